"""Full attention over the paged KV cache with per-head q/k RMSNorm and rotary positions
(:class:`QKNormAttention`): the attention layer of Qwen3, and (with ``output_gate`` and
zero-centred norms) of Qwen3-Next and Qwen3.5. Weight names follow the checkpoint: ``q_proj``,
``k_proj``, ``v_proj`` fill the rows of the packed ``qkv_proj``; ``o_proj``; ``q_norm``,
``k_norm``.

A float32 CPU decode step (one new token per sequence) runs the layer as its two products, one
prologue call (q/k norms, rotary, the gate's sigmoid, the K/V store: the registry's CPU
``qk_norm_rope_store``, native when built) and the paged decode attention kernel; every other
step, and every other device, runs the unfused path.
"""
from __future__ import annotations

import torch
from torch import nn

from ...kernels import find_kernel, get_kernel
from ...model_inputs import StepContext
from ..layers import Linear, PackedLinear, RMSNorm, apply_rotary, attention

__all__ = ['QKNormAttention', 'attention_head_dim']


def attention_head_dim(config) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads`` when the config has none."""
    return getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads


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

    def _fused_decode(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      ctx: StepContext) -> torch.Tensor | None:
        """:meth:`forward` of a float32 decode step through the registry's
        ``qk_norm_rope_store``, or ``None`` (another dtype, not one token per sequence, q and k
        norms of different conventions, another cache dtype, or no such kernel for the device)."""
        if not (hidden.dtype == cos.dtype == torch.float32 and hidden.shape[0] == len(ctx.q_seqlens)
                and self.q_norm.zero_centered == self.k_norm.zero_centered and self.q_norm.eps == self.k_norm.eps
                and all(n == 1 for n in ctx.q_seqlens)):
            return None
        prologue = find_kernel('qk_norm_rope_store', hidden.device)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        if prologue is None or k_cache.dtype != torch.float32:
            return None
        blocks, offsets = ctx.kv_write_index
        q, gate = prologue(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim, self.output_gate,
                           self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.zero_centered, cos,
                           sin, k_cache, v_cache, blocks, offsets)
        out = get_kernel('paged_decode_attention', hidden.device)(q, k_cache, v_cache, ctx.block_table,
                                                                  ctx.kv_seqlens_t, self.scale, ctx.kv_gather_index)
        out = out.view(hidden.shape[0], -1)
        return self.o_proj(out if gate is None else out.mul_(gate))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; writes this layer's K/V into the cache."""
        fused = self._fused_decode(hidden, cos, sin, ctx)
        if fused is not None:
            return fused
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
