"""Ling 3's clipped and GLM-5.3-Flash's clamped SwiGLU experts in one native call
(``limited_swiglu_experts_native``, the CPU implementation of the ``limited_swiglu_experts``
kernel): over expert counts, top-k, empty experts, widths that are not a multiple of the vector
length, limits that bite and row counts of a decode step or a short prompt, it sums each output
element in the torch loop's order (bit for bit once both use the same ``silu``: the C library's
``expf``), stays within float32 rounding of a float64 reference and of the loop with torch's
``silu``, keeps NaN where torch does, refuses what it does not cover, and reads nothing into
Python, so a decode graph replays a Ling 3 MoE layer."""
import ctypes
import ctypes.util
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dispatch_log import one_native_call
from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.cpu_native import NATIVE_EXPERT_TOKENS, limited_swiglu_experts_native, native_library
from lmdeploy.pytorch.kernels.moe import (limited_swiglu_experts_cpu, limited_swiglu_experts_cuda,
                                          limited_swiglu_experts_loop)

pytestmark = pytest.mark.skipif(native_library() is None, reason='native CPU kernels could not be built here '
                                '(no C compiler with OpenMP, or LMDEPLOY_CPU_KERNELS=0)')

_LIBM = ctypes.CDLL(ctypes.util.find_library('m'))
_LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def _libm_silu(g: torch.Tensor) -> torch.Tensor:
    """``g / (1 + expf(-g))`` in float32 with the C library's ``expf``: the native layer's silu
    (torch's rounds differently in the last bit for a few percent of inputs)."""
    e = torch.tensor([_LIBM.expf(-v) for v in g.flatten().tolist()], dtype=torch.float32).view(g.shape)
    return g / (1.0 + e)


def _layer(T, E, k, hit, H, inter, seed):
    """A random layer and routing: ``T`` tokens each choosing ``k`` distinct experts among the
    first ``hit`` of ``E`` (the others stay empty), float32 weights in (0, 1]; gate and up come
    out with a standard deviation of about 3, so limits of 0.5 to 7 clip some of them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    gate_up = torch.randn(E, 2 * inter, H, generator=gen) * 3 * H ** -0.5
    down = torch.randn(E, H, inter, generator=gen) * inter ** -0.5
    index = torch.stack([torch.randperm(hit, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen) + 1e-3
    return x, index, weights, gate_up, down


def _loop_with_libm_silu(*args):
    with mock.patch.object(F, 'silu', _libm_silu):
        return limited_swiglu_experts_loop(*args)


def _float64(x, index, weights, gate_up, down, act, limit):
    x, weights, gate_up, down = (t.double() for t in (x, weights, gate_up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(index[t].tolist(), weights[t]):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            if act == 'clamped':
                a = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            elif limit:
                a = F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
            else:
                a = F.silu(gate) * up
            out[t] += w * (down[e] @ a)
    return out


def _within_rounding(got, loop, exact):
    """``got`` within float32 rounding of ``loop``, measured as the loop's own distance from
    float64 (times 4, plus 1e-5 of the scale), as ``tests/numerics.close_to_measured_rounding``."""
    own = (loop.double() - exact).abs().max().item()
    err = (got.double() - loop.double()).abs().max().item()
    assert err <= 4 * own + 1e-5 * (1.0 + exact.abs().max().item()), (err, own)


# 0.1 is not a float32: the limit rounds to float32 in both (torch casts the clamp's scalar)
_ACTS = st.sampled_from([('clipped', 0.0), ('clipped', 0.1), ('clipped', 0.5), ('clipped', 7.0), ('clamped', 0.1),
                         ('clamped', 0.5), ('clamped', 2.0), ('clamped', 7.0)])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24), st.integers(2, 16), st.integers(1, 6), st.sampled_from([8, 16, 33]),
       st.sampled_from([5, 16, 24]), _ACTS, st.data())
@example(T=1, E=8, k=6, H=16, inter=24, act=('clipped', 0.5), data=None)   # 6 choices: sum(1) would reorder
@example(T=24, E=2, k=1, H=33, inter=5, act=('clamped', 2.0), data=None)   # 24 rows per expert
def test_sums_in_slot_order_and_within_float32_rounding_of_float64(T, E, k, H, inter, act, data):
    k = min(k, E)
    hit = E if data is None else data.draw(st.integers(k, E), label='experts hit')
    seed = 0 if data is None else data.draw(st.integers(0, 2 ** 31), label='seed')
    layer = (*_layer(T, E, k, hit, H, inter, seed), *act)
    got = limited_swiglu_experts_native(*layer)
    assert got.shape == (T, H) and got.dtype == torch.float32
    assert torch.equal(got, _loop_with_libm_silu(*layer))
    _within_rounding(got, limited_swiglu_experts_loop(*layer), _float64(*layer))


def test_the_limits_bite_and_the_activations_differ():
    """The test layers reach the limits: each limit changes the result, and clip != clamp."""
    layer = _layer(8, 4, 2, 4, 16, 24, seed=5)
    free = limited_swiglu_experts_native(*layer, 'clipped', 0.0)
    clipped = limited_swiglu_experts_native(*layer, 'clipped', 0.5)
    clamped = limited_swiglu_experts_native(*layer, 'clamped', 0.5)
    assert not torch.equal(free, clipped) and not torch.equal(clipped, clamped) and not torch.equal(free, clamped)
    assert torch.equal(limited_swiglu_experts_native(*layer, 'clipped', 1e30), free)


def test_a_prompt_of_128_tokens_matches_the_loop_to_float32_rounding():
    """Beyond 24 rows per expert the loop's products are MKL's (another sum order): equal to
    float32 rounding, as measured against float64."""
    for act, limit in (('clipped', 0.5), ('clamped', 2.0)):
        layer = (*_layer(NATIVE_EXPERT_TOKENS, 4, 2, 4, 40, 24, seed=1), act, limit)
        _within_rounding(limited_swiglu_experts_native(*layer), limited_swiglu_experts_loop(*layer), _float64(*layer))


@pytest.mark.parametrize('act', ['clipped', 'clamped'])
def test_a_nan_gate_stays_nan_as_in_torch(act):
    """A NaN gate channel of expert 0 (its up finite): torch's clamps keep the NaN, so every
    token routed to expert 0 comes out NaN, the others finite and equal (``fminf`` would have
    turned the NaN into the limit)."""
    x, index, weights, gate_up, down = _layer(6, 4, 2, 4, 16, 8, seed=6)
    gate_up[0, 3] = float('nan')
    layer = (x, index, weights, gate_up, down, act, 0.5)
    got, want = limited_swiglu_experts_native(*layer), _loop_with_libm_silu(*layer)
    routed = (index == 0).any(1)
    assert routed.any() and not routed.all()
    assert torch.isnan(got).all(1).equal(routed) and torch.isnan(want).all(1).equal(routed)
    assert torch.equal(got[~routed], want[~routed])


def test_refuses_what_it_does_not_cover_and_the_cpu_kernel_falls_back_to_the_loop():
    x, index, weights, gate_up, down = _layer(3, 4, 2, 4, 16, 8, seed=2)
    with pytest.raises(ValueError, match=r'expert index out of range \[0, 4\)'):
        limited_swiglu_experts_native(x, index.clamp(max=3) + 1, weights, gate_up, down, 'clipped', 1.0)
    with pytest.raises(ValueError, match='expected x'):
        limited_swiglu_experts_native(x, index, weights, gate_up, down[:, :, :4], 'clipped', 1.0)
    for fn in (limited_swiglu_experts_native, limited_swiglu_experts_loop):
        with pytest.raises(ValueError, match="act must be one of"):
            fn(x, index, weights, gate_up, down, 'relu', 1.0)
    many = _layer(NATIVE_EXPERT_TOKENS + 1, 4, 2, 4, 16, 8, seed=3)
    grad = gate_up.clone().requires_grad_()
    for args in (many, (x.bfloat16(), index, weights, gate_up.bfloat16(), down.bfloat16()),
                 (x, index.int(), weights, gate_up, down), (x[:0], index[:0], weights[:0], gate_up, down),
                 (x, index, weights, grad, down)):
        assert limited_swiglu_experts_native(*args, 'clamped', 2.0) is None
        with torch.no_grad():
            assert torch.equal(limited_swiglu_experts_cpu(*args, 'clamped', 2.0),
                               limited_swiglu_experts_loop(*args, 'clamped', 2.0))
    assert limited_swiglu_experts_cpu(x, index, weights, grad, down, 'clamped', 2.0).requires_grad
    assert get_kernel('limited_swiglu_experts', 'cpu') is limited_swiglu_experts_cpu
    assert get_kernel('limited_swiglu_experts', 'cuda') is limited_swiglu_experts_cuda


def test_ling3_moe_layer_is_one_native_call_and_reads_nothing_into_python():
    """A Ling 3 (clipped) MoE layer's routed experts on a float32 decode batch: one native call
    and no tensor value read into Python (what refused Ling 3's decode graph: the old per-expert
    loop's ``index.unique().tolist()``), and the loop's result."""
    from lmdeploy.pytorch.models.blocks.moe import LimitedExperts, clipped_swiglu

    experts = LimitedExperts(8, 24, 20, 0.75, clipped_swiglu).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 24, generator=gen)
    index = torch.tensor([[0, 5], [5, 2], [7, 0]])
    weights = torch.rand(3, 2, generator=gen)

    got, ops = one_native_call(lambda: experts(x, index, weights), 'limited_swiglu_experts')
    assert not {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.unique_dim.default,
                torch.ops.aten._unique2.default, torch.ops.aten.nonzero.default} & ops
    with torch.no_grad():
        want = limited_swiglu_experts_native(x, index, weights, experts.gate_up_proj, experts.down_proj, 'clipped',
                                             0.75)
    assert torch.equal(got, want)
