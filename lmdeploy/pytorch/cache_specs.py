"""Layer-type cache specs: what each decoder layer caches.

Every layer of a model declares one spec; the cache engine sizes and lays
out memory from the list of specs alone, with no model-specific branches:

- :class:`FullAttentionSpec` — keys and values per token, stored in paged blocks of
  ``block_size`` tokens (``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V).
- :class:`LinearAttentionSpec` — a fixed-size recurrent state per sequence (conv state and
  delta-rule state), stored in state slots (``[num_slots, *shape]`` per tensor).

Byte sizes derived here are the ones the Store byte accounting uses (docs/en/advance/store.md):
``S`` = :func:`state_bytes_per_slot`, ``K_blk`` = :func:`kv_bytes_per_block`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ['FullAttentionSpec', 'LinearAttentionSpec', 'LayerCacheSpec', 'kv_bytes_per_block',
           'state_bytes_per_slot', 'dtype_nbytes']


def dtype_nbytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FullAttentionSpec:
    """A full-attention layer: K and V per token in paged blocks.

    Attributes:
        num_kv_heads: key/value heads on this rank.
        head_dim: channels per head.
        dtype: storage dtype of K and V.
    """
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of K plus V for ``block_size`` tokens of this layer."""
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype_nbytes(self.dtype)


@dataclass(frozen=True)
class LinearAttentionSpec:
    """A linear-attention (recurrent) layer: a fixed-size state per sequence.

    Attributes:
        conv_shape: causal conv1d state ``(conv_dim, kernel_size - 1)``.
        conv_dtype: dtype of the conv state (the activation dtype).
        recurrent_shape: delta-rule state ``(num_v_heads, k_head_dim, v_head_dim)``.
        recurrent_dtype: dtype of the recurrent state (float32: it accumulates over the
            whole sequence, so low precision would drift).
    """
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent_shape: tuple[int, ...]
    recurrent_dtype: torch.dtype = torch.float32

    def tensors(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The (shape, dtype) of each state tensor, in slot layout order."""
        return [(tuple(self.conv_shape), self.conv_dtype), (tuple(self.recurrent_shape), self.recurrent_dtype)]

    def bytes_per_slot(self) -> int:
        """Bytes of this layer's state for one sequence."""
        total = 0
        for shape, dtype in self.tensors():
            n = 1
            for s in shape:
                n *= s
            total += n * dtype_nbytes(dtype)
        return total


LayerCacheSpec = FullAttentionSpec | LinearAttentionSpec


def kv_bytes_per_block(specs: Sequence[LayerCacheSpec], block_size: int) -> int:
    """``K_blk``: KV bytes of one block over all full-attention layers (this rank)."""
    return sum(s.bytes_per_block(block_size) for s in specs if isinstance(s, FullAttentionSpec))


def state_bytes_per_slot(specs: Sequence[LayerCacheSpec]) -> int:
    """``S`` before slot padding: state bytes of one sequence over all linear layers."""
    return sum(s.bytes_per_slot() for s in specs if isinstance(s, LinearAttentionSpec))
