"""FP8 block-quantized weights under tensor parallelism, through the one loader (issue 43).

- a rank's split of an FP8 weight that falls on 128-blocks keeps FP8 with its scale rows /
  columns, and dequantizing that part is bit-identical to the same part of the whole weight
  dequantized, for any shape, block, TP size and split (hypothesis over ``block_ranges``);
  a split off the blocks is refused by ``block_ranges`` exactly when a local block would mix
  two checkpoint blocks;
- a tiny Qwen3-Next FP8 checkpoint whose ``o_proj`` / ``out_proj`` inputs are 256 wide: at TP2
  every rank keeps them FP8 (128 columns each, the scale's columns sliced), and the TP2 logits
  equal the TP1 FP8 logits within the TP tolerance (tests/tp_utils.py ``TP_TOL``: TP only
  reorders the float32 sums of the row-parallel products);
- the default tiny checkpoint (64-wide, half a block per rank) dequantizes them with one log
  line, its parts equal to slices of the whole dequantized weights; the MTP head under TP is
  dequantized and equals the TP1 head's slices.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from tp_utils import TP_TOL
from engine_utils import random_prompt
from lmdeploy.pytorch.distributed.sharding import RowParallelLinear, Shard, TPLayout
from lmdeploy.pytorch.kernels.fp8 import dequantize_fp8_blocks
from lmdeploy.pytorch.models.loader import load_config, load_model, load_mtp_head
from lmdeploy.pytorch.models.quantization import block_ranges
from lmdeploy.tools.fp8_checkpoint import quantize_fp8_blocks
from lmdeploy.tools.make_tiny_model import make_tiny_model

# o_proj input 4 heads x 64 = 256, Gated DeltaNet out_proj input 4 value heads x 64 = 256
ALIGNED = dict(head_dim=64, linear_value_head_dim=64)
KEPT = ('self_attn.o_proj.weight', 'linear_attn.out_proj.weight')
PROMPT = random_prompt(40, seed=11)


@pytest.fixture(scope='module')
def fp8_aligned(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp('fp8_tp_aligned')), arch='qwen3_next', fp8=True, **ALIGNED)


@pytest.fixture(scope='module')
def fp8_ragged(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp('fp8_tp_ragged')), arch='qwen3_next', fp8=True)


def _split(size: int, rank: int, tp: int) -> tuple[int, int]:
    per = size // tp
    return rank * per, (rank + 1) * per


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 520), k=st.integers(1, 520), tp=st.integers(1, 4), dim=st.sampled_from([0, 1]),
       block=st.sampled_from([(128, 128), (64, 32), (16, 48)]), pieces=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_a_split_on_blocks_dequantizes_to_the_slice_of_the_whole_and_only_such_splits_pass(
        n, k, tp, dim, block, pieces, seed):
    """``pieces`` = 3 is the q | k | v layout (conv1d / in_proj_qkv): the dimension cut in three
    groups, each split over the ranks, the rank's parts concatenated."""
    size = (n, k)[dim]
    if size % (tp * pieces):
        return
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s = quantize_fp8_blocks(w, block)
    whole = dequantize_fp8_blocks(q, s, block, torch.float32)
    group = size // pieces
    b = block[dim]
    for rank in range(tp):
        ranges = tuple((g * group + lo, g * group + hi) for g in range(pieces) for lo, hi in [_split(group, rank, tp)])
        shard = Shard(dim, ranges)
        got = block_ranges(shard, (n, k), block)
        # the definition: every local row's block (in the concatenated part) is one checkpoint block
        local_rows = [r for lo, hi in ranges for r in range(lo, hi)]
        blocks_of_local = {}
        for j, g in enumerate(local_rows):
            blocks_of_local.setdefault(j // b, set()).add(g // b)
        starts_ok = all(local_rows[j] % b == 0 for j in range(0, len(local_rows), b))
        fits = starts_ok and all(len(v) == 1 for v in blocks_of_local.values())
        assert (got is not None) == fits, (ranges, b)
        if got is None:
            continue
        part_q = torch.cat([q.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim)
        part_s = torch.cat([s.narrow(dim, lo, hi - lo) for lo, hi in got], dim)
        want = torch.cat([whole.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim)
        assert torch.equal(dequantize_fp8_blocks(part_q, part_s, block, torch.float32), want)


def test_block_ranges_examples():
    assert block_ranges(Shard(0, ((128, 256),)), (384, 64), (128, 128)) == ((1, 2),)
    assert block_ranges(Shard(0, ((192, 384),)), (384, 64), (128, 128)) is None
    assert block_ranges(Shard(0, ((0, 100),)), (200, 64), (128, 128)) == ((0, 1),)       # a ragged last block
    assert block_ranges(Shard(0, ((0, 100), (200, 300))), (300, 64), (128, 128)) is None  # q | k | v off blocks
    assert block_ranges(Shard(1, ((256, 300),)), (8, 300), (128, 128)) == ((2, 3),)     # ragged tail
    assert block_ranges(Shard(0, ((1, 2),)), (4, 256, 256), (128, 128)) == ((1, 2),)    # expert dimension


def _rank_logits(rank: int, size: int, port: int, path: str):
    """Rank ``rank``'s FP8-kept shard (keep_fp8 forces the CUDA layout on CPU): its FP8
    parameter names, the kept checkpoint names and the prompt's logits (identical on every rank)."""
    from model_harness import ModelHarness
    from lmdeploy.pytorch.distributed.comm import destroy_group, init_group
    init_group(rank, size, port, torch.device('cpu'), 120.0)
    try:
        loaded = load_model(path, TPLayout(load_config(path), rank, size), dtype='float32', progress=False,
                            keep_fp8=True)
        fp8 = sorted(n for n, p in loaded.model.named_parameters() if p.dtype == torch.float8_e4m3fn)
        h = ModelHarness(loaded.model, loaded.cache_specs())
        return fp8, sorted(loaded.fp8_kept), h.run_chunks(h.add_sequence(), PROMPT, 16)
    finally:
        destroy_group()


def test_fp8_kept_at_tp2_on_block_aligned_splits_gives_the_tp1_fp8_logits(fp8_aligned):
    """Regression: before the one loader a TP rank dequantized every FP8 weight. Rank 0 runs in
    this process (as the engine's does), rank 1 in a spawned one."""
    from model_harness import ModelHarness
    from lmdeploy.pytorch.distributed.comm import free_port
    whole = load_model(fp8_aligned, dtype='float32', progress=False, keep_fp8=True)
    h = ModelHarness(whole.model, whole.cache_specs())
    ref = h.run_chunks(h.add_sequence(), PROMPT, 16)
    port = free_port()
    peer = mp.get_context('spawn').Process(target=_rank_logits, args=(1, 2, port, fp8_aligned), daemon=True)
    peer.start()
    try:
        fp8_params, kept, got = _rank_logits(0, 2, port, fp8_aligned)
    finally:
        peer.join(timeout=60)
        if peer.exitcode is None:
            peer.kill()
    assert peer.exitcode == 0
    assert kept == sorted(whole.fp8_kept)
    assert any(n.endswith(KEPT[0]) for n in kept) and any(n.endswith(KEPT[1]) for n in kept)
    # both row-parallel projections hold FP8 weights on this rank (rank 1 loads the same names)
    assert any(n.endswith(KEPT[0]) for n in fp8_params) and any(n.endswith(KEPT[1]) for n in fp8_params)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TP_TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_rank_keeps_fp8_with_its_scale_columns(fp8_aligned):
    """In process (loading needs no process group): rank r's kept ``o_proj`` is columns
    ``[128 r, 128 (r + 1))`` of the checkpoint's FP8 tensor with scale column ``r``."""
    config = load_config(fp8_aligned)
    whole = load_model(fp8_aligned, dtype='float32', progress=False, keep_fp8=True).model
    name = next(n for n, _ in whole.named_modules() if n.endswith('self_attn.o_proj'))
    full = whole.get_submodule(name)
    for rank in range(2):
        shard = load_model(fp8_aligned, TPLayout(config, rank, 2), dtype='float32', progress=False,
                           keep_fp8=True).model.get_submodule(name)
        assert isinstance(shard, RowParallelLinear) and shard.fp8_block == (128, 128)
        assert torch.equal(shard.weight.view(torch.uint8), full.weight[:, 128 * rank:128 * (rank + 1)].view(torch.uint8))
        assert torch.equal(shard.weight_scale_inv, full.weight_scale_inv[:, rank:rank + 1])


def test_a_split_off_the_blocks_is_dequantized_with_one_log_line(fp8_ragged, caplog):
    config = load_config(fp8_ragged)
    whole = dict(load_model(fp8_ragged, dtype='float32', progress=False).model.named_parameters())
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        loaded = load_model(fp8_ragged, TPLayout(config, 1, 2), dtype='float32', progress=False, keep_fp8=True)
    lines = [r.getMessage() for r in caplog.records if 'FP8 under tp=2' in r.getMessage()]
    # 3 Gated DeltaNet out_proj + 1 o_proj, 32 of 64 columns per rank; replicated ones stay FP8
    assert len(lines) == 1 and lines[0].startswith('FP8 under tp=2: 4 weight(s) dequantized, their split is not '
                                                   'on [128, 128] blocks')
    assert loaded.fp8_kept and all('shared_expert.down_proj' in n for n in loaded.fp8_kept)
    params = dict(loaded.model.named_parameters())
    assert all(p.dtype == torch.float32 for n, p in params.items() if n.endswith(KEPT))
    name = next(n for n in params if n.endswith(KEPT[0]))
    assert torch.equal(params[name], whole[name][:, 32:64])          # rank 1's 32 columns of 64


def test_the_mtp_head_under_tp_is_the_tp1_heads_slices(fp8_aligned):
    """The head goes through the same reader: dequantized, and rank r's ``o_proj`` columns are
    the whole head's (bit-identical: aligned splits dequantize their own FP8 blocks)."""
    config = load_config(fp8_aligned)
    whole = load_mtp_head(fp8_aligned, dtype='float32')
    parts = [load_mtp_head(fp8_aligned, TPLayout(config, r, 2), dtype='float32') for r in range(2)]
    full = whole.layers[0].self_attn.o_proj.weight
    assert full.dtype == torch.float32
    assert torch.equal(torch.cat([m.layers[0].self_attn.o_proj.weight for m in parts], 1), full)
    assert torch.equal(parts[0].fc.weight, whole.fc.weight)


def test_block_ranges_of_a_dimension_shorter_than_one_block():
    """Every range of a q | k | v split of a 66-wide dimension lies in checkpoint block 0 (block
    128): the rank's 33 columns are one local block whose scale is block 0's (hypothesis found
    this split refused by the old rule, which asked every range to start on a block boundary)."""
    assert block_ranges(Shard(1, ((0, 11), (22, 33), (44, 55))), (1, 66), (128, 128)) == ((0, 1),)
    assert block_ranges(Shard(1, ((11, 22), (33, 44), (55, 66))), (1, 66), (128, 128)) is None
