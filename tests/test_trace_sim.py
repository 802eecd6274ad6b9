"""The cache-only trace simulator (benchmark/trace_sim.py) drives the engine's scheduler and prefix
cache: exact hits of a hand-made conversation with an unlimited cache, the host tier restoring
what a small device evicts, and every eviction choice (legacy split, LRU, reuse, Belady) never
beating the unlimited cache."""
from __future__ import annotations

from types import SimpleNamespace

from benchmark.trace_sim import simulate_trace

# scale 16: a hash id is 32 tokens; B = 16, A = 32, P = 64, last-only
GEOMETRY = dict(state_bytes=64, kv_block_bytes=16, save_policy='last_only', block_size=16, alignment=32, chunk=64,
                concurrency=1, scale=16)


def _conversation():
    row = lambda ids: SimpleNamespace(input_length=512 * len(ids), output_length=16, hash_ids=list(ids))
    # a 96-token turn, its two continuations (160, 192 tokens), and an unrelated 32-token request
    return [row([0, 1, 2]), row([0, 1, 2, 3, 4]), row([0, 1, 2, 3, 4, 5]), row([9])]


def test_unlimited_cache_hits_each_turns_last_aligned_checkpoint():
    ideal = simulate_trace(_conversation(), **GEOMETRY)
    # last-only checkpoints at 64 (of 96), 128 (of 160), 160 (of 192); 32 tokens leave none
    assert ideal.per_request_hit_tokens == [0, 64, 128, 0]
    assert ideal.hit_tokens == 192 and ideal.prompt_tokens == 480
    assert ideal.checkpoints_saved == {'prefill_last': 3} and ideal.evictions == {'checkpoint': 0, 'kv': 0}
    assert ideal.rows_per_checkpoint == 4


def test_a_small_device_loses_hits_the_host_tier_restores_and_no_eviction_beats_the_ideal():
    rows = _conversation()
    ideal = simulate_trace(rows, **GEOMETRY)
    budget = 16 * 16          # 16 rows: one 192-token prompt (12 blocks) and one checkpoint (4 rows)
    hosted = simulate_trace(rows, **GEOMETRY, eviction='reuse', budget_bytes=budget, host_bytes=ideal.peak_bytes)
    assert hosted.per_request_hit_tokens == ideal.per_request_hit_tokens
    assert hosted.hit_tokens_by_tier['host'] > 0 and hosted.evictions['checkpoint'] > 0
    for eviction in ('legacy', 'lru', 'reuse', 'optimal'):
        r = simulate_trace(rows, **GEOMETRY, eviction=eviction, budget_bytes=budget)
        assert 0 <= r.hit_tokens <= ideal.hit_tokens and r.evictions['kv'] > 0, eviction


def _random_rows(n: int, seed: int):
    import random
    rng = random.Random(seed)
    rows, heads = [], [[100 * h + i for i in range(rng.randint(1, 4))] for h in range(5)]
    for r in range(n):
        ids = rng.choice(heads) + [10_000 + 10 * r + i for i in range(rng.randint(0, 3))]
        rows.append(SimpleNamespace(input_length=512 * len(ids), output_length=16, hash_ids=ids))
        if rng.random() < 0.5:
            heads.append(ids)
    return rows


def test_beladys_heap_with_the_oracles_refreshes_chooses_as_a_scan_does(monkeypatch):
    """The offline optimum's heap is exact because the oracle rescores every prefix whose next use
    time passed: replaying with a scan at every eviction gives the same hits, request by request."""
    import benchmark.trace_sim as ts
    rows, budget = _random_rows(60, seed=7), 50 * 16      # (without the refreshes: 4,224 hit tokens)
    heap = simulate_trace(rows, **GEOMETRY, eviction='optimal', budget_bytes=budget)

    class Scan(ts.OfflineOptimalPolicy):
        def select(self, live, pinned, clock):
            return self.victim([s for slot, s in live.items() if not pinned(slot)], clock)

    monkeypatch.setattr(ts, 'OfflineOptimalPolicy', Scan)
    scan = simulate_trace(rows, **GEOMETRY, eviction='optimal', budget_bytes=budget)
    assert heap.evictions['checkpoint'] > 0 and heap.hit_tokens == 4512
    assert heap.per_request_hit_tokens == scan.per_request_hit_tokens and heap.evictions == scan.evictions


# The replay's fast paths against the code they replaced -----------------------------------------
def _reference_chain_block_hashes(token_ids, block_size, num_blocks=None, extra_keys=None, prefix=(), salt=None):
    """Block hashes as they were computed before the one-pack change: a struct call per block."""
    import hashlib
    import struct

    from lmdeploy.pytorch.prefix_cache.block_trie import salted_root
    full = len(token_ids) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    hashes = list(prefix[:n])
    prev = hashes[-1] if hashes else salted_root(salt)
    for i in range(len(hashes), n):
        h = hashlib.blake2b(prev, digest_size=16)
        block = token_ids[i * block_size:(i + 1) * block_size]
        h.update(struct.pack(f'<{len(block)}I', *block))
        if extra_keys is not None and extra_keys[i]:
            h.update(extra_keys[i])
        prev = h.digest()
        hashes.append(prev)
    return hashes


def _reference_descend(self, node, token_ids, block_ids, num_blocks, hashes, out, adopt=False):
    """The trie's insert walk before the block-identity shortcut: every existing node's tokens
    compared with a fresh tuple of the sequence's."""
    from lmdeploy.pytorch.prefix_cache import block_trie as bt
    B = self.block_size
    for i in range(node.depth, num_blocks):
        h = hashes[i]
        tokens = tuple(token_ids[i * B:(i + 1) * B])
        child = node.children.get(h)
        if block_ids[i] < 0 and (child is None or child.tokens != tokens):
            break
        if child is None or child.tokens != tokens:
            if child is not None:
                break
            child = bt.TrieNode(node, h, tokens, block_ids[i], i + 1)
            self.block_manager.cache(block_ids[i])
            node.children[h] = child
            self.num_nodes += 1
            for listener in self.listeners:
                listener.block_cached(child)
        elif adopt and 0 <= block_ids[i] != child.block_id and self.block_manager.refcount[child.block_id] == 1:
            self.block_manager.cache(block_ids[i])
            self.block_manager.uncache(child.block_id)
            child.block_id = block_ids[i]
        child.last_access = next(bt._CLOCK)
        if out is not None:
            out.append(child)
        node = child
    if node is not self.root and not node.children:
        self._push_leaf(node)
    return node


def _reference_evict(self, num_blocks, dead_only=False):
    """The trie's leaf eviction before blocked entries were parked: every blocked leaf popped and
    pushed back at each call."""
    import heapq
    freed, blocked = 0, []
    while freed < num_blocks and self._leaves:
        entry = heapq.heappop(self._leaves)
        if not self._is_current(entry):
            continue
        leaf = entry[-1]
        if not self._evictable(leaf) or (dead_only and leaf.ckpts_below):
            blocked.append(entry)
            continue
        parent = leaf.parent
        freed += self._remove(leaf)
        if parent is not self.root and not parent.children:
            self._push_leaf(parent)
    for entry in blocked:
        heapq.heappush(self._leaves, entry)
    if freed < num_blocks and not dead_only:
        freed += self._evict_subtrees(num_blocks - freed)
    return freed


def _replay_all(rows, geometry):
    out = {}
    for policy in ('default', 'last_only'):
        ideal = simulate_trace(rows, save_policy=policy, budget_bytes=None, **geometry)
        out[policy, 'ideal'] = ideal
        for eviction in ('lru', 'reuse', 'optimal'):
            out[policy, eviction] = simulate_trace(rows, save_policy=policy, eviction=eviction,
                                                   budget_bytes=ideal.peak_bytes // 8, **geometry)
    return out


def test_the_fast_replay_gives_the_reference_paths_hits_request_by_request(monkeypatch):
    """120 requests of the committed codex trace (branches, compactions, a shared head) at scale 16
    (B = 8, A = 32, P = 128), both save policies, lru / reuse / optimal at 1/8 of the working set:
    the same hits request by request, evictions, checkpoints and peaks as with the per-block hash
    packing, the token-comparing insert walk, the eviction that pops and pushes back every
    blocked leaf, and the cyclic GC on during the loop."""
    from benchmark.traces import load_trace
    from lmdeploy.pytorch.prefix_cache import block_trie, coordinator
    import benchmark.trace_sim as ts
    rows = load_trace('benchmark/traces/codex.jsonl')[:120]
    geometry = dict(state_bytes=3000, kv_block_bytes=100, block_size=8, alignment=32, chunk=128, scale=16,
                    concurrency=4)
    fast = _replay_all(rows, geometry)
    with monkeypatch.context() as m:
        m.setattr(block_trie.BlockTrie, '_descend', _reference_descend)
        m.setattr(block_trie.BlockTrie, 'evict', _reference_evict)
        m.setattr(block_trie, 'chain_block_hashes', _reference_chain_block_hashes)
        m.setattr(coordinator, 'chain_block_hashes', _reference_chain_block_hashes)
        m.setattr(ts, 'chain_block_hashes', _reference_chain_block_hashes)
        m.setattr(ts.gc, 'disable', lambda: None)
        m.setattr(ts.gc, 'collect', lambda generation=2: 0)
        slow = _replay_all(rows, geometry)
    for key, r in slow.items():
        f = fast[key]
        assert f.per_request_hit_tokens == r.per_request_hit_tokens, key
        assert (f.evictions, f.checkpoints_saved, f.peak_bytes) == (r.evictions, r.checkpoints_saved, r.peak_bytes), key
    # the budgets evict and the policies differ, so the comparison covers eviction choices
    assert all(fast[p, e].evictions['kv'] > 0 for p in ('default', 'last_only') for e in ('lru', 'reuse', 'optimal'))
    assert fast['last_only', 'optimal'].hit_tokens > fast['last_only', 'lru'].hit_tokens


def test_block_hashes_equal_the_per_block_packing_on_random_inputs():
    """One pack of every new block gives the per-block hashes exactly: random lengths, block
    sizes, ``num_blocks`` cuts, continued prefixes, extra keys and salts (300 seeded cases)."""
    import random

    from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
    rng = random.Random(40)
    for _ in range(300):
        B = rng.choice((1, 2, 4, 16, 64))
        ids = [rng.randrange(2 ** 32) if rng.random() < 0.2 else rng.randrange(300)
               for _ in range(rng.randrange(0, 9 * B))]
        full = len(ids) // B
        num = rng.choice((None, rng.randint(0, full + 2)))
        extra = [rng.choice((b'', b'img', None)) for _ in range(full)] if rng.random() < 0.3 else None
        salt = rng.choice((None, '', 'tenant-a'))
        prefix = (_reference_chain_block_hashes(ids, B, rng.randint(0, full), extra, salt=salt)
                  if rng.random() < 0.5 else ())
        kw = dict(num_blocks=num, extra_keys=extra, prefix=prefix, salt=salt)
        assert chain_block_hashes(ids, B, **kw) == _reference_chain_block_hashes(ids, B, **kw)


def test_evictions_equal_the_reference_on_random_traces(monkeypatch):
    """Fuzz over small random conversation traces (shared heads, branches), both save policies,
    budgets from 1/3 to 1/10 of the working set, every dead-first and LRU policy: the trie's
    eviction (parked blocked leaves, live leaves skipped by dead-only calls until their checkpoint
    goes, a chain's parent taken at once) frees the same blocks as the reference that pops and
    pushes back every blocked leaf at each call, request by request."""
    from lmdeploy.pytorch.prefix_cache import block_trie
    geometry = dict(state_bytes=48, kv_block_bytes=16, block_size=16, alignment=32, chunk=64, scale=16,
                    concurrency=3)
    for seed in range(6):
        rows = _random_rows(40, seed)
        for policy in ('default', 'last_only'):
            peak = simulate_trace(rows, save_policy=policy, **geometry).peak_bytes
            for k, eviction in enumerate(('reuse', 'lru', 'optimal')):
                kw = dict(save_policy=policy, eviction=eviction, budget_bytes=peak // (3 + (seed + k) % 8), **geometry)
                fast = simulate_trace(rows, **kw)
                with monkeypatch.context() as m:
                    m.setattr(block_trie.BlockTrie, 'evict', _reference_evict)
                    ref = simulate_trace(rows, **kw)
                assert fast.evictions['kv'] > 0, (seed, policy, eviction)
                assert fast.per_request_hit_tokens == ref.per_request_hit_tokens, (seed, policy, eviction)
                assert (fast.evictions, fast.checkpoints_saved, fast.peak_bytes) == \
                    (ref.evictions, ref.checkpoints_saved, ref.peak_bytes), (seed, policy, eviction)


def test_a_dead_only_eviction_does_not_reread_live_leaves(monkeypatch):
    """Entries an eviction reads stay proportional to the blocks it frees: a leaf kept alive by
    its checkpoint is read once, not again at every later dead-only call (300 requests of the
    agent_fleet shape at 1/4 of the working set: the old eviction read 31,195 entries for 5,655
    blocks, this one 7,275)."""
    from benchmark.traces import agent_fleet
    from lmdeploy.pytorch.prefix_cache import block_trie
    reads = []
    current = block_trie.BlockTrie._is_current
    monkeypatch.setattr(block_trie.BlockTrie, '_is_current', staticmethod(lambda e: reads.append(1) or current(e)))
    rows = list(agent_fleet(300, head_tokens=2000, compact_at=6000))
    geometry = dict(state_bytes=3000, kv_block_bytes=100, block_size=8, alignment=32, chunk=128, scale=16,
                    concurrency=4, save_policy='last_only')
    peak = simulate_trace(rows, **geometry).peak_bytes
    reads.clear()
    r = simulate_trace(rows, **geometry, eviction='reuse', budget_bytes=peak // 4)
    assert r.evictions == {'checkpoint': 229, 'kv': 5655}
    assert len(reads) <= 2 * r.evictions['kv'], len(reads)
