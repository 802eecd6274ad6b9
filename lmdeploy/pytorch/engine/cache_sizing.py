"""How many KV blocks and state slots an engine allocates (:func:`size_caches`), and the check that
its caches fit in memory.

State slots, in slot order::

    [ runtime (one per running sequence) | checkpoints (fixed slots) | scratch (speculative decoding) ]

Checkpoints take KV block rows instead of fixed slots when they share the pool
(``CacheConfig.checkpoints_in_block_rows``): one memory budget.

A model of global and sliding-window layers whose window layers get a pool of their own
(:func:`~lmdeploy.pytorch.cache_specs.paged_groups`, split) has two block pools, each of its own
row bytes (the layers of its group). The window pool holds what every running sequence can hold
at once, ``max_batch_size x (ceil((W - 1 + P) / B) + 1)`` blocks (a sequence's window table
never holds more: the window plus one chunk of ``P`` tokens, one more block where they straddle
block ends), but never more blocks than one pool of both rows would have had; the global pool
takes the rest of the budget::

    budget = slots + num_window_blocks x window row + num_blocks x global row

So a mixed model never gets fewer global blocks than with one shared pool, and its window
layers' memory no longer grows with the sequences' lengths. With prefix caching on (window rows
kept by the local tier for its checkpoints) the window pool also holds what the cached checkpoints
read, ``C x ceil((W - 1) / B)`` more blocks (C: ``num_checkpoint_slots``, or its default when the
checkpoints take block rows; for a model without state, its markers, zero-byte checkpoints, as
many), within the same bound; when it runs short anyway, checkpoints are
evicted to free their window rows. With ``num_gpu_blocks`` set, the
global pool has that many blocks and the window pool the smaller of the two counts above.

Bytes per block and per state slot come from the model's cache specs
(:meth:`~lmdeploy.pytorch.cache_engine.CacheEngine.bytes_per_block` / ``bytes_per_slot``),
the one layout the cache engine and the Store use too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..cache_engine import CacheEngine, rows_per_state
from ..cache_specs import PagedGroup, kv_bytes_per_block
from ..config import DEFAULT_CHECKPOINT_SLOTS, CacheConfig

__all__ = ['CPU_CACHE_BUDGET', 'CacheSizes', 'size_caches', 'memory_bytes', 'check_cache_fits',
           'derive_num_blocks']

CPU_CACHE_BUDGET = 4 << 30   # bytes; CPU has no "free device memory" to take a fraction of


def memory_bytes(device: torch.device) -> int:
    """Memory the caches may take at most, in bytes: free device memory (CUDA) or physical RAM (CPU)."""
    if device.type == 'cuda':
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):    # not a POSIX system: no check
        return 1 << 62


def check_cache_fits(block_bytes: int, slot_bytes: int, cfg: CacheConfig, num_blocks: int, num_slots: int,
                     device: torch.device, window_bytes: int = 0) -> None:
    """Check that ``num_blocks`` KV blocks of ``block_bytes`` and ``num_slots`` state slots of
    ``slot_bytes`` (and ``window_bytes`` of a window group's own pool) fit in memory at all.

    Raises:
        ValueError: naming the fields (``num_gpu_blocks`` or the derived block count; the state
            slots' ``max_batch_size`` / ``num_state_slots`` / ``num_checkpoint_slots``) and the bytes.
    """
    kv = num_blocks * block_bytes + window_bytes
    state = num_slots * slot_bytes
    memory = memory_bytes(device)
    if kv + state > memory:
        what = 'num_gpu_blocks' if cfg.num_gpu_blocks else 'the derived block count'
        raise ValueError(f'the caches need {kv + state} bytes ({num_blocks} KV blocks of {what}: {kv} bytes; '
                         f'{num_slots} recurrent-state slots (max_batch_size / num_state_slots, '
                         f'num_checkpoint_slots): {state} bytes), more than the {memory} bytes of '
                         f'{"free device memory" if device.type == "cuda" else "RAM"}')


def derive_num_blocks(block_bytes: int, slot_bytes: int, cfg: CacheConfig, num_slots: int, device: torch.device,
                      max_batch_size: int, session_len: int, checkpoint_rows: int = 0, reserved: int = 0) -> int:
    """KV block rows (of ``block_bytes``) for a budget of ``cache_bytes``, else
    ``cache_max_entry_count`` × free device memory (CUDA) or × :data:`CPU_CACHE_BUDGET` (CPU), less
    the ``num_slots`` state slots (of ``slot_bytes``); at most twice what
    ``max_batch_size`` sequences of ``session_len`` tokens need, plus ``checkpoint_rows`` (the rows
    checkpoints may take when they share the pool); ``reserved`` bytes of the budget are taken
    first (a window group's own pool).

    Raises:
        ValueError: the state slots take the whole budget, or no block fits.
    """
    if cfg.cache_bytes:
        budget = cfg.cache_bytes
    elif device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.cache_max_entry_count)
    else:
        budget = int(CPU_CACHE_BUDGET * cfg.cache_max_entry_count)
    slots = num_slots * slot_bytes + reserved
    per_block = block_bytes
    # no point in more blocks than every running sequence at full session length needs, twice
    cap = 2 * max_batch_size * (-(-session_len // cfg.block_size)) + checkpoint_rows
    num_blocks = min((budget - slots) // per_block, cap)
    if num_blocks < 1:
        what = f'cache_bytes={cfg.cache_bytes}' if cfg.cache_bytes else f'cache_max_entry_count={cfg.cache_max_entry_count}'
        if slots >= budget:
            raise ValueError(f'the {num_slots} recurrent-state slots ({slots} bytes; max_batch_size / '
                             f'num_state_slots, num_checkpoint_slots) take the whole cache budget of {budget} '
                             f'bytes ({what}): lower them, raise the budget or set num_gpu_blocks')
        raise ValueError(f'the cache budget ({what}) leaves no memory for even one KV block')
    return num_blocks


@dataclass(frozen=True)
class CacheSizes:
    """What an engine allocates.

    Attributes:
        num_blocks: KV block rows (checkpoints' rows included when they share the pool).
        num_slots: state slots in all (0 for a model without recurrent state).
        num_runtime: runtime state slots (one per running sequence).
        num_checkpoint_slots: fixed checkpoint slots (0 when checkpoints take block rows or are not kept).
        checkpoints_in_block_rows: checkpoints take KV block rows (one memory budget).
        scratch_base: the first scratch slot (speculative decoding on a hybrid model), else None.
        num_window_blocks: blocks of a sliding-window group's own pool (0: none).
        session_len: the session length, capped to what the KV cache holds (tokens).
        capped: the session length was capped to the KV cache.
    """
    num_blocks: int
    num_slots: int
    num_runtime: int
    num_checkpoint_slots: int
    checkpoints_in_block_rows: bool
    scratch_base: int | None
    session_len: int
    capped: bool
    num_window_blocks: int = 0


def size_caches(specs, hybrid: bool, cc: CacheConfig, device: torch.device, max_batch_size: int, session_len: int,
                speculative: bool, groups: Sequence[PagedGroup] = (), chunk_tokens: int = 0) -> CacheSizes:
    """Size an engine's caches for its model's cache ``specs`` and check that they fit in memory.

    Args:
        specs: the model's cache specs (this rank's heads).
        hybrid: the specs hold recurrent state (state slots and checkpoints are needed).
        cc: the cache configuration.
        device: where the caches live.
        max_batch_size: running sequences at most (one runtime slot each unless ``num_state_slots``).
        session_len: tokens one sequence may hold; capped to the KV cache when it holds fewer (a
            longer sequence could never be admitted).
        speculative: speculative decoding is on (a hybrid model then needs one scratch slot per
            runtime slot, to roll back).
        groups: the engine's paged groups (:func:`~lmdeploy.pytorch.cache_specs.paged_groups`);
            a second group (a sliding window) gets a pool of its own, sized by the module's rule.
        chunk_tokens: P, the most tokens one forward adds to a sequence (the window pool's rule).

    Raises:
        ValueError: see :func:`derive_num_blocks` and :func:`check_cache_fits`.
    """
    num_runtime = cc.num_state_slots or max_batch_size
    keeps_checkpoints = hybrid and cc.enable_prefix_caching
    slot_bytes, block_bytes, group_rows = CacheEngine.row_bytes(specs, cc.block_size,
                                                                [g.entries for g in groups[:2]] if len(groups) > 1 else ())
    # a model that caches nothing per token (pure Mamba-2) has block rows of padding only: its
    # checkpoints keep slots of their own
    block_rows = keeps_checkpoints and cc.checkpoints_in_block_rows and kv_bytes_per_block(specs, cc.block_size) > 0
    num_ckpt = cc.fixed_checkpoint_slots if (keeps_checkpoints and not block_rows) else 0
    num_slots = num_runtime + num_ckpt if hybrid else 0
    scratch_base = num_slots if (hybrid and speculative) else None
    if scratch_base is not None:
        num_slots += num_runtime
    extra = (cc.num_checkpoint_slots if cc.num_checkpoint_slots is not None else
             DEFAULT_CHECKPOINT_SLOTS) * rows_per_state(slot_bytes, block_bytes) if block_rows else 0
    num_window, window_row = 0, 0
    if len(groups) > 1:
        # the shared pool this model would have had bounds the window pool
        shared = cc.num_gpu_blocks or derive_num_blocks(block_bytes, slot_bytes, cc, num_slots, device,
                                                        max_batch_size, session_len, extra)
        block_bytes, window_row = group_rows
        per_seq = -(-(groups[1].window - 1 + chunk_tokens) // cc.block_size) + 1
        # the window rows the cached checkpoints read (each at most ceil((W - 1) / B) blocks); a
        # model without state split with caching on keeps them for as many markers (zero-byte
        # checkpoints, one slot each)
        keep = (cc.fixed_checkpoint_slots * -(-(groups[1].window - 1) // cc.block_size)
                if cc.enable_prefix_caching else 0)
        num_window = min(max_batch_size * per_seq + keep, shared)
    num_blocks = cc.num_gpu_blocks or derive_num_blocks(block_bytes, slot_bytes, cc, num_slots, device, max_batch_size,
                                                        session_len, extra, reserved=num_window * window_row)
    capacity = num_blocks * cc.block_size
    check_cache_fits(block_bytes, slot_bytes, cc, num_blocks, num_slots, device, num_window * window_row)
    return CacheSizes(num_blocks, num_slots, num_runtime, num_ckpt, block_rows, scratch_base,
                      min(session_len, capacity), session_len > capacity, num_window)
