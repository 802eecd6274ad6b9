"""The shared pieces the families pick their layers from (models/blocks/decoder.py options,
blocks/window_attention.py, config_audit.check_layer_types, blocks/gqa.py): exact values against
hand-written references, and the config checks over generated layer lists."""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from lmdeploy.pytorch.models.blocks.decoder import (DecoderLayer, RotaryTables, SharedMLPDecoderLayer, UniformStack,
                                                    mixer_nope_ctx, mixer_table_ctx)
from lmdeploy.pytorch.models.blocks.gqa import GQAProjections, RotaryGQA
from lmdeploy.pytorch.models.blocks.window_attention import layer_windows
from lmdeploy.pytorch.models.config_audit import check_layer_types

KINDS = ('linear_attention', 'sliding_attention', 'full_attention', 'conv', 'mamba')


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(types=st.lists(st.sampled_from(KINDS), max_size=6), n=st.integers(0, 6),
       allowed=st.sets(st.sampled_from(KINDS), min_size=1).map(sorted), field=st.sampled_from(
           ['layer_types', 'mlp_layer_types', 'indexer_types']))
def test_check_layer_types_refuses_exactly_a_wrong_length_or_kind(types, n, allowed, field):
    config = SimpleNamespace(num_hidden_layers=n, **{field: types})
    good = len(types) == n and all(t in allowed for t in types)
    if good:
        assert check_layer_types(config, tuple(allowed), field) == types
    else:
        with pytest.raises(ValueError, match=f'^{field} must list'):
            check_layer_types(config, tuple(allowed), field)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(types=st.lists(st.sampled_from(KINDS[:4]), min_size=1, max_size=6),
       window=st.one_of(st.none(), st.booleans(), st.integers(-2, 50)), other=st.sampled_from([None, 'conv']))
def test_layer_windows_per_kind(types, window, other):
    config = SimpleNamespace(num_hidden_layers=len(types), layer_types=types, sliding_window=window)
    kinds = {'sliding_attention', 'full_attention'} | ({other} if other else set())
    if any(t not in kinds for t in types):
        with pytest.raises(ValueError, match='layer_types'):
            layer_windows(config, other)
        return
    slides = 'sliding_attention' in types
    if slides and (window is None or isinstance(window, bool) or window < 1):
        with pytest.raises(ValueError, match='sliding_window'):
            layer_windows(config, other)
        return
    expected = [0 if t == other else window if t == 'sliding_attention' else None for t in types]
    assert layer_windows(config, other) == expected


class _Scale(nn.Module):
    """A token mixer / MLP with one weight: ``x * w`` (exact to reproduce by hand)."""

    def __init__(self, value: float):
        super().__init__()
        self.w = nn.Parameter(torch.full((8,), value))

    def forward(self, x, *args):
        return x * self.w


def _reference(x, mixer, mlp, shared, norm_1, norm_2, m):
    h = x + mixer(norm_1(x)) * m
    normed = norm_2(h)
    out = mlp(normed) + shared(normed) if shared is not None else mlp(normed)
    return h + out * m


@pytest.mark.parametrize('m', [1.0, 0.22])
@pytest.mark.parametrize('with_shared', [True, False])
def test_shared_mlp_layer_adds_the_second_mlp_on_the_same_input(m, with_shared):
    torch.manual_seed(0)
    shared = _Scale(0.5) if with_shared else None
    layer = SharedMLPDecoderLayer(8, 1e-6, _Scale(1.5), _Scale(-0.75), residual_multiplier=m,
                                  names=('self_attn', 'block_sparse_moe', 'input_layernorm', 'post_attention_layernorm'),
                                  shared=('shared_mlp', shared))
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 8)
    got = layer(x, None, None)
    if shared is None:      # exactly the plain layer (its fused add + norm when m == 1)
        want = DecoderLayer.forward(layer, x, None, None)
    else:
        want = _reference(x, layer.self_attn, layer.block_sparse_moe, shared, layer.input_layernorm,
                          layer.post_attention_layernorm, m)
    assert torch.equal(got, want)
    names = {k.split('.')[0] for k in layer.state_dict()}
    assert names == {'self_attn', 'block_sparse_moe', 'input_layernorm', 'post_attention_layernorm'} | (
        {'shared_mlp'} if with_shared else set())


def test_rotary_tables_and_per_kind_calls():
    calls = []

    class Table(nn.Module):
        def __init__(self, tag):
            super().__init__()
            self.tag = tag

        def forward(self, positions, dtype):
            return (self.tag, positions.to(dtype))

    tables = RotaryTables({'sliding_attention': Table('s'), 10000.0: Table('t')})
    assert list(tables.state_dict()) == []          # no parameters, no buffers: names unchanged
    out = tables(torch.arange(3), torch.float32)
    assert set(out) == {'sliding_attention', 10000.0} and out[10000.0][0] == 't'

    def mixer(x, rotary, ctx):
        calls.append(rotary)
        return x

    x = torch.zeros(1)
    mixer_table_ctx('sliding_attention')(mixer, x, out, None)
    mixer_table_ctx(0.0)(mixer, x, out, None)       # a NoPE layer: no table under its key
    mixer_nope_ctx(mixer, x, out, None)
    assert calls[0] is out['sliding_attention'] and calls[1] is None and calls[2] is None


def test_uniform_stack_builds_each_layer_from_the_class_attributes():
    def make_layer(config, i):                      # a plain function stays unbound
        return nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    class Stack(UniformStack):
        layer_class = make_layer

    config = SimpleNamespace(vocab_size=11, hidden_size=4, rms_norm_eps=1e-6, num_hidden_layers=3)
    stack = Stack(config)
    assert len(stack.layers) == 3 and stack.rotary is None
    assert sorted({k.split('.')[0] for k in stack.state_dict()}) == ['embed_tokens', 'layers', 'norm']


def test_gqa_projections_without_attention_bias_have_no_biases():
    """MiniMax's config has no ``attention_bias``: the projections are bias-free (the old
    ``config.attention_bias`` read raised AttributeError)."""
    config = SimpleNamespace(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    for layer in (GQAProjections(config, 0), RotaryGQA(config, 0)):
        assert layer.qkv_proj.bias is None and layer.o_proj.bias is None
    assert RotaryGQA(config, 0).scale == 4 ** -0.5 and RotaryGQA(config, 0, scale=0.1).scale == 0.1


class _WrappedAttend(RotaryGQA):
    """A variant whose attend still computes the plain attention (it only wraps it)."""
    plain_attend = True

    def attend(self, q, k, v, ctx):
        return super().attend(q, k, v, ctx)


def _swa_attention():
    from lmdeploy.pytorch.models.granitemoe_swa import GraniteSWAAttention

    class Inherits(GraniteSWAAttention):      # no attend of its own: GraniteSWA's kernel, its flag
        pass

    return GraniteSWAAttention, Inherits


@pytest.mark.parametrize('kind,fused', [('plain', True), ('wrapped', True), ('swa', False), ('swa-subclass', False)])
def test_rotary_gqa_runs_the_fused_decode_exactly_when_attend_is_plain(kind, fused, monkeypatch):
    """A float32 decode step asks for the fused decode path exactly when the layer's attend is
    the plain paged attention: RotaryGQA and a wrapper that says so (plain_attend), never
    Granite-SWA's window-and-sinks attend nor a subclass inheriting it."""
    from lmdeploy.pytorch.model_inputs import StepContext
    from lmdeploy.pytorch.models.blocks import gqa
    swa, swa_sub = _swa_attention()
    cls = {'plain': RotaryGQA, 'wrapped': _WrappedAttend, 'swa': swa, 'swa-subclass': swa_sub}[kind]
    config = SimpleNamespace(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                             attention_multiplier=0.5)
    layer = cls(config, 0) if cls in (RotaryGQA, _WrappedAttend) else cls(config, 0, None)
    calls = []

    def recording(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    real = gqa.fused_attention_decode
    monkeypatch.setattr(gqa, 'fused_attention_decode', recording)
    cache = (torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4))
    ctx = StepContext(input_ids=torch.zeros(1, dtype=torch.int64), positions=torch.tensor([3]), q_seqlens=[1],
                      q_start_loc=[0], kv_seqlens=[4], block_tables=[torch.tensor([1])], state_slots=[-1],
                      kv_caches=[cache], block_size=4)
    out = layer(torch.randn(1, 16, generator=torch.Generator().manual_seed(0)), None, ctx)
    assert out.shape == (1, 16)
    assert calls == ([layer] if fused else [])


def test_overriding_attend_without_plain_attend_is_refused():
    """A RotaryGQA subclass with its own attend must say whether it is the plain attention:
    leaving plain_attend out fails when the class is defined, not silently at decode time."""
    with pytest.raises(TypeError, match='plain_attend'):
        class Forgot(RotaryGQA):
            def attend(self, q, k, v, ctx):
                return super().attend(q, k, v, ctx)
