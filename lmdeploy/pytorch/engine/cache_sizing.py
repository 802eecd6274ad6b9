"""How many KV blocks an engine allocates, and the check that its caches fit in memory.

Bytes per block and per state slot come from the model's cache specs
(:meth:`~lmdeploy.pytorch.cache_engine.CacheEngine.bytes_per_block` / ``bytes_per_slot``),
the one layout the cache engine and the Store use too.
"""
from __future__ import annotations

import os

import torch

from ..cache_engine import CacheEngine
from ..config import CacheConfig

__all__ = ['CPU_CACHE_BUDGET', 'memory_bytes', 'check_cache_fits', 'derive_num_blocks']

CPU_CACHE_BUDGET = 4 << 30   # bytes; CPU has no "free device memory" to take a fraction of


def memory_bytes(device: torch.device) -> int:
    """Memory the caches may take at most, in bytes: free device memory (CUDA) or physical RAM (CPU)."""
    if device.type == 'cuda':
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):    # not a POSIX system: no check
        return 1 << 62


def check_cache_fits(specs, cfg: CacheConfig, num_blocks: int, num_slots: int, device: torch.device) -> None:
    """Check that ``num_blocks`` KV blocks and ``num_slots`` state slots fit in memory at all.

    Raises:
        ValueError: naming the fields (``num_gpu_blocks`` or the derived block count; the state
            slots' ``max_batch_size`` / ``num_state_slots`` / ``num_checkpoint_slots``) and the bytes.
    """
    kv = num_blocks * CacheEngine.bytes_per_block(specs, cfg.block_size)
    state = num_slots * CacheEngine.bytes_per_slot(specs)
    memory = memory_bytes(device)
    if kv + state > memory:
        what = 'num_gpu_blocks' if cfg.num_gpu_blocks else 'the derived block count'
        raise ValueError(f'the caches need {kv + state} bytes ({num_blocks} KV blocks of {what}: {kv} bytes; '
                         f'{num_slots} recurrent-state slots (max_batch_size / num_state_slots, '
                         f'num_checkpoint_slots): {state} bytes), more than the {memory} bytes of '
                         f'{"free device memory" if device.type == "cuda" else "RAM"}')


def derive_num_blocks(specs, cfg: CacheConfig, num_slots: int, device: torch.device, max_batch_size: int,
                      session_len: int, checkpoint_rows: int = 0) -> int:
    """KV block rows for a budget of ``cache_bytes``, else ``cache_max_entry_count`` × free device
    memory (CUDA) or × :data:`CPU_CACHE_BUDGET` (CPU), less the state slots; at most twice what
    ``max_batch_size`` sequences of ``session_len`` tokens need, plus ``checkpoint_rows`` (the rows
    checkpoints may take when they share the pool).

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
    slots = num_slots * CacheEngine.bytes_per_slot(specs)
    per_block = CacheEngine.bytes_per_block(specs, cfg.block_size)
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
