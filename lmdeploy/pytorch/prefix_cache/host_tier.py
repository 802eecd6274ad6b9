"""The host tier of the prefix cache: checkpoints (and their KV blocks) the device tier evicted,
kept in host memory and promoted back on a hit, before the Store is asked.

Order of the tiers a restore asks: device (the block trie), host (this), Store. The host tier
answers the questions of every tier (:class:`~.tier.PrefixTier`) — how deep a prefix does it hold
(:meth:`HostTier.depth`), load it (:meth:`HostTier.load`), keep it (:meth:`HostTier.save`, which
:meth:`HostTier.demote` calls for a checkpoint the device evicts), evict — and owns its bytes::

    device evicts checkpoint at b ──▶ demote → save: state payload under state/{hash_b}, and the
                                      KV payloads of blocks [0, b) not held yet under kv/{hash_i}
    admission (no deeper device hit) ─▶ depth: deepest b with state/{hash_b} held and every KV
                                      block the device does not share held too
    engine, before the forward ──────▶ load: host payloads → fresh device blocks + runtime slot

Payloads are plain CPU tensors (pinned memory on CUDA, so the copies back are asynchronous-capable;
a separate pool on CPU so the path is tested there), least recently used first out when the
tier's ``capacity_bytes`` is exceeded. A demotion happens while the device rows still hold the
evicted data (eviction only frees rows; they are written by a later forward). Without a cache
engine (the benchmark's simulator) only the keys and sizes are kept.

Window rows (``window_rows``: a mixed model whose sliding-window layers keep a pool of their own,
window W): a ``kv`` entry holds the global layers' row of a block, and a prefix at b also needs
``window/{hash_i}`` entries, the sliding layers' rows of only the blocks ``[window_first_block(b, W),
b/B)`` its window reads (the window blocks the device trie kept for the evicted checkpoint; a
checkpoint whose window rows the device no longer holds is not kept). A load writes them into the
window-pool blocks the admission gave the sequence.

Markers (``has_state=False``: a mixed model without recurrent state whose window layers keep their
own pool, so its device tier publishes markers, zero-byte checkpoints): a marker the device evicts
is demoted as a checkpoint is, with an empty ``state`` entry (0 bytes: nothing read or written), the
marker that the prefix's ``kv`` and ``window`` entries are held; a load writes no state, and the
device keeps the promoted prefix as a marker again.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..cache_specs import window_first_block
from ..paging.prefill_plan import ReuseRules
from .block_trie import root_path
from .plans import StoreLoad, StorePut

__all__ = ['HostTier', 'zero_host_counters']


def zero_host_counters() -> dict:
    """The host tier's counters, all 0 (what an engine without a host tier reports)."""
    return {'host_demotions': 0, 'host_promotions': 0, 'host_evictions': 0, 'host_hit_tokens': 0,
            'host_bytes_held': 0}


class HostTier:
    """Host-memory tier of evicted checkpoints and KV blocks.

    Args:
        cache_engine: the device caches payloads are read from and written to (None: bookkeeping
            only, for simulation).
        capacity_bytes: the most payload bytes held.
        block_size: B, tokens per block.
        state_bytes, kv_block_bytes: S and K_blk (the sizes charged per entry).
        window_block_bytes: K_win, bytes of a window entry (with ``window_rows``).
        window_rows: the window (tokens) of a sliding-window group with a pool of its own, or None
            (module docstring).
        has_state: False for a model without recurrent state (markers, module docstring): its
            state entries are empty and ``state_bytes`` must be 0.

    Raises:
        ValueError: ``has_state`` False with ``state_bytes`` not 0.
    """

    name = 'host'

    def __init__(self, cache_engine, capacity_bytes: int, block_size: int, state_bytes: int, kv_block_bytes: int,
                 window_block_bytes: int = 0, window_rows: int | None = None, has_state: bool = True):
        if not has_state and state_bytes:
            raise ValueError(f'state_bytes must be 0 for a model without state (has_state=False), got {state_bytes}')
        self.has_state = has_state
        self.cache_engine = cache_engine
        self.window_block_bytes, self.window_rows = window_block_bytes, window_rows or None
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.state_bytes, self.kv_block_bytes = state_bytes, kv_block_bytes
        self._entries: OrderedDict[tuple[str, bytes], torch.Tensor | None] = OrderedDict()
        self.bytes_held = 0
        self.pin_memory = cache_engine is not None and cache_engine.device.type == 'cuda'
        self.counters = zero_host_counters()
        del self.counters['host_bytes_held']
        # observers told demoting(node) before a demotion's puts and held(key) / dropped(key) as
        # entries come and go, e.g. the KV event tracker (kv_events.HostEventTracker)
        self.listeners: list = []

    def _size(self, kind: str) -> int:
        return {'state': self.state_bytes, 'window': self.window_block_bytes}.get(kind, self.kv_block_bytes)

    def _window_first(self, boundary: int) -> int:
        """The first block whose window entry a prefix of ``boundary`` tokens needs (``boundary / B``:
        none, without window rows)."""
        if not self.window_rows:
            return boundary // self.block_size
        return window_first_block(boundary, self.window_rows, self.block_size)

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        return key in self._entries

    def _put(self, key: tuple[str, bytes], payload: torch.Tensor | None) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if self.pin_memory and payload is not None:
            payload = payload.pin_memory()
        self._entries[key] = payload
        self.bytes_held += self._size(key[0])
        for listener in self.listeners:
            listener.held(key)
        if self.bytes_held > self.capacity_bytes:
            self.evict(self.bytes_held - self.capacity_bytes)

    def evict(self, num_bytes: int) -> int:
        """Drop entries, least recently used first, until ``num_bytes`` payload bytes are freed
        or none is left; returns the bytes freed."""
        freed = 0
        while freed < num_bytes and self._entries:
            old, _ = self._entries.popitem(last=False)
            self.bytes_held -= self._size(old[0])
            freed += self._size(old[0])
            self.counters['host_evictions'] += 1
            for listener in self.listeners:
                listener.dropped(old)
        return freed

    # save -----------------------------------------------------------------------------------
    def demote(self, node, state_ref) -> None:
        """The device tier is evicting the checkpoint on trie ``node`` (its state at
        ``state_ref``): :meth:`save` the prefix it ends. A state larger than the whole tier is
        not kept."""
        if self.state_bytes + self.kv_block_bytes > self.capacity_bytes:
            return
        for listener in self.listeners:
            listener.demoting(node)
        path = root_path(node)
        self.save(StorePut([p.key for p in path], [p.block_id for p in path], len(path) * self.block_size, state_ref,
                           [getattr(p, 'window_block', -1) for p in path] if self.window_rows else None))

    def save(self, put: StorePut) -> None:
        """Keep prefix ``[0, put.boundary)``: the state at ``put.slot`` (read now) and the KV
        blocks of ``put.block_ids`` the tier lacks (those it holds become as recent as the state
        they serve), and with window rows the window rows of ``put.window_block_ids`` its window
        reads (not kept at all when one of them is given back). A state larger than the whole tier
        is not kept."""
        if self.state_bytes + self.kv_block_bytes > self.capacity_bytes:
            return
        full = put.boundary // self.block_size
        hashes, block_ids = put.hashes[:full], put.block_ids[:full]
        wfirst = self._window_first(put.boundary)
        window_ids = list(put.window_block_ids or [])[:full]
        if wfirst < full and (len(window_ids) < full or any(w < 0 for w in window_ids[wfirst:])):
            return      # (its restore would read a window row the device no longer holds)
        missing = [i for i, h in enumerate(hashes) if ('kv', h) not in self._entries]
        for h in hashes:
            if ('kv', h) in self._entries:
                self._entries.move_to_end(('kv', h))
        eng = self.cache_engine
        if eng is not None and missing:
            payloads = eng.read_kv_blocks([block_ids[i] for i in missing])
            for i, payload in zip(missing, payloads):
                self._put(('kv', hashes[i]), payload)
        else:
            for i in missing:
                self._put(('kv', hashes[i]), None)
        wmissing = [i for i in range(wfirst, full) if ('window', hashes[i]) not in self._entries]
        for i in range(wfirst, full):
            if ('window', hashes[i]) in self._entries:
                self._entries.move_to_end(('window', hashes[i]))
        wpayloads = eng.read_window_blocks([window_ids[i] for i in wmissing]) if eng is not None and wmissing else None
        for j, i in enumerate(wmissing):
            self._put(('window', hashes[i]), wpayloads[j] if wpayloads is not None else None)
        self._put(('state', hashes[-1]), eng.read_state(put.slot) if eng is not None and self.has_state else None)
        self.counters['host_demotions'] += 1

    # restore --------------------------------------------------------------------------------
    def probe(self, hashes: list[bytes], rules: ReuseRules, shared_blocks: int, above: int = 0) -> int:
        """:meth:`depth` with the shared blocks given by position."""
        return self.depth(hashes, rules, shared_blocks=shared_blocks, above=above)

    def depth(self, hashes: list[bytes], rules: ReuseRules, *, shared_blocks: int = 0, above: int = 0,
              below: int | None = None) -> int:
        """The deepest restorable boundary ``above < b`` (``< below`` when given; tokens) the tier
        holds for an input whose first ``shared_blocks`` blocks the device shares (the KV of
        blocks ``[0, b/B + r)`` held here or there, and with window rows the window entries of
        b's window here), or 0. Metadata only."""
        B, r = self.block_size, rules.recompute_blocks
        if not self._entries:
            return 0
        for b in rules.restore_candidates(above, len(hashes)):
            if ('state', hashes[b // B - 1]) not in self._entries or (below is not None and b >= below):
                continue
            if all(('kv', h) in self._entries for h in hashes[shared_blocks:b // B + r]) and all(
                    ('window', h) in self._entries for h in hashes[self._window_first(b):b // B]):
                return b
        return 0

    def load(self, load: StoreLoad) -> bool:
        """Copy a held prefix into the device: KV blocks ``[first_block, b/B)`` into
        ``load.block_ids``, the window rows of b's window into ``load.window_block_ids`` (window
        rows) and the state into runtime slot ``load.slot``. False when an entry left the tier
        since the probe (the caller rolls the admission back)."""
        B, hashes = self.block_size, load.hashes
        wfirst = self._window_first(load.boundary)
        keys = [('kv', hashes[i]) for i in range(load.first_block, load.boundary // B)]
        wkeys = [('window', hashes[i]) for i in range(wfirst, load.boundary // B)]
        state_key = ('state', hashes[load.boundary // B - 1])
        if state_key not in self._entries or any(k not in self._entries for k in keys + wkeys):
            return False
        eng = self.cache_engine
        for i, key in zip(range(load.first_block, load.boundary // B), keys):
            if eng is not None:
                eng.write_kv_block(load.block_ids[i], self._entries[key])
            self._entries.move_to_end(key)
        for i, key in zip(range(wfirst, load.boundary // B), wkeys):
            if eng is not None:
                eng.write_window_block(load.window_block_ids[i], self._entries[key])
            self._entries.move_to_end(key)
        if eng is not None and self.has_state:
            eng.write_state(load.slot, self._entries[state_key])
        self._entries.move_to_end(state_key)
        self.counters['host_promotions'] += 1
        return True

    def record_hit(self, tokens: int) -> None:
        """A restore of ``tokens`` tokens from this tier took effect (counted once per request)."""
        self.counters['host_hit_tokens'] += tokens

    def stats(self) -> dict:
        """Counters (demotions, promotions, evictions, hit tokens) and bytes held."""
        return {**self.counters, 'host_bytes_held': self.bytes_held}
