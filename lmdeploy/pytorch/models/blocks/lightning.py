"""MiniMax's lightning attention layer (MiniMax-01, 2025): linear attention whose state decays by
one fixed factor per head and layer, and its per-sequence state.

Per layer and sequence the state slot holds one tensor::

    recurrent  [H, d, d]  (float32)   S_t = exp(-s_h) S_{t-1} + k_t^T v_t

No convolution precedes it, so that is the whole state. The decay rates are not weights: head
``h`` (0-based) of layer ``l`` out of ``L`` layers has ``s = 2^(-8/H)^(h+1) * (1 - l / (L - 1 +
1e-5) + 1e-5)``, computed in float32 exactly as ``transformers`` does. The recurrence is the
registry's ``lightning_attention_varlen`` (:mod:`lmdeploy.pytorch.kernels.lightning_attention`).

Under tensor parallelism (:func:`lightning_split`) a rank holds a range of heads (the state
splits as ``'v_heads'``): the split's collective gives each layer its heads' decay rates of the
full model, and the output norm, which spans every head, sums its squares over the ranks
(:class:`CrossRankRMSNorm`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...cache_specs import CacheTensor, StateSpec
from ...kernels import get_kernel
from ...model_inputs import StepContext
from ..layers import Linear, RMSNorm
from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows
from .gated_delta_net import attention_head_dim

__all__ = ['LightningAttention', 'CrossRankRMSNorm', 'lightning_split', 'lightning_state_spec', 'lightning_slopes']

# tokens per chunk of the torch chunked form (the result does not depend on it beyond rounding)
CHUNK_SIZE = 64


def lightning_state_spec(config) -> StateSpec:
    """The state of one lightning-attention layer: ``recurrent [H, d, d]`` float32
    (``H = num_attention_heads``, ``d`` the head size), whatever the model dtype; split by head
    under tensor parallelism (``tp_split='v_heads'``)."""
    H, d = config.num_attention_heads, attention_head_dim(config)
    return StateSpec((CacheTensor('recurrent', (H, d, d), torch.float32, 'v_heads'),))


class CrossRankRMSNorm:
    """The output RMS norm for a rank that holds ``D_local`` of the ``D`` normalised channels:
    each rank's sum of squares ``[T]`` (float32) is summed over the ranks (one all-reduce of
    ``T`` floats), then ``weight * x * rsqrt(sum / D + eps)``.

    Args:
        all_reduce: sums a tensor over all ranks in place and returns it.
        dim: ``D``, the channels of the whole norm.
    """

    def __init__(self, all_reduce, dim: int):
        self.all_reduce, self.dim = all_reduce, dim

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x [T, D_local]``, ``weight [D_local]`` → ``[T, D_local]`` in ``x.dtype``."""
        h = x.float()
        sums = self.all_reduce(h.pow(2).sum(-1, keepdim=True))
        return weight * (h * torch.rsqrt(sums / self.dim + eps)).to(x.dtype)


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """The decay rates ``s [num_heads]`` float32 of layer ``layer_idx`` (see the module docstring)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (torch.arange(num_heads) + 1)) * factor


class LightningAttention(nn.Module):
    """``out_proj(sigmoid(output_gate(h)) * norm(lightning(q, k, v)))`` with
    ``q | k | v = silu(qkv_proj(h))`` split per head (``[H, 3d]``: each head's q, k, v side by
    side) and ``norm`` an RMS norm over all heads (eps 1e-6, transformers' default).

    Args:
        config: HF ``MiniMaxConfig`` (``hidden_size``, ``num_attention_heads``, ``head_dim`` or
            none, ``num_hidden_layers``).
        layer_idx: the layer's index (its decay rates) and its index into
            ``StepContext.state_caches`` (``(recurrent,)``).

    Attributes:
        slopes: the decay rates ``[H]`` float32 of the layer's heads (CPU).
        cross_rank_norm: None, or the :class:`CrossRankRMSNorm` a tensor-parallel plan attaches
            (:meth:`hold_heads`).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_attention_heads, attention_head_dim(config)
        D = self.num_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, 3 * D, bias=False)
        self.output_gate = Linear(config.hidden_size, D, bias=False)
        self.norm = RMSNorm(D, 1e-6)
        self.out_proj = Linear(D, config.hidden_size, bias=False)
        # a plain CPU attribute, not a buffer: real values even when the model is built on the
        # meta device (neither ``to_empty`` nor a dtype cast touches it)
        self.num_layers = config.num_hidden_layers
        with torch.device('cpu'):
            self.slopes = lightning_slopes(self.num_heads, layer_idx, self.num_layers)
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self.cross_rank_norm = None

    def hold_heads(self, first: int, total: int, all_reduce) -> None:
        """Make this layer heads ``[first, first + H)`` of a full layer of ``total`` heads: their
        decay rates (a function of the head's index among all heads) and the output norm summed
        over the ranks (``all_reduce`` sums a tensor over them)."""
        with torch.device('cpu'):
            self.slopes = lightning_slopes(total, self.layer_idx, self.num_layers)[first:first + self.num_heads]
        self._on_device.clear()
        self.cross_rank_norm = CrossRankRMSNorm(all_reduce, total * self.head_dim)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        T, H, d = hidden.shape[0], self.num_heads, self.head_dim
        slopes = self._on_device.get(hidden.device)
        if slopes is None:
            slopes = self._on_device[hidden.device] = self.slopes.to(hidden.device)
        q, k, v = F.silu(self.qkv_proj(hidden)).view(T, H, 3 * d).split(d, dim=-1)
        (state,) = ctx.state_caches[self.layer_idx]
        o = get_kernel('lightning_attention_varlen', hidden.device)(q, k, v, slopes, state, ctx.cu_seqlens, ctx.slots,
                                                                    ctx.has_history, CHUNK_SIZE)
        o = o.reshape(T, H * d).to(hidden.dtype)
        o = self.norm(o) if self.cross_rank_norm is None else self.cross_rank_norm(o, self.norm.weight, self.norm.eps)
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * o)


def lightning_split(config, size: int) -> BlockSplit:
    """The tensor-parallel split of a lightning-attention layer by head (a split factory).

    Axis ``q_heads`` (``num_attention_heads``, set to the rank's count in the local config, with
    ``head_dim`` explicit); ``qkv_proj`` rows ``[h, 3d]`` of the rank's heads, ``output_gate``
    rows and the output norm's weight of its heads' channels, ``out_proj`` columns
    (row-parallel); the state by head (``'v_heads'``). Its collective gives each layer the full
    model's decay rates of its heads and the norm summed over the ranks
    (:meth:`LightningAttention.hold_heads`).
    """
    total, d = config.num_attention_heads, attention_head_dim(config)

    def collective(module, part, all_reduce) -> None:
        module.hold_heads(part('q_heads')[0], total, all_reduce)

    h = Piece('q_heads', d)
    return BlockSplit((Axis('q_heads', total, 'num_attention_heads', 'num_attention_heads'),),
                      (rows('qkv_proj.weight', Piece('q_heads', 3 * d)), rows(('output_gate.weight', 'norm.weight'), h),
                       cols('out_proj.weight', h)),
                      row_parallel=('out_proj',), caches=(('v_heads', (Piece('q_heads'),)),),
                      config=(('head_dim', d),), collective=collective)
