"""Jamba (``jamba``: Mamba-1 layers, an attention layer without positions, MoE every other layer)
served exactly like transformers: logits <= 1e-4 in fp32 at every prompt position (5-700 tokens,
cold and in 32-token chunks), greedy tokens equal cold, chunked and after a local prefix-cache
restore, a 4-turn chat identical under every cache policy, a new engine restoring a prefix from a
``file:`` Store (KV blocks and state objects) and decoding what a cold engine decodes, TP2 = TP1
(attention by head, Mamba-1 by channel, dense MLPs by rows, experts replicated) and indivisible
head counts refused by name; the config audit."""
import pytest

from engine_utils import tiny_checkpoint_and_reference
from family_harness import (FamilyConformance, check_a_new_engine_restores_from_a_file_store,
                            check_audit_lists_every_field_transformers_reads, check_refused_field)


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'jamba')


class TestJambaConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""
    logits_cases = ((5, 8192), (150, 32), (700, 32))


def test_a_new_engine_restores_kv_blocks_and_states_from_the_store(tiny, tmp_path):
    """A writer puts 4 state objects and the 16 KV blocks below 256 tokens; a new engine (empty
    local cache) restores 256 tokens from the Store and decodes what a cold engine decodes."""
    check_a_new_engine_restores_from_a_file_store(tiny[0], tmp_path, 994_301, {'state': 4, 'kv': 16})


def test_tp2_logits_and_greedy_tokens_equal_tp1_and_odd_heads_are_refused(tiny):
    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    config, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    # 3 Mamba layers x 9 (in_proj, conv1d weight and bias, x_proj, dt_proj weight and bias, A_log, D,
    # out_proj); the attention layer's q/k/v/o; the dense MLPs of layers 0 and 2 (gate, up, down); the
    # embedding and lm_head
    assert split == 3 * 9 + 4 + 2 * 3 + 2
    check_tp2_equals_tp1(tiny[0])
    config.num_key_value_heads = 1
    with pytest.raises(ValueError, match=r'num_key_value_heads \(1\) must be divisible by tp \(2\)'):
        TPLayout(config, 0, 2)


@pytest.mark.parametrize('change, field', [(dict(hidden_act='gelu'), 'hidden_act'),
                                           (dict(num_experts_per_tok=5), 'num_experts_per_tok'),
                                           (dict(mamba_dt_rank=0), 'mamba_dt_rank'),
                                           (dict(attn_layer_offset=4), 'attn_layer_offset')])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    check_refused_field(AutoConfig.from_pretrained(tiny[0]), change, field)


def test_audit_lists_every_field_transformers_reads():
    check_audit_lists_every_field_transformers_reads('jamba')


def test_store_sizes_of_a_jamba_mini_shaped_config():
    """The S and K_blk docs/en/supported_models.md quotes: 28 Mamba-1 layers x (conv [8192, 3] bf16
    + SSM [8192, 16] float32); 4 attention layers x 64 tokens x K and V of 8 heads x 128 bf16; TP2
    halves both."""
    from benchmark.store_presets import sizes_from_config
    config = dict(model_type='jamba', hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=14336, num_experts=16, mamba_d_state=16, mamba_d_conv=4,
                  mamba_expand=2, dtype='bfloat16')
    sizes = sizes_from_config(config, block_size=64)
    assert sizes.state_bytes == 28 * (8192 * 3 * 2 + 8192 * 16 * 4) == 16_056_320
    assert sizes.kv_block_bytes == 4 * 64 * 2 * 8 * 128 * 2 == 1_048_576
    tp2 = sizes_from_config(config, block_size=64, tp=2)
    assert (tp2.state_bytes, tp2.kv_block_bytes) == (sizes.state_bytes // 2, sizes.kv_block_bytes // 2)


def test_transformers_fused_expert_names_load_too(tiny, tmp_path):
    """The same weights saved in transformers' in-memory layout (``feed_forward.experts.gate_up_proj``
    ``[E, 2I, H]`` / ``down_proj``) instead of one tensor per expert match transformers."""
    import shutil

    from safetensors.torch import save_file

    from engine_utils import check_checkpoint_matches_transformers
    path, hf = tiny
    fused = tmp_path / 'fused'
    shutil.copytree(path, fused)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert 'model.layers.1.feed_forward.experts.gate_up_proj' in sd
    save_file(sd, str(fused / 'model.safetensors'), metadata={'format': 'pt'})
    check_checkpoint_matches_transformers(str(fused), hf)
