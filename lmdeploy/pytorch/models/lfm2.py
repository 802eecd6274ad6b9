"""Liquid LFM2 (``lfm2``) and LFM2-MoE (``lfm2_moe``): gated short-convolution layers mixed with
grouped-query attention layers, each followed by a SwiGLU MLP (LFM2) or, past the first
``num_dense_layers``, a sigmoid-routed MoE (LFM2-MoE).

``config.layer_types`` picks each layer's token mixer (``'conv'`` / ``'full_attention'``)::

    h = embed(ids)
    layer i:  h = h + mixer(RMSNorm(h))
              h = h + ffn(RMSNorm(h))
      mixer = short conv ('conv':           B, C, x = in_proj(h); y = C * conv(B * x); out_proj(y),
                                            a depthwise causal conv of width conv_L_cache, no
                                            activation; its state is the last conv_L_cache - 1
                                            inputs B * x: one tensor per sequence, no recurrence)
            | GQA        ('full_attention': per-head RMSNorm on q and k, RoPE, K/V in paged blocks)
      ffn   = SwiGLU w2(silu(w1 h) * w3 h)  (LFM2: width from block_auto_adjust_ff_dim, see ffn_size)
            | MoE  (LFM2-MoE layers >= num_dense_layers: s = sigmoid(gate h); the top k of
                    s + expert_bias chosen, weighted by s, renormalised when norm_topk_prob,
                    times routed_scaling_factor)
    logits = lm_head(RMSNorm(h))       (the final norm is named embedding_norm)

Weight names are the published checkpoints' (``LiquidAI/LFM2-*``: ``conv.in_proj`` /
``conv.conv`` / ``conv.out_proj``, ``self_attn.out_proj`` / ``q_layernorm`` / ``k_layernorm``,
``feed_forward.w1`` / ``w3`` / ``w2``; LFM2-MoE experts one tensor each,
``feed_forward.experts.{e}.w1`` / ``w3`` / ``w2``, the router ``feed_forward.gate`` and
``feed_forward.expert_bias``) and transformers' in-memory fused experts
(``feed_forward.experts.gate_up_proj`` / ``down_proj``). The engine names the feed-forward
``mlp`` (so the per-expert loader of :mod:`.qwen3_next` fills the fused experts).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.attention import fused_attention_decode
from .blocks.decoder import DecoderLayer, DecoderStack, mixer_ctx, mixer_rotary_ctx
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import gqa_split
from .blocks.moe import W123_EXPERT_RENAMES, FusedExperts, load_expert_tensor
from .blocks.short_conv import CONV_SPLIT, ShortConv, short_conv_split, short_conv_state_spec
from .config_audit import CHECKED, IMPLEMENTED, INERT
from .layers import (Linear, PackedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_renames, apply_rotary,
                     attention, mlp_split)
from .parallel_plan import Block, ParallelPlan

__all__ = ['Lfm2ForCausalLM', 'Lfm2MoeForCausalLM', 'ShortConv', 'short_conv_state_spec', 'ffn_size', 'check_config']

CONV, ATTENTION = 'conv', 'full_attention'


def layer_kinds(config) -> list[str]:
    """Each layer's mixer, ``'conv'`` or ``'full_attention'``.

    Raises:
        ValueError: ``layer_types`` is not one of those per layer.
    """
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != config.num_hidden_layers or any(t not in (CONV, ATTENTION) for t in types):
        raise ValueError(f"layer_types must list 'conv' or 'full_attention' for each of the "
                         f'{config.num_hidden_layers} layers, got {types}')
    return types


def ffn_size(config) -> int:
    """Intermediate width of a dense SwiGLU layer: LFM2's ``intermediate_size`` adjusted as
    transformers' ``Lfm2MLP`` does when ``block_auto_adjust_ff_dim`` (2/3 of it, times
    ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``); LFM2-MoE's as is."""
    size = config.intermediate_size
    if getattr(config, 'block_auto_adjust_ff_dim', False):
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            m = config.block_multiple_of
            size = int(config.block_ffn_dim_multiplier * size)
            size = m * ((size + m - 1) // m)
    return size


def _is_moe(config, layer_idx: int) -> bool:
    return config.model_type == 'lfm2_moe' and layer_idx >= config.num_dense_layers


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types``, ``conv_L_cache`` (at least 2: a width-1
            conv keeps no state, which transformers' cache cannot run either),
            ``num_key_value_heads`` (must divide ``num_attention_heads``), LFM2-MoE's
            ``num_experts_per_tok`` (``1..num_experts``); the rope parameters (:mod:`.rope`) when
            there is an attention layer.
    """
    kinds = layer_kinds(config)
    if config.conv_L_cache < 2:
        raise ValueError(f'conv_L_cache must be at least 2, got {config.conv_L_cache}')
    if ATTENTION in kinds:
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f'num_key_value_heads ({config.num_key_value_heads}) must divide num_attention_heads '
                             f'({config.num_attention_heads})')
        RotaryEmbedding(config)            # raises for rope parameters it cannot reproduce
    if config.model_type == 'lfm2_moe' and config.num_dense_layers < config.num_hidden_layers:
        E, k = config.num_experts, config.num_experts_per_tok
        if not 1 <= k <= E:
            raise ValueError(f'num_experts_per_tok ({k}) must be in [1, num_experts = {E}]')


class Lfm2Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (``q_layernorm`` /
    ``k_layernorm``, eps ``norm_eps``) and rotary embedding over the paged KV cache."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention_head_dim(config)
        kv = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {'q_proj': self.num_heads * self.head_dim, 'k_proj': kv,
                                                          'v_proj': kv})
        self.out_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)``; writes this layer's K/V."""
        fused = fused_attention_decode(self, hidden, ctx, rotary, q_norm=self.q_layernorm, k_norm=self.k_layernorm)
        if fused is not None:
            return self.out_proj(fused)
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        q = self.q_layernorm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_layernorm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return self.out_proj(attention(q, k, v, ctx, self.layer_idx, self.scale).reshape(T, -1))


class Lfm2MoE(nn.Module):
    """LFM2-MoE's sigmoid-routed experts: ``s = sigmoid(gate(x))`` in float32, the top ``k`` of
    ``s + expert_bias`` (``use_expert_bias``; else of ``s``) chosen and weighted by ``s``,
    divided by their sum + 1e-6 when ``norm_topk_prob``, times ``routed_scaling_factor``;
    SwiGLU experts, gate rows first."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.scale = float(config.routed_scaling_factor)
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.expert_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False) \
            if config.use_expert_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        scores = torch.sigmoid(self.gate(x).float())
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        index = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return self.experts(x, index, (weights * self.scale).to(x.dtype))


def _short_conv(config, layer_idx: int) -> ShortConv:
    # a rank's channels under tensor parallelism (short_conv_split's local config), else all of them
    channels = getattr(config, 'conv_channels', config.hidden_size)
    return ShortConv(config.hidden_size, channels, config.conv_L_cache, bool(config.conv_bias), layer_idx)


#: each layer kind's token mixer: (attribute name, factory (config, layer_idx) -> module, call)
MIXERS = {CONV: ('conv', _short_conv, mixer_ctx), ATTENTION: ('self_attn', Lfm2Attention, mixer_rotary_ctx)}


class Lfm2DecoderLayer(DecoderLayer):
    """Pre-norm layer: short conv or attention (:data:`MIXERS`), then the dense SwiGLU or the MoE
    (the checkpoint's ``feed_forward``, the engine's ``mlp``), norms ``operator_norm`` /
    ``ffn_norm`` with eps ``norm_eps``."""

    def __init__(self, config, layer_idx: int, kind: str):
        name, make, call = MIXERS[kind]
        mlp = Lfm2MoE(config) if _is_moe(config, layer_idx) else \
            SwiGLUMLP(config.hidden_size, ffn_size(config), names=('w1', 'w3', 'w2'))
        super().__init__(config.hidden_size, config.norm_eps, make(config, layer_idx), mlp, call=call,
                         names=(name, 'mlp', 'operator_norm', 'ffn_norm'))


class Lfm2Model(DecoderStack):
    """Embedding, decoder layers, the final norm (``embedding_norm``); rotary tables only when
    some layer attends."""

    def __init__(self, config):
        kinds = layer_kinds(config)
        super().__init__(config, (Lfm2DecoderLayer(config, i, kind) for i, kind in enumerate(kinds)),
                         rotary=RotaryEmbedding(config) if ATTENTION in kinds else None,
                         norm=RMSNorm(config.hidden_size, config.norm_eps),
                         names=('embed_tokens', 'layers', 'embedding_norm'))


# checkpoint -> the engine's module names
_RENAMES = [(re.compile(r'\.feed_forward\.'), '.mlp.'), *W123_EXPERT_RENAMES]


class Lfm2ForCausalLM(CausalLM):
    """LFM2 causal LM in the engine's layers; ``config`` a ``transformers``
    ``Lfm2Config``, refused (ValueError) as :func:`check_config` says."""
    # short conv, short conv, attention, short conv; block_ff_dim 192 auto-adjusted to 2/3, rounded up to
    # 32: a 128-wide MLP
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       conv_L_cache=3, conv_bias=False, max_position_embeddings=32768, tie_word_embeddings=False,
                       norm_eps=1e-5, rope_parameters=dict(rope_type='default', rope_theta=10000.0),
                       layer_types=['conv', 'conv', 'full_attention', 'conv'], intermediate_size=192,
                       block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=32)
    tiny_top_level_rope_theta = True
    # the published spellings; transformers reads them as intermediate_size / tie_word_embeddings
    tiny_published_fields = {'intermediate_size': 'block_ff_dim', 'tie_word_embeddings': 'tie_embedding'}


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        'vocab_size': IMPLEMENTED,
        'hidden_size': IMPLEMENTED,
        'intermediate_size': IMPLEMENTED,         # block_ff_dim in the published config.json
        'num_hidden_layers': IMPLEMENTED,
        'num_attention_heads': IMPLEMENTED,
        'num_key_value_heads': CHECKED,           # divides num_attention_heads
        'head_dim': IMPLEMENTED,
        'norm_eps': IMPLEMENTED,
        'tie_word_embeddings': IMPLEMENTED,       # tie_embedding in the published config.json
        'dtype': IMPLEMENTED,
        'max_position_embeddings': IMPLEMENTED,   # an input of the rope scaling functions
        'rope_parameters': CHECKED,               # see .rope
        'layer_types': CHECKED,                   # 'conv' / 'full_attention'
        'full_attn_idxs': IMPLEMENTED,            # transformers derives layer_types from it when absent
        'conv_L_cache': CHECKED,                  # the conv width, at least 2
        'conv_bias': IMPLEMENTED,
        'block_auto_adjust_ff_dim': IMPLEMENTED,  # ffn_size
        'block_ffn_dim_multiplier': IMPLEMENTED,
        'block_multiple_of': IMPLEMENTED,
        'quantization_config': CHECKED,           # FP8 block-wise only (.quantization)
        'pad_token_id': INERT,                    # padding_idx only masks the embedding's gradient
        '_attn_implementation': INERT,
        'initializer_range': INERT,
        'use_cache': INERT,
    }
    check_config = staticmethod(check_config)
    rotary_class = None       # check_config builds the rotary table itself, only with attention layers
    # attention by head, short conv by channel, dense MLPs by rows (checkpoint feed_forward or mlp, w1 / w3
    # rows, w2 columns; the width auto-adjusted before the split); LFM2-MoE's experts and router replicated
    parallel_plan = ParallelPlan(
        layers=lambda config: [(kind, 'moe' if _is_moe(config, i) else 'dense')
                               for i, kind in enumerate(layer_kinds(config))],
        blocks={ATTENTION: (Block(gqa_split(shared_kv=False, o='out_proj'), 'self_attn'),),
                CONV: (Block(short_conv_split, 'conv'),),
                'dense': (Block(mlp_split(up=('w1', 'w3'), down='w2', width=ffn_size,
                                          config=(('block_auto_adjust_ff_dim', False),)),
                                ('feed_forward', 'mlp'), module='mlp'),),
                'moe': ()})

    model_class = Lfm2Model

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: the short-conv state (:func:`short_conv_state_spec`: ``[channels,
        conv_L_cache - 1]`` in ``dtype``, nothing else) or a :class:`FullAttentionSpec` (KV heads
        x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        conv = short_conv_state_spec(getattr(config, 'conv_channels', config.hidden_size), config.conv_L_cache, dtype)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [conv if kind == CONV else full for kind in layer_kinds(config)]

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return apply_renames(name, _RENAMES)

    load_tensor = staticmethod(load_expert_tensor)      # experts per expert or fused


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE causal LM: LFM2 with the MoE in layers ``>= num_dense_layers``; ``config`` a
    ``transformers`` ``Lfm2MoeConfig``, refused (ValueError) as :func:`check_config` says."""
    # LFM2's, but short conv, attention, short conv, short conv and a plain 128-wide dense MLP; one dense
    # layer, then sigmoid-routed MoE with a nonzero expert bias and a scaling off 1
    tiny_config = dict({k: v for k, v in Lfm2ForCausalLM.tiny_config.items() if not k.startswith('block_')},
                       layer_types=['conv', 'full_attention', 'conv', 'conv'], intermediate_size=128,
                       num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       use_expert_bias=True, routed_scaling_factor=1.5, norm_topk_prob=True)
    tiny_top_level_rope_theta = True
    tiny_published_fields = {}


    config_fields = {
        **{k: v for k, v in Lfm2ForCausalLM.config_fields.items() if not k.startswith(('block_', 'full_attn'))},
        'intermediate_size': IMPLEMENTED,         # the dense layers' width
        'num_dense_layers': IMPLEMENTED,
        'num_experts': IMPLEMENTED,
        'num_experts_per_tok': CHECKED,           # in [1, num_experts]
        'moe_intermediate_size': IMPLEMENTED,
        'use_expert_bias': IMPLEMENTED,
        'routed_scaling_factor': IMPLEMENTED,
        'norm_topk_prob': IMPLEMENTED,
        'output_router_logits': INERT,            # the training loss only
    }
