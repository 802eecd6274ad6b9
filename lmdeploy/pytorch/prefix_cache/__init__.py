"""The prefix cache: which prefixes can be reused, from where, and what to save.

Folder map (where to look)::

    ../paging/prefill_plan.py   where a save point is chosen (ReuseRules, plan_prefill: pure)
    plans.py                    the plans the engine executes (restores, saves, Store puts)
    coordinator.py              PrefixCache: local tier first, then host, then the Store; per-request bookkeeping
    tier.py                     PrefixTier: what every tier answers; NullTier: a tier not configured
    null_cache.py               NullPrefixCache: what the scheduler holds with prefix caching off
    local_tier.py               LocalTier: block trie + checkpoint slots, pins, node ↔ slot links
    pins.py                     CheckpointPins: the one owner of checkpoint pins (leases, released once)
    block_trie.py               chained block hashes, verified match, LRU eviction
    state_cache.py              runtime and checkpoint state slots
    host_tier.py                HostTier: checkpoints the device evicted, in host memory
    store_tier.py               StoreTier: probe / load / put of Store objects, the put worker
    kv_events.py                KVEventTracker: what a KV-aware router may know (restorable prefixes only)
    ../cache_engine.py          where state is copied (copy_states) and payloads are read/written
    ../store/                   Mooncake bytes: object format, client, embedded services

Every tier answers the same questions — how deep a prefix do you hold (metadata only), load it,
save it, evict (:mod:`.tier`) — and the scheduler sees them only through :class:`PrefixCache`.
"""
from .coordinator import STORE_RESTORE_ATTEMPTS, PrefixCache
from .local_tier import LocalTier
from .null_cache import NullPrefixCache
from .plans import (CheckpointRestore, CheckpointSave, LoadPlan, PrefixMatch, SavePlan, StoreLoad, StorePut)

__all__ = ['PrefixCache', 'NullPrefixCache', 'LocalTier', 'STORE_RESTORE_ATTEMPTS', 'PrefixMatch', 'CheckpointRestore', 'StoreLoad',
           'LoadPlan', 'CheckpointSave', 'StorePut', 'SavePlan']
