"""One memory budget and eviction that predicts reuse.

- checkpoints in KV block rows: the cache engine moves a state row into and out of its block rows
  byte for byte; the state cache takes and returns exactly ``rows_per_checkpoint`` rows;
- the local tier evicts dead blocks (no checkpoint at or below them) first, then the policy's
  checkpoint, then the blocks only it made usable — exact block ids;
- the policies: LRU takes the oldest, the reuse-aware one keeps what was reached or hit, the
  offline optimum what is used next;
- engines on a tiny budget give the outputs of caching off under both policies, and the ledger
  returns to idle.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_engine import CacheEngine, rows_per_state
from lmdeploy.pytorch.cache_specs import FullAttentionSpec, LinearAttentionSpec
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.prefix_cache.eviction import (CheckpointStats, LRUPolicy, OfflineOptimalPolicy,
                                                    ReuseAwarePolicy, make_policy)
from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache

from engine_utils import assert_idle, make_engine, random_prompt

B = 4


# ------------------------------------------------------------------ cache engine
def _specs():
    attn = FullAttentionSpec(1, 3, torch.float32)
    lin = LinearAttentionSpec((5, 3), torch.float32, (2, 7, 3))
    return [lin, attn, lin]


def test_state_rows_round_trip_through_block_rows_byte_for_byte():
    specs = _specs()
    eng = CacheEngine(specs, B, num_blocks=40, num_slots=3)
    m = rows_per_state(eng.state_buf.shape[1], eng.kv_buf.shape[1])
    assert m == -(-eng.state_buf.shape[1] // eng.kv_buf.shape[1]) and m > 1
    gen = torch.Generator().manual_seed(0)
    eng.state_buf.copy_(torch.randint(0, 256, eng.state_buf.shape, generator=gen, dtype=torch.uint8))
    rows_a, rows_b = tuple(range(30, 30 - m, -1)), tuple(range(2, 2 + m))     # any rows, any order
    before = eng.state_buf.clone()
    eng.copy_states([0, 2], [rows_a, rows_b])
    assert torch.equal(eng.read_state(rows_a), before[0, :eng.state_bytes])
    eng.state_buf.zero_()
    eng.copy_states([rows_b, rows_a], [1, 0])
    assert torch.equal(eng.state_buf[1], before[2]) and torch.equal(eng.state_buf[0], before[0])
    with pytest.raises(ValueError, match='block rows'):
        eng.copy_states([rows_a], [rows_b])


# ------------------------------------------------------------------ state cache in block rows
def test_block_row_checkpoints_take_and_return_exact_rows():
    bm = BlockManager(10)
    sc = StateCache(2, 2, block_manager=bm, rows_per_checkpoint=3)
    a, b = sc.alloc_checkpoint(), sc.alloc_checkpoint()
    assert (a, b) == (2, 3) and sc.locate(a) == (0, 1, 2) and sc.locate(b) == (3, 4, 5)
    assert bm.num_free == 4 and sc.num_checkpoint_rows == 6
    assert sc.alloc_checkpoint() is None           # the count limit (2), though 4 rows are free
    sc.release_checkpoint(a)
    assert bm.num_free == 7 and sc.locate(a) == a
    assert sc.alloc_checkpoint() == a              # ids are recycled, rows come from the pool
    assert sc.num_free_checkpoints == 0


class _Seq:
    def __init__(self, tokens, blocks):
        self.token_ids, self.block_ids, self.seq_id = tokens, blocks, id(self)
        self.state_slot = 0


def _tier(num_rows: int, policy: str, rows_per_ckpt: int = 2):
    bm = BlockManager(num_rows)
    sc = StateCache(1, None, block_manager=bm, rows_per_checkpoint=rows_per_ckpt, policy=make_policy(policy))
    return bm, sc, LocalTier(bm, B, sc, state_bytes=2, block_bytes=1)


def _cache_path(bm, tier, tokens, ckpt_depths, reason='prefill'):
    """Insert a released sequence's blocks and publish checkpoints at ``ckpt_depths``."""
    from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
    blocks = bm.allocate(len(tokens) // B)
    seq = _Seq(tokens, blocks)
    hashes = chain_block_hashes(tokens, B)
    nodes = tier.trie.insert(tokens, blocks, len(blocks), hashes)
    bm.free_all(blocks)          # the sequence leaves; the trie keeps them
    for d in ckpt_depths:
        slot = tier.alloc_checkpoint()
        tier.state_cache.publish(slot, nodes[d - 1], tier.checkpoint_stats(nodes[d - 1], d * B, reason))
    return nodes


def test_dead_blocks_go_first_then_the_policy_checkpoint_with_the_blocks_it_alone_made_usable():
    bm, sc, tier = _tier(20, 'reuse')
    a = _cache_path(bm, tier, list(range(16)), [2])            # 4 blocks, a checkpoint at depth 2
    b = _cache_path(bm, tier, list(range(100, 112)), [])       # 3 dead blocks
    assert bm.num_free == 20 - 7 - 2
    assert [n.ckpts_below for n in a] == [1, 1, 0, 0]
    freed = tier.evict(5)
    # every dead block went (b's 3, a's tail 2), the checkpoint and a's head stayed
    assert freed == 5 and all(n.parent is None for n in b) and [n.parent is None for n in a] == [False, False,
                                                                                                   True, True]
    assert a[1].checkpoint_slot is not None
    freed = tier.evict(3)
    # then the checkpoint (2 rows) and the first block it alone made usable
    assert freed == 3 and a[1].checkpoint_slot is None and sc.num_published == 0
    assert tier.num_evictions == {'checkpoint': 1, 'kv': 6}


def test_a_checkpoint_with_a_deeper_one_below_weighs_only_its_state_and_its_age_is_kept():
    """Regression: a checkpoint's bytes held were fixed at its publish, so an interior chunk-end
    checkpoint kept weighing the blocks a deeper checkpoint of the same path later made usable
    too, though evicting it frees only its state. Now the nearest checkpoint above a publish or an
    eviction is reweighed (bytes: the state, 2, plus 1 per block only it makes usable) and filed
    as covered (its reuse is learned apart from its request's last checkpoint's), and its score
    keeps the age of its last use."""
    bm, sc, tier = _tier(40, 'reuse')
    tokens = list(range(8 * B))
    nodes = _cache_path(bm, tier, tokens, [2])
    shallow = sc.stats[nodes[1].checkpoint_slot]
    assert shallow.nbytes == 2 + 2
    aged, last_use = shallow.aged, shallow.last_use
    sc.policy.inflation = 100.0         # time passed: a rescore would take this age
    slot = tier.alloc_checkpoint()
    assert tier.publish_checkpoint(slot, nodes[5], tier.checkpoint_stats(nodes[5], 6 * B, 'prefill_last'))
    deep = sc.stats[slot]
    assert (shallow.nbytes, deep.nbytes, deep.tokens_saved) == (2, 2 + 4, 4 * B)
    assert (shallow.covered, deep.covered) == (True, False)
    assert shallow.cls == ('prefill', False, 0, True, (2 * B).bit_length())     # reuse learned apart
    assert (shallow.aged, shallow.last_use) == (aged, last_use)
    assert shallow.score == aged + sc.policy.value(shallow)
    assert sc.policy.select(sc.stats, sc.is_pinned, 0) is (min(sc.stats.values(), key=lambda s: s.score))
    sc.release_checkpoint(slot, evicted=True)       # as the tier's eviction does, then reweighs
    tier._reweigh_above(nodes[5])
    assert (shallow.nbytes, shallow.covered) == (2 + 2, False)
    assert shallow.cls[3] is True         # still learned as a covered one


@pytest.mark.parametrize('seed', range(4))
def test_exclusive_blocks_equal_their_definition_on_random_tries(seed):
    """Property: on a random trie with random checkpoints, the blocks a checkpoint (published or
    about to be) alone makes usable, which both a publish's weight and a reweigh read, are the
    nodes of its path, itself included, whose subtree holds no other published checkpoint."""
    rng = random.Random(seed)
    bm, sc, tier = _tier(400, 'reuse', rows_per_ckpt=1)
    nodes = []
    for _ in range(12):
        head = rng.randint(0, 3) * 100                  # paths sharing a prefix of 1-3 blocks
        tokens = list(range(head, head + rng.randint(1, 3) * B)) + [1000 + rng.randrange(10 ** 6)
                                                                    for _ in range(rng.randint(1, 4) * B)]
        path = _cache_path(bm, tier, tokens, [])
        for d in rng.sample(range(1, len(path) + 1), rng.randint(0, 2)):
            if path[d - 1].checkpoint_slot is None:
                slot = tier.alloc_checkpoint()
                sc.publish(slot, path[d - 1], tier.checkpoint_stats(path[d - 1], d * B, 'prefill'))
        nodes += [n for n in path if n not in nodes]
    published = [n for n in nodes if n.checkpoint_slot is not None]
    assert published and len(published) < len(nodes)

    def others_below(m, node):
        stack, count = [m], 0
        while stack:
            k = stack.pop()
            count += k.checkpoint_slot is not None and k is not node
            stack.extend(k.children.values())
        return count

    for node in nodes:
        path, m = [], node
        while m.parent is not None:
            path.append(m)
            m = m.parent
        expected = next((i for i, m in enumerate(path) if others_below(m, node)), len(path))
        own = int(node.checkpoint_slot is not None)
        assert tier._exclusive_blocks(node, own) == expected
        if not own:
            assert tier.checkpoint_stats(node, node.depth * B, 'prefill').nbytes == 2 + expected


def test_lru_policy_evicts_blocks_least_recently_used_first_as_before():
    bm, sc, tier = _tier(20, 'lru')
    a = _cache_path(bm, tier, list(range(16)), [2])
    b = _cache_path(bm, tier, list(range(100, 112)), [])
    tier.evict(2)
    assert [n.parent is None for n in a] == [False, False, True, True] and all(n.parent is not None for n in b)


def _publish(pol, stats, clock):
    pol.published(stats)
    pol.rescore(stats, clock)


def _hit(pol, stats, clock):
    stats.hits += 1
    pol.hit(stats)
    pol.rescore(stats, clock)


def test_reuse_policy_keeps_a_reached_shared_head_over_newer_cold_checkpoints():
    pol = ReuseAwarePolicy()
    head = CheckpointStats(1, 1024, 1024, 10, 'shared_head')
    cold = [CheckpointStats(i, 1024, 1024, 10, 'prefill_last') for i in range(2, 6)]
    _publish(pol, head, 1)
    for i, s in enumerate(cold):
        _publish(pol, s, 2 + i)
    # each unused publish lowers the class's measured rate: the last one scored lowest
    assert pol.victim(cold + [head], 10) is cold[-1] and cold[-1].score < cold[0].score < head.score
    lru, copies = LRUPolicy(), [dataclasses.replace(s) for s in [head] + cold]
    for i, s in enumerate(copies):
        lru.rescore(s, i + 1)
    assert lru.victim(copies, 10) is copies[0]
    # a used checkpoint goes after every never-used one
    _hit(pol, cold[-1], 11)
    assert pol.victim(cold, 12) is cold[-2]


def test_a_stream_of_one_off_checkpoints_does_not_flush_a_proven_one():
    """Regression: a used checkpoint's evidence was its class's first-use rate plus its hits (here
    about 2 after one hit) whatever the traffic said about used checkpoints coming back. Now the
    chance of one more hit is learned per class and hit count, and the evidence is the expected
    number of further hits p / (1 - p): 20 checkpoints each hit 4 times make it 11.7 after one hit.
    Such a checkpoint then outlives a long stream of never-used one-offs."""
    pol = ReuseAwarePolicy()
    for i in range(20):     # used checkpoints of this class come back: each hit 4 times
        s = CheckpointStats(1000 + i, 1024, 1024, 10, 'prefill_last', key=1000 + i)
        _publish(pol, s, 1)
        for _ in range(4):
            _hit(pol, s, 1)
        pol.released(s, False)
    assert pol.p_again(('prefill_last', False, 0, False), 1) == (20 + 4 * 0.5) / (20 + 4)
    live = {}
    hot = CheckpointStats(0, 1024, 1024, 10, 'prefill_last', key='hot')
    _publish(pol, hot, 2)
    live[0] = hot
    _hit(pol, hot, 3)
    coarse = (20 + 4 * 0.5) / (21 + 4)       # (the hot one reached one hit too)
    p = (20 + 16 * coarse) / (21 + 16)      # its length class, smoothed towards its coarse class
    assert hot.cls == ('prefill_last', False, 0, False, 11)
    assert pol.evidence(hot) == p / (1 - p) and pol.evidence(hot) > 3 * (1 + pol.reuse_rate(hot.cls))
    for i in range(1, 300):         # a cache of 4 checkpoints, a new one-off prefix per request
        s = CheckpointStats(i, 1024, 1024, 10, 'prefill', key=i)
        _publish(pol, s, 3 + i)
        live[i] = s
        while len(live) > 4:
            v = pol.select(live, lambda slot: False, 0)
            del live[v.slot]
            pol.released(v, True)
        assert 0 in live, i


def test_reuse_is_learned_per_prefix_length_backed_off_to_the_save_reason():
    """Interior checkpoints of one save reason are reused at rates that differ with the length of
    the prefix: the policy learns each length class (a doubling of tokens) apart, smoothed towards
    the reason's rate, which a length it has not seen yet gets."""
    pol = ReuseAwarePolicy()
    for i in range(40):
        short = CheckpointStats(i, 8192, 8192, 10, 'prefill')          # never reused
        long_ = CheckpointStats(100 + i, 32768, 8192, 10, 'prefill')   # every other one reused
        for s in (short, long_):
            _publish(pol, s, 1)
        if i % 2:
            _hit(pol, long_, 2)
    coarse = (20 + 4 * 0.2) / (80 + 4)
    assert pol.p_again(('prefill', False, 0, False), 0) == coarse
    assert pol.p_again(('prefill', False, 0, False, 14), 0) == (0 + 16 * coarse) / (40 + 16)
    assert pol.p_again(('prefill', False, 0, False, 16), 0) == (20 + 16 * coarse) / (40 + 16)
    assert pol.p_again(('prefill', False, 0, False, 18), 0) == coarse        # a length not seen yet
    fresh = [CheckpointStats(200 + i, b, 8192, 10, 'prefill') for i, b in enumerate((8192, 32768))]
    for s in fresh:
        _publish(pol, s, 3)
    assert pol.victim(fresh, 4) is fresh[0]


@pytest.mark.parametrize('name', ['lru', 'reuse', 'optimal'])
def test_heap_selection_equals_a_scan_over_random_operations(name):
    """Property: whatever the sequence of publishes, hits, touches, reweighs, pins and releases, the
    O(log N) heap picks exactly the checkpoint a scan of the unpinned ones picks."""
    rng = random.Random(7)
    uses = {}
    pol = OfflineOptimalPolicy(lambda key, clock: uses[key]) if name == 'optimal' else make_policy(name)
    live, pins, clock = {}, set(), 0
    reasons = ['prefill', 'prefill_last', 'shared_head', 'restored']
    for step in range(1500):
        clock += 1
        op = rng.random()
        if op < 0.35 or not live:
            slot = step
            s = CheckpointStats(slot, rng.randint(1, 64) * 64, rng.randint(1, 8) * 64, rng.randint(1, 20),
                                rng.choice(reasons),
                                rng.random() < 0.5, reached=rng.randint(0, 3), key=slot)
            uses[slot] = rng.choice([rng.randint(1, 50), float('inf')])
            live[slot] = s
            pol.published(s)
            pol.rescore(s, clock)
        elif op < 0.6:
            s = live[rng.choice(list(live))]
            if rng.random() < 0.5:
                s.hits += 1
                pol.hit(s)
            else:
                s.reached += 1
            pol.rescore(s, clock)
        elif op < 0.65:         # another checkpoint now shares (or stopped sharing) its blocks
            pol.reweigh(live[rng.choice(list(live))], rng.randint(1, 20), rng.random() < 0.5)
        elif op < 0.7:
            slot = rng.choice(list(live))
            pins.symmetric_difference_update({slot})
        elif op < 0.75:         # a release that is not an eviction
            slot = rng.choice(list(live))
            pins.discard(slot)
            pol.released(live.pop(slot), False)
        else:
            want = pol.victim([s for slot, s in live.items() if slot not in pins], clock)
            got = pol.select(live, pins.__contains__, clock)
            assert got is want, step
            if got is not None:
                del live[got.slot]
                pol.released(got, True)


def test_offline_optimum_evicts_the_checkpoint_used_farthest_in_the_future():
    uses = {'a': 5, 'b': 50, 'c': float('inf')}
    pol = OfflineOptimalPolicy(lambda key, clock: uses[key])
    stats = [CheckpointStats(i, 64, 64, 1, key=k) for i, k in enumerate('abc')]
    assert pol.victim(stats, 0).key == 'c'
    assert pol.victim(stats[:2], 0).key == 'b'


def test_make_policy_names_the_field():
    with pytest.raises(ValueError, match='cache_eviction'):
        make_policy('fifo')


# ------------------------------------------------------------------ engines on a tiny budget
@pytest.mark.parametrize('eviction,host', [('reuse', False), ('lru', False), ('reuse', True)])
def test_tiny_budget_outputs_equal_cache_off_and_ledger_idle(tiny_qwen3_next, eviction, host):
    """Random conversations (shared heads, continuations, branches) on a budget of a few prompts:
    checkpoints and blocks are evicted, greedy outputs equal caching off, the ledger idles. With a
    host tier, evicted checkpoints are promoted back from host memory (host hits > 0), and the
    outputs are still those of caching off."""
    rng = random.Random(7)
    gen = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    head = random_prompt(40, seed=1)
    prompts, convs = [], []
    for i in range(8):
        if convs and rng.random() < 0.5:
            ids = rng.choice(convs) + random_prompt(rng.randrange(5, 30), seed=100 + i)
        else:
            ids = head[:rng.randrange(8, 40)] + random_prompt(rng.randrange(10, 50), seed=200 + i)
        convs.append(ids)
        prompts.append(ids)
    prompts += prompts[:3]          # long-gone prefixes again: evicted from the device by now
    off = make_engine(tiny_qwen3_next, block_size=8, max_prefill_token_num=32)
    expected = [off.generate(p, gen).output_ids for p in prompts]
    row, state = CacheEngine.bytes_per_block(off.specs, 8), CacheEngine.bytes_per_slot(off.specs)
    budget = 2 * state + 40 * row       # 2 runtime slots + 40 rows for blocks and checkpoints
    eng = make_engine(tiny_qwen3_next, block_size=8, max_prefill_token_num=32, enable_prefix_caching=True,
                      prefill_save_alignment=16, num_gpu_blocks=0, cache_bytes=budget, cache_eviction=eviction,
                      max_batch_size=2, host_cache_bytes=(1 << 24) if host else 0)
    assert eng.state_cache.uses_block_rows and eng.block_manager.num_blocks == 40
    got = [eng.generate(p, gen).output_ids for p in prompts]
    assert got == expected
    stats = eng.stats()
    assert stats['prefix_cache_evictions']['kv'] > 0 and stats['prefix_cache_hit_tokens'] > 0
    if host:
        assert stats['host_demotions'] > 0 and stats['host_promotions'] > 0 and stats['host_hit_tokens'] > 0
    else:
        assert stats['host_demotions'] == 0
    led = eng.ledger()
    assert led['blocks_in_use'] == 0 and led['checkpoint_rows'] == led['checkpoints_published'] * \
        eng.state_cache.rows_per_checkpoint
    assert eng.is_idle()


def test_host_tier_probe_and_load_need_the_state_and_every_block_not_shared():
    from lmdeploy.pytorch.paging.prefill_plan import ReuseRules
    from lmdeploy.pytorch.prefix_cache.host_tier import HostTier
    from lmdeploy.pytorch.prefix_cache.plans import StoreLoad

    class Node:
        def __init__(self, parent, key, block_id):
            self.parent, self.key, self.block_id = parent, key, block_id

    root = Node(None, b'r', -1)
    path = [root]
    for i in range(4):
        path.append(Node(path[-1], bytes([i]), 10 + i))
    host = HostTier(None, capacity_bytes=100, block_size=B, state_bytes=10, kv_block_bytes=1)
    host.demote(path[2], 7)                  # a checkpoint at 2 blocks: state + blocks 0, 1
    hashes = [n.key for n in path[1:]]
    rules = ReuseRules(17, B, B)
    assert host.probe(hashes, rules, 0) == 2 * B
    assert host.probe(hashes, rules, 0, above=2 * B) == 0
    host.demote(path[4], 9)                  # adds blocks 2, 3 and the state at 4 blocks
    assert host.probe(hashes, rules, 0) == 4 * B and host.bytes_held == 2 * 10 + 4
    load = StoreLoad(None, 4 * B, hashes, [0] * 4, 1, 0)
    assert host.load(load) and host.counters['host_promotions'] == 1
    small = HostTier(None, capacity_bytes=12, block_size=B, state_bytes=10, kv_block_bytes=1)
    small.demote(path[2], 7)
    small.demote(path[4], 9)                 # LRU out: the older state and blocks
    assert small.bytes_held <= 12 and small.probe(hashes, rules, 0) == 0
