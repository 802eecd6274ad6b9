"""The byte-level backend protocol the Store tier talks to, and its typed results.

A backend stores opaque values under string keys. The tier (``prefix_cache/store_tier.py``)
never sees a backend's own error codes or counters: every operation returns a typed answer.

- :meth:`StoreBackend.put` says what the Store *gained* (:class:`PutResult`): ``STORED`` only
  when the value now under the key is this call's value and was not there before, so the tier
  counts bytes and objects from ``PutResult.gained`` and the counts are exactly what the Store
  gained, with any number of concurrent writers. Values are expected to start with bytes that
  are unique per writer (the object header's writer id, :mod:`.object_format`); that is how a
  backend whose put keeps the first value tells whose value it kept.
- ``put(..., replace=True)`` overwrites: the tier uses it only for a key whose object it found
  unusable (rejected at load), and the answer is ``REPAIRED``.
- A backend repairs a half-written object itself: when its put reports success but the key
  stays absent (a writer killed mid-put left an incomplete object that blocks the key), it
  replaces the object and answers ``REPAIRED``.
- :meth:`StoreBackend.batch_exists` returns None when the query failed (never "absent"), so
  a failure is never mistaken for a miss and nothing diffs shared counters.

Optional methods, used when a backend has them (``hasattr``), so a backend without them keeps
working:

- ``put_many(items: list[tuple[str, bytes, bool]]) -> list[PutResult]``: put several
  ``(key, value, replace)`` at once, one result per item in order, each with the meaning of
  :meth:`StoreBackend.put` (e.g. the folder backend syncs a whole batch once). Without it the
  tier calls ``put`` per item, stopping at the first failure.
- ``trip() -> None``: the caller saw a call miss its deadline; fail operations at once until
  the backend's own health probe finds the Store answering again.

Every method may block (a Store that stopped answering); the tier bounds the calls made on the
engine thread with a deadline and lets only its writer threads wait on puts. A backend is called
from several threads at once.

Implementations: :class:`.mooncake_client.StoreClient` (Mooncake), :class:`.file_backend.FileStore`
(a local folder), :class:`.mooncake_client.FakeStoreClient` (a dict, for fault tests).
"""
from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

__all__ = ['PutResult', 'StoreBackend']


class PutResult(enum.Enum):
    """What one put did to the Store."""
    STORED = 'stored'       # the key now holds this call's value, which it did not hold before
    REPAIRED = 'repaired'   # as STORED, replacing an incomplete or unusable object under the key
    EXISTS = 'exists'       # a complete value was there already (maybe another writer's): nothing gained
    FAILED = 'failed'       # nothing is known to be stored (counted by the backend)

    @property
    def gained(self) -> bool:
        """True when the Store gained this call's value (count its bytes)."""
        return self in (PutResult.STORED, PutResult.REPAIRED)

    @property
    def ok(self) -> bool:
        """True when the key now holds a complete value (this call's or another writer's)."""
        return self is not PutResult.FAILED


@runtime_checkable
class StoreBackend(Protocol):
    """Bytes in, bytes out; no method raises after the backend was opened."""

    @property
    def available(self) -> bool:
        """False when closed or known to be unreachable right now."""

    def put(self, key: str, value, *, replace: bool = False) -> PutResult:
        """Store ``value`` (bytes-like) under ``key`` unless a complete value is there
        (``replace=True``: overwrite it)."""

    def get(self, key: str) -> bytes | None:
        """The value under ``key``; None when it is missing or cannot be read."""

    def batch_exists(self, keys: list[str]) -> list[bool] | None:
        """Per key, whether a complete value is stored; None when the query failed."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a complete value (False also when the query failed)."""

    def remove(self, key: str) -> bool:
        """Remove ``key``; True when it is gone afterwards."""

    def close(self) -> None:
        """Release the backend (idempotent)."""
