"""Granite-4.0-H (``granitemoehybrid``) served exactly like transformers: logits <= 1e-4 in fp32 at
every prompt position (5-700 tokens, cold and in 32-token chunks whose ends are not multiples of
the SSD chunk), greedy tokens equal cold, chunked and after a local prefix-cache restore, a
checkpoint at 64 tokens shared by two conversations, a 4-turn chat identical with the prefix
cache off / on / last-only / turn-end, a new engine's Store restore, TP2 = TP1, a
transformers-named checkpoint with RoPE, no experts and attention bias, the layer cache specs,
the simulator preset, and the config audit covering every field transformers reads."""
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
                          check_prompt_logits_match_transformers, make_engine,
                          random_prompt, tiny_checkpoint_and_reference)
from family_harness import check_a_new_engine_restores_from_a_file_store
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_specs import StateSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, check_config


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path in the published layout, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'granitemoehybrid')


def test_tiny_model_is_a_hybrid_with_mup_multipliers_and_an_ssd_chunk_off_the_prefill_chunks(tiny):
    config = json.load(open(os.path.join(tiny[0], 'config.json')))
    assert sorted(set(config['layer_types'])) == ['attention', 'mamba']
    assert all(config[k] != 1 for k in ('embedding_multiplier', 'residual_multiplier', 'logits_scaling'))
    assert config['attention_multiplier'] != (config['hidden_size'] // config['num_attention_heads']) ** -0.5
    assert 32 % config['mamba_chunk_size'] and config['mamba_n_groups'] > 1 and config['num_local_experts'] > 0


@pytest.mark.parametrize('n, chunk', [(5, 8192), (150, 32), (700, 32), (300, 8192)])
def test_prompt_logits_match_transformers_cold_and_chunked(tiny, n, chunk):
    check_prompt_logits_match_transformers(*tiny, n, chunk)


def test_greedy_equals_transformers_cold_chunked_and_after_prefix_cache_restore(tiny):
    check_greedy_equals_transformers_cold_chunked_and_after_restore(*tiny)


def test_a_64_token_checkpoint_of_a_shared_system_prompt_is_reused(tiny):
    """A 100-token system prompt shared by two conversations: the second one restores the
    Mamba-2 states and KV of the first 64 tokens (no 528-token floor), and decodes what a cold
    engine decodes."""
    path, _ = tiny
    system = random_prompt(100, seed=900)
    a, b = system + random_prompt(20, seed=901), system + random_prompt(30, seed=902)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    eng = make_engine(path, block_size=16, prefill_save_alignment=64, enable_prefix_caching=True)
    first, second = eng.generate(a, gen), eng.generate(b, gen)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert second.output_ids == make_engine(path, block_size=16).generate(b, gen).output_ids


def test_four_turn_chat_is_identical_under_every_cache_policy(tiny):
    path, _ = tiny
    check_four_turn_chat_under_every_cache_policy(path)


def test_transformers_named_checkpoint_with_rope_no_experts_and_bias_matches(tiny, tmp_path):
    """Granite's other switches (RoPE, the dense form with ``num_local_experts=0``, attention
    bias, projection biases, one B/C group, a width-3 conv, tied embeddings) saved under transformers' in-memory
    names."""
    from safetensors.torch import save_file
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from lmdeploy.tools.make_tiny_model import _randomize
    src, _ = tiny
    base = json.load(open(os.path.join(src, 'config.json')))
    config = GraniteMoeHybridConfig(
        vocab_size=base['vocab_size'], hidden_size=48, num_hidden_layers=3, layer_types=['attention', 'mamba', 'mamba'],
        num_attention_heads=3, num_key_value_heads=1, num_local_experts=0, num_experts_per_tok=0,
        shared_intermediate_size=40, intermediate_size=16, position_embedding_type='rope',
        rope_parameters=dict(rope_type='default', rope_theta=5000.0), attention_bias=True, mamba_proj_bias=True,
        mamba_conv_bias=True, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3,
        mamba_chunk_size=16, embedding_multiplier=6.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=True, eos_token_id=base['eos_token_id'],
        pad_token_id=base['pad_token_id'], bos_token_id=None)
    torch_state = torch.random.get_rng_state()
    hf = GraniteMoeHybridForCausalLM(config).float().eval()
    torch.random.set_rng_state(torch_state)
    _randomize(hf, 3)
    path = tmp_path / 'hf_names'
    shutil.copytree(src, path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != 'lm_head.weight'}   # tied, as published
    save_file(sd, str(path / 'model.safetensors'), metadata={'format': 'pt'})
    cfg = config.to_diff_dict()
    cfg['architectures'] = ['GraniteMoeHybridForCausalLM']
    json.dump(cfg, open(path / 'config.json', 'w'))
    check_checkpoint_matches_transformers(str(path), hf)


def test_cache_specs_are_a_mamba2_state_and_paged_kv(tiny):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('granitemoehybrid').cache_specs(config, torch.float32)
    kinds = ['attention' if s.paged else 'mamba' for s in specs]
    assert kinds == json.load(open(os.path.join(tiny[0], 'config.json')))['layer_types']
    mamba = next(s for s in specs if isinstance(s, StateSpec))
    H, P, N, G, K = (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state, config.mamba_n_groups,
                     config.mamba_d_conv)
    conv_dim = H * P + 2 * G * N
    assert state_bytes_per_slot(specs) == kinds.count('mamba') * 4 * (conv_dim * (K - 1) + H * P * N)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_row = 2 * config.num_key_value_heads * head_dim * 4                  # K and V of one token, float32
    assert kv_bytes_per_block(specs, 16) == kinds.count('attention') * 16 * kv_row
    assert [t.name for t in mamba.tensors()] == ['conv', 'ssm'] and mamba.tensors()[1].dtype == torch.float32


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(layer_types=['mamba'] * 2), 'layer_types'),
    (dict(position_embedding_type='alibi'), 'position_embedding_type'),
    (dict(num_experts_per_tok=9), 'num_experts_per_tok'),
    (dict(mamba_n_groups=3), 'mamba_n_groups'),
    (dict(mamba_n_groups=0), 'mamba_n_groups'),          # was a ZeroDivisionError
    (dict(mamba_d_head=7), 'mamba_d_head'),
    (dict(time_step_limit=(0.01, 10.0)), 'time_step_limit'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    for k, v in change.items():
        object.__setattr__(config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)
    checked = {f for f, how in FIELDS['granitemoehybrid'].items() if how == CHECKED}
    assert checked <= {'hidden_act', 'layer_types', 'layers_block_type', 'position_embedding_type', 'rope_parameters',
                       'num_experts_per_tok', 'mamba_n_groups', 'mamba_d_head', 'time_step_limit',
                       'quantization_config'}


def test_audit_lists_every_field_transformers_reads_for_granitemoehybrid():
    import transformers.models.granitemoehybrid.modeling_granitemoehybrid as modeling
    source = inspect.getsource(modeling)
    read = set(re.findall(r'config\.(\w+)', source)) | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)',
                                                                       source))
    assert read and not read - set(FIELDS['granitemoehybrid']), sorted(read - set(FIELDS['granitemoehybrid']))


def test_a_new_engine_restores_from_the_store(tiny, tmp_path):
    """A writer engine saves a 300-token prompt (Mamba-2 state checkpoints + attention KV blocks) to
    a ``file:`` Store; a new engine with an empty local cache restores 256 tokens from it and
    decodes what an engine with caching off decodes (the same in a fresh process:
    tests/test_store_fresh_process.py)."""
    check_a_new_engine_restores_from_a_file_store(tiny[0], tmp_path, seed=882_000, put_objects={'state': 4, 'kv': 16})


def test_tp2_logits_and_greedy_tokens_equal_tp1(tiny):
    """Attention by head, Mamba-2 by head and group, the shared MLP by rows; experts replicated."""
    from test_tensor_parallel import check_tp2_equals_tp1
    check_tp2_equals_tp1(tiny[0])


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over the ranks, each split tensor's ranges tile its axis exactly once (groups split too)."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    assert split > 0


def test_granite_4_0_h_small_preset_sizes():
    """The published Granite-4.0-H-Small geometry (bf16): S = 36 Mamba-2 layers x (conv
    (8192 + 2 x 128) x 3 bf16 + a 128 x 64 x 128 float32 state); K_blk = 4 attention layers x 64
    tokens x 2 x 8 KV heads x 128 bf16."""
    from test_benchmark_store_bytes import sim
    sizes = sim.sizes_from_config(sim.GRANITE_4_0_H_SMALL_CONFIG, block_size=64)
    assert sizes == sim.StoreSizes(36 * ((8192 + 256) * 3 * 2 + 128 * 64 * 128 * 4), 4 * 64 * 2 * 8 * 128 * 2)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (layer pattern, heads and groups, state size, conv width, SSD
    chunk, RoPE or none, experts or the dense form) and a random prefill chunking then 3 decode
    steps: logits <= 1e-4 of transformers' full forward, through NaN-poisoned scrambled blocks
    and slots."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(1, 3))
    types = data.draw(st.lists(st.sampled_from(['mamba', 'attention']), min_size=n_layers, max_size=n_layers))
    groups = data.draw(st.sampled_from([1, 2]))
    heads = groups * data.draw(st.integers(1, 2))
    experts = data.draw(st.sampled_from([0, 4]))
    config = GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=n_layers, layer_types=types, num_attention_heads=2,
        num_key_value_heads=data.draw(st.sampled_from([1, 2])), num_local_experts=experts,
        num_experts_per_tok=data.draw(st.integers(1, 3)) if experts else 0, intermediate_size=16,
        shared_intermediate_size=24, mamba_n_heads=heads, mamba_d_head=64 // heads, mamba_n_groups=groups,
        mamba_d_state=data.draw(st.sampled_from([4, 8])), mamba_d_conv=data.draw(st.integers(2, 4)),
        mamba_chunk_size=data.draw(st.sampled_from([5, 8, 64])),
        position_embedding_type=data.draw(st.sampled_from([None, 'rope'])), embedding_multiplier=4.0,
        residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0, pad_token_id=0, bos_token_id=None,
        eos_token_id=1)
    check_random_model_in_random_chunks_then_decode(data, GraniteMoeHybridForCausalLM, 'granitemoehybrid', config, 70,
                                                    TOL)


@pytest.fixture(scope='module')
def tiny_one_group(tmp_path_factory):
    """The tiny model with the published ``mamba_n_groups = 1`` (fewer groups than TP ranks)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_granite_g1')), arch='granitemoehybrid', seed=0,
                           mamba_n_groups=1)


def test_one_group_tp2_equals_tp1_with_the_group_replicated_and_its_norm_all_reduced(tiny_one_group):
    """``mamba_n_groups = 1`` at TP2: each rank reads half the heads and the whole group's B / C
    rows and conv channels (the only ranges both ranks read); TP2 = TP1 (the norm's sum of squares
    is all-reduced). Each rank's state holds its heads plus a copy of B / C; the Store (and the
    simulator) charges the single-process layout, B / C once."""
    from safetensors import safe_open

    from test_store_engine import sim
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    _, _, split, repeated = check_tp_slices_tile_every_split_tensor(tiny_one_group, shared=True)
    cfg = json.load(open(os.path.join(tiny_one_group, 'config.json')))
    mamba = cfg['layer_types'].count('mamba')
    with safe_open(os.path.join(tiny_one_group, 'model.safetensors'), framework='pt') as f:
        bc = [n for n in f.keys() if re.search(r'\.mamba\.(in_proj|conv1d)\.', n)]
    assert split > 0 and mamba > 0 and repeated == 2 * len(bc)     # each: the B range and the C range

    def store_sizes(eng):
        one, two = (sim.sizes_from_config(cfg, tp=tp, block_size=eng.cache_engine.block_size) for tp in (1, 2))
        assert two.charged == (eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes)
        assert two.charged[0] == one.state_bytes
        H, P, Dn, K = cfg['mamba_n_heads'], cfg['mamba_d_head'], cfg['mamba_d_state'], cfg['mamba_d_conv']
        per_rank = mamba * 4 * ((H // 2 * P + 2 * Dn) * (K - 1) + H // 2 * P * Dn)     # float32
        assert two.state_bytes == per_rank and 2 * per_rank > one.state_bytes
    check_tp2_equals_tp1(tiny_one_group, then=store_sizes)


def test_one_group_tp2_store_put_bytes_equal_the_simulator_and_a_tp1_reader_restores(tiny_one_group,
                                                                                     mooncake_services):
    """A TP2 writer of the ``mamba_n_groups = 1`` model (B / C copied on both ranks) puts the
    single-process payload: its put bytes equal the simulator's (the group once), and a TP1
    reader restores the 128-token prefix and decodes what a cold engine decodes."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from test_store_engine import sim, store_config
    from tp_utils import A, B, P, assert_reader_restores, engine as tp_engine
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    ids = random_prompt(150, 36_036)        # a prompt new to the session's Store
    cold = tp_engine(tiny_one_group)
    expected = cold.generate(ids, gen).output_ids
    cold.close()
    cfg = store_config(mooncake_services, prefill_save_last_only=True, num_gpu_blocks=64)
    writer = Engine(tiny_one_group, PytorchEngineConfig(**cfg, tp=2))
    try:
        seq = writer.generate(ids, gen)
        assert seq.output_ids == expected and seq.stats.save_points == [128]
        assert writer.store.flush(timeout=30)
        sizes = sim.sizes_from_config(json.load(open(os.path.join(tiny_one_group, 'config.json'))), tp=2,
                                      block_size=B)
        S, K = sizes.charged
        plan = sim.simulate([150], S, K, chunk_size=P, block_size=B, alignment=A)
        assert writer.stats()['store_put_bytes'] == {'state': S, 'kv': 8 * K}
        assert sum(writer.stats()['store_put_bytes'].values()) == plan.last_only.total_bytes
    finally:
        writer.close()
    assert_reader_restores(tiny_one_group, cfg, 1, ids, gen, expected)
