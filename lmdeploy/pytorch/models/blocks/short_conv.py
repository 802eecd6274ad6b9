"""LFM2's gated short convolution (Liquid AI; ``lfm2``, ``lfm2_moe`` and ``lfm3`` layers of type
``'conv'``) and its per-sequence state::

    B, C, x = in_proj(h)            (three row blocks of ``channels`` each)
    y = C * conv(B * x)             (depthwise, causal, width ``conv_L_cache``, no activation)
    out = out_proj(y)
    state: the last ``conv_L_cache - 1`` conv inputs ``B * x``, ``[channels, conv_L_cache - 1]``

The state is the layer's whole memory (no recurrence), one tensor per sequence, split by channel
under tensor parallelism (:func:`short_conv_split`; ``CacheTensor.tp_split`` :data:`CONV_SPLIT`).
"""
from __future__ import annotations

import torch
from torch import nn

from ...cache_specs import CacheTensor, StateSpec
from ...kernels import get_kernel
from ...model_inputs import StepContext
from ..layers import Linear
from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows

__all__ = ['CONV_SPLIT', 'ShortConv', 'short_conv_split', 'short_conv_state_spec']

CONV_SPLIT = 'short_conv_channels'      # CacheTensor.tp_split of the conv state: the rank's channels


def short_conv_state_spec(channels: int, kernel: int, dtype: torch.dtype) -> StateSpec:
    """A short-conv layer's per-sequence state: one tensor, ``conv [channels, kernel - 1]`` in
    ``dtype`` (the last ``kernel - 1`` conv inputs), split by channel under tensor parallelism.
    No recurrent tensor: the conv window is the layer's whole memory."""
    return StateSpec((CacheTensor('conv', (channels, kernel - 1), dtype, CONV_SPLIT, 0),))


def short_conv_split(config, size: int) -> BlockSplit:
    """The tensor-parallel split of a short-conv layer (a split factory): by channel (axis
    ``short_conv_channels`` of ``hidden_size`` channels): the rank's channel range of each of
    ``in_proj``'s ``B``, ``C`` and ``x`` row blocks (three pieces, biases too), those ``conv``
    filters, ``out_proj`` columns (row-parallel, its bias whole); its conv state
    (:data:`CONV_SPLIT`) holds those channels. The local config sets ``conv_channels`` to the
    rank's channel count (the layer's ``channels``; absent at tp=1: ``hidden_size``)."""
    H, c = config.hidden_size, Piece('short_conv_channels')
    return BlockSplit((Axis('short_conv_channels', H, 'hidden_size', 'conv_channels'),),
                      (rows('in_proj', c, Piece(c.axis, 1, H), Piece(c.axis, 1, 2 * H)), rows('conv', c),
                       cols('out_proj.weight', c)),
                      row_parallel=('out_proj',), caches=((CONV_SPLIT, (c,)),))


class ShortConv(nn.Module):
    """LFM2's gated short convolution: ``B, C, x = in_proj(h)``, ``y = C * conv(B * x)``,
    ``out_proj(y)``; the conv is depthwise, causal, without activation, continuing each
    sequence's state slot (the registry's ``causal_conv1d_varlen``: torch anywhere, the native
    decode step on CPU).

    Args:
        hidden_size: input and output width.
        channels: conv channels on this rank (``hidden_size`` at tp=1).
        kernel: ``conv_L_cache``.
        bias: ``conv_bias`` (in_proj, conv and out_proj all take it).
        layer_idx: index into ``StepContext.state_caches`` (``(conv,)``).
    """

    def __init__(self, hidden_size: int, channels: int, kernel: int, bias: bool, layer_idx: int):
        super().__init__()
        self.layer_idx, self.channels = layer_idx, channels
        self.in_proj = Linear(hidden_size, 3 * channels, bias=bias)
        # weight holder [channels, 1, K] (the checkpoint shape); the conv kernel runs it
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)
        self.out_proj = Linear(channels, hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's conv state."""
        b, c, x = self.in_proj(hidden).split(self.channels, dim=-1)
        (conv_cache,) = ctx.state_caches[self.layer_idx]
        y = get_kernel('causal_conv1d_varlen', hidden.device)(
            b * x, self.conv.weight.squeeze(1), self.conv.bias, conv_cache, ctx.cu_seqlens, ctx.seq_ids, ctx.slots,
            ctx.has_history, None, slot_span=ctx.slot_span)
        return self.out_proj(c * y)
