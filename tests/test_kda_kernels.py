"""Kimi Delta Attention kernels against the token-by-token reference: the chunked form for any
length and chunk size (with and without an initial state), pieces carried through the state
equal one pass, and the varlen kernel over mixed decode / prefill sequences in scrambled,
NaN-poisoned slots equals each sequence run alone."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.kimi_delta_attention import chunk_kda, kda_varlen, recurrent_kda

TOL = 2e-5


def _inputs(L, H=2, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, H, dk, generator=gen), torch.randn(L, H, dk, generator=gen)
    v = torch.randn(L, H, dv, generator=gen)
    g = -torch.rand(L, H, dk, generator=gen) * 2.0          # per-channel log decays in (-2, 0]
    beta = torch.rand(L, H, generator=gen)
    return q, k, v, g, beta


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 90), chunk=st.sampled_from([4, 16, 32, 64]), with_state=st.booleans(),
       seed=st.integers(0, 1000))
def test_chunk_equals_recurrent(L, chunk, with_state, seed):
    q, k, v, g, beta = _inputs(L, seed=seed)
    s0 = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(seed + 1)) if with_state else None
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, s0)
    o, s = chunk_kda(q, k, v, g, beta, s0, chunk_size=chunk)
    assert (o - o_ref).abs().max() <= TOL and (s - s_ref).abs().max() <= TOL


def test_pieces_carry_the_state():
    q, k, v, g, beta = _inputs(70, seed=3)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta)
    o1, s1 = chunk_kda(q[:33], k[:33], v[:33], g[:33], beta[:33])
    o2, s2 = chunk_kda(q[33:], k[33:], v[33:], g[33:], beta[33:], s1)
    assert (torch.cat((o1, o2)) - o_ref).abs().max() <= TOL and (s2 - s_ref).abs().max() <= TOL


def test_a_per_channel_decay_differs_from_a_per_head_one():
    """The kernel really decays channel by channel: replacing g by its per-head mean changes it."""
    q, k, v, g, beta = _inputs(20, seed=5)
    o, _ = chunk_kda(q, k, v, g, beta)
    o_mean, _ = chunk_kda(q, k, v, g.mean(-1, keepdim=True).expand_as(g).contiguous(), beta)
    assert (o - o_mean).abs().max() > 1e-3


def test_varlen_equals_each_sequence_alone():
    lengths, history = [5, 1, 40, 1, 2], [False, True, True, False, True]
    H, dk, dv, slots_n = 2, 8, 6, 9
    cache = torch.full((slots_n, H, dk, dv), float('nan'))
    slots = torch.tensor([7, 2, 5, 0, 3])
    gen = torch.Generator().manual_seed(9)
    states = [torch.randn(H, dk, dv, generator=gen) for _ in lengths]
    for s, st_, h in zip(slots.tolist(), states, history):
        if h:
            cache[s] = st_
    q, k, v, g, beta = _inputs(sum(lengths), H, dk, dv, seed=11)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    out = get_kernel('kda_varlen', 'cpu')(q, k, v, g, beta, cache, cu, slots, torch.tensor(history))
    assert get_kernel('kda_varlen', 'cpu') is kda_varlen
    for i, n in enumerate(lengths):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        o_ref, s_ref = recurrent_kda(q[sl], k[sl], v[sl], g[sl], beta[sl], states[i] if history[i] else None)
        assert (out[sl] - o_ref).abs().max() <= TOL
        assert (cache[slots[i]] - s_ref).abs().max() <= TOL
    untouched = [s for s in range(slots_n) if s not in slots.tolist()]
    assert torch.isnan(cache[untouched]).all()


def test_bad_shapes_are_refused():
    q, k, v, g, beta = _inputs(4)
    with pytest.raises(ValueError, match='g'):
        recurrent_kda(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match='chunk_size'):
        chunk_kda(q, k, v, g, beta, chunk_size=0)
