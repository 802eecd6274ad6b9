"""OLMo Hybrid's and Zamba2's layers as built from the shared decoder layer and stack
(models/blocks/decoder.py): every layer keeps the checkpoint's module names over generated layer
lists, and the two layer shapes the shared layer does not cover by itself (OLMo's post-norm
attention layer, Zamba2's hybrid layer that adds the shared block's output to the Mamba-2 input
only) equal hand-written references exactly, with stub mixers standing for attention / Mamba-2."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from lmdeploy.pytorch.models.blocks.decoder import DecoderLayer, DecoderStack
from lmdeploy.pytorch.models.layers import RMSNorm, SwiGLUMLP
from lmdeploy.pytorch.models.olmo_hybrid import OlmoHybridModel, OlmoHybridPostNormLayer
from lmdeploy.pytorch.models.zamba2 import HYBRID, MAMBA, Zamba2HybridLayer, Zamba2Model
from lmdeploy.tools.make_tiny_model import build_config

OLMO_NAMES = {'linear_attention': {'linear_attn', 'input_layernorm', 'post_attention_layernorm', 'mlp'},
              'full_attention': {'self_attn', 'post_attention_layernorm', 'post_feedforward_layernorm', 'mlp'}}


def _config(arch: str, **overrides):
    return build_config(arch, vocab_size=32, eos_token_id=1, pad_token_id=0, **overrides)


def _children(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(types=st.lists(st.sampled_from(sorted(OLMO_NAMES)), min_size=2, max_size=5).filter(
    lambda types: len(set(types)) == 2))      # transformers wants both kinds
def test_olmo_layers_keep_the_checkpoint_names_per_kind(types):
    model = OlmoHybridModel(_config('olmo_hybrid', num_hidden_layers=len(types), layer_types=types))
    assert isinstance(model, DecoderStack) and _children(model) == {'embed_tokens', 'layers', 'norm'}
    for layer, kind in zip(model.layers, types):
        assert isinstance(layer, DecoderLayer) and _children(layer) == OLMO_NAMES[kind]
        assert isinstance(layer, OlmoHybridPostNormLayer) == (kind == 'full_attention')


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(kinds=st.lists(st.sampled_from([MAMBA, HYBRID]), min_size=1, max_size=5), tied=st.booleans())
def test_zamba2_layers_keep_the_checkpoint_names_per_kind(kinds, tied):
    config = _config('zamba2', num_hidden_layers=len(kinds), layers_block_type=kinds, tie_word_embeddings=tied)
    model = Zamba2Model(config)
    assert _children(model) == {'embed_tokens', 'blocks', 'layers', 'final_layernorm', 'rotary'}   # RoPE: no weights
    uses = [i for i, kind in enumerate(kinds) if kind == HYBRID]
    assert len(model.blocks) == (min(len(uses), config.num_mem_blocks) if tied else len(uses))
    for i, (layer, kind) in enumerate(zip(model.layers, kinds)):
        mamba = layer.mamba_decoder if kind == HYBRID else layer
        assert isinstance(mamba, DecoderLayer) and _children(mamba) == {'mamba', 'input_layernorm'}
        assert mamba.mamba.layer_idx == i
        if kind == HYBRID:
            u = uses.index(i)
            assert _children(layer) == {'linear', 'mamba_decoder'}      # the shared block is not a child
            assert layer.shared_transformer is model.blocks[u % config.num_mem_blocks if tied else u]
            assert (layer.use, layer.kv_idx) == (u, len(kinds) + u)


class _Mixer(nn.Module):
    """A stub token mixer ``tanh(W x)`` that records the extra arguments it was called with."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)
        self.calls = []

    def forward(self, x, *args):
        self.calls.append(args)
        return torch.tanh(self.proj(x))


def _randomize_norms(module: nn.Module, gen: torch.Generator) -> None:
    for norm in module.modules():
        if isinstance(norm, RMSNorm):
            norm.weight.data = torch.rand(norm.weight.shape, generator=gen) + 0.5


def test_olmo_post_norm_layer_equals_the_hand_written_layer():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mixer, mlp = _Mixer(16, 16), SwiGLUMLP(16, 24)
    names = ('self_attn', 'mlp', 'post_attention_layernorm', 'post_feedforward_layernorm')
    layer = OlmoHybridPostNormLayer(16, 1e-6, mixer, mlp, call=lambda m, x, rotary, ctx: m(x, rotary, ctx), names=names)
    _randomize_norms(layer, gen)
    x, rotary, ctx = torch.randn(5, 16, generator=gen), object(), object()
    h = x + layer.post_attention_layernorm(mixer.proj(x).tanh())      # no norm before the mixer
    expected = h + layer.post_feedforward_layernorm(mlp(h))
    assert torch.equal(layer(x, rotary, ctx), expected)
    assert mixer.calls[-1][0] is rotary and mixer.calls[-1][1] is ctx


@pytest.mark.parametrize('rotary', [None, 'tables'])
def test_zamba2_hybrid_layer_equals_the_hand_written_layer(rotary):
    """``y = h + mamba(RMSNorm(h + linear(block(h, e))))``: the block's output enters the mixer's
    input, not the residual; the block gets the layer's use, KV entry, rotary and the embeddings."""
    gen = torch.Generator().manual_seed(1)
    config = _config('zamba2', hidden_size=16, n_mamba_heads=2, mamba_headdim=16, mamba_ngroups=1)
    block, mixer = _Mixer(32, 16), _Mixer(16, 16)
    layer = Zamba2HybridLayer(config, 2, use=1, block_id=1, block=block)
    layer.mamba_decoder.mamba = mixer
    layer.linear.weight.data = torch.randn(16, 16, generator=gen)
    _randomize_norms(layer, gen)
    h, e, ctx = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen), object()
    # the stub block reads [h | e] so a swapped or missing embedding changes the result
    layer.shared_transformer = lambda hidden, embeds, *args: block(torch.cat((hidden, embeds), -1), *args)
    t = layer.linear(block.proj(torch.cat((h, e), -1)).tanh())
    expected = h + mixer.proj(layer.mamba_decoder.input_layernorm(h + t)).tanh()
    assert torch.equal(layer(h, (rotary, e), ctx), expected)
    assert block.calls[-1] == (1, config.num_hidden_layers + 1, rotary, ctx)
    assert mixer.calls[-1] == (ctx,)
