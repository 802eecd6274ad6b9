"""Qwen3 (``transformers`` model type ``qwen3``): a full-attention decoder.

Per layer: RMSNorm → attention (per-head RMSNorm on q and k, rotary embedding, GQA over the
paged KV cache) → residual → RMSNorm → SwiGLU MLP → residual. Weight names follow the
Hugging Face checkpoint, except that q/k/v and gate/up run as packed projections
(``qkv_proj``, ``gate_up_proj``) which the weight loader fills from the separate tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from ..model_inputs import StepContext
from .config_audit import CHECKED, COMMON_FIELDS
from .base import CausalLM
from .layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary, attention
from .parallel_plan import ParallelPlan

__all__ = ['Qwen3ForCausalLM', 'Qwen3Attention']


class Qwen3Attention(nn.Module):
    """Self-attention with q/k RMSNorm and rotary embedding over the paged KV cache.

    Args:
        config: HF config (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``rms_norm_eps``, ``attention_bias``).
        layer_idx: index into ``StepContext.kv_caches``.
        output_gate: Qwen3-Next's gated attention: ``q_proj`` also emits a per-channel gate and
            the output is ``attn * sigmoid(gate)``.
        zero_centered_norm: q/k norms store ``w - 1`` (Qwen3-Next).
    """

    def __init__(self, config, layer_idx: int, output_gate: bool = False, zero_centered_norm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, 'head_dim', None) or config.hidden_size // self.num_heads
        self.output_gate = output_gate
        bias = getattr(config, 'attention_bias', False)
        q_out = self.num_heads * self.head_dim * (2 if output_gate else 1)
        kv_out = self.num_kv_heads * self.head_dim
        # one matmul for q, k and v; the checkpoint's q_proj / k_proj / v_proj fill its rows
        self.qkv_proj = PackedLinear(config.hidden_size, {'q_proj': q_out, 'k_proj': kv_out, 'v_proj': kv_out},
                                     bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered_norm)
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; writes this layer's K/V into the cache."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        gate = None
        if self.output_gate:
            q, gate = q.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(q, k, v, ctx, self.layer_idx, self.scale).reshape(T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention and SwiGLU MLP, each with a residual."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, ctx):
        """``[T, hidden]`` → ``[T, hidden]`` (pre-norm attention and MLP, each with a residual);
        ``cos``/``sin``: rotary tables ``[T, rotary_dim]``; the layer's KV goes to ``ctx``'s cache."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's ``T`` flat tokens (``ctx.input_ids``)."""
        hidden = self.embed_tokens(ctx.input_ids)
        cos, sin = self.rotary(ctx.positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, ctx)
        return self.norm(hidden)


def check_config(config) -> None:
    """Reject a Qwen3 config this implementation cannot run exactly.

    Raises:
        ValueError: ``hidden_act`` other than ``'silu'``, or ``layer_types`` other than
            ``'full_attention'`` for every layer (sliding-window attention is not supported).
    """
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    types = list(getattr(config, 'layer_types', None) or ['full_attention'] * config.num_hidden_layers)
    bad = sorted({t for t in types if t != 'full_attention'})
    if bad or len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must be 'full_attention' for all {config.num_hidden_layers} layers, "
                         f'got {bad or types} (use_sliding_window={getattr(config, "use_sliding_window", None)}, '
                         f'sliding_window={getattr(config, "sliding_window", None)}, max_window_layers='
                         f'{getattr(config, "max_window_layers", None)}); sliding-window attention is not '
                         'supported')


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 causal LM in the engine's layers; weights: ``q/k/v_proj`` and ``gate/up_proj`` load
    into their packed rows, ``lm_head`` is tied when the config says so.

    Args:
        config: a ``transformers`` ``Qwen3Config``.

    Raises:
        ValueError: see :func:`check_config`.
    """
    model_class = Qwen3Model
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'sliding_window': CHECKED,            # read for 'sliding_attention' layers, which are refused
    }
    check_config = staticmethod(check_config)
    parallel_plan = ParallelPlan()        # heads, dense MLP and vocabulary split (Megatron-LM)

    @staticmethod
    def cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """One :class:`FullAttentionSpec` per layer."""
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        return [FullAttentionSpec(config.num_key_value_heads, head_dim, dtype)] * config.num_hidden_layers
