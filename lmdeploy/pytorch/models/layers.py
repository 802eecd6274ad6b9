"""Building blocks shared by the engine's models: norms, rotary embedding, MLP, attention.

All layers take the flat token axis first (``[T, ...]``) as produced by
:class:`~lmdeploy.pytorch.model_inputs.StepContext`; none of them keeps per-request state —
caches live in the cache engine and arrive through the context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import get_kernel
from ..model_inputs import StepContext
from .rope import RotaryEmbedding  # noqa: F401  (re-exported: models import it from here)

__all__ = ['RMSNorm', 'RotaryEmbedding', 'SwiGLUMLP', 'apply_rotary', 'attention']


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), computed in float32.

    Args:
        dim: normalised channels.
        eps: added to the mean square.
        zero_centered: the weight is stored as ``w - 1`` (output ``x̂ * (1 + w)``), the
            Qwen3-Next convention; otherwise ``x̂ * w``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` → ``[..., dim]`` in ``x.dtype``."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` channels of ``x [T, heads, head_dim]``."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer, "GLU Variants Improve Transformer", 2020)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer_idx: int,
              scale: float) -> torch.Tensor:
    """Paged causal attention for layer ``layer_idx`` via the kernel registry.

    Shapes as in :func:`lmdeploy.pytorch.kernels.attention.paged_attention_torch`.
    """
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    return get_kernel('paged_attention', q.device)(q, k, v, k_cache, v_cache, ctx, scale)
