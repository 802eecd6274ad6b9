"""Mamba-1 language models (``mamba`` and ``falcon_mamba``: Mamba-1 layers only, no attention,
nothing cached per token) served exactly like transformers: logits <= 1e-4 in fp32 at every prompt
position (5-700 tokens, cold and in 32-token chunks), greedy tokens equal cold, chunked and after
a local prefix-cache restore, a 4-turn chat identical with the prefix cache off / on / last-only /
turn-end, Store puts of state objects only (bytes equal to the simulator) and a new engine
restoring from them; TP2 = TP1 (channels split, x_proj and out_proj summed over ranks) and an
indivisible channel count refused by name; the original checkpoint names; the config audit.
FalconMamba differs only by its weightless RMS norms of dt, B and C: the same weights served as
``mamba`` give other logits, so the comparison with transformers would catch a missing norm."""
import json
import os

import pytest
import torch

from engine_utils import (TOL, check_checkpoint_matches_transformers, check_store_bytes_then_a_new_engine_restores,
                          engine_prompt_logits, hf_prompt_logits, make_engine, random_prompt,
                          tiny_checkpoint_and_reference)
from family_harness import (FamilyConformance, check_a_new_engine_restores_from_a_file_store,
                            check_audit_lists_every_field_transformers_reads, check_refused_field, hf_model,
                            write_checkpoint)
from lmdeploy.pytorch.cache_specs import kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.models import get_model_class

FAMILIES = ('mamba', 'falcon_mamba')


@pytest.fixture(scope='module', params=FAMILIES)
def tiny(request, tmp_path_factory):
    """(checkpoint path, transformers float32 reference) of each family."""
    return tiny_checkpoint_and_reference(tmp_path_factory, request.param)


class TestMambaConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""
    logits_cases = ((5, 8192), (150, 32), (700, 32))


def test_states_only_store_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    """K_blk = 0 and a state row of conv [D, K - 1] + SSM [D, N] float32 per layer; no KV objects
    are put or asked for; a new engine restores 256 tokens from the state object alone and decodes
    what an engine with caching off decodes. The put-bytes-equal-the-simulator scenarios run for
    ``mamba`` (FalconMamba's cache rows are the same kind and size)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class(config.model_type).cache_specs(config, torch.float32)
    Dd, N, K = config.intermediate_size, config.state_size, config.conv_kernel
    assert all(not s.paged for s in specs) and kv_bytes_per_block(specs, 16) == 0
    assert state_bytes_per_slot(specs) == config.num_hidden_layers * 4 * (Dd * (K - 1) + Dd * N)
    if config.model_type == 'mamba':
        check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=992_000)
        return
    check_a_new_engine_restores_from_a_file_store(tiny[0], tmp_path, 993_301, {'state': 4, 'kv': 0})


def test_tp2_logits_and_greedy_tokens_equal_tp1_and_odd_channels_are_refused(tiny):
    """Every mixer by channel (in_proj x and z rows, conv, dt_proj, A_log, D; x_proj and out_proj
    columns); a channel count TP does not divide is refused naming ``intermediate_size``. The TP2
    engine runs for ``falcon_mamba`` (the same split as ``mamba``, plus its norms of the summed
    x_proj output)."""
    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    config, _, split = check_tp_slices_tile_every_split_tensor(tiny[0])
    # per mixer in_proj, conv1d weight and bias, x_proj, dt_proj weight and bias, A_log, D, out_proj;
    # the embedding and lm_head
    assert split == 9 * config.num_hidden_layers + 2
    if config.model_type == 'falcon_mamba':
        check_tp2_equals_tp1(tiny[0])
    config.intermediate_size = 129
    with pytest.raises(ValueError, match=r'intermediate_size \(129\) must be divisible by tp \(2\)'):
        TPLayout(config, 0, 2)


def test_original_names_tied_embeddings_biases_and_no_conv_bias_match(tmp_path):
    """``mamba``: the original spelling ``backbone.embedding`` with tied embeddings (no
    ``lm_head``), in/out projection biases, no conv bias, a width-3 conv, an explicit dt rank and
    ``residual_in_fp32 = False``."""
    from transformers import MambaConfig, MambaForCausalLM

    from lmdeploy.tools.make_tiny_model import make_tiny_model
    src = make_tiny_model(str(tmp_path / 'src'), arch='mamba')
    base = json.load(open(os.path.join(src, 'config.json')))
    config = MambaConfig(vocab_size=base['vocab_size'], hidden_size=48, num_hidden_layers=2, expand=2, state_size=8,
                         conv_kernel=3, time_step_rank=6, use_bias=True, use_conv_bias=False, residual_in_fp32=False,
                         tie_word_embeddings=True, eos_token_id=base['eos_token_id'],
                         pad_token_id=base['pad_token_id'], bos_token_id=None)
    hf = hf_model(MambaForCausalLM, config, 5)
    sd = write_checkpoint(src, tmp_path / 'original', hf, config,
                  lambda k: None if k == 'lm_head.weight' else k.replace('backbone.embeddings.', 'backbone.embedding.'))
    assert 'backbone.embedding.weight' in sd and 'lm_head.weight' not in sd
    check_checkpoint_matches_transformers(str(tmp_path / 'original'), hf)


def test_falcon_mamba_weightless_norm_tensors_are_dropped_and_the_norms_matter(tmp_path):
    """A FalconMamba checkpoint holding ``{b,c,dt}_layernorm.weight`` (transformers' norms have no
    weight and ignore them) loads and matches; the same weights served as ``mamba`` (no norms)
    differ from transformers' FalconMamba by far more than the tolerance."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    from lmdeploy.tools.make_tiny_model import make_tiny_model
    src = make_tiny_model(str(tmp_path / 'src'), arch='falcon_mamba')
    config = FalconMambaConfig.from_pretrained(src)
    hf = hf_model(FalconMambaForCausalLM, config, 0)
    path = tmp_path / 'with_norm_weights'
    write_checkpoint(src, path, hf, config, lambda k: k)
    from safetensors.torch import load_file, save_file
    sd = load_file(str(path / 'model.safetensors'))
    for i in range(config.num_hidden_layers):
        for n in ('b', 'c', 'dt'):
            size = config.time_step_rank if n == 'dt' else config.state_size
            sd[f'backbone.layers.{i}.mixer.{n}_layernorm.weight'] = torch.full((size,), 3.0)
    save_file(sd, str(path / 'model.safetensors'), metadata={'format': 'pt'})
    check_checkpoint_matches_transformers(str(path), hf)
    cfg = json.load(open(path / 'config.json'))
    cfg.update(model_type='mamba', architectures=['MambaForCausalLM'])
    cfg.pop('mixer_rms_eps')
    json.dump(cfg, open(path / 'config.json', 'w'))
    ids = random_prompt(40, seed=3)
    got, _ = engine_prompt_logits(make_engine(str(path), block_size=16), ids)
    assert (got - hf_prompt_logits(hf, ids)).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize('change, field', [(dict(hidden_act='gelu'), 'hidden_act'),
                                           (dict(time_step_rank=0), 'time_step_rank')])
@pytest.mark.parametrize('arch', FAMILIES)
def test_refused_fields_name_themselves(arch, change, field):
    from transformers import AutoConfig
    check_refused_field(AutoConfig.for_model(arch), change, field, arch,
                        {'hidden_act', 'time_step_rank', 'quantization_config'})


@pytest.mark.parametrize('arch', FAMILIES)
def test_audit_lists_every_field_transformers_reads(arch):
    check_audit_lists_every_field_transformers_reads(arch)


def test_store_sizes_of_a_falcon_mamba_7b_shaped_config():
    """The S and K_blk docs/en/supported_models.md quotes: 64 layers x (conv [8192, 3] bf16 + SSM
    [8192, 16] float32), nothing per token."""
    from benchmark.store_presets import sizes_from_config
    config = dict(model_type='falcon_mamba', hidden_size=4096, num_hidden_layers=64, expand=2, state_size=16,
                  conv_kernel=4, dtype='bfloat16')
    sizes = sizes_from_config(config, block_size=64)
    assert sizes.state_bytes == 64 * (8192 * 3 * 2 + 8192 * 16 * 4) == 36_700_160
    assert sizes.kv_block_bytes == 0
