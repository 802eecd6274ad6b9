"""The inputs of one model forward: a flat batch of new tokens plus cache handles.

The model runner builds one :class:`StepContext` per forward; model layers read it to find
where each sequence's tokens are, which KV blocks and which state slot belong to it::

    flat tokens  | seq 0 (prefill chunk, 5 new) | seq 1 (decode, 1 new) |
    q_start_loc    0                              5
    q_seqlens      5                              1
    kv_seqlens     133 (128 cached + 5 new)       41 (40 cached + 1 new)
    history_len    128                            40

A sequence whose ``history_len`` is 0 starts from a zero recurrent state; otherwise its
state slot holds the state after exactly ``history_len`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ['StepContext']


@dataclass
class StepContext:
    """One forward's batch (all sequences' new tokens concatenated).

    Attributes:
        input_ids: ``[T]`` int64, the new tokens of every sequence, concatenated.
        positions: ``[T]`` int64, absolute position of each token in its sequence.
        q_seqlens: new tokens per sequence (length = number of sequences).
        q_start_loc: offset of each sequence's first new token in ``input_ids``.
        kv_seqlens: tokens in each sequence's cache after this forward (history + new).
        block_tables: per sequence, ``[num_blocks]`` int64 block ids covering ``kv_seqlens``.
        state_slots: per sequence, the runtime state slot (``-1`` for models without state).
        kv_caches: per layer, ``(k_cache, v_cache)`` each ``[num_blocks, block_size,
            num_kv_heads, head_dim]`` for full-attention layers, else ``None``.
        state_caches: per layer, ``(conv_state [num_slots, conv_dim, kernel_size - 1],
            recurrent_state [num_slots, num_v_heads, k_head_dim, v_head_dim] float32)`` for
            linear-attention layers, else ``None``.
        block_size: tokens per KV block.
    """
    input_ids: torch.Tensor
    positions: torch.Tensor
    q_seqlens: list[int]
    q_start_loc: list[int]
    kv_seqlens: list[int]
    block_tables: list[torch.Tensor]
    state_slots: list[int]
    kv_caches: list = field(default_factory=list)
    state_caches: list = field(default_factory=list)
    block_size: int = 64

    @property
    def num_seqs(self) -> int:
        """Sequences in this forward."""
        return len(self.q_seqlens)

    @property
    def history_lens(self) -> list[int]:
        """Tokens already cached for each sequence before this forward."""
        return [kv - q for kv, q in zip(self.kv_seqlens, self.q_seqlens)]

    def seq_slice(self, i: int) -> slice:
        """The slice of the flat token axis that belongs to sequence ``i``."""
        start = self.q_start_loc[i]
        return slice(start, start + self.q_seqlens[i])
