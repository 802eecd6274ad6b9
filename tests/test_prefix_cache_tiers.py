"""The prefix-cache tiers as units: the admission transaction against a recording fake tier,
the Store tier's dedup and belief rules against a fake client, one set of reusability rules
for planner, local match and Store probe, and the ledger gauges on /metrics.

Geometry: B = 16 tokens per block, A = 64.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.metrics import LEDGER_SERIES, ServerMetrics
from lmdeploy.pytorch.config import SchedulerConfig
from lmdeploy.pytorch.paging.sequence import SeqStatus, Sequence
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.prefill_plan import ReuseRules, is_reusable, last_reusable, plan_prefill
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
from lmdeploy.pytorch.prefix_cache.plans import PrefixMatch, StoreLoad, StorePut
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache
from lmdeploy.pytorch.prefix_cache.store_tier import StoreTier
from lmdeploy.pytorch.store.mooncake_client import FakeStoreClient
from lmdeploy.pytorch.store.object_format import encode_object, object_key

B, A = 16, 64
GEN = GenerationConfig(max_new_tokens=2, ignore_eos=True)


# ---------------------------------------------------------------- admission with a fake tier
class RecordingTier:
    """A stand-in for PrefixCache that offers a fixed match and records every call in order."""
    decode_save_last = False
    caches_prefixes = True

    def __init__(self, block_manager: BlockManager, match: PrefixMatch, evictable: int = 0):
        self.bm, self._match, self.evictable, self.calls = block_manager, match, evictable, []

    def match(self, seq):
        self.calls.append('match')
        return self._match

    def pin(self, match):
        self.calls.append('pin')
        for node in match.nodes[:match.num_shared_blocks]:
            self.bm.incref(node.block_id)

    def unpin(self, match):
        self.calls.append('unpin')
        for node in match.nodes[:match.num_shared_blocks]:
            self.bm.decref(node.block_id)

    @property
    def num_evictable_blocks(self):
        self.calls.append('count')
        return self.evictable

    def evict(self, n):
        self.calls.append(f'evict {n}')
        freed = min(n, self.evictable)
        self.evictable -= freed
        self.bm.free_all(self._held[:freed])
        del self._held[:freed]
        return freed

    def plan_load(self, seq, match, loads):
        self.calls.append(f'load {match.source} {match.cached_tokens}')

    def release(self, seq, cache_blocks):
        self.calls.append('release')

    def forget(self, seq):
        self.calls.append('forget')

    def requeued(self, seq):
        self.calls.append('requeued')


class _Node:
    def __init__(self, block_id):
        self.block_id = block_id


def _scheduler(num_blocks: int, match: PrefixMatch, evictable: int = 0):
    cfg = PytorchEngineConfig(block_size=B, prefill_save_alignment=A, max_prefill_token_num=64,
                              enable_prefix_caching=True)
    bm = BlockManager(num_blocks)
    tier = RecordingTier(bm, match, evictable)
    tier._held = bm.allocate(evictable)          # blocks the fake "cache" could free
    return Scheduler(SchedulerConfig.from_engine_config(cfg), bm, StateCache(2, 0), tier), bm, tier


def test_a_failed_admission_only_matches_pins_and_unpins():
    """Nothing is evicted, allocated or loaded for an admission that cannot get its first chunk."""
    store_hit = PrefixMatch([], 128, 'store', None, 0, 0)
    sched, bm, tier = _scheduler(num_blocks=10, match=store_hit, evictable=2)
    bm.allocate(4)                                       # 4 free + 2 evictable < 12 blocks for 192 tokens
    seq = Sequence(prompt(300, 1), GEN)
    sched.add(seq)
    for _ in range(3):
        out = sched.schedule()
        assert out.chunks == [] and not out.loads
    assert tier.calls == ['match', 'pin', 'count', 'unpin'] * 3
    assert bm.num_free == 4 and seq.status is SeqStatus.WAITING and seq.block_ids == []


def test_a_committed_admission_evicts_explicitly_then_plans_its_load():
    sched, bm, tier = _scheduler(num_blocks=14, match=PrefixMatch([], 128, 'store', None, 0, 0), evictable=4)
    bm.allocate(2)                                       # 8 free + 4 evictable >= 12 blocks for 192 tokens
    seq = Sequence(prompt(300, 2), GEN)
    sched.add(seq)
    out = sched.schedule()
    [chunk] = out.chunks
    assert (chunk.start, chunk.end) == (128, 192)
    assert tier.calls == ['match', 'pin', 'count', 'evict 4', 'load store 128']
    assert len(seq.block_ids) == 12 and bm.num_free == 0


# ---------------------------------------------------------------- Store tier with a fake client
class _Slots:
    """A cache engine stand-in: blocks and slots hold recognisable byte payloads."""
    state_bytes, kv_block_bytes = 8, 4

    def __init__(self):
        self.kv, self.state = {}, {}

    def read_kv_blocks(self, ids):
        return torch.stack([torch.full((4,), b, dtype=torch.uint8) for b in ids])

    def read_state(self, slot):
        return torch.full((8,), 100 + slot, dtype=torch.uint8)

    def write_kv_block(self, block, payload):
        self.kv[block] = bytes(payload.numpy())

    def write_state(self, slot, payload):
        self.state[slot] = bytes(payload.numpy())


NS = b'\x01' * 16


def _tier(client=None):
    client = client or FakeStoreClient()
    return StoreTier(client, _Slots(), NS, B), client


def _put(tier, ids, boundary, blocks, slot=0):
    hashes = chain_block_hashes(ids, B, boundary // B)
    tier.submit(StorePut(hashes, blocks[:boundary // B], boundary, slot))
    assert tier.flush(timeout=10)
    return hashes


def test_blocks_another_engine_stored_are_neither_put_nor_counted():
    ids = prompt(200, 3)
    first, client = _tier()
    _put(first, ids, 128, list(range(8)))
    assert first.stats()['store_put_objects'] == {'state': 1, 'kv': 8}
    second, _ = _tier(client)                            # a fresh engine on the same Store
    _put(second, ids, 192, list(range(12)))
    stats = second.stats()
    assert stats['store_put_objects'] == {'state': 1, 'kv': 4}          # only blocks 8..11 are new
    assert stats['store_put_bytes'] == {'state': 8, 'kv': 4 * 4}
    assert stats['store_existing_objects'] == 8
    first.close(), second.close()


def test_a_state_is_put_only_above_a_complete_prefix_and_a_gap_forgets_every_belief():
    ids = prompt(200, 4)
    tier, client = _tier()
    hashes = _put(tier, ids, 64, list(range(4)))
    lost = object_key(NS.hex(), 'kv', hashes[1].hex())
    del client.objects[lost]                             # e.g. a restarted master lost it
    _put(tier, ids, 128, list(range(8)))                 # block 1 is believed stored: not copied
    state_128 = object_key(NS.hex(), 'state', chain_block_hashes(ids, B, 8)[-1].hex())
    assert state_128 not in client.objects               # never a state above a hole
    _put(tier, ids, 128, list(range(8)))                 # the next save of the prefix repairs it
    assert lost in client.objects and state_128 in client.objects
    tier.close()


def test_a_failed_put_forgets_beliefs_so_the_next_save_puts_again():
    ids = prompt(200, 5)
    tier, client = _tier()
    _put(tier, ids, 64, list(range(4)))
    client.objects.clear()                               # the whole Store is gone
    client.fail_puts = 1
    _put(tier, ids, 128, list(range(8)))                 # first put fails: beliefs are dropped
    _put(tier, ids, 128, list(range(8)))
    hashes = chain_block_hashes(ids, B, 8)
    assert all(object_key(NS.hex(), 'kv', h.hex()) in client.objects for h in hashes)
    tier.close()


def test_probe_answers_from_existence_only_and_load_verifies():
    ids = prompt(200, 6)
    tier, client = _tier()
    hashes = _put(tier, ids, 128, list(range(8)))
    rules = ReuseRules(200, B, A)
    gets = len(client.put_keys), client.stats.gets
    assert tier.probe(chain_block_hashes(ids, B), rules) == [128]
    assert client.stats.gets == gets[1]                  # no object was read
    assert tier.probe(chain_block_hashes(ids, B), rules, below=128) == []
    key = object_key(NS.hex(), 'kv', hashes[3].hex())
    client.objects[key] = encode_object('kv', NS, 4 * B, b'\xff' * 4, key=key)[:-1] + b'\x00'   # corrupt payload
    assert not tier.load(StoreLoad(None, 128, hashes, list(range(8)), 0, 1))
    assert tier.stats()['store_rejected_objects'] == 1
    tier.close()


# ---------------------------------------------------------------- one set of reusability rules
spans = st.lists(st.tuples(st.integers(0, 600), st.integers(1, 200)).map(lambda t: (t[0], t[0] + t[1])),
                 max_size=2)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 700), lookahead=st.integers(0, 2), recompute=st.integers(0, 2), spans=spans,
       matched=st.integers(0, 50), above=st.integers(0, 300))
def test_planner_local_match_and_store_probe_share_one_rule_set(n, lookahead, recompute, spans, matched, above):
    rules = ReuseRules(n, B, A, lookahead, recompute, tuple(spans))
    assert rules.last_reusable() == last_reusable(n, B, A, lookahead, recompute, spans)
    for last_only in (False, True):
        assert rules.plan(0, 128, last_only) == plan_prefill(n, 0, 128, B, A, last_only, lookahead, recompute, spans)
    expected = [b for b in range(n, above, -1)
                if is_reusable(b, n, B, A, lookahead, recompute, spans) and b // B + recompute <= matched]
    assert rules.restore_candidates(above, matched) == expected
    assert all(rules.restorable(b, matched) for b in expected)


# ---------------------------------------------------------------- ledger gauges
def test_metrics_export_the_ledger_as_gauges(tiny_qwen3_next):
    from lmdeploy.pytorch.engine.engine import Engine
    from prometheus_client import generate_latest
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', block_size=B,
                                                      prefill_save_alignment=A, enable_prefix_caching=True,
                                                      num_gpu_blocks=64))
    seq = eng.add_request(prompt(100, 7), GenerationConfig(max_new_tokens=3, ignore_eos=True))
    eng.add_request(prompt(50, 8), GenerationConfig(max_new_tokens=3, ignore_eos=True))
    eng.step()
    text = generate_latest(ServerMetrics(eng.stats, eng.ledger).registry).decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith('lmdeploy_')}
    led = eng.ledger()
    assert {f'lmdeploy_{name}' for name, _, _ in LEDGER_SERIES} <= set(values)
    # first forward: 64 tokens of the first prompt (its chunk ends at the save point) + 50 of the
    # second = 4 + 4 blocks, 4 + 3 of them full and cached
    assert (led['blocks_in_use'], led['blocks_cached'], led['blocks_free']) == (1, 7, 56)
    assert values['lmdeploy_kv_blocks_in_use'] == 1 and values['lmdeploy_kv_blocks_cached'] == 7
    assert values['lmdeploy_kv_blocks_free'] == 56
    assert values['lmdeploy_state_slots_in_use'] == 2 and values['lmdeploy_scheduler_requests_running'] == 2
    while not seq.is_finished or eng.has_work:
        eng.step()
    text = generate_latest(ServerMetrics(eng.stats, eng.ledger).registry).decode()
    assert 'lmdeploy_kv_blocks_in_use 0.0' in text and 'lmdeploy_scheduler_requests_waiting 0.0' in text


# ---------------------------------------------------------------- one interface for every tier
def test_host_store_and_null_tiers_answer_the_same_questions():
    """Host, Store and null tiers implement ``PrefixTier``: a prefix saved through ``save`` is
    found by ``depth`` (above / below bounds respected), a tier not configured holds nothing, and
    the host tier's ``evict`` frees exact bytes, least recently used first."""
    from lmdeploy.pytorch.prefix_cache.host_tier import HostTier
    from lmdeploy.pytorch.prefix_cache.tier import NullTier, PrefixTier
    ids = prompt(200, seed=3)
    hashes, rules = chain_block_hashes(ids, B), ReuseRules(200, B, A)
    store, _ = _tier()
    host = HostTier(None, capacity_bytes=1000, block_size=B, state_bytes=10, kv_block_bytes=1)
    null = NullTier('store')
    try:
        for tier in (host, store, null):
            assert isinstance(tier, PrefixTier)
            assert tier.depth(hashes, rules) == 0
            tier.save(StorePut(hashes[:8], list(range(8)), 128, 0))
            tier.save(StorePut(hashes[:4], list(range(4)), 64, 0))
            assert store.flush(timeout=10)
            want = (128, 64, 0) if tier is not null else (0, 0, 0)
            assert (tier.depth(hashes, rules), tier.depth(hashes, rules, below=128),
                    tier.depth(hashes, rules, above=128)) == want, tier.name
        assert host.bytes_held == 2 * 10 + 8 and store.bytes_held == null.bytes_held == 0
        # LRU order now: kv 4..7, state@128, kv 0..3 (made recent by the save at 64), state@64
        assert host.evict(11) == 4 + 10 and host.bytes_held == 10 + 4
        assert host.depth(hashes, rules) == 64 and host.counters['host_evictions'] == 5
    finally:
        store.close()


def test_the_local_tier_answers_depth_like_the_others_without_touching_anything():
    """``LocalTier.depth``: the deepest boundary whose blocks are cached and whose node holds a
    checkpoint (above / below bounds as the host and Store tiers), by hashes alone; LRU clocks,
    reach counts and pins stay as they were. A full-attention tier answers at any block boundary
    short of the last token."""
    from lmdeploy.pytorch.paging.block_manager import BlockManager
    from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
    from lmdeploy.pytorch.prefix_cache.state_cache import StateCache
    ids = prompt(200, seed=3)
    hashes, rules = chain_block_hashes(ids, B), ReuseRules(200, B, A)
    bm = BlockManager(32)
    local = LocalTier(bm, B, StateCache(1, 4))
    assert local.depth(hashes, rules) == 0
    blocks = bm.allocate(10)
    nodes = local.trie.insert(ids, blocks, 10, hashes)
    assert local.depth(hashes, rules) == 0                  # blocks but no checkpoint
    for depth in (4, 8):
        slot = local.alloc_checkpoint()
        assert local.publish_checkpoint(slot, nodes[depth - 1], local.checkpoint_stats(nodes[depth - 1], depth * B,
                                                                                       'prefill'))
    clocks = [n.last_access for n in nodes]
    assert (local.depth(hashes, rules), local.depth(hashes, rules, below=128),
            local.depth(hashes, rules, above=128), local.depth(hashes[:7], rules)) == (128, 64, 0, 64)
    assert [n.last_access for n in nodes] == clocks and local.pins.num_held == 0
    attention_only = LocalTier(bm, B, None)
    attention_only.trie.insert(ids, blocks, 10, hashes)
    assert (attention_only.depth(hashes, rules), attention_only.depth(hashes, rules, below=100),
            attention_only.depth(hashes, ReuseRules(160, B, A)), attention_only.depth(hashes, rules, above=160)) == \
        (160, 96, 144, 0)


def test_the_coordinator_asks_tiers_and_never_reaches_inside_one():
    """``PrefixCache`` calls tier methods only: no attribute path into the local tier's state
    cache, pins or trie, nor into another tier's counters."""
    import pathlib
    import re
    import lmdeploy.pytorch.prefix_cache.coordinator as coordinator
    source = pathlib.Path(coordinator.__file__).read_text()
    reaches = re.findall(r'(?:self\.)?(?:local|host|store)\.(?:state_cache|pins|trie|counters|_\w+)\b', source)
    assert not reaches, reaches


def test_an_attention_only_local_tier_has_a_state_cache_with_no_slots():
    """A model without recurrent state gets a state cache of zero slots: the tier's checkpoint
    questions answer 'none' on the same code path (no slot to allocate, nothing evictable beyond
    blocks, nothing evicted), and a host tier given to it never receives a demotion."""
    from lmdeploy.pytorch.prefix_cache.coordinator import PrefixCache
    from lmdeploy.pytorch.prefix_cache.host_tier import HostTier
    from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
    bm = BlockManager(8)
    local = LocalTier(bm, B, None)
    assert not local.is_hybrid and local.state_cache.num_slots == 0
    assert local.alloc_checkpoint() is None and local.num_evictable_blocks == 0
    assert local.num_evictions == {'checkpoint': 0, 'kv': 0} and not local.dead_first
    host = HostTier(None, 1 << 20, B, 10, 1)
    cache = PrefixCache(local, None, block_size=B, alignment=A, decode_save_last=True, host=host)
    assert cache.host is host and cache.decode_save_last is False
    seq = Sequence(prompt(3 * B + 1, seed=5), GEN)
    seq.block_ids = bm.allocate(4)
    seq.num_computed_tokens = 3 * B
    cache.release(seq, cache_blocks=True)
    bm.free_all(seq.block_ids)            # (what the scheduler does next: the trie keeps its own refs)
    assert cache.num_cached_blocks == 3 and cache.num_evictable_blocks == 3
    assert cache.evict(3) == 3 and host.counters['host_demotions'] == 0
