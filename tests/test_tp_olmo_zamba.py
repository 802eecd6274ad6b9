"""Tensor parallelism for OLMo Hybrid and Zamba2 on CPU (gloo), TP2 against TP1 on their tiny
models.

What is checked, per family: each split tensor's ranges tile its axis over the ranks (exact split
counts; OLMo's whole-width q / k norm weights by head, Zamba2's adapter up matrices ``B`` by the
rows of the projection they add to and the down matrices ``A`` whole), and each cached tensor's
ranks' ranges tile it (the Store's full-head layout); one TP2 engine (B = 16,
A = 64, P = 48, prefix cache on) gives a cold prompt (one forward) and a chunked prompt (48 | 64 |
90) logits within ``TP_TOL`` of a TP1 engine with caching off, and greedy tokens equal to it for
staggered prompts, then again when the second pass restores their prefixes from the cache (Zamba2:
the prompt-only ``dt`` clamp reads ``prompt_lens`` on every rank); counts the TP size does not
divide are refused naming the field, over random geometries. The whole-width norm's cross-rank sum
is checked alone against the one-rank norm.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from engine_utils import assert_idle, engine_prompt_logits, random_prompt, run_staggered, sampled_logits
from tp_utils import PROMPTS, TP_TOL, engine
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.distributed.sharding import TPLayout
from lmdeploy.pytorch.models import get_model_class

GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)
COLD = random_prompt(40, 4401)        # under P = 48 and A = 64: prefilled in one forward


@pytest.fixture(scope='module', params=['olmo_hybrid', 'zamba2'])
def tiny(request, tmp_path_factory) -> tuple[str, str]:
    """``(arch, path)`` of the family's tiny checkpoint (published layout, float32)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    arch = request.param
    return arch, make_tiny_model(str(tmp_path_factory.mktemp(f'tp_{arch}')), arch=arch, seed=0)


# what splits ---------------------------------------------------------------------------------
# OLMo: 3 Gated DeltaNet layers x 12 (q/k/v/g/a/b projections, q/k/v conv filters, dt_bias, A_log,
# o_proj) + the attention layer's q/k/v/o and q_norm/k_norm + 4 MLPs x 3 + embed and lm_head.
# Zamba2: 4 Mamba-2 mixers x 8 (in_proj, conv weight and bias, dt_bias, A_log, D, norm, out_proj);
# the two shared blocks, each stored once: q/k/v/o + gate_up/down + one B per adapter (block 0 runs
# uses 0 and 2: 2 x (q, k, v, gate_up); block 1 use 1: 4); the tied embedding.
SPLIT_TENSORS = {'olmo_hybrid': 3 * 12 + 6 + 4 * 3 + 2, 'zamba2': 4 * 8 + 2 * 6 + 4 * 3 + 1}


def test_each_split_tensor_tiles_its_axis_and_the_adapters_split_as_their_projection(tiny):
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    arch, path = tiny
    config, layouts, split = check_tp_slices_tile_every_split_tensor(path)
    assert split == SPLIT_TENSORS[arch]
    # every cached tensor: each rank's ranges are as wide as its local tensor and together tile
    # the full model's (what the Store's full-head layout converts by)
    cls = get_model_class(arch)
    full = [t for spec in cls.cache_specs(config, torch.float32) for t in spec.tensors()]
    local = [[t for spec in cls.cache_specs(lay.local_config(), torch.float32) for t in spec.tensors()]
             for lay in layouts]
    assert {t.tp_split for t in full} == ({'conv_channels', 'v_heads', 'kv_heads'} if arch == 'olmo_hybrid' else
                                         {'mamba_conv_channels', 'mamba_heads', 'kv_heads'})
    for i, t in enumerate(full):
        ranges = [lay.cache_ranges(t.tp_split) for lay in layouts]
        for r, rank_ranges in enumerate(ranges):
            assert sum(b - a for a, b in rank_ranges) == local[r][i].shape[t.tp_axis], (t, r)
        covered = sorted(x for rank_ranges in ranges for x in rank_ranges)
        assert covered[0][0] == 0 and covered[-1][1] == t.shape[t.tp_axis], t
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), t
    rank1 = layouts[1]
    if arch == 'olmo_hybrid':
        attn = 'model.layers.3.self_attn.'          # 4 query heads, 2 KV heads of 16
        assert rank1.shard(f'{attn}q_norm.weight').ranges == rank1.shard(f'{attn}q_proj.weight').ranges == ((32, 64),)
        assert rank1.shard(f'{attn}k_norm.weight').ranges == rank1.shard(f'{attn}k_proj.weight').ranges == ((16, 32),)
        gdn = 'model.layers.0.linear_attn.'         # 2 key heads of 16 serving 4 value heads of 16
        assert rank1.shard(f'{gdn}k_conv1d.weight').ranges == ((16, 32),)
        assert rank1.shard(f'{gdn}v_conv1d.weight').ranges == rank1.shard(f'{gdn}g_proj.weight').ranges == ((32, 64),)
        assert rank1.cache_ranges('conv_channels') == ((16, 32), (48, 64), (96, 128))
        local = rank1.local_config()
        assert (local.num_attention_heads, local.num_key_value_heads, local.linear_num_key_heads,
                local.linear_num_value_heads, local.intermediate_size) == (2, 1, 1, 2, 64)
        return
    block = 'model.layers.0.shared_transformer.'     # 4 heads of 32 over 128 input channels
    for p in 'qkv':
        assert rank1.shard(f'{block}self_attn.linear_{p}_adapter_list.2.1.weight').ranges == \
            rank1.shard(f'{block}self_attn.{p}_proj.weight').ranges == ((64, 128),)
        assert rank1.shard(f'{block}self_attn.linear_{p}_adapter_list.2.0.weight') is None
    gate_up = ((64, 128), (192, 256))               # the gate half's rows, then the up half's
    assert rank1.shard(f'{block}feed_forward.gate_up_proj_adapter_list.0.1.weight').ranges == \
        rank1.shard(f'{block}feed_forward.gate_up_proj.weight').ranges == gate_up
    assert rank1.shard(f'{block}feed_forward.gate_up_proj_adapter_list.0.0.weight') is None
    assert rank1.shard('model.layers.0.linear.weight') is None
    assert rank1.shard('model.layers.0.mamba_decoder.mamba.out_proj.weight').ranges == ((64, 128),)
    local = rank1.local_config()
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim, local.intermediate_size,
            local.mamba_tp_size) == (2, 2, 32, 64, 2)


def test_every_rank_builds_its_share_and_a_tied_block_is_one_module(tiny):
    """Rank 1's model: OLMo's q / k norms sum over the ranks with the whole widths; Zamba2's hybrid
    layers reach their shared block (one module for the two uses of block 0, its ``o_proj``
    row-parallel), whose parameters are registered once."""
    from lmdeploy.pytorch.distributed.sharding import RowParallelLinear
    from lmdeploy.pytorch.models.blocks.spanning_norm import SummedRMSNorm
    arch, path = tiny
    config = AutoConfig.from_pretrained(path)
    layout = TPLayout(config, 1, 2)
    with torch.device('meta'):
        model = layout.apply(get_model_class(arch)(layout.local_config()))
    if arch == 'olmo_hybrid':
        attn = model.model.layers[3].self_attn
        assert isinstance(attn.q_norm, SummedRMSNorm) and isinstance(attn.k_norm, SummedRMSNorm)
        assert (attn.q_norm.weight.shape[0], attn.q_norm.total, attn.k_norm.weight.shape[0], attn.k_norm.total) == \
            (32, 64, 16, 32)
        assert isinstance(model.model.layers[0].linear_attn.out_proj, RowParallelLinear)
        return
    layers = model.model.layers
    assert layers[0].shared_transformer is layers[3].shared_transformer is model.model.blocks[0]
    assert layers[2].shared_transformer is model.model.blocks[1]
    for block in model.model.blocks:
        assert isinstance(block.self_attn.o_proj, RowParallelLinear)
        assert isinstance(block.feed_forward.down_proj, RowParallelLinear)
    names = [n for n, _ in model.named_parameters()]
    assert not any('shared_transformer' in n for n in names) and len(names) == len(set(names))


# TP2 == TP1 ------------------------------------------------------------------------------
def test_tp2_equals_tp1_cold_chunked_and_after_a_prefix_cache_restore(tiny):
    """TP1 with caching off is the reference. One TP2 engine with the prefix cache on: a cold
    40-token prompt (one forward) and ``PROMPTS[1]`` (90 tokens: forwards end at 48, 64, 90) give
    logits within ``TP_TOL`` (see tests/tp_utils.py for why) and the same argmax, and so are the
    logits of 6 decode steps (Zamba2: a generated token's ``dt`` is not clamped, a prompt token's
    is, on every rank; clamping them all moves these logits by more than 1e-4, see
    tests/test_zamba2.py); staggered greedy runs of ``PROMPTS`` equal TP1's, the second pass
    restoring their prefixes; the engine ends idle but for its cached prefixes."""
    _, path = tiny
    ref = engine(path)
    ref_cold, _ = engine_prompt_logits(ref, COLD)
    ref_chunked, ref_forwards = engine_prompt_logits(ref, PROMPTS[1])
    ref_decode = sampled_logits(ref, COLD, 6)
    expected = [s.output_ids for s in run_staggered(ref, PROMPTS, GEN, every=2)]
    assert_idle(ref)
    ref.close()
    assert ref_forwards == 3
    eng = engine(path, tp=2, enable_prefix_caching=True)
    try:
        cold, forwards = engine_prompt_logits(eng, COLD)
        assert forwards == 1
        assert (cold - ref_cold).abs().max().item() <= TP_TOL
        assert torch.equal(cold.argmax(-1), ref_cold.argmax(-1))
        chunked, forwards = engine_prompt_logits(eng, PROMPTS[1])
        assert forwards == 3
        assert (chunked - ref_chunked).abs().max().item() <= TP_TOL
        assert torch.equal(chunked.argmax(-1), ref_chunked.argmax(-1))
        assert (sampled_logits(eng, COLD, 6) - ref_decode).abs().max().item() <= TP_TOL
        assert [s.output_ids for s in run_staggered(eng, PROMPTS, GEN, every=2)] == expected
        hits = eng.stats()['prefix_cache_hit_tokens']
        assert [s.output_ids for s in run_staggered(eng, PROMPTS, GEN, every=2)] == expected
        stats = eng.stats()
        assert stats['prefix_cache_hit_tokens'] - hits >= 3 * 64 and stats['checkpoints_saved'] > 0
        assert eng.is_idle()
        led = eng.ledger()
        assert led['blocks_in_use'] == 0 and led['checkpoints_pinned'] == 0
        assert led['runtime_slots_free'] == led['runtime_slots_total']
    finally:
        eng.close()


# refusals ----------------------------------------------------------------------------------
def _config(arch: str, **fields):
    return AutoConfig.for_model(arch, **{**get_model_class(arch).tiny_config, 'vocab_size': 64, **fields})


@pytest.mark.parametrize('arch, fields, size, message', [
    ('olmo_hybrid', dict(num_attention_heads=2, num_key_value_heads=1), 2,
     r'num_key_value_heads \(1\) must be divisible by tp \(2\): the key norm spans every KV head'),
    ('olmo_hybrid', dict(linear_num_key_heads=1), 2, r'linear_num_key_heads \(1\) must be divisible by tp \(2\)'),
    ('olmo_hybrid', dict(intermediate_size=129), 2, r'intermediate_size \(129\) must be divisible by tp \(2\)'),
    ('zamba2', dict(n_mamba_heads=2, mamba_headdim=64, mamba_ngroups=1), 4,
     r'n_mamba_heads \(2\) must be divisible by tp \(4\)'),
    ('zamba2', dict(hidden_size=48, n_mamba_heads=6, mamba_headdim=16, mamba_ngroups=3), 2,
     r'mamba_ngroups \(3\) must be divisible by tp \(2\) or divide it'),
    ('zamba2', dict(num_attention_heads=2, num_key_value_heads=2), 4,
     r'num_attention_heads \(2\) must be divisible by tp \(4\)'),
])
def test_counts_the_tp_size_does_not_divide_are_refused_naming_the_field(arch, fields, size, message):
    with pytest.raises(ValueError, match=message):
        TPLayout(_config(arch, **fields), 0, size)


def _counts(draw, size: int, fit: list[int]) -> int:
    """A count that is a multiple of ``size`` about half the time, else one of ``fit`` (all
    divide 96 and 192, the widths the heads split)."""
    return draw(st.sampled_from([size, 2 * size] + fit))


def _olmo_fields(draw, size: int) -> dict:
    kv, k = _counts(draw, size, [1, 3]), _counts(draw, size, [1, 3])
    return dict(num_attention_heads=kv * draw(st.sampled_from([1, 2])), num_key_value_heads=kv,
                linear_num_key_heads=k, linear_num_value_heads=k * draw(st.sampled_from([1, 2])),
                intermediate_size=_counts(draw, size, [50]) * 8, hidden_size=96)


def _zamba_fields(draw, size: int) -> dict:
    heads = _counts(draw, size, [3, 6])
    groups = draw(st.sampled_from([g for g in (1, 2, 3, 4, 8) if heads % g == 0]))
    attn = _counts(draw, size, [1, 3])
    return dict(n_mamba_heads=heads, mamba_headdim=192 // heads, mamba_ngroups=groups, num_attention_heads=attn,
                num_key_value_heads=attn, hidden_size=96, intermediate_size=_counts(draw, size, [50]) * 8)


def _must_divide(arch: str, f: dict, size: int) -> set[str]:
    """The fields ``size`` fails, as the plans declare them (Zamba2's Mamba groups and KV heads
    may also be fewer than the ranks when they divide ``size``; OLMo's KV heads may not)."""
    def bad(n, shared=False):
        return n % size != 0 and not (shared and n < size and size % n == 0)
    if arch == 'olmo_hybrid':
        counts = dict(num_attention_heads=(f['num_attention_heads'], False),
                      num_key_value_heads=(f['num_key_value_heads'], False),
                      linear_num_key_heads=(f['linear_num_key_heads'], False),
                      linear_num_value_heads=(f['linear_num_value_heads'], False),
                      intermediate_size=(f['intermediate_size'], False))
    else:
        counts = dict(n_mamba_heads=(f['n_mamba_heads'], False), mamba_ngroups=(f['mamba_ngroups'], True),
                      num_attention_heads=(f['num_attention_heads'], False),
                      num_key_value_heads=(f['num_key_value_heads'], True),
                      intermediate_size=(f['intermediate_size'], False))
    return {name for name, (n, shared) in counts.items() if bad(n, shared)}


@given(data=st.data(), arch=st.sampled_from(['olmo_hybrid', 'zamba2']), size=st.sampled_from([2, 3, 4, 8]))
@settings(max_examples=60, deadline=None)
def test_any_geometry_splits_into_ranks_that_tile_it_or_is_refused_naming_a_failing_field(data, arch, size):
    """Random head / group / MLP counts: every rank's layout builds and the ranks' local counts add
    up to the model's (a shared count: each rank one unit), or the layout is a ValueError whose
    message starts with a count the TP size does not divide."""
    fields = (_olmo_fields if arch == 'olmo_hybrid' else _zamba_fields)(data.draw, size)
    config = _config(arch, **fields)
    failing = _must_divide(arch, fields, size)
    try:
        layouts = [TPLayout(config, r, size) for r in range(size)]
    except ValueError as e:
        assert failing and str(e).split(' ')[0] in failing, (str(e), failing)
        return
    assert not failing
    for name, axis in layouts[0].axes.items():
        parts = [lay.part(name) for lay in layouts]
        if axis.total >= size:
            assert parts == [(r * axis.total // size, (r + 1) * axis.total // size) for r in range(size)]
        else:
            assert all(b - a == 1 for a, b in parts) and sorted({a for a, _ in parts}) == list(range(axis.total))


# the cross-rank norm alone ---------------------------------------------------------------------
@given(widths=st.lists(st.integers(1, 24), min_size=1, max_size=4), tokens=st.integers(1, 5),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=40, deadline=None)
def test_a_norm_split_over_ranks_equals_the_whole_norm(widths, tokens, seed):
    """Channels split into any pieces, each piece normalised by :class:`SummedRMSNorm` with an
    all-reduce that adds every piece's sum of squares: the pieces concatenated equal
    :class:`RMSNorm` over all channels within 1e-6 of the output's largest magnitude (float32:
    only the order of one sum differs)."""
    from lmdeploy.pytorch.models.blocks.spanning_norm import SummedRMSNorm
    from lmdeploy.pytorch.models.layers import RMSNorm
    g = torch.Generator().manual_seed(seed)
    total = sum(widths)
    x = torch.randn(tokens, total, generator=g)
    whole = RMSNorm(total, 1e-6)
    whole.weight.data = torch.randn(total, generator=g)
    pieces = x.split(widths, dim=-1)
    sums = sum(p.pow(2).sum(-1, keepdim=True) for p in pieces)
    out, start = [], 0
    for p, w in zip(pieces, widths):
        norm = SummedRMSNorm(w, total, 1e-6, all_reduce=lambda t: sums.clone())
        norm.weight.data = whole.weight.data[start:start + w].clone()
        out.append(norm(p))
        start += w
    # "within 1e-6" relative to the output's magnitude: the outputs are products of two N(0, 1) draws and
    # reach ~16, where one float32 ulp is ~1e-6 (hypothesis found 1.43e-6 at such a value: 1.5 ulps),
    # so an absolute 1e-6 bound rejected the one-sum reordering this test is about.
    ref = whole(x)
    assert (torch.cat(out, dim=-1) - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
