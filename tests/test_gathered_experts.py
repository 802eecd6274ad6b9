"""The relu^2 and limited-SwiGLU expert layers without a host read of the routing
(``relu2_experts_gathered``, ``limited_swiglu_experts_gathered``: the CUDA path for decode-sized
batches, callable on any device, tested here on the CPU): over random shapes, top-k 1 to 4, one
token, expert ids repeated across tokens and limits that bite, they equal the loop to float32
rounding (measured against float64: the loop's own distance times 4 plus 1e-5 of the scale, as
tests/numerics.close_to_measured_rounding), sum the slots in the loop's order, read nothing on
the host (what a CUDA graph capture refuses), chunk without changing a bit, and refuse bad
input with a ValueError. The GPU check is in tests/test_cuda.py."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from host_reads import HostReads
from lmdeploy.pytorch.kernels import get_kernel, moe
from lmdeploy.pytorch.kernels.moe import (GATHER_PAIRS_PER_EXPERT, gathered_applies, limited_swiglu_experts_cuda,
                                          limited_swiglu_experts_gathered, limited_swiglu_experts_loop,
                                          relu2_experts_cuda, relu2_experts_gathered, relu2_experts_loop)


def _routing(T, E, k, hit, gen):
    """``T`` tokens each choosing ``k`` distinct experts among the first ``hit``: ids repeat
    across tokens whenever ``T * k > hit``."""
    index = torch.stack([torch.randperm(hit, generator=gen)[:k] for _ in range(T)])
    return index, torch.rand(T, k, generator=gen) + 1e-3


def _relu2_layer(T, E, k, hit, D, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    up = torch.randn(E, inter, D, generator=gen) * D ** -0.5
    down = torch.randn(E, D, inter, generator=gen) * inter ** -0.5
    return (x, *_routing(T, E, k, hit, gen), up, down)


def _limited_layer(T, E, k, hit, H, inter, seed):
    """gate and up with a standard deviation of about 3: limits of 0.5 to 7 clip some of them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    gate_up = torch.randn(E, 2 * inter, H, generator=gen) * 3 * H ** -0.5
    down = torch.randn(E, H, inter, generator=gen) * inter ** -0.5
    return (x, *_routing(T, E, k, hit, gen), gate_up, down)


def _float64(x, index, weights, w1, w2, act):
    x, weights, w1, w2 = (t.double() for t in (x, weights, w1, w2))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(index[t].tolist(), weights[t]):
            out[t] += w * (w2[e] @ act(w1[e] @ x[t]))
    return out


def _limited64(act, limit):
    def fn(h):
        gate, up = h.chunk(2)
        if act == 'clamped':
            return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        if limit:
            return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
        return F.silu(gate) * up
    return fn


def _within_rounding(got, loop, exact):
    own = (loop.double() - exact).abs().max().item()
    err = (got.double() - loop.double()).abs().max().item()
    assert err <= 4 * own + 1e-5 * (1.0 + exact.abs().max().item()), (err, own)


_ACTS = st.sampled_from([('clipped', 0.0), ('clipped', 0.5), ('clipped', 7.0), ('clamped', 0.5), ('clamped', 2.0),
                         ('clamped', 7.0)])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.integers(1, 4), st.sampled_from([8, 16, 33]),
       st.sampled_from([5, 16, 24]), st.data())
@example(T=1, E=8, k=4, D=16, inter=24, data=None)
@example(T=9, E=2, k=1, D=33, inter=5, data=None)           # every token on one of two experts
def test_relu2_gathered_equals_the_loop_to_float32_rounding(T, E, k, D, inter, data):
    k = min(k, E)
    hit = E if data is None else data.draw(st.integers(k, E), label='experts hit')
    seed = 0 if data is None else data.draw(st.integers(0, 2 ** 31), label='seed')
    layer = _relu2_layer(T, E, k, hit, D, inter, seed)
    got = relu2_experts_gathered(*layer)
    assert got.shape == (T, D) and got.dtype == torch.float32
    _within_rounding(got, relu2_experts_loop(*layer), _float64(*layer, lambda h: F.relu(h) ** 2))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.integers(1, 4), st.sampled_from([8, 16, 33]),
       st.sampled_from([5, 16, 24]), _ACTS, st.data())
@example(T=1, E=8, k=4, H=16, inter=24, act=('clipped', 0.5), data=None)
@example(T=9, E=2, k=1, H=33, inter=5, act=('clamped', 2.0), data=None)
def test_limited_swiglu_gathered_equals_the_loop_to_float32_rounding(T, E, k, H, inter, act, data):
    k = min(k, E)
    hit = E if data is None else data.draw(st.integers(k, E), label='experts hit')
    seed = 0 if data is None else data.draw(st.integers(0, 2 ** 31), label='seed')
    layer = (*_limited_layer(T, E, k, hit, H, inter, seed), *act)
    got = limited_swiglu_experts_gathered(*layer)
    assert got.shape == (T, H) and got.dtype == torch.float32
    _within_rounding(got, limited_swiglu_experts_loop(*layer), _float64(*layer[:5], _limited64(*act)))


def _per_slot(fn, layer, k):
    """Each slot alone (top-1 with that slot's experts and weights), then summed in slot order."""
    x, index, weights, *rest = layer
    parts = [fn(x, index[:, j:j + 1], weights[:, j:j + 1], *rest) for j in range(k)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def test_the_slots_are_summed_in_slot_order():
    """Top-1 per slot (the same products), then added in slot order: bit for bit the gathered
    layer; the slots summed in reverse order differ somewhere (the order is observable)."""
    layer = _relu2_layer(16, 8, 4, 8, 16, 24, seed=3)
    got = relu2_experts_gathered(*layer)
    assert torch.equal(got, _per_slot(relu2_experts_gathered, layer, 4))
    x, index, weights, up, down = layer
    flipped = relu2_experts_gathered(x, index.flip(1), weights.flip(1), up, down)
    assert not torch.equal(got, flipped) and torch.allclose(got, flipped, rtol=0, atol=1e-5)


def test_the_limits_bite():
    layer = _limited_layer(8, 4, 2, 4, 16, 24, seed=5)
    free = limited_swiglu_experts_gathered(*layer, 'clipped', 0.0)
    clipped = limited_swiglu_experts_gathered(*layer, 'clipped', 0.5)
    clamped = limited_swiglu_experts_gathered(*layer, 'clamped', 0.5)
    assert not torch.equal(free, clipped) and not torch.equal(clipped, clamped)
    assert torch.equal(limited_swiglu_experts_gathered(*layer, 'clipped', 1e30), free)


def test_chunks_change_nothing(monkeypatch):
    """Pairs gathered in chunks of 3 (a bound far below one layer): the same products and sums,
    so the relu^2 layer is bit for bit the one-chunk result; the limited layer within float32
    rounding, because torch's CPU ``silu`` rounds its vectorised body and its scalar tail apart
    (1 ulp, measured) and the chunks move which channels fall in the tail."""
    relu2 = _relu2_layer(7, 6, 3, 6, 16, 8, seed=7)
    limited = (*_limited_layer(7, 6, 3, 6, 16, 8, seed=8), 'clamped', 0.5)
    whole = relu2_experts_gathered(*relu2), limited_swiglu_experts_gathered(*limited)
    per_pair = (16 * 8 + 16 * 8) * 4
    monkeypatch.setattr(moe, 'GATHER_CHUNK_BYTES', 3 * per_pair)
    assert torch.equal(relu2_experts_gathered(*relu2), whole[0])
    per_pair = (2 * 16 * 8 + 16 * 8) * 4
    monkeypatch.setattr(moe, 'GATHER_CHUNK_BYTES', 3 * per_pair)
    _within_rounding(limited_swiglu_experts_gathered(*limited), whole[1],
                     _float64(*limited[:5], _limited64('clamped', 0.5)))


def test_bfloat16_equals_the_loop_to_bfloat16_rounding():
    """The products run in the input dtype as the loop's do; weighted sums in float32."""
    x, index, weights, up, down = _relu2_layer(5, 8, 2, 8, 32, 16, seed=9)
    args = (x.bfloat16(), index, weights, up.bfloat16(), down.bfloat16())
    got, loop = relu2_experts_gathered(*args), relu2_experts_loop(*args)
    assert got.dtype == torch.bfloat16
    # bfloat16 keeps 8 mantissa bits: two roundings of the intermediate apart, 2**-6 of the scale
    scale = loop.float().abs().max().item()
    assert (got.float() - loop.float()).abs().max().item() <= 2 ** -6 * scale


def test_reads_nothing_on_the_host_where_the_loop_does():
    relu2 = _relu2_layer(4, 8, 2, 8, 16, 8, seed=10)
    limited = (*_limited_layer(4, 8, 2, 8, 16, 8, seed=11), 'clipped', 0.5)
    for gathered, loop, layer in ((relu2_experts_gathered, relu2_experts_loop, relu2),
                                  (limited_swiglu_experts_gathered, limited_swiglu_experts_loop, limited)):
        with HostReads() as reads:
            gathered(*layer)
        assert reads.seen == []
        with HostReads() as reads:
            loop(*layer)
        assert 'tolist' in reads.seen          # the detector sees what the loop reads


def test_the_cuda_kernels_gather_decode_batches_and_loop_beyond():
    assert get_kernel('relu2_experts', 'cuda') is relu2_experts_cuda
    assert get_kernel('limited_swiglu_experts', 'cuda') is limited_swiglu_experts_cuda
    E, k = 8, 2
    most = GATHER_PAIRS_PER_EXPERT * E // k
    assert gathered_applies(most, k, E) and not gathered_applies(most + 1, k, E)
    for T in (most, most + 1):
        relu2 = _relu2_layer(T, E, k, E, 16, 8, seed=T)
        limited = (*_limited_layer(T, E, k, E, 16, 8, seed=T), 'clamped', 2.0)
        for cuda, gathered, loop, layer in ((relu2_experts_cuda, relu2_experts_gathered, relu2_experts_loop, relu2),
                                            (limited_swiglu_experts_cuda, limited_swiglu_experts_gathered,
                                             limited_swiglu_experts_loop, limited)):
            with HostReads() as reads:
                got = cuda(*layer)
            assert torch.equal(got, (gathered if T == most else loop)(*layer))
            assert (reads.seen == []) == (T == most)


def test_bad_input_is_a_value_error_naming_the_field():
    x, index, weights, up, down = _relu2_layer(3, 4, 2, 4, 16, 8, seed=12)
    with pytest.raises(ValueError, match='weights must be'):
        relu2_experts_gathered(x, index, weights[:, :1], up, down)
    with pytest.raises(ValueError, match='index must be int64 or int32'):
        relu2_experts_gathered(x, index.float(), weights, up, down)
    with pytest.raises(ValueError, match='expected x'):
        relu2_experts_gathered(x, index[:2], weights[:2], up, down)
    with pytest.raises(ValueError, match='expert weights'):
        relu2_experts_gathered(x, index, weights, up, down[:, :, :4])
    x, index, weights, gate_up, down = _limited_layer(3, 4, 2, 4, 16, 8, seed=13)
    with pytest.raises(ValueError, match='act must be one of'):
        limited_swiglu_experts_gathered(x, index, weights, gate_up, down, 'relu', 1.0)
    with pytest.raises(ValueError, match='expert weights'):
        limited_swiglu_experts_gathered(x, index, weights, gate_up[:, :12], down, 'clipped', 1.0)
    with pytest.raises(ValueError, match='gate_up must be'):            # 2I + 1 rows: 17 // 2 matches down
        limited_swiglu_experts_gathered(x, index, weights, torch.cat([gate_up, gate_up[:, :1]], 1), down,
                                        'clamped', 1.0)
    assert torch.equal(relu2_experts_gathered(x[:, :16], index.int(), weights, up, down[:, :16]),
                       relu2_experts_gathered(x[:, :16], index, weights, up, down[:, :16]))


def test_an_empty_batch_gives_an_empty_result_as_the_loop():
    relu2 = _relu2_layer(3, 4, 2, 4, 16, 8, seed=14)
    limited = _limited_layer(3, 4, 2, 4, 16, 8, seed=15)
    cases = ((relu2_experts_gathered, relu2_experts_loop, relu2, ()),
             (limited_swiglu_experts_gathered, limited_swiglu_experts_loop, limited, ('clamped', 2.0)))
    for gathered, loop, (x, index, weights, w1, w2), extra in cases:
        empty = (x[:0], index[:0], weights[:0], w1, w2, *extra)
        got, want = gathered(*empty), loop(*empty)
        assert got.shape == want.shape == (0, 16) and got.dtype == want.dtype == x.dtype
        # no choice per token: the empty sum (the loop has no such case to compare with)
        assert torch.equal(gathered(x, index[:, :0], weights[:, :0], w1, w2, *extra), torch.zeros(3, 16))
