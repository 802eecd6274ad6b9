"""The shared decoder layer and stack (models/blocks/decoder.py) in the shapes the state-space and
short-conv families use: a mixer registered as ``mixer`` (Mamba, Nemotron-H), a channel mixer of
two modules (Granite-4.0-H), a SwiGLU under other names or with biases (LFM2, Bamba), a float32
residual stream (Mamba's ``residual_in_fp32``); and every such family built from them. Tiny
modules on CPU, exact comparisons against the same operations written out."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.blocks.decoder import DecoderLayer, DecoderStack
from lmdeploy.pytorch.models.blocks.ssm_lm import ResidualRMSNorm, SSMBlock
from lmdeploy.pytorch.models.layers import RMSNorm, SwiGLUMLP

H = 8


class _CtxLinear(nn.Module):
    """A mixer called as ``mixer(x, ctx)``: one linear map, ``ctx`` unused."""

    def __init__(self, seed: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H, H, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return x @ self.weight.to(x.dtype).T


def _jitter(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    return module


def _x(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(5, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_a_mixer_the_checkpoint_calls_mixer_is_the_layers_mixer():
    # the property is named `mixer` too: reading it through getattr recursed forever
    mixer = _CtxLinear(1)
    layer = _jitter(DecoderLayer(H, 1e-6, mixer, None, names=('mixer', 'mlp', 'norm', 'post_norm')), 2)
    assert layer.mixer is mixer and layer.mlp_block is None and layer.norm_2 is None
    assert sorted(layer.state_dict()) == ['mixer.weight', 'norm.weight']
    x = _x()
    assert torch.equal(layer(x, None, None), x + mixer(layer.norm(x), None))


class _TwoMLPs(DecoderLayer):
    """Granite's shape: a routed and a shared channel mixer summed, a residual multiplier."""

    def __init__(self, m: float):
        super().__init__(H, 1e-6, _CtxLinear(3), SwiGLUMLP(H, 16), residual_multiplier=m,
                         names=('self_attn', 'shared_mlp', 'input_layernorm', 'post_attention_layernorm'))
        self.routed = SwiGLUMLP(H, 12)

    def channel_mix(self, normed: torch.Tensor) -> torch.Tensor:
        return self.routed(normed) + self.shared_mlp(normed)


@pytest.mark.parametrize('m', [1.0, 0.22])
def test_a_layer_that_overrides_channel_mix_keeps_the_residual_wiring(m):
    layer = _jitter(_TwoMLPs(m), 4)
    x = _x(5)
    mixed = layer.self_attn(layer.input_layernorm(x), None)
    h = x + mixed * m if m != 1.0 else x + mixed
    n = layer.post_attention_layernorm(h)
    out = layer.routed(n) + layer.shared_mlp(n)
    assert torch.equal(layer(x, None, None), h + (out * m if m != 1.0 else out))


def test_swiglu_under_other_names_and_with_biases_computes_the_same():
    plain, named = SwiGLUMLP(H, 16, bias=True), SwiGLUMLP(H, 16, bias=True, names=('w1', 'w3', 'w2'))
    _jitter(plain, 6)
    assert sorted(named.state_dict()) == ['gate_up_proj.bias', 'gate_up_proj.weight', 'w2.bias', 'w2.weight']
    assert sorted(plain.state_dict()) == ['down_proj.bias', 'down_proj.weight', 'gate_up_proj.bias',
                                          'gate_up_proj.weight']
    named.load_state_dict({k.replace('down_proj', 'w2'): v for k, v in plain.state_dict().items()})
    x = _x(7)
    assert torch.equal(named(x), plain(x))
    assert sorted(SwiGLUMLP(H, 16).state_dict()) == ['down_proj.weight', 'gate_up_proj.weight']


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_a_float32_residual_stream_is_normed_in_the_weight_dtype(dtype):
    class Cfg:
        hidden_size, layer_norm_epsilon = H, 1e-5

    block = _jitter(SSMBlock(Cfg, _CtxLinear(8)), 9).to(dtype)
    assert isinstance(block.norm, ResidualRMSNorm)
    x = _x(10)          # the float32 residual stream
    mixed = block.mixer(RMSNorm.forward(block.norm, x.to(dtype)), None)
    out = block(x, None, None)
    assert out.dtype == torch.float32 and torch.equal(out, x + mixed)


FAMILIES = ['bamba', 'granitemoehybrid', 'falcon_h1', 'jamba', 'lfm2', 'lfm2_moe', 'nemotron_h', 'mamba',
            'falcon_mamba', 'mamba2']


@pytest.mark.parametrize('arch', FAMILIES)
def test_the_state_space_and_short_conv_families_are_built_from_the_shared_layer_and_stack(arch):
    from lmdeploy.tools.make_tiny_model import build_config

    model = get_model_class(arch)(build_config(arch, 64, 1, 0))
    assert isinstance(model.model, DecoderStack)
    layers = [m for m in model.model.modules() if isinstance(m, DecoderLayer)]
    assert len(layers) == len(model.layer_cache_specs(model.config, torch.float32)) // (2 if arch == 'falcon_h1'
                                                                                          else 1)
    # the module tree has no other decoder-layer class beside them
    assert not [type(m).__name__ for m in model.model.modules()
                if type(m).__name__.endswith(('DecoderLayer', 'Block')) and not isinstance(m, DecoderLayer)]
