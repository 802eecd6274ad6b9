"""Kimi-Linear served exactly like transformers: logits <= 1e-4 in fp32 at every prompt
position (5-700 tokens, cold and in 32-token chunks), greedy tokens equal cold, chunked and after
a local prefix-cache restore, a 4-turn chat identical with the prefix cache off / on / last-only /
turn-end (hits on later turns), a checkpoint in transformers' in-memory names (stacked conv,
fused experts, q LoRA, attention bias) loading the same model, the layer cache specs, and the
config audit covering every field transformers reads."""
import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import TOL, check_checkpoint_matches_transformers
from family_harness import (FamilyConformance, check_a_new_engine_restores_from_a_file_store,
                            check_audit_lists_every_field_transformers_reads,
                            check_continuous_batching_equals_each_request_alone, check_store_put_bytes_against_mooncake,
                            tiny_fixture)
from lmdeploy.pytorch.cache_specs import PagedSpec, StateSpec, kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, check_config


tiny = tiny_fixture('kimi_linear')


class TestKimiLinearConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""


def test_continuous_batching_equals_each_request_alone(tiny):
    """Requests added while others run (mixed prefill + decode forwards: batched KDA decode
    steps, per-sequence MLA over the latent blocks) decode what each decodes alone."""
    rec = check_continuous_batching_equals_each_request_alone(tiny[0])
    assert rec.num_mixed_steps > 0 and rec.max_concurrent() >= 3


def test_transformers_named_checkpoint_with_q_lora_and_bias_matches(tiny, tmp_path):
    """Other shapes (q LoRA, attention bias, v_head_dim != qk dims, 3 of 12 experts in 4 groups,
    two shared experts, no renormalisation) saved under transformers' in-memory names."""
    from safetensors.torch import save_file
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from lmdeploy.tools.make_tiny_model import _randomize
    src, _ = tiny
    base = json.load(open(os.path.join(src, 'config.json')))
    lin, full = 'linear_attention', 'full_attention'
    config = KimiLinearConfig(vocab_size=base['vocab_size'], hidden_size=48, num_attention_heads=3,
                              num_key_value_heads=3, num_hidden_layers=3, layer_types=[full, lin, lin],
                              mlp_layer_types=['sparse', 'dense', 'sparse'], intermediate_size=64,
                              moe_intermediate_size=16, num_local_experts=12, num_experts_per_tok=3, n_group=4,
                              topk_group=2, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.7,
                              kv_lora_rank=24, q_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=8,
                              v_head_dim=12, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=3,
                              attention_bias=True, eos_token_id=base['eos_token_id'],
                              pad_token_id=base['pad_token_id'], bos_token_id=None)
    torch_state = torch.random.get_rng_state()
    hf = KimiLinearForCausalLM(config).float().eval()
    torch.random.set_rng_state(torch_state)
    _randomize(hf, 3)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith('e_score_correction_bias'):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)))
    path = tmp_path / 'hf_names'
    shutil.copytree(src, path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith('self_attn.conv1d.weight') for k in sd) and any('forget_gate' in k for k in sd)
    save_file(sd, str(path / 'model.safetensors'), metadata={'format': 'pt'})
    cfg = config.to_diff_dict()
    cfg['architectures'] = ['KimiLinearForCausalLM']
    json.dump(cfg, open(path / 'config.json', 'w'))
    check_checkpoint_matches_transformers(str(path), hf)


def test_cache_specs_are_a_latent_row_and_a_four_tensor_state(tiny):
    path, _ = tiny
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    specs = get_model_class('kimi_linear').cache_specs(config, torch.float32)
    kda, mla = specs[0], specs[2]
    assert isinstance(kda, StateSpec) and isinstance(mla, PagedSpec)
    assert [t.name for t in kda.tensors()] == ['q_conv', 'k_conv', 'v_conv', 'recurrent']
    assert all(t.tp_split == 'v_heads' for t in kda.tensors())
    (latent,) = mla.tensors()
    assert latent.shape == (config.kv_lora_rank + config.qk_rope_head_dim,) and latent.tp_split is None
    H, d, K = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    assert state_bytes_per_slot(specs) == 3 * 4 * (3 * H * d * (K - 1) + H * d * d)
    assert kv_bytes_per_block(specs, 16) == 1 * 16 * 4 * (config.kv_lora_rank + config.qk_rope_head_dim)


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(layer_types=['full_attention'] * 3), 'layer_types'),
    (dict(mlp_layer_types=['moe'] * 4), 'mlp_layer_types'),
    (dict(n_group=3), 'n_group'),
    (dict(topk_group=5), 'topk_group'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)
    checked = {f for f, how in FIELDS['kimi_linear'].items() if how == CHECKED}
    assert checked <= {'hidden_act', 'layer_types', 'mlp_layer_types', 'n_group',
                       'topk_group', 'quantization_config'}


def test_audit_lists_every_field_transformers_reads_for_kimi_linear():
    check_audit_lists_every_field_transformers_reads('kimi_linear')


def test_a_new_engine_restores_from_the_store(tiny, tmp_path):
    """KDA state checkpoints + MLA latent blocks of a 300-token prompt, restored from a
    ``file:`` Store by a new engine (family_harness; in a fresh process:
    tests/test_store_fresh_process.py)."""
    check_a_new_engine_restores_from_a_file_store(tiny[0], tmp_path, seed=771_000, put_objects={'state': 4, 'kv': 16})


@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_store_put_bytes_equal_the_simulator_to_the_byte(tiny, mooncake_services, last_only):
    check_store_put_bytes_against_mooncake(tiny[0], mooncake_services, last_only, max_turns=3, seed=770_000)


def test_kimi_linear_48b_preset_sizes():
    """The published Kimi-Linear-48B geometry (bf16): S = 20 KDA layers x (3 convs
    32 x 128 x 3 bf16 + a 32 x 128 x 128 float32 state); K_blk = 7 MLA layers x 64 tokens x
    (512 + 64) bf16 — the latent once, not once per head."""
    from test_benchmark_store_bytes import sim
    sizes = sim.sizes_from_config(sim.KIMI_LINEAR_48B_CONFIG, block_size=64)
    assert sizes == sim.StoreSizes(20 * (3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4), 7 * 64 * 576 * 2)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (layer and MLP patterns, q LoRA or not, head dims, conv
    kernel, expert groups) and a random prefill chunking then 3 decode steps: logits <= 1e-4
    of transformers' full forward, through NaN-poisoned scrambled blocks and slots."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    lin, full = 'linear_attention', 'full_attention'
    n_layers = data.draw(st.integers(1, 3))
    types = data.draw(st.lists(st.sampled_from([lin, full]), min_size=n_layers, max_size=n_layers))
    mlp = data.draw(st.lists(st.sampled_from(['dense', 'sparse']), min_size=n_layers, max_size=n_layers))
    heads = data.draw(st.integers(1, 3))
    n_group = data.draw(st.sampled_from([1, 2, 4]))
    config = KimiLinearConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=heads, num_key_value_heads=heads,
        num_hidden_layers=n_layers, layer_types=types, mlp_layer_types=mlp, intermediate_size=48,
        moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=data.draw(st.integers(1, 3)),
        n_group=n_group, topk_group=data.draw(st.integers(1, n_group)), n_shared_experts=1,
        norm_topk_prob=data.draw(st.booleans()), routed_scaling_factor=2.0,
        kv_lora_rank=data.draw(st.sampled_from([8, 16])), q_lora_rank=data.draw(st.sampled_from([None, 12])),
        qk_nope_head_dim=8, qk_rope_head_dim=data.draw(st.sampled_from([4, 8])),
        v_head_dim=data.draw(st.sampled_from([4, 8])),
        linear_num_heads=data.draw(st.integers(1, 3)), linear_head_dim=data.draw(st.sampled_from([4, 8])),
        linear_conv_kernel_dim=data.draw(st.integers(2, 4)), pad_token_id=0, bos_token_id=None, eos_token_id=1)
    check_random_model_in_random_chunks_then_decode(data, KimiLinearForCausalLM, 'kimi_linear', config, 80, TOL)


def test_tp2_logits_and_greedy_tokens_equal_tp1(tiny):
    """KDA split by head, MLA by query head with the latent replicated; MoE replicated."""
    from test_tensor_parallel import check_tp2_equals_tp1
    check_tp2_equals_tp1(tiny[0])


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over the ranks, each split tensor's ranges tile its axis exactly once; the latent's
    producers (q_a / kv_a projections and norms) are read whole by every rank."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, layouts, _ = check_tp_slices_tile_every_split_tensor(tiny[0])
    for name in ('model.layers.2.self_attn.kv_a_proj_with_mqa.weight', 'model.layers.2.self_attn.kv_a_layernorm.weight'):
        assert layouts[0].shard(name) is None and layouts[1].shard(name) is None


@pytest.mark.parametrize('writer_tp, reader_tp', [(2, 1), (1, 2)])
def test_store_across_tp_sizes_holds_the_latent_once_and_bytes_match_the_simulator(tiny, mooncake_services,
                                                                                  writer_tp, reader_tp):
    """A TP2 writer's Store objects are the TP-independent payloads: S is the sum of the ranks'
    KDA head slices, K_blk the latent of ONE rank (replicated, stored once, charged once by the
    simulator); a reader of the other TP size restores the prefix and decodes the same tokens."""
    from tp_utils import check_store_across_tp_sizes
    check_store_across_tp_sizes(tiny[0], mooncake_services, writer_tp, reader_tp, 5000 + 10 * writer_tp + reader_tp,
                                kv_replicated=True)


def test_a_refused_config_stops_the_loader_before_weights(tiny, tmp_path):
    from lmdeploy.pytorch.models.loader import load_model
    path = tmp_path / 'bad'
    shutil.copytree(tiny[0], path)
    cfg = json.load(open(path / 'config.json'))
    cfg['topk_group'] = 5     # the tiny model has 2 expert groups
    json.dump(cfg, open(path / 'config.json', 'w'))
    os.remove(path / 'model.safetensors')      # the check must come first
    with pytest.raises(ValueError, match='topk_group'):
        load_model(str(path))
