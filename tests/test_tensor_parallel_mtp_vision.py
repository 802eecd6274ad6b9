"""Tensor parallelism on CPU (gloo) for Qwen3-Next MTP and Qwen3.5 with images, TP2 against TP1.

MTP drafting at TP2 loads only slices of the split ``mtp.*`` tensors, drafts exactly TP1's tokens
and decodes plain TP1's, and its Store objects restore across TP sizes with TP1's bytes; a model
without the head is refused naming the method. Qwen3.5 with images (the vision tower on rank 0
only; chunked, prefix cache off / on) equals TP1 and its Store objects restore across TP sizes.
Geometry and tolerance as tests/test_tensor_parallel.py (B = 16, A = 64, P = 48).
"""
from __future__ import annotations

import os

import pytest
import torch

from engine_utils import random_prompt
from tp_utils import B, PROMPTS, TP_TOL, assert_reader_restores, engine, record_safetensors_reads
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.distributed.sharding import TPLayout
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.models.loader import iter_safetensors, load_config


# Qwen3-Next MTP speculative decoding ---------------------------------------------------------
MTP_GEN = GenerationConfig(max_new_tokens=16, ignore_eos=True)


def _mtp(k: int = 3) -> dict:
    return dict(method='qwen3_next_mtp', num_speculative_tokens=k)


@pytest.fixture(scope='module')
def few_token_qwen3_next(tiny_qwen3_next, tmp_path_factory) -> str:
    """The tiny Qwen3-Next with an ``lm_head`` that scores only tokens 5 and 6 (every other row
    zero): greedy tokens are 0, 5 or 6, so the random MTP head is right often enough that verify
    steps accept some drafts and reject others."""
    import shutil

    from safetensors.torch import load_file, save_file
    dst = str(tmp_path_factory.mktemp('few_token_qwen3_next'))
    for name in os.listdir(tiny_qwen3_next):
        if not name.endswith('.safetensors'):
            shutil.copy(os.path.join(tiny_qwen3_next, name), dst)
    tensors = load_file(os.path.join(tiny_qwen3_next, 'model.safetensors'))
    head = tensors['lm_head.weight']
    keep = head[[5, 6]].clone()
    head.zero_()
    head[[5, 6]] = keep
    save_file(tensors, os.path.join(dst, 'model.safetensors'), metadata={'format': 'pt'})
    return dst


def _record_drafts(eng: Engine, prompts, gen: GenerationConfig):
    """Run ``prompts`` together; returns the sequences and every sequence's drafts after each step."""
    seqs = [eng.add_request(p, gen) for p in prompts]
    drafts = []
    while not all(s.is_finished for s in seqs):
        eng.step()
        drafts.append([list(s.draft_ids) for s in seqs])
    return seqs, drafts


def test_each_rank_loads_its_mtp_shard_reading_only_slices_of_the_split_mtp_tensors(tiny_qwen3_next, monkeypatch):
    """Rank r's MTP head: its attention built from the local config (query / KV heads halved,
    ``o_proj`` row-parallel), the q/k/v/o tensors read as slices (never whole) and tiling the
    whole head's; ``fc``, norms and MoE replicated; only ``mtp.*`` tensors read."""
    from lmdeploy.pytorch.distributed.sharding import RowParallelLinear
    from lmdeploy.pytorch.models.loader import load_mtp_head
    config = load_config(tiny_qwen3_next)
    names = {n for n, _ in iter_safetensors(tiny_qwen3_next, progress=False) if n.startswith('mtp.')}
    whole = load_mtp_head(tiny_qwen3_next, dtype='float32')
    reads = record_safetensors_reads(monkeypatch)
    shards = []
    for rank in range(2):
        reads.clear()
        layout = TPLayout(config, rank, 2)
        mtp = load_mtp_head(tiny_qwen3_next, layout, dtype='float32')
        split = {n for n in names if layout.shard(n) is not None}
        assert split == {f'mtp.layers.0.self_attn.{p}_proj.weight' for p in 'qkvo'}
        assert sorted(n for n, _ in reads) == sorted(names)          # each mtp.* tensor once, nothing else
        assert {n for n, how in reads if how == 'slice'} == split      # split ones never whole
        attn = mtp.layers[0].self_attn
        assert isinstance(attn.o_proj, RowParallelLinear)
        assert (attn.num_heads, attn.num_kv_heads) == (config.num_attention_heads // 2, 1)
        assert torch.equal(mtp.fc.weight, whole.fc.weight)
        shards.append(mtp)
    full_attn = whole.layers[0].self_attn
    attns = [m.layers[0].self_attn for m in shards]
    assert torch.equal(torch.cat([a.o_proj.weight for a in attns], 1), full_attn.o_proj.weight)
    for proj in ('q_proj', 'k_proj', 'v_proj'):
        rows = [a.qkv_proj.weight[a.qkv_proj.shard_rows[proj]] for a in attns]
        assert torch.equal(torch.cat(rows), full_attn.qkv_proj.weight[full_attn.qkv_proj.shard_rows[proj]]), proj
    experts = [m.layers[0].mlp.experts.gate_up_proj for m in shards]
    assert torch.equal(experts[0], experts[1]) and torch.equal(experts[0], whole.layers[0].mlp.experts.gate_up_proj)


def test_tp2_mtp_on_a_model_without_the_head_is_refused_naming_the_method(tiny_qwen3):
    with pytest.raises(ValueError, match=r'speculative_config\.method=mtp needs a model with an MTP head'):
        Engine(tiny_qwen3, PytorchEngineConfig(tp=2, device_type='cpu', dtype='float32', num_gpu_blocks=16,
                                               speculative_config=_mtp()))


@pytest.mark.parametrize('cache', ['off', 'on'])
def test_tp2_mtp_greedy_equals_plain_tp1_and_drafts_equal_tp1_mtp(few_token_qwen3_next, cache):
    """TP2 with the MTP head decodes plain TP1's tokens (no drafts) for three concurrent prompts
    and proposes, step after step, exactly the drafts TP1 with the MTP head proposes (K = 3,
    some accepted, some rolled back); with the prefix cache on, a warm second pass restores
    the prefixes (MTP KV included) and drafts the same again."""
    path, fields = few_token_qwen3_next, dict(enable_prefix_caching=cache == 'on')
    plain = engine(path, **fields)
    expected = [plain.generate(p, MTP_GEN).output_ids for p in PROMPTS]
    plain.close()

    def run(tp: int):
        eng = engine(path, tp=tp, speculative_config=_mtp(), **fields)
        try:
            passes = []
            for _ in range(2 if cache == 'on' else 1):
                seqs, drafts = _record_drafts(eng, PROMPTS, MTP_GEN)
                passes.append(([s.output_ids for s in seqs], drafts))
            assert eng.is_idle()
            return passes, eng.stats()
        finally:
            eng.close()
    ref, ref_stats = run(1)
    got, stats = run(2)
    for outputs, drafts in got:
        assert outputs == expected
        assert sum(len(d) for step in drafts for d in step) > 0
    assert got == ref          # outputs and every step's drafts
    spec = {k: v for k, v in stats.items() if k.startswith('spec_decode')}
    assert spec == {k: v for k, v in ref_stats.items() if k.startswith('spec_decode')}
    assert 0 < spec['spec_decode_accepted_tokens'] < spec['spec_decode_draft_tokens']
    assert 0 < spec['spec_decode_rollbacks'] < spec['spec_decode_verify_steps']     # some steps kept every draft
    if cache == 'on':
        assert stats['prefix_cache_hit_tokens'] == ref_stats['prefix_cache_hit_tokens'] >= 64


@pytest.mark.parametrize('writer_tp, reader_tp', [(2, 1), (1, 2)])
def test_mtp_store_objects_restore_across_tp_sizes_with_tp1_bytes(writer_tp, reader_tp, tiny_qwen3_next,
                                                                  mooncake_services):
    """With the MTP head, Store objects carry its KV rows in the full-head layout: a TP2 writer's
    K_blk, S and put bytes are TP1's (the simulator's with ``mtp=True``), a reader of the other
    TP size restores the prefix and drafts what a cold TP1 engine with the MTP head drafts (its
    MTP head attends to the restored rows), decoding plain TP1's tokens."""
    import json

    from test_store_engine import sim, store_config
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    ids = random_prompt(150, 5000 + 10 * writer_tp + reader_tp)     # a prompt new to the shared Store
    cold = engine(tiny_qwen3_next)
    expected = cold.generate(ids, gen).output_ids
    cold.close()
    cold = engine(tiny_qwen3_next, speculative_config=_mtp(2))
    (cold_seq,), cold_drafts = _record_drafts(cold, [ids], gen)
    cold.close()
    assert cold_seq.output_ids == expected
    with open(os.path.join(tiny_qwen3_next, 'config.json')) as f:
        sizes = sim.sizes_from_config(json.load(f), block_size=B, mtp=True)
    S, K = sizes.state_bytes, sizes.kv_block_bytes
    cfg = store_config(mooncake_services, prefill_save_last_only=True, num_gpu_blocks=64, speculative_config=_mtp(2))
    writer = Engine(tiny_qwen3_next, PytorchEngineConfig(**cfg, tp=writer_tp))
    try:
        seq = writer.generate(ids, gen)
        assert seq.output_ids == expected and seq.stats.save_points == [128]
        assert writer.store.flush(timeout=30)
        assert (writer.cache_engine.state_bytes, writer.cache_engine.kv_block_bytes) == (S, K)
        assert writer.stats()['store_put_bytes'] == {'state': S, 'kv': 8 * K}
    finally:
        writer.close()
    reader = Engine(tiny_qwen3_next, PytorchEngineConfig(**cfg, tp=reader_tp))
    try:
        (again,), drafts = _record_drafts(reader, [ids], gen)
        assert again.num_cached_tokens == 128 and again.stats.store_hit_tokens == 128
        assert again.output_ids == expected
        assert [d for d in drafts if d[0]] == [d for d in cold_drafts if d[0]]
        assert reader.store.flush(timeout=30) and reader.is_idle()
    finally:
        reader.close()


# Qwen3.5 with images -----------------------------------------------------------------------
def _image_prompts(path: str):
    """The image tests' one-image and two-image prompts: ``[(token ids, MultimodalInputs)]``."""
    from transformers import AutoImageProcessor

    from test_qwen3_5_images import ONE, TWO, _pieces, _prompt
    config, proc = load_config(path), AutoImageProcessor.from_pretrained(path)
    return [_prompt(proc, config, _pieces(spec))[:2] for spec in (ONE, TWO)]


def _vl_engine(path: str, **fields) -> Engine:
    return engine(path, max_prefill_token_num=32, prefill_save_alignment=16, num_checkpoint_slots=8, **fields)


@pytest.mark.parametrize('cache', ['off', 'on'])
def test_tp2_qwen3_5_with_images_equals_tp1(tiny_qwen3_5, cache):
    """Images at TP2 (the vision tower on rank 0, its output and the M-RoPE positions broadcast
    with the step): prompt logits of a two-image prompt prefilled in 32-token chunks (images in
    later chunks, no chunk ending inside one) within 1e-5 of TP1, and greedy tokens of a one-
    and a two-image prompt decoded together equal TP1's; with the prefix cache on, a warm second
    pass restores past the images and decodes the same tokens."""
    from engine_utils import StepRecorder
    prompts = _image_prompts(tiny_qwen3_5)
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)

    def run(tp: int):
        eng = _vl_engine(tiny_qwen3_5, tp=tp, enable_prefix_caching=cache == 'on')
        try:
            ids, mms = prompts[1]
            rec = StepRecorder(eng, keep_logits=True)
            seq = eng.generate(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True), multimodal=tuple(mms))
            logits, steps = rec.prompt_logits(seq), rec.steps
            del eng.model_runner.forward        # stop recording
            passes = []
            for _ in range(2 if cache == 'on' else 1):
                seqs = [eng.add_request(i, gen, multimodal=tuple(m)) for i, m in prompts]
                while not all(s.is_finished for s in seqs):
                    eng.step()
                passes.append(([s.output_ids for s in seqs], [s.num_cached_tokens for s in seqs]))
            assert eng.is_idle()
            return logits, steps, passes
        finally:
            eng.close()
    ref_logits, ref_steps, ref_passes = run(1)
    logits, steps, passes = run(2)
    ids, mms = prompts[1]
    assert len(steps) >= 3 and any(s.chunks[0][1] >= mms[0].end for s in steps)   # text after an image, later
    for start, end in (m.span for m in mms):     # no forward ends strictly inside an image
        assert all(not start < e < end for s in steps for _, _, e, _ in s.chunks)
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= TP_TOL, diff
    assert [p[0] for p in passes] == [p[0] for p in ref_passes]
    if cache == 'on':
        (_, cached), (i, m) = passes[1], prompts[1]
        assert cached[1] > m[1].end and passes[1][0] == ref_passes[0][0]


@pytest.mark.parametrize('writer_tp, reader_tp', [(2, 1), (1, 2)])
def test_qwen3_5_store_objects_restore_across_tp_sizes(writer_tp, reader_tp, tiny_qwen3_5, mooncake_services):
    """Qwen3.5's Store objects are in the full-head layout (KV heads; conv channels as q | k | v
    ranges; recurrent state by value head): a TP2 writer's K_blk and S are TP1's, and a reader
    of the other TP size restores the prefix and decodes cold TP1's tokens."""
    from test_store_engine import store_config
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    ids = random_prompt(150, 6000 + 10 * writer_tp + reader_tp)     # a prompt new to the shared Store
    cold = engine(tiny_qwen3_5)
    expected = cold.generate(ids, gen).output_ids
    sizes = (cold.cache_engine.state_bytes, cold.cache_engine.kv_block_bytes)
    cold.close()
    cfg = store_config(mooncake_services, prefill_save_last_only=True, num_gpu_blocks=64)
    writer = Engine(tiny_qwen3_5, PytorchEngineConfig(**cfg, tp=writer_tp))
    try:
        seq = writer.generate(ids, gen)
        assert seq.output_ids == expected and seq.stats.save_points == [128]
        assert writer.store.flush(timeout=30)
        assert (writer.cache_engine.state_bytes, writer.cache_engine.kv_block_bytes) == sizes
    finally:
        writer.close()
    assert_reader_restores(tiny_qwen3_5, cfg, reader_tp, ids, gen, expected)
