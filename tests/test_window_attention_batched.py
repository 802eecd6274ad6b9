"""The batched sliding-window attention (lmdeploy/pytorch/kernels/window_attention.py) against its
per-sequence reference: random steps of several sequences (decode rows and prefill chunks mixed,
with and without history, a window or none, GQA, sinks), each block table shuffled, every cache
entry no query may read set to NaN and the table entries of blocks before every window pointed
at a NaN block; the number of torch ops of a step does not grow with its sequences; the plan is
built once per step and window and shared by the layers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lmdeploy.pytorch.kernels import window_attention as wa
from lmdeploy.pytorch.model_inputs import StepContext

TOL = 1e-5


def _step(seqs, window, gqa, sinks, block_size, seed, Hkv=2, D=4):
    """A step over ``seqs = [(history, new), ...]`` with shuffled block tables; returns
    ``(q, k, v, k_cache, v_cache, ctx, sink)``. Cache entries before each sequence's first
    readable key hold NaN, and so do unwritten entries; dead blocks' table entries point at
    a spare NaN block."""
    gen = torch.Generator().manual_seed(seed)
    H = Hkv * gqa
    lens = [h + n for h, n in seqs]
    nblocks = [-(-n // block_size) for n in lens]
    total = sum(nblocks) + 1
    spare = total - 1
    perm = torch.randperm(total - 1, generator=gen)
    k_cache = torch.full((total, block_size, Hkv, D), float('nan'))
    v_cache = k_cache.clone()
    tables, used = [], 0
    for (hist, new), nb in zip(seqs, nblocks):
        table = perm[used:used + nb].clone()
        used += nb
        first = wa.window_key_range(hist, hist + 1, window)[0]
        for p in range(first, hist):    # only the history a window reaches is written
            k_cache[table[p // block_size], p % block_size] = torch.randn(Hkv, D, generator=gen)
            v_cache[table[p // block_size], p % block_size] = torch.randn(Hkv, D, generator=gen)
        table[:first // block_size] = spare
        tables.append(table)
    T = sum(n for _, n in seqs)
    q = torch.randn(T, H, D, generator=gen)
    k, v = torch.randn(T, Hkv, D, generator=gen), torch.randn(T, Hkv, D, generator=gen)
    sink = torch.randn(H, generator=gen) if sinks else None
    starts = [sum(n for _, n in seqs[:i]) for i in range(len(seqs))]
    ctx = StepContext(input_ids=torch.zeros(T, dtype=torch.int64),
                      positions=torch.cat([torch.arange(h, h + n) for h, n in seqs]),
                      q_seqlens=[n for _, n in seqs], q_start_loc=starts, kv_seqlens=lens, block_tables=tables,
                      state_slots=[-1] * len(seqs), kv_caches=[(k_cache, v_cache)], state_caches=[None],
                      block_size=block_size)
    return q, k, v, k_cache, v_cache, ctx, sink


def _both(seqs, window, gqa, sinks, block_size, seed):
    """(batched, reference) outputs of one step, each on its own copy of the caches."""
    q, k, v, kc, vc, ctx, sink = _step(seqs, window, gqa, sinks, block_size, seed)
    ref_ctx = StepContext(**{f: getattr(ctx, f) for f in ('input_ids', 'positions', 'q_seqlens', 'q_start_loc',
                                                          'kv_seqlens', 'block_tables', 'state_slots',
                                                          'block_size')})
    ref = wa.paged_window_attention_reference(q, k, v, kc.clone(), vc.clone(), ref_ctx, 0.5, window, sink)
    got = wa.paged_window_attention(q, k, v, kc, vc, ctx, 0.5, window, sink)
    return got, ref


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 70), st.sampled_from([1, 1, 2, 5, 17, 40])), min_size=1, max_size=6),
       window=st.one_of(st.none(), st.integers(1, 40)), gqa=st.sampled_from([1, 3]), sinks=st.booleans(),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2 ** 16))
def test_batched_window_attention_equals_the_per_sequence_reference(seqs, window, gqa, sinks, block_size, seed):
    got, ref = _both(seqs, window, gqa, sinks, block_size, seed)
    assert not got.isnan().any()
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize('window, sinks', [(24, True), (24, False), (None, True), (None, False), (200, False)])
def test_decode_step_of_sixteen_sequences(window, sinks):
    """A pure decode step (the benchmark's batch 16) at lengths around the window: one call, or
    the paged decode kernel where the window covers every key and there are no sinks."""
    seqs = [(h, 1) for h in (0, 3, 22, 23, 24, 25, 40, 63, 64, 65, 90, 100, 127, 128, 150, 7)]
    got, ref = _both(seqs, window, 2, sinks, 16, 3)
    assert not got.isnan().any() and (got - ref).abs().max().item() <= TOL


def test_a_step_over_the_score_bound_runs_in_equal_groups(monkeypatch):
    """With the score bound cut to one tile per call, a long chunk (and a decode step) runs tile
    group by tile group and still equals the reference."""
    monkeypatch.setattr(wa, 'SCORE_ELEMENTS', 1)
    got, ref = _both([(30, 70), (0, 1), (5, 33)], 16, 2, True, 4, 11)
    assert (got - ref).abs().max().item() <= TOL
    got, ref = _both([(30, 1), (0, 1), (5, 1), (17, 1)], 16, 2, True, 4, 12)     # a decode step, one call each
    assert (got - ref).abs().max().item() <= TOL


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(seqs, window, sinks, layers=1):
    q, k, v, kc, vc, ctx, sink = _step(seqs, window, 2, sinks, 16, 0)
    with _CountOps() as count:
        for _ in range(layers):
            wa.paged_window_attention(q, k, v, kc, vc, ctx, 0.5, window, sink)
    return count.ops


@pytest.mark.parametrize('window, sinks', [(24, True), (None, True), (8, False)])
def test_ops_per_step_do_not_grow_with_the_sequences(window, sinks):
    """Regression: the attention looped over the sequences in Python (about 25 torch ops per
    sequence and layer). Now a decode step of 16 sequences costs what one of 2 does, and so
    does a prefill step of 6 chunks against one of 2."""
    assert _ops([(40 + i, 1) for i in range(16)], window, sinks) == _ops([(40, 1), (41, 1)], window, sinks)
    assert _ops([(i, 20) for i in range(6)], window, sinks) == _ops([(0, 20), (3, 20)], window, sinks)


def test_the_plan_is_built_once_per_step_and_window():
    """A second layer of the same window reuses the first one's plan: it costs only its gather,
    products and softmax (fewer ops than the first), and the memo holds one plan per window."""
    seqs = [(40 + i, 1) for i in range(4)] + [(10, 12)]
    first, two = _ops(seqs, 24, True), _ops(seqs, 24, True, layers=2)
    assert two - first < first
    q, k, v, kc, vc, ctx, sink = _step(seqs, 24, 2, True, 16, 0)
    for window in (24, None, 24):
        wa.paged_window_attention(q, k, v, kc, vc, ctx, 0.5, window, sink)
    assert sorted(key[1] or 0 for key in ctx.kernel_memo) == [0, 24]


def test_strided_queries_of_a_packed_projection():
    """Queries that are a column slice of a packed q/k/v projection (not contiguous), as a layer
    without rotary passes them, give the same output in a decode step and a mixed one."""
    for seqs in ([(30, 1), (4, 1), (50, 1)], [(30, 1), (4, 9), (50, 3)]):
        q, k, v, kc, vc, ctx, sink = _step(seqs, 24, 2, True, 4, 5)
        packed = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 3)], 1)
        strided = packed[:, :-3].unflatten(1, q.shape[1:])
        assert not strided.is_contiguous()
        want = wa.paged_window_attention(q, k, v, kc.clone(), vc.clone(), ctx, 0.5, 24, sink)
        ctx.kernel_memo.clear()
        assert torch.equal(wa.paged_window_attention(strided, k, v, kc, vc, ctx, 0.5, 24, sink), want)


def test_window_below_one_is_refused():
    q, k, v, kc, vc, ctx, _ = _step([(3, 2)], 4, 1, False, 4, 0)
    for fn in (wa.paged_window_attention, wa.paged_window_attention_reference):
        with pytest.raises(ValueError, match='sliding_window must be >= 1'):
            fn(q, k, v, kc, vc, ctx, 0.5, 0, None)


@pytest.mark.parametrize('window, expected', [(None, 256), (1, 16), (24, 24), (4096, 256)])
def test_query_tile(window, expected):
    assert wa.query_tile(window) == expected
