"""Mamba-2 SSD kernels against the token-by-token float64 recurrence: the chunked scan for any
length and chunk size (partial last chunks, with and without an initial state, heads sharing
groups), pieces carried through the state equal one pass, the decode step, the varlen driver
over mixed decode / prefill sequences in scrambled NaN-poisoned slots, and the grouped gated norm
against transformers' Nemotron-H norm."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.mamba2 import (grouped_gated_rms_norm, mamba2_ssd_varlen, ssd_chunk_scan,
                                             ssd_recurrent_reference, ssd_step)

TOL = 2e-5


def _inputs(L, H=4, P=3, G=2, Dn=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, P, generator=gen)
    dt = torch.rand(L, H, generator=gen) * 0.5 + 0.01                  # softplus'd step sizes
    A = -torch.rand(H, generator=gen) * 3.0 - 0.1
    B, C = torch.randn(L, G, Dn, generator=gen), torch.randn(L, G, Dn, generator=gen)
    D = torch.randn(H, generator=gen)
    return x, dt, A, B, C, D


def _close(a, b):
    return (a.double() - b).abs().max().item() <= TOL


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 80), chunk=st.sampled_from([1, 5, 16, 24, 64]), with_state=st.booleans(),
       G=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_chunk_scan_equals_recurrence(L, chunk, with_state, G, seed):
    x, dt, A, B, C, D = _inputs(L, G=G, seed=seed)
    s0 = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(seed + 1)) if with_state else None
    s0_copy = None if s0 is None else s0.clone()
    y_ref, s_ref = ssd_recurrent_reference(x, dt, A, B, C, D, s0)
    y, s = ssd_chunk_scan(x, dt, A, B, C, D, s0, chunk)
    assert y.dtype == s.dtype == torch.float32 and y.shape == x.shape
    assert _close(y, y_ref) and _close(s, s_ref)
    if s0 is not None:
        assert torch.equal(s0, s0_copy)                                   # the initial state is read only


def test_pieces_carry_the_state():
    x, dt, A, B, C, D = _inputs(70, seed=3)
    y_ref, s_ref = ssd_recurrent_reference(x, dt, A, B, C, D)
    y1, s1 = ssd_chunk_scan(x[:33], dt[:33], A, B[:33], C[:33], D, None, 24)
    y2, s2 = ssd_chunk_scan(x[33:], dt[33:], A, B[33:], C[33:], D, s1, 24)
    assert _close(torch.cat((y1, y2)), y_ref) and _close(s2, s_ref)


def test_step_equals_recurrence_token_by_token():
    x, dt, A, B, C, D = _inputs(6, seed=4)
    state = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(2))
    y_ref, s_ref = ssd_recurrent_reference(x, dt, A, B, C, D, state[0])
    ys = [ssd_step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, state) for t in range(6)]
    assert _close(torch.cat(ys), y_ref) and _close(state[0], s_ref)


def test_groups_are_shared_by_consecutive_heads():
    """Head h reads group h // (H / G): swapping the two groups changes heads 0-1 and 2-3."""
    x, dt, A, B, C, D = _inputs(9, G=2, seed=6)
    y, _ = ssd_chunk_scan(x, dt, A, B, C, D, None, 4)
    y_sw, _ = ssd_chunk_scan(x, dt, A, B.flip(1), C.flip(1), D, None, 4)
    assert (y - y_sw).abs().amax(dim=(0, 2)).min() > 1e-3


def test_varlen_equals_each_sequence_alone():
    lengths, history = [5, 1, 40, 1, 2, 25], [False, True, True, False, True, True]
    H, P, Dn, n_slots = 4, 3, 5, 9
    cache = torch.full((n_slots, H, P, Dn), float('nan'))
    slots = torch.tensor([7, 2, 5, 0, 3, 8])
    gen = torch.Generator().manual_seed(9)
    states = [torch.randn(H, P, Dn, generator=gen) for _ in lengths]
    for s, st_, h in zip(slots.tolist(), states, history):
        if h:
            cache[s] = st_
    x, dt, A, B, C, D = _inputs(sum(lengths), H, P, 2, Dn, seed=11)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    out = get_kernel('mamba2_ssd_varlen', 'cpu')(x, dt, A, B, C, D, cache, cu, slots, torch.tensor(history), 16)
    assert get_kernel('mamba2_ssd_varlen', 'cpu') is mamba2_ssd_varlen   # one driver (its step native on CPU)
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        y_ref, s_ref = ssd_recurrent_reference(x[sl], dt[sl], A, B[sl], C[sl], D, states[i] if history[i] else None)
        assert _close(out[sl], y_ref) and _close(cache[slots[i]], s_ref)
    untouched = [s for s in range(n_slots) if s not in slots.tolist()]
    assert torch.isnan(cache[untouched]).all()


def test_grouped_gated_norm_matches_transformers():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated
    gen = torch.Generator().manual_seed(1)
    x, z = torch.randn(7, 12, generator=gen), torch.randn(7, 12, generator=gen)
    ref = NemotronHRMSNormGated(12, group_size=4, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(12, generator=gen))
        expected = ref(x, z)
    got = get_kernel('grouped_gated_rms_norm', 'cpu')(x, z, ref.weight.detach(), 4, 1e-5)
    assert (got - expected).abs().max() <= 1e-6
    # groups matter: one group over all channels is a different norm
    assert (grouped_gated_rms_norm(x, z, ref.weight.detach(), 12, 1e-5) - expected).abs().max() > 1e-3


def test_bad_shapes_are_refused():
    x, dt, A, B, C, D = _inputs(4)
    with pytest.raises(ValueError, match='dt'):
        ssd_chunk_scan(x, dt[:, :1], A, B, C, D, None, 8)
    with pytest.raises(ValueError, match='chunk_size'):
        ssd_chunk_scan(x, dt, A, B, C, D, None, 0)
    with pytest.raises(ValueError, match='G dividing'):
        ssd_chunk_scan(x, dt, A, B[:, :1].expand(4, 3, 5), C[:, :1].expand(4, 3, 5), D, None, 8)
    with pytest.raises(ValueError, match='group_size'):
        grouped_gated_rms_norm(x[0], x[0], torch.ones(3), 2, 1e-5)


@pytest.mark.parametrize('slots', [[2, 3, 4], [4, 2, 3], [0, 5, 2]], ids=['sorted-range', 'range-unsorted', 'scattered'])
def test_a_decode_step_updates_its_slots_in_place_or_gathered_alike(slots):
    """One token per sequence, every sequence with history: the slots of a sorted range are
    updated in place as one slice, others gathered and scattered; both equal the recurrence and
    leave every other (NaN) slot alone."""
    H, P, Dn = 4, 3, 5
    cache = torch.full((7, H, P, Dn), float('nan'))
    gen = torch.Generator().manual_seed(21)
    states = [torch.randn(H, P, Dn, generator=gen) for _ in slots]
    for s, st_ in zip(slots, states):
        cache[s] = st_
    x, dt, A, B, C, D = _inputs(len(slots), H, P, 2, Dn, seed=22)
    cu = torch.arange(len(slots) + 1)
    history = torch.ones(len(slots), dtype=torch.bool)
    out = mamba2_ssd_varlen(x, dt, A, B, C, D, cache, cu, torch.tensor(slots), history, 16)
    for i, s in enumerate(slots):
        y_ref, s_ref = ssd_recurrent_reference(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, states[i])
        assert _close(out[i:i + 1], y_ref) and _close(cache[s], s_ref)
    assert torch.isnan(cache[[s for s in range(7) if s not in slots]]).all()


def test_cross_rank_group_norm_over_ranks_equals_the_norm_of_the_whole_model():
    """Two groups over four ranks (two ranks per group): each rank's slice, with its partial sums
    of squares summed over the ranks, equals that slice of the single-process norm; a rank
    normalising its slice alone does not. The Mamba-2 split refuses a group count the TP size
    neither divides nor is a multiple of, naming the field."""
    from types import SimpleNamespace

    from lmdeploy.pytorch.models.blocks.mamba2 import CrossRankGroupNorm, Mamba2Dims, mamba2_split
    dims = Mamba2Dims(hidden_size=16, num_heads=8, head_dim=3, n_groups=2, state_size=4, conv_kernel=3,
                      chunk_size=8, conv_bias=False, proj_bias=False, dt_min=0.0, dt_max=float('inf'), norm_eps=1e-5)
    g = torch.Generator().manual_seed(3)
    x, z = torch.randn(5, dims.d_inner, generator=g), torch.randn(5, dims.d_inner, generator=g)
    w = torch.randn(dims.d_inner, generator=g)
    expected = grouped_gated_rms_norm(x, z, w, dims.d_inner // 2, 1e-5)
    def rank_norm(d, rank, size, all_reduce):
        """The rank's parts of the split's axes and the norm its collective hands the mixer."""
        split = mamba2_split(lambda config: d, 'h', 'groups')(None, size)
        part = {a.name: a.part(rank, size) for a in split.axes}
        mixer = SimpleNamespace(cross_rank_norm=None)
        split.collective(mixer, part.__getitem__, all_reduce)
        return part, mixer.cross_rank_norm

    pending = []         # each rank's sums tensor; the fake all-reduce adds them once all are in

    def fake_all_reduce(t):
        pending.append(t)
        return t
    ranks = [rank_norm(dims, r, 4, fake_all_reduce) for r in range(4)]
    assert [part['mamba_groups'] for part, _ in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    norms = [n for _, n in ranks]
    parts = [slice(*(h * dims.head_dim for h in part['mamba_heads'])) for part, _ in ranks]
    for n, p in zip(norms, parts):      # first pass: collect every rank's partial sums
        n(x[:, p], z[:, p], w[p], 1e-5)
    total = sum(pending)
    for n, p in zip(norms, parts):
        got = CrossRankGroupNorm(lambda t: total.clone(), n.group, n.n_groups, n.group_size)(x[:, p], z[:, p],
                                                                                            w[p], 1e-5)
        assert (got - expected[:, p]).abs().max().item() <= 1e-5
        alone = grouped_gated_rms_norm(x[:, p], z[:, p], w[p], p.stop - p.start, 1e-5)
        assert (alone - expected[:, p]).abs().max().item() > 1e-3
    assert rank_norm(dims, 0, 2, fake_all_reduce)[1] is None          # whole groups: no communication
    with pytest.raises(ValueError, match=r'groups \(3\) must be divisible by tp \(2\) or divide it'):
        rank_norm(Mamba2Dims(**{**dims.__dict__, 'num_heads': 6, 'n_groups': 3}), 0, 2, fake_all_reduce)
