"""No engine model registers a buffer: the loader builds models on the meta device and
``to_empty`` gives buffers uninitialized memory that ``load_weights`` never fills (a
non-persistent buffer is in no checkpoint), so a buffer computed in ``__init__`` (a rotary
table, µP multipliers) would hold garbage at run time. Constants live in plain attributes."""
import pytest
import torch

from lmdeploy.pytorch.models import get_model_class
from lmdeploy.tools.make_tiny_model import build_config
from lmdeploy.tools.tiny_args import ARCHS


@pytest.mark.parametrize('arch', ARCHS)
def test_a_model_built_as_the_loader_builds_it_has_no_buffers(arch):
    config = build_config(arch, vocab_size=64, eos_token_id=2, pad_token_id=0)
    with torch.device('meta'):
        model = get_model_class(config.model_type)(config)
    assert [name for name, _ in model.named_buffers()] == []
