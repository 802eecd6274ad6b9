"""GLM-5.3-Flash's DSA decode step (lmdeploy/pytorch/kernels/dsa_decode.py): the fixed-shape
path (native kernels and their torch forms) equals the per-sequence path of
``DSAAttention.forward`` (indexer mask + attention over the up-projected keys) over a seeded
sweep of batches and lengths (shorter than ``index_topk``, not multiples of the block size or of
the pool, blocks scattered in the cache), keeps the same pools (ties to the earlier pool), and
refuses bad lengths, block ids and pool ids with a ValueError. The layer-level sweep runs with the
native kernels and, as without the library, with the torch forms."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.kernels import cpu_native, dsa_decode
from lmdeploy.pytorch.kernels.dsa_decode import (dsa_attend_native, dsa_attend_torch, dsa_select_native,
                                                 dsa_select_torch)
from lmdeploy.pytorch.model_inputs import StepBatch
from lmdeploy.pytorch.models.glm5_next import Glm5NextForCausalLM
from lmdeploy.pytorch.models.glm5_next_layers import DSAAttention

native = pytest.mark.skipif(cpu_native.native_library() is None, reason='needs the native CPU kernels')
BLOCK = 4          # tokens per block: pools of 8 span two blocks


def _config(**overrides):
    from transformers import Glm5NextTextConfig
    return Glm5NextTextConfig(**{**Glm5NextForCausalLM.tiny_config, **overrides})


def _layers(config, seed: int) -> tuple[DSAAttention, DSAAttention]:
    """The tiny config's 'full' DSA layer 1 and 'shared' layer 2, random weights."""
    gen = torch.Generator().manual_seed(seed)
    layers = DSAAttention(config, 1), DSAAttention(config, 2)
    for layer in layers:
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.3
    return layers


def _step(lengths: list[int], seed: int, num_blocks: int = 160):
    """A decode step of ``len(lengths)`` sequences at those lengths (this step's token included),
    their blocks a random permutation of the cache's, the caches random (the new rows are
    written by the layers)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lengths:
        k = -(-n // BLOCK)
        tables.append(perm[at:at + k])
        at += k
    B = len(lengths)
    batch = StepBatch(input_ids=[0] * B, positions=[n - 1 for n in lengths], q_seqlens=[1] * B,
                      q_start_loc=list(range(B)), kv_seqlens=list(lengths), block_tables=tables,
                      state_slots=[-1] * B, sample_rows=list(range(B)))
    config = _config()
    latent = torch.randn(num_blocks, BLOCK, config.kv_lora_rank, generator=gen)
    keys = torch.randn(num_blocks, BLOCK, 2 * config.index_head_dim, generator=gen)
    hidden = torch.randn(B, config.hidden_size, generator=gen)
    return batch, [None, (latent, keys), (latent.clone(),), None], hidden


def _run(layers, batch, caches, hidden, fixed: bool, monkeypatch):
    """Both layers' outputs and the selections (the first layer's), by the fixed-shape decode
    path or (``fixed=False``) the per-sequence loop."""
    caches = [None if c is None else tuple(t.clone() for t in c) for c in caches]
    ctx = batch.context(torch.device('cpu'), caches, [], BLOCK)
    with monkeypatch.context() as m:
        if not fixed:
            m.setattr(DSAAttention, '_decode', lambda *args: None)
        with torch.inference_mode():
            out1, sel = layers[0](hidden, ctx, None)
            out2, _ = layers[1](hidden * 0.5, ctx, sel)
    return out1, out2, sel


def _as_masks(pools: torch.Tensor, lengths: list[int], pool: int, tail: bool) -> list[torch.Tensor]:
    """The ``[1, S]`` key masks of a pools tensor (what the per-sequence path returns)."""
    out = []
    for row, n in zip(pools.tolist(), lengths):
        mask = torch.zeros(1, n, dtype=torch.bool)
        for p in row:
            if p >= 0:
                mask[0, p * pool:(p + 1) * pool] = True
        if tail and pool > 1:
            mask[0, n // pool * pool:] = True
        out.append(mask)
    return out


SWEEP = [[5], [1], [64], [71, 9], [200, 63, 8, 17], [130, 1, 2, 66, 99, 250], [7, 300]]


@pytest.mark.parametrize('forms', ['native', 'torch'])
@pytest.mark.parametrize('tail', [True, False])
@pytest.mark.parametrize('case', range(len(SWEEP)))
def test_decode_path_equals_the_per_sequence_path(case, tail, forms, monkeypatch):
    if forms == 'torch':        # as without the library (LMDEPLOY_CPU_KERNELS=0): the registry's torch forms
        monkeypatch.setattr(dsa_decode, 'native_library', lambda: None)
    elif cpu_native.native_library() is None:
        pytest.skip('needs the native CPU kernels')
    lengths = SWEEP[case]
    config = _config(index_kpool_always_select_tail=tail)
    layers = _layers(config, seed=case)
    batch, caches, hidden = _step(lengths, seed=100 + case)
    ref1, ref2, masks = _run(layers, batch, caches, hidden, False, monkeypatch)
    calls = cpu_native.CALLS['dsa_select'], cpu_native.CALLS['dsa_attend']
    got1, got2, pools = _run(layers, batch, caches, hidden, True, monkeypatch)
    native_calls = (cpu_native.CALLS['dsa_select'] - calls[0], cpu_native.CALLS['dsa_attend'] - calls[1])
    assert native_calls == ((1, 2) if forms == 'native' else (0, 0))      # one indexer, two attentions
    assert pools.shape == (len(lengths), config.index_topk // config.index_kpool) and pools.dtype == torch.int64
    for got, want in zip(_as_masks(pools, lengths, config.index_kpool, tail), masks):
        assert torch.equal(got, want)
    # without the tail a sequence shorter than a pool sees no key: its attention output is 0 in both
    torch.testing.assert_close(got1, ref1, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got2, ref2, atol=2e-5, rtol=1e-5)
    # a shared layer that loops over its sequences (e.g. an FP8 kv_b_proj) reads the pools as masks
    layers[1]._decode = lambda *args: None
    _, mixed2, _ = _run(layers, batch, caches, hidden, True, monkeypatch)
    torch.testing.assert_close(mixed2, ref2, atol=2e-5, rtol=1e-5)


def _select_args(lengths, seed, heads=8, d=16, pool=8, zero_w=False):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 10
    batch, _, _ = _step(lengths, seed, num_blocks)
    ctx = batch.context(torch.device('cpu'), [], [], BLOCK)
    N = len(lengths)
    w = torch.zeros(N, heads) if zero_w else torch.randn(N, heads, generator=gen)
    return (torch.randn(N, heads, d, generator=gen), w, torch.randn(num_blocks, BLOCK, 2 * d, generator=gen),
            torch.randn(pool, d, generator=gen), ctx.block_table, ctx.kv_seqlens_t)


@native
@pytest.mark.parametrize('seed', range(6))
def test_native_kernels_equal_their_torch_forms(seed):
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 6, (), generator=gen))
    lengths = torch.randint(1, 400, (B,), generator=gen).tolist()
    pool = (1, 2, 4, 8, 3, 8)[seed]
    args = _select_args(lengths, seed, pool=pool)
    for k in (0, 1, 8, 64):
        got, want = dsa_select_native(*args, k, 0.25), dsa_select_torch(*args, k, 0.25)
        assert torch.equal(got, want), (k, got, want)
    pools = dsa_select_native(*args, 8, 0.25)
    q_c = torch.randn(5, B, 32, generator=gen)
    cache = torch.randn(args[2].shape[0], BLOCK, 32, generator=gen)
    for tail in (True, False):
        got = dsa_attend_native(q_c, cache, args[4], args[5], pools, pool, tail, 0.3)
        want = dsa_attend_torch(q_c, cache, args[4], args[5], pools, pool, tail, 0.3)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, equal_nan=True)


@native
def test_tied_scores_keep_the_earliest_pools():
    lengths = [300, 70, 20]
    args = _select_args(lengths, seed=7, zero_w=True)          # every pool scores 0
    want = torch.tensor([list(range(8)), list(range(8)), [0, 1] + [-1] * 6])
    assert torch.equal(dsa_select_native(*args, 8, 0.25), want)
    assert torch.equal(dsa_select_torch(*args, 8, 0.25), want)


@pytest.mark.parametrize('impl', [pytest.param(dsa_select_native, marks=native), dsa_select_torch])
def test_select_refuses_bad_lengths_and_block_ids(impl):
    q, w, keys, ape, table, lens = _select_args([30, 9], seed=3)
    with pytest.raises(ValueError, match='kv_seqlens'):
        impl(q, w, keys, ape, table, torch.tensor([30, 0]), 8, 0.25)
    with pytest.raises(ValueError, match='kv_seqlens'):
        impl(q, w, keys, ape, table, torch.tensor([30, table.shape[1] * BLOCK + 1]), 8, 0.25)
    bad = table.clone()
    bad[1, 0] = keys.shape[0]
    with pytest.raises(ValueError, match='block id'):
        impl(q, w, keys, ape, bad, lens, 8, 0.25)
    with pytest.raises(ValueError, match='ape'):
        impl(q, w, keys, ape[:, :3], table, lens, 8, 0.25)


@pytest.mark.parametrize('impl', [pytest.param(dsa_attend_native, marks=native), dsa_attend_torch])
def test_attend_refuses_pools_out_of_range(impl):
    _, _, _, _, table, lens = _select_args([30, 9], seed=4)
    q_c, cache = torch.randn(2, 2, 32), torch.randn(32, BLOCK, 32)
    for bad in ([[3, -1], [1, -1]], [[0, -2], [0, -1]]):          # 9 tokens hold one pool of 8; -2 is no entry
        with pytest.raises(ValueError, match='pools'):
            impl(q_c, cache, table, lens, torch.tensor(bad), 8, True, 0.3)
    with pytest.raises(ValueError, match='pool must be'):
        impl(q_c, cache, table, lens, torch.tensor([[0], [0]]), 0, True, 0.3)


@pytest.mark.parametrize('impl', [pytest.param(dsa_attend_native, marks=native), dsa_attend_torch])
def test_a_pool_given_twice_is_attended_once(impl):
    _, _, _, _, table, lens = _select_args([70, 30], seed=5)
    gen = torch.Generator().manual_seed(5)
    q_c, cache = torch.randn(3, 2, 32, generator=gen), torch.randn(table.max() + 1, BLOCK, 32, generator=gen)
    twice = torch.tensor([[6, 2, 6, 2, -1], [1, 1, 1, 0, 0]])
    once = torch.tensor([[6, 2, -1, -1, -1], [1, 0, -1, -1, -1]])
    for tail in (True, False):
        got = impl(q_c, cache, table, lens, twice, 8, tail, 0.3)
        want = dsa_attend_torch(q_c, cache, table, lens, once, 8, tail, 0.3)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize('impl', [pytest.param(dsa_attend_native, marks=native), dsa_attend_torch])
def test_a_nan_in_the_first_selected_row_gives_nan(impl):
    """NaN in a selected key row propagates as torch's softmax does, first row or not (the
    online softmax must not skip a NaN score while its running max is still -inf)."""
    _, _, _, _, table, lens = _select_args([70, 30], seed=6)
    gen = torch.Generator().manual_seed(6)
    q_c, cache = torch.randn(3, 2, 32, generator=gen), torch.randn(table.max() + 1, BLOCK, 32, generator=gen)
    pools = torch.tensor([[4, 2, -1], [1, 0, -1]])
    cache[table[0, 2 * 8 // BLOCK], 0, 0] = float('nan')      # sequence 0's token 16: the first of pool 2
    out = impl(q_c, cache, table, lens, pools, 8, True, 0.3)
    assert out[:, 0].isnan().all(), out[:, 0]
    assert not out[:, 1].isnan().any()


@native
@pytest.mark.parametrize('heads', [9, 13, 16, 17])
def test_attend_with_several_head_groups_equals_the_torch_form(heads):
    """More than 8 heads: the native kernel's groups of up to 8 heads, the last one partial."""
    lengths = [70, 30, 200]
    args = _select_args(lengths, seed=heads)
    pools = dsa_select_native(*args, 4, 0.25)
    gen = torch.Generator().manual_seed(heads)
    q_c = torch.randn(heads, len(lengths), 32, generator=gen)
    cache = torch.randn(args[2].shape[0], BLOCK, 32, generator=gen)
    for tail in (True, False):
        got = dsa_attend_native(q_c, cache, args[4], args[5], pools, 8, tail, 0.3)
        want = dsa_attend_torch(q_c, cache, args[4], args[5], pools, 8, tail, 0.3)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        # each head its own: a head's output does not depend on the others
        alone = dsa_attend_native(q_c[-1:].contiguous(), cache, args[4], args[5], pools, 8, tail, 0.3)
        assert torch.equal(got[-1:], alone)


@pytest.mark.parametrize('impl', [pytest.param(dsa_select_native, marks=native), dsa_select_torch])
def test_select_refuses_a_zero_channel_width(impl):
    q, w, keys, ape, table, lens = _select_args([30, 9], seed=3)
    with pytest.raises(ValueError, match='D >= 1'):
        impl(q[..., :0], w, keys[..., :0], ape[:, :0], table, lens, 8, 0.25)


@pytest.mark.parametrize('impl', [pytest.param(dsa_attend_native, marks=native), dsa_attend_torch])
def test_attend_refuses_a_zero_latent_width(impl):
    _, _, _, _, table, lens = _select_args([30, 9], seed=4)
    with pytest.raises(ValueError, match='R >= 1'):
        impl(torch.randn(2, 2, 0), torch.randn(32, BLOCK, 0), table, lens, torch.tensor([[0], [0]]), 8, True, 0.3)


def test_the_torch_forms_read_nothing_on_the_host_without_the_range_checks():
    """What a CUDA graph captures: with ``check=False`` (the registration for devices other than
    the CPU) neither torch form reads a tensor on the host; with the checks (CPU) they do."""
    from host_reads import HostReads
    args = _select_args([70, 30, 9], seed=8)
    gen = torch.Generator().manual_seed(8)
    q_c, cache = torch.randn(3, 3, 32, generator=gen), torch.randn(args[2].shape[0], BLOCK, 32, generator=gen)
    with HostReads() as reads:
        pools = dsa_select_torch(*args, 4, 0.25, check=False)
        out = dsa_attend_torch(q_c, cache, args[4], args[5], pools, 8, True, 0.3, check=False)
    assert reads.seen == []
    assert torch.equal(pools, dsa_select_torch(*args, 4, 0.25))
    assert torch.equal(out, dsa_attend_torch(q_c, cache, args[4], args[5], pools, 8, True, 0.3))
    with HostReads() as reads:
        dsa_attend_torch(q_c, cache, args[4], args[5], pools, 8, True, 0.3)
    assert reads.seen


def test_the_range_checks_run_on_the_cpu_only():
    """On a device other than the CPU (here ``meta``: no data to read) the torch forms run
    without the range checks, which would read the tensors on the host."""
    q, w, keys, ape, table, lens = (t.to('meta') for t in _select_args([30, 9], seed=3))
    pools = dsa_select_torch(q, w, keys, ape, table, lens, 4, 0.25)
    assert pools.shape == (2, 4) and pools.device.type == 'meta'
    out = dsa_attend_torch(torch.randn(2, 2, 32, device='meta'), torch.randn(keys.shape[0], BLOCK, 32, device='meta'),
                           table, lens, pools, 8, True, 0.3)
    assert out.shape == (2, 2, 32) and out.device.type == 'meta'
