"""Mamba-2 language models (``mamba2``: Mamba-2 layers only, no attention, nothing cached per
token) served exactly like transformers: logits <= 1e-4 in fp32 at every prompt position (5-700
tokens, cold and in 32-token chunks whose ends are not multiples of the SSD chunk of 24), greedy
tokens equal cold, chunked and after a local prefix-cache restore, a 4-turn chat identical with the
prefix cache off / on / last-only / turn-end, and the prefix cache working on state checkpoints
alone: zero-byte KV blocks (the trie still counts tokens in blocks), checkpoints in slots of their
own even under one memory budget, Store puts of state objects only (bytes equal to the simulator)
and a new engine restoring from them; TP2 = TP1; the original checkpoint names and the config audit."""
import json
import os

import pytest
import torch

from engine_utils import (check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores,
                          random_prompt, tiny_checkpoint_and_reference)
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads, check_refused_field,
                            hf_model, write_checkpoint)
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_specs import kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'mamba2')


class TestMamba2Conformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""


def test_the_caches_are_states_only_and_checkpoints_keep_slots_of_their_own(tiny):
    """K_blk = 0 (a KV block row is its 16 bytes of padding); with one memory budget (no
    ``num_gpu_blocks``) checkpoints still take state slots of their own, not thousands of
    padding rows each, and a rerun restores from them."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.engine.engine import Engine
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('mamba2').cache_specs(config, torch.float32)
    H, P, N, G, K = config.num_heads, config.head_dim, config.state_size, config.n_groups, config.conv_kernel
    assert all(not s.paged for s in specs) and kv_bytes_per_block(specs, 16) == 0
    assert state_bytes_per_slot(specs) == config.num_hidden_layers * 4 * ((H * P + 2 * G * N) * (K - 1) + H * P * N)
    eng = Engine(tiny[0], PytorchEngineConfig(device_type='cpu', dtype='float32', enable_prefix_caching=True,
                                              block_size=16, prefill_save_alignment=64, num_checkpoint_slots=8,
                                              max_prefill_token_num=64, session_len=1024, max_batch_size=2))
    try:
        assert not eng.state_cache.uses_block_rows and eng.state_cache.num_checkpoint_slots == 8
        assert eng.cache_engine.kv_block_bytes == 0
        ids, gen = random_prompt(150, seed=15), GenerationConfig(max_new_tokens=5, ignore_eos=True)
        first, again = eng.generate(ids, gen), eng.generate(ids, gen)
        assert first.stats.save_points == [64, 128] and again.num_cached_tokens == 128
        assert again.output_ids == first.output_ids
    finally:
        eng.close()


def test_store_put_bytes_equal_the_simulator_and_a_new_engine_restores_from_state_objects_alone(tiny, tmp_path):
    """No KV objects are put or asked for; a new engine restores 256 tokens from the state object
    (this restore failed on a 0-byte KV payload before the Store tier knew K_blk can be 0)."""
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=991_000)


def test_original_names_tied_embeddings_biases_and_one_group_match(tiny, tmp_path):
    """The original checkpoint spelling ``backbone.embedding`` with tied embeddings (no
    ``lm_head``), in/out projection biases, no conv bias, one B/C group, a width-3 conv and
    ``residual_in_fp32 = False``."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    src, _ = tiny
    base = json.load(open(os.path.join(src, 'config.json')))
    config = Mamba2Config(vocab_size=base['vocab_size'], hidden_size=48, num_hidden_layers=2, num_heads=6, head_dim=16,
                          expand=2, n_groups=1, state_size=8, conv_kernel=3, chunk_size=16, use_bias=True,
                          use_conv_bias=False, residual_in_fp32=False, tie_word_embeddings=True,
                          eos_token_id=base['eos_token_id'], pad_token_id=base['pad_token_id'], bos_token_id=None)
    hf = hf_model(Mamba2ForCausalLM, config, 5)
    path = tmp_path / 'original_names'
    sd = write_checkpoint(src, path, hf, config,
                          lambda k: None if k == 'lm_head.weight' else k.replace('backbone.embeddings.',
                                                                                  'backbone.embedding.'),
                          drop_config=('time_step_limit',))   # the default: JSON has no infinity
    assert 'backbone.embedding.weight' in sd
    check_checkpoint_matches_transformers(str(path), hf)


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(n_groups=3), 'n_groups'),
    (dict(head_dim=7), 'head_dim'),
    (dict(time_step_limit=(0.01, 10.0)), 'time_step_limit'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    check_refused_field(AutoConfig.from_pretrained(tiny[0]), change, field, 'mamba2',
                        {'hidden_act', 'n_groups', 'head_dim', 'time_step_limit', 'quantization_config'})


def test_audit_lists_every_field_transformers_reads_for_mamba2():
    check_audit_lists_every_field_transformers_reads('mamba2')


def test_tp2_logits_and_greedy_tokens_equal_tp1_and_odd_groups_are_refused(tiny):
    """Every mixer by head and group (two groups: one per rank); a group count TP neither divides
    nor is a multiple of is refused naming ``n_groups``."""
    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    config, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    # per mixer in_proj, conv1d weight and bias, dt_bias, A_log, D, norm, out_proj; the embedding and lm_head
    assert split == 8 * config.num_hidden_layers + 2
    check_tp2_equals_tp1(tiny[0])
    config.expand, config.num_heads, config.head_dim, config.n_groups = 3, 6, 32, 3     # 6 x 32 = 3 x 64
    with pytest.raises(ValueError, match=r'n_groups \(3\) must be divisible by tp \(2\) or divide it'):
        TPLayout(config, 0, 2)
