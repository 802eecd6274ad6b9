"""The decoding strategy supplies ℓ and r to every sequence's prefill plan (issue 5)."""
import pytest

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.spec_decode.strategy import AUTOREGRESSIVE, DecodingStrategy
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill

from engine_utils import random_prompt

GEOMETRY = dict(block_size=16, prefill_save_alignment=64, max_prefill_token_num=512, num_gpu_blocks=128,
                enable_prefix_caching=True, prefill_save_last_only=True, device_type='cpu', dtype='float32')


def test_autoregressive_strategy_has_no_restore_requirements():
    assert (AUTOREGRESSIVE.token_lookahead, AUTOREGRESSIVE.recompute_blocks) == (0, 0)


@pytest.mark.parametrize('field', ['token_lookahead', 'recompute_blocks'])
def test_negative_strategy_values_are_rejected_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        DecodingStrategy(**{field: -1})


@pytest.mark.parametrize('strategy, expected_save', [(AUTOREGRESSIVE, 128),
                                                     (DecodingStrategy('mtp-recompute', 0, 1), 64),
                                                     (DecodingStrategy('mtp', 1, 0), 128)])
def test_engine_plans_with_its_strategy(tiny_qwen3_next, strategy, expected_save):
    engine = Engine(tiny_qwen3_next, PytorchEngineConfig(**GEOMETRY), strategy=strategy)
    prompt = random_prompt(129, seed=3)
    seq = engine.generate(prompt, GenerationConfig(max_new_tokens=2))
    assert (seq.token_lookahead, seq.recompute_blocks) == (strategy.token_lookahead, strategy.recompute_blocks)
    expected = plan_prefill(129, 0, 512, 16, 64, True, strategy.token_lookahead, strategy.recompute_blocks)
    assert seq.stats.plans == [expected]
    assert seq.stats.save_points == [expected_save]
    warm = engine.generate(prompt, GenerationConfig(max_new_tokens=2))
    assert warm.num_cached_tokens == expected_save
    assert warm.output_ids == seq.output_ids
