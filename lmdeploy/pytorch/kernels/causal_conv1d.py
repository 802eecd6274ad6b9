"""Depthwise causal 1-D convolution with a carried state: one sequence, or a varlen batch.

Gated DeltaNet layers run a short depthwise convolution (kernel ``K``, typically 4) over the
q/k/v channels before the delta rule (Yang et al., "Gated Delta Networks", 2024, sec. 3.3).
Across forwards the only memory the convolution needs is its last ``K - 1`` inputs::

    inputs   ... x[h-3] x[h-2] x[h-1] | x[h] x[h+1] ...  (this forward)
    state        <---- K - 1 ---->    |
    y[t] = act(bias + sum_j w[:, j] * x[t - (K - 1) + j])

Invariant: the returned state is the last ``K - 1`` inputs seen, zero-filled where the
sequence is shorter than ``K - 1``, so running a sequence in pieces equals one pass.

:func:`causal_conv1d_varlen` runs every sequence of a step in one call. Each sequence's state
rows are placed in front of its new inputs in one row-major buffer, and the convolution runs over
the whole buffer as ``K`` shifted multiply-adds; outputs whose window straddles two sequences
are simply not gathered::

    buffer  | s0 s0 s0 x0 x0 x0 x0 x0 | s1 s1 s1 x1 | s2 s2 s2 x2 x2 |   (K = 4)
    kept    |          y0 y0 y0 y0 y0 |          y1 |          y2 y2 |
    new state of sequence i = the last K - 1 rows of its segment

A pure decode step (one token per sequence) takes a shorter path: ``[N, C, K]`` windows
multiplied by the filters and summed; when the step's slots are one sorted range of the cache
(common: runtime slots are handed out lowest first) the states are read and rewritten
in place as one slice instead of gathered and scattered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel, slot_range
from .cpu_native import conv_decode_step_native

__all__ = ['causal_conv1d', 'causal_conv1d_varlen']


@register_kernel('causal_conv1d', device_type='any')
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  conv_state: torch.Tensor | None = None,
                  activation: str | None = 'silu') -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of ``x`` continuing from ``conv_state``.

    Args:
        x: ``[L, C]`` new inputs (``L >= 1``).
        weight: ``[C, K]`` one filter per channel; the product runs in ``weight.dtype``.
        bias: ``[C]`` or ``None``.
        conv_state: ``[C, K - 1]`` the previous ``K - 1`` inputs (oldest first), or ``None``
            for a sequence with no history (zeros). Read only.
        activation: ``'silu'`` (alias ``'swish'``) or ``None``.

    Returns:
        ``(y [L, C] in x.dtype, new_state [C, K - 1] in x.dtype)``.

    Raises:
        ValueError: inconsistent shapes or an unknown activation.
    """
    if activation not in (None, 'silu', 'swish'):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f'x must be [L, C] and weight [C, K]; got {tuple(x.shape)}, {tuple(weight.shape)}')
    C, K = weight.shape
    if conv_state is None:
        history = x.new_zeros(C, K - 1)
    elif conv_state.shape != (C, K - 1):
        raise ValueError(f'conv_state must be [C, K - 1] = {(C, K - 1)}; got {tuple(conv_state.shape)}')
    else:
        history = conv_state.to(x.dtype)
    window = torch.cat((history, x.t()), dim=1)   # [C, K - 1 + L], the inputs as stored
    y = F.conv1d(window.to(weight.dtype)[None], weight[:, None, :], bias, groups=C)[0]  # [C, L]
    if activation is not None:
        y = F.silu(y)
    new_state = window[:, window.shape[1] - (K - 1):].contiguous()
    return y.t().to(x.dtype), new_state


def _shifted_sum(buf: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out[r] = bias + sum_j weight[:, j] * buf[r + j]`` for ``r < R - (K - 1)``: the depthwise
    convolution of a row-major ``buf [R, C]`` as ``K`` shifted multiply-adds (no transposes; on
    CPU a grouped ``conv1d`` over ``[C, R]`` runs about twice as slow). Returns ``[R - K + 1, C]``
    in ``weight.dtype``."""
    K = weight.shape[1]
    rows = buf.shape[0] - (K - 1)
    # accumulate in float32 and round once, as conv1d does for half types
    acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    taps = weight.t().to(acc)                                                        # [K, C]
    out = buf[:rows].to(acc) * taps[0]
    for j in range(1, K):
        out.addcmul_(buf[j:j + rows].to(acc), taps[j])
    if bias is not None:
        out += bias.to(acc)
    return out.to(weight.dtype)


@register_kernel('causal_conv1d_varlen', device_type='any')
def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_cache: torch.Tensor,
                         cu_seqlens: torch.Tensor, seq_ids: torch.Tensor, slots: torch.Tensor,
                         has_history: torch.Tensor, activation: str | None = 'silu',
                         slot_span=...) -> torch.Tensor:
    """Causal depthwise convolution of a flat batch of sequences, each continuing its state slot.

    Args:
        x: ``[T, C]`` new inputs of all sequences, concatenated (every sequence has >= 1 row).
        weight: ``[C, K]``; the product runs in ``weight.dtype``.
        bias: ``[C]`` or ``None``.
        conv_cache: ``[num_slots, C, K - 1]`` states; rows ``slots`` are read and then
            overwritten in place with each sequence's new state (may be a strided view).
        cu_seqlens: int64 ``[N + 1]``, sequence ``i`` owns rows ``[cu_seqlens[i], cu_seqlens[i + 1])``.
        seq_ids: int64 ``[T]``, the sequence of each row.
        slots: int64 ``[N]`` distinct state slots.
        has_history: bool ``[N]``; False starts that sequence from zeros whatever its slot holds.
        activation: ``'silu'`` (alias ``'swish'``) or ``None``.
        slot_span: :func:`~lmdeploy.pytorch.kernels.slot_range` of ``slots`` when the caller has
            it (``StepContext.slot_span``, shared by all layers of a step); ``...`` computes it.

    Returns:
        ``y [T, C]`` in ``x.dtype``; equal to :func:`causal_conv1d` per sequence.

    Raises:
        ValueError: an unknown activation or inconsistent shapes.
    """
    if activation not in (None, 'silu', 'swish'):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    C, K = weight.shape
    N, T, K1 = slots.shape[0], x.shape[0], K - 1
    if x.dim() != 2 or x.shape[1] != C or conv_cache.shape[1:] != (C, K1) or cu_seqlens.shape != (N + 1,):
        raise ValueError(f'x must be [T, C], conv_cache [S, C, K - 1], cu_seqlens [N + 1]; got x {tuple(x.shape)}, '
                         f'weight {tuple(weight.shape)}, conv_cache {tuple(conv_cache.shape)}, '
                         f'cu_seqlens {tuple(cu_seqlens.shape)}, slots {tuple(slots.shape)}')
    span = None if T != N else slot_range(slots, has_history) if slot_span is ... else slot_span
    if span is not None and span[1] is None:
        # decode with the slots one sorted range: read and rewrite that slice of the cache in place
        lo = span[0]
        rows = conv_cache[lo:lo + N]                                                   # [N, C, K1] view
        y = conv_decode_step_native(x, rows, weight, bias, activation is not None)
        if y is not None:
            return y
        window = torch.cat((rows.to(x.dtype), x[:, :, None]), dim=2)                   # [N, C, K]
        y = (window.to(weight.dtype) * weight).sum(-1)
        if bias is not None:
            y = y + bias
        rows.copy_(window[:, :, 1:])
        if activation is not None:
            y = F.silu(y)
        return y.to(x.dtype)
    state = conv_cache.index_select(0, slots).to(x.dtype)                             # [N, C, K1]
    # masked on every device, without reading has_history on the host (no device sync, and a CPU
    # decode graph can replay the step: engine/decode_graph.py)
    state = torch.where(has_history[:, None, None], state, 0)
    if T == N:   # decode: one row per sequence
        window = torch.cat((state, x[:, :, None]), dim=2)                              # [N, C, K]
        y = (window.to(weight.dtype) * weight).sum(-1)
        if bias is not None:
            y = y + bias
        conv_cache.index_copy_(0, slots, window[:, :, 1:].to(conv_cache.dtype))
    else:
        if N == 1:   # one sequence: its state rows, then its inputs
            buf = torch.cat((state[0].t(), x))                                     # [K1 + T, C]
        else:
            seq_base = torch.arange(N, device=x.device) * K1
            x_rows = torch.arange(T, device=x.device) + (seq_ids + 1) * K1     # row of x[t] in the buffer
            state_rows = (cu_seqlens[:-1] + seq_base)[:, None] + torch.arange(K1, device=x.device)
            buf = x.new_empty(T + N * K1, C)
            buf.index_copy_(0, x_rows, x)
            buf.index_copy_(0, state_rows.flatten(), state.transpose(1, 2).reshape(N * K1, C))
        full = _shifted_sum(buf.to(weight.dtype), weight, bias)                    # [T + (N-1) K1, C]
        y = full if N == 1 else full.index_select(0, x_rows - K1)
        end_rows = (cu_seqlens[1:] + (torch.arange(N, device=x.device) + 1) * K1)[:, None] - K1 \
            + torch.arange(K1, device=x.device)
        conv_cache.index_copy_(0, slots, buf.index_select(0, end_rows.flatten()).view(N, K1, C).transpose(1, 2)
                               .to(conv_cache.dtype))
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)
