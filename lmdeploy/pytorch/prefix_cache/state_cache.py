"""Recurrent-state slots: runtime slots for running sequences and checkpoint slots for the
prefix cache. This class is the one owner of both free lists, checkpoint pins, and the
statistics the eviction policy scores checkpoints by.

Runtime slots are rows of the cache engine's state buffer. A checkpoint slot is an id whose
bytes live in one of two places::

    fixed slots  (num_checkpoint_slots set with num_gpu_blocks): rows R .. R+C-1 of the state buffer
    slot id   0 ........ R-1 | R .................... R+C-1
              runtime slots  | checkpoint slots

    block rows   (one memory budget): a checkpoint takes ``rows_per_checkpoint`` rows of the KV
                 block pool (:class:`~lmdeploy.pytorch.paging.block_manager.BlockManager`), so KV
                 blocks and checkpoints share one byte budget and the split follows the workload;
                 ids are R, R+1, ... (recycled), :meth:`StateCache.locate` gives their rows.

A checkpoint slot is *published* on a block-trie node once the copy into it has been queued;
it may be evicted only while unpinned. Pins are taken while a copy reads or writes the slot
(restore at admission, save after a forward). Which unpinned checkpoint goes first is the
eviction policy's choice (:mod:`.eviction`).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

from .eviction import CheckpointStats, EvictionPolicy, LRUPolicy

__all__ = ['StateCache', 'count_checkpoint']


def count_checkpoint(node, delta: int) -> None:
    """A checkpoint was published on (``delta=1``) or released from (``-1``) trie ``node``: keep
    ``ckpts_below`` (published checkpoints in a node's subtree, itself included) of it and its
    ancestors exact, in O(depth). A node with no count (a test double) is skipped."""
    while node is not None and hasattr(node, 'ckpts_below'):
        node.ckpts_below += delta
        node = node.parent


class StateCache:
    """Allocator for runtime and checkpoint state slots.

    Args:
        num_runtime_slots: R, slots of running sequences.
        num_checkpoint_slots: C: with fixed slots, the slots that hold checkpoints (may be 0);
            with block rows, the most checkpoints held at once (None: as many as rows allow).
        block_manager: the KV block pool checkpoints take their rows from (block rows); None for
            fixed slots.
        rows_per_checkpoint: rows one checkpoint takes from ``block_manager`` (block rows only).
        policy: the eviction policy (default LRU).
    """

    def __init__(self, num_runtime_slots: int, num_checkpoint_slots: int | None = 0, *, block_manager=None,
                 rows_per_checkpoint: int = 0, policy: EvictionPolicy | None = None):
        self.num_runtime_slots = num_runtime_slots
        self.block_manager = block_manager
        self.rows_per_checkpoint = rows_per_checkpoint if block_manager is not None else 0
        if block_manager is not None and rows_per_checkpoint < 1:
            raise ValueError(f'rows_per_checkpoint must be >= 1 with block rows, got {rows_per_checkpoint}')
        self.max_checkpoints = num_checkpoint_slots
        self.num_checkpoint_slots = num_checkpoint_slots or 0
        self.policy = policy or LRUPolicy()
        self.clock = itertools.count(1)
        # a min-heap: the lowest free slot first, so running sequences hold one compact range of
        # slots as long as they can (a decode step then updates those slots in place)
        self._free_runtime = list(range(num_runtime_slots))
        if block_manager is None:
            C = self.num_checkpoint_slots
            self._free_ckpt = list(range(num_runtime_slots + C - 1, num_runtime_slots - 1, -1))
        else:
            self._free_ckpt = []                 # recycled ids (rows come from the block pool)
            self._next_id = itertools.count(num_runtime_slots)
        self._rows: dict[int, tuple[int, ...]] = {}
        self._pins: dict[int, int] = {}
        self._published: dict[int, Any] = {}               # published checkpoint slot -> trie node
        self.stats: dict[int, CheckpointStats] = {}       # published checkpoint slot -> its statistics
        self.num_allocated = 0                             # checkpoint slots allocated (published or not)
        self.num_evicted = 0                               # published checkpoints evicted
        # called as on_evict(node, state_ref) before an evicted checkpoint's memory is freed (the
        # host tier demotes it); None: nothing to keep
        self.on_evict = None
        # observers told ``checkpoint_counted(node, delta)`` after a publish (+1) or release (-1)
        # updated ``ckpts_below`` on the node's path, e.g. the KV event tracker (kv_events.py)
        self.listeners: list = []

    @property
    def uses_block_rows(self) -> bool:
        """Checkpoints live in KV block rows (one memory budget)."""
        return self.block_manager is not None

    @property
    def num_slots(self) -> int:
        """Rows of the state buffer: R + C with fixed slots, R with block rows."""
        return self.num_runtime_slots + (0 if self.uses_block_rows else self.num_checkpoint_slots)

    # runtime slots ------------------------------------------------------------------
    @property
    def num_free_runtime(self) -> int:
        """Runtime slots not held by a sequence."""
        return len(self._free_runtime)

    def alloc_runtime(self) -> int | None:
        """The lowest free runtime slot, or None."""
        return heapq.heappop(self._free_runtime) if self._free_runtime else None

    def free_runtime(self, slot: int) -> None:
        """Return runtime ``slot`` (held by a sequence until now) to the free list."""
        assert 0 <= slot < self.num_runtime_slots and slot not in self._free_runtime
        heapq.heappush(self._free_runtime, slot)

    def is_runtime(self, slot: int) -> bool:
        """``slot`` is a runtime slot (not a checkpoint)."""
        return 0 <= slot < self.num_runtime_slots

    # checkpoint slots ---------------------------------------------------------------
    @property
    def num_free_checkpoints(self) -> int:
        """Checkpoints that can be allocated now without evicting (fixed slots: free slots)."""
        if not self.uses_block_rows:
            return len(self._free_ckpt)
        room = self.block_manager.num_free // self.rows_per_checkpoint
        if self.max_checkpoints is not None:
            room = min(room, self.max_checkpoints - self.num_allocated)
        return max(room, 0)

    @property
    def num_published(self) -> int:
        """Checkpoint slots attached to a trie node."""
        return len(self._published)

    @property
    def num_checkpoint_rows(self) -> int:
        """KV block rows held by checkpoints (0 with fixed slots)."""
        return self.num_allocated * self.rows_per_checkpoint

    def locate(self, slot: int) -> int | tuple[int, ...]:
        """Where ``slot``'s bytes are: a state-buffer row (runtime or fixed checkpoint slot), or
        the tuple of KV block rows of a block-row checkpoint."""
        return self._rows.get(slot, slot)

    def at_capacity(self) -> bool:
        """No more checkpoints may be held (the count limit), whatever the free rows."""
        if not self.uses_block_rows:
            return not self._free_ckpt
        return self.max_checkpoints is not None and self.num_allocated >= self.max_checkpoints

    def alloc_checkpoint(self) -> int | None:
        """A free checkpoint slot. With fixed slots, when none is free, the policy's victim among
        unpinned published checkpoints is released first; with block rows nothing is evicted
        here (the local tier evicts rows first) and None means the rows or the count limit are
        short. None also when every checkpoint is pinned (or C == 0)."""
        if self.at_capacity():
            victim = self.victim()
            if victim is not None:
                self.release_checkpoint(victim, evicted=True)
        if not self.uses_block_rows:
            slot = self._free_ckpt.pop() if self._free_ckpt else None
        elif self.at_capacity() or self.block_manager.num_free < self.rows_per_checkpoint:
            slot = None
        else:
            slot = self._free_ckpt.pop() if self._free_ckpt else next(self._next_id)
            self._rows[slot] = tuple(self.block_manager.allocate(self.rows_per_checkpoint))
        if slot is not None:
            self.num_allocated += 1
        return slot

    def victim(self) -> int | None:
        """The unpinned published checkpoint the policy evicts next, or None (O(log N): the
        policy's heap)."""
        choice = self.policy.select(self.stats, self.is_pinned, self.now())
        return None if choice is None else choice.slot

    def now(self) -> int:
        """Advance and return the logical clock."""
        return next(self.clock)

    def publish(self, slot: int, node: Any, stats: CheckpointStats | None = None) -> bool:
        """Attach checkpoint ``slot`` to trie ``node`` (sets ``node.checkpoint_slot``); returns True.

        Returns False, and changes nothing, when ``node`` already holds another checkpoint or has
        left the trie (``node.parent`` is None): e.g. two Store restores of one prefix in the
        same step each reserved a slot for it. The caller releases ``slot`` then; a node never
        points at two slots, and every published slot is the checkpoint of a node in the trie.
        """
        if (node.checkpoint_slot is not None and node.checkpoint_slot != slot) or node.parent is None:
            return False
        if node.checkpoint_slot == slot and self._published.get(slot) is node:
            return True
        node.checkpoint_slot = slot
        self._published[slot] = node
        count_checkpoint(node, 1)
        for listener in self.listeners:
            listener.checkpoint_counted(node, 1)
        if stats is None:
            stats = CheckpointStats(slot, 0, 0, 1)
        stats.slot = slot
        self.stats[slot] = stats
        self.policy.published(stats)
        self.policy.rescore(stats, self.now())
        return True

    def release_checkpoint(self, slot: int, evicted: bool = False) -> None:
        """Return an allocated checkpoint slot; detaches it from its node if published.

        Raises:
            RuntimeError: the slot is pinned.
        """
        if self._pins.get(slot):
            raise RuntimeError(f'checkpoint slot {slot} is pinned')
        if evicted and self.on_evict is not None and slot in self._published:
            self.on_evict(self._published[slot], self.locate(slot))     # the rows still hold it
        node = self._published.pop(slot, None)
        if node is not None:
            node.checkpoint_slot = None
            count_checkpoint(node, -1)
            for listener in self.listeners:
                listener.checkpoint_counted(node, -1)
        stats = self.stats.pop(slot, None)
        if stats is not None:
            self.policy.released(stats, evicted)
            self.num_evicted += evicted
        rows = self._rows.pop(slot, None)
        if rows is not None:
            self.block_manager.free_all(list(rows))
        self._free_ckpt.append(slot)
        self.num_allocated -= 1

    def touch(self, slot: int, hit: bool = False) -> None:
        """A published checkpoint was used (``hit``: a restore consumed it): rescore it now."""
        stats = self.stats.get(slot)
        if stats is not None:
            if hit:
                stats.hits += 1
                self.policy.hit(stats)
            self.policy.rescore(stats, self.now())

    def pin(self, slot: int) -> None:
        """Add a pin on ``slot`` (pins nest): it cannot be evicted or released until unpinned."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        """Drop one pin of ``slot``; KeyError if it holds none."""
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
        else:
            del self._pins[slot]

    def node_of(self, slot: int):
        """The trie node checkpoint ``slot`` is published on, or None."""
        return self._published.get(slot)

    def pinned_nodes(self) -> list:
        """Trie nodes whose published checkpoint is pinned now."""
        return [self._published[s] for s in self._pins if s in self._published]

    def is_pinned(self, slot: int) -> bool:
        """Whether ``slot`` holds at least one pin."""
        return bool(self._pins.get(slot))

    @property
    def num_pinned(self) -> int:
        """Slots holding at least one pin (0 when idle)."""
        return len(self._pins)

    @property
    def num_evictable_rows(self) -> int:
        """Block rows that releasing every unpinned published checkpoint would free (block rows)."""
        if not self.uses_block_rows:
            return 0
        pinned = sum(1 for s in self._pins if s in self._published)
        return (len(self._published) - pinned) * self.rows_per_checkpoint
