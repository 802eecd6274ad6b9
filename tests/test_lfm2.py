"""LFM2 (``lfm2``) and LFM2-MoE (``lfm2_moe``) served exactly like transformers: logits <= 1e-4 in
fp32 at every prompt position (5-700 tokens, cold and in 32-token chunks), greedy tokens equal
cold, chunked and after a local prefix-cache restore, a 4-turn chat identical with the prefix
cache off / on / last-only / turn-end, a TP2 Store writer putting the simulator's bytes and a
TP1 reader restoring from the Store, TP2 = TP1, the published config.json spellings and
transformers' in-memory names (fused experts) loading, the conv-only cache spec, the simulator
preset, and the config audit covering every field transformers reads."""
import inspect
import json
import os
import re
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import (TOL, check_checkpoint_matches_transformers, check_four_turn_chat_under_every_cache_policy,
                          check_greedy_equals_transformers_cold_chunked_and_after_restore,
                          check_prompt_logits_match_transformers, tiny_checkpoint_and_reference)
from lmdeploy.pytorch.cache_specs import StateSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, check_config

ARCHS = ('lfm2', 'lfm2_moe')


@pytest.fixture(scope='module', params=ARCHS)
def tiny(request, tmp_path_factory):
    """(arch, checkpoint path in the published layout, transformers float32 reference)."""
    return (request.param, *tiny_checkpoint_and_reference(tmp_path_factory, request.param))


def _config(path: str) -> dict:
    with open(os.path.join(path, 'config.json')) as f:
        return json.load(f)


def test_tiny_models_are_short_conv_hybrids_in_the_published_layout(tiny):
    arch, path, _ = tiny
    config = _config(path)
    assert sorted(set(config['layer_types'])) == ['conv', 'full_attention']
    if arch == 'lfm2':      # published spellings; the auto-adjusted MLP width differs from block_ff_dim
        assert 'block_ff_dim' in config and 'tie_embedding' in config and 'intermediate_size' not in config
        assert config['block_auto_adjust_ff_dim'] and config['block_multiple_of'] < config['block_ff_dim']
    else:                   # experts one tensor each, a nonzero expert bias, a dense first layer
        from safetensors import safe_open
        with safe_open(os.path.join(path, 'model.safetensors'), framework='pt') as f:
            names = set(f.keys())
            bias = f.get_tensor('model.layers.1.feed_forward.expert_bias')
        assert 'model.layers.1.feed_forward.experts.7.w3.weight' in names and bias.abs().min() > 0
        assert config['num_dense_layers'] == 1 and config['routed_scaling_factor'] != 1


@pytest.mark.parametrize('n, chunk', [(5, 8192), (150, 32), (700, 32)])
def test_prompt_logits_match_transformers_cold_and_chunked(tiny, n, chunk):
    check_prompt_logits_match_transformers(*tiny[1:], n, chunk)


def test_greedy_equals_transformers_cold_chunked_and_after_prefix_cache_restore(tiny):
    check_greedy_equals_transformers_cold_chunked_and_after_restore(*tiny[1:])


def test_four_turn_chat_is_identical_under_every_cache_policy(tiny):
    check_four_turn_chat_under_every_cache_policy(tiny[1])


def test_cache_specs_are_one_conv_state_tensor_and_paged_kv(tiny):
    """A short-conv layer caches one tensor per sequence, ``conv [hidden, conv_L_cache - 1]`` in
    the model dtype (no recurrent state); attention layers K/V per token."""
    from transformers import AutoConfig
    arch, path, _ = tiny
    config = AutoConfig.from_pretrained(path)
    specs = get_model_class(arch).cache_specs(config, torch.bfloat16)
    kinds = ['full_attention' if s.paged else 'conv' for s in specs]
    assert kinds == _config(path)['layer_types']
    conv = next(s for s in specs if isinstance(s, StateSpec))
    assert [(t.name, t.shape, t.dtype) for t in conv.tensors()] == [('conv', (64, 2), torch.bfloat16)]
    assert state_bytes_per_slot(specs) == kinds.count('conv') * 64 * 2 * 2
    assert kv_bytes_per_block(specs, 16) == kinds.count('full_attention') * 16 * 2 * 2 * 16 * 2


def test_simulator_sizes_the_conv_only_state_from_config_json(tiny):
    """``sizes_from_config`` reads the family's cache specs: S is the conv states alone, at TP2
    half per rank and the whole charged to the Store."""
    from test_benchmark_store_bytes import sim
    arch, path, _ = tiny
    cfg = _config(path)
    convs, attn = cfg['layer_types'].count('conv'), cfg['layer_types'].count('full_attention')
    one = sim.sizes_from_config(cfg, block_size=16)
    assert one == sim.StoreSizes(convs * 64 * 2 * 4, attn * 16 * 2 * 2 * 16 * 4)
    two = sim.sizes_from_config(cfg, tp=2, block_size=16)
    assert two.state_bytes * 2 == one.state_bytes and two.charged == (one.state_bytes, one.kv_block_bytes)


def test_lfm2_1_2b_preset_sizes():
    """The published LFM2-1.2B geometry (bf16): S = 10 short-conv layers x 2048 channels x 2
    (conv_L_cache 3) bf16 — 80 KiB, a tenth of one KV block; K_blk = 6 attention layers x 64
    tokens x 2 x 8 KV heads x 64 bf16."""
    from test_benchmark_store_bytes import sim
    sizes = sim.sizes_from_config(sim.LFM2_1_2B_CONFIG, block_size=64)
    assert sizes == sim.StoreSizes(10 * 2048 * 2 * 2, 6 * 64 * 2 * 8 * 64 * 2)


def test_transformers_named_checkpoints_with_other_switches_match(tiny, tmp_path):
    """Each family's other switches saved under transformers' in-memory names (LFM2-MoE: fused
    experts): LFM2 with conv biases, a width-4 conv, tied embeddings, 3 query heads of 16 over
    one KV head and the MLP width as given (no auto-adjust); LFM2-MoE with no expert bias, no
    renormalisation, two dense layers and a width-2 conv."""
    from safetensors.torch import save_file
    from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

    from lmdeploy.tools.make_tiny_model import _randomize
    arch, src, _ = tiny
    base = _config(src)
    common = dict(vocab_size=base['vocab_size'], hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                  rope_parameters=dict(rope_type='default', rope_theta=5000.0), norm_eps=1e-6,
                  eos_token_id=base['eos_token_id'], pad_token_id=base['pad_token_id'], bos_token_id=None)
    if arch == 'lfm2':
        cls, config = Lfm2ForCausalLM, Lfm2Config(
            **common, num_hidden_layers=3, layer_types=['full_attention', 'conv', 'conv'], intermediate_size=40,
            block_auto_adjust_ff_dim=False, conv_bias=True, conv_L_cache=4, tie_word_embeddings=True)
    else:
        cls, config = Lfm2MoeForCausalLM, Lfm2MoeConfig(
            **common, num_hidden_layers=4, layer_types=['conv', 'conv', 'full_attention', 'conv'],
            intermediate_size=40, num_dense_layers=2, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16,
            use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=0.7, conv_L_cache=2,
            tie_word_embeddings=False)
    torch_state = torch.random.get_rng_state()
    hf = cls(config).float().eval()
    torch.random.set_rng_state(torch_state)
    _randomize(hf, 3)
    path = tmp_path / 'hf_names'
    shutil.copytree(src, path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != 'lm_head.weight' or arch != 'lfm2'}
    save_file(sd, str(path / 'model.safetensors'), metadata={'format': 'pt'})
    cfg = config.to_diff_dict()
    cfg['architectures'] = [cls.__name__]
    json.dump(cfg, open(path / 'config.json', 'w'))
    check_checkpoint_matches_transformers(str(path), hf)


@pytest.mark.parametrize('change, field', [
    (dict(layer_types=['conv'] * 2), 'layer_types'),
    (dict(layer_types=['conv', 'sliding_attention', 'conv', 'conv']), 'layer_types'),
    (dict(conv_L_cache=1), 'conv_L_cache'),
    (dict(num_key_value_heads=3), 'num_key_value_heads'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    arch, path, _ = tiny
    config = AutoConfig.from_pretrained(path)
    for k, v in change.items():
        object.__setattr__(config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)
    checked = {f for f, how in FIELDS[arch].items() if how == CHECKED}
    assert checked <= {'layer_types', 'conv_L_cache', 'num_key_value_heads', 'rope_parameters', 'num_experts_per_tok',
                       'quantization_config'}


@pytest.mark.parametrize('tiny', ['lfm2_moe'], indirect=True)
def test_lfm2_moe_refuses_more_experts_per_token_than_experts(tiny):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[1])
    object.__setattr__(config, 'num_experts_per_tok', 9)
    with pytest.raises(ValueError, match='num_experts_per_tok'):
        check_config(config)


@pytest.mark.parametrize('arch', ARCHS)
def test_audit_lists_every_field_transformers_reads(arch):
    import importlib
    source = inspect.getsource(importlib.import_module(f'transformers.models.{arch}.modeling_{arch}'))
    read = set(re.findall(r'config\.(\w+)', source)) | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)',
                                                                       source))
    assert read and not read - set(FIELDS[arch]), sorted(read - set(FIELDS[arch]))


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over the ranks, each split tensor's ranges tile its axis exactly once (in_proj's B, C and x
    blocks each by channel)."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, layouts, split = check_tp_slices_tile_every_split_tensor(tiny[1])
    assert split > 0
    assert layouts[1].shard('model.layers.0.conv.in_proj.weight').ranges == ((32, 64), (96, 128), (160, 192))


def test_tp_refusal_names_the_field_tp_does_not_divide(tiny):
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    config = AutoConfig.from_pretrained(tiny[1])
    with pytest.raises(ValueError, match='num_key_value_heads'):
        TPLayout(config, 0, 4)     # 4 query heads, 2 KV heads


def test_tp2_equals_tp1_store_bytes_equal_the_simulator_and_a_fresh_engine_restores(tiny, mooncake_services):
    """Tensor parallelism and the Store with one TP2 engine per family (each TP2 engine is a
    process start). LFM2 (its MLP width auto-adjusted before the split): a last-only TP2 writer
    saves a 150-token prompt (conv states at 128 + attention KV) and decodes what TP1 decodes,
    its put bytes equal the simulator's (S the conv states of both ranks' channels, K_blk both
    ranks' KV heads), and a fresh TP1 engine restores the 128-token prefix from the Store and
    decodes the same. LFM2-MoE: TP2 prompt logits within ``TP_TOL`` of TP1 and staggered greedy
    outputs equal (experts replicated), then the same Store check with a TP1 writer and reader."""
    from test_tensor_parallel import check_tp2_equals_tp1
    from tp_utils import check_store_across_tp_sizes
    arch, path, _ = tiny
    if arch == 'lfm2_moe':
        check_tp2_equals_tp1(path)
    writer_tp = 2 if arch == 'lfm2' else 1
    check_store_across_tp_sizes(path, mooncake_services, writer_tp, 1, 44_000 + ARCHS.index(arch),
                                kv_replicated=False)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (family, layer pattern, KV heads, conv width and bias, MLP
    auto-adjust, expert bias and renormalisation) and a random prefill chunking then 3 decode
    steps: logits <= 1e-4 of transformers' full forward, through NaN-poisoned scrambled blocks
    and slots."""
    from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    arch = data.draw(st.sampled_from(ARCHS))
    n_layers = data.draw(st.integers(1, 3))
    types = data.draw(st.lists(st.sampled_from(['conv', 'full_attention']), min_size=n_layers, max_size=n_layers))
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=n_layers, layer_types=types,
                  num_attention_heads=2, num_key_value_heads=data.draw(st.sampled_from([1, 2])),
                  conv_L_cache=data.draw(st.integers(2, 4)), conv_bias=data.draw(st.booleans()),
                  pad_token_id=0, bos_token_id=None, eos_token_id=1)
    if arch == 'lfm2':
        cls, config = Lfm2ForCausalLM, Lfm2Config(
            **common, intermediate_size=48, block_auto_adjust_ff_dim=data.draw(st.booleans()), block_multiple_of=16)
    else:
        cls, config = Lfm2MoeForCausalLM, Lfm2MoeConfig(
            **common, intermediate_size=24, num_dense_layers=data.draw(st.integers(0, 1)), num_experts=4,
            num_experts_per_tok=data.draw(st.integers(1, 3)), moe_intermediate_size=16,
            use_expert_bias=data.draw(st.booleans()), norm_topk_prob=data.draw(st.booleans()),
            routed_scaling_factor=1.5)
    check_random_model_in_random_chunks_then_decode(data, cls, arch, config, 70, TOL)
