"""The packed grouped-query projections the hybrids' attention layers share (Bamba, Falcon-H1,
Granite-4.0-H, Granite-MoE-SWA): ``q_proj`` / ``k_proj`` / ``v_proj`` packed into one matmul, and
``o_proj``. A family subclasses :class:`GQAProjections` and keeps its own scale, RoPE and kernel."""
from __future__ import annotations

import torch
from torch import nn

from ..layers import Linear, PackedLinear
from .gated_delta_net import attention_head_dim

__all__ = ['GQAProjections']


class GQAProjections(nn.Module):
    """``qkv_proj`` (packed ``q_proj``, ``k_proj``, ``v_proj``) and ``o_proj``, biases when
    ``attention_bias``.

    Args:
        config: the HF config (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` or none, ``attention_bias``).
        layer_idx: index into ``StepContext.kv_caches``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention_head_dim(config)
        bias = config.attention_bias
        kv = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {'q_proj': self.num_heads * self.head_dim, 'k_proj': kv,
                                                          'v_proj': kv}, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, hidden]`` → ``q [T, num_heads, head_dim]``, ``k`` and ``v [T, num_kv_heads,
        head_dim]`` (before any RoPE)."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        return (q.reshape(T, self.num_heads, self.head_dim), k.reshape(T, self.num_kv_heads, self.head_dim),
                v.reshape(T, self.num_kv_heads, self.head_dim))
