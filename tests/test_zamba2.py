"""Zamba2 (``zamba2``) served exactly like transformers: logits <= 1e-4 in fp32 at every prompt
position (5-700 tokens, cold and in 32-token chunks whose ends fall inside the 24-token SSD
chunks), greedy tokens equal cold, chunked and after a local prefix-cache restore, decode-step
logits equal transformers' (whose decode step does not clamp dt, while its prompt forward
does), a 4-turn chat identical with the prefix cache off / on / last-only / turn-end, Store put bytes equal
to the simulator and a Store restore by a new engine, transformers' state dict (every tied block
repeated) and the published one (each shared block once) loading, the cache specs, the refusals
(tp > 1 included), random geometries in random chunks at the model level and the config audit."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import (TOL, check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores,
                          make_engine, random_prompt, sampled_logits)
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            hf_model, published_config_and_names, tiny_cache_specs, tiny_fixture, write_checkpoint)
from lmdeploy.pytorch.cache_specs import StateSpec, kv_bytes_per_block, state_bytes_per_slot

tiny = tiny_fixture('zamba2')


class TestZamba2Conformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness); the
    32-token chunks end inside the 24-token SSD chunks."""
    logits_cases = ((5, 8192), (150, 32), (700, 32))


def _decode_logits(model_path: str, ids: list[int], steps: int, **fields) -> torch.Tensor:
    """``[steps, vocab]``: the engine's logits of each sampled token (the prompt's last, then
    each decode step's), greedy, eos ignored, prefill in 32-token chunks."""
    return sampled_logits(make_engine(model_path, block_size=16, max_prefill_token_num=32, **fields), ids, steps)


def test_decode_step_logits_equal_transformers_whose_decode_step_does_not_clamp_dt(tiny, monkeypatch):
    """transformers clamps ``dt >= time_step_min`` (0.01 in the tiny model) in its prompt
    forward only: each decode step's logits are within ``TOL`` of ``generate``'s, and clamping
    the generated tokens too (what the shared Mamba-2 mixer does for every token) moves them by
    more than ``TOL``, so this pins the prompt-only clamp."""
    from lmdeploy.pytorch.models.blocks.mamba2 import Mamba2Mixer
    from lmdeploy.pytorch.models.zamba2 import Zamba2Mixer
    path, hf = tiny
    ids = random_prompt(70, seed=12)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, eos_token_id=None)
    ref = torch.cat(out.logits).float()
    got = _decode_logits(path, ids, 8)
    assert (got - ref).abs().max().item() <= TOL
    monkeypatch.setattr(Zamba2Mixer, 'step_sizes', Mamba2Mixer.step_sizes)     # clamp every token
    clamped = _decode_logits(path, ids, 8)
    assert (clamped[0] - ref[0]).abs().max().item() <= TOL        # the prompt's last token: clamped either way
    assert (clamped[1:] - ref[1:]).abs().max().item() > TOL


def test_turn_end_checkpoints_are_off_since_decode_leaves_dt_unclamped(tiny):
    """A checkpoint after decode steps holds unclamped-dt state a recomputed prefix would not
    (the harness's 4-turn chat gave other replies on turns 2-4 with it): ``decode_save_last`` is
    ignored for Zamba2, prefill checkpoints stay."""
    eng = make_engine(tiny[0], block_size=16, enable_prefix_caching=True, decode_save_last=True)
    assert not eng.prefix_cache.decode_save_last and eng.prefix_cache.local is not None


def test_store_put_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=992_000)


@pytest.mark.parametrize('tied', [True, False])
def test_transformers_state_dict_with_every_block_repeated_and_other_switches_matches(tiny, tmp_path, tied):
    """Zamba2's other switches from ``Zamba2ForCausalLM``'s own state dict, where every hybrid
    layer repeats its block's tensors (one block for three uses, no attention adapters, no RoPE,
    GQA with 2 KV heads, one Mamba group, silu, projection biases). Tied embeddings: the repeats
    are one shared block; untied: transformers ties nothing, so each hybrid layer runs its own
    copy."""
    from transformers import Zamba2Config, Zamba2ForCausalLM
    src, _ = tiny
    base, _ = published_config_and_names(src)
    config = Zamba2Config(
        vocab_size=base['vocab_size'], hidden_size=32, num_hidden_layers=4,
        layers_block_type=['hybrid', 'linear_attention', 'hybrid', 'hybrid'], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2,
        mamba_ngroups=1, n_mamba_heads=4, chunk_size=16, num_mem_blocks=1, use_shared_attention_adapter=False,
        adapter_rank=4, use_mem_rope=False, hidden_act='silu', add_bias_linear=True, time_step_min=0.02,
        tie_word_embeddings=tied, eos_token_id=base['eos_token_id'], pad_token_id=base['pad_token_id'],
        bos_token_id=None)
    hf = hf_model(Zamba2ForCausalLM, config, 3)
    shared = [hf.model.layers[i].shared_transformer.self_attn.q_proj.weight for i in (0, 3)]
    assert (shared[0].data_ptr() == shared[1].data_ptr()) == tied
    path = tmp_path / 'hf_names'
    sd = write_checkpoint(src, path, hf, config)      # copies tensors: safetensors refuses shared memory
    assert 'model.layers.3.shared_transformer.self_attn.q_proj.weight' in sd
    check_checkpoint_matches_transformers(str(path), hf)


def test_cache_specs_are_a_mamba2_state_per_layer_then_kv_per_hybrid_layer(tiny):
    _, specs = tiny_cache_specs(tiny[0], 'zamba2', torch.bfloat16)
    assert ['kv' if s.paged else 'mamba' for s in specs] == ['mamba'] * 4 + ['kv'] * 3
    assert isinstance(specs[0], StateSpec)
    conv_dim = 128 + 2 * 2 * 8           # d_inner = 2 * 64, two groups of state 8
    assert [(t.shape, t.dtype) for t in specs[0].tensors()] == [((conv_dim, 3), torch.bfloat16),
                                                                ((4, 32, 8), torch.float32)]
    assert state_bytes_per_slot(specs) == 4 * (conv_dim * 3 * 2 + 4 * 32 * 8 * 4)
    assert kv_bytes_per_block(specs, 16) == 3 * 16 * 2 * 4 * 32 * 2     # 4 KV heads of 2 * 64 / 4


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='relu'), 'hidden_act'),
    (dict(layers_block_type=['hybrid', 'full_attention', 'hybrid', 'hybrid']),
     'layers_block_type'),
    (dict(mamba_ngroups=3), 'mamba_ngroups'),
    (dict(mamba_headdim=8), 'mamba_headdim'),
    (dict(num_key_value_heads=2), 'num_key_value_heads'),
    (dict(num_mem_blocks=0), 'num_mem_blocks'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    check_refused_field(tiny[0], change, field, 'zamba2',
                        {'hidden_act', 'layer_types', 'layers_block_type', 'mamba_ngroups', 'mamba_headdim',
                         'num_key_value_heads', 'num_mem_blocks', 'chunk_size', 'rope_parameters',
                         'quantization_config'})


def test_audit_lists_every_field_transformers_reads():
    check_audit_lists_every_field_transformers_reads('zamba2')


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (layer pattern, shared blocks, attention adapters, RoPE,
    KV heads, Mamba groups, conv width, biases, activation, tied or per-layer blocks) and a random
    prefill chunking then 3 decode steps: logits <= 1e-4 of transformers' full forward, through
    NaN-poisoned scrambled blocks and slots. ``time_step_min`` is 1e-30 here, which no dt
    reaches (the reference is one full forward, which would clamp the decode tokens too; the
    prompt-only clamp is pinned by the decode-step test above)."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(2, 4))
    kinds = data.draw(st.lists(st.sampled_from(['linear_attention', 'hybrid']), min_size=n_layers,
                               max_size=n_layers).filter(lambda k: 'hybrid' in k))
    adapters = data.draw(st.booleans())
    config = Zamba2Config(
        vocab_size=64, hidden_size=16, num_hidden_layers=n_layers, layers_block_type=kinds, num_attention_heads=2,
        num_key_value_heads=2 if adapters else data.draw(st.sampled_from([1, 2])), intermediate_size=24,
        mamba_d_state=4, mamba_d_conv=data.draw(st.integers(2, 4)), mamba_expand=2,
        mamba_ngroups=data.draw(st.sampled_from([1, 2])), n_mamba_heads=2, chunk_size=8,
        num_mem_blocks=data.draw(st.integers(1, 2)), use_shared_attention_adapter=adapters, adapter_rank=4,
        use_mem_rope=data.draw(st.booleans()), hidden_act=data.draw(st.sampled_from(['gelu', 'silu'])),
        add_bias_linear=data.draw(st.booleans()), time_step_min=1e-30,
        tie_word_embeddings=data.draw(st.booleans()), pad_token_id=0, bos_token_id=None, eos_token_id=1)
    check_random_model_in_random_chunks_then_decode(data, Zamba2ForCausalLM, 'zamba2', config, 70, TOL)
