"""Qwen3.5-MoE served exactly like transformers: the text-only ``qwen3_5_moe_text`` and the
vision-language ``qwen3_5_moe`` checkpoints on text prompts (logits <= 1e-4 in fp32 at every
prompt position, cold and in 32-token chunks; greedy tokens equal cold, chunked, after a local
prefix-cache restore and after a new engine's Store restore), experts loaded from
per-expert tensors and from transformers' fused layout alike, a 4-turn chat identical with the
prefix cache off / on / last-only / turn-end (hits on later turns), and the config audit
covering the fields transformers reads. Images: tests/test_qwen3_5_moe_images.py."""
import inspect
import re

import pytest
import torch

from engine_utils import (TOL, check_four_turn_chat_under_every_cache_policy,
                          check_greedy_equals_transformers_cold_chunked_and_after_restore,
                          check_prompt_logits_match_transformers, make_engine,
                          random_prompt)
from family_harness import check_a_new_engine_restores_from_a_file_store
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import FIELDS, check_config
from model_harness import ModelHarness, randomize_hybrid_

ARCHS = ['qwen3_5_moe_text', 'qwen3_5_moe']


@pytest.fixture(scope='module')
def models(tiny_qwen3_5_moe_text, tiny_qwen3_5_moe):
    """arch -> (checkpoint path, transformers float32 reference)."""
    import transformers
    out = {}
    for arch, path in (('qwen3_5_moe_text', tiny_qwen3_5_moe_text), ('qwen3_5_moe', tiny_qwen3_5_moe)):
        cls = transformers.Qwen3_5MoeForConditionalGeneration if arch == 'qwen3_5_moe' \
            else transformers.Qwen3_5MoeForCausalLM
        out[arch] = path, cls.from_pretrained(path, dtype=torch.float32).eval()
    return out


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('n, chunk', [(5, 8192), (150, 32)])
def test_prompt_logits_match_transformers_cold_and_chunked(models, arch, n, chunk):
    check_prompt_logits_match_transformers(*models[arch], n, chunk)


@pytest.mark.parametrize('arch', ARCHS)
def test_greedy_equals_transformers_cold_chunked_and_after_prefix_cache_restore(models, arch):
    check_greedy_equals_transformers_cold_chunked_and_after_restore(*models[arch])


def test_fused_expert_checkpoint_loads_the_same_weights(tiny_qwen3_5_moe_text, tmp_path):
    """The checkpoint rewritten with transformers' fused ``mlp.experts.gate_up_proj [E, 2I, H]``
    / ``down_proj [E, H, I]`` (also for the MTP layer) gives bit-identical parameters."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lmdeploy.pytorch.models.loader import load_model
    fused = tmp_path / 'fused'
    shutil.copytree(tiny_qwen3_5_moe_text, fused)
    tensors = load_file(str(fused / 'model.safetensors'))
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r'^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$', name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    assert experts
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _ in parts)
        out[f'{prefix}.gate_up_proj'] = torch.stack([torch.cat((parts[(e, 'gate_proj')], parts[(e, 'up_proj')]))
                                                     for e in range(num)])
        out[f'{prefix}.down_proj'] = torch.stack([parts[(e, 'down_proj')] for e in range(num)])
    save_file(out, str(fused / 'model.safetensors'), metadata={'format': 'pt'})
    a = load_model(tiny_qwen3_5_moe_text, dtype='float32', progress=False).model
    b = load_model(str(fused), dtype='float32', progress=False).model
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = random_prompt(40, seed=5)
    assert make_engine(str(fused)).generate(ids, GenerationConfig(max_new_tokens=6)).output_ids == \
        make_engine(tiny_qwen3_5_moe_text).generate(ids, GenerationConfig(max_new_tokens=6)).output_ids




@pytest.mark.parametrize('arch', ARCHS)
def test_four_turn_chat_is_identical_under_every_cache_policy(models, arch):
    path, _ = models[arch]
    check_four_turn_chat_under_every_cache_policy(path)


def test_a_new_engine_restores_from_the_store(tiny_qwen3_5_moe_text, tmp_path):
    """A writer engine saves a 300-token prompt (gated delta rule checkpoints + KV blocks) to a
    ``file:`` Store; a new engine with an empty local cache restores 256 tokens from it and decodes
    what an engine with caching off decodes (the same in a fresh process:
    tests/test_store_fresh_process.py)."""
    check_a_new_engine_restores_from_a_file_store(tiny_qwen3_5_moe_text, tmp_path, seed=884_000,
                                                  put_objects={'state': 4, 'kv': 16})


def _text_config(**overrides):
    from transformers import Qwen3_5MoeTextConfig
    fields = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=3, layer_types=['linear_attention', 'full_attention', 'linear_attention'],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                  shared_expert_intermediate_size=40,
                  rope_parameters=dict(rope_type='default', rope_theta=1e4, partial_rotary_factor=0.75,
                                       mrope_section=[2, 2, 2]))
    fields.update(overrides)
    return Qwen3_5MoeTextConfig(**fields)


@pytest.mark.parametrize('overrides', [{}, dict(tie_word_embeddings=True, attention_bias=True, num_experts_per_tok=1)])
def test_random_config_matches_transformers_chunked_and_decoded(overrides):
    """Model level, other shapes (k = 1 and 3 of 6 experts, tied embeddings, attention bias):
    prompt in 40-token chunks then 3 decode steps, logits <= 1e-4 of transformers."""
    from transformers import Qwen3_5MoeForCausalLM
    config = _text_config(**overrides)
    check_config(config)
    torch.manual_seed(0)
    hf = randomize_hybrid_(Qwen3_5MoeForCausalLM(config).float().eval())
    ours = get_model_class('qwen3_5_moe_text')(config).eval()
    ours.load_weights(hf.state_dict().items())
    ids = torch.randint(0, 96, (93,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids[None], use_cache=False).logits[0].float()
    h = ModelHarness(ours, type(ours).cache_specs(config, torch.float32))
    seq = h.add_sequence()
    got = torch.cat([h.run_chunks(seq, ids[:90].tolist(), 40)] + [h.step([(seq, [t])])[0] for t in ids[90:].tolist()])
    assert (got - ref).abs().max().item() <= TOL


def test_router_always_renormalises_its_top_k():
    """The MoE block of every layer renormalises (the config has no norm_topk_prob field)."""
    config = _text_config()
    assert not hasattr(config, 'norm_topk_prob')
    model = get_model_class('qwen3_5_moe_text')(config)
    assert all(layer.mlp.norm_topk_prob for layer in model.model.layers)


@pytest.mark.parametrize('arch', ARCHS)
def test_audit_lists_every_field_transformers_reads_for_qwen3_5_moe(arch):
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling
    source = inspect.getsource(modeling)
    read = (set(re.findall(r'config\.(\w+)', source))
            | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)', source))) - {
                'get_text_config', 'standardize_rope_params', 'per_layer_config'}
    if arch == 'qwen3_5_moe_text':      # the text classes only
        read -= set(FIELDS['qwen3_5_moe']) - set(FIELDS['qwen3_5_moe_text'])
    assert not read - set(FIELDS[arch]), sorted(read - set(FIELDS[arch]))
