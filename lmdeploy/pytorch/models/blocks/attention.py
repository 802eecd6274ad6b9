"""Full attention over the paged KV cache with per-head q/k RMSNorm and rotary positions
(:class:`QKNormAttention`): the attention layer of Qwen3, and (with ``output_gate`` and
zero-centred norms) of Qwen3-Next and Qwen3.5. Weight names follow the checkpoint: ``q_proj``,
``k_proj``, ``v_proj`` fill the rows of the packed ``qkv_proj``; ``o_proj``; ``q_norm``,
``k_norm``.

A float32 CPU decode step (one new token per sequence) runs the layer as its two products, one
prologue call (q/k norms, rotary, the gate's sigmoid, the K/V store: the registry's CPU
``qk_norm_rope_store``, native when built) and the paged decode attention kernel; every other
step, and every other device, runs the unfused path. :func:`fused_attention_decode` is that
decode step for any grouped-query attention layer, with or without q/k norms and rotary (the
plain GQA layers of the Mamba hybrids take it through their own ``forward``).
"""
from __future__ import annotations

import torch
from torch import nn

from ...kernels import find_kernel, get_kernel
from ...model_inputs import StepContext
from ..layers import Linear, PackedLinear, RMSNorm, apply_rotary, attention

__all__ = ['QKNormAttention', 'attention_head_dim', 'fused_attention_decode']


def attention_head_dim(config) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads`` when the config has none."""
    return getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads


def fused_attention_decode(layer: nn.Module, hidden: torch.Tensor, ctx: StepContext,
                           rotary: tuple[torch.Tensor, torch.Tensor] | None = None, *, q_norm: RMSNorm | None = None,
                           k_norm: RMSNorm | None = None, gated: bool = False,
                           k_scale: float = 1.0) -> torch.Tensor | None:
    """A grouped-query attention layer's float32 decode step (one new token per sequence) from
    its input to its output projection's input: the packed qkv product, one prologue call (q/k
    norms when given, the key scale, rotary, the gate's sigmoid, the K/V store: the registry's
    CPU ``qk_norm_rope_store``, native when built) and the paged decode attention kernel.

    Args:
        layer: the attention module; reads ``qkv_proj`` (packed ``[q | k | v]``, q per head
            ``[q | gate]`` when ``gated``), ``num_heads``, ``num_kv_heads``, ``head_dim``,
            ``layer_idx`` (its ``StepContext.kv_caches`` entry) and ``scale`` (the softmax scale).
        hidden: ``[T, hidden]``.
        ctx: the step.
        rotary: ``(cos, sin)`` ``[T, rot]`` (the two-halves layout, ``rot <= head_dim``), or
            ``None`` (no positional encoding).
        q_norm, k_norm: per-head RMS norms of one convention and epsilon, or both ``None``.
        gated: the output is ``attn * sigmoid(gate)`` (Qwen3-Next).
        k_scale: the keys' multiplier before the rotary (Falcon-H1's ``key_multiplier``).

    Returns:
        float32 ``[T, num_heads * head_dim]`` (the output projection's input), or ``None`` when
        the step is not a float32 decode step, the norms differ in convention, the cache is not
        float32, or the device has no such kernel: the caller runs its unfused path.
    """
    T = hidden.shape[0]
    if not (hidden.dtype == torch.float32 and T == len(ctx.q_seqlens) and all(n == 1 for n in ctx.q_seqlens)
            and (rotary is None or rotary[0].dtype == torch.float32)):
        return None
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and (q_norm.zero_centered != k_norm.zero_centered
                                                                       or q_norm.eps != k_norm.eps)):
        return None
    prologue = find_kernel('qk_norm_rope_store', hidden.device)
    k_cache, v_cache = ctx.kv_caches[layer.layer_idx]
    if prologue is None or k_cache.dtype != torch.float32:
        return None
    if rotary is None:
        none = hidden.new_empty(T, 0)
        rotary = (none, none)
    blocks, offsets = ctx.kv_write_index
    q, gate = prologue(layer.qkv_proj(hidden), layer.num_heads, layer.num_kv_heads, layer.head_dim, gated,
                       None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                       1e-6 if q_norm is None else q_norm.eps, q_norm is not None and q_norm.zero_centered, *rotary,
                       k_cache, v_cache, blocks, offsets, k_scale)
    out = get_kernel('paged_decode_attention', hidden.device)(q, k_cache, v_cache, ctx.block_table, ctx.kv_seqlens_t,
                                                              layer.scale, ctx.kv_gather_index)
    out = out.view(T, -1)
    return out if gate is None else out.mul_(gate)


class QKNormAttention(nn.Module):
    """Self-attention with q/k RMSNorm and rotary embedding over the paged KV cache (GQA):
    Qwen3's attention, and with ``output_gate`` Qwen3-Next's / Qwen3.5's gated attention.

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
        fused = fused_attention_decode(self, hidden, ctx, (cos, sin), q_norm=self.q_norm, k_norm=self.k_norm,
                                       gated=self.output_gate)
        if fused is not None:
            return self.o_proj(fused)
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
