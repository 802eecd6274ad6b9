"""Checkpoint pins: the one owner that takes and releases them.

A checkpoint slot is *pinned* while a copy reads or writes it, or while a request keeps it as
its turn-end staging slot: a pinned slot is never evicted or released
(:meth:`StateCache.alloc_checkpoint` skips it, :meth:`StateCache.release_checkpoint` refuses
it). Every pin is a :class:`PinLease` handed out by :class:`CheckpointPins` — the only caller
of :meth:`StateCache.pin` / :meth:`StateCache.unpin` — and travels with the plan that needs it::

    purpose            taken by                          released by (exactly once)
    restore_source     LocalTier.pin (admission)         LocalTier.unpin (admission rolled back)
                                                         or PrefixCache.loads_done (copy ran/raised),
                                                         or PrefixCache.plan_load (a marker: no copy)
    save_target        LocalTier.plan_checkpoint         LocalTier.checkpoint_done (copy ran/raised)
    store_keep         LocalTier.cache_restored          PrefixCache.restored_kept
    staging            PrefixCache._stage                turn-end publish, or the request leaving

A lease is released at most once (a second :meth:`PinLease.release` raises; leaving a ``with``
block releases it only if nobody did). A request that leaves the engine — finished, aborted,
preempted or rolled back — has :meth:`CheckpointPins.release_owner` called for it, which
drops any lease it still owns and counts it in :attr:`CheckpointPins.num_reclaimed` (a leak
caught; 0 unless a path forgot its release), so no path can hold a checkpoint forever.
"""
from __future__ import annotations

from .state_cache import StateCache

__all__ = ['CheckpointPins', 'PinLease', 'PURPOSES']

PURPOSES = ('restore_source', 'save_target', 'store_keep', 'staging')


class PinLease:
    """One pin on checkpoint ``slot``, for ``purpose`` (one of :data:`PURPOSES`), owned by the
    request ``owner`` (a ``seq_id``, or None for a pin that lives within one engine step).

    Use as a context manager to release on every exit path, or call :meth:`release`.
    """

    __slots__ = ('slot', 'purpose', 'owner', '_pins', 'released')

    def __init__(self, pins: CheckpointPins, slot: int, purpose: str, owner: int | None):
        self._pins, self.slot, self.purpose, self.owner, self.released = pins, slot, purpose, owner, False

    def release(self) -> None:
        """Drop the pin.

        Raises:
            RuntimeError: the lease was released already (a path released it twice).
        """
        if self.released:
            raise RuntimeError(f'{self.purpose} pin of checkpoint slot {self.slot} released twice')
        self.released = True
        self._pins._drop(self)

    def __enter__(self) -> PinLease:
        return self

    def __exit__(self, *exc) -> None:
        if not self.released:
            self.release()

    def __repr__(self) -> str:
        state = 'released' if self.released else 'held'
        return f'PinLease(slot={self.slot}, {self.purpose}, owner={self.owner}, {state})'


class CheckpointPins:
    """Hands out and takes back every checkpoint pin of one :class:`StateCache`.

    Args:
        state_cache: the slots whose pin counts this object alone changes; None for a model
            without recurrent state (no checkpoint exists, so :meth:`take` is never called).
    """

    def __init__(self, state_cache: StateCache | None):
        self.state_cache = state_cache
        self._held: dict[int, PinLease] = {}       # id(lease) -> lease, every lease not yet released
        self.num_taken = 0
        self.num_reclaimed = 0      # leases a leaving request still held (should stay 0)

    def take(self, slot: int, purpose: str, owner: int | None = None) -> PinLease:
        """Pin ``slot`` for ``purpose``; the returned lease must be released exactly once."""
        if purpose not in PURPOSES:
            raise ValueError(f'purpose: {purpose!r} is not one of {PURPOSES}')
        lease = PinLease(self, slot, purpose, owner)
        self.state_cache.pin(slot)
        self._held[id(lease)] = lease
        self.num_taken += 1
        return lease

    def _drop(self, lease: PinLease) -> None:
        del self._held[id(lease)]
        self.state_cache.unpin(lease.slot)

    def held(self, owner: int | None = ..., purpose: str | None = None) -> list[PinLease]:
        """Leases not released yet, optionally only ``owner``'s and/or one ``purpose``'s."""
        return [lease for lease in self._held.values()
                if (owner is ... or lease.owner == owner) and (purpose is None or lease.purpose == purpose)]

    @property
    def num_held(self) -> int:
        """Leases not released yet (0 when no request is in flight)."""
        return len(self._held)

    def release_owner(self, owner: int) -> int:
        """Release every lease ``owner`` still holds (it left the engine); returns how many.
        Callers release their own leases first, so each one found here is a reclaimed leak."""
        leases = self.held(owner)
        for lease in leases:
            lease.release()
        self.num_reclaimed += len(leases)
        return len(leases)
