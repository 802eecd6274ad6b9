"""The one varlen driver of the recurrent-state ops: a step's flat batch of sequences, each
continuing its state slot, run through the op's one-token step kernel and its one-sequence chunk
kernel.

``gated_delta_rule_varlen``, ``kda_varlen``, ``mamba2_ssd_varlen``, ``selective_scan_varlen`` and
``lightning_attention_varlen`` differ only in their per-row inputs and in those two kernels; the
batching, the slot reads and writes and the zero start of a sequence without history are this
module's::

    rows     | s0: 1 | s1: 5 rows        | s2: 1 | s3: 3 rows |
    step       s0 and s2 together: states gathered from their slots (zeroed without history),
               one step call, states scattered back
    chunk      s1, then s3, one call each from its slot's state (None without history); the
               final state written back to the slot

A pure decode step (one row per sequence) whose slots are one range ``lo .. lo + N - 1``, all
with history (:func:`~lmdeploy.pytorch.kernels.slot_range`), runs the step on that slice of a
float32 cache in place: no gathered copy, no scatter.

Invariants: exactly the slots given are rewritten; a sequence without history starts from zeros
whatever its slot holds; the result does not depend on how the sequences are ordered or which
path ran them (the step and chunk kernels agree to float32 rounding).
"""
from __future__ import annotations

from typing import Callable

import torch

from . import slot_range

__all__ = ['varlen_state_scan', 'ssm_varlen', 'delta_varlen']

StepFn = Callable[..., torch.Tensor]
ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def varlen_state_scan(rows: tuple[torch.Tensor, ...], state_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                      slots: torch.Tensor, has_history: torch.Tensor, *, step: StepFn, chunk: ChunkFn,
                      out_shape: tuple[int, ...], out_dtype: torch.dtype, slot_span=...,
                      batch_chunks: Callable[[list[int], list[int], torch.Tensor], list[int]] | None = None
                      ) -> torch.Tensor:
    """Run every sequence of a flat batch from its state slot (module docstring).

    Args:
        rows: the op's per-row inputs, each ``[T, ...]`` (all sequences' rows concatenated).
        state_cache: ``[num_slots, ...]`` (may be a strided view); rows ``slots`` are read, then
            overwritten with each sequence's state after its last row.
        cu_seqlens: int64 ``[N + 1]`` row offsets (every sequence has >= 1 row).
        slots: int64 ``[N]`` distinct state slots; has_history: bool ``[N]`` (False: zeros).
        step: ``step(*rows_of_M_sequences, state)`` → ``y [M, *out_shape]``, one token per
            sequence, ``state`` (float32 ``[M, ...]``) updated in place.
        chunk: ``chunk(*rows_of_one_sequence, initial_state or None)`` → ``(y [L, *out_shape],
            final state)``; must not modify ``initial_state``.
        out_shape: the output's shape per row; out_dtype: its dtype.
        slot_span: :func:`~lmdeploy.pytorch.kernels.slot_range` of ``slots`` when the caller has
            it (``StepContext.slot_span``); ``...`` computes it.
        batch_chunks: optional ``batch_chunks(indices, bounds, out)``: runs some of the
            multi-row sequences ``indices`` together (writing ``out`` and their slots) and
            returns the indices left for the one-at-a-time chunk calls.

    Returns:
        ``y [T, *out_shape]`` in ``out_dtype``.
    """
    T, N = rows[0].shape[0], slots.shape[0]
    if T == N and state_cache.dtype == torch.float32:
        span = slot_range(slots, has_history) if slot_span is ... else slot_span
        if span is not None:
            lo, order = span
            state = state_cache[lo:lo + N]
            if order is None:
                return step(*rows, state).to(out_dtype)
            y = step(*(r[order] for r in rows), state)
            return y.new_empty(y.shape).index_copy_(0, order, y).to(out_dtype)
    out = rows[0].new_empty((T, *out_shape), dtype=out_dtype)
    if T == N:   # pure decode, slots scattered: no host read of cu_seqlens
        _gathered_step(step, rows, None, None, state_cache, slots, has_history, out)
        return out
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    single = [i for i, n in enumerate(lengths) if n == 1]
    if single:
        idx = torch.tensor(single, dtype=torch.int64, device=rows[0].device)
        _gathered_step(step, rows, cu_seqlens.to(idx.device)[idx], idx, state_cache, slots, has_history, out)
    multi = [i for i, n in enumerate(lengths) if n > 1]
    if batch_chunks is not None and multi:
        multi = batch_chunks(multi, bounds, out)
    history = has_history.tolist()
    for i in multi:
        sl = slice(bounds[i], bounds[i + 1])
        initial = state_cache[slots[i]] if history[i] else None
        y, state = chunk(*(r[sl] for r in rows), initial)
        state_cache[slots[i]] = state.to(state_cache.dtype)
        out[sl] = y
    return out


def ssm_varlen(step: StepFn, chunk: ChunkFn, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, state_cache: torch.Tensor, cu_seqlens: torch.Tensor,
               slots: torch.Tensor, has_history: torch.Tensor, chunk_size: int, slot_span=...) -> torch.Tensor:
    """The selective state-space ops (Mamba-1 ``selective_scan_*``, Mamba-2 ``ssd_*``):
    :func:`varlen_state_scan` with rows ``x, dt, B, C`` and ``A, D`` shared.

    Args:
        step: ``step(x, dt, A, B, C, D, state)`` → float32 ``y`` (the op's one-token kernel).
        chunk: ``chunk(x, dt, A, B, C, D, initial_state, chunk_size)`` → ``(y, state)``.
        x, dt, A, B, C, D, state_cache, cu_seqlens, slots, has_history, chunk_size, slot_span: as
            the op's varlen kernel (``selective_scan_varlen``, ``mamba2_ssd_varlen``).

    Returns:
        float32 ``y`` shaped like ``x``.
    """
    return varlen_state_scan(
        (x, dt, B, C), state_cache, cu_seqlens, slots, has_history,
        step=lambda x, dt, B, C, state: step(x, dt, A, B, C, D, state),
        chunk=lambda x, dt, B, C, initial: chunk(x, dt, A, B, C, D, initial, chunk_size),
        out_shape=x.shape[1:], out_dtype=torch.float32, slot_span=slot_span)


def delta_varlen(step: StepFn, chunk: ChunkFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, state_cache: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                 has_history: torch.Tensor, use_qk_l2norm: bool, scale: float | None, slot_span=...,
                 batch_chunks=None) -> torch.Tensor:
    """The delta-rule ops (``gated_delta_rule_varlen``, ``kda_varlen``): :func:`varlen_state_scan`
    with rows ``q, k, v, g, beta``.

    Args:
        step: ``step(q, k, v, g, beta, state, use_qk_l2norm, scale)`` → ``o [M, H, dv]``.
        chunk: ``chunk(q, k, v, g, beta, initial_state, use_qk_l2norm=, scale=)`` → ``(o, state)``.
        the rest: as the op's varlen kernel; batch_chunks as in :func:`varlen_state_scan`.

    Returns:
        ``o [T, H, dv]`` in ``q.dtype``.
    """
    return varlen_state_scan(
        (q, k, v, g, beta), state_cache, cu_seqlens, slots, has_history,
        step=lambda q, k, v, g, beta, state: step(q, k, v, g, beta, state, use_qk_l2norm, scale),
        chunk=lambda q, k, v, g, beta, initial: chunk(q, k, v, g, beta, initial, use_qk_l2norm=use_qk_l2norm,
                                                      scale=scale),
        out_shape=v.shape[1:], out_dtype=q.dtype, slot_span=slot_span, batch_chunks=batch_chunks)


def _gathered_step(step: StepFn, rows, row_idx, seq_idx, state_cache, slots, has_history, out) -> None:
    """One step call for the single-row sequences ``seq_idx`` (rows ``row_idx``; None: all) on a
    gathered float32 copy of their states, zeroed without history, scattered back."""
    if seq_idx is not None:
        rows = tuple(r[row_idx] for r in rows)
        slots, has_history = slots[seq_idx], has_history[seq_idx]
    state = state_cache.index_select(0, slots).to(torch.float32)
    # leftovers may be anything; masked on every device, without reading has_history on the host
    # (no device sync, and a CPU decode graph can replay the step: engine/decode_graph.py)
    state.masked_fill_(~has_history.view((-1,) + (1,) * (state.dim() - 1)), 0)
    y = step(*rows, state)
    if row_idx is None:
        out.copy_(y)
    else:
        out[row_idx] = y.to(out.dtype)
    state_cache.index_copy_(0, slots, state.to(state_cache.dtype))
