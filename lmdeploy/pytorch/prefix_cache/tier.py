"""What every tier behind the device answers, and the tier that holds nothing.

A restore asks the tiers in order — the device (:class:`~.local_tier.LocalTier`), then host
memory (:class:`~.host_tier.HostTier`), then the Store (:class:`~.store_tier.StoreTier`) — and
each answers the same questions about the prefix named by a sequence's chained block hashes::

    depth(hashes, rules, ...)   how deep a restorable prefix do you hold?   (metadata only)
    load(StoreLoad)             copy it into the device's fresh blocks and runtime slot
    save(StorePut)              keep the prefix [0, b) and its state at b
    record_hit(tokens)          a restore from the tier took effect
    evict(num_bytes)            free up to num_bytes of what you hold
    stats() / bytes_held        counters; payload bytes held in this process's memory

The device tier answers them in its richer form, because it is the tier that *shares* blocks
rather than copying them: :meth:`~.local_tier.LocalTier.match` verifies the tokens and returns
the nodes an admission attaches, :meth:`~.local_tier.LocalTier.plan_checkpoint` saves by a slot
copy the engine runs, :meth:`~.local_tier.LocalTier.evict` frees block rows; the coordinator
(:class:`~.coordinator.PrefixCache`) reaches none of its internals. It also answers the
hash-only ``depth`` question as the others do (:meth:`~.local_tier.LocalTier.depth`).

A tier the engine was not configured with is a :class:`NullTier` (it holds nothing), so the
coordinator asks every tier the same way and never checks which ones exist.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..paging.prefill_plan import ReuseRules
from .plans import StoreLoad, StorePut

__all__ = ['NullTier', 'PrefixTier']


@runtime_checkable
class PrefixTier(Protocol):
    """A tier holding copies of prefixes by their chained block hashes (host memory, the Store)."""

    name: str       # 'host', 'store': the ``PrefixMatch.source`` of a restore from this tier

    def depth(self, hashes: list[bytes], rules: ReuseRules, *, shared_blocks: int = 0, above: int = 0,
              below: int | None = None) -> int:
        """The deepest boundary ``b`` (tokens), ``above < b`` and ``b < below`` (when given),
        restorable under ``rules`` whose state object and the KV blocks ``[shared_blocks, b/B + r)``
        the tier holds (the device shares the first ``shared_blocks``); 0 if none."""

    def load(self, load: StoreLoad) -> bool:
        """Copy the prefix ``load`` names into its device blocks and runtime slot; False (nothing
        usable written) when the tier no longer holds it or it fails verification."""

    def save(self, put: StorePut) -> None:
        """Keep prefix ``[0, put.boundary)``: the KV blocks of ``put.block_ids`` the tier lacks and
        the state at ``put.slot`` (a runtime slot or a located checkpoint)."""

    def record_hit(self, tokens: int) -> None:
        """A restore of ``tokens`` tokens from this tier took effect (counted once per request)."""

    def evict(self, num_bytes: int) -> int:
        """Drop what the tier holds, its own policy's choice first, until ``num_bytes`` payload
        bytes are freed or nothing is left; returns the bytes freed (0 for a tier whose backend
        evicts by itself)."""

    def stats(self) -> dict:
        """The tier's cumulative counters (and bytes held)."""

    @property
    def bytes_held(self) -> int:
        """Payload bytes the tier holds in this process's memory."""


class NullTier:
    """A tier that holds nothing: every depth is 0, nothing loads, a save keeps nothing.

    Args:
        name: the tier it stands in for (``'host'``, ``'store'``).
    """

    bytes_held = 0

    def __init__(self, name: str):
        self.name = name

    def depth(self, hashes: list[bytes], rules: ReuseRules, *, shared_blocks: int = 0, above: int = 0,
              below: int | None = None) -> int:
        """Nothing held: 0."""
        return 0

    def load(self, load: StoreLoad) -> bool:
        """Nothing held: False."""
        return False

    def save(self, put: StorePut) -> None:
        """Keeps nothing."""

    def record_hit(self, tokens: int) -> None:
        """Never restored from."""

    def evict(self, num_bytes: int) -> int:
        """Nothing to free: 0."""
        return 0

    def stats(self) -> dict:
        """No counters (the engine reports the missing tier's zeros)."""
        return {}
