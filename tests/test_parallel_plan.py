"""Models own their parallel plan: the TP layout applies a model class's ``parallel_plan`` and
never branches on the model type."""
import inspect

import pytest
from transformers import AutoConfig

from lmdeploy.pytorch.distributed import sharding
from lmdeploy.pytorch.distributed.sharding import TPLayout
from lmdeploy.pytorch.models import MODEL_REGISTRY, get_model_class
from lmdeploy.pytorch.models.parallel_plan import ParallelPlan


def test_the_layout_has_no_model_type_branch():
    source = inspect.getsource(sharding)
    for name in MODEL_REGISTRY:
        assert f"'{name}'" not in source, name
    assert 'model_type in' not in source and 'model_type ==' not in source


def test_every_model_that_splits_declares_a_plan():
    for model_type in MODEL_REGISTRY:
        plan = get_model_class(model_type).parallel_plan
        assert plan is None or isinstance(plan, ParallelPlan), model_type


def _next_config(**kw):
    fields = dict(num_hidden_layers=4, full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_key_value_heads=2,
                  num_attention_heads=4, head_dim=8, hidden_size=32, intermediate_size=64, vocab_size=64,
                  num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1)
    fields.update(kw)
    return AutoConfig.for_model('qwen3_next', **fields)


def test_the_plan_decides_what_splits(monkeypatch):
    """Qwen3-Next's plan: all-MoE layers leave no dense MLP to split; an mlp_only layer does.
    Swapping the class's plan changes the layout with no other code."""
    assert TPLayout(_next_config(), 1, 2).intermediate == (0, 0)
    assert TPLayout(_next_config(mlp_only_layers=[1]), 1, 2).intermediate == (32, 64)
    layout = TPLayout(_next_config(), 1, 2)
    assert layout.shard('model.layers.0.self_attn.q_proj.weight').ranges == ((32, 64),)   # gated: 2 * 8 rows a head
    cls = get_model_class('qwen3_next')
    monkeypatch.setattr(cls, 'parallel_plan', ParallelPlan(gated_delta_net=True, skipped=('mtp.',)))
    layout = TPLayout(_next_config(), 1, 2)
    assert layout.shard('model.layers.0.self_attn.q_proj.weight').ranges == ((16, 32),)   # ungated
    assert not layout.reads('mtp.fc.weight') and layout.reads('model.norm.weight')
    monkeypatch.setattr(cls, 'parallel_plan', None)
    with pytest.raises(ValueError, match=r"tp \(2\).*not 'qwen3_next'"):
        TPLayout(_next_config(), 0, 2)
