"""Qwen3.5 text stack served exactly like transformers: the vision-language checkpoint's
``Qwen3_5ForConditionalGeneration`` on text prompts and the text-only ``Qwen3_5ForCausalLM``
(logits <= 1e-4 in fp32 at every prompt position across chunk ends, greedy tokens equal),
interleaved M-RoPE tables equal to transformers' on 3-axis positions, output equal with the
prefix cache on, and the config audit covering the new fields."""
import inspect
import re

import pytest
import torch

from engine_utils import TOL, engine_prompt_logits, hf_greedy, hf_prompt_logits, make_engine, random_prompt
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import FIELDS, ROPE_FIELDS, check_config
from lmdeploy.pytorch.multimodal import MultimodalInput
from model_harness import ModelHarness, randomize_hybrid_


@pytest.fixture(scope='module')
def hf_vl(tiny_qwen3_5):
    from transformers import Qwen3_5ForConditionalGeneration
    return Qwen3_5ForConditionalGeneration.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()


@pytest.mark.parametrize('n, chunk', [(5, 8192), (150, 48), (300, 100)])
def test_vl_checkpoint_text_logits_match_transformers(tiny_qwen3_5, hf_vl, n, chunk):
    ids = random_prompt(n, seed=n)
    eng = make_engine(tiny_qwen3_5, max_prefill_token_num=chunk, block_size=16)
    got, forwards = engine_prompt_logits(eng, ids)
    ref = hf_prompt_logits(hf_vl, ids)
    assert forwards == -(-n // chunk)
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_vl_checkpoint_greedy_equals_transformers_with_and_without_prefix_cache(tiny_qwen3_5, hf_vl):
    ids = random_prompt(200, seed=11)
    expected = hf_greedy(hf_vl, ids, 12)
    gen = GenerationConfig(max_new_tokens=12)
    cold = make_engine(tiny_qwen3_5, block_size=16, max_prefill_token_num=64).generate(ids, gen).output_ids
    cached = make_engine(tiny_qwen3_5, block_size=16, max_prefill_token_num=64, prefill_save_alignment=64,
                         enable_prefix_caching=True, num_checkpoint_slots=8)
    first = cached.generate(ids, gen)
    again = cached.generate(ids, gen)
    assert cold == first.output_ids == again.output_ids == expected
    assert first.stats.save_points == [64, 128, 192] and again.num_cached_tokens == 192


def _text_config(**overrides):
    from transformers import Qwen3_5TextConfig
    fields = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, num_hidden_layers=3,
                  layer_types=['linear_attention', 'full_attention', 'linear_attention'],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, rope_parameters=dict(rope_type='default', rope_theta=1e4,
                                                                 partial_rotary_factor=0.75,
                                                                 mrope_section=[2, 2, 2]))
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def _randomized(hf, seed=0):
    return randomize_hybrid_(hf, seed)


# rms_norm_eps=1e-3 is compared with transformers run in float64: on this random model
# transformers' own float32 logits are 1.8e-4 away from its float64 ones (ours: 4e-5), so a
# float32-vs-float32 comparison there would measure the reference's rounding, not our math
@pytest.mark.parametrize('overrides, reference_dtype', [
    ({}, torch.float32),
    (dict(tie_word_embeddings=True, attention_bias=True, linear_num_value_heads=2, linear_conv_kernel_dim=3),
     torch.float32),
    (dict(rms_norm_eps=1e-3), torch.float64)])
def test_text_only_causal_lm_matches_transformers(overrides, reference_dtype):
    from transformers import Qwen3_5ForCausalLM
    config = _text_config(**overrides)
    check_config(config)
    torch.manual_seed(0)
    hf = _randomized(Qwen3_5ForCausalLM(config).float().eval())
    ours = get_model_class('qwen3_5_text')(config).eval()
    ours.load_weights(hf.state_dict().items())
    ids = torch.randint(0, 96, (93,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.to(reference_dtype)(input_ids=ids[None], use_cache=False).logits[0].float()
    h = ModelHarness(ours, type(ours).cache_specs(config, torch.float32))
    seq = h.add_sequence()
    got = torch.cat([h.run_chunks(seq, ids[:90].tolist(), 40)] + [h.step([(seq, [t])])[0] for t in ids[90:].tolist()])
    assert (got - ref).abs().max().item() <= TOL


def test_mrope_tables_equal_transformers_on_three_axis_positions():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from lmdeploy.pytorch.models.qwen3_5 import MRotaryEmbedding
    for sections, factor, head_dim in (([2, 2, 2], 0.75, 16), ([11, 11, 10], 0.25, 256), ([3, 1, 0], 1.0, 12)):
        config = _text_config(head_dim=head_dim, rope_parameters=dict(
            rope_type='default', rope_theta=1e4, partial_rotary_factor=factor, mrope_section=sections))
        gen = torch.Generator().manual_seed(1)
        pos = torch.randint(0, 500, (3, 37), generator=gen)
        ref_cos, ref_sin = Qwen3_5TextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
        cos, sin = MRotaryEmbedding(config).forward_mrope(pos, torch.float32)
        assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6), sections
        # distinct axes really matter (the check above is not vacuous)
        plain, _ = MRotaryEmbedding(config)(pos[0], torch.float32)
        assert not torch.allclose(plain, cos)
        # equal axes (text tokens): M-RoPE is plain partial RoPE
        same, _ = MRotaryEmbedding(config).forward_mrope(pos[:1].expand(3, -1), torch.float32)
        assert torch.allclose(same, plain, atol=1e-6)


def test_image_without_its_grid_is_rejected(tiny_qwen3_5):
    eng = make_engine(tiny_qwen3_5, block_size=16)
    image = MultimodalInput(2, 6, b'h' * 16, data={'pixel_values': torch.zeros(16, 384)})
    with pytest.raises(ValueError, match='image_grid_thw'):
        eng.add_request(random_prompt(10, 1), GenerationConfig(max_new_tokens=1), multimodal=(image,))


@pytest.mark.parametrize('change, message', [
    (dict(rope_parameters=dict(rope_type='default', rope_theta=1e4, partial_rotary_factor=0.25,
                               mrope_section=[2, 2])), 'mrope_section'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0, partial_rotary_factor=0.25)),
     "'dynamic'"),
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(linear_num_value_heads=3), 'linear_num_value_heads'),
])
def test_refused_qwen3_5_fields_name_the_field(change, message):
    config = _text_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(config)


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3_5_text'])
def test_audit_lists_every_field_transformers_reads_for_qwen3_5(arch):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    source = inspect.getsource(modeling)
    read = (set(re.findall(r'config\.(\w+)', source))
            | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)', source))) - {
                'get_text_config', 'standardize_rope_params', 'per_layer_config'}
    if arch == 'qwen3_5_text':      # the text classes only
        read -= set(FIELDS['qwen3_5']) - set(FIELDS['qwen3_5_text'])
    assert not read - set(FIELDS[arch]), sorted(read - set(FIELDS[arch]))
    assert {'mrope_section', 'mrope_interleaved'} <= set(ROPE_FIELDS)
