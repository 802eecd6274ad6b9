"""RMS norms that span every head of an attention layer (OLMo Hybrid's q / k norms: one norm
over all query channels and one over all key channels, not one per head) under tensor
parallelism.

A rank holds the channels of its own heads only, so the mean square needs the other ranks'
channels. Each rank sums its channels' squares per token and one all-reduce adds the ranks'
sums (the mechanism of MiniMax's lightning output norm, :class:`~.lightning.CrossRankRMSNorm`,
reused here); every rank then scales its own channels::

    rank r:   s_r[t] = sum over its channels c of x[t, c]^2          (float32, [T])
    all:      s[t]   = s_0[t] + ... + s_{N-1}[t]                       (one all-reduce of T floats)
    rank r:   y[t, c] = w[c] * x[t, c] * rsqrt(s[t] / D + eps)          D = the whole norm's channels

That is one all-reduce for q and one for k per attention layer. A copied KV head (fewer KV
heads than ranks) would count twice in the key norm's sum, so :func:`spanning_qk_norm_split`
refuses it naming ``num_key_value_heads``.
"""
from __future__ import annotations

import dataclasses

import torch

from ..layers import RMSNorm
from ..parallel_plan import BlockSplit, Piece, rows
from .attention import attention_head_dim
from .lightning import CrossRankRMSNorm

__all__ = ['SummedRMSNorm', 'spanning_qk_norm_split']


class SummedRMSNorm(RMSNorm):
    """:class:`~..layers.RMSNorm` over ``dim`` of a norm's ``total`` channels, the rest held by
    other ranks: the per-token sum of squares is summed over the ranks before it divides.

    Args:
        dim: this rank's channels (its ``weight`` rows).
        total: the whole norm's channels (the divisor of the mean square).
        eps: added to the mean square.
        all_reduce: sums a tensor over all ranks in place and returns it.
        zero_centered: as :class:`~..layers.RMSNorm` (the weight stored as ``w - 1``).
    """

    def __init__(self, dim: int, total: int, eps: float, all_reduce, zero_centered: bool = False):
        super().__init__(dim, eps, zero_centered)
        self.total = total
        self.summed = CrossRankRMSNorm(all_reduce, total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, dim]`` → ``[T, dim]`` in ``x.dtype``."""
        weight = 1.0 + self.weight if self.zero_centered else self.weight
        return self.summed(x, weight, self.eps)


def spanning_qk_norm_split(attention_split, q_norm: str = 'q_norm', k_norm: str = 'k_norm'):
    """Extend an attention split factory (e.g. ``gqa_split(shared_kv=False)``: axes ``q_heads``
    and ``kv_heads``) with q / k norms that span every head, as a split factory.

    A rank reads the rows of ``q_norm.weight`` of its query heads and of ``k_norm.weight`` of its
    KV heads (``head_dim`` each, :func:`attention_head_dim` of the full config); the split's
    collective swaps the attention module's ``q_norm`` / ``k_norm`` (:class:`~..layers.RMSNorm`
    of the rank's channels) for :class:`SummedRMSNorm` of the whole widths.

    Raises:
        ValueError (from the returned factory): ``num_key_value_heads`` not divisible by the TP
            size (a copied KV head would count twice in the key norm).
    """

    def split(config, size: int) -> BlockSplit:
        inner = attention_split(config, size)
        heads, kv, d = config.num_attention_heads, config.num_key_value_heads, attention_head_dim(config)
        if kv % size:
            raise ValueError(f'num_key_value_heads ({kv}) must be divisible by tp ({size}): the key norm spans '
                             'every KV head, so no rank may hold a copy of one')

        def collective(attn, part, all_reduce) -> None:
            if inner.collective is not None:
                inner.collective(attn, part, all_reduce)
            for name, total in ((q_norm, heads * d), (k_norm, kv * d)):
                old = getattr(attn, name)
                setattr(attn, name, SummedRMSNorm(old.weight.shape[0], total, old.eps, all_reduce,
                                                  old.zero_centered))

        tensors = (rows(f'{q_norm}.weight', Piece('q_heads', d)), rows(f'{k_norm}.weight', Piece('kv_heads', d)))
        return dataclasses.replace(inner, tensors=inner.tensors + tensors, collective=collective)

    return split
