"""Open cache specs: any layer kind is a list of named tensors (paged per token, or per
sequence), and the cache engine, the Store payload layout and the byte counts follow from it."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import AutoConfig

from lmdeploy.pytorch.cache_specs import (CacheTensor, FullAttentionSpec, LinearAttentionSpec, PagedSpec, StateSpec,
                                          has_state, kv_bytes_per_block, state_bytes_per_slot)
from lmdeploy.pytorch.distributed.sharding import TPLayout
from lmdeploy.pytorch.store.layout import StoreLayout
from lmdeploy.pytorch.cache_engine import CacheEngine
from lmdeploy.pytorch.models import get_model_class

# a latent KV shared by every query head (one tensor per token, replicated under TP), and a
# state of three short-conv states plus one recurrent state: kinds no model here declares yet
LATENT = PagedSpec((CacheTensor('latent', (40,), torch.bfloat16),))
FOUR_STATES = StateSpec(tuple(CacheTensor(n, (12, 3), torch.bfloat16) for n in ('q_conv', 'k_conv', 'v_conv'))
                        + (CacheTensor('recurrent', (2, 4, 4), torch.float32),))


def test_a_new_kind_is_laid_out_from_its_tensors():
    specs = [FOUR_STATES, LATENT, FullAttentionSpec(2, 8, torch.float32)]
    eng = CacheEngine(specs, block_size=4, num_blocks=3, num_slots=2)
    assert [v.shape for v in eng.kv_caches[1]] == [torch.Size([3, 4, 40])]
    assert [v.shape for v in eng.kv_caches[2]] == [torch.Size([3, 4, 2, 8])] * 2
    assert [v.shape for v in eng.state_caches[0]] == [torch.Size([2, 12, 3])] * 3 + [torch.Size([2, 2, 4, 4])]
    assert eng.kv_caches[0] is None and eng.state_caches[1] is None
    # K_blk and S: the payload bytes, one definition for the engine and the simulator
    assert eng.kv_block_bytes == kv_bytes_per_block(specs, 4) == 4 * 40 * 2 + 2 * 4 * 2 * 8 * 4
    assert eng.state_bytes == state_bytes_per_slot(specs) == 3 * 12 * 3 * 2 + 2 * 4 * 4 * 4
    assert has_state(specs) and not has_state([LATENT])
    # every tensor's view is its own bytes: writing one leaves the others untouched
    eng.state_caches[0][3][1].fill_(1.5)
    assert all(float(v[1].abs().sum()) == 0 for v in eng.state_caches[0][:3])


def _tiny_qwen3_next():
    return AutoConfig.for_model('qwen3_next', num_hidden_layers=4, full_attention_interval=4, linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                linear_conv_kernel_dim=4, num_key_value_heads=2, num_attention_heads=4, head_dim=8,
                                hidden_size=32, intermediate_size=64, vocab_size=64)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 16), kv=st.booleans())
def test_store_payloads_round_trip_across_ranks_for_any_kind(seed, kv):
    """Rank payloads → full-head payload → rank payloads is the identity for the model's own
    specs plus a replicated latent; the latent is stored once, not once per rank."""
    config = _tiny_qwen3_next()
    cls = get_model_class('qwen3_next')
    full = list(cls.cache_specs(config, torch.float32)) + [LATENT]
    local = list(cls.cache_specs(TPLayout(config, 0, 2).local_config(), torch.float32)) + [LATENT]
    layout = StoreLayout(config, 2, local, full, block_size=4)
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randint(0, 256, (3, layout.kv_block_bytes if kv else layout.state_bytes), dtype=torch.uint8,
                          generator=gen)
    parts = layout.to_ranks(whole, kv=kv)
    assert torch.equal(layout.to_full(parts, kv=kv), whole)
    if kv:
        # 2 KV heads split 1 + 1 (each rank half of the K/V bytes), the latent whole on each rank
        latent = 4 * 40 * 2
        assert layout.kv_block_bytes == kv_bytes_per_block(full, 4)
        assert all(p.shape[1] == (layout.kv_block_bytes - latent) // 2 + latent for p in parts)


def test_a_split_that_does_not_cover_the_axis_is_refused():
    config = _tiny_qwen3_next()
    cls = get_model_class('qwen3_next')
    full = list(cls.cache_specs(config, torch.float32))
    wrong = [LinearAttentionSpec((7, 3), torch.float32, (2, 8, 8)) if not s.paged else s for s in full]
    with pytest.raises(ValueError, match="'conv'.*conv_channels"):
        StoreLayout(config, 2, wrong, full, block_size=4)
