"""Per-subsystem configurations, built once from the user's :class:`PytorchEngineConfig`.

Each subsystem reads only its own frozen config, so what a piece depends on is visible in its
constructor::

    PytorchEngineConfig ──▶ CacheConfig       block pool, state slots, prefix-cache tiers
                        └─▶ SchedulerConfig   queues, budgets, prefill plans

Validation stays in :class:`PytorchEngineConfig` (a ``ValueError`` naming the field); these
are plain views of validated values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..messages import PytorchEngineConfig

__all__ = ['CacheConfig', 'SchedulerConfig', 'cache_root', 'DEFAULT_CHECKPOINT_SLOTS']

DEFAULT_CHECKPOINT_SLOTS = 64     # checkpoint slots when num_gpu_blocks fixes the KV pool and none are given


@dataclass(frozen=True)
class CacheConfig:
    """KV blocks, state slots and the prefix cache.

    Attributes:
        block_size: B, tokens per KV block.
        num_gpu_blocks: explicit KV block count, 0 = derive from memory.
        cache_max_entry_count: fraction of free memory given to the caches.
        num_state_slots: runtime state slots, 0 = ``max_batch_size``.
        num_checkpoint_slots: most checkpoints of the prefix cache (hybrid models); None = the budget's.
        enable_prefix_caching: whether the tiers exist at all.
        prefill_save_alignment: A, checkpoint boundaries are multiples of A (tokens).
        decode_save_last: also checkpoint the last block boundary of a finished request.
        cache_bytes: explicit byte budget of the caches, 0 = ``cache_max_entry_count`` of memory.
        cache_eviction: the eviction policy's name (``'reuse'`` or ``'lru'``).
    """
    block_size: int
    num_gpu_blocks: int
    cache_max_entry_count: float
    num_state_slots: int
    num_checkpoint_slots: int | None
    enable_prefix_caching: bool
    prefill_save_alignment: int
    decode_save_last: bool = False
    cache_bytes: int = 0
    cache_eviction: str = 'reuse'

    @property
    def checkpoints_in_block_rows(self) -> bool:
        """Checkpoints share the KV block pool (one memory budget): unless ``num_gpu_blocks``
        fixes the KV block count, in which case checkpoints keep slots of their own."""
        return not self.num_gpu_blocks

    @property
    def fixed_checkpoint_slots(self) -> int:
        """Checkpoint slots of their own with an explicit ``num_gpu_blocks`` (default 64)."""
        return DEFAULT_CHECKPOINT_SLOTS if self.num_checkpoint_slots is None else self.num_checkpoint_slots

    @classmethod
    def from_engine_config(cls, cfg: PytorchEngineConfig) -> 'CacheConfig':
        """The cache fields of ``cfg`` (block size, KV and state budgets, prefix caching)."""
        return cls(cfg.block_size, cfg.num_gpu_blocks, cfg.cache_max_entry_count, cfg.num_state_slots,
                   cfg.num_checkpoint_slots, cfg.enable_prefix_caching, cfg.prefill_save_alignment,
                   cfg.decode_save_last, cfg.cache_bytes, cfg.cache_eviction)


@dataclass(frozen=True)
class SchedulerConfig:
    """Queues, budgets and prefill plans.

    Attributes:
        block_size: B, tokens per KV block.
        max_batch_size: most running sequences.
        max_prefill_token_num: P, most prefill tokens per step (and per chunk).
        prefill_save_alignment: A (tokens).
        prefill_save_last_only: one save point per input turn (hybrid models only).
        save_junction: one more save point at a branch point (hybrid models only).
    """
    block_size: int
    max_batch_size: int
    max_prefill_token_num: int
    prefill_save_alignment: int
    prefill_save_last_only: bool
    save_junction: bool = False

    @classmethod
    def from_engine_config(cls, cfg: PytorchEngineConfig) -> 'SchedulerConfig':
        """The scheduling fields of ``cfg`` (batch and prefill limits, save policy)."""
        return cls(cfg.block_size, cfg.max_batch_size, cfg.max_prefill_token_num, cfg.prefill_save_alignment,
                   cfg.prefill_save_last_only, cfg.save_junction)


def cache_root() -> Path:
    """The folder under which lmdeploy keeps caches of its own (weight digests, built kernels):
    ``$LMDEPLOY_CACHE_DIR``, else ``$XDG_CACHE_HOME/lmdeploy``, else ``~/.cache/lmdeploy``."""
    root = os.environ.get('LMDEPLOY_CACHE_DIR')
    if root:
        return Path(root)
    return Path(os.environ.get('XDG_CACHE_HOME') or str(Path.home() / '.cache')) / 'lmdeploy'
