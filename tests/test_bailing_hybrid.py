"""Ling 3 (``bailing_hybrid``: KDA layers with full-rank gates, gated MLA with interleaved rotary,
grouped MoE with clipped SwiGLUs, NextN MTP layers in the checkpoint) served exactly like
transformers: logits <= 1e-4 in fp32 at every prompt position (5-700 tokens, cold and in 32-token
chunks), greedy tokens equal cold, chunked and after a local prefix-cache restore, a 4-turn chat
identical under every cache policy, Store put bytes equal to the simulator and a new engine
restoring from a ``file:`` Store, transformers' in-memory names loading the same model, the
NextN layers of a published checkpoint skipped, MTP speculative decoding refused by name, TP2 =
TP1; the config audit."""
import pytest
import torch

from engine_utils import check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            check_tp2_equals_tp1_and_refusal, rewrite_checkpoint, tiny_fixture)

tiny = tiny_fixture('bailing_hybrid')


class TestBailingHybridConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness). The
    300-token prompt is one forward in which the KDA kernel's 64-token chunks end; the 150 / 700
    ones go in 32-token forwards, each starting mid-way through a kernel chunk of the sequence."""


def test_store_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=440_000)


def test_the_swiglu_clip_changes_the_output(tiny):
    """The tiny checkpoint's limits (0.05 on layer 2's routed and layer 3's shared experts)
    clip: the same weights without them give other logits, so the match above covers clipping."""
    from transformers import AutoConfig

    from engine_utils import hf_prompt_logits, random_prompt
    path, hf = tiny
    config = AutoConfig.from_pretrained(path)
    config.swiglu_limits, config.swiglu_limits_shared = [0] * 4, [0] * 4
    from transformers import AutoModelForCausalLM
    unclipped = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    unclipped.load_state_dict(hf.state_dict())
    ids = random_prompt(40, seed=5)
    assert (hf_prompt_logits(hf, ids) - hf_prompt_logits(unclipped, ids)).abs().max().item() > 1e-3


def test_transformers_names_load_and_published_nextn_layers_are_skipped(tiny, tmp_path):
    """The same weights in transformers' in-memory names (stacked conv, ``forget_gate.*``, fused
    experts, ``e_score_correction_bias``) plus the tensors of a NextN layer
    ``model.layers.4.*`` (``num_nextn_predict_layers = 1``, as published) match transformers."""
    path, hf = tiny
    sd = hf.state_dict()
    assert 'model.layers.0.self_attn.conv1d.weight' in sd and 'model.layers.1.mlp.experts.gate_up_proj' in sd
    sd.update({k.replace('model.layers.3.', 'model.layers.4.'): v for k, v in sd.items()
               if k.startswith('model.layers.3.')})
    out = rewrite_checkpoint(path, tmp_path / 'hf_names', sd, dict(num_nextn_predict_layers=1))
    check_checkpoint_matches_transformers(out, hf)


def test_mtp_speculative_decoding_is_refused_by_name(tiny):
    from transformers import AutoConfig

    from lmdeploy.pytorch.models import mtp_head_class
    config = AutoConfig.from_pretrained(tiny[0])
    with pytest.raises(ValueError, match=r"speculative_config.method=mtp .*got 'bailing_hybrid'"):
        mtp_head_class(config)


@pytest.mark.parametrize('change, field', [(dict(hidden_act='gelu'), 'hidden_act'),
                                           (dict(layer_types=['linear_attention'] * 3), 'layer_types'),
                                           (dict(mlp_layer_types=['moe'] * 4), 'mlp_layer_types'),
                                           (dict(expert_swiglu_limit_list=[0, 0, -1, 0]), 'expert_swiglu_limit_list'),
                                           (dict(num_expert_group=3), 'n_group')])
def test_refused_fields_name_themselves(tiny, change, field):
    check_refused_field(tiny[0], change, field)


def test_audit_lists_every_field_transformers_reads():
    check_audit_lists_every_field_transformers_reads('bailing_hybrid')


def test_store_sizes_of_the_default_ling_3_config():
    """The S and K_blk docs/en/supported_models.md quotes for transformers' default config (42
    layers, MLA every 6th): 35 KDA layers x (three convs [32, 128, 3] bf16 + recurrent
    [32, 128, 128] float32); 7 MLA layers x 64 tokens x latent (512 + 64) bf16."""
    from benchmark.store_presets import sizes_from_config
    sizes = sizes_from_config(dict(model_type='bailing_hybrid', dtype='bfloat16'), block_size=64)
    assert sizes.state_bytes == 35 * (3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4) == 75_980_800
    assert sizes.kv_block_bytes == 7 * 64 * (512 + 64) * 2 == 516_096


def test_tp2_logits_and_greedy_tokens_equal_tp1_and_odd_heads_are_refused(tiny):
    """KDA split by head, MLA by query head (its output gate too) with the latent replicated; MoE
    replicated; the published names (``attention.dense``, ``word_embeddings``) are split."""
    # 2 KDA layers x 11 (q/k/v/f/g/b_proj, three convs, dt_bias, A_log) + their dense o_proj; 2 MLA
    # layers x (q_proj, kv_b_proj, g_proj, dense); the embedding and lm_head
    layouts = check_tp2_equals_tp1_and_refusal(tiny[0], 2 * 12 + 2 * 4 + 2, dict(num_attention_heads=3),
                                               r'divisible by tp \(2\)')
    for name in ('model.layers.1.attention.kv_a_proj_with_mqa.weight',
                 'model.layers.1.attention.kv_a_layernorm.weight'):
        assert layouts[0].shard(name) is None and layouts[1].shard(name) is None


@pytest.mark.parametrize('change', [dict(kda_safe_gate=False),
                                    dict(rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0,
                                                              original_max_position_embeddings=64,
                                                              mscale_all_dim=1.0))],
                         ids=['softplus_gate', 'yarn_mscale'])
def test_config_variants_of_the_same_weights_match_transformers(tiny, tmp_path, change):
    """The KDA softplus decay (``kda_safe_gate: false``) and YaRN rope whose ``mscale_all_dim``
    also scales the MLA softmax: the tiny weights under each config match transformers."""
    from engine_utils import load_hf
    out = rewrite_checkpoint(tiny[0], tmp_path / 'variant', config=change)
    check_checkpoint_matches_transformers(out, load_hf(out))
