"""The one-call decode steps of the KDA and Mamba-2 layers (kernels/fused_recurrent.py) equal the
blocks' unfused torch paths, natively and in their torch forms, over their input class: KDA's
softplus and safe-gate decays, low-rank and full-rank gates, odd head counts and widths, conv
widths; Mamba-2's group counts, state sizes not a multiple of the vector length, a conv bias or
none, a clamp that bites, Zamba2's prompt-only clamp; batches of several sequences on a slot range that does not start at 0
inside a larger cache (rows around it untouched). A step off the fused class (slots out of order,
float64, a subclass with its own step-size rule) runs the unfused path."""
import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numerics import close_to_measured_rounding
from test_cpu_native_fused import _three_ways

from lmdeploy.pytorch.kernels.cpu_native import CALLS, native_library
from lmdeploy.pytorch.models.blocks.kda import KimiDeltaAttention
from lmdeploy.pytorch.models.blocks.mamba2 import Mamba2Dims, Mamba2Mixer
from lmdeploy.pytorch.models.zamba2 import Zamba2Mixer

pytestmark = pytest.mark.skipif(native_library() is None, reason='native CPU kernels could not be built here '
                                '(no C compiler with OpenMP, or LMDEPLOY_CPU_KERNELS=0)')

HIDDEN = 24


def _randomize(layer, gen):
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer.eval()


def _ctx(caches, n, lo):
    return SimpleNamespace(state_caches=[caches], slots=torch.arange(lo, lo + n),
                           has_history=torch.ones(n, dtype=torch.bool), cu_seqlens=torch.arange(n + 1),
                           seq_ids=torch.arange(n), slot_span=(lo, None))


def _step(layer, hidden, ctx, states):
    return layer(hidden, SimpleNamespace(**{**vars(ctx), 'state_caches': [states]}))


def _check_three_ways(layer, hidden, ctx, op):
    """The step natively, by the fused op's torch form and unfused: one native call; the state
    rows outside the step's slots untouched in every way; the output and states of the two fused
    ways equal the unfused path's to float32 rounding.

    "float32 rounding" is measured, not assumed: the unfused path is also run in float64, and each
    fused way may differ from the unfused one by its error against float64 (the two round in
    another order) times 4, plus 1e-5 of the tensor's scale. A fixed 1e-5 alone does not hold
    over this input class: a head whose SSD output is a near-cancellation of O(1) terms, which
    the grouped norm then scales up, moved all three float32 ways 2e-4 from float64 (native the
    closest), while a wrong decay, clamp or gate moves them by O(1)."""
    caches = ctx.state_caches[0]

    def run(states):
        return _step(layer, hidden, ctx, states)

    before = CALLS[op]
    with torch.inference_mode():
        results = _three_ways(run, lambda: tuple(c.clone() for c in caches))
    assert CALLS[op] == before + 1
    lo, n = ctx.slot_span[0], hidden.shape[0]
    for _, states in results:
        for got, orig in zip(states, caches):
            assert torch.equal(got[:lo], orig[:lo]) and torch.equal(got[lo + n:], orig[lo + n:])
    exact_states = tuple(c.double() for c in caches)
    with torch.inference_mode():
        exact_out = _step(copy.deepcopy(layer).double(), hidden.double(), ctx, exact_states)
    close_to_measured_rounding(results, exact_out, exact_states)


def _kda(heads, dim, kernel, lower_bound, low_rank, seed):
    config = SimpleNamespace(hidden_size=HIDDEN, linear_num_heads=heads, linear_head_dim=dim,
                             linear_conv_kernel_dim=kernel, rms_norm_eps=1e-6)
    gen = torch.Generator().manual_seed(seed)
    return _randomize(KimiDeltaAttention(config, 0, lower_bound, low_rank), gen), gen


def _kda_caches(heads, dim, kernel, slots, gen):
    conv = tuple(torch.randn(slots, heads, dim, kernel - 1, generator=gen) for _ in range(3))
    return conv + (torch.randn(slots, heads, dim, dim, generator=gen) * 0.3,)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 3, 5]), st.sampled_from([8, 13, 32]), st.sampled_from([2, 4]),
       st.sampled_from([None, -5.0, -0.5]), st.booleans(), st.integers(1, 5), st.integers(0, 3),
       st.integers(0, 2 ** 31))
def test_kda_decode_equals_the_unfused_path(heads, dim, kernel, lower_bound, low_rank, n, lo, seed):
    """Kimi-Linear's softplus decay and GLM-5.3-Flash's safe gate (``None`` / a bound), low-rank
    (Kimi, GLM) or full-rank (Ling 3) gates: output and all four states equal the unfused path."""
    layer, gen = _kda(heads, dim, kernel, lower_bound, low_rank, seed)
    hidden = torch.randn(n, HIDDEN, generator=gen)
    ctx = _ctx(_kda_caches(heads, dim, kernel, lo + n + 2, gen), n, lo)
    _check_three_ways(layer, hidden, ctx, 'kda_decode')


def _mamba2(heads, head_dim, groups, state, kernel, conv_bias, dt_min, dt_max, seed):
    dims = Mamba2Dims(hidden_size=HIDDEN, num_heads=heads, head_dim=head_dim, n_groups=groups, state_size=state,
                      conv_kernel=kernel, chunk_size=8, conv_bias=conv_bias, proj_bias=True, dt_min=dt_min,
                      dt_max=dt_max, norm_eps=1e-5)
    gen = torch.Generator().manual_seed(seed)
    return _randomize(Mamba2Mixer(dims, 0), gen), gen


def _mamba2_caches(layer, slots, gen):
    d = layer.dims
    return (torch.randn(slots, d.conv_dim, d.conv_kernel - 1, generator=gen),
            torch.randn(slots, d.num_heads, d.head_dim, d.state_size, generator=gen))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (3, 3)]), st.sampled_from([4, 7, 16]),
       st.sampled_from([5, 16, 20]), st.sampled_from([2, 4]), st.booleans(),
       st.sampled_from([(0.0, float('inf')), (0.3, 0.9)]), st.integers(1, 5), st.integers(0, 3),
       st.integers(0, 2 ** 31))
def test_mamba2_decode_equals_the_unfused_path(heads_groups, head_dim, state, kernel, conv_bias, limits, n, lo,
                                               seed):
    """Group counts (one group, several, one head per group), state sizes around the vector
    width, a conv bias or none, the default clamp and one that bites: output and both states."""
    heads, groups = heads_groups
    layer, gen = _mamba2(heads, head_dim, groups, state, kernel, conv_bias, *limits, seed)
    hidden = torch.randn(n, HIDDEN, generator=gen)
    ctx = _ctx(_mamba2_caches(layer, lo + n + 2, gen), n, lo)
    _check_three_ways(layer, hidden, ctx, 'mamba2_decode')


@pytest.mark.parametrize('prompt', [False, True])
def test_zamba2_decode_applies_its_own_rule(prompt):
    """Zamba2's step sizes (``>= time_step_min`` for prompt tokens only; 0.3 here, which bites)
    through the fused step: generated tokens unclamped, a step of prompt tokens clamped."""
    base, gen = _mamba2(4, 4, 2, 16, 4, True, 0.3, float('inf'), 2)
    layer = _randomize(Zamba2Mixer(base.dims, 0), gen)
    hidden = torch.randn(3, HIDDEN, generator=gen)
    ctx = _ctx(_mamba2_caches(layer, 5, gen), 3, 1)
    ctx.prompt_token_mask = torch.full((3,), prompt)
    _check_three_ways(layer, hidden, ctx, 'mamba2_decode')


class _OwnStepSizes(Mamba2Mixer):
    def step_sizes(self, dt, ctx):
        return super().step_sizes(dt, ctx) * 0.5


def test_fused_decodes_fall_back_off_their_class():
    """Slots out of order, a float64 step, a Mamba-2 subclass with its own ``step_sizes`` (and no
    clamp declared for it), or a Zamba2 step of prompt and generated tokens together run the
    unfused path: no fused call."""
    kda, gen = _kda(2, 8, 4, None, True, 1)
    mamba, _ = _mamba2(4, 4, 2, 16, 4, True, 0.0, float('inf'), 1)
    own = _randomize(_OwnStepSizes(mamba.dims, 0), gen)
    hidden = torch.randn(2, HIDDEN, generator=gen)
    before = (CALLS['kda_decode'], CALLS['mamba2_decode'])
    with torch.inference_mode():
        for layer, caches in ((kda, lambda: _kda_caches(2, 8, 4, 4, gen)),
                              (mamba, lambda: _mamba2_caches(mamba, 4, gen))):
            ctx = _ctx(caches(), 2, 0)
            ctx.slot_span = (0, torch.tensor([1, 0]))
            layer(hidden, ctx)
            layer.to(torch.float64)(hidden.double(), _ctx(tuple(c.double() for c in caches()), 2, 0))
        own(hidden, _ctx(_mamba2_caches(own, 4, gen), 2, 0))
        zamba = _randomize(Zamba2Mixer(mamba.dims, 0), gen)
        ctx = _ctx(_mamba2_caches(zamba, 4, gen), 2, 0)
        ctx.prompt_token_mask = torch.tensor([True, False])
        zamba(hidden, ctx)
    assert (CALLS['kda_decode'], CALLS['mamba2_decode']) == before
