"""NullPrefixCache: the prefix cache of an engine that caches no prefixes.

It answers the scheduler's questions the way an empty cache that never keeps anything would:
every match is empty, nothing is pinned, loaded, saved or evictable. The scheduler holds one of
these instead of ``None`` when ``enable_prefix_caching`` is off, so admission, preemption and
release follow one code path whether or not prefixes are cached.
"""
from __future__ import annotations

from .plans import LoadPlan, PrefixMatch, SavePlan

__all__ = ['NullPrefixCache']


class NullPrefixCache:
    """Stands in for :class:`~lmdeploy.pytorch.prefix_cache.coordinator.PrefixCache` with
    prefix caching off. ``caches_prefixes`` is False: the scheduler then plans no save points."""

    caches_prefixes = False
    decode_save_last = False
    num_evictable_blocks = 0
    store = None

    def match(self, seq) -> PrefixMatch:
        """No cached prefix: 0 cached tokens, no shared blocks."""
        return PrefixMatch()

    def pin(self, match: PrefixMatch) -> None:
        """Nothing to hold."""

    def unpin(self, match: PrefixMatch) -> None:
        """Nothing was held."""

    def plan_load(self, seq, match: PrefixMatch, loads: LoadPlan) -> None:
        """Nothing to restore."""

    def plan_saves(self, chunks, saves: SavePlan) -> None:
        """Nothing is saved."""

    def finish_turn(self, seq, saves: SavePlan) -> None:
        """No turn-end checkpoint."""

    def release(self, seq, cache_blocks: bool) -> None:
        """No block is cached: the scheduler frees them all."""

    def forget(self, seq) -> None:
        """No per-request bookkeeping."""

    def requeued(self, seq) -> None:
        """Nothing to ask again."""

    def evict(self, num_blocks: int) -> int:
        """Nothing is cached, so nothing is freed."""
        return 0
