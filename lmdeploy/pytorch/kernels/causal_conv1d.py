"""Depthwise causal 1-D convolution with a carried state, for one sequence.

Gated DeltaNet layers run a short depthwise convolution (kernel ``K``, typically 4) over the
q/k/v channels before the delta rule (Yang et al., "Gated Delta Networks", 2024, sec. 3.3).
Across forwards the only memory the convolution needs is its last ``K - 1`` inputs::

    inputs   ... x[h-3] x[h-2] x[h-1] | x[h] x[h+1] ...  (this forward)
    state        <---- K - 1 ---->    |
    y[t] = act(bias + sum_j w[:, j] * x[t - (K - 1) + j])

Invariant: the returned state is the last ``K - 1`` inputs seen, zero-filled where the
sequence is shorter than ``K - 1``, so running a sequence in pieces equals one pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel

__all__ = ['causal_conv1d']


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
