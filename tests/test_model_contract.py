"""The model contract (models/base.py) and the layout of models/ (.importlinter).

Every registered model class is a :class:`CausalLM` and every MTP head an :class:`MTPHead`, so
each optional capability has a declared value; nothing outside models/ probes a model with
``getattr``; families build from models/blocks and never import each other; models/ has no
import circle.
"""
from __future__ import annotations

import importlib
import pathlib
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from lmdeploy.pytorch.models import MODEL_REGISTRY, get_model_class
from lmdeploy.pytorch.models.base import CausalLM, MTPHead
from lmdeploy.pytorch.models.parallel_plan import ParallelPlan

ROOT = pathlib.Path(__file__).resolve().parents[1]
CAPABILITIES = ('supports_images', 'image_inputs', 'forward_images', 'check_multimodal', 'parallel_plan',
                'mtp_head', 'rotary', 'rotary_class', 'check_config', 'config_fields', 'cache_specs',
                'compute_logits', 'supports_tp', 'decode_state_equals_prefill')


@pytest.mark.parametrize('model_type', sorted(MODEL_REGISTRY))
def test_every_model_class_keeps_the_contract(model_type):
    cls = get_model_class(model_type)
    assert issubclass(cls, CausalLM)
    assert isinstance(cls.supports_images, bool)
    assert cls.parallel_plan is None or isinstance(cls.parallel_plan, ParallelPlan)
    assert cls.rotary_class is None or issubclass(cls.rotary_class, torch.nn.Module)
    assert cls.config_fields and set(cls.config_fields.values()) <= {'implemented', 'checked', 'inert'}
    assert cls.layer_cache_specs is not CausalLM.layer_cache_specs, 'a model class says what its layers cache'
    if cls.mtp_head is not None:
        module, name = cls.mtp_head.split(':')
        head = getattr(importlib.import_module(f'lmdeploy.pytorch.models.{module}'), name)
        assert issubclass(head, MTPHead)


def test_the_base_declares_every_capability_off():
    """A family that declares nothing: text only, tp=1 only, no MTP head, rope fields audited."""
    assert (CausalLM.supports_images, CausalLM.parallel_plan, CausalLM.mtp_head) == (False, None, None)
    assert CausalLM.rotary_class.__name__ == 'RotaryEmbedding'

    class Stack(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)

    class Tiny(CausalLM):
        model_class = Stack

    config = SimpleNamespace(vocab_size=5, hidden_size=3, model_type='tiny', tie_word_embeddings=True,
                             get_text_config=lambda: config)
    model = Tiny(config)
    assert model.image_inputs([None], [0], [1], [0]) is None
    model.check_multimodal([1, 2], [SimpleNamespace(data=None)])        # spans without pixels are fine
    with pytest.raises(ValueError, match="model_type 'tiny' does not accept images"):
        model.check_multimodal([1, 2], [SimpleNamespace(data={'pixel_values': 0})])
    embed = torch.arange(15.0).reshape(5, 3)
    model.load_weights([('model.embed_tokens.weight', embed)])      # lm_head tied: the loop of the base
    assert torch.equal(model.lm_head.weight, embed)
    assert torch.equal(model.compute_logits(torch.eye(3)), embed.t())
    assert MTPHead().compute_logits(torch.zeros(1, 3)) is None      # a head without its own vocabulary


def test_nothing_probes_a_model_with_getattr():
    """Capabilities are read as declared attributes; a ``getattr(x, '<capability>', default)``
    anywhere in the package would hide a class that forgot to declare one."""
    probe = re.compile(r"getattr\((?:[^()]|\([^()]*\))*,\s*'(%s)'" % '|'.join(CAPABILITIES))
    found = [f'{path.relative_to(ROOT)}:{i}' for path in sorted((ROOT / 'lmdeploy').rglob('*.py'))
             for i, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []


def test_families_and_circles_break_the_contracts(tmp_path):
    """A family importing another family breaks the independence contract, and an import
    circle inside models/ breaks the acyclic one (on a copy of the package)."""
    from test_layering import _lint
    shutil.copytree(ROOT / 'lmdeploy', tmp_path / 'lmdeploy', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / '.importlinter', tmp_path / '.importlinter')
    models = tmp_path / 'lmdeploy' / 'pytorch' / 'models'
    with open(models / 'granitemoehybrid.py', 'a') as f:       # lazily, like the tree's function-level imports
        f.write('\n\ndef _borrowed():\n    from .qwen3_next import Qwen3NextModel\n    return Qwen3NextModel\n')
    with open(models / 'rope.py', 'a') as f:                    # base imports rope: a circle
        f.write('\n\ndef _circle():\n    from .base import CausalLM\n    return CausalLM\n')
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert 'model families are independent (shared layers live in models/blocks) BROKEN' in done.stdout
    assert 'lmdeploy.pytorch.models.granitemoehybrid -> lmdeploy.pytorch.models.qwen3_next' in done.stdout
    assert 'no import circle in models/ BROKEN' in done.stdout, done.stdout
