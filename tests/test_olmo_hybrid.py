"""OLMo Hybrid (``olmo_hybrid``) served exactly like transformers: logits <= 1e-4 in fp32 at every
prompt position (5-700 tokens, cold and in 32-token chunks whose ends fall inside the 64-token
chunks of the delta-rule kernel), greedy tokens equal cold, chunked and after a local prefix-cache
restore, a 4-turn chat identical with the prefix cache off / on / last-only / turn-end, Store put
bytes equal to the simulator and a Store restore by a new engine, the published layout (split
conv filters, OLMo-core norm names, NoPE) and transformers' in-memory names with the other
switches (RoPE, beta in [0, 1], tied embeddings) loading, random geometries in random chunks at
the model level, the cache specs, the refusals (tp > 1 included) and the config audit."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import TOL, check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            hf_model, published_config_and_names, tiny_cache_specs, tiny_fixture, untied,
                            write_checkpoint)
from lmdeploy.pytorch.cache_specs import kv_bytes_per_block, state_bytes_per_slot

tiny = tiny_fixture('olmo_hybrid')


def test_tiny_model_is_published_layout_nope_with_grouped_value_heads(tiny):
    config, names = published_config_and_names(tiny[0])
    assert config['rope_parameters']['rope_theta'] is None and config['linear_allow_neg_eigval']
    assert config['linear_num_value_heads'] == 2 * config['linear_num_key_heads']
    assert {'model.layers.0.linear_attn.q_conv1d.weight', 'model.layers.0.attention_layer_norm.weight',
            'model.layers.0.feedforward_layer_norm.weight', 'model.layers.3.post_feedforward_layernorm.weight'} <= names
    assert not any('linear_attn.conv1d' in n for n in names)


class TestOlmoHybridConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness); the
    32-token chunks end inside the delta-rule kernel's 64-token chunks."""
    logits_cases = ((5, 8192), (150, 32), (700, 32))


def test_store_put_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=991_000)


def test_transformers_checkpoint_with_rope_beta_in_0_1_and_tied_embeddings_matches(tiny, tmp_path):
    """OLMo Hybrid's other switches from ``OlmoHybridForCausalLM``'s own state dict (stacked
    conv, transformers' norm names): RoPE on the attention layers, ``linear_allow_neg_eigval``
    off, as many key as value heads, a width-3 conv, attention biases, MHA, two attention layers,
    tied embeddings."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM
    src, _ = tiny
    base, _ = published_config_and_names(src)
    config = OlmoHybridConfig(
        vocab_size=base['vocab_size'], hidden_size=48, num_hidden_layers=4, num_attention_heads=3,
        num_key_value_heads=3, intermediate_size=40, attention_bias=True,
        layer_types=['full_attention', 'linear_attention', 'full_attention', 'linear_attention'],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_conv_kernel_dim=3, linear_allow_neg_eigval=False,
        rope_parameters=dict(rope_type='default', rope_theta=5000.0), tie_word_embeddings=True,
        eos_token_id=base['eos_token_id'], pad_token_id=base['pad_token_id'], bos_token_id=None)
    hf = hf_model(OlmoHybridForCausalLM, config, 3)
    assert hf.model.rotary_emb is not None
    path = tmp_path / 'hf_names'
    write_checkpoint(src, path, hf, config, untied)
    check_checkpoint_matches_transformers(str(path), hf)


def test_cache_specs_are_a_gated_deltanet_state_and_paged_kv(tiny):
    _, specs = tiny_cache_specs(tiny[0], 'olmo_hybrid', torch.bfloat16)
    assert ['attention' if s.paged else 'gdn' for s in specs] == ['gdn', 'gdn', 'gdn', 'attention']
    conv_dim = 2 * 2 * 16 + 4 * 16
    assert [(t.shape, t.dtype) for t in specs[0].tensors()] == [((conv_dim, 3), torch.bfloat16),
                                                                ((4, 16, 16), torch.float32)]
    assert state_bytes_per_slot(specs) == 3 * (conv_dim * 3 * 2 + 4 * 16 * 16 * 4)
    assert kv_bytes_per_block(specs, 16) == 16 * 2 * 2 * 16 * 2


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(layer_types=['linear_attention', 'sliding_attention', 'linear_attention', 'full_attention']),
     'layer_types'),
    (dict(linear_num_value_heads=3), 'linear_num_value_heads'),
    (dict(num_key_value_heads=3), 'num_key_value_heads'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    check_refused_field(tiny[0], change, field, 'olmo_hybrid',
                        {'hidden_act', 'layer_types', 'linear_num_value_heads', 'num_key_value_heads',
                         'rope_parameters', 'quantization_config'})


def test_audit_lists_every_field_transformers_reads():
    check_audit_lists_every_field_transformers_reads('olmo_hybrid')


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (layer pattern, KV heads, key/value head ratio, conv width,
    beta range, RoPE or NoPE, attention biases) and a random prefill chunking then 3 decode
    steps: logits <= 1e-4 of transformers' full forward, through NaN-poisoned scrambled blocks
    and slots."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(2, 3))
    types = data.draw(st.lists(st.sampled_from(['linear_attention', 'full_attention']), min_size=n_layers,
                               max_size=n_layers).filter(lambda t: len(set(t)) == 2))
    key_heads = data.draw(st.sampled_from([1, 2]))
    rope = data.draw(st.sampled_from([None, 5000.0]))
    config = OlmoHybridConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=n_layers, layer_types=types, num_attention_heads=2,
        num_key_value_heads=data.draw(st.sampled_from([1, 2])), intermediate_size=48,
        attention_bias=data.draw(st.booleans()), linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * data.draw(st.sampled_from([1, 2])), linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=data.draw(st.integers(2, 4)),
        linear_allow_neg_eigval=data.draw(st.booleans()), rope_parameters=dict(rope_type='default', rope_theta=rope),
        pad_token_id=0, bos_token_id=None, eos_token_id=1)
    check_random_model_in_random_chunks_then_decode(data, OlmoHybridForCausalLM, 'olmo_hybrid', config, 70, TOL)
