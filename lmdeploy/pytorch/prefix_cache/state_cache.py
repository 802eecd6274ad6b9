"""Recurrent-state slots: runtime slots for running sequences and checkpoint slots for the
prefix cache. This class is the one owner of both free lists, checkpoint pins and the
checkpoint LRU order.

Slot ids index one state buffer in the cache engine::

    slot id   0 ........ R-1 | R .................... R+C-1
              runtime slots  | checkpoint slots (prefix cache)

A checkpoint slot is *published* on a block-trie node once the copy into it has been queued;
it may be evicted (LRU) only while unpinned. Pins are taken while a copy reads or writes
the slot (restore at admission, save after a forward).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

__all__ = ['StateCache']


class StateCache:
    """Allocator for runtime and checkpoint state slots.

    Args:
        num_runtime_slots: R, slots of running sequences.
        num_checkpoint_slots: C, slots that hold prefix-cache checkpoints (may be 0).
    """

    def __init__(self, num_runtime_slots: int, num_checkpoint_slots: int):
        self.num_runtime_slots = num_runtime_slots
        self.num_checkpoint_slots = num_checkpoint_slots
        # a min-heap: the lowest free slot first, so running sequences hold one compact range of
        # slots as long as they can (a decode step then updates those slots in place)
        self._free_runtime = list(range(num_runtime_slots))
        self._free_ckpt = list(range(num_runtime_slots + num_checkpoint_slots - 1, num_runtime_slots - 1, -1))
        self._pins: dict[int, int] = {}
        # published checkpoint slot -> trie node, in LRU order (oldest first)
        self._published: OrderedDict[int, Any] = OrderedDict()

    @property
    def num_slots(self) -> int:
        """R + C."""
        return self.num_runtime_slots + self.num_checkpoint_slots

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

    # checkpoint slots ---------------------------------------------------------------
    @property
    def num_free_checkpoints(self) -> int:
        """Checkpoint slots neither published nor being written."""
        return len(self._free_ckpt)

    @property
    def num_published(self) -> int:
        """Checkpoint slots attached to a trie node."""
        return len(self._published)

    def alloc_checkpoint(self) -> int | None:
        """A free checkpoint slot, evicting the least recently used unpinned checkpoint if
        none is free; None when every checkpoint slot is pinned (or C == 0)."""
        if not self._free_ckpt:
            for slot in self._published:
                if not self._pins.get(slot):
                    self.release_checkpoint(slot)
                    break
        return self._free_ckpt.pop() if self._free_ckpt else None

    def publish(self, slot: int, node: Any) -> bool:
        """Attach checkpoint ``slot`` to trie ``node`` (sets ``node.checkpoint_slot``); returns True.

        Returns False, and changes nothing, when ``node`` already holds another checkpoint or has
        left the trie (``node.parent`` is None): e.g. two Store restores of one prefix in the
        same step each reserved a slot for it. The caller releases ``slot`` then; a node never
        points at two slots, and every published slot is the checkpoint of a node in the trie.
        """
        if (node.checkpoint_slot is not None and node.checkpoint_slot != slot) or node.parent is None:
            return False
        node.checkpoint_slot = slot
        self._published[slot] = node
        return True

    def release_checkpoint(self, slot: int) -> None:
        """Return an allocated checkpoint slot; detaches it from its node if published.

        Raises:
            RuntimeError: the slot is pinned.
        """
        if self._pins.get(slot):
            raise RuntimeError(f'checkpoint slot {slot} is pinned')
        node = self._published.pop(slot, None)
        if node is not None:
            node.checkpoint_slot = None
        self._free_ckpt.append(slot)

    def touch(self, slot: int) -> None:
        """Mark a published checkpoint as most recently used."""
        if slot in self._published:
            self._published.move_to_end(slot)

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
