"""Qwen3.5-MoE with images: the image suite of tests/test_qwen3_5_images.py run unchanged on
the tiny ``qwen3_5_moe`` checkpoint against transformers' ``Qwen3_5MoeForConditionalGeneration``
(logits <= 1e-4 in fp32 and greedy equal with one and two images, cold, in 32-token chunks,
after a local prefix-cache restore and after a Store restore, also in a fresh process)."""
import pytest
import torch

from test_qwen3_5_images import (test_greedy_equals_transformers_cold_and_after_prefix_cache_restore,  # noqa: F401
                                 test_image_prompt_logits_match_transformers,
                                 test_store_restore_with_images_in_a_fresh_process,
                                 test_store_restore_with_images_matches_transformers)


@pytest.fixture(scope='module')
def tiny_qwen3_5(tiny_qwen3_5_moe):
    """The imported tests' model fixture, here the MoE checkpoint."""
    return tiny_qwen3_5_moe


@pytest.fixture(scope='module')
def hf_vl(tiny_qwen3_5_moe):
    from transformers import Qwen3_5MoeForConditionalGeneration
    return Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_qwen3_5_moe, dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def image_processor(tiny_qwen3_5_moe):
    from transformers import AutoImageProcessor
    return AutoImageProcessor.from_pretrained(tiny_qwen3_5_moe)


def test_the_engine_runs_the_moe_model(tiny_qwen3_5_moe):
    """The fixture override is in effect (the imported tests do not silently run dense Qwen3.5)."""
    from engine_utils import make_engine
    eng = make_engine(tiny_qwen3_5_moe)
    assert type(eng.model).__name__ == 'Qwen3_5MoeForConditionalGeneration'
