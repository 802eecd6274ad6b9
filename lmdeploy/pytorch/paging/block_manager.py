"""KV block allocator: the one owner of block reference counts and the free list.

A block is free (refcount 0, on the free list) or referenced by sequences and/or by one
prefix-cache node. The pool never evicts on its own: whoever needs more blocks than are free
asks the prefix cache to evict first (the scheduler does, explicitly), so checking whether an
allocation fits has no side effects.
"""
from __future__ import annotations

from collections import deque

__all__ = ['BlockManager', 'OutOfBlocks']


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks."""


class BlockManager:
    """Reference-counted pool of ``num_blocks`` KV blocks.

    Args:
        num_blocks: total blocks in the cache engine.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f'num_blocks must be >= 1, got {num_blocks}')
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = deque(range(num_blocks))
        # blocks owned by a prefix-cache node, and how many of those no sequence references
        self._cached = bytearray(num_blocks)
        self.num_cached_unshared = 0

    @property
    def num_free(self) -> int:
        """Blocks on the free list (not counting evictable cached blocks)."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        """True if ``n`` blocks are free now (no side effects; eviction is the caller's)."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, each with refcount 1.

        Raises:
            OutOfBlocks: fewer than ``n`` blocks are free (nothing is taken).
        """
        if not self.can_allocate(n):
            raise OutOfBlocks(f'need {n} blocks, {len(self._free)} free')
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        """Add a reference to an allocated block."""
        assert self.refcount[block] > 0, f'incref of free block {block}'
        self.refcount[block] += 1
        if self._cached[block] and self.refcount[block] == 2:
            self.num_cached_unshared -= 1

    def decref(self, block: int) -> None:
        """Drop a reference; the block returns to the free list at zero."""
        assert self.refcount[block] > 0, f'decref of free block {block}'
        self.refcount[block] -= 1
        if self._cached[block] and self.refcount[block] == 1:
            self.num_cached_unshared += 1
        if self.refcount[block] == 0:
            self._free.append(block)

    def cache(self, block: int) -> None:
        """A prefix-cache node takes a reference on ``block`` (O(1) bookkeeping of
        :attr:`num_cached_unshared`, cached blocks only the cache references)."""
        self.incref(block)
        self._cached[block] = 1
        if self.refcount[block] == 1:
            self.num_cached_unshared += 1

    def uncache(self, block: int) -> None:
        """The prefix-cache node of ``block`` is gone: drop its reference."""
        if self.refcount[block] == 1:
            self.num_cached_unshared -= 1
        self._cached[block] = 0
        self.decref(block)

    def free_all(self, blocks: list[int]) -> None:
        """Drop one reference from each block in ``blocks``."""
        for b in blocks:
            self.decref(b)
