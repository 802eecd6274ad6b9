"""GLM-5.3-Flash NextN MTP speculative decoding (``speculative_config.method='qwen3_next_mtp'``
on a tiny ``glm5_next`` checkpoint written with its NextN layer): the head's draft logits
against a plain-torch reference (the DSA decoder block taken from ``transformers``, the rest of
the NextN composition written here from the published layout), greedy outputs equal plain
decoding (prompts past ``index_topk``, 4 concurrent, prefix cache off and on, a multi-turn
chat, TP2 against plain TP1), the restore requirements ℓ = 1, r = 0 in the prefill plan, the
head's cache spec in K_blk (and in the Store simulator), and accepted drafts counted.

The tiny head is random, so its own drafts are (almost) never accepted; the acceptance test
replaces the head's drafts by the plain continuation (the head still runs and writes its
rows) to show the verify path keeps and counts accepted drafts. It says nothing about the
quality of a trained head.
"""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from engine_utils import random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_specs import PagedSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=12, ignore_eos=True)
_PLAIN: dict[tuple, list[int]] = {}


@pytest.fixture(scope='module')
def tiny(tmp_path_factory) -> str:
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_glm5_next_mtp')), arch='glm5_next', seed=0, mtp=True)


def engine(path: str, mtp: bool = True, k: int = 2, cache: bool = False, **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               num_gpu_blocks=256, num_checkpoint_slots=8, max_batch_size=4, enable_prefix_caching=cache,
               session_len=4096)
    if mtp:
        cfg['speculative_config'] = dict(method='qwen3_next_mtp', num_speculative_tokens=k)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def plain(path: str, ids: list[int], gen: GenerationConfig = GEN) -> list[int]:
    key = (path, tuple(ids), gen.max_new_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = engine(path, mtp=False).generate(ids, gen).output_ids
    return _PLAIN[key]


def run_batch(eng: Engine, prompts, gen: GenerationConfig = GEN):
    seqs = [eng.add_request(p, gen) for p in prompts]
    for _ in range(3000):
        if all(s.is_finished for s in seqs):
            break
        eng.step()
    return [s.output_ids for s in seqs]


# ------------------------------------------------------------------ the head
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def reference_nextn_logits(path: str, ids: list[int], next_ids: list[int]) -> torch.Tensor:
    """NextN draft logits ``[n, vocab]`` at every position of ``ids`` (next tokens ``next_ids``):
    transformers' target hidden states and its DSA decoder block (layer index
    ``num_hidden_layers``, own indexer, the last layer's MoE), the NextN norms, ``eh_proj``,
    stream copy / mean and ``shared_head`` written here."""
    from transformers import Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer
    hf = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    cfg = hf.config.get_text_config()
    n_layers, eps, N = cfg.num_hidden_layers, cfg.rms_norm_eps, cfg.hc_mult
    prefix = f'model.language_model.layers.{n_layers}.'
    w = {k[len(prefix):]: v for k, v in load_file(os.path.join(path, 'model.safetensors')).items()
         if k.startswith(prefix)}
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.layer_types = list(cfg.layer_types) + ['indexed_attention']
    layer_cfg.indexer_types = list(cfg.indexer_types) + ['full']
    layer_cfg.mlp_layer_types = list(cfg.mlp_layer_types) + [cfg.mlp_layer_types[-1]]
    layer = Glm5NextTextDecoderLayer(layer_cfg, n_layers).eval()
    own = ('enorm.weight', 'hnorm.weight', 'eh_proj.weight', 'shared_head.norm.weight', 'shared_head.head.weight')
    state = {re.sub(r'^hc_(attn|ffn)_(fn|base|scale)$', r'\1_hc.\2', k): v for k, v in w.items()
             if k not in own and '.experts.' not in k}
    E = cfg.num_local_experts
    state['mlp.experts.gate_up_proj'] = torch.stack([torch.cat((w[f'mlp.experts.{e}.gate_proj.weight'],
                                                                w[f'mlp.experts.{e}.up_proj.weight']))
                                                     for e in range(E)])
    state['mlp.experts.down_proj'] = torch.stack([w[f'mlp.experts.{e}.down_proj.weight'] for e in range(E)])
    layer.load_state_dict(state, strict=True)
    n = len(ids)
    text = hf.model.language_model
    hidden = text(input_ids=torch.tensor([ids])).last_hidden_state[0]      # stream mean + final norm
    embeds = text.embed_tokens(torch.tensor(next_ids))
    x = torch.cat((_rms(embeds, w['enorm.weight'], eps), _rms(hidden, w['hnorm.weight'], eps)), -1) \
        @ w['eh_proj.weight'].t()
    streams = x[None, :, None, :].expand(1, n, N, x.shape[-1]).contiguous()
    y, _ = layer(streams, attention_mask=torch.ones(1, n, dtype=torch.bool), position_ids=torch.arange(n)[None],
                 position_embeddings=None)
    return _rms(y[0].mean(1), w['shared_head.norm.weight'], eps) @ w['shared_head.head.weight'].t()


def record_mtp(eng: Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Wrap the engine's MTP step: records ``(positions, draft logits)`` of every call."""
    drafter = eng.executor.worker.drafter
    calls, inner = [], drafter._step

    def step(hidden, ctx):
        out = inner(hidden, ctx)
        calls.append((ctx.positions.clone(), eng.mtp.compute_logits(out)))
        return out

    drafter._step = step
    return calls


@pytest.mark.parametrize('chunk', [8192, 32])
def test_nextn_head_matches_a_plain_torch_reference(tiny, chunk):
    """100 prompt positions (past index_topk = 64: the head's indexer selects), in one forward
    and in 32-token chunks (the head's indexer reads its own cached keys of earlier chunks)."""
    ids = random_prompt(100, 11)
    eng = engine(tiny, k=1, max_prefill_token_num=chunk)
    calls = record_mtp(eng)
    seq = eng.generate(ids, GenerationConfig(max_new_tokens=1))
    prefill = [c for c in calls if int(c[0][0]) < len(ids)]
    assert torch.cat([c[0] for c in prefill]).tolist() == list(range(len(ids)))
    got = torch.cat([c[1] for c in prefill])
    want = reference_nextn_logits(tiny, ids, ids[1:] + seq.output_ids[:1])
    assert (got - want).abs().max().item() <= 1e-4


def test_the_head_is_a_dsa_block_with_its_own_paged_rows_and_lookahead(tiny):
    eng, ref = engine(tiny), engine(tiny, mtp=False)
    head = eng.mtp
    assert type(head).__name__ == 'Glm5NextMTP' and head.layers[0].self_attn.indexer is not None
    assert head.shared_head.head is not None          # the checkpoint's own shared_head.head
    assert eng.specs[:-1] == ref.specs and isinstance(eng.specs[-1], PagedSpec)
    assert [t.name for t in eng.specs[-1].tensors()] == ['latent', 'index_keys']
    # K_blk grows by one DSA layer with its own indexer (the target has 2 DSA layers: 1 full, 1 shared)
    full_dsa = [s for s in ref.specs if isinstance(s, PagedSpec) and len(s.tensors()) == 2][0]
    assert kv_bytes_per_block(eng.specs, B) == kv_bytes_per_block(ref.specs, B) + kv_bytes_per_block([full_dsa], B)
    assert state_bytes_per_slot(eng.specs) == state_bytes_per_slot(ref.specs)
    assert (eng.strategy.token_lookahead, eng.strategy.recompute_blocks) == (1, 0)
    # the Store simulator's MTP sizes come from the same head spec
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmark'))
    try:
        import simulate_store_writes as sim
    finally:
        sys.path.pop(0)
    sizes = sim.sizes_from_config(json.loads((Path(tiny) / 'config.json').read_text()), block_size=B, mtp=True)
    assert (sizes.state_bytes, sizes.kv_block_bytes) == (eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes)


def test_mtp_needs_the_nextn_layer(tmp_path):
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    bare = make_tiny_model(str(tmp_path / 'bare'), arch='glm5_next', seed=0)     # no NextN layer by default
    with pytest.raises(ValueError, match=r'model\.layers\.4'):
        engine(bare)


def test_tp2_mtp_greedy_equals_plain_tp1(tiny):
    from test_tensor_parallel import engine as tp_engine
    prompts = PROMPTS[1:]
    expected = [plain(tiny, p) for p in prompts]
    eng = tp_engine(tiny, tp=2, speculative_config=dict(method='qwen3_next_mtp', num_speculative_tokens=2))
    try:
        attn = eng.mtp.layers[0].self_attn          # rank 0's shard: 1 of the 2 query heads, o_proj all-reduced
        assert attn.num_heads == 1 and type(attn.o_proj).__name__ == 'RowParallelLinear'
        assert run_batch(eng, prompts) == expected
        assert eng.stats()['spec_decode_draft_tokens'] > 0
    finally:
        eng.close()


# ------------------------------------------------------------------ outputs
PROMPTS = [random_prompt(n, 200 + n) for n in (5, 40, 100, 150)]     # 100, 150 > index_topk


@pytest.mark.parametrize('cache', [False, True])
def test_mtp_greedy_equals_plain_single_and_concurrent(tiny, cache):
    eng = engine(tiny, cache=cache)
    expected = [plain(tiny, p) for p in PROMPTS]
    assert eng.generate(PROMPTS[2], GEN).output_ids == expected[2]
    assert run_batch(eng, PROMPTS) == expected
    if cache:
        assert run_batch(eng, PROMPTS) == expected
        assert eng.stats()['prefix_cache_hit_tokens'] > 0
    stats = eng.stats()
    assert stats['spec_decode_verify_steps'] > 0 and stats['spec_decode_draft_tokens'] > 0


def test_multi_turn_chat_with_the_prefix_cache_equals_plain(tiny):
    """Three turns, each prompt the previous prompt + reply + a new user message; MTP with the
    prefix cache on restores earlier turns and decodes the plain (cache-off) tokens."""
    eng = engine(tiny, cache=True)
    ids, hits = random_prompt(70, 5), []
    for turn in range(3):
        seq = eng.generate(ids, GEN)
        assert seq.output_ids == plain(tiny, ids), turn
        hits.append(seq.num_cached_tokens)
        ids = seq.token_ids + random_prompt(9, 50 + turn)
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])


@pytest.mark.parametrize('n, lookahead, recompute, expected_save', [(129, None, None, 128), (128, None, None, 64),
                                                                     (129, 2, 0, 64), (129, 0, 1, 64)])
def test_restore_requirements_feed_the_boundary_choice(tiny, n, lookahead, recompute, expected_save):
    """With MTP the sequence carries ℓ = 1, r = 0 and its plan is ``plan_prefill`` of those:
    a boundary b needs token b (b <= n - 1). Forcing other values moves it as the planner says."""
    eng = engine(tiny, cache=True, prefill_save_last_only=True, max_prefill_token_num=512)
    ids, gen = random_prompt(n, 3), GenerationConfig(max_new_tokens=2, ignore_eos=True)
    seq = eng.generate(ids, gen, token_lookahead=lookahead, recompute_blocks=recompute)
    want = (1 if lookahead is None else lookahead, 0 if recompute is None else recompute)
    assert (seq.token_lookahead, seq.recompute_blocks) == want
    assert seq.stats.plans == [plan_prefill(n, 0, 512, B, A, True, *want)]
    assert seq.stats.save_points == [expected_save]
    warm = eng.generate(ids, gen, token_lookahead=lookahead, recompute_blocks=recompute)
    assert warm.num_cached_tokens == expected_save and warm.output_ids == seq.output_ids == plain(tiny, ids, gen)


def test_accepted_drafts_are_kept_and_counted(tiny):
    """The head runs (writing its rows) but its drafts are replaced by the plain continuation:
    every draft is accepted, the counters say so, and the output is still the plain one."""
    ids = PROMPTS[3]
    expected = plain(tiny, ids)
    eng = engine(tiny, k=2)
    spec, prompt_len = eng.spec, len(ids)
    inner = spec._run_mtp

    def oracle(sched, new_tokens):
        inner(sched, new_tokens)
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.draft_ids:
                done = len(seq.token_ids) + len(new_tokens.get(seq.seq_id, [])) * (not chunk.drafts) - prompt_len
                seq.draft_ids = expected[done:done + len(seq.draft_ids)]

    spec._run_mtp = oracle
    assert eng.generate(ids, GEN).output_ids == expected
    stats = eng.stats()
    assert stats['spec_decode_draft_tokens'] > 0
    assert stats['spec_decode_accepted_tokens'] == stats['spec_decode_draft_tokens']
    assert stats['spec_decode_rollbacks'] == 0


def test_spec_decode_has_no_model_type_branch():
    """A family's MTP head comes from its model class (``mtp_head``): the speculative-decoding
    package compares no model type and names no family's model type."""
    import ast
    from pathlib import Path

    from lmdeploy.pytorch.models import MODEL_REGISTRY
    from lmdeploy.pytorch.spec_decode.mtp import mtp_model_types
    root = Path(__file__).resolve().parents[1] / 'lmdeploy' / 'pytorch' / 'spec_decode'
    for path in root.glob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in MODEL_REGISTRY, (path.name, node.value)
    assert {'glm5_next', 'glm5_next_text', 'qwen3_next', 'qwen3_5_moe', 'qwen3_5_moe_text'} == set(mtp_model_types())


def test_fp8_checkpoint_head_is_dequantized_and_decodes_the_plain_tokens(tmp_path):
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / 'fp8'), arch='glm5_next', seed=0, mtp=True, fp8=True)
    eng = engine(path)
    assert eng.mtp.eh_proj.weight.dtype == torch.float32
    assert eng.generate(PROMPTS[3], GEN).output_ids == plain(path, PROMPTS[3])
    assert eng.stats()['spec_decode_draft_tokens'] > 0
