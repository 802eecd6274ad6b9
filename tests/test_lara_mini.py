"""Lara-4-Mini (``lara_mini``: Gated DeltaNet + sliding-window + global NoPE attention, MoE with an
ungated shared expert) served exactly like transformers: logits <= 1e-4 in fp32 at every prompt
position (5-700 tokens, cold and in 32-token chunks whose ends fall inside the 40-token windows
and inside the delta rule's 64-token kernel chunks), greedy tokens equal cold, chunked and after a
local prefix-cache restore, a 4-turn chat identical under every cache policy, Store bytes equal
the simulator and a new engine restoring from the Store, TP2 = TP1 from the published fused
``in_proj`` layout, the layer cache specs, config refusals naming their field, the audit of every
field transformers reads, and random geometries in random chunks."""
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import TOL, check_store_bytes_then_a_new_engine_restores
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            published_config_and_names, tiny_cache_specs, tiny_fixture)
from lmdeploy.pytorch.cache_specs import FullAttentionSpec, LinearAttentionSpec, SlidingWindowSpec, kv_window
from lmdeploy.pytorch.models import get_model_class

tiny = tiny_fixture('lara_mini')


def test_tiny_model_is_the_released_pattern_in_the_published_layout(tiny):
    config, names = published_config_and_names(tiny[0])
    assert config['layer_types'] == ['linear_attention', 'sliding_attention', 'linear_attention', 'full_attention',
                                     'sliding_attention']
    assert config['sliding_window'] == 40 and 32 % 40 and 40 % 16      # chunk and block ends fall inside windows
    assert 'model.layers.0.linear_attn.in_proj.weight' in names                  # fused [q|k|v|z|b|a]
    assert 'model.layers.0.linear_attn.out_norm.weight' in names
    assert not any('in_proj_qkv' in n or '.linear_attn.norm.' in n for n in names)


def test_experts_one_tensor_each_and_transformers_names_load_the_same_parameters(tiny):
    """The published fused tensors and the other spellings (experts one tensor per expert,
    ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a`` and ``linear_attn.norm``) fill identical parameters."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    published = load_file(os.path.join(tiny[0], 'model.safetensors'))
    other = {}
    for name, t in published.items():
        if name.endswith('.mlp.experts.gate_up_proj'):
            gates, ups = t.chunk(2, dim=1)          # [E, 2I, H]: gate rows first
            for e in range(t.shape[0]):
                other[f'{name[:-len("gate_up_proj")]}{e}.gate_proj.weight'] = gates[e]
                other[f'{name[:-len("gate_up_proj")]}{e}.up_proj.weight'] = ups[e]
        elif name.endswith('.mlp.experts.down_proj'):
            for e in range(t.shape[0]):
                other[f'{name[:-len("down_proj")]}{e}.down_proj.weight'] = t[e]
        elif name.endswith('.linear_attn.in_proj.weight'):
            sizes = [2 * 2 * 16 + 4 * 16, 4 * 16, 4, 4]
            for part, piece in zip(('in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a'), t.split(sizes)):
                other[name.replace('in_proj.weight', f'{part}.weight')] = piece
        else:
            other[name.replace('.out_norm.', '.norm.')] = t
    cls = get_model_class('lara_mini')
    a, b = cls(config), cls(config)
    a.load_weights(published.items())
    b.load_weights(other.items())
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


class TestLaraMiniConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness); the
    32-token chunks end inside the 40-token windows and inside the delta rule's 64-token kernel
    chunks."""


def test_store_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    """Mixed global + window layers: the Store keeps every block below a save point."""
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=4_400)


def test_cache_specs_are_state_slots_sliding_window_and_global_kv(tiny):
    _, specs = tiny_cache_specs(tiny[0], 'lara_mini', torch.float32)
    assert [type(s) for s in specs] == [LinearAttentionSpec, SlidingWindowSpec, LinearAttentionSpec,
                                        FullAttentionSpec, SlidingWindowSpec]
    assert specs[1].window == specs[4].window == 40 and kv_window(specs) is None   # the global layer reads all
    assert specs[0].conv_shape == (2 * 2 * 16 + 4 * 16, 3) and specs[0].recurrent_shape == (4, 16, 16)


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(layer_types=['full_attention'] * 2), 'layer_types'),
    (dict(layer_types=['linear_attention', 'chunked_attention', 'linear_attention', 'full_attention',
                       'sliding_attention']), 'layer_types'),
    (dict(sliding_window=0), 'sliding_window'),
    (dict(sliding_window=None), 'sliding_window'),
    (dict(linear_num_value_heads=3), 'linear_num_value_heads'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type'),
    (dict(num_experts_per_tok=9), 'num_experts_per_tok'),
    (dict(num_experts=0), 'num_experts'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    check_refused_field(tiny[0], change, field)


def test_audit_lists_every_field_transformers_reads_for_lara_mini():
    check_audit_lists_every_field_transformers_reads('lara_mini')


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over the ranks, each split tensor of the published layout (the fused in_proj among them)
    has ranges that tile its axis exactly once."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    assert split > 0


def test_tp_shards_of_the_fused_in_proj_equal_the_four_projections_shards(tiny):
    """The published fused ``in_proj`` rows a rank reads are its ``in_proj_qkv | z | b | a`` rows."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    config = AutoConfig.from_pretrained(tiny[0])
    conv_dim, hv, dv = 2 * 2 * 16 + 4 * 16, 4, 16
    offsets = dict(in_proj_qkv=0, in_proj_z=conv_dim, in_proj_b=conv_dim + hv * dv, in_proj_a=conv_dim + hv * dv + hv)
    for rank in range(2):
        layout = TPLayout(config, rank, 2)
        fused = layout.shard('model.layers.0.linear_attn.in_proj.weight')
        parts = [(a + offsets[p], b + offsets[p]) for p in offsets
                 for a, b in layout.shard(f'model.layers.0.linear_attn.{p}.weight').ranges]
        assert fused.dim == 0 and list(fused.ranges) == parts


def test_tp2_logits_and_greedy_tokens_equal_tp1(tiny):
    """Attention by head, Gated DeltaNet by key head (from the fused published in_proj); experts replicated."""
    from test_tensor_parallel import check_tp2_equals_tp1
    check_tp2_equals_tp1(tiny[0])


def test_tp_refuses_a_head_count_it_cannot_split_naming_the_field(tiny):
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    config = AutoConfig.from_pretrained(tiny[0])
    with pytest.raises(ValueError, match='linear_num_key_heads'):
        TPLayout(config, 0, 4)      # 2 key heads of the Gated DeltaNet layers


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (linear / sliding / global layers, windows of 1-40 tokens, key
    and value heads, top-k, renormalisation) and a random prefill chunking then 3 decode steps:
    logits <= 1e-4 of transformers' full forward, through NaN-poisoned scrambled blocks and slots."""
    from transformers import LaraMiniConfig, LaraMiniForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(1, 3))
    types = data.draw(st.lists(st.sampled_from(['linear_attention', 'sliding_attention', 'full_attention']),
                               min_size=n_layers, max_size=n_layers))
    kh = data.draw(st.sampled_from([1, 2]))
    config = LaraMiniConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=n_layers, layer_types=types,
        sliding_window=data.draw(st.integers(1, 40)), num_attention_heads=4,
        num_key_value_heads=data.draw(st.sampled_from([1, 2, 4])), head_dim=8, linear_num_key_heads=kh,
        linear_num_value_heads=kh * data.draw(st.sampled_from([1, 2])), linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=data.draw(st.sampled_from([2, 4])), num_experts=4,
        num_experts_per_tok=data.draw(st.integers(1, 3)), norm_topk_prob=data.draw(st.booleans()),
        moe_intermediate_size=16, shared_expert_intermediate_size=24, pad_token_id=0, bos_token_id=None,
        eos_token_id=1, tie_word_embeddings=False, rope_parameters=dict(rope_type='default', rope_theta=10000.0))
    check_random_model_in_random_chunks_then_decode(data, LaraMiniForCausalLM, 'lara_mini', config, 70, TOL)
