"""Models own their parallel plan: the TP layout applies a model class's ``parallel_plan`` (a
composition of the blocks' splits) and never branches on the model type; model files write no
split code; an axis splits into ranges that tile it or is refused naming the field."""
import inspect
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from lmdeploy.pytorch.distributed import sharding
from lmdeploy.pytorch.distributed.sharding import TPLayout
from lmdeploy.pytorch.models import MODEL_REGISTRY, get_model_class
from lmdeploy.pytorch.models.blocks.gated_delta_net import FULL, HYBRID_BLOCKS, hybrid_layer_kinds
from lmdeploy.pytorch.models.blocks.gqa import gqa_split
from lmdeploy.pytorch.models.layers import mlp_split
from lmdeploy.pytorch.models.parallel_plan import Axis, Block, ParallelPlan


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
    assert 'intermediate' not in TPLayout(_next_config(), 1, 2).axes
    assert TPLayout(_next_config(mlp_only_layers=[1]), 1, 2).part('intermediate') == (32, 64)
    layout = TPLayout(_next_config(), 1, 2)
    assert layout.shard('model.layers.0.self_attn.q_proj.weight') is None      # layer 0 is Gated DeltaNet
    assert layout.shard('model.layers.3.self_attn.q_proj.weight').ranges == ((32, 64),)   # gated: 2 * 8 rows a head
    cls = get_model_class('qwen3_next')
    ungated = {**HYBRID_BLOCKS, FULL: (Block(gqa_split(), 'self_attn'),)}
    monkeypatch.setattr(cls, 'parallel_plan', ParallelPlan(layers=lambda c: hybrid_layer_kinds(c, dense=False),
                                                           blocks=ungated, skipped=('mtp.',)))
    layout = TPLayout(_next_config(), 1, 2)
    assert layout.shard('model.layers.3.self_attn.q_proj.weight').ranges == ((16, 32),)   # ungated
    assert not layout.reads('mtp.fc.weight') and layout.reads('model.norm.weight')
    monkeypatch.setattr(cls, 'parallel_plan', None)
    with pytest.raises(ValueError, match=r"tp \(2\).*not 'qwen3_next'"):
        TPLayout(_next_config(), 0, 2)


def test_a_plan_that_contradicts_itself_is_refused(monkeypatch):
    """Two blocks declaring one axis name differently, or a layer kind with no blocks, is a
    ValueError naming the axis or the kind (a plan bug, caught before any weight is read)."""
    cls = get_model_class('qwen3_next')
    other = Block(mlp_split(field='moe_intermediate_size'), 'mlp')       # same axis name, another count
    monkeypatch.setattr(cls, 'parallel_plan', ParallelPlan(layers=lambda c: hybrid_layer_kinds(c, dense=True),
                                                           blocks={**HYBRID_BLOCKS, FULL: (other,)}))
    with pytest.raises(ValueError, match="axis 'intermediate'"):
        TPLayout(_next_config(), 0, 2)
    monkeypatch.setattr(cls, 'parallel_plan', ParallelPlan(layers=lambda c: ['conv'] * c.num_hidden_layers))
    with pytest.raises(ValueError, match="layer kind 'conv'"):
        TPLayout(_next_config(), 0, 2)


def test_model_files_compose_block_splits_and_write_no_split_code():
    """The split code lives in the blocks and the layout: a family file declares its plan as a
    composition of block splits (no shard / local-config / cache-range methods, no plan class),
    and every plan's blocks return a BlockSplit of data."""
    import lmdeploy.pytorch.models as models_pkg
    root = os.path.dirname(models_pkg.__file__)
    for name in sorted(os.listdir(root)):
        # loader.py's WholeModel is the tp=1 layout (every tensor whole), not a family's split
        if not name.endswith('.py') or name in ('parallel_plan.py', 'loader.py'):
            continue
        with open(os.path.join(root, name)) as f:
            source = f.read()
        for code in ('def shard(', 'def cache_ranges(', 'def local_config(', 'TPPlan', 'TPSplit', 'custom='):
            assert code not in source, (name, code)
    for model_type in MODEL_REGISTRY:
        plan = get_model_class(model_type).parallel_plan
        if plan is None:          # tp=1 only (refused naming tp)
            continue
        for kind, blocks in plan.blocks.items():
            assert all(isinstance(b, Block) for b in blocks), (model_type, kind)


@given(total=st.integers(1, 64), size=st.sampled_from([1, 2, 3, 4, 6, 8, 16]), shared=st.booleans())
@settings(max_examples=300, deadline=None)
def test_an_axis_splits_into_ranges_that_tile_it_or_refuses_naming_the_field(total, size, shared):
    """Any count and TP size: the ranks' parts tile ``[0, total)`` in rank order (a shared axis
    with fewer units than ranks: every unit held by exactly ``size / total`` consecutive ranks),
    or the split is a ValueError naming the field."""
    axis = Axis('heads', total, 'num_heads', shared=shared)
    try:
        parts = [axis.part(r, size) for r in range(size)]
    except ValueError as e:
        assert str(e).startswith(f'num_heads ({total}) must be divisible by tp ({size})')
        assert total % size and not (shared and size % total == 0)
        return
    if total % size == 0:
        assert parts == [(r * total // size, (r + 1) * total // size) for r in range(size)]
    else:
        assert shared and size % total == 0
        assert [a for a, _ in parts] == sorted(a for a, _ in parts) and all(b == a + 1 for a, b in parts)
        assert all(sum(1 for p in parts if p[0] == u) == size // total for u in range(total))


def _tiny(model_type: str, **kw):
    return AutoConfig.for_model(model_type, **{**get_model_class(model_type).tiny_config, 'vocab_size': 64, **kw})


@pytest.mark.parametrize('size', [2, 4])
def test_lightning_layers_keep_the_full_models_decay_rates_and_norm(size):
    """MiniMax under TP: each rank's lightning layer holds exactly the full model's decay rates of
    its heads (a function of the head's index among all heads) and normalises over all heads."""
    import torch

    from lmdeploy.pytorch.models.blocks.lightning import LightningAttention, lightning_slopes
    config = _tiny('minimax', num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    cls = get_model_class('minimax')
    for rank in range(size):
        layout = TPLayout(config, rank, size)
        with torch.device('meta'):
            model = layout.apply(cls(layout.local_config()))
        first, stop = layout.part('q_heads')
        assert (first, stop) == (rank * 8 // size, (rank + 1) * 8 // size)
        layers = [(i, m.self_attn) for i, m in enumerate(model.model.layers)
                  if isinstance(m.self_attn, LightningAttention)]
        assert [i for i, _ in layers] == [0, 2, 3]
        for i, attn in layers:
            assert torch.equal(attn.slopes, lightning_slopes(8, i, 4)[first:stop])
            assert attn.cross_rank_norm.dim == 8 * 8


def test_ling3_splits_its_published_and_transformers_spellings_alike():
    """Ling 3's KDA (full-rank gates) and gated MLA split the same whether a tensor is spelled as
    published (``attention.*``, ``dense``) or as transformers saves it (``self_attn.*``,
    ``forget_gate.*``, ``o_proj``); the latent producers and NextN layers are whole."""
    layout = TPLayout(_tiny('bailing_hybrid'), 1, 2)      # 4 KDA heads of 16, 4 MLA heads
    kda, mla = 'model.layers.0.', 'model.layers.1.'
    expect = {f'{kda}attention.f_proj.weight': (0, ((32, 64),)),
              f'{kda}self_attn.forget_gate.f_proj.weight': (0, ((32, 64),)),
              f'{kda}attention.g_proj.weight': (0, ((32, 64),)), f'{kda}attention.A_log': (0, ((2, 4),)),
              f'{kda}self_attn.forget_gate.A_log': (0, ((2, 4),)), f'{kda}attention.dense.weight': (1, ((32, 64),)),
              f'{kda}self_attn.o_proj.weight': (1, ((32, 64),)), f'{mla}attention.g_proj.weight': (0, ((2, 4),)),
              f'{mla}attention.dense.weight': (1, ((32, 64),)), f'{mla}self_attn.kv_b_proj.weight': (0, ((64, 128),)),
              'model.word_embeddings.weight': (0, ((32, 64),))}
    for name, (dim, ranges) in expect.items():
        shard = layout.shard(name)
        assert (shard.dim, shard.ranges) == (dim, ranges), name
    for name in (f'{mla}attention.kv_a_proj_with_mqa.weight', f'{kda}attention.f_a_proj.weight',
                 'model.layers.4.attention.dense.weight'):
        assert layout.shard(name) is None, name
    local = layout.local_config()
    assert (local.linear_num_heads, local.num_attention_heads, local.num_key_value_heads) == (2, 2, 2)


def test_lara_mini_and_lfm3_split_as_their_former_plans_every_spelling_alike():
    """Rank 2 of 4 reads exactly what the two families' former hand-written splits gave it (values
    dumped from them): Lara-4-Mini's published fused ``in_proj`` six ranges, the same rows as
    transformers' ``in_proj_qkv | z | b | a``; LFM3's output gate (published ``gate_proj``,
    transformers' ``g_proj``) by query head, its short conv's ``B | C | x`` by channel, its MLP by
    rows; norms and the MoE whole; the local config and cache ranges alike."""
    lara = TPLayout(_tiny('lara_mini', num_attention_heads=8, linear_num_key_heads=4, linear_num_value_heads=8), 2, 4)
    gdn = 'model.layers.0.linear_attn.'
    qkv = ((32, 48), (96, 112), (192, 224))
    expect = {f'{gdn}in_proj.weight': (0, qkv + ((320, 352), (388, 390), (396, 398))),
              f'{gdn}in_proj_qkv.weight': (0, qkv), f'{gdn}conv1d.weight': (0, qkv),
              f'{gdn}in_proj_z.weight': (0, ((64, 96),)), f'{gdn}in_proj_b.weight': (0, ((4, 6),)),
              f'{gdn}A_log': (0, ((4, 6),)), f'{gdn}out_proj.weight': (1, ((64, 96),)),
              'model.layers.1.self_attn.q_proj.weight': (0, ((64, 96),)),
              'model.layers.1.self_attn.k_proj.weight': (0, ((16, 32),)),      # 2 KV heads: 2 ranks share one
              'model.layers.3.self_attn.o_proj.weight': (1, ((64, 96),))}
    for name, (dim, ranges) in expect.items():
        assert (lara.shard(name).dim, lara.shard(name).ranges) == (dim, ranges), name
    for name in (f'{gdn}out_norm.weight', 'model.layers.1.mlp.shared_expert.down_proj.weight',
                 'model.layers.1.mlp.gate.weight'):
        assert lara.shard(name) is None, name
    local = lara.local_config()
    assert (local.num_attention_heads, local.num_key_value_heads, local.linear_num_key_heads,
            local.linear_num_value_heads) == (2, 1, 1, 2)
    assert (lara.cache_ranges('conv_channels'), lara.cache_ranges('kv_heads'), lara.cache_ranges('v_heads')) == \
        (qkv, ((1, 2),), ((4, 6),))

    lfm3 = TPLayout(_tiny('lfm3', num_attention_heads=8, num_key_value_heads=4), 2, 4)
    expect = {'model.layers.0.conv.in_proj.weight': (0, ((32, 48), (96, 112), (160, 176))),
              'model.layers.0.conv.conv.weight': (0, ((32, 48),)),
              'model.layers.0.conv.out_proj.weight': (1, ((32, 48),)),
              'model.layers.1.self_attn.gate_proj.weight': (0, ((4, 6),)),
              'model.layers.1.self_attn.g_proj.weight': (0, ((4, 6),)),
              'model.layers.2.self_attn.q_proj.weight': (0, ((64, 96),)),
              'model.layers.2.self_attn.k_proj.weight': (0, ((32, 48),)),
              'model.layers.2.self_attn.o_proj.weight': (1, ((64, 96),)),
              'model.layers.0.feed_forward.w1.weight': (0, ((48, 72),)),
              'model.layers.0.feed_forward.w2.weight': (1, ((48, 72),))}
    for name, (dim, ranges) in expect.items():
        assert (lfm3.shard(name).dim, lfm3.shard(name).ranges) == (dim, ranges), name
    assert lfm3.shard('model.layers.2.self_attn.q_norm.weight') is None
    local = lfm3.local_config()
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.conv_channels) == \
        (2, 1, 24, 16)
    assert (lfm3.cache_ranges('kv_heads'), lfm3.cache_ranges('short_conv_channels')) == (((2, 3),), ((32, 48),))
    with pytest.raises(ValueError, match=r'num_key_value_heads \(4\) must be divisible by tp \(8\)'):
        TPLayout(_tiny('lfm3', num_attention_heads=8, num_key_value_heads=4), 0, 8)    # KV heads never shared
