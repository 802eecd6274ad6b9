"""Bamba (``bamba``) served exactly like transformers: logits <= 1e-4 in fp32 at every prompt
position (5-700 tokens, cold and in 32-token chunks whose ends are not multiples of the SSD chunk
of 24), greedy tokens equal cold, chunked and after a local prefix-cache restore, a 4-turn chat
identical with the prefix cache off / on / last-only / turn-end, Store put bytes equal to the
simulator and a Store restore by a new engine, TP2 = TP1 (one group spanning the ranks; the
two-group split's slices tile), a transformers checkpoint with the other switches (biases, tied embeddings, one group),
the layer cache specs and the config audit."""
import json
import os

import pytest
import torch

from engine_utils import (check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores,
                          tiny_checkpoint_and_reference)
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            hf_model, untied, write_checkpoint)
from lmdeploy.pytorch.cache_specs import StateSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'bamba')


def test_tiny_model_is_a_hybrid_with_half_rotary_heads_and_an_ssd_chunk_off_the_prefill_chunks(tiny):
    config = json.load(open(os.path.join(tiny[0], 'config.json')))
    assert config['attn_layer_indices'] == [1] and config['num_hidden_layers'] == 4
    assert config['rope_parameters']['partial_rotary_factor'] == 0.5
    assert 32 % config['mamba_chunk_size'] and config['mamba_n_groups'] > 1


class TestBambaConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""


def test_store_put_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=990_000)


def test_transformers_checkpoint_with_biases_one_group_and_tied_embeddings_matches(tiny, tmp_path):
    """Bamba's other switches (attention, MLP and Mamba projection biases, no conv bias, one B/C
    group, a width-3 conv, two attention layers, MHA, tied embeddings) from ``BambaForCausalLM``'s
    own state dict."""
    from transformers import BambaConfig, BambaForCausalLM

    src, _ = tiny
    base = json.load(open(os.path.join(src, 'config.json')))
    config = BambaConfig(
        vocab_size=base['vocab_size'], hidden_size=48, num_hidden_layers=4, attn_layer_indices=[0, 2],
        num_attention_heads=3, num_key_value_heads=3, intermediate_size=40, attention_bias=True, mlp_bias=True,
        mamba_proj_bias=True, mamba_conv_bias=False, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=16, rope_parameters=dict(rope_type='default',
                                                                                   rope_theta=5000.0),
        tie_word_embeddings=True, eos_token_id=base['eos_token_id'], pad_token_id=base['pad_token_id'],
        bos_token_id=None)
    hf = hf_model(BambaForCausalLM, config, 3)
    path = tmp_path / 'hf_names'
    write_checkpoint(src, path, hf, config, untied, drop_config=('time_step_limit',))   # the default: no JSON inf
    check_checkpoint_matches_transformers(str(path), hf)


def test_cache_specs_are_a_mamba2_state_and_paged_kv(tiny):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('bamba').cache_specs(config, torch.float32)
    assert ['attention' if s.paged else 'mamba' for s in specs] == ['mamba', 'attention', 'mamba', 'mamba']
    H, P, N, G, K = (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state, config.mamba_n_groups,
                     config.mamba_d_conv)
    assert state_bytes_per_slot(specs) == 3 * 4 * ((H * P + 2 * G * N) * (K - 1) + H * P * N)
    head_dim = config.hidden_size // config.num_attention_heads
    assert kv_bytes_per_block(specs, 16) == 16 * 2 * config.num_key_value_heads * head_dim * 4
    mamba = specs[0]
    assert isinstance(mamba, StateSpec) and [t.dtype for t in mamba.tensors()] == [torch.float32] * 2
    bf16 = get_model_class('bamba').cache_specs(config, torch.bfloat16)[0].tensors()
    assert bf16[0].dtype == torch.bfloat16 and bf16[1].dtype == torch.float32    # the SSM state stays fp32


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(attn_layer_indices=[1, 4]), 'attn_layer_indices'),
    (dict(mamba_n_groups=3), 'mamba_n_groups'),
    (dict(mamba_d_head=7), 'mamba_d_head'),
    (dict(time_step_limit=(0.01, 10.0)), 'time_step_limit'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0, partial_rotary_factor=0.5)),
     'rope_type'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    check_refused_field(AutoConfig.from_pretrained(tiny[0]), change, field, 'bamba',
                        {'hidden_act', 'layer_types', 'attn_layer_indices', 'rope_parameters', 'mamba_n_groups',
                         'mamba_d_head', 'time_step_limit', 'quantization_config'})


def test_audit_lists_every_field_transformers_reads_for_bamba():
    check_audit_lists_every_field_transformers_reads('bamba')


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Attention by head, Mamba-2 by head and group (two groups: one per rank), the MLP by rows:
    over the ranks each split tensor's ranges tile its axis once. (TP2 = TP1 runs on the
    one-group model below, whose split also all-reduces the norm; tests/test_mamba2.py runs the
    two-group split.)"""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    # per Mamba layer in_proj, conv1d weight and bias, dt_bias, A_log, D, norm, out_proj (3 layers);
    # q/k/v/o (1 layer); gate/up/down (4 layers); the embedding and lm_head
    assert split == 8 * 3 + 4 + 3 * 4 + 2


def test_one_group_tp2_equals_tp1_and_odd_heads_are_refused_naming_the_field(tmp_path):
    """``mamba_n_groups = 1`` (the published Bamba): the group's ``B`` / ``C`` are read by both
    ranks and its norm is all-reduced; TP2 = TP1. Three KV heads at TP2 are refused naming
    ``num_key_value_heads``."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    path = make_tiny_model(str(tmp_path / 'g1'), arch='bamba', seed=0, mamba_n_groups=1, num_hidden_layers=2)
    _, _, split, repeated = check_tp_slices_tile_every_split_tensor(path, shared=True)
    assert split > 0 and repeated == 2 * 3        # one Mamba layer: in_proj, conv1d weight and bias, B and C
    check_tp2_equals_tp1(path)
    config = AutoConfig.from_pretrained(path)
    config.num_attention_heads, config.num_key_value_heads = 6, 3
    with pytest.raises(ValueError, match=r'num_key_value_heads \(3\) must be divisible by tp \(2\)'):
        TPLayout(config, 0, 2)
