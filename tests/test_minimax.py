"""MiniMax-01 (``minimax``: lightning attention, softmax attention with RoPE, softmax-routed MoE,
alpha / beta residual factors on normalised inputs) served exactly like transformers: logits
<= 1e-4 in fp32 at every prompt position (5-700 tokens, cold and in 32-token chunks, and 300 in
one forward over several 64-token kernel chunks), greedy tokens equal cold, chunked and after a
local prefix-cache restore, a 4-turn chat identical under every cache policy, Store put bytes
equal to the simulator and a new engine restoring from a ``file:`` Store, transformers'
in-memory names (with its saved decay tables) loading the same model, TP2 = TP1 (both mixers by
head); the layer cache specs and the config audit."""
import pytest
import torch

from engine_utils import check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            check_tp2_equals_tp1_and_refusal, rewrite_checkpoint, tiny_cache_specs, tiny_fixture)

tiny = tiny_fixture('minimax')


class TestMiniMaxConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness); the
    300-token prompt is one forward over several 64-token kernel chunks."""


def test_store_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=450_000)


def test_transformers_names_with_decay_tables_load_too(tiny, tmp_path):
    """The same weights saved by transformers (``mlp.gate``, fused experts, and the lightning
    layers' ``slope_rate`` / ``*_decay`` buffers, which are skipped) match transformers."""
    path, hf = tiny
    sd = hf.state_dict()
    assert 'model.layers.0.self_attn.slope_rate' in sd and 'model.layers.0.mlp.experts.gate_up_proj' in sd
    check_checkpoint_matches_transformers(rewrite_checkpoint(path, tmp_path / 'hf_names', sd), hf)


def test_cache_specs_are_a_float32_state_and_kv_blocks(tiny):
    """Lightning layers: one float32 recurrent state [4 heads, 16, 16] (no conv); the softmax layer:
    K and V of 2 heads x 16 per token; the decay rates equal transformers' buffers bit for bit."""
    from lmdeploy.pytorch.cache_specs import FullAttentionSpec, StateSpec, state_bytes_per_slot
    from lmdeploy.pytorch.models.blocks.lightning import lightning_slopes
    _, specs = tiny_cache_specs(tiny[0], 'minimax', torch.bfloat16)
    assert [type(s) for s in specs] == [StateSpec, FullAttentionSpec, StateSpec, StateSpec]
    (t,) = specs[0].tensors()
    assert (t.name, t.shape, t.dtype) == ('recurrent', (4, 16, 16), torch.float32)
    assert (specs[1].num_kv_heads, specs[1].head_dim) == (2, 16)
    assert state_bytes_per_slot(specs) == 3 * 4 * 16 * 16 * 4
    for i in (0, 2, 3):
        assert torch.equal(lightning_slopes(4, i, 4), tiny[1].model.layers[i].self_attn.slope_rate.flatten())


def test_tp2_logits_and_greedy_tokens_equal_tp1_and_odd_heads_are_refused(tiny):
    """Both mixers split by head (the lightning norm summed over the ranks, the decay rates the
    full model's); MoE replicated."""
    # 3 lightning layers x (qkv_proj, output_gate, norm, out_proj); the softmax layer's q/k/v/o; the
    # embedding and lm_head
    check_tp2_equals_tp1_and_refusal(tiny[0], 3 * 4 + 4 + 2, dict(num_key_value_heads=1),
                                     r'num_key_value_heads \(1\) must be divisible by tp \(2\)')


@pytest.mark.parametrize('change, field', [(dict(hidden_act='gelu'), 'hidden_act'),
                                           (dict(layer_types=['linear_attention'] * 3), 'layer_types'),
                                           (dict(sliding_window=64), 'sliding_window'),
                                           (dict(num_experts_per_tok=5), 'num_experts_per_tok')])
def test_refused_fields_name_themselves(tiny, change, field):
    check_refused_field(tiny[0], change, field)


def test_audit_lists_every_field_transformers_reads():
    check_audit_lists_every_field_transformers_reads('minimax')


def test_store_sizes_of_a_minimax_text_01_shaped_config():
    """The S and K_blk docs/en/supported_models.md quotes: 80 layers with softmax attention every
    8th; 70 lightning layers x float32 state [64, 128, 128]; 10 softmax layers x 64 tokens x K and
    V of 8 heads x 128 bf16."""
    from benchmark.store_presets import sizes_from_config
    types = ['full_attention' if (i + 1) % 8 == 0 else 'linear_attention' for i in range(80)]
    config = dict(model_type='minimax', dtype='bfloat16', hidden_size=6144, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=128, layer_types=types)
    sizes = sizes_from_config(config, block_size=64)
    assert sizes.state_bytes == 70 * 64 * 128 * 128 * 4 == 293_601_280
    assert sizes.kv_block_bytes == 10 * 64 * 2 * 8 * 128 * 2 == 2_621_440
