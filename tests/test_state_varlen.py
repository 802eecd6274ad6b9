"""The one varlen driver of the recurrent-state ops (Mamba-1, Mamba-2, KDA, gated delta rule,
lightning attention):
for any batch of decode and prefill sequences, slots in any order (a sorted run, a permuted run,
scattered), with or without history, every op's output and the state written to each slot equal
that sequence run alone through the token-by-token reference, and no other slot is touched."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.gated_delta_rule import recurrent_gated_delta_rule
from lmdeploy.pytorch.kernels.kimi_delta_attention import recurrent_kda
from lmdeploy.pytorch.kernels.lightning_attention import lightning_attention_reference
from lmdeploy.pytorch.kernels.mamba1 import selective_scan_reference
from lmdeploy.pytorch.kernels.mamba2 import ssd_recurrent_reference

NUM_SLOTS = 7
# float32 kernels against float32 / float64 token-by-token references over <= 12 tokens: the
# tolerance of the ops' own test files (rounding of the chunked sums, no algorithmic slack)
TOL = 5e-5


def _mamba1(T, gen):
    x, dt = torch.randn(T, 6, generator=gen), torch.rand(T, 6, generator=gen) * 0.5 + 0.01
    A, D = -(1 + 3 * torch.rand(6, 4, generator=gen)), torch.randn(6, generator=gen)
    B, C = torch.randn(T, 4, generator=gen), torch.randn(T, 4, generator=gen)
    run = get_kernel('selective_scan_varlen', 'cpu')
    return ((6, 4),
            lambda cache, cu, slots, hist: run(x, dt, A, B, C, D, cache, cu, slots, hist, 4),
            lambda sl, s0: selective_scan_reference(x[sl], dt[sl], A, B[sl], C[sl], D, s0))


def _mamba2(T, gen):
    x, dt = torch.randn(T, 4, 3, generator=gen), torch.rand(T, 4, generator=gen) * 0.5 + 0.01
    A, D = -torch.rand(4, generator=gen) * 3.0 - 0.1, torch.randn(4, generator=gen)
    B, C = torch.randn(T, 2, 5, generator=gen), torch.randn(T, 2, 5, generator=gen)
    run = get_kernel('mamba2_ssd_varlen', 'cpu')
    return ((4, 3, 5),
            lambda cache, cu, slots, hist: run(x, dt, A, B, C, D, cache, cu, slots, hist, 4),
            lambda sl, s0: ssd_recurrent_reference(x[sl], dt[sl], A, B[sl], C[sl], D, s0))


def _delta(op, reference, per_channel):
    def make(T, gen):
        q, k, v = torch.randn(T, 2, 8, generator=gen), torch.randn(T, 2, 8, generator=gen), torch.randn(
            T, 2, 6, generator=gen)
        g = -torch.rand((T, 2, 8) if per_channel else (T, 2), generator=gen) * 2.0
        beta = torch.rand(T, 2, generator=gen)
        run = get_kernel(op, 'cpu')
        return ((2, 8, 6),
                lambda cache, cu, slots, hist: run(q, k, v, g, beta, cache, cu, slots, hist),
                lambda sl, s0: reference(q[sl], k[sl], v[sl], g[sl], beta[sl], s0))
    return make


def _lightning(T, gen):
    q, k, v = torch.randn(T, 2, 8, generator=gen), torch.randn(T, 2, 8, generator=gen), torch.randn(
        T, 2, 6, generator=gen)
    slope = torch.rand(2, generator=gen) + 0.05
    run = get_kernel('lightning_attention_varlen', 'cpu')
    return ((2, 8, 6),
            lambda cache, cu, slots, hist: run(q, k, v, slope, cache, cu, slots, hist, 4),
            lambda sl, s0: lightning_attention_reference(q[sl], k[sl], v[sl], slope, s0))


OPS = {'selective_scan_varlen': _mamba1, 'mamba2_ssd_varlen': _mamba2,
       'kda_varlen': _delta('kda_varlen', recurrent_kda, True),
       'gated_delta_rule_varlen': _delta('gated_delta_rule_varlen', recurrent_gated_delta_rule, False),
       'lightning_attention_varlen': _lightning}


@pytest.mark.parametrize('op', sorted(OPS))
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_every_state_op_equals_each_sequence_alone(op, data):
    N = data.draw(st.integers(1, 4), 'N')
    decode = data.draw(st.booleans(), 'decode only')          # the in-place and gathered decode paths
    lengths = [1] * N if decode else data.draw(st.lists(st.integers(1, 5), min_size=N, max_size=N), 'lengths')
    layout = data.draw(st.sampled_from(['run', 'permuted run', 'scattered']), 'layout')
    lo = data.draw(st.integers(0, NUM_SLOTS - N), 'lo')
    if layout == 'run':
        slots = list(range(lo, lo + N))
    elif layout == 'permuted run':
        slots = data.draw(st.permutations(list(range(lo, lo + N))), 'perm')
    else:
        slots = data.draw(st.lists(st.integers(0, NUM_SLOTS - 1), min_size=N, max_size=N, unique=True), 'slots')
    history = [True] * N if data.draw(st.booleans(), 'all history') else \
        data.draw(st.lists(st.booleans(), min_size=N, max_size=N), 'history')
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), 'seed'))
    state_shape, run, reference = OPS[op](sum(lengths), gen)
    cache = torch.full((NUM_SLOTS, *state_shape), float('nan'))       # a slot without history holds garbage
    states = [torch.randn(state_shape, generator=gen) for _ in lengths]
    for s, s0, h in zip(slots, states, history):
        if h:
            cache[s] = s0
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    out = run(cache, cu, torch.tensor(slots), torch.tensor(history))
    for i, s in enumerate(slots):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        y_ref, s_ref = reference(sl, states[i] if history[i] else None)
        assert (out[sl].double() - y_ref.double()).abs().max() <= TOL
        assert (cache[s].double() - s_ref.double()).abs().max() <= TOL
    assert torch.isnan(cache[[s for s in range(NUM_SLOTS) if s not in slots]]).all()
