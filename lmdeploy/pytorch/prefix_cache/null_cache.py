"""NullPrefixCache: the prefix cache of an engine that caches no prefixes.

It answers the scheduler's and the engine's questions the way an empty cache that never keeps
anything would: every match is empty, nothing is pinned, loaded, saved or evictable, every
counter is 0. The engine and its scheduler hold one of these instead of ``None`` when
``enable_prefix_caching`` is off, so admission, preemption, release, the step, the ledger and
the stats follow one code path whether or not prefixes are cached.
"""
from __future__ import annotations

from .coordinator import zero_counters
from .plans import LoadPlan, PrefixMatch, SavePlan, StoreLoad

__all__ = ['NullPrefixCache']


class NullPrefixCache:
    """Stands in for :class:`~lmdeploy.pytorch.prefix_cache.coordinator.PrefixCache` with
    prefix caching off. ``caches_prefixes`` is False: the scheduler then plans no save points."""

    caches_prefixes = False
    decode_save_last = False
    num_evictable_blocks = 0
    num_cached_blocks = 0
    store = None
    window_pool = None          # keeps no window rows
    markers = False             # publishes no markers
    num_window_blocks = 0
    num_evictable_window_blocks = 0

    def probe(self, waiting) -> None:
        """No Store to ask."""

    def cached_nodes(self) -> list:
        """No trie: no cached block."""
        return []

    def match(self, seq) -> PrefixMatch:
        """No cached prefix: 0 cached tokens, no shared blocks."""
        return PrefixMatch()

    def pin(self, match: PrefixMatch) -> None:
        """Nothing to hold."""

    def unpin(self, match: PrefixMatch) -> None:
        """Nothing was held."""

    def plan_load(self, seq, match: PrefixMatch, loads: LoadPlan) -> None:
        """Nothing to restore."""

    def loads_done(self, loads: LoadPlan, copied: bool) -> None:
        """No restore was planned."""

    def store_loaded(self, load: StoreLoad, ok: bool) -> None:
        """No Store load was planned."""
        return None

    def restored_kept(self, node, slot: int, copied: bool) -> None:
        """No Store restore is kept."""

    def saves_done(self, saves: SavePlan, copied: bool) -> None:
        """No save was planned."""

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

    def plan_handoff(self, seq):
        """Never asked: a ``role`` other than ``'both'`` needs ``enable_prefix_caching`` (the
        config refuses it otherwise), so no request of a cache-less engine is handed off.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError('a prefill/decode hand-off needs enable_prefix_caching')

    def evict(self, num_blocks: int) -> int:
        """Nothing is cached, so nothing is freed."""
        return 0

    def evict_window(self, num_blocks: int) -> int:
        """No window rows are cached, so nothing is freed."""
        return 0

    def stats(self) -> dict:
        """The prefix cache's counters, all 0 (the engine adds the Store tier's, all 0 too)."""
        return {**zero_counters(), 'checkpoints_skipped': {}}
