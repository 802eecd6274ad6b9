"""The in-memory store of ``/v1/responses`` replies (``store: true``), for ``previous_response_id``
and ``GET`` / ``DELETE /v1/responses/{id}``.

Each entry holds the response body as returned and the conversation it ends (chat messages:
the earlier turns, this turn's input and the reply, without ``instructions``), so a request that
names it continues the same token sequence and reuses the prefix cache past the reply.

Bounds (server flags ``--response-store-max-entries``, ``--response-store-max-bytes``,
``--response-store-ttl``): at most ``max_entries`` entries and ``max_bytes`` bytes (the UTF-8
JSON size of body and messages); an entry older than ``ttl`` seconds is gone. Adding past a
bound evicts the least recently used entries first (a read refreshes recency, not age); an entry
larger than ``max_bytes`` alone is not stored. ``max_entries`` 0 turns the store off. Nothing
outlives the process.

Tenants: an entry belongs to the tenant (API key digest, or None without keys) that stored it;
a lookup by another tenant finds nothing, exactly as for an unknown id, so one key can neither
read, continue nor delete another's responses, nor learn that an id exists.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ['ResponseStore', 'ResponseStoreLimits', 'StoredResponse']


@dataclass(frozen=True)
class ResponseStoreLimits:
    """Bounds of the store (see the module docstring).

    Args:
        max_entries: most stored responses; 0 disables storing.
        max_bytes: most bytes over all entries.
        ttl: seconds an entry lives after it is stored.

    Raises:
        ValueError: a negative bound, or a ttl that is not a positive finite number.
    """
    max_entries: int = 1024
    max_bytes: int = 256 << 20
    ttl: float = 3600.0

    def __post_init__(self):
        if self.max_entries < 0:
            raise ValueError(f'max_entries (--response-store-max-entries) must be >= 0, got {self.max_entries}')
        if self.max_bytes < 0:
            raise ValueError(f'max_bytes (--response-store-max-bytes) must be >= 0, got {self.max_bytes}')
        if not 0 < self.ttl < float('inf'):
            raise ValueError(f'ttl (--response-store-ttl) must be a positive number of seconds, got {self.ttl}')


@dataclass
class StoredResponse:
    """One stored reply: ``body`` (the Response object as returned), ``messages`` (the chat
    conversation it ends), ``created`` (``clock()`` seconds), ``size`` (bytes) and ``owner`` (the
    tenant that stored it; None without API keys)."""
    body: dict
    messages: list[dict]
    created: float
    size: int
    owner: str | None = None


class ResponseStore:
    """A bounded, thread-safe map ``response id -> StoredResponse``.

    Args:
        limits: the bounds.
        clock: seconds (monotonic); injectable for tests.
    """

    def __init__(self, limits: ResponseStoreLimits | None = None, clock=time.monotonic):
        self.limits = limits or ResponseStoreLimits()
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            self._expire()
            return self._bytes

    def put(self, rid: str, body: dict, messages: list[dict], owner: str | None = None) -> bool:
        """Store (or replace) ``rid`` for tenant ``owner``; returns False when it does not fit at
        all, or when ``rid`` is another tenant's (ids are random: only a forged id collides)."""
        size = len(json.dumps([body, messages], ensure_ascii=False).encode())
        with self._lock:
            held = self._entries.get(rid)
            if held is not None and held.owner != owner:
                return False
            self._drop(rid)
            if self.limits.max_entries == 0 or size > self.limits.max_bytes:
                return False
            self._expire()
            while self._entries and (len(self._entries) >= self.limits.max_entries
                                     or self._bytes + size > self.limits.max_bytes):
                self._drop(next(iter(self._entries)))
            self._entries[rid] = StoredResponse(body, messages, self.clock(), size, owner)
            self._bytes += size
            return True

    def get(self, rid: str, owner: str | None = None) -> StoredResponse | None:
        """The entry, or None when unknown, evicted, expired or another tenant's."""
        with self._lock:
            self._expire()
            entry = self._entries.get(rid)
            if entry is None or entry.owner != owner:
                return None
            self._entries.move_to_end(rid)
            return entry

    def delete(self, rid: str, owner: str | None = None) -> bool:
        """Remove ``rid``; False when it was not there (or is another tenant's)."""
        with self._lock:
            self._expire()
            entry = self._entries.get(rid)
            if entry is None or entry.owner != owner:
                return False
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _expire(self) -> None:
        deadline = self.clock() - self.limits.ttl
        for rid in [r for r, e in self._entries.items() if e.created <= deadline]:
            self._drop(rid)
