"""Inkling (``inkling_text``, and the text part of the multimodal ``inkling_mm_model``: sliding-window
and global attention with a hidden-state-conditioned relative-logits bias and log-scaled global
logits, four residual short convs per layer, a sigmoid router whose shared experts share its
normalisation, normed embeddings, a muP logit divisor) served exactly like transformers: logits
<= 1e-4 in fp32 at every prompt position (5-700 tokens, cold and in 32-token chunks whose ends fall
inside the 40-token windows and the 48-token bias extent), greedy tokens equal cold, chunked and
after a local prefix-cache restore, a 4-turn chat identical under every cache policy, Store put
bytes equal the simulator and a new engine restoring from a ``file:`` Store, the layer cache
specs, TP2 = TP1, the multimodal checkpoint's text model (images refused by name), config refusals naming
their field, the audit of every field transformers reads, random geometries in random
chunks then decode, the batched decode attention equal to the per-sequence tiles (with an op
count that does not grow with the batch), and the Store preset of transformers' default config."""
import json
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import (TOL, check_store_bytes_then_a_new_engine_restores, engine_prompt_logits,
                          hf_prompt_logits, make_engine, random_prompt, tiny_checkpoint_and_reference)
from family_harness import (FamilyConformance, check_audit_lists_every_field_transformers_reads,
                            check_refused_field, hf_model, write_checkpoint)
from lmdeploy.pytorch.cache_specs import FullAttentionSpec, SlidingWindowSpec, StateSpec, kv_window
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.inkling import InklingWindowSpec

MODELING = 'transformers.models.inkling.modeling_inkling'


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'inkling_text')


class TestInklingConformance(FamilyConformance):
    """Prompt logits, greedy tokens and a 4-turn chat against transformers (family_harness)."""


def test_tiny_model_mixes_windows_bias_extents_log_scaling_and_both_mlps(tiny):
    config = json.load(open(os.path.join(tiny[0], 'config.json')))
    assert config['model_type'] == 'inkling_text'
    assert config['layer_types'] == ['hybrid_sliding', 'hybrid', 'hybrid_sliding', 'hybrid']
    assert config['mlp_layer_types'] == ['dense', 'sparse', 'sparse', 'sparse']
    # chunk (32) and block (16) ends fall inside the 40-token windows; 150 / 700 tokens pass the
    # 48-token bias extent of the global layers and the log-scaling floor
    assert config['sliding_window_size'] == 40 and 32 % 40 and 40 % 16
    assert config['rel_extent'] == 48 and config['log_scaling_n_floor'] == 32


def test_small_score_budgets_split_queries_into_small_tiles_with_the_same_logits(tiny, monkeypatch):
    """Long contexts take fewer query rows per score block (``SCORE_BUDGET``): with a budget of a
    few hundred scores the tiles shrink to 1-4 rows, and the logits stay within TOL of
    transformers' (global layers: every key; sliding ones: the window)."""
    import lmdeploy.pytorch.models.inkling as inkling
    from engine_utils import check_prompt_logits_match_transformers
    monkeypatch.setattr(inkling, 'SCORE_BUDGET', 4 * 4 * 100)
    check_prompt_logits_match_transformers(*tiny, 150, 64)


def test_store_bytes_equal_the_simulator_and_a_new_engine_restores(tiny, tmp_path):
    """Window and global layers: the Store keeps every block below a save point, and the state
    objects hold the four conv states of every layer."""
    check_store_bytes_then_a_new_engine_restores(tiny[0], tmp_path, seed=4_700)


def test_cache_specs_are_window_or_global_kv_and_four_float32_conv_states_per_layer(tiny):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('inkling_text').cache_specs(config, torch.bfloat16)
    assert [type(s) for s in specs] == [InklingWindowSpec, StateSpec, FullAttentionSpec, StateSpec] * 2
    assert isinstance(specs[0], SlidingWindowSpec)
    assert specs[0].window == 40 and kv_window(specs) is None       # the global layers read every block
    assert (specs[0].num_kv_heads, specs[0].head_dim, specs[2].num_kv_heads, specs[2].head_dim) == (1, 8, 2, 16)
    assert [(t.name, t.shape, t.dtype) for t in specs[1].tensors()] == [
        ('k_conv', (8, 3), torch.float32), ('v_conv', (8, 3), torch.float32),
        ('attn_conv', (64, 3), torch.float32), ('mlp_conv', (64, 3), torch.float32)]
    assert [t.shape for t in specs[3].tensors()][:2] == [(32, 3), (32, 3)]
    # S: float32 (4 bytes) k/v convs of 8 (sliding) or 32 (global) channels and two 64-channel convs per
    # layer; K_blk: 16 tokens x K and V x bf16 (2 bytes) x two layers of each kind x (1 x 8 or 2 x 16)
    assert sum(s.bytes_per_slot() for s in specs) == 4 * 3 * (2 * (2 * 8 + 2 * 32) + 4 * 2 * 64) == 8064
    assert sum(s.bytes_per_block(16) for s in specs) == 16 * 2 * 2 * 2 * (8 + 32) == 5120


def test_short_convs_and_router_scale_stay_float32_in_a_bfloat16_model(tiny):
    """As transformers' ``_keep_in_fp32_modules_strict``: the convs and the router's scale and
    correction bias are float32 after the model is cast; everything else takes the cast."""
    from transformers import AutoConfig
    model = get_model_class('inkling_text')(AutoConfig.from_pretrained(tiny[0])).to(torch.bfloat16)
    layer = model.model.layers[1]
    assert {p.dtype for p in (layer.attn_sconv.weight, layer.mlp_sconv.weight, layer.self_attn.k_sconv.weight,
                              layer.mlp.gate.global_scale, layer.mlp.gate.e_score_correction_bias)} == {torch.float32}
    assert layer.mlp.gate.weight.dtype == layer.self_attn.q_proj.weight.dtype == torch.bfloat16


def test_unpadded_vocab_columns_are_never_sampled(tiny):
    """``unpadded_vocab_size``: transformers drops the logits past it; they are -inf here and the
    rest equal the full head's."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    model = get_model_class('inkling_text')(config)
    config.unpadded_vocab_size = config.vocab_size - 5
    cut = get_model_class('inkling_text')(config)
    cut.load_state_dict(model.state_dict())
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    full, got = model.compute_logits(hidden), cut.compute_logits(hidden)
    assert torch.equal(got[:, :-5], full[:, :-5]) and bool((got[:, -5:] == float('-inf')).all())


@pytest.mark.parametrize('layout', ['published', 'transformers'])
def test_multimodal_checkpoint_serves_its_text_model_and_refuses_images(tiny, tmp_path, layout):
    """An ``inkling_mm_model`` checkpoint with tiny vision / audio towers, in the published layout
    (what ``save_pretrained`` writes: ``model.llm.*``, ``attn.wq_du``, interleaved ``w13``
    tensors) or ``transformers``' in-memory names: prompt logits within TOL of
    ``InklingForConditionalGeneration``'s; a request with image data is refused naming
    ``multimodal``."""
    import shutil

    from safetensors import safe_open
    from transformers import AutoConfig, InklingConfig, InklingForConditionalGeneration

    from lmdeploy.pytorch.multimodal import MultimodalInput
    text = AutoConfig.from_pretrained(tiny[0])
    config = InklingConfig(text_config=text.to_dict(), vision_config=dict(hidden_size=16, num_hidden_layers=2,
                                                                          num_attention_heads=2),
                           image_token_id=5, audio_token_id=6, image_bos_token_id=7, audio_bos_token_id=8)
    hf = hf_model(InklingForConditionalGeneration, config, seed=3)
    path = tmp_path / layout
    if layout == 'published':
        shutil.copytree(tiny[0], path)
        hf.save_pretrained(path)
        with safe_open(str(path / 'model.safetensors'), 'pt') as f:
            names = set(f.keys())
        assert {'model.llm.layers.1.attn.wq_du.weight', 'model.llm.layers.1.mlp.experts.w13_weight',
                'model.llm.layers.0.mlp.w13_dn.weight', 'model.llm.unembed.weight'} <= names
        # TP2 reads the published names too: rank 1's interleaved gate/up rows are one run of 2 x 48
        from lmdeploy.pytorch.distributed.sharding import TPLayout
        rank1 = TPLayout(AutoConfig.from_pretrained(path), 1, 2)
        assert rank1.shard('model.llm.layers.0.mlp.w13_dn.weight').ranges == ((96, 192),)
        assert rank1.shard('model.llm.layers.1.attn.wo_ud.weight').ranges == ((32, 64),)
        assert rank1.shard('model.llm.unembed.weight').ranges == rank1.shard('model.llm.embed.weight').ranges
    else:
        write_checkpoint(tiny[0], path, hf, config)
    ids = random_prompt(90, seed=90)
    engine = make_engine(str(path), max_prefill_token_num=32, block_size=16)
    got, _ = engine_prompt_logits(engine, ids)
    assert (got - hf_prompt_logits(hf, ids)).abs().max().item() <= TOL
    image = MultimodalInput(0, 2, b'\0' * 16, {'pixel_values': None})
    with pytest.raises(ValueError, match="model_type 'inkling_mm_model' does not accept images") as err:
        engine.add_request(ids, multimodal=(image,))
    assert err.value.field == 'multimodal'
    engine.close()


def test_tp_plan_slices_tile_every_split_tensor(tiny):
    """Over 2 ranks each split tensor's ranges tile its axis (the sliding layers' single KV head
    and its k/v convs shared by both ranks): q / r / k / v / o and both k/v convs of each of 4
    layers, gate / up / down of the dense layer, the embedding and lm_head."""
    from test_tensor_parallel import check_tp_slices_tile_every_split_tensor
    _, layouts, split, shared = check_tp_slices_tile_every_split_tensor(tiny[0], shared=True)
    assert split == 4 * 7 + 3 + 2
    assert shared == 2 * 4          # k_proj, v_proj, k_sconv, v_sconv of both sliding layers
    assert layouts[1].shard('model.layers.1.self_attn.r_proj.weight').ranges == ((8, 16),)      # 2 heads x d_rel 4
    assert layouts[1].shard('model.layers.0.self_attn.k_sconv.conv1d.weight').ranges == ((0, 8),)
    assert layouts[1].shard('model.layers.1.self_attn.v_sconv.conv1d.weight').ranges == ((16, 32),)


def test_tp2_equals_tp1_and_a_count_tp_cannot_split_names_its_field(tiny):
    """Attention by head (sliding and global counts each), the dense MLP by rows: TP2 logits
    within TP_TOL of TP1, staggered greedy outputs equal; 3 sliding query heads are refused by
    name at TP2."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp2_equals_tp1
    config = AutoConfig.from_pretrained(tiny[0])
    config.swa_num_attention_heads, config.swa_num_key_value_heads = 3, 1
    with pytest.raises(ValueError, match=r'swa_num_attention_heads \(3\) must be divisible by tp \(2\)'):
        TPLayout(config, 0, 2)
    check_tp2_equals_tp1(tiny[0])


@pytest.mark.parametrize('change, field', [
    (dict(layer_types=['hybrid'] * 2), 'layer_types'),
    (dict(layer_types=['hybrid', 'full_attention', 'hybrid', 'hybrid']), 'layer_types'),
    (dict(mlp_layer_types=['dense', 'moe', 'sparse', 'sparse']), 'mlp_layer_types'),
    (dict(sliding_window_size=0), 'sliding_window_size'),
    (dict(rel_extent=None), 'rel_extent'),
    (dict(d_rel=0), 'd_rel'),
    (dict(conv_kernel_size=1), 'conv_kernel_size'),
    (dict(num_key_value_heads=3), 'num_key_value_heads'),
    (dict(swa_num_key_value_heads=3), 'swa_num_key_value_heads'),
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(num_experts_per_tok=9), 'num_experts_per_tok'),
    (dict(n_shared_experts=0), 'n_shared_experts'),
    (dict(log_scaling_n_floor=0), 'log_scaling_n_floor'),
    (dict(unpadded_vocab_size=10 ** 6), 'unpadded_vocab_size'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    check_refused_field(AutoConfig.from_pretrained(tiny[0]), change, field, 'inkling_text', checked={
        'layer_types', 'mlp_layer_types', 'sliding_window_size', 'rel_extent', 'd_rel', 'conv_kernel_size',
        'num_key_value_heads', 'swa_num_key_value_heads', 'hidden_act', 'num_experts_per_tok', 'n_shared_experts',
        'log_scaling_n_floor', 'unpadded_vocab_size', 'quantization_config'})


@pytest.mark.parametrize('model_type', ['inkling_text', 'inkling_mm_model'])
def test_audit_lists_every_field_transformers_reads(model_type):
    check_audit_lists_every_field_transformers_reads(model_type, MODELING)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (sliding / global layers, windows of 1-20 tokens, bias extents
    of 1-30, log scaling on or off, KV heads, conv width, dense or sparse MLPs) and a random
    prefill chunking then 3 decode steps: logits <= 1e-4 of transformers' full forward, through
    NaN-poisoned scrambled blocks and slots."""
    from transformers import InklingForCausalLM, InklingTextConfig

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(1, 3))
    config = InklingTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=n_layers,
        layer_types=data.draw(st.lists(st.sampled_from(['hybrid_sliding', 'hybrid']), min_size=n_layers,
                                       max_size=n_layers)),
        mlp_layer_types=data.draw(st.lists(st.sampled_from(['dense', 'sparse']), min_size=n_layers,
                                           max_size=n_layers)),
        num_attention_heads=4, num_key_value_heads=data.draw(st.sampled_from([1, 2, 4])), head_dim=8,
        swa_num_attention_heads=2, swa_num_key_value_heads=data.draw(st.sampled_from([1, 2])), swa_head_dim=4,
        sliding_window_size=data.draw(st.integers(1, 20)), d_rel=data.draw(st.integers(1, 4)),
        rel_extent=data.draw(st.integers(1, 30)), log_scaling_n_floor=data.draw(st.sampled_from([None, 1, 9])),
        log_scaling_alpha=0.3, conv_kernel_size=data.draw(st.integers(2, 4)), intermediate_size=40,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=data.draw(st.integers(1, 2)), route_scale=1.5, logits_mup_width_multiplier=2.0,
        pad_token_id=0, bos_token_id=None, eos_token_id=1)
    check_random_model_in_random_chunks_then_decode(data, InklingForCausalLM, 'inkling_text', config, 60, TOL)


def _paged_step(data, q_lens: list[int], window: int | None, Hkv: int, D: int, B: int):
    """Random paged K/V caches (NaN where never written; on a sliding layer the blocks wholly
    before each sequence's window are a NaN block, as a window pool's freed entries) for sequences
    adding ``q_lens`` tokens to drawn histories, and the step's :class:`StepContext`; returns
    ``(ctx, k_cache, v_cache, new k, new v)``."""
    from lmdeploy.pytorch.model_inputs import StepContext
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    kv_lens = [n + data.draw(st.integers(0, 70)) for n in q_lens]
    num_blocks = 1 + sum(-(-n // B) for n in kv_lens)
    k_cache = torch.full((num_blocks, B, Hkv, D), float('nan'))
    v_cache = torch.full((num_blocks, B, Hkv, D), float('nan'))
    free = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()     # block 0: never written
    tables = []
    for n, kv in zip(q_lens, kv_lens):
        table = [free.pop() for _ in range(-(-kv // B))]
        hist = kv - n
        first = 0 if window is None else max(0, hist - window + 1)      # the first key any new query sees
        for pos in range(first, hist):
            k_cache[table[pos // B], pos % B] = torch.randn(Hkv, D, generator=gen)
            v_cache[table[pos // B], pos % B] = torch.randn(Hkv, D, generator=gen)
        if window is not None:
            table[:first // B] = [0] * (first // B)
        tables.append(torch.tensor(table, dtype=torch.long))
    T = sum(q_lens)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    positions = torch.cat([torch.arange(kv - n, kv) for n, kv in zip(q_lens, kv_lens)])
    ctx = StepContext(input_ids=torch.zeros(T, dtype=torch.long), positions=positions, q_seqlens=list(q_lens),
                      q_start_loc=starts, kv_seqlens=kv_lens, block_tables=tables, state_slots=[-1] * len(q_lens),
                      block_size=B)
    return ctx, k_cache, v_cache, torch.randn(T, Hkv, D, generator=gen), torch.randn(T, Hkv, D, generator=gen)


# float32 scores and softmax as the looped reference, summed in another order (batched products,
# and past GATHER_BUDGET the online merge of key tiles): outputs are averages of N(0, 1) values
BATCHED_TOL = 1e-5


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_batched_decode_attention_equals_the_looped_tiles(data):
    """:func:`relative_bias_attention` of a step of 1-5 sequences (decodes only, or decodes beside
    prefill chunks) over random histories (0-70 tokens), windows (none or 1-24), bias extents
    (1-30), head layouts, block sizes, log scaling on or off and gather budgets down to one key per
    tile, equals :func:`tiled_attention` (the per-sequence loop) over every sequence, within
    BATCHED_TOL, through NaN-poisoned unwritten cache entries."""
    from unittest import mock

    import lmdeploy.pytorch.models.inkling as inkling
    from lmdeploy.pytorch.kernels.attention import fill_kv_cache
    n_seqs = data.draw(st.integers(1, 5))
    q_lens = data.draw(st.lists(st.sampled_from([1, 1, 1, 2, 7]), min_size=n_seqs, max_size=n_seqs))
    window = data.draw(st.one_of(st.none(), st.integers(1, 24)))
    Hkv, G, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.sampled_from([2, 8]))
    d_rel, E = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 30))
    B = data.draw(st.sampled_from([1, 4, 16]))
    budget = data.draw(st.sampled_from([inkling.GATHER_BUDGET, 1, 3 * n_seqs * Hkv * D]))
    ctx, k_cache, v_cache, k, v = _paged_step(data, q_lens, window, Hkv, D, B)
    T, H = k.shape[0], Hkv * G
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    q, rel = torch.randn(T, H, D, generator=gen), torch.randn(T, H, d_rel, generator=gen)
    proj = torch.randn(d_rel, E, generator=gen)
    tau = 1 + torch.rand(T, generator=gen) if data.draw(st.booleans()) else None
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    fill_kv_cache(k, v, ref_k, ref_v, ctx)
    ref = torch.full_like(q, float('nan'))
    inkling.tiled_attention(q, rel, proj, ref_k, ref_v, ctx, 0.3, window, tau, ref, list(range(n_seqs)))
    with mock.patch.object(inkling, 'GATHER_BUDGET', budget):
        got = inkling.relative_bias_attention(q, k, v, rel, proj, k_cache, v_cache, ctx, 0.3, window, tau)
    assert not ref.isnan().any()
    assert (got - ref).abs().max().item() <= BATCHED_TOL


def test_decode_attention_runs_the_same_torch_ops_for_two_or_twelve_sequences():
    """No Python work per sequence at decode: the op count of a decode step's attention (global
    and sliding, histories of 25-58 tokens, past the bias extent: which slices are whole, and
    so which views torch takes, depends on the key count; the step's shared layout tensors built
    by a first call, as the engine's first layer does) does not grow with the batch; the
    per-sequence loop ran 75 more ops for each sequence."""
    from types import SimpleNamespace

    from lmdeploy.pytorch.models.inkling import relative_bias_attention
    from test_varlen_kernels import _count_ops

    class Draw(SimpleNamespace):
        def draw(self, strategy):
            return self.values.pop(0)

    counts = {}
    for window in (None, 16):
        for n in (2, 12):
            lens = [25 + 3 * i for i in range(n)]
            ctx, k_cache, v_cache, k, v = _paged_step(Draw(values=[n] + lens), [1] * n, window, 2, 8, 4)
            q, rel = torch.randn(n, 4, 8), torch.randn(n, 4, 3)
            proj, tau = torch.randn(3, 20), torch.ones(n)
            # a first call builds the step's shared layout tensors
            relative_bias_attention(q, k, v, rel, proj, k_cache, v_cache, ctx, 0.1, window, tau)
            counts[window, n] = _count_ops(lambda: relative_bias_attention(
                q, k, v, rel, proj, k_cache, v_cache, ctx, 0.1, window, tau))
    assert counts[None, 2] == counts[None, 12] and counts[16, 2] == counts[16, 12], counts


def test_store_preset_of_transformers_default_config_sized_by_hand():
    """benchmark/family_presets.py's ``inkling-default`` (transformers' default
    ``InklingTextConfig``, bf16): 66 layers, every sixth global (11 global layers of 8 KV heads,
    55 sliding of 16, head_dim 128 both). S: four float32 convs of 3 inputs per layer (k / v of
    ``kv_heads x 128`` channels, two of hidden 6144); K_blk: K and V of the 11 global layers over
    64 tokens, and K_win of the 55 sliding ones (window objects: the Store keeps only the blocks of
    each save point's 512-token window for them)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmark.family_presets import FAMILY_PRESETS, family_sizes
    preset = next(p for p in FAMILY_PRESETS if p.family == 'inkling_text')
    f32, bf16, B = 4, 2, 64
    S = 3 * f32 * (55 * (2 * 16 * 128 + 2 * 6144) + 11 * (2 * 8 * 128 + 2 * 6144))
    K_blk, K_win = B * 2 * bf16 * 11 * 8 * 128, B * 2 * bf16 * 55 * 16 * 128
    sizes = family_sizes(preset)
    assert sizes.charged == (S, K_blk) == (12_705_792, 2_883_584)
    assert (sizes.window_block_bytes, sizes.window_rows, sizes.window) == (K_win, 512, None)
