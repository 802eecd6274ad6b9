"""Batched varlen kernels (one call per layer for every sequence of a step) equal the
per-sequence reference: KV write + paged attention, causal conv update/prefill, gated delta
rule; StepContext's batch tensors hold the exact offsets; decode op count does not grow with
the batch."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy.pytorch.kernels import attention as attn_mod
from lmdeploy.pytorch.kernels.attention import paged_attention_reference, paged_attention_torch
from lmdeploy.pytorch.kernels.causal_conv1d import causal_conv1d, causal_conv1d_varlen
from lmdeploy.pytorch.kernels.gated_delta_rule import gated_delta_rule_varlen, recurrent_gated_delta_rule
from lmdeploy.pytorch.model_inputs import StepContext

BLOCK = 4
NUM_BLOCKS = 160
NUM_SLOTS = 6
# (history, new tokens) per sequence: decodes, a continued prefill, fresh prefills, a 1-token prompt.
MIXED = [(9, 1), (0, 7), (5, 6), (3, 1), (0, 1), (13, 1)]
DECODE = [(9, 1), (1, 1), (3, 1), (16, 1), (5, 1)]


def _byte_view(shape, dtype, fill_nan=True):
    """A tensor that is a strided view into a wider byte buffer (as the cache engine hands out)."""
    numel = 1
    for s in shape[1:]:
        numel *= s
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    buf = torch.full((shape[0], nbytes + 64), 0xFF if fill_nan else 0, dtype=torch.uint8)
    return buf[:, 32:32 + nbytes].view(dtype).view(*shape)


def _ctx(layout, slots=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    q_lens, starts, kv_lens, tables, pos = [], [], [], [], []
    for hist, n in layout:
        starts.append(sum(q_lens))
        q_lens.append(n)
        kv_lens.append(hist + n)
        tables.append(torch.tensor([free.pop() for _ in range(-(-(hist + n) // BLOCK))], dtype=torch.int64))
        pos.extend(range(hist, hist + n))
    T = sum(q_lens)
    return StepContext(input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.tensor(pos), q_seqlens=q_lens,
                       q_start_loc=starts, kv_seqlens=kv_lens, block_tables=tables,
                       state_slots=slots if slots is not None else list(range(len(layout))), block_size=BLOCK)


def test_step_context_batch_tensors_are_exact():
    ctx = StepContext(input_ids=torch.zeros(4, dtype=torch.int64), positions=torch.tensor([5, 6, 7, 2]),
                      q_seqlens=[3, 1], q_start_loc=[0, 3], kv_seqlens=[8, 3],
                      block_tables=[torch.tensor([7, 2]), torch.tensor([5])], state_slots=[4, 1], block_size=4)
    assert ctx.cu_seqlens.tolist() == [0, 3, 4]
    assert ctx.seq_ids.tolist() == [0, 0, 0, 1]
    assert ctx.slots.tolist() == [4, 1]
    assert ctx.has_history.tolist() == [True, True]
    assert ctx.block_table.tolist() == [[7, 2], [5, 0]]
    assert ctx.kv_positions.tolist() == [5, 6, 7, 2]
    blocks, offsets = ctx.kv_write_index
    assert blocks.tolist() == [2, 2, 2, 5] and offsets.tolist() == [1, 2, 3, 2]
    blocks, offsets, valid = ctx.kv_gather_index
    assert blocks.tolist() == [[7, 7, 7, 7, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]]
    assert offsets.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert valid.sum(1).tolist() == [8, 3]
    assert not ctx.is_decode
    assert ctx.slot_span is None          # a prefill chunk in the step: no in-place decode


@pytest.mark.parametrize('slots,history,span', [
    ([3, 4, 5], [4, 1, 9], (3, None)),
    ([5, 3, 4], [4, 1, 9], (3, [1, 2, 0])),
    ([3, 5, 6], [4, 1, 9], None),          # a gap
    ([3, 4, 5], [4, 0, 9], None),          # a fresh one-token prompt starts from zeros
])
def test_step_context_slot_span(slots, history, span):
    """Decode steps compute the slot range once for every layer's conv and delta-rule kernels."""
    ctx = StepContext(input_ids=torch.zeros(3, dtype=torch.int64), positions=torch.tensor(history),
                      q_seqlens=[1, 1, 1], q_start_loc=[0, 1, 2], kv_seqlens=[h + 1 for h in history],
                      block_tables=[torch.tensor([0])] * 3, state_slots=slots, block_size=64)
    got = ctx.slot_span
    assert (got if got is None else (got[0], None if got[1] is None else got[1].tolist())) == span
    assert ctx.slot_span is got           # cached for the step


def _kv_setup(layout, num_heads, num_kv_heads, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx = _ctx(layout, seed=seed)
    D = 8
    T = sum(n for _, n in layout)
    k_cache = _byte_view((NUM_BLOCKS, BLOCK, num_kv_heads, D), dtype)
    v_cache = _byte_view((NUM_BLOCKS, BLOCK, num_kv_heads, D), dtype)
    for i, (hist, _) in enumerate(layout):   # the history each sequence already cached
        for p in range(hist):
            block = int(ctx.block_tables[i][p // BLOCK])
            k_cache[block, p % BLOCK] = torch.randn(num_kv_heads, D, generator=gen).to(dtype)
            v_cache[block, p % BLOCK] = torch.randn(num_kv_heads, D, generator=gen).to(dtype)
    q = torch.randn(T, num_heads, D, generator=gen)
    k = torch.randn(T, num_kv_heads, D, generator=gen)
    v = torch.randn(T, num_kv_heads, D, generator=gen)
    return ctx, q, k, v, k_cache, v_cache


def _plan_values(plan):
    return [(t.rows.tolist(), t.blocks.tolist(), t.offsets.tolist(), t.hidden.tolist(), t.in_order) for t in plan]


@pytest.mark.parametrize('layout', [MIXED, DECODE], ids=['mixed', 'decode'])
@pytest.mark.parametrize('view_first', [False, True], ids=['global-first', 'window-first'])
def test_each_paged_group_memoises_its_own_plans(layout, view_first):
    """A kernel plan memoised on one paged group's context (global block tables, or the window
    group's own) is never returned for the other's, whichever group builds it first: each
    group's plan equals one built on a fresh context holding only that group's tables."""
    from lmdeploy.pytorch.kernels.window_attention import window_plan
    ctx = _ctx(layout)
    ctx.window_block_tables = [t + NUM_BLOCKS for t in ctx.block_tables]    # ids no global table holds
    view = ctx.paged_group(8)
    assert ctx.paged_group(None) is ctx and ctx.paged_group(8) is view
    assert view.kernel_memo is not ctx.kernel_memo
    order = [view, ctx] if view_first else [ctx, view]
    plans = {id(c): window_plan(c, 8, 2) for c in order}
    for c, tables in ((ctx, ctx.block_tables), (view, ctx.window_block_tables)):
        fresh = _ctx(layout)
        fresh.block_tables = tables
        assert _plan_values(plans[id(c)]) == _plan_values(window_plan(fresh, 8, 2))
    assert all(int(t.blocks.min()) >= NUM_BLOCKS for t in plans[id(view)])
    assert all(int(t.blocks.max()) < NUM_BLOCKS for t in plans[id(ctx)])


@pytest.mark.parametrize('layout', [MIXED, DECODE], ids=['mixed', 'decode'])
@pytest.mark.parametrize('heads', [(4, 2), (3, 3)], ids=['gqa', 'mha'])
@pytest.mark.parametrize('tile', [1024, 2], ids=['one-tile', 'tiled'])
def test_paged_attention_equals_per_sequence_reference(layout, heads, tile, monkeypatch):
    monkeypatch.setattr(attn_mod, 'PREFILL_QUERY_TILE', tile)
    ctx, q, k, v, k_cache, v_cache = _kv_setup(layout, *heads, torch.float32, seed=len(layout))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = paged_attention_torch(q, k, v, k_cache, v_cache, ctx, scale=0.3)
    ref = paged_attention_reference(q, k, v, k_ref, v_ref, ctx, scale=0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # Same cache bytes, untouched entries (NaN) included.
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


def test_paged_attention_bf16_cache_follows_reference():
    ctx, q, k, v, k_cache, v_cache = _kv_setup(MIXED, 4, 2, torch.bfloat16, seed=3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = paged_attention_torch(q, k, v, k_cache, v_cache, ctx, scale=0.3)
    ref = paged_attention_reference(q, k, v, k_ref, v_ref, ctx, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)   # same bf16 K/V, fp32 arithmetic


def _conv_setup(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    C, K = 5, 4
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:len(layout)].tolist()
    ctx = _ctx(layout, slots=slots, seed=seed)
    cache = _byte_view((NUM_SLOTS, C, K - 1), torch.float32)   # NaN everywhere ...
    for (hist, _), slot in zip(layout, slots):                  # ... but in live histories
        if hist:
            cache[slot] = torch.randn(C, K - 1, generator=gen)
    x = torch.randn(sum(n for _, n in layout), C, generator=gen)
    return ctx, x, torch.randn(C, K, generator=gen), torch.randn(C, generator=gen), cache


@pytest.mark.parametrize('layout', [MIXED, DECODE, [(0, 2), (2, 1)]], ids=['mixed', 'decode', 'short'])
@pytest.mark.parametrize('with_bias', [False, True])
def test_causal_conv1d_varlen_equals_per_sequence(layout, with_bias):
    ctx, x, weight, bias, cache = _conv_setup(layout, seed=len(layout))
    bias = bias if with_bias else None
    ref_cache = cache.clone()
    expected = []
    for i, (hist, _) in enumerate(layout):
        slot = ctx.state_slots[i]
        y, state = causal_conv1d(x[ctx.seq_slice(i)], weight, bias, ref_cache[slot] if hist else None)
        ref_cache[slot] = state
        expected.append(y)
    y = causal_conv1d_varlen(x, weight, bias, cache, ctx.cu_seqlens, ctx.seq_ids, ctx.slots, ctx.has_history)
    torch.testing.assert_close(y, torch.cat(expected), atol=1e-6, rtol=0)
    torch.testing.assert_close(cache, ref_cache, atol=1e-6, rtol=0, equal_nan=True)   # other slots untouched


# Multi-chunk prefills: 70 and 100 tokens share a chunk count (2), 5 and 64 another (1), 130 alone.
LONG = [(0, 70), (3, 100), (0, 5), (9, 64), (2, 1), (0, 130)]


@pytest.mark.parametrize('layout', [MIXED, DECODE, LONG], ids=['mixed', 'decode', 'long'])
def test_gated_delta_rule_varlen_equals_per_sequence(layout):
    """Per-sequence reference for every layout; prefills with the same chunk count run as one
    padded batch in the torch form, and the padding must not leak into outputs or states."""
    gen = torch.Generator().manual_seed(11)
    H, dk, dv = 2, 4, 3
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:len(layout)].tolist()
    ctx = _ctx(layout, slots=slots)
    cache = _byte_view((NUM_SLOTS, H, dk, dv), torch.float32)
    for (hist, _), slot in zip(layout, slots):
        if hist:
            cache[slot] = torch.randn(H, dk, dv, generator=gen)
    T = sum(n for _, n in layout)
    q, k = torch.randn(T, H, dk, generator=gen), torch.randn(T, H, dk, generator=gen)
    v = torch.randn(T, H, dv, generator=gen)
    g, beta = -2 * torch.rand(T, H, generator=gen), torch.rand(T, H, generator=gen)
    ref_cache = cache.clone()
    expected = []
    for i, (hist, _) in enumerate(layout):
        sl, slot = ctx.seq_slice(i), ctx.state_slots[i]
        o, state = recurrent_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], ref_cache[slot] if hist else None)
        ref_cache[slot] = state
        expected.append(o)
    o = gated_delta_rule_varlen(q, k, v, g, beta, cache, ctx.cu_seqlens, ctx.slots, ctx.has_history)
    torch.testing.assert_close(o, torch.cat(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=0, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_decode_kernels_any_slot_arrangement(data):
    """Pure decode steps (delta rule and causal conv) update the cache in place when the slots form one range (sorted or
    not) and through a gather otherwise; every arrangement equals the per-sequence reference,
    fresh (history 0) one-token prompts start from zeros, and slots outside the batch are
    untouched (NaN there stays NaN)."""
    num_slots = 8
    n = data.draw(st.integers(1, 6), label='batch')
    kind = data.draw(st.sampled_from(['range', 'shuffled range', 'any']), label='kind')
    if kind == 'any':
        slots = data.draw(st.permutations(range(num_slots)), label='perm')[:n]
    else:
        lo = data.draw(st.integers(0, num_slots - n), label='lo')
        slots = list(range(lo, lo + n))
        if kind == 'shuffled range':
            slots = data.draw(st.permutations(slots), label='perm')
    history = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label='history')
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label='seed'))
    H, dk, dv = 2, 4, 3
    cache = _byte_view((num_slots, H, dk, dv), torch.float32)   # NaN everywhere
    for slot, hist in zip(slots, history):
        if hist:
            cache[slot] = torch.randn(H, dk, dv, generator=gen)
    q, k = torch.randn(n, H, dk, generator=gen), torch.randn(n, H, dk, generator=gen)
    v = torch.randn(n, H, dv, generator=gen)
    g, beta = -2 * torch.rand(n, H, generator=gen), torch.rand(n, H, generator=gen)
    ref_cache = cache.clone()
    expected = []
    for i, slot in enumerate(slots):
        o, state = recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                              ref_cache[slot] if history[i] else None)
        ref_cache[slot] = state
        expected.append(o)
    o = gated_delta_rule_varlen(q, k, v, g, beta, cache, torch.arange(n + 1), torch.tensor(slots),
                                torch.tensor(history))
    torch.testing.assert_close(o, torch.cat(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=0, equal_nan=True)

    # the causal conv's decode path, same arrangement (in place for one sorted range)
    C, K = 5, 4
    conv_cache = _byte_view((num_slots, C, K - 1), torch.float32)
    for slot, hist in zip(slots, history):
        if hist:
            conv_cache[slot] = torch.randn(C, K - 1, generator=gen)
    x, weight, bias = torch.randn(n, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    ref_conv = conv_cache.clone()
    expected = []
    for i, slot in enumerate(slots):
        y, state = causal_conv1d(x[i:i + 1], weight, bias, ref_conv[slot] if history[i] else None)
        ref_conv[slot] = state
        expected.append(y)
    y = causal_conv1d_varlen(x, weight, bias, conv_cache, torch.arange(n + 1), torch.arange(n), torch.tensor(slots),
                             torch.tensor(history))
    # conv1d vs multiply-and-sum: float32 summation order (relative ~3e-7 on outputs up to ~5)
    torch.testing.assert_close(y, torch.cat(expected), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(conv_cache, ref_conv, atol=0, rtol=0, equal_nan=True)   # copies: exact


@pytest.mark.parametrize('x_dtype,cache_dtype', [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize('kind', ['sorted range', 'shuffled range'])
def test_causal_conv1d_decode_slot_range(x_dtype, cache_dtype, kind):
    """A decode step whose slots are one sorted range with history everywhere rewrites that slice
    of the (strided) cache in place, no gather or scatter; a shuffled range takes the gather path.
    Both equal the per-sequence reference, in every dtype pairing, and leave other slots alone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    n, C, K, lo = 4, 6, 4, 2
    slots = list(range(lo, lo + n)) if kind == 'sorted range' else [lo + 2, lo, lo + 3, lo + 1]
    cache = _byte_view((NUM_SLOTS + 2, C, K - 1), cache_dtype)       # NaN outside the range
    for slot in slots:
        cache[slot] = torch.randn(C, K - 1, generator=gen).to(cache_dtype)
    x = torch.randn(n, C, generator=gen).to(x_dtype)
    weight, bias = torch.randn(C, K, generator=gen).to(x_dtype), torch.randn(C, generator=gen).to(x_dtype)
    ref_cache = cache.clone()
    expected = []
    for i, slot in enumerate(slots):
        y, state = causal_conv1d(x[i:i + 1], weight, bias, ref_cache[slot])
        ref_cache[slot] = state.to(cache_dtype)
        expected.append(y)
    ops = Ops()
    with ops:
        y = causal_conv1d_varlen(x, weight, bias, cache, torch.arange(n + 1), torch.arange(n), torch.tensor(slots),
                                 torch.ones(n, dtype=torch.bool))
    gathered = any('index_select' in op or 'index_copy' in op for op in ops.names)
    assert gathered == (kind != 'sorted range'), ops.names
    tol = 1e-6 if x_dtype == torch.float32 else 2e-2   # conv1d vs multiply-and-sum: summation order
    torch.testing.assert_close(y, torch.cat(expected), atol=tol, rtol=tol)
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0, rtol=0, equal_nan=True)


def _count_ops(fn) -> int:
    """Torch dispatcher calls made by ``fn()``: the benchmark's own counter, so the test and the
    benchmark's op profile count the same thing."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location('benchmark_throughput', root / 'benchmark' / 'benchmark_throughput.py')
    mod = sys.modules.get('benchmark_throughput')
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules['benchmark_throughput'] = mod
        spec.loader.exec_module(mod)
    return mod.count_ops(fn)


class _CountingForward:
    """Stands in for the model inside the harness; counts the ops of ``forward`` only."""

    def __init__(self, model):
        self.model, self.ops = model, None

    def forward(self, ctx):
        out = []
        self.ops = _count_ops(lambda: out.append(self.model.forward(ctx)))
        return out[0]

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def test_decode_step_op_count_does_not_grow_with_batch():
    """A decode step issues the same torch ops for 5 or 12 sequences: no per-sequence Python loop
    (dense MLPs here: on CPU the MoE runs one matmul pair per expert the batch hits). Both batch
    sizes take the same product kernel (the native few-row product when it is built, MKL's direct
    form otherwise), which issue different numbers of torch ops."""
    from lmdeploy.pytorch.kernels.cpu_native import NATIVE_ROWS
    from lmdeploy.pytorch.kernels.linear import transposed_rows
    from test_qwen3_next_layers import _build, _config, _harness
    config = _config(mlp_only_layers=[0, 1, 2, 3])
    _, ours = _build(config)
    assert {5, 12} <= set(NATIVE_ROWS) and not {5, 12} & set(transposed_rows(config.hidden_size))
    counts = []
    for batch in (5, 12):
        harness = _harness(config, ours, num_slots=batch)
        seqs = [harness.add_sequence() for _ in range(batch)]
        harness.step([(s, [1, 2, 3, 4, 5][:2 + s % 3]) for s in seqs])   # different lengths
        harness.model = counter = _CountingForward(ours)
        harness.step([(s, [4]) for s in seqs])
        counts.append(counter.ops)
    # (the floor only shows the count is a real step's: the Gated DeltaNet layers take one native
    # call each, gdn_varlen, since the step's slots are not one sorted range; 99 ops here)
    assert counts[0] > 80 and counts[0] == counts[1]


@pytest.mark.parametrize('intermediate,counts', [
    (8, [2, 0, 3, 1, 1]), (6, [2, 0, 3, 1, 1]),
    # runs of 8-63 rows take the (W x^T)^T orientation on CPU, 64 and more the direct one
    (8, [9, 0, 1, 40, 64]),
], ids=['grouped', 'unaligned-fallback', 'long-runs'])
def test_swiglu_experts_grouped_equals_loop_and_per_token_reference(intermediate, counts):
    from lmdeploy.pytorch.kernels.moe import grouped_mm_usable, swiglu_experts_grouped, swiglu_experts_loop
    gen = torch.Generator().manual_seed(5)
    E, H = 5, 8
    gate_up = torch.randn(E, 2 * intermediate, H, generator=gen)
    down = torch.randn(E, H, intermediate, generator=gen)
    counts = torch.tensor(counts)    # expert 1 unused
    x = torch.randn(int(counts.sum()), H, generator=gen)
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    silu = torch.nn.functional.silu
    ref = torch.stack([silu(x[r] @ gate_up[e, :intermediate].T) * (x[r] @ gate_up[e, intermediate:].T)
                       for r, e in enumerate(expert_of_row.tolist())])
    ref = torch.stack([ref[r] @ down[e].T for r, e in enumerate(expert_of_row.tolist())])
    assert grouped_mm_usable(x, gate_up) == (intermediate == 8)
    # float32 rounding only: the reference sums each dot product in another order (rel ~1e-7
    # of outputs up to ~60 here)
    torch.testing.assert_close(swiglu_experts_loop(x, gate_up, down, counts), ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(swiglu_experts_grouped(x, gate_up, down, counts), ref, atol=1e-5, rtol=1e-6)


def test_moe_experts_equal_one_token_at_a_time():
    from lmdeploy.pytorch.models.blocks.moe import FusedExperts
    gen = torch.Generator().manual_seed(6)
    experts = FusedExperts(num_experts=5, hidden_size=8, intermediate_size=8)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(7, 8, generator=gen)
    index = torch.tensor([[0, 3], [3, 1], [4, 0], [3, 4], [1, 0], [0, 3], [4, 1]])
    weights = torch.rand(7, 2, generator=gen)
    ref = torch.stack([experts(x[t:t + 1], index[t:t + 1], weights[t:t + 1])[0] for t in range(7)])
    torch.testing.assert_close(experts(x, index, weights), ref, atol=1e-5, rtol=0)


# In a subprocess so TRITON_INTERPRET=1 is set before triton is imported and does not leak.
_TRITON_DECODE_SCRIPT = '''
import torch
from lmdeploy.pytorch.kernels.attention import paged_decode_attention
from lmdeploy.pytorch.kernels.attention_triton import paged_decode_attention_triton
checked = 0
for N, H, Hkv, D, block, lens in [(3, 4, 2, 8, 4, [1, 7, 12]), (2, 3, 3, 6, 5, [5, 11]), (4, 8, 1, 16, 8, [9, 1, 16, 3])]:
    g = torch.Generator().manual_seed(N * 100 + D)
    W = -(-max(lens) // block)
    num_blocks = N * W + 3
    buf = torch.full((num_blocks, block * Hkv * D * 2 + 8), float('nan'))   # strided views, NaN where unwritten
    k_cache = buf[:, :block * Hkv * D].view(num_blocks, block, Hkv, D)
    v_cache = buf[:, block * Hkv * D:2 * block * Hkv * D].view(num_blocks, block, Hkv, D)
    table = torch.randperm(num_blocks, generator=g)[:N * W].view(N, W)
    for n, L in enumerate(lens):
        for p in range(L):
            k_cache[table[n, p // block], p % block] = torch.randn(Hkv, D, generator=g)
            v_cache[table[n, p // block], p % block] = torch.randn(Hkv, D, generator=g)
    q = torch.randn(N, H, D, generator=g)
    kv = torch.tensor(lens)
    ref = paged_decode_attention(q, k_cache, v_cache, table, kv, 0.4)
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, kv, 0.4)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    checked += 1
print('checked', checked)
'''


def test_triton_paged_decode_attention_matches_torch_under_interpreter():
    import os
    import subprocess
    import sys
    pytest.importorskip('triton')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{root}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', _TRITON_DECODE_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ['checked', '3']


def test_swiglu_experts_loop_two_matmuls_per_hit_expert_and_few_other_ops():
    """Batched decode on CPU is bound by the number of small torch ops: the expert loop may
    spend only its two products per expert with rows plus a constant, whatever ``E``. A product
    is an ``mm`` or, for the few rows the native product takes (``linear``'s row rule, which
    depends on the host and on whether the native library is built), one native call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmdeploy.pytorch.kernels.cpu_native import CALLS
    from lmdeploy.pytorch.kernels.moe import swiglu_experts_loop

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    H, inner = 8, 4
    MATMULS = ('aten.mm.default',)   # `linear` reaches the dispatcher as t + mm here (no_grad)
    totals = []
    for E in (16, 64):   # 12 experts with rows either way
        counts = torch.tensor([2, 1, 0, 3] * 4 + [0] * (E - 16))
        x, gate_up, down = torch.randn(int(counts.sum()), H), torch.randn(E, 2 * inner, H), torch.randn(E, H, inner)
        Count.ops = []
        native_before = CALLS['matmul_rows']
        with torch.no_grad(), Count():
            out = swiglu_experts_loop(x, gate_up, down, counts)
        assert out.shape == x.shape
        native = CALLS['matmul_rows'] - native_before
        assert sum(op in MATMULS for op in Count.ops) + native == 2 * 12
        # per hit expert: its two matmuls and two views of each weight (the expert, its
        # transpose); the rest is a constant
        assert len(Count.ops) <= 6 * 12 + 12, Count.ops
        totals.append(len(Count.ops))
    assert totals[0] == totals[1]   # experts without rows cost nothing


def _index_reference(ctx):
    """The tensor-op form of ``seq_ids`` / ``kv_positions`` (the definition they must keep)."""
    counts = torch.tensor(ctx.q_seqlens, dtype=torch.int64)
    seq_ids = torch.repeat_interleave(torch.arange(len(ctx.q_seqlens)), counts)
    history = torch.tensor(ctx.kv_seqlens) - counts
    starts = torch.tensor(list(ctx.q_start_loc) + [0], dtype=torch.int64)
    return seq_ids, history[seq_ids] + torch.arange(int(counts.sum())) - starts[seq_ids]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=7), st.booleans(), st.booleans())
def test_step_context_token_indices_equal_tensor_definition(layout, shifted, host):
    """``seq_ids`` and ``kv_positions`` equal their tensor-op definition over random batches,
    empty sequences and non-contiguous ``q_start_loc`` included, on both paths (host lists for
    decode-sized steps, tensor ops above ``HOST_INDEX_TOKENS``)."""
    import lmdeploy.pytorch.model_inputs as model_inputs
    saved, model_inputs.HOST_INDEX_TOKENS = model_inputs.HOST_INDEX_TOKENS, (256 if host else -1)
    try:
        _check_token_indices(layout, shifted)
    finally:
        model_inputs.HOST_INDEX_TOKENS = saved


def _check_token_indices(layout, shifted):
    q = [n for _, n in layout]
    starts = [sum(q[:i]) + (3 * i if shifted else 0) for i in range(len(q))]
    T = sum(q)
    ctx = StepContext(input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.zeros(T, dtype=torch.int64),
                      q_seqlens=q, q_start_loc=starts, kv_seqlens=[h + n for h, n in layout],
                      block_tables=[torch.tensor([0])] * len(q), state_slots=list(range(len(q))), block_size=BLOCK)
    seq_ids, positions = _index_reference(ctx)
    assert ctx.seq_ids.dtype == ctx.kv_positions.dtype == torch.int64
    assert ctx.seq_ids.tolist() == seq_ids.tolist()
    assert ctx.kv_positions.tolist() == positions.tolist()


def test_step_context_token_indices_are_one_host_copy_each():
    """Per-step batch metadata costs no chain of small tensor ops (about 0.1 ms per batch-1
    decode step on CPU before): ``seq_ids`` and ``kv_positions`` are one tensor creation each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    ctx = _ctx([(7, 1), (0, 3), (12, 1)])
    ctx.kv_seqlens_t, ctx.cu_seqlens   # noqa: B018 -- the other cached tensors, built outside the count
    with Count():
        ctx.seq_ids, ctx.kv_positions   # noqa: B018
    assert Count.ops <= 2, Count.ops
