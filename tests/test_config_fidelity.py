"""A model that loads is a model that matches transformers.

- every rope type the engine accepts gives transformers' logits (fp32, max abs diff <= 1e-4)
  on tiny Qwen3 and Qwen3-Next models, over a prompt fed in chunks and then decoded;
- the issue's checkpoint (Qwen3 with YaRN in config.json's ``rope_scaling``) loads through the
  loader and matches at every position;
- every field the engine refuses gives a ``ValueError`` naming the field and its value;
- the audit tables list every config field transformers' modeling code reads for each
  architecture (re-read from the installed transformers source, so a new field fails here).
"""
import inspect
import json
import os
import re

import pytest
import torch

from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, ROPE_FIELDS, check_config
from lmdeploy.pytorch.models.rope import SEQUENCE_DEPENDENT_ROPE_TYPES
from model_harness import ModelHarness, randomize_hybrid_

TOL = 1e-4
PROMPT, CHUNK, DECODE = 90, 40, 3

# one config per rope type the engine accepts; positions run past original_max_position_embeddings
ROPES = {
    'default': dict(rope_type='default', rope_theta=10000.0),
    'linear': dict(rope_type='linear', rope_theta=10000.0, factor=4.0),
    'yarn': dict(rope_type='yarn', rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768),
    'yarn-options': dict(rope_type='yarn', rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                         beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5, truncate=False),
    'yarn-attention-factor': dict(rope_type='yarn', rope_theta=10000.0, factor=2.0,
                                  original_max_position_embeddings=64, attention_factor=1.3),
    'llama3': dict(rope_type='llama3', rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    'proportional': dict(rope_type='proportional', rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5),
}
MAX_POS = {'yarn': 131072, 'llama3': 256}


def _config(arch, **overrides):
    from transformers import Qwen3Config, Qwen3NextConfig
    common = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, rms_norm_eps=1e-6, hidden_act='silu', tie_word_embeddings=False,
                  max_position_embeddings=4096)
    if arch == 'qwen3':
        fields = dict(common, num_hidden_layers=2)
        cls = Qwen3Config
    else:
        fields = dict(common, num_hidden_layers=2, layer_types=['linear_attention', 'full_attention'],
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True)
        cls = Qwen3NextConfig
    fields.update(overrides)
    return cls(**fields)


def _rope_config(arch, name):
    rope = dict(ROPES[name])
    if arch == 'qwen3_next':
        rope.setdefault('partial_rotary_factor', 0.25)  # Qwen3-Next's partial rotary, composed with the type
    return _config(arch, rope_parameters=rope, max_position_embeddings=MAX_POS.get(name, 4096))


def _hf_model(config, seed=0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize_hybrid_(hf, seed)
    return hf


def _engine_logits(model, config, ids):
    """Prompt in CHUNK-token forwards, then one token per forward: logits ``[len(ids), V]``."""
    h = ModelHarness(model, type(model).cache_specs(config, torch.float32))
    seq = h.add_sequence()
    prompt = h.run_chunks(seq, ids[:PROMPT], CHUNK)
    decode = [h.step([(seq, [t])])[0] for t in ids[PROMPT:]]
    return torch.cat([prompt, *decode])


def _compare(arch, config, seed=0):
    hf = _hf_model(config, seed)
    ours = get_model_class(arch)(config).eval()
    ours.load_weights(hf.state_dict().items())
    ids = torch.randint(0, config.vocab_size, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids[None], use_cache=False).logits[0].float()
    got = _engine_logits(ours, config, ids.tolist())
    return (got - ref).abs().max().item(), ref


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_next'])
@pytest.mark.parametrize('name', list(ROPES))
def test_each_rope_type_matches_transformers(arch, name):
    config = _rope_config(arch, name)
    check_config(config)
    diff, ref = _compare(arch, config)
    assert diff <= TOL, f'{arch} {name}: max abs diff {diff}'


# implemented fields away from their defaults (the engine tests cover the defaults)
IMPLEMENTED_CASES = [
    ('qwen3', dict(attention_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-3, head_dim=32)),
    ('qwen3', dict(num_key_value_heads=4, attention_dropout=0.5, pad_token_id=5)),
    ('qwen3_next', dict(attention_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-3)),
    ('qwen3_next', dict(decoder_sparse_step=2, norm_topk_prob=False, num_experts_per_tok=3, linear_conv_kernel_dim=3,
                        mlp_only_layers=[1], linear_num_value_heads=2, linear_value_head_dim=16)),
]


@pytest.mark.parametrize('arch, overrides', IMPLEMENTED_CASES)
def test_implemented_fields_match_transformers(arch, overrides):
    config = _config(arch, rope_parameters=dict(ROPES['default'], **(
        {'partial_rotary_factor': 0.25} if arch == 'qwen3_next' else {})), **overrides)
    check_config(config)
    diff, _ = _compare(arch, config)
    assert diff <= TOL, f'{arch} {overrides}: max abs diff {diff}'


@pytest.mark.parametrize('name', ['linear', 'yarn', 'llama3', 'proportional'])
def test_rope_types_change_the_logits(name):
    """The cases above are not vacuous: each scaled type moves the logits away from plain RoPE."""
    from transformers import AutoModelForCausalLM
    scaled = _rope_config('qwen3', name)
    plain = _rope_config('qwen3', 'default')
    plain.rope_parameters['rope_theta'] = scaled.rope_parameters['rope_theta']
    ids = torch.randint(0, 96, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    hf = _hf_model(scaled)
    other = AutoModelForCausalLM.from_config(plain).float().eval()
    other.load_state_dict(hf.state_dict())
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - other(input_ids=ids).logits).abs().max().item()
    assert diff > 1e-2


def test_yarn_checkpoint_from_config_json_loads_and_matches(tmp_path):
    """The issue's case: Qwen3 + YaRN written the documented way (``rope_scaling`` in config.json)."""
    from transformers import AutoModelForCausalLM

    from lmdeploy.pytorch.models.loader import load_model
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / 'yarn'), arch='qwen3', max_position_embeddings=131072,
                           rope_parameters=dict(rope_type='yarn', rope_theta=1e6, factor=4.0,
                                                original_max_position_embeddings=32768))
    cfg_path = os.path.join(path, 'config.json')
    with open(cfg_path) as f:
        raw = json.load(f)
    rope = raw.pop('rope_parameters')
    raw['rope_scaling'] = {k: v for k, v in rope.items() if k != 'rope_theta'}
    raw['rope_theta'] = rope['rope_theta']
    with open(cfg_path, 'w') as f:
        json.dump(raw, f)
    loaded = load_model(path, dtype='float32', progress=False)
    model, config = loaded.model, loaded.config
    assert config.rope_parameters['rope_type'] == 'yarn'
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, config.vocab_size, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(input_ids=ids[None], use_cache=False).logits[0].float()
    got = _engine_logits(model, config, ids.tolist())
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


# (arch, config change, field named by the error, its value in the message)
REFUSED = [
    ('qwen3', dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type', "'dynamic'"),
    ('qwen3', dict(rope_parameters=dict(rope_type='longrope', rope_theta=1e4, short_factor=[1.0] * 8,
                                        long_factor=[2.0] * 8, original_max_position_embeddings=64)),
     'rope_type', "'longrope'"),
    ('qwen3', dict(rope_parameters=dict(rope_type='mystery', rope_theta=1e4)), 'rope_type', "'mystery'"),
    ('qwen3', dict(rope_parameters={'full_attention': dict(rope_type='default', rope_theta=1e4)}),
     'rope_parameters', 'full_attention'),
    ('qwen3', dict(rope_parameters=dict(rope_type='linear', rope_theta=1e4, factor=2.0, partial_rotary_factor=0.5)),
     'partial_rotary_factor', '0.5'),
    ('qwen3', dict(hidden_act='gelu'), 'hidden_act', "'gelu'"),
    ('qwen3', dict(layer_types=['full_attention', 'sliding_attention'], sliding_window=32), 'layer_types',
     'sliding_attention'),
    ('qwen3', dict(layer_types=['full_attention', 'sliding_attention'], sliding_window=32), 'sliding_window', '32'),
    # FP8 is loaded block-wise only (tests/test_fp8.py): no weight_block_size is refused
    ('qwen3', dict(quantization_config={'quant_method': 'fp8'}), 'quantization_config', 'weight_block_size=None'),
    ('qwen3_next', dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0,
                                             partial_rotary_factor=0.25)), 'rope_type', "'dynamic'"),
    ('qwen3_next', dict(hidden_act='gelu'), 'hidden_act', "'gelu'"),
    ('qwen3_next', dict(layer_types=['linear_attention', 'sliding_attention']), 'layer_types', 'sliding_attention'),
    ('qwen3_next', dict(linear_num_value_heads=3), 'linear_num_value_heads', '3'),
    ('qwen3_next', dict(quantization_config={'quant_method': 'awq'}), 'quantization_config', "'awq'"),
]


@pytest.mark.parametrize('arch, change, field, value', REFUSED)
def test_refused_field_gives_named_value_error(arch, change, field, value):
    config = _config(arch)
    for key, v in change.items():
        setattr(config, key, v)
    with pytest.raises(ValueError) as err:
        check_config(config)
    assert field in str(err.value) and value in str(err.value), str(err.value)


def test_refused_rope_type_stops_the_loader_before_weights(tmp_path):
    from lmdeploy.pytorch.models.loader import load_model
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / 'dyn'), arch='qwen3_next',
                           rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0,
                                                partial_rotary_factor=0.25))
    os.remove(os.path.join(path, 'model.safetensors'))  # the check must come first
    with pytest.raises(ValueError, match=r"rope_type='dynamic'"):
        load_model(path)


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_next'])
def test_every_checked_field_has_a_refusal_case(arch):
    checked = {f for f, how in FIELDS[arch].items() if how == CHECKED}
    refused = {field for a, _, field, _ in REFUSED if a == arch}
    rope_checked = {f for f, how in ROPE_FIELDS.items() if how == CHECKED}
    assert checked - {'rope_parameters'} <= refused, checked - refused
    # short_factor / long_factor are only read by 'longrope' and 'type' is rope_type's old
    # spelling: all are refused through rope_type; mrope_section is Qwen3.5's (its refusal case is in
    # tests/test_qwen3_5.py)
    assert rope_checked - {'short_factor', 'long_factor', 'type', 'mrope_section'} <= {f for _, _, f, _ in REFUSED}


def _fields_read(source: str) -> set[str]:
    return (set(re.findall(r'config\.(\w+)', source))
            | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)', source))) - {
                'get_text_config', 'standardize_rope_params', 'per_layer_config'}


@pytest.mark.parametrize('arch, module', [('qwen3', 'transformers.models.qwen3.modeling_qwen3'),
                                          ('qwen3_next', 'transformers.models.qwen3_next.modeling_qwen3_next')])
def test_audit_lists_every_field_transformers_reads(arch, module):
    import importlib

    import transformers.modeling_rope_utils as rope_utils
    read = _fields_read(inspect.getsource(importlib.import_module(module)))
    assert read, 'the scan found nothing: the regex is broken'
    missing = read - set(FIELDS[arch])
    assert not missing, f'transformers reads config fields the audit does not list: {sorted(missing)}'
    # the rope functions read these top-level fields too
    rope_reads = _fields_read(inspect.getsource(rope_utils)) & {
        'head_dim', 'hidden_size', 'num_attention_heads', 'max_position_embeddings'}
    assert rope_reads <= set(FIELDS[arch])


def test_audit_lists_every_rope_parameter():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters
    assert set(RopeParameters.__annotations__) <= set(ROPE_FIELDS)
    source = inspect.getsource(inspect.getmodule(ROPE_INIT_FUNCTIONS['yarn']))
    keys = set(re.findall(r'rope_parameters(?:_dict)?(?:\[[^\]]+\])?\[["\'](\w+)["\']\]', source)) | set(
        re.findall(r'rope_parameters(?:_dict)?\.get\(["\'](\w+)', source))
    assert keys and keys <= set(ROPE_FIELDS), keys - set(ROPE_FIELDS)
    accepted = set(ROPE_INIT_FUNCTIONS) - set(SEQUENCE_DEPENDENT_ROPE_TYPES)
    assert accepted | {'default'} <= {c['rope_type'] for c in ROPES.values()}, 'a rope type has no fidelity case'
