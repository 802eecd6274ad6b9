"""Lara-4-Mini (``transformers`` model type ``lara_mini``): Gated DeltaNet layers mixed with
sliding-window and global attention layers, every layer followed by a sparse MoE with an
ungated shared expert.

``config.layer_types`` picks each layer's token mixer (the released pattern repeats
linear, sliding, linear, full, sliding)::

    h = embed(ids)
    layer i:  h = h + mixer(RMSNorm(h))
              h = h + moe(RMSNorm(h))
      mixer = Gated DeltaNet   ('linear_attention':  Qwen3.5's flat q|k|v, z, b, a projections;
                                                      conv + float32 delta-rule state in a slot)
            | SWA              ('sliding_attention': q/k RMSNorm, RoPE, the last sliding_window
                                                      positions, the query's own included)
            | global attention ('full_attention':    q/k RMSNorm, no positional encoding, every
                                                      earlier position)
      moe   = top-k of softmax(router(h)) in float32 (renormalised when norm_topk_prob) over the
              experts, plus the shared expert added in full (no sigmoid gate, unlike Qwen3-Next)
    logits = lm_head(RMSNorm(h))

Every RMSNorm stores its weight as is (``x̂ * w``, not Qwen3-Next's ``x̂ * (1 + w)``).
Caches: the linear layers a :class:`LinearAttentionSpec` state slot, the sliding layers a
:class:`SlidingWindowSpec`, the global ones a :class:`FullAttentionSpec` (so a prefix keeps
every block: the global layers read all of them).

Weight names: the published checkpoints' (``translated/Lara-4-Mini*``: the four Gated DeltaNet
input projections fused into one ``linear_attn.in_proj`` with rows ``[q|k|v|z|b|a]``, the gated
norm named ``linear_attn.out_norm``) and ``transformers``' in-memory ones (``in_proj_qkv`` /
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``norm``); fused experts
(``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj``) or one tensor per expert.
"""
from __future__ import annotations

import torch
from torch import nn

from ..cache_specs import FullAttentionSpec, LayerCacheSpec, LinearAttentionSpec, SlidingWindowSpec
from ..kernels import get_kernel
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.attention import QKNormAttention
from .blocks.gated_delta_net import MOE, GatedDeltaNet, attention_head_dim, gdn_split, hybrid_layer_kinds
from .blocks.gqa import gqa_split
from .blocks.moe import FusedExperts, load_expert_tensor
from .config_audit import CHECKED, COMMON_FIELDS, GATED_DELTANET_FIELDS, IMPLEMENTED, INERT
from .layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary
from .parallel_plan import Block, ParallelPlan

__all__ = ['LaraMiniForCausalLM', 'check_config', 'layer_windows']

LINEAR, SLIDING, FULL = 'linear_attention', 'sliding_attention', 'full_attention'


def layer_windows(config) -> list[int | None]:
    """Each attention layer's window in tokens (``sliding_window`` for ``'sliding_attention'``,
    None for ``'full_attention'``); 0 for a Gated DeltaNet layer.

    Raises:
        ValueError: ``layer_types`` does not list one of the three kinds per layer, or
            ``sliding_window`` is not an int >= 1 while some layer slides.
    """
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != config.num_hidden_layers or any(t not in (LINEAR, SLIDING, FULL) for t in types):
        raise ValueError(f'layer_types must list {LINEAR!r}, {SLIDING!r} or {FULL!r} for each of the '
                         f'{config.num_hidden_layers} layers, got {types}')
    window = getattr(config, 'sliding_window', None)
    if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f'sliding_window must be an int >= 1 for the sliding_attention layers, got {window!r}')
    return [0 if t == LINEAR else window if t == SLIDING else None for t in types]


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types`` / ``sliding_window`` (:func:`layer_windows`),
            ``linear_num_value_heads`` (a multiple of ``linear_num_key_heads``), ``hidden_act``
            (``'silu'`` only), ``num_experts`` (>= 1), ``num_experts_per_tok``
            (``1..num_experts``); rope fields: see :mod:`.rope`.
    """
    layer_windows(config)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f'linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of '
                         f'linear_num_key_heads ({config.linear_num_key_heads})')
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    E, k = config.num_experts, config.num_experts_per_tok
    if not isinstance(E, int) or E < 1:
        raise ValueError(f'num_experts must be >= 1, got {E!r}')
    if not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f'num_experts_per_tok ({k}) must be in [1, num_experts = {E}]')


class LaraGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3.5's flat projections packed as ``in_proj`` rows
    ``[q all heads | k all heads | v all heads | z | b | a]``: exactly the published fused
    ``linear_attn.in_proj.weight`` ``[2·Hk·dk + 2·Hv·dv + 2·Hv, hidden]``, which loads whole, while
    ``transformers``' ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` fill its rows."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.in_proj = PackedLinear(config.hidden_size, {'in_proj_qkv': self.conv_dim, 'in_proj_z': self.value_dim,
                                                         'in_proj_b': self.num_v_heads,
                                                         'in_proj_a': self.num_v_heads})

    def _split_projections(self, hidden: torch.Tensor):
        """``[T, hidden]`` → mixed q|k|v ``[T, conv_dim]``, z ``[T, Hv, dv]``, b, a ``[T, Hv]``."""
        mixed, z, b, a = self.in_proj.forward_split(hidden)
        return mixed, z.reshape(hidden.shape[0], self.num_v_heads, self.head_v_dim), b, a


class LaraAttention(QKNormAttention):
    """Qwen3's attention (q/k RMSNorm per head, no output gate) over the paged KV cache, with a
    sliding window when ``window`` is set; RoPE only when the forward gets tables (the global
    layers get none).

    Args:
        config: the HF config (this rank's head counts under TP).
        layer_idx: index into ``StepContext.kv_caches``.
        window: keys per query (itself included), None for a global layer.
    """

    def __init__(self, config, layer_idx: int, window: int | None):
        super().__init__(config, layer_idx)
        self.window = window

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)`` or None (no positions);
        writes this layer's K/V into the cache."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = get_kernel('paged_window_attention', q.device)(q, k, v, k_cache, v_cache, ctx, self.scale, self.window,
                                                              None)
        return self.o_proj(out.reshape(T, -1))


class LaraMoE(nn.Module):
    """Top-k softmax-routed experts (router in float32, renormalised when ``norm_topk_prob``) plus
    the shared expert added in full.

    Args:
        config: reads ``hidden_size``, ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``.
    """

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        # the reference routes in float32 whatever the model dtype
        probs = torch.softmax(torch.nn.functional.linear(x.float(), self.gate.weight.float()), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, index, weights.to(x.dtype)) + self.shared_expert(x)


class LaraDecoderLayer(nn.Module):
    """Pre-norm layer: the mixer ``layer_types[layer_idx]`` picks, then the MoE, each with a residual."""

    def __init__(self, config, layer_idx: int, window: int | None):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = LaraGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = LaraAttention(config, layer_idx, window)
        self.mlp = LaraMoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary``: the step's ``(cos, sin)``."""
        normed = self.input_layernorm(hidden)
        if self.layer_type == LINEAR:
            hidden = hidden + self.linear_attn(normed, ctx)
        else:
            # the global layers use no positional encoding
            hidden = hidden + self.self_attn(normed, rotary if self.layer_type == SLIDING else None, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LaraMiniModel(nn.Module):
    """Embedding, decoder layers, final norm; one rotary table (for the sliding layers)."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LaraDecoderLayer(config, i, w) for i, w in enumerate(layer_windows(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat tokens."""
        hidden = self.embed_tokens(ctx.input_ids)
        rotary = self.rotary(ctx.positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rotary, ctx)
        return self.norm(hidden)


_ATTENTION = Block(gqa_split(), 'self_attn')     # the sliding and the global layers alike


class LaraMiniForCausalLM(CausalLM):
    """``lara_mini`` causal LM in the engine's layers.

    Args:
        config: a ``transformers`` ``LaraMiniConfig``.

    Raises:
        ValueError: see :func:`check_config`.
    """
    # the released period-5 pattern (linear, sliding, linear, full, sliding): a 40-token window, off
    # the 16-token blocks and the 32-token prefill chunks, so chunk and block ends fall inside windows;
    # two value heads per key head; MoE with a shared expert
    tiny_config = dict(hidden_size=64, num_hidden_layers=5,
                       layer_types=[LINEAR, SLIDING, LINEAR, FULL, SLIDING], sliding_window=40,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, norm_topk_prob=True, rope_theta=10000.0,
                       max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    # the published experts are fused, as transformers holds them
    tiny_expert_prefixes = ()

    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **GATED_DELTANET_FIELDS,
        'sliding_window': IMPLEMENTED,            # the window of 'sliding_attention' layers
        'num_experts': CHECKED,                   # >= 1
        'num_experts_per_tok': CHECKED,           # in [1, num_experts]
        'moe_intermediate_size': IMPLEMENTED,
        'shared_expert_intermediate_size': IMPLEMENTED,
        'norm_topk_prob': IMPLEMENTED,
        'output_router_logits': INERT,            # the training loss only
        'router_aux_loss_coef': INERT,
    }
    check_config = staticmethod(check_config)
    # attention by head, Gated DeltaNet by key head (the published fused in_proj or transformers' flat
    # in_proj_qkv | z | b | a); the MoE (router, experts, shared expert) replicated
    parallel_plan = ParallelPlan(
        layers=lambda config: hybrid_layer_kinds(config, dense=False),
        blocks={LINEAR: (Block(gdn_split, 'linear_attn'),), SLIDING: (_ATTENTION,), FULL: (_ATTENTION,), MOE: ()})

    model_class = LaraMiniModel

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a :class:`LinearAttentionSpec` (conv ``[conv_dim, kernel-1]`` in ``dtype``,
        float32 recurrent ``[Hv, dk, dv]``), a :class:`SlidingWindowSpec` with ``sliding_window``
        or a :class:`FullAttentionSpec` (KV heads x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
            config.linear_num_value_heads * config.linear_value_head_dim
        linear = LinearAttentionSpec(conv_shape=(conv_dim, config.linear_conv_kernel_dim - 1), conv_dtype=dtype,
                                     recurrent_shape=(config.linear_num_value_heads, config.linear_key_head_dim,
                                                      config.linear_value_head_dim))
        heads, dim = config.num_key_value_heads, attention_head_dim(config)
        return [linear if w == 0 else FullAttentionSpec(heads, dim, dtype) if w is None
                else SlidingWindowSpec(heads, dim, dtype, w) for w in layer_windows(config)]

    def rename_weight(self, name: str) -> str:
        """The published gated-norm name ``linear_attn.out_norm`` → ``linear_attn.norm``."""
        return name.replace('.linear_attn.out_norm.', '.linear_attn.norm.')

    load_tensor = staticmethod(load_expert_tensor)
