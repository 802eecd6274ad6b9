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
