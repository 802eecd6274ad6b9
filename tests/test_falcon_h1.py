"""Falcon-H1 (``falcon_h1``: Mamba-2 and attention side by side in every layer, µP multipliers)
served exactly like transformers: logits <= 1e-4 in fp32 at every prompt position (5-700 tokens,
cold and in 32-token chunks whose ends are not multiples of the SSD chunk of 24), greedy tokens
equal cold, chunked and after a local prefix-cache restore, a 4-turn chat identical with the
prefix cache off / on / last-only / turn-end, Store put bytes equal to the simulator and a Store
restore by a new engine, TP2 = TP1 (one group spanning the ranks), a transformers checkpoint
with the other switches (no Mamba norm, norm before the gate, biases, tied embeddings), the two
cache entries per layer and the config audit."""
import json
import os
import shutil

import pytest
import torch

from engine_utils import (check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores,
                          tiny_checkpoint_and_reference)
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            hf_model, untied, write_checkpoint)
from lmdeploy.pytorch.cache_specs import FullAttentionSpec, StateSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'falcon_h1')


def test_tiny_model_has_every_multiplier_off_one_and_an_ssd_chunk_off_the_prefill_chunks(tiny):
    config = json.load(open(os.path.join(tiny[0], 'config.json')))
    for key in ('embedding_multiplier', 'lm_head_multiplier', 'key_multiplier', 'attention_in_multiplier',
                'attention_out_multiplier', 'ssm_in_multiplier', 'ssm_out_multiplier'):
        assert config[key] != 1.0, key
    assert all(m != 1.0 for m in config['mlp_multipliers'] + config['ssm_multipliers'])
    assert config['mamba_d_ssm'] != config['mamba_expand'] * config['hidden_size']
    assert 32 % config['mamba_chunk_size'] and config['mamba_n_groups'] > 1 and config['mamba_rms_norm']


class TestFalconH1Conformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""


def test_store_put_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=991_000)


@pytest.mark.parametrize('norm', ['none', 'before_gate'])
def test_transformers_checkpoint_with_the_other_switches_matches(tiny, tmp_path, norm):
    """Falcon-H1's other switches from ``FalconH1ForCausalLM``'s own state dict: no Mamba norm
    (``mamba_rms_norm`` off: ``y * silu(z)``) or a norm before the gate; attention, MLP, Mamba
    ``in_proj`` and ``out_proj`` (``projectors_bias``) biases, no conv bias, one B/C group, a
    width-3 conv, MHA, ``mamba_d_ssm`` unset (``mamba_expand`` x hidden), tied embeddings."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    src, _ = tiny
    base = json.load(open(os.path.join(src, 'config.json')))
    config = FalconH1Config(
        vocab_size=base['vocab_size'], hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=40, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
        projectors_bias=True, mamba_conv_bias=False, mamba_d_ssm=None, mamba_expand=2, mamba_n_heads=4,
        mamba_d_head='auto', mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=16,
        mamba_rms_norm=norm != 'none', mamba_norm_before_gate=norm == 'before_gate',
        embedding_multiplier=3.0, lm_head_multiplier=0.5, mlp_multipliers=[1.5, 0.7], key_multiplier=0.6,
        attention_in_multiplier=0.8, attention_out_multiplier=1.4, ssm_multipliers=[1.2, 0.9, 1.3, 0.75, 1.1],
        ssm_in_multiplier=0.9, ssm_out_multiplier=1.2,
        rope_parameters=dict(rope_type='default', rope_theta=5000.0), tie_word_embeddings=True,
        eos_token_id=base['eos_token_id'], pad_token_id=base['pad_token_id'], bos_token_id=None)
    hf = hf_model(FalconH1ForCausalLM, config, 3)
    path = tmp_path / 'hf_names'
    sd = write_checkpoint(src, path, hf, config, untied, drop_config=('time_step_limit',))  # the default: no JSON inf
    assert any(k.endswith('mamba.norm.weight') for k in sd) == (norm != 'none')
    check_checkpoint_matches_transformers(str(path), hf)


def test_a_config_json_in_the_published_form_loads_and_matches(tiny, tmp_path):
    """The tiiuae/Falcon-H1-* ``config.json`` form: top-level ``rope_theta`` (1e11) with
    ``rope_scaling: null`` and no ``rope_parameters``, ``torch_dtype``, the original code's extra
    keys (``attn_layer_indices``, ``mamba_use_mlp``, ``mlp_expansion_factor``) and no
    ``time_step_limit``; the engine and ``transformers`` read it alike."""
    from engine_utils import load_hf
    src, _ = tiny
    path = tmp_path / 'published'
    shutil.copytree(src, path)
    cfg = json.load(open(path / 'config.json'))
    cfg.pop('rope_parameters')
    cfg.update(rope_theta=1e11, rope_scaling=None, torch_dtype=cfg.pop('dtype'), attn_layer_indices=None,
               mamba_use_mlp=True, mlp_expansion_factor=8, transformers_version='4.52.0.dev0')
    json.dump(cfg, open(path / 'config.json', 'w'))
    check_checkpoint_matches_transformers(str(path), load_hf(str(path)))


def test_cache_specs_are_two_entries_per_layer_kv_then_the_mamba2_state(tiny):
    from transformers import AutoConfig

    from lmdeploy.pytorch.models.falcon_h1 import attention_cache_index, mamba_cache_index
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('falcon_h1').cache_specs(config, torch.float32)
    L = config.num_hidden_layers
    assert len(specs) == 2 * L
    assert all(isinstance(specs[attention_cache_index(i)], FullAttentionSpec) for i in range(L))
    assert all(isinstance(specs[mamba_cache_index(i)], StateSpec) for i in range(L))
    H, P, N, G, K = (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state, config.mamba_n_groups,
                     config.mamba_d_conv)
    assert state_bytes_per_slot(specs) == L * 4 * ((H * P + 2 * G * N) * (K - 1) + H * P * N)
    assert kv_bytes_per_block(specs, 16) == L * 16 * 2 * config.num_key_value_heads * config.head_dim * 4
    bf16 = specs = get_model_class('falcon_h1').cache_specs(config, torch.bfloat16)[1].tensors()
    assert bf16[0].dtype == torch.bfloat16 and bf16[1].dtype == torch.float32    # the SSM state stays fp32


def test_the_layers_address_their_own_cache_entries(tiny):
    """Layer ``i``'s attention reads ``kv_caches[2 i]`` and its mixer ``state_caches[2 i + 1]``."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    model = get_model_class('falcon_h1')(config)
    assert [(layer.self_attn.layer_idx, layer.mamba.layer_idx) for layer in model.model.layers] == \
        [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(mamba_n_groups=3), 'mamba_n_groups'),
    (dict(mamba_d_head=7), 'mamba_d_head'),
    (dict(time_step_limit=(0.01, 10.0)), 'time_step_limit'),
    (dict(mlp_multipliers=[1.0]), 'mlp_multipliers'),
    (dict(ssm_multipliers=[1.0, 1.0]), 'ssm_multipliers'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    check_refused_field(AutoConfig.from_pretrained(tiny[0]), change, field, 'falcon_h1',
                        {'hidden_act', 'rope_parameters', 'mamba_n_groups', 'mamba_d_head', 'time_step_limit',
                         'quantization_config', 'mlp_multipliers', 'ssm_multipliers', 'mamba_norm_before_gate'})


def test_audit_lists_every_field_transformers_reads_for_falcon_h1():
    check_audit_lists_every_field_transformers_reads('falcon_h1')


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Attention by head, Mamba-2 by head and group (two groups: one per rank), the MLP by rows:
    over the ranks each split tensor's ranges tile its axis once."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    # per layer: in_proj, conv1d weight and bias, dt_bias, A_log, D, norm, out_proj; q/k/v/o;
    # gate/up/down (3 layers); the embedding and lm_head
    assert split == 3 * (8 + 4 + 3) + 2


def test_one_group_tp2_equals_tp1_and_refusals_name_the_field(tmp_path):
    """``mamba_n_groups = 1`` (the published Falcon-H1): the group's ``B`` / ``C`` are read by
    both ranks and its norm is all-reduced; TP2 = TP1. Three KV heads at TP2 are refused naming
    ``num_key_value_heads``; a norm before the gate over a group spanning ranks names
    ``mamba_norm_before_gate``."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    path = make_tiny_model(str(tmp_path / 'g1'), arch='falcon_h1', seed=0, mamba_n_groups=1, num_hidden_layers=1)
    _, _, split, repeated = check_tp_slices_tile_every_split_tensor(path, shared=True)
    assert split > 0 and repeated == 2 * 3     # in_proj, conv1d weight and bias: B and C each
    check_tp2_equals_tp1(path)
    config = AutoConfig.from_pretrained(path)
    config.mamba_norm_before_gate = True
    with pytest.raises(ValueError, match='mamba_norm_before_gate'):
        TPLayout(config, 0, 2)
    config.num_attention_heads, config.num_key_value_heads = 6, 3
    with pytest.raises(ValueError, match=r'num_key_value_heads \(3\) must be divisible by tp \(2\)'):
        TPLayout(config, 0, 2)
