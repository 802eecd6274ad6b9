"""Gated delta rule and causal conv1d kernels: chunked == recurrent == the paper's recurrence,
and running a sequence in pieces with a carried state equals one pass."""
import pytest
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.causal_conv1d import causal_conv1d
from lmdeploy.pytorch.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

H, DK, DV = 3, 8, 6


def _inputs(L, seed=0, H=H, dk=DK, dv=DV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, H, dk, generator=gen)
    k = torch.randn(L, H, dk, generator=gen)
    v = torch.randn(L, H, dv, generator=gen)
    # Decays between exp(-2) and 1, as softplus-gated Qwen3-Next layers produce.
    g = -2.0 * torch.rand(L, H, generator=gen)
    beta = torch.rand(L, H, generator=gen)
    return q, k, v, g, beta


def _state(seed=1):
    return torch.randn(H, DK, DV, generator=torch.Generator().manual_seed(seed))


def _naive(q, k, v, g, beta, state):
    """Gated delta rule written as in the paper: S <- a (I - b k k^T) S + b k v^T, o = S^T q."""
    q = F.normalize(q, dim=-1, eps=0) * q.shape[-1] ** -0.5  # eps 1e-6 inside the root is negligible
    k = F.normalize(k, dim=-1, eps=0)
    S = state.clone().double()
    out = []
    for t in range(q.shape[0]):
        o_t = []
        for h in range(q.shape[1]):
            kt, vt, qt = k[t, h].double(), v[t, h].double(), q[t, h].double()
            eye = torch.eye(kt.numel(), dtype=torch.float64)
            a, b = torch.exp(g[t, h].double()), beta[t, h].double()
            S[h] = a * (eye - b * torch.outer(kt, kt)) @ S[h] + b * torch.outer(kt, vt)
            o_t.append(S[h].T @ qt)
        out.append(torch.stack(o_t))
    return torch.stack(out).float(), S.float()


def test_recurrent_matches_paper_recurrence():
    q, k, v, g, beta = _inputs(7)
    state = _state()
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o_ref, s_ref = _naive(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize('L', [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize('with_state', [False, True])
def test_chunked_equals_recurrent(L, with_state):
    q, k, v, g, beta = _inputs(L, seed=L)
    state = _state() if with_state else None
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=64)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert o_c.shape == (L, H, DV) and s_c.shape == (H, DK, DV) and s_c.dtype == torch.float32
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=0)


@pytest.mark.parametrize('L', [1, 40, 64, 130])
def test_chunked_without_a_state_is_bitwise_the_zero_state_run(L):
    """``initial_state=None`` skips the first chunk's products with the (zero) state; the result
    is the explicit zero state's exactly (x - 0, 0 + x and 0 * d + x are exact)."""
    q, k, v, g, beta = _inputs(L, seed=10 + L)
    zero = torch.zeros(H, DK, DV)
    o0, s0 = chunk_gated_delta_rule(q, k, v, g, beta, None, chunk_size=32)
    o1, s1 = chunk_gated_delta_rule(q, k, v, g, beta, zero, chunk_size=32)
    assert torch.equal(o0, o1) and torch.equal(s0, s1)


@pytest.mark.parametrize('decay_scale', [2.0, 20.0, 200.0])
def test_chunked_strong_decay_flush_changes_nothing_and_leaves_no_subnormals(decay_scale, monkeypatch):
    """Strong decays (``g`` down to -200 per token) drive the chunk's decay factors far below
    float32's normal range. Flushing factors under exp(-60) to 0 gives the same output and state
    as not flushing, none of the factors is subnormal, and (where the chunked form itself is
    within 1e-5 of the token-by-token form, i.e. up to g = -20) it still equals that form."""
    from lmdeploy.pytorch.kernels import gated_delta_rule as gdr
    q, k, v, _, beta = _inputs(200, seed=3)
    g = -decay_scale * torch.rand(200, H, generator=torch.Generator().manual_seed(4))
    factors = []
    real_decay = gdr.decay_factor

    def recording_decay(x):
        out = real_decay(x)
        factors.append(out)
        return out

    monkeypatch.setattr(gdr, 'decay_factor', recording_decay)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, _state())
    tiny = torch.finfo(torch.float32).tiny
    assert factors and all(not ((f != 0) & (f.abs() < tiny)).any() for f in factors)
    if decay_scale > 2:
        assert any((f == 0).any() for f in factors)   # the flush did happen
    monkeypatch.setattr(gdr, '_DECAY_FLOOR', float('-inf'))   # no flush
    o_u, s_u = chunk_gated_delta_rule(q, k, v, g, beta, _state())
    torch.testing.assert_close(o_c, o_u, atol=1e-7, rtol=0)
    torch.testing.assert_close(s_c, s_u, atol=1e-7, rtol=0)
    if decay_scale <= 20:
        o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, _state())
        torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=0)
        torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=0)


def test_chunk_size_does_not_change_result():
    q, k, v, g, beta = _inputs(50, seed=3)
    o16, s16 = chunk_gated_delta_rule(q, k, v, g, beta, _state(), chunk_size=16)
    o7, s7 = chunk_gated_delta_rule(q, k, v, g, beta, _state(), chunk_size=7)
    torch.testing.assert_close(o16, o7, atol=1e-5, rtol=0)
    torch.testing.assert_close(s16, s7, atol=1e-5, rtol=0)


def test_matches_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    q, k, v, g, beta = _inputs(90, seed=5)
    state = _state()
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    o_hf, s_hf = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_hf[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize('cuts', [[1, 2, 3], [63, 64, 65], [5, 100, 101, 170], [130]])
@pytest.mark.parametrize('kernel', ['chunk', 'recurrent'])
def test_split_sequence_with_carried_state_equals_one_pass(cuts, kernel):
    fn = {'chunk': chunk_gated_delta_rule, 'recurrent': recurrent_gated_delta_rule}[kernel]
    q, k, v, g, beta = _inputs(200, seed=9)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, None)
    state, outs = None, []
    for a, b in zip([0] + cuts, cuts + [200]):
        o, state = fn(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), o_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, s_full, atol=1e-5, rtol=0)


def test_initial_state_is_not_modified():
    q, k, v, g, beta = _inputs(70)
    state = _state()
    before = state.clone()
    chunk_gated_delta_rule(q, k, v, g, beta, state)
    recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(state, before)


def test_without_l2norm_uses_raw_qk_and_custom_scale():
    q, k, v, g, beta = _inputs(20, seed=4)
    k = F.normalize(k, dim=-1) * 0.5  # keep the un-normalised delta rule stable
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, None, chunk_size=8, use_qk_l2norm=False, scale=0.3)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, None, use_qk_l2norm=False, scale=0.3)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=0)
    # Step 0 from a zero state: o = beta * (k.q) * scale * v.
    expected0 = beta[0, :, None] * (k[0] * q[0]).sum(-1, keepdim=True) * 0.3 * v[0]
    torch.testing.assert_close(o_r[0], expected0, atol=1e-6, rtol=0)


def test_gated_delta_rule_rejects_bad_shapes():
    q, k, v, g, beta = _inputs(4)
    with pytest.raises(ValueError, match='initial_state'):
        chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros(H, DK, DV + 1))
    with pytest.raises(ValueError, match='g and beta'):
        recurrent_gated_delta_rule(q, k, v, g[:, :2], beta)
    with pytest.raises(ValueError, match='q, k'):
        chunk_gated_delta_rule(q, k[:, :2], v, g, beta)
    with pytest.raises(ValueError, match='chunk_size'):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)


# ---------------------------------------------------------------------------- causal conv1d
C, K = 5, 4


def _conv_inputs(L, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(L, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)


def test_conv_matches_definition():
    x, w, b = _conv_inputs(6)
    y, state = causal_conv1d(x, w, b, None, activation=None)
    padded = torch.cat((torch.zeros(K - 1, C), x))
    expected = torch.stack([b + (w.t() * padded[t:t + K]).sum(0) for t in range(6)])
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
    assert torch.equal(state, x[-(K - 1):].t())
    y_silu, _ = causal_conv1d(x, w, b, None)
    torch.testing.assert_close(y_silu, F.silu(expected), atol=1e-6, rtol=0)


def test_conv_state_of_short_sequence_is_zero_padded():
    x, w, b = _conv_inputs(2)
    _, state = causal_conv1d(x, w, b, None)
    assert state.shape == (C, K - 1)
    assert torch.equal(state[:, 0], torch.zeros(C))
    assert torch.equal(state[:, 1:], x.t())


@pytest.mark.parametrize('cuts', [[1], [1, 2], [2, 3, 4, 9], [3, 10], [11]])
def test_conv_split_with_carried_state_equals_one_pass(cuts):
    x, w, b = _conv_inputs(12, seed=2)
    y_full, s_full = causal_conv1d(x, w, b, None)
    state, ys = None, []
    for a, e in zip([0] + cuts, cuts + [12]):
        y, state = causal_conv1d(x[a:e], w, b, state)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys), y_full, atol=1e-6, rtol=0)
    assert torch.equal(state, s_full)


def test_conv_rejects_bad_input():
    x, w, b = _conv_inputs(3)
    with pytest.raises(ValueError, match='conv_state'):
        causal_conv1d(x, w, b, torch.zeros(C, K))
    with pytest.raises(ValueError, match='activation'):
        causal_conv1d(x, w, b, None, activation='gelu')


def test_registry_picks_torch_kernels_on_cpu():
    assert get_kernel('chunk_gated_delta_rule', 'cpu') is chunk_gated_delta_rule
    assert get_kernel('recurrent_gated_delta_rule', 'cpu') is recurrent_gated_delta_rule
    assert get_kernel('causal_conv1d', 'cpu') is causal_conv1d
