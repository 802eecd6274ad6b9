"""Qwen3-Next MTP speculative decoding: the head against a plain-torch reference, outputs equal
plain decoding, the prefix cache restores with lookahead ℓ = 1, and the Store carries the MTP
layer's KV rows.

The reference MTP forward is written here from the published layout (norms, ``fc`` over the
concatenation, one decoder layer, final norm, shared ``lm_head``), with the decoder layer taken
from ``transformers`` and loaded from the ``mtp.*`` tensors; it shares no code with the engine.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from engine_utils import random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_specs import FullAttentionSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.engine.engine import Engine

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=20, ignore_eos=True)
CACHE = {'off': dict(enable_prefix_caching=False),
         'on': dict(enable_prefix_caching=True),
         'last_only': dict(enable_prefix_caching=True, prefill_save_last_only=True)}
_PLAIN: dict[tuple, list[int]] = {}


def engine(path: str, mtp: bool = True, k: int = 1, cache: str = 'off', method: str = 'qwen3_next_mtp',
           **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               num_gpu_blocks=512, num_checkpoint_slots=16, max_batch_size=8)
    cfg.update(CACHE[cache])
    if mtp:
        cfg['speculative_config'] = dict(method=method, num_speculative_tokens=k)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def test_mtp_and_its_alias_qwen3_next_mtp_run_the_same_engine(tiny_qwen3_next):
    """``mtp`` (the generic name) and ``qwen3_next_mtp`` (its alias) are one method: the config
    reads back ``mtp``, the strategy is MTP's (look-ahead 1), and both engines decode the same
    tokens as plain decoding with the same draft/accept counters."""
    from lmdeploy.pytorch.spec_decode.strategy import MTP
    ids = random_prompt(70, 41)
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    runs = []
    for method in ('mtp', 'qwen3_next_mtp'):
        eng = engine(tiny_qwen3_next, k=2, method=method)
        assert eng.config.speculative_config.method == 'mtp' and eng.strategy == MTP
        seq = eng.generate(ids, gen)
        stats = eng.stats()
        runs.append((seq.output_ids, {k: v for k, v in stats.items() if k.startswith('spec_decode_')}))
        eng.close()
    assert runs[0] == runs[1] and runs[0][0] == plain(tiny_qwen3_next, ids, gen)
    assert runs[0][1]['spec_decode_verify_steps'] > 0


def plain(path: str, ids: list[int], gen: GenerationConfig = GEN, **fields) -> list[int]:
    key = (path, tuple(ids), gen.max_new_tokens, tuple(sorted(fields.items())))
    if key not in _PLAIN:
        _PLAIN[key] = engine(path, mtp=False, **fields).generate(ids, gen).output_ids
    return _PLAIN[key]


def run_batch(eng: Engine, prompts, gen: GenerationConfig = GEN):
    seqs = [eng.add_request(p, gen) for p in prompts]
    for _ in range(3000):
        if all(s.is_finished for s in seqs):
            break
        eng.step()
    return [s.output_ids for s in seqs]


def assert_idle(eng: Engine) -> None:
    led = eng.ledger()
    assert eng.is_idle(), led
    assert led['blocks_free'] + led['blocks_cached'] == led['blocks_total']


# ------------------------------------------------------------------ the head
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def reference_mtp_logits(path: str, ids: list[int], next_ids: list[int]) -> torch.Tensor:
    """MTP draft logits ``[n, vocab]`` at every position of ``ids`` (next tokens ``next_ids``)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation='eager').eval()
    cfg = hf.config
    w = {k[len('mtp.'):]: v for k, v in load_file(os.path.join(path, 'model.safetensors')).items()
         if k.startswith('mtp.')}
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.layer_types = list(cfg.layer_types) + ['full_attention']
    layer = Qwen3NextDecoderLayer(layer_cfg, cfg.num_hidden_layers).eval()
    state = {k[len('layers.0.'):]: v for k, v in w.items() if k.startswith('layers.0.') and '.experts.' not in k}
    E = cfg.num_experts
    state['mlp.experts.gate_up_proj'] = torch.stack([torch.cat((w[f'layers.0.mlp.experts.{e}.gate_proj.weight'],
                                                                w[f'layers.0.mlp.experts.{e}.up_proj.weight']))
                                                     for e in range(E)])
    state['mlp.experts.down_proj'] = torch.stack([w[f'layers.0.mlp.experts.{e}.down_proj.weight'] for e in range(E)])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    n, eps = len(ids), cfg.rms_norm_eps
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]          # after the final norm
        embeds = hf.model.embed_tokens(torch.tensor(next_ids))
        x = torch.cat((_rms(embeds, w['pre_fc_norm_embedding.weight'], eps),
                       _rms(hidden, w['pre_fc_norm_hidden.weight'], eps)), -1) @ w['fc.weight'].t()
        positions = torch.arange(n)[None]
        rope = hf.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), float('-inf')).triu(1)[None, None]
        y = layer(x[None], position_embeddings=rope, attention_mask=mask, position_ids=positions)
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(_rms(y[0], w['norm.weight'], eps))


def record_mtp(eng: Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Wrap the MTP step of the engine's (tp=1: in-process) worker: records ``(positions, draft
    logits)`` of every call."""
    drafter = eng.executor.worker.drafter
    calls, inner = [], drafter._step

    def step(hidden, ctx):
        out = inner(hidden, ctx)
        calls.append((ctx.positions.clone(), eng.model.compute_logits(out)))
        return out

    drafter._step = step
    return calls


@pytest.mark.parametrize('chunk', [64, 16])
def test_mtp_head_matches_a_plain_torch_reference(tiny_qwen3_next, chunk):
    ids = random_prompt(40, 11)
    eng = engine(tiny_qwen3_next, max_prefill_token_num=chunk)
    calls = record_mtp(eng)
    seq = eng.generate(ids, GenerationConfig(max_new_tokens=1))
    prefill = [c for c in calls if int(c[0][0]) < len(ids)]
    positions = torch.cat([c[0] for c in prefill])
    assert positions.tolist() == list(range(len(ids)))      # every prompt position once, chunk after chunk
    got = torch.cat([c[1] for c in prefill])
    want = reference_mtp_logits(tiny_qwen3_next, ids, ids[1:] + seq.output_ids[:1])
    # 2e-5, not 1e-5: on an AMD EPYC (AVX-512) machine the 16-token chunks gave 1.11e-5 with the
    # native CPU kernels (9.1e-6 with LMDEPLOY_CPU_KERNELS=0; 64-token chunks 4.4e-6): fp32
    # rounding of a different summation order, half the engine's 1e-4 logit bound
    assert (got - want).abs().max().item() <= 2e-5


def test_mtp_needs_a_qwen3_next_checkpoint_with_mtp_weights(tiny_qwen3, tmp_path):
    with pytest.raises(ValueError, match='qwen3_next'):
        engine(tiny_qwen3)
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    bare = make_tiny_model(str(tmp_path / 'bare'), arch='qwen3_next', mtp=False, num_hidden_layers=2,
                           layer_types=['linear_attention', 'full_attention'])
    with pytest.raises(ValueError, match='mtp'):
        engine(bare)


def test_mtp_layer_has_its_own_paged_kv_and_lookahead_strategy(tiny_qwen3_next):
    eng, ref = engine(tiny_qwen3_next), engine(tiny_qwen3_next, mtp=False)
    assert eng.specs[:-1] == ref.specs and isinstance(eng.specs[-1], FullAttentionSpec)
    assert kv_bytes_per_block(eng.specs, B) == 2 * kv_bytes_per_block(ref.specs, B)     # 1 full layer + MTP
    assert state_bytes_per_slot(eng.specs) == state_bytes_per_slot(ref.specs)
    assert (eng.strategy.token_lookahead, eng.strategy.recompute_blocks) == (1, 0)
    assert (ref.strategy.token_lookahead, ref.strategy.recompute_blocks) == (0, 0)


# ------------------------------------------------------------------ outputs
PROMPTS = [random_prompt(30 + 11 * i, 100 + i) for i in range(8)]


@pytest.mark.parametrize('cache', ['off', 'on', 'last_only'])
def test_mtp_greedy_equals_plain_single_and_8_concurrent(tiny_qwen3_next, cache):
    eng = engine(tiny_qwen3_next, k=2, cache=cache)
    expected = [plain(tiny_qwen3_next, p) for p in PROMPTS]
    assert eng.generate(PROMPTS[0], GEN).output_ids == expected[0]
    assert run_batch(eng, PROMPTS) == expected
    if cache != 'off':
        assert run_batch(eng, PROMPTS) == expected
        assert eng.stats()['prefix_cache_hit_tokens'] > 0
    stats = eng.stats()
    # the tiny model's MTP head is random: drafts every step, mostly rejected
    assert stats['spec_decode_verify_steps'] > 8 * (GEN.max_new_tokens // 2)
    assert stats['spec_decode_accepted_tokens'] < 0.5 * stats['spec_decode_draft_tokens']
    assert_idle(eng)


# ------------------------------------------------------------------ the review case, B = 64, A = 1024
def test_mtp_last_only_saves_and_reuses_2048_of_a_2049_token_prompt(tiny_qwen3_next):
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    geometry = dict(block_size=64, prefill_save_alignment=1024, max_prefill_token_num=8192, num_gpu_blocks=160)
    ids = random_prompt(2049, 5)
    expected = plain(tiny_qwen3_next, ids, gen, **geometry)
    eng = engine(tiny_qwen3_next, cache='last_only', **geometry)
    cold = eng.generate(ids, gen)
    assert cold.stats.save_points == [2048] and cold.output_ids == expected
    warm = eng.generate(ids, gen)
    assert warm.num_cached_tokens == 2048 and warm.output_ids == expected
    # with ℓ = 0, r = 1 forced the boundary moves to 1024 (2048 + 64 > floor_64(2048)) and is reused
    eng = engine(tiny_qwen3_next, cache='last_only', **geometry)
    cold = eng.generate(ids, gen, token_lookahead=0, recompute_blocks=1)
    assert cold.stats.save_points == [1024] and cold.output_ids == expected
    warm = eng.generate(ids, gen, token_lookahead=0, recompute_blocks=1)
    assert warm.num_cached_tokens == 1024 and warm.output_ids == expected
    assert_idle(eng)


# ------------------------------------------------------------------ the Store
def test_store_objects_carry_the_mtp_kv_and_a_fresh_engine_restores_them(tiny_qwen3_next, mooncake_services):
    """K_blk includes the MTP layer's rows (the simulator's formula with ``mtp=True``); a second
    engine with an empty local cache restores from the Store and decodes the same tokens."""
    import json
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / 'benchmark'))
    try:
        import simulate_store_writes as sim
    finally:
        sys.path.pop(0)
    store = dict(mooncake_master=mooncake_services.master_address,
                 mooncake_metadata_server=mooncake_services.metadata_server, mooncake_local_buffer_size=1 << 20)
    ids = random_prompt(150, 21)
    expected = plain(tiny_qwen3_next, ids)
    first = engine(tiny_qwen3_next, k=2, cache='on', **store)
    config = json.loads((Path(tiny_qwen3_next) / 'config.json').read_text())
    sizes = sim.sizes_from_config(config, block_size=B, mtp=True)
    assert (first.cache_engine.state_bytes, first.cache_engine.kv_block_bytes) == (sizes.state_bytes,
                                                                                  sizes.kv_block_bytes)
    assert sizes.kv_block_bytes == 2 * sim.sizes_from_config(config, block_size=B).kv_block_bytes
    first_calls = record_mtp(first)
    try:
        seq = first.generate(ids, GEN)
        assert seq.output_ids == expected and seq.stats.save_points == [64, 128]
    finally:
        first.close()       # flushes the Store worker
    stats = first.stats()
    S, K = sizes.state_bytes, sizes.kv_block_bytes
    assert stats['store_put_bytes'] == {'state': 2 * S, 'kv': (128 // B) * K}
    fresh = engine(tiny_qwen3_next, k=2, cache='on', **store)
    fresh_calls = record_mtp(fresh)
    try:
        warm = fresh.generate(ids, GEN)
        assert warm.stats.store_hit_tokens == 128 and warm.output_ids == expected
    finally:
        fresh.close()
    # the MTP rows came back too: from position 128 on, the MTP head attends to restored rows
    # [0, 128) and gives the first engine's draft logits
    assert int(fresh_calls[0][0][0]) == 128
    tail = first_calls[len(first_calls) - len(fresh_calls):]
    for (pos_a, a), (pos_b, b) in zip(tail, fresh_calls):
        assert torch.equal(pos_a, pos_b) and (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize('n, out', [(100, 1), (100, 3), (95, 2), (130, 15), (64, 5), (200, 9)])
def test_mtp_with_turn_end_checkpoints_restores_past_short_replies(tiny_qwen3_next, n, out):
    """MTP drafting with decode_save_last: the prompt's last block boundary is a forward end
    (ℓ tokens after it permitting), so even a reply that crosses no block boundary leaves a
    turn-end checkpoint; the next turn restores at floor_B(n + out - 1) and both turns' outputs
    equal plain decoding without a cache."""
    gen = GenerationConfig(max_new_tokens=out, ignore_eos=True)
    eng = engine(tiny_qwen3_next, k=2, cache='last_only', decode_save_last=True)
    first = torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n * 7 + out)).tolist()
    one = eng.generate(first, gen)
    assert one.output_ids == plain(tiny_qwen3_next, first, gen)
    follow = one.token_ids + [5, 9, 13, 2, 7, 11, 3]
    two = eng.generate(follow, GEN)
    assert two.output_ids == plain(tiny_qwen3_next, follow, GEN)
    assert two.num_cached_tokens == (n + out - 1) // B * B
    assert_idle(eng)
