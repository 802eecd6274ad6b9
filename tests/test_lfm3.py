"""LFM3 (``lfm3``: LFM2's short conv + sliding-window + global attention, per-type RoPE, per-head
output gates, sandwich norms) served exactly like transformers: logits <= 1e-4 in fp32 at every
prompt position (5-700 tokens, cold and in 32-token chunks whose ends fall inside the 40-token
windows), greedy tokens equal cold, chunked and after a local prefix-cache restore, a 4-turn chat
identical under every cache policy, Store bytes equal the simulator and a new engine restoring
from the Store, TP2 = TP1, the layer cache specs, config refusals
naming their field, the audit of every field transformers reads, and random geometries (layer
kinds, windows, rope types, gates and sandwich norms on or off) in random chunks."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import TOL, check_store_bytes_then_a_new_engine_restores
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            published_config_and_names, tiny_cache_specs, tiny_fixture)
from lmdeploy.pytorch.cache_specs import FullAttentionSpec, SlidingWindowSpec, StateSpec, kv_window

tiny = tiny_fixture('lfm3')


def test_tiny_model_mixes_conv_windows_and_nested_rope_in_the_published_layout(tiny):
    config, names = published_config_and_names(tiny[0])
    assert config['layer_types'] == ['conv', 'sliding_attention', 'full_attention', 'conv', 'sliding_attention']
    assert config['sliding_window'] == 40 and 32 % 40 and 40 % 16      # chunk and block ends fall inside windows
    assert config['rope_parameters']['full_attention']['rope_type'] == 'proportional'
    assert config['use_sandwich_norm'] and config['use_attention_gate']
    assert 'model.layers.1.self_attn.gate_proj.weight' in names and not any('g_proj' in n for n in names)


class TestLfm3Conformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness); the
    32-token chunks end inside the 40-token windows."""


def test_store_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    """Mixed global + window layers: the Store keeps every block below a save point."""
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=4_500)


def test_cache_specs_are_conv_states_sliding_window_and_global_kv(tiny):
    _, specs = tiny_cache_specs(tiny[0], 'lfm3', torch.float32)
    assert [type(s) for s in specs] == [StateSpec, SlidingWindowSpec, FullAttentionSpec, StateSpec, SlidingWindowSpec]
    assert specs[1].window == specs[4].window == 40 and kv_window(specs) is None   # the global layer reads all
    assert [t.shape for t in specs[0].tensors()] == [(64, 2)]                      # one conv tensor, no recurrence


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over the ranks, each split tensor of the published layout has ranges that tile its axis
    exactly once (in_proj's B, C and x blocks each by channel, the output gate by query head)."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, layouts, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    assert split > 0
    assert layouts[1].shard('model.layers.0.conv.in_proj.weight').ranges == ((32, 64), (96, 128), (160, 192))
    assert layouts[1].shard('model.layers.1.self_attn.gate_proj.weight').ranges == ((2, 4),)


def test_tp2_equals_tp1_and_a_count_tp_cannot_split_names_its_field(tiny):
    """Attention by head (the output gate with its query heads), short conv by channel, the MLP by
    rows: TP2 logits within TP_TOL of TP1, staggered greedy outputs equal."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp2_equals_tp1
    with pytest.raises(ValueError, match='num_key_value_heads'):
        TPLayout(AutoConfig.from_pretrained(tiny[0]), 0, 4)       # 2 KV heads
    check_tp2_equals_tp1(tiny[0])


@pytest.mark.parametrize('change, field', [
    (dict(layer_types=['conv'] * 2), 'layer_types'),
    (dict(layer_types=['conv', 'chunked_attention', 'full_attention', 'conv', 'conv']), 'layer_types'),
    (dict(sliding_window=0), 'sliding_window'),
    (dict(sliding_window=None), 'sliding_window'),
    (dict(conv_L_cache=1), 'conv_L_cache'),
    (dict(num_key_value_heads=3), 'num_key_value_heads'),
    (dict(rope_parameters=dict(sliding_attention=dict(rope_type='default', rope_theta=1e4))), 'rope_parameters'),
    (dict(rope_parameters=dict(rope_type='default', rope_theta=1e4)), 'rope_parameters'),
    (dict(rope_parameters=dict(sliding_attention=dict(rope_type='default', rope_theta=1e4),
                               full_attention=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0))), 'rope_type'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    check_refused_field(tiny[0], change, field)


def test_audit_lists_every_field_transformers_reads_for_lfm3():
    check_audit_lists_every_field_transformers_reads('lfm3')


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (conv / sliding / global layers, windows of 1-40 tokens, KV
    heads, conv width and bias, default or proportional RoPE per type, gates and sandwich norms on
    or off) and a random prefill chunking then 3 decode steps: logits <= 1e-4 of transformers'
    full forward, through NaN-poisoned scrambled blocks and slots."""
    from transformers import Lfm3Config, Lfm3ForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(1, 3))
    types = data.draw(st.lists(st.sampled_from(['conv', 'sliding_attention', 'full_attention']), min_size=n_layers,
                               max_size=n_layers))
    rope = {t: data.draw(st.sampled_from([dict(rope_type='default', rope_theta=500.0),
                                          dict(rope_type='proportional', rope_theta=1e6, partial_rotary_factor=0.5)]))
            for t in ('sliding_attention', 'full_attention')}
    config = Lfm3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=n_layers, layer_types=types,
        sliding_window=data.draw(st.integers(1, 40)), num_attention_heads=4,
        num_key_value_heads=data.draw(st.sampled_from([1, 2, 4])), head_dim=8, intermediate_size=40,
        conv_L_cache=data.draw(st.integers(2, 4)), conv_bias=data.draw(st.booleans()),
        use_sandwich_norm=data.draw(st.booleans()), use_attention_gate=data.draw(st.booleans()),
        rope_parameters=rope, pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False)
    check_random_model_in_random_chunks_then_decode(data, Lfm3ForCausalLM, 'lfm3', config, 70, TOL)
