"""The native CPU decode kernels equal their torch implementations over their whole input class
(row counts, widths not a multiple of the vector length, strided rows and cache views, expert
routings, convolution widths), refuse what they do not cover, and fall back cleanly when they
cannot be built or are switched off."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy.pytorch.kernels import causal_conv1d as conv_mod
from lmdeploy.pytorch.kernels import cpu_native
from lmdeploy.pytorch.kernels import gated_delta_rule as gdr_mod
from lmdeploy.pytorch.kernels.cpu_native import (bcast_rows, conv_decode_step_native, delta_step_native,
                                                 matmul_bcast, matmul_rows, native_library, swiglu_experts_native)
from lmdeploy.pytorch.kernels.linear import linear
from lmdeploy.pytorch.kernels.moe import swiglu_experts_loop

pytestmark = pytest.mark.skipif(native_library() is None, reason='native CPU kernels could not be built here '
                                '(no C compiler with OpenMP, or LMDEPLOY_CPU_KERNELS=0)')

# float32 sums of up to a few hundred products in a different order: the error bound scales with
# the sum of |terms| (not the result), about K * 2^-24 relative to it; 1e-5 of that sum is loose
# enough for every K used here and ~100x tighter than any real error (a wrong index, a missed term).


def _close(actual, expected, scale):
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= 1e-5 * scale + 1e-6, f'max error {err} for a term scale of {scale}'


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 300), st.integers(1, 70), st.integers(0, 9), st.integers(0, 2 ** 31))
def test_matmul_rows_equals_f_linear(rows, inner, outputs, pad, seed):
    """Every row count, inner sizes with a tail past the last 16 columns, output counts that do not
    fill the last 4-row block, and inputs whose rows are spaced wider than they are."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, inner + pad, generator=gen)
    x = base[:, :inner]                                   # row stride inner + pad
    w = torch.randn(outputs, inner, generator=gen)
    y = matmul_rows(x, w)
    assert y.shape == (rows, outputs) and y.is_contiguous() and y.dtype == torch.float32
    _close(y, F.linear(x, w), float((x.abs() @ w.abs().t()).max()))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 200), st.integers(1, 40), st.integers(0, 2 ** 31))
def test_matmul_rows_row_results_do_not_depend_on_the_row_count(rows, inner, outputs, seed):
    """Each output element is one fixed-order sum whatever the block shape (1, 2-3 and 4+ input
    rows take different weight-row widths): a row's result is bit for bit the same alone and in a
    call of ``rows`` rows, so a decode step's rounding does not depend on its batch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(outputs, inner, generator=gen)
    y = matmul_rows(x, w)
    for i in range(rows):
        assert torch.equal(matmul_rows(x[i:i + 1], w)[0], y[i])
    for k in (2, 3):
        if rows >= k:
            assert torch.equal(matmul_rows(x[:k], w), y[:k])


_needs_bcast = pytest.mark.skipif(native_library() is None or not bcast_rows(),
                                  reason='the broadcast-form product is built without AVX-512 only')


@_needs_bcast
@settings(max_examples=120, deadline=None)
@given(st.integers(1, 64), st.integers(1, 300), st.integers(1, 40), st.integers(0, 9), st.integers(0, 2 ** 31))
def test_matmul_bcast_equals_f_linear(rows, inner, outputs, pad, seed):
    """Every row count it takes (a last block of 16 input rows partly padding), inner sizes around
    the 64-column chunk, output counts that do not fill the last block of 6 weight rows, and
    inputs whose rows are spaced wider than they are."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, inner + pad, generator=gen)
    x = base[:, :inner]                                   # row stride inner + pad
    w = torch.randn(outputs, inner, generator=gen)
    y = matmul_bcast(x, w)
    assert y.shape == (rows, outputs) and y.is_contiguous() and y.dtype == torch.float32
    _close(y, F.linear(x, w), float((x.abs() @ w.abs().t()).max()))


@_needs_bcast
@settings(max_examples=40, deadline=None)
@given(st.integers(2, 64), st.integers(1, 200), st.integers(1, 20), st.integers(0, 2 ** 31))
def test_matmul_bcast_row_results_do_not_depend_on_the_row_count_or_threads(rows, inner, outputs, seed):
    """Each element is summed k after k within 64-column chunks and the chunk sums in order, in
    whichever block of 16 rows and 6 weight rows it falls: a row's result is bit for bit the same
    in a call of any row count and with one thread or two."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(outputs, inner, generator=gen)
    y = matmul_bcast(x, w)
    for lo, hi in ((0, 1), (rows - 1, rows), (rows // 3, rows), (0, max(1, rows // 2))):
        assert torch.equal(matmul_bcast(x[lo:hi], w), y[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        assert torch.equal(matmul_bcast(x, w), y)
    finally:
        torch.set_num_threads(threads)


@_needs_bcast
def test_linear_takes_the_bcast_product_for_25_to_64_rows_only(monkeypatch):
    """``linear`` routes 25-64 float32 rows to the broadcast form (a fixed rule of the build), 24 and
    65 elsewhere; the refusals of the native product hold for it too."""
    from lmdeploy.pytorch.kernels import linear as linear_mod
    assert bcast_rows() == range(25, 65)
    calls = []

    def spy(x, w):
        calls.append(x.shape[0])
        return matmul_bcast(x, w)
    monkeypatch.setattr(linear_mod, 'matmul_bcast', spy)
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(13, 70, generator=gen), torch.randn(13, generator=gen)
    for rows in (24, 25, 40, 64, 65):
        x = torch.randn(1, rows, 70, generator=gen)
        with torch.inference_mode():
            y = linear(x, w, b)
        _close(y, F.linear(x, w, b), float((x.abs() @ w.abs().t()).max() + b.abs().max()))
    assert calls == [25, 40, 64]
    x = torch.randn(30, 16)
    assert matmul_bcast(torch.randn(65, 16), torch.randn(4, 16)) is None            # past the window
    assert matmul_bcast(x, torch.randn(4, 16, requires_grad=True)) is None          # autograd graph
    assert matmul_bcast(x.double(), torch.randn(4, 16).double()) is None
    assert matmul_bcast(torch.randn(16, 30).t(), torch.randn(4, 16)) is None         # column-major rows
    assert matmul_bcast(x, torch.randn(4, 15)) is None                              # inner sizes differ
    assert matmul_bcast(torch.randn(0, 16), torch.randn(4, 16)) is None


@_needs_bcast
def test_a_recorded_bcast_product_is_one_native_call():
    """Under a decode graph's recording stand-in the broadcast product records its one kernel call
    (the row bound was read when the library loaded, so a replay repeats nothing else)."""
    from lmdeploy.pytorch.engine.decode_graph import _NativeRecorder
    lib, entries = native_library(), []
    x, w = torch.randn(30, 48), torch.randn(10, 48)
    cpu_native._LIB = _NativeRecorder(lib, entries)
    try:
        y = matmul_bcast(x, w)
    finally:
        cpu_native._LIB = lib
    assert [e[1] for e in entries] == ['lm_matmul_bcast'] and torch.equal(y, matmul_bcast(x, w))


def test_an_earlier_library_loads_without_the_entry_points_it_lacks():
    """The benchmarks' A/B against a library built from an earlier source binds what it has
    (``missing_ok``); by default a missing entry point is an error (a library of another version)."""
    from lmdeploy.pytorch.kernels import native_build
    path = native_library()._name
    types = dict(cpu_native._ARGTYPES, lm_not_in_this_library=('p', None))
    with pytest.raises(AttributeError):
        native_build.load_private(path, types)
    lib = native_build.load_private(path, types, missing_ok=True)
    assert lib.lm_matmul_rows.restype is None and not hasattr(lib, 'lm_not_in_this_library')


@pytest.mark.parametrize('inner, outputs', [(1, 1), (15, 1), (17, 33), (1000, 17), (1024, 16), (1040, 7)])
def test_matmul_rows_single_row_equals_f_linear_for_odd_shapes(inner, outputs):
    """One input row (the batch-1 decode product): inner sizes with a tail past the last 16
    columns, a single output, output counts below and above the 16-row block, and a row view of a
    wider tensor; a row that is not unit-stride along K is refused (the caller runs MKL)."""
    gen = torch.Generator().manual_seed(inner * 100 + outputs)
    base = torch.randn(3, inner + 5, generator=gen)
    w = torch.randn(outputs, inner, generator=gen)
    for x in (base[:1, :inner], base[1:2, 3:inner + 3]):
        y = matmul_rows(x, w)
        assert y.shape == (1, outputs) and y.is_contiguous()
        _close(y, F.linear(x, w), float((x.abs() @ w.abs().t()).max()))
    assert matmul_rows(torch.randn(inner, 2, generator=gen).t()[:1], w) is None     # K stride 2


@pytest.mark.parametrize('rows', [1, 3, 4, 16, 24, 25, 64])
def test_linear_takes_the_native_product_for_its_row_window_only(rows, monkeypatch):
    calls = []
    real = cpu_native.matmul_rows

    def spy(x, w):
        calls.append(x.shape[0])
        return real(x, w)

    from lmdeploy.pytorch.kernels import linear as linear_mod
    monkeypatch.setattr(linear_mod, 'matmul_rows', spy)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=gen)           # 3-D input: flattened rows
    w, b = torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    with torch.inference_mode():
        y = linear(x, w, b)
    assert calls == ([rows] if rows in cpu_native.NATIVE_ROWS else [])
    assert y.shape == (1, rows, 40)
    _close(y, F.linear(x, w, b), float((x.abs() @ w.abs().t()).max() + b.abs().max()))


def test_native_paths_refuse_autograd_other_dtypes_and_bad_shapes():
    w = torch.randn(8, 32, requires_grad=True)
    x = torch.randn(4, 32)
    assert matmul_rows(x, w) is None                                    # autograd graph: torch path
    with torch.no_grad():
        assert matmul_rows(x, w) is not None
        assert matmul_rows(x.bfloat16(), w.bfloat16()) is None
        assert matmul_rows(x.t().contiguous().t(), w) is None          # column-major rows
        assert matmul_rows(x[:, :16], w) is None                        # inner sizes differ
        gate_up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
        idx, wts = torch.tensor([[0, 5]]), torch.ones(1, 2)
        with pytest.raises(ValueError, match=r'expert index out of range \[0, 4\)'):
            swiglu_experts_native(torch.randn(1, 8), idx, wts, gate_up, down)
        with pytest.raises(ValueError, match=r'expected x \[T, H\], index and weights \[T, k\]'):
            swiglu_experts_native(torch.randn(1, 8), idx, torch.ones(1, 3), gate_up, down)
        with pytest.raises(ValueError, match=r'down \[E, H, I\]'):
            swiglu_experts_native(torch.randn(1, 8), idx.clamp(max=3), wts, gate_up, down[:, :, :4])
        many = torch.zeros(cpu_native.NATIVE_EXPERT_TOKENS + 1, 2, dtype=torch.int64)
        assert swiglu_experts_native(torch.randn(many.shape[0], 8), many, torch.ones(many.shape), gate_up,
                                     down) is None                      # a prefill chunk: torch's GEMMs
        assert swiglu_experts_native(torch.randn(1, 8).bfloat16(), idx.clamp(max=3), wts.bfloat16(),
                                     gate_up.bfloat16(), down.bfloat16()) is None


def _experts_reference(x, index, weights, gate_up, down):
    """The torch path of FusedExperts: sort by expert, per-expert loop, weight, unsort, sum."""
    k = index.shape[1]
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    y = swiglu_experts_loop(x[order // k], gate_up, down, counts) * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(x.shape[0], k, -1).sum(1)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, cpu_native.NATIVE_EXPERT_TOKENS), st.integers(1, 6), st.integers(1, 12),
       st.sampled_from([16, 40, 64]), st.sampled_from([8, 24, 32]), st.integers(0, 2 ** 31))
def test_swiglu_experts_native_equals_the_torch_path(tokens, k, num_experts, hidden, inter, seed):
    """Any routing: experts hit by many tokens, by one, or by none; top-k up to 6."""
    k = min(k, num_experts)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    out = swiglu_experts_native(x, index, weights, gate_up, down)
    ref = _experts_reference(x, index, weights, gate_up, down)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    _close(out, ref, float(ref.abs().max()) + 1.0)


def test_fused_experts_module_uses_the_native_kernel_under_inference_mode():
    from lmdeploy.pytorch.models.blocks.moe import FusedExperts
    gen = torch.Generator().manual_seed(0)
    m = FusedExperts(8, 32, 16)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=gen))
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=gen))
    x = torch.randn(5, 32, generator=gen)
    index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    with torch.inference_mode():
        native = m(x, index, weights)
        torch_path = m.forward_sorted(x, index, weights)
    _close(native, torch_path, float(torch_path.abs().max()) + 1.0)


def _gdn_inputs(gen, n, heads, dk, dv):
    q, k = torch.randn(n, heads, dk, generator=gen), torch.randn(n, heads, dk, generator=gen)
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 3          # log decay <= 0
    beta = torch.rand(n, heads, generator=gen)
    return q, k, v, g, beta


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.sampled_from([8, 16, 33]), st.sampled_from([8, 24, 40]),
       st.booleans(), st.integers(0, 2 ** 31))
def test_delta_step_native_equals_torch_and_updates_cache_rows_in_place(n, heads, dk, dv, row_layout, seed):
    """The decode step against the torch form (same inputs, native disabled) and against the
    token-by-token reference, on a contiguous state and on a view into cache rows that hold
    more than the state (the engine's layout), with the rows around it untouched."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _gdn_inputs(gen, n, heads, dk, dv)
    size = heads * dk * dv
    cache = torch.randn(n + 3, size + (7 if row_layout else 0), generator=gen)
    before = cache.clone()
    state = cache[1:1 + n, :size].view(n, heads, dk, dv)
    expected_state = state.clone()
    o = gdr_mod._recurrent_step_batched(q, k, v, g, beta, state, True, None)
    # the torch form on a copy
    saved = gdr_mod.delta_step_native
    gdr_mod.delta_step_native = lambda *args: None
    try:
        o_torch = gdr_mod._recurrent_step_batched(q, k, v, g, beta, expected_state, True, None)
    finally:
        gdr_mod.delta_step_native = saved
    _close(o, o_torch, float(o_torch.abs().max()) + 1.0)
    _close(state, expected_state, float(expected_state.abs().max()) + 1.0)
    for i in range(n):   # the per-sequence reference
        o_ref, s_ref = gdr_mod.recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                                          beta[i:i + 1], before[1 + i, :size].view(heads, dk, dv))
        _close(o[i], o_ref[0], float(o_ref.abs().max()) + 1.0)
        _close(state[i], s_ref, float(s_ref.abs().max()) + 1.0)
    assert torch.equal(cache[0], before[0]) and torch.equal(cache[1 + n:], before[1 + n:])
    if row_layout:
        assert torch.equal(cache[:, size:], before[:, size:])


def test_delta_step_native_refuses_what_it_does_not_cover():
    state = torch.zeros(2, 1, 4, 4)
    kq, v, d, b = torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 4), torch.ones(2, 1), torch.ones(2, 1)
    assert delta_step_native(kq, v, d, b, state) is not None
    assert delta_step_native(kq, v, d, b, state.transpose(2, 3)) is None      # dv not unit stride
    assert delta_step_native(kq.bfloat16(), v, d, b, state) is None
    assert delta_step_native(kq[:, :, :1], v, d, b, state) is None             # shape mismatch


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.integers(1, 5), st.booleans(), st.booleans(), st.integers(0, 2 ** 31))
def test_conv_decode_step_native_equals_the_torch_path(n, channels, width, with_bias, silu, seed):
    """The varlen convolution's in-place decode path with the native step and with torch: same
    outputs, same cache (the window shifted by the new input), rows outside the slice untouched."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    cache = torch.randn(n + 4, channels, width - 1, generator=gen)
    cache_torch = cache.clone()
    args = (torch.arange(n + 1), torch.arange(n), torch.arange(2, 2 + n), torch.ones(n, dtype=torch.bool),
            'silu' if silu else None)
    y = conv_mod.causal_conv1d_varlen(x, weight, bias, cache, *args)
    saved = conv_mod.conv_decode_step_native
    conv_mod.conv_decode_step_native = lambda *a: None
    try:
        y_torch = conv_mod.causal_conv1d_varlen(x, weight, bias, cache_torch, *args)
    finally:
        conv_mod.conv_decode_step_native = saved
    _close(y, y_torch, float(y_torch.abs().max()) + 1.0)
    assert torch.equal(cache, cache_torch)          # the window is moved, not computed: exact


def test_conv_decode_step_native_refuses_what_it_does_not_cover():
    x, w = torch.zeros(2, 3), torch.zeros(3, 4)
    state = torch.zeros(2, 3, 3)
    assert conv_decode_step_native(x, state, w, None, True) is not None
    assert conv_decode_step_native(x, state.transpose(1, 2).contiguous().transpose(1, 2), w, None, True) is None
    assert conv_decode_step_native(x.double(), state.double(), w.double(), None, True) is None
    assert conv_decode_step_native(x, state[:, :, :2], w, None, True) is None


def _in_subprocess(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


_PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from lmdeploy.pytorch.kernels import cpu_native
from lmdeploy.pytorch.kernels.linear import linear
print('library', cpu_native.native_library() is not None)
x, w = torch.randn(8, 64), torch.randn(32, 64)
with torch.inference_mode():
    print('close', bool(torch.allclose(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-4)))
"""


@pytest.mark.parametrize('env, reason', [({'LMDEPLOY_CPU_KERNELS': '0'}, 'LMDEPLOY_CPU_KERNELS=0'),
                                         ({'CC': '/nonexistent/cc'}, 'No such file'),
                                         ({'CC': 'false'}, 'failed'),
                                         ({'CC': '', 'PATH': '/nonexistent'}, 'no C compiler')])
def test_switched_off_or_unbuildable_falls_back_to_torch_with_the_reason_logged(env, reason, tmp_path):
    done = _in_subprocess(_PROBE, LMDEPLOY_CACHE_DIR=str(tmp_path), **env)
    assert done.returncode == 0, done.stderr
    assert 'library False' in done.stdout and 'close True' in done.stdout
    assert reason in done.stdout and 'torch kernels run' in done.stdout


def test_build_is_cached_per_source_and_reused(tmp_path):
    first = _in_subprocess(_PROBE, LMDEPLOY_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0 and 'library True' in first.stdout, first.stderr + first.stdout
    built = sorted(p.name for p in (tmp_path / 'kernels').iterdir())
    assert len(built) == 1 and built[0].startswith('cpu_native_') and built[0].endswith('.so')
    again = _in_subprocess(_PROBE, LMDEPLOY_CACHE_DIR=str(tmp_path), CC='false')   # cached: no compile
    assert 'library True' in again.stdout, again.stderr + again.stdout
    assert sorted(p.name for p in (tmp_path / 'kernels').iterdir()) == built


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(1, 300), st.booleans(), st.booleans(), st.integers(0, 2 ** 31))
def test_rms_norm_native_equals_the_torch_layers(rows, dim, zero_centered, gated, seed):
    """RMSNorm (both weight conventions) and the gated norm against the layers' torch forms, on
    inputs that are views with a row stride wider than the row."""
    from lmdeploy.pytorch.models.layers import RMSNorm
    from lmdeploy.pytorch.models.blocks.gated_delta_net import GatedRMSNorm
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim + 3, generator=gen)[:, 1:1 + dim] * 3
    z = torch.randn(rows, dim, generator=gen)
    m = GatedRMSNorm(dim, 1e-6) if gated else RMSNorm(dim, 1e-6, zero_centered)
    with torch.no_grad():
        m.weight.copy_(torch.randn(dim, generator=gen))
    args = (x, z) if gated else (x,)
    expected = m(*args).detach()                # parameters require grad: the torch form
    with torch.inference_mode():
        native = m(*args)
    assert native.shape == x.shape and native.dtype == torch.float32
    _close(native, expected, float(expected.abs().max()) + 1.0)
    assert cpu_native.rms_norm_native(x, m.weight.detach(), 1e-6, zero_centered) is not None
    assert cpu_native.rms_norm_native(x.double(), m.weight.detach().double(), 1e-6, zero_centered) is None
    assert cpu_native.rms_norm_native(x, torch.ones(dim + 1), 1e-6, zero_centered) is None   # weight of another width


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3), (8, 2)]), st.sampled_from([8, 32, 40]),
       st.sampled_from([1, 4, 16]), st.integers(1, 5), st.integers(0, 2 ** 31))
def test_paged_decode_attention_native_equals_the_torch_kernel(n, heads, dim, block_size, width, seed):
    """Grouped heads, lengths from 1 key to a full block table, blocks in any order, K and V
    as views into one byte row per block (the engine's layout)."""
    from lmdeploy.pytorch.kernels.attention import paged_decode_attention, paged_decode_attention_cpu
    H, Hkv = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = n * width + 2
    kv_row = block_size * Hkv * dim
    rows = torch.randn(blocks, 2 * kv_row + 5, generator=gen)
    k_cache = rows[:, :kv_row].view(blocks, block_size, Hkv, dim)
    v_cache = rows[:, kv_row:2 * kv_row].view(blocks, block_size, Hkv, dim)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(n)])
    kv_seqlens = torch.randint(1, width * block_size + 1, (n,), generator=gen)
    kv_seqlens[0] = width * block_size                    # one full table, one single key where n > 1
    if n > 1:
        kv_seqlens[1] = 1
    q = torch.randn(n, H, dim, generator=gen) * 2
    out = paged_decode_attention_cpu(q, k_cache, v_cache, table, kv_seqlens, dim ** -0.5)
    ref = paged_decode_attention(q, k_cache, v_cache, table, kv_seqlens, dim ** -0.5)
    assert cpu_native.paged_decode_attention_native(q, k_cache, v_cache, table, kv_seqlens, dim ** -0.5) is not None
    _close(out, ref, float(ref.abs().max()) + 1.0)


def test_paged_decode_attention_native_refuses_bad_lengths_and_other_layouts():
    k_cache = torch.randn(4, 8, 2, 16)
    q, table = torch.randn(2, 4, 16), torch.tensor([[0, 1], [2, 3]])
    for bad in ([0, 3], [17, 3]):
        with pytest.raises(ValueError, match=r'kv_seqlens must be in \[1, 16\]'):
            cpu_native.paged_decode_attention_native(q, k_cache, k_cache, table, torch.tensor(bad), 0.25)
    ok = torch.tensor([16, 1])
    for bad_table in ([[0, 4], [2, 3]], [[0, 1], [-1, 3]]):      # a block id the lengths reach is out of range
        with pytest.raises(ValueError, match=r'block id outside \[0, 4\)'):
            cpu_native.paged_decode_attention_native(q, k_cache, k_cache, torch.tensor(bad_table), ok, 0.25)
    beyond = torch.tensor([[0, 1], [2, 99]])                     # sequence 1 has 1 key: its 2nd block is unused
    assert cpu_native.paged_decode_attention_native(q, k_cache, k_cache, beyond, ok, 0.25) is not None
    assert cpu_native.paged_decode_attention_native(q.bfloat16(), k_cache.bfloat16(), k_cache.bfloat16(), table,
                                                    ok, 0.25) is None
    assert cpu_native.paged_decode_attention_native(q, k_cache, k_cache.clone().transpose(0, 1).contiguous()
                                                    .transpose(0, 1), table, ok, 0.25) is None   # unequal strides
    assert cpu_native.paged_decode_attention_native(torch.randn(2, 3, 16), k_cache, k_cache, table, ok,
                                                    0.25) is None                  # 3 heads over 2 KV heads


def test_cache_folder_others_can_write_is_never_used(tmp_path, monkeypatch):
    """A library loaded from the cache runs in the server: a cache folder another user could
    write (or one that is not a folder) is passed over for a private one, never used."""
    shared = tmp_path / 'shared'
    (shared / 'kernels').mkdir(parents=True)
    (shared / 'kernels').chmod(0o777)
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(shared))
    chosen = next(cpu_native._candidate_folders())
    assert chosen != str(shared / 'kernels')
    st = os.stat(chosen)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022
    private = tmp_path / 'private'
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(private))
    assert next(cpu_native._candidate_folders()) == str(private / 'kernels')
    assert not os.stat(private / 'kernels').st_mode & 0o077        # created 0700
    (tmp_path / 'file').write_text('')
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'file'))   # kernels/ cannot be made under a file
    assert next(cpu_native._candidate_folders()) != str(tmp_path / 'file' / 'kernels')
    monkeypatch.delenv('LMDEPLOY_CACHE_DIR')                 # the same root as the weight digests' cache
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert next(cpu_native._candidate_folders()) == str(tmp_path / 'xdg' / 'lmdeploy' / 'kernels')
    from lmdeploy.pytorch.store.identity import digest_cache_dir
    assert digest_cache_dir() == tmp_path / 'xdg' / 'lmdeploy' / 'weight-digests'


_WHERE = _PROBE + """
print('loaded', cpu_native._LIB is not None and cpu_native._LIB._name)
"""


def test_a_symlinked_cache_folder_is_never_used(tmp_path):
    """A folder reached through a symlink could be swapped between the check and the load."""
    target = tmp_path / 'target'
    target.mkdir(mode=0o700)
    root = tmp_path / 'root'
    root.mkdir()
    (root / 'kernels').symlink_to(target)
    assert not cpu_native._trusted_folder(str(root / 'kernels'))
    done = _in_subprocess(_WHERE, LMDEPLOY_CACHE_DIR=str(root))
    assert 'library True' in done.stdout, done.stdout + done.stderr
    assert not list(target.iterdir())                              # built elsewhere (the temp folder)


def test_a_library_others_can_write_or_of_another_version_is_not_loaded(tmp_path):
    """A cached file others could have written is refused, as is a file without the kernels'
    entry points (another version): the next folder is used (built there), and the engine
    never fails over it."""
    root = tmp_path / 'cache'
    (root / 'kernels').mkdir(parents=True, mode=0o700)
    lib = root / 'kernels' / cpu_native._library_name()
    lib.write_bytes(b'not a library')
    lib.chmod(0o666)
    done = _in_subprocess(_WHERE, LMDEPLOY_CACHE_DIR=str(root))
    # built in the next folder, the reason logged
    assert 'library True' in done.stdout and 'not a private file' in done.stdout, done.stdout + done.stderr
    loaded_from = [line for line in done.stdout.splitlines() if line.startswith('loaded ')][-1]
    assert str(lib) not in loaded_from                               # the other folder's build
    foreign = tmp_path / 'foreign.c'
    foreign.write_text('int lm_unrelated(void) { return 0; }\n')
    lib.unlink()
    subprocess.run(['cc', '-shared', '-fPIC', str(foreign), '-o', str(lib)], check=True)
    lib.chmod(0o700)
    done = _in_subprocess(_WHERE + "\nprint('calls ok', cpu_native.native_library() is cpu_native._LIB)",
                          LMDEPLOY_CACHE_DIR=str(root))
    assert done.returncode == 0 and 'library True' in done.stdout and 'close True' in done.stdout, done.stderr
    assert 'undefined symbol' in done.stdout or 'lm_matmul_rows' in done.stdout   # the reason, logged


def test_a_read_only_cache_with_the_library_is_used_without_a_compiler(tmp_path):
    root = tmp_path / 'cache'
    first = _in_subprocess(_PROBE, LMDEPLOY_CACHE_DIR=str(root))
    assert 'library True' in first.stdout, first.stdout + first.stderr
    (root / 'kernels').chmod(0o500)
    try:
        again = _in_subprocess(_WHERE, LMDEPLOY_CACHE_DIR=str(root), CC='', PATH='/nonexistent')
    finally:
        (root / 'kernels').chmod(0o700)
    assert 'library True' in again.stdout and str(root / 'kernels') in again.stdout, again.stdout + again.stderr


def test_attention_gives_a_key_with_an_infinite_negative_score_zero_weight():
    """A score of -inf (here: finite values whose product overflows) weighs nothing, first
    key or not, as in torch; no NaN."""
    from lmdeploy.pytorch.kernels.attention import paged_decode_attention
    k_cache = torch.randn(2, 4, 1, 8)
    k_cache[0, 0] = -3e38                                    # the first key of sequence 0
    k_cache[1, 2] = -3e38                                    # a later key of sequence 1
    v_cache = torch.randn(2, 4, 1, 8)
    q = torch.full((2, 2, 8), 10.0)
    table, lengths = torch.tensor([[0], [1]]), torch.tensor([4, 4])
    out = cpu_native.paged_decode_attention_native(q, k_cache, v_cache, table, lengths, 1.0)
    ref = paged_decode_attention(q, k_cache, v_cache, table, lengths, 1.0)
    assert not out.isnan().any() and not ref.isnan().any()
    _close(out, ref, float(ref.abs().max()) + 1.0)



def test_attention_gives_nan_for_a_nan_first_key_as_torch_does():
    """A NaN score on the first key (the running max still -inf) propagates, as in torch's
    attention, instead of being skipped like a -inf one."""
    from lmdeploy.pytorch.kernels.attention import paged_decode_attention
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 4, 1, 8, generator=gen)
    k_cache[0, 0, 0, 3] = float('nan')                        # the first key of sequence 0
    q = torch.randn(2, 2, 8, generator=gen)
    table, lengths = torch.tensor([[0], [1]]), torch.tensor([4, 4])
    out = cpu_native.paged_decode_attention_native(q, k_cache, v_cache, table, lengths, 1.0)
    ref = paged_decode_attention(q, k_cache, v_cache, table, lengths, 1.0)
    assert out[0].isnan().all() and ref[0].isnan().all()
    assert not out[1].isnan().any()
    _close(out[1], ref[1], 1.0)


def test_mla_decode_gives_nan_for_a_nan_first_row_as_torch_does():
    """The MLA decode kernel's online softmax: a NaN score on a sequence's first cached row
    propagates as in its torch form."""
    from lmdeploy.pytorch.kernels.fused_decode import mla_decode_native, mla_decode_torch
    gen = torch.Generator().manual_seed(1)
    H, N, R, P, bs = 3, 2, 16, 4, 4
    cache = torch.randn(4, bs, R + P, generator=gen)
    cache[0, 0, 5] = float('nan')                             # sequence 0's row 0
    args = (torch.randn(H, N, R, generator=gen), torch.randn(N, H, P, generator=gen),
            torch.randn(N, R + P, generator=gen), torch.rand(R, generator=gen) + 0.5, 1e-6, None, None)
    where = (torch.tensor([1, 3]), torch.tensor([1, 2]), torch.tensor([[0, 1], [2, 3]]), torch.tensor([6, 7]))
    out = mla_decode_native(*args, cache.clone(), *where, 0.2)
    ref = mla_decode_torch(*args, cache.clone(), *where, 0.2)
    assert out[:, 0].isnan().all() and ref[:, 0].isnan().all()
    assert not out[:, 1].isnan().any()
    _close(out[:, 1], ref[:, 1], 1.0)

@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_a_cpu_engine_builds_the_kernels_when_it_starts(tiny_qwen3_next, dtype, tmp_path):
    """The build (about a second) happens at engine start, not in the first request; bf16 too
    (its float32 recurrent state uses the delta-rule kernel)."""
    code = f"""
from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu_native
assert not cpu_native._TRIED
engine = Engine({tiny_qwen3_next!r}, PytorchEngineConfig(device_type='cpu', dtype={dtype!r}, num_gpu_blocks=16))
print('tried', cpu_native._TRIED, 'loaded', cpu_native._LIB is not None, 'calls', sum(cpu_native.CALLS.values()))
"""
    done = _in_subprocess(code, LMDEPLOY_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert 'tried True loaded True calls 0' in done.stdout, done.stdout
