"""The prefix cache as the scheduler sees it: the device tier first, then host memory, then the Store.

:class:`PrefixCache` asks each tier the same questions and keeps the per-sequence cache
bookkeeping (block hashes, the Store's answer for a waiting sequence, how many Store restores
failed for it), so :class:`~lmdeploy.pytorch.paging.sequence.Sequence` holds only tokens,
progress and the resources the forward needs::

    probe (engine, before schedule)  Store existence queries for newly waiting sequences
    match                            local trie + checkpoints, then the host tier, then the probed Store boundaries
    pin / unpin                      shared blocks + checkpoint   (unpin: the one rollback path)
    plan_load                        CheckpointRestore | StoreLoad          ─┐ executed by the
    loads_done / store_loaded        unpin; keep a Store restore locally     │ engine, which
    plan_saves                       new full blocks → trie; save points →   │ reports back
                                     CheckpointSave + StorePut              ─┘
    finish_turn                      publish the turn-end checkpoint (decode_save_last)
    release / forget                 cache computed blocks; drop bookkeeping

Turn-end checkpoints (``decode_save_last``): the state at each block boundary a request reaches
from its prompt's last one on (the scheduler ends a prefill forward there) is copied into one
staging slot of that request (one row copy per B tokens); when it finishes, the last copy is
published at that boundary and put to the Store with its unsaved KV blocks. Such a boundary is a multiple of B, not of A, so with the policy
on, restores accept any block boundary that satisfies the other reusability rules.

The turn-end put comes on top of the Store puts of the prefill save points, which are made at
once as without the policy: the turn-end state serves only the exact continuation of the reply,
while the prompt's last save point serves a regenerate of the same prompt, another conversation
asking it, or an edited reply — so ``decode_save_last`` never restores less from the Store than
``prefill_save_last_only`` alone, for one more state snapshot per turn
(benchmark/store_follow_ups.py compares it with putting the turn end instead).

Checkpoint pins are leases of the local tier's :class:`~.pins.CheckpointPins` (its module
lists who takes and releases each); a request leaving (:meth:`PrefixCache.release`,
:meth:`PrefixCache.forget`) has any lease it still owns reclaimed.

A Store restore whose load fails is rolled back by the scheduler and retried below the failed
boundary, at most :data:`STORE_RESTORE_ATTEMPTS` times per request.

Prefill/decode hand-off (:mod:`~lmdeploy.pytorch.paging.handoff`): a prefill engine's request
ends at its hand-off point h (unaligned), and :meth:`PrefixCache.plan_handoff` plans the put of
the KV blocks below ``floor_B(h)`` plus one hand-off object keyed by :func:`handoff_digest` (the
hash of the full blocks, chained with the tail tokens ``[floor_B(h), h)`` and the images among
them). A decode engine's probe asks for that object (and the KV objects below it) first; found,
the admission restores exactly h tokens from it; missing or failing to load, the request takes
the ordinary path (a shallower aligned restore, or computing the prompt), never a wrong answer.
A hand-off restore is never kept as a local checkpoint (the trie holds whole blocks only).

Sliding windows (``window``: :func:`~lmdeploy.pytorch.cache_specs.kv_window`, every paged layer
slides): a restore at b needs only the blocks from
:func:`~lmdeploy.pytorch.cache_specs.window_first_block` on (:attr:`PrefixMatch.first_block`);
the ones before it are neither attached nor loaded, so a restored sequence holds its window,
not its whole prefix. A model of global and sliding layers whose window layers keep a pool of their
own (``local.window_pool``) restores locally from window rows (:class:`~.local_tier.LocalTier`): the
restored sequence attaches the window blocks of its boundary's window
(:attr:`PrefixMatch.window_blocks`); a host or Store restore of such a model loads the rows of its
boundary's window into fresh window-pool blocks (:attr:`PrefixMatch.window_first` on), and its
saves carry the window table (:class:`~.plans.StorePut`). A model without state puts its prefixes
to the Store too: at each save point b of the turn's plan that a chunk passed (no forward needs to
end there), the blocks b needs (with window rows: the global rows below b and the window rows of
b's window) and an empty state object (a marker that they are all stored). The plan is the default
policy's, or with markers the turn's policy; the marker a stateless mixed model adds at its
prompt's last block boundary (``PrefillPlan.local_only``) is not put, as a hybrid's prefill saves
nothing there, but its turn-end marker is, as a hybrid's turn-end checkpoint.

A model of global and sliding layers without state whose window layers keep a pool of their own
(``local.markers``) publishes a zero-byte checkpoint, a *marker*, at each save point of its plan
that a chunk passed (:meth:`LocalTier.save_marker <.local_tier.LocalTier.save_marker>`), right
after that forward: there is nothing to copy. Markers count as checkpoints saved. A host or Store
restore of such a model is kept as a marker published at once (:meth:`PrefixCache.store_loaded`,
:meth:`LocalTier.restored_marker <.local_tier.LocalTier.restored_marker>`), keeping the window rows
the load wrote; its restores accept any block boundary, from every tier.
"""
from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass

from ..cache_specs import window_first_block
from ..multimodal import block_extra_keys
from ..paging.prefill_plan import ReuseRules
from .block_trie import chain_block_hashes, salted_root
from .eviction import SAVE_REASONS
from .local_tier import LocalTier
from .plans import CheckpointRestore, HandoffPut, LoadPlan, PrefixMatch, SavePlan, StateSnapshot, StoreLoad, StorePut
from .tier import NullTier

logger = logging.getLogger('lmdeploy')

__all__ = ['PrefixCache', 'STORE_RESTORE_ATTEMPTS', 'zero_counters', 'handoff_digest']

STORE_RESTORE_ATTEMPTS = 3   # failed Store loads per request before it stops asking the Store
_PROBES_PER_STEP = 64        # waiting sequences probed per step at most (each once per attempt)


def zero_counters() -> dict:
    """The prefix cache's cumulative counters (tokens, checkpoints, evictions), all 0: what
    :meth:`PrefixCache.stats` starts from, and what an engine without a prefix cache reports."""
    return {'prefix_cache_queried_tokens': 0, 'prefix_cache_hit_tokens': 0, 'checkpoints_saved': 0,
            'state_miss_tokens': 0, 'turn_end_checkpoints_saved': 0, 'junction_checkpoints_saved': 0,
            'shared_head_checkpoints_saved': 0, 'handoff_misses': 0,
            'checkpoints_saved_by_reason': {r: 0 for r in SAVE_REASONS},
            'prefix_cache_evictions': {'checkpoint': 0, 'kv': 0}}


def handoff_digest(prev: bytes, tail: list[int], extra: bytes = b'') -> bytes:
    """The 16-byte hash of a hand-off at h tokens: ``blake2b(prev ‖ b'handoff' ‖ len(tail) ‖ tail
    token ids as little-endian uint32 ‖ extra)``, where ``prev`` is the chained hash of the full
    blocks below ``floor_B(h)`` (the salted root when there is none), ``tail`` the tokens
    ``[floor_B(h), h)`` and ``extra`` the multimodal keys of the images among them. The marker
    keeps it apart from every block hash."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(b'handoff' + struct.pack('<I', len(tail)))
    h.update(struct.pack(f'<{len(tail)}I', *tail))
    h.update(extra)
    return h.digest()


@dataclass
class _Staging:
    """A request's turn-end staging slots and the boundary whose state each holds (0: none
    yet). One slot; two for a request with stop strings, copied into alternately, so the state
    one block before the last boundary survives for a stop string whose tokens cross it."""
    slots: list[int]
    boundaries: list[int]
    leases: list      # the staging pin of each slot (PinLease)

    def next_slot(self) -> int:
        """Index of the slot the next copy overwrites: the one holding the older boundary."""
        return self.boundaries.index(min(self.boundaries))


@dataclass
class _StoreView:
    """The Store's answer for one waiting sequence."""
    boundary: int | None = None           # the deepest restorable boundary, 0 if none (None: not probed)
    below: int | None = None              # only boundaries below this (lowered by failed loads)
    failures: int = 0
    handoff: bytes | None = None          # the hand-off object's hash when ``boundary`` is a hand-off


class PrefixCache:
    """Coordinator of the device, host and Store tiers (:mod:`.tier`): it asks each the same
    questions and reaches inside none.

    Args:
        local: the device tier.
        store: the Store tier, or None.
        host: the host tier, or None (then a :class:`~.tier.NullTier` that holds nothing).
        block_size: B, tokens per block.
        alignment: A, prefill checkpoint boundaries are multiples of A.
        decode_save_last: keep a turn-end checkpoint of every finished request (hybrid models).
        window: the model's sliding window when every paged layer slides (tokens), else None:
            a restore attaches and loads only the blocks the window reads.
    """

    caches_prefixes = True    # the scheduler plans save points (see NullPrefixCache for off)

    def __init__(self, local: LocalTier, store=None, *, block_size: int, alignment: int,
                 decode_save_last: bool = False, host=None, window: int | None = None):
        self.local = local
        self.window = window or None
        self.store = store
        self.host = host if host is not None else NullTier('host')     # (a tier not configured holds nothing)
        if host is not None:
            local.on_checkpoint_evicted(host.demote)
        self.block_size = block_size
        self.alignment = alignment
        self.decode_save_last = decode_save_last and local.is_hybrid
        # zero-byte checkpoints of a stateless mixed model (the scheduler plans their save points)
        self.markers = local.markers
        # their turn-end form: no forward needs to end at the boundary (nothing is copied), so
        # the scheduler's chunks stay as they are (``decode_save_last`` stays False for it)
        self.turn_end_markers = decode_save_last and local.markers
        # turn-end checkpoints sit on block boundaries: restores then accept any block boundary;
        # so do markers (a prompt's last block boundary), from the host tier or the Store too
        self.restore_alignment = block_size if self.decode_save_last or self.markers else alignment
        self._hashes: dict[int, list[bytes]] = {}
        self._store_views: dict[int, _StoreView] = {}
        self._staging: dict[int, _Staging] = {}
        self._continuation: dict[int, bool] = {}      # seq_id -> its admission continued a cached prefix
        self.counters: dict[str, int] = zero_counters()
        self.skipped: dict[str, int] = {}

    def hashes(self, seq) -> list[bytes]:
        """Chained hashes of ``seq``'s full blocks, computed incrementally; an image's content hash
        enters the hash of the block holding its first token (and so every later one), the
        request's ``cache_salt`` the first block's (so every one)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        full = seq.num_tokens // self.block_size
        if len(hashes) < full:
            extra = block_extra_keys(seq.multimodal, full, self.block_size) if seq.multimodal else None
            hashes[:] = chain_block_hashes(seq.token_ids, self.block_size, full, extra_keys=extra, prefix=hashes,
                                           salt=seq.gen_config.cache_salt)
        return hashes

    def handoff_hash(self, seq) -> bytes:
        """:func:`handoff_digest` of ``seq`` at its hand-off point (``seq.handoff.point``)."""
        B, point = self.block_size, seq.handoff.point
        full = point // B
        hashes = self.hashes(seq)[:full]
        prev = hashes[-1] if hashes else salted_root(seq.gen_config.cache_salt)
        extra = b''
        if seq.multimodal:      # images wholly below h whose span starts in the partial block
            keys = block_extra_keys([m for m in seq.multimodal if m.end <= point], full + 1, B)
            extra = keys[full] if keys else b''
        return handoff_digest(prev, list(seq.token_ids[full * B:point]), extra)

    def plan_handoff(self, seq) -> HandoffPut:
        """The put of a prefill engine's hand-off: ``seq`` computed exactly ``seq.handoff.point``
        tokens (the engine submits it to the Store tier before the blocks are released)."""
        B, point = self.block_size, seq.handoff.point
        full = point // B
        return HandoffPut(self.hashes(seq)[:full], seq.block_ids[:full], point,
                          seq.block_ids[full] if point % B else None, self.handoff_hash(seq), seq.state_slot,
                          seq.handoff)

    def _rules(self, seq) -> ReuseRules:
        """The rules a restore of ``seq`` must satisfy now."""
        return ReuseRules.for_sequence(seq, self.block_size, self.restore_alignment)

    # before admission (engine) -----------------------------------------------------------
    def probe(self, waiting) -> None:
        """Ask the Store which prefixes it holds for waiting sequences not probed yet (network:
        batched existence queries). Called by the engine before :meth:`Scheduler.schedule`."""
        if self.store is None:
            return
        probed = 0
        for seq in waiting:
            view = self._store_views.setdefault(seq.seq_id, _StoreView())
            if view.boundary is not None or view.failures >= STORE_RESTORE_ATTEMPTS:
                continue
            handoff = seq.handoff
            if handoff is not None and handoff.role == 'decode' and handoff.point and not view.failures:
                digest = self.handoff_hash(seq)
                handoff.key = self.store.handoff_key(digest)
                if self.store.has_handoff(self.hashes(seq)[:handoff.point // self.block_size], digest):
                    view.boundary, view.handoff = handoff.point, digest
                    probed += 1
                    continue
            view.boundary = self.store.depth(self.hashes(seq), self._rules(seq), below=view.below)
            probed += 1
            if probed >= _PROBES_PER_STEP:
                break

    # admission (scheduler) ---------------------------------------------------------------
    def match(self, seq) -> PrefixMatch:
        """The deepest prefix the tiers can restore for ``seq`` (metadata only), and the first
        block it needs (:attr:`PrefixMatch.first_block`, the window rule)."""
        match = self._match(seq)
        match.first_block = window_first_block(match.cached_tokens, self.window, self.block_size)
        return match

    def _match(self, seq) -> PrefixMatch:
        match = self.local.match(seq, self.hashes(seq), self._rules(seq))
        b = self.host.depth(self.hashes(seq), self._rules(seq), shared_blocks=len(match.nodes),
                            above=match.cached_tokens)
        if b > match.cached_tokens:
            match = PrefixMatch(match.nodes, b, self.host.name, None, min(len(match.nodes), b // self.block_size),
                                match.matched_tokens, window_first=self._window_first(b))
        view = self._store_views.get(seq.seq_id)
        if view is not None and view.boundary and view.failures < STORE_RESTORE_ATTEMPTS:
            b = view.boundary
            if b > match.cached_tokens:
                shared = min(len(match.nodes), b // self.block_size)
                return PrefixMatch(match.nodes, b, 'store', None, shared, match.matched_tokens,
                                   window_first=self._window_first(b) if view.handoff is None else 0)
        return match

    def _window_first(self, b: int) -> int:
        """Window rows: the first block of b's window, whose rows a host or Store restore at b loads
        into fresh window-pool blocks (the entries before it are FREED_BLOCK); 0 without them."""
        if self.local.window_pool is None:
            return 0
        return window_first_block(b, self.local.window, self.block_size)

    def pin(self, match: PrefixMatch) -> None:
        """Hold what ``match`` restores from (shared blocks, checkpoint) during admission."""
        self.local.pin(match)

    def unpin(self, match: PrefixMatch) -> None:
        """Roll back :meth:`pin`."""
        self.local.unpin(match)

    def plan_load(self, seq, match: PrefixMatch, loads: LoadPlan) -> None:
        """Add the restore of a committed admission to ``loads`` (``seq`` holds its slot and
        blocks through the first chunk), and tell the eviction policy which checkpoint it uses."""
        continued = self.local.record_use(match, self.hashes(seq), self.alignment)
        self._continuation[seq.seq_id] = bool(continued or match.matched_tokens or getattr(seq, 'continuation', False))
        if match.source in ('store', 'host'):
            hashes = self.hashes(seq)[:match.cached_tokens // self.block_size]
            view = self._store_views.get(seq.seq_id)
            handoff = view.handoff if view is not None and match.source == 'store' else None
            load = StoreLoad(seq, match.cached_tokens, hashes, seq.block_ids,
                             max(match.num_shared_blocks, match.first_block), seq.state_slot, match.matched_tokens,
                             handoff, seq.window_block_ids if self.local.window_pool is not None else None)
            (loads.store_loads if match.source == 'store' else loads.host_loads).append(load)
            return      # counted once the load succeeded
        if match.checkpoint_slot is not None:
            loads.restores.append(CheckpointRestore(seq, match.checkpoint_slot, seq.state_slot, match.lease))
            match.lease.owner, match.lease = seq.seq_id, None    # the restore (of seq) owns the pin now
        elif match.lease is not None:       # a marker: nothing to copy, so the admission's pin ends here
            match.lease.release()
            match.lease = None
        self._count(seq, match.cached_tokens, match.source, match.matched_tokens)

    def _count(self, seq, cached: int, source: str | None, matched: int) -> None:
        """Count a lookup once per request: at its first admission that took effect."""
        if len(seq.stats.plans) != 1:
            return
        seq.num_cached_tokens = cached
        self.counters['prefix_cache_queried_tokens'] += seq.num_tokens
        if source == 'local':
            seq.stats.hit_tokens = cached
            self.counters['prefix_cache_hit_tokens'] += cached
        elif source == 'store':
            seq.stats.store_hit_tokens = cached
            self.store.record_hit(cached)
        elif source == 'host':
            seq.stats.hit_tokens = cached
            self.host.record_hit(cached)
        # (0 for a model without state: its blocks need no checkpoint, so it restores all it matched)
        self.counters['state_miss_tokens'] += max(0, matched - cached)
        handoff = seq.handoff
        if handoff is not None and handoff.role == 'decode' and handoff.point and cached < handoff.point:
            # no hand-off restored: missing, rejected, or the prefill engine wrote another namespace
            self.counters['handoff_misses'] += 1
            logger.info('decode: no hand-off of %d tokens restored (%d computed from %d); is the prefill engine '
                        'writing to this Store with the same model, dtype and block size?', handoff.point,
                        seq.num_tokens - cached, cached)

    def loads_done(self, loads: LoadPlan, copied: bool) -> None:
        """The checkpoint → runtime copies of ``loads`` ran (or raised): drop their pins."""
        for restore in loads.restores:
            restore.lease.release()

    def host_loaded(self, load: StoreLoad, ok: bool) -> tuple | None:
        """Book a host-tier load's result as :meth:`store_loaded` does (a failed one — an entry
        the host tier dropped since the probe — just rolls back; the next admission asks again)."""
        if not ok:
            return None
        self._count(load.seq, load.boundary, 'host', load.matched_tokens)
        return self._keep_restored(load.seq, load.boundary)

    def store_loaded(self, load: StoreLoad, ok: bool) -> tuple | None:
        """Book a Store load's result. On success count the hit (first admission only) and
        return ``(node, lease)`` when the restored state should also become a local checkpoint
        (the engine copies ``load.slot`` into ``lease.slot``, then calls :meth:`restored_kept`).
        On failure only boundaries below the failed one are tried again."""
        seq = load.seq
        view = self._store_views.setdefault(seq.seq_id, _StoreView())
        if not ok:
            view.failures += 1
            view.below, view.boundary, view.handoff = load.boundary, None, None
            return None
        self._store_views.pop(seq.seq_id, None)
        self._count(seq, load.boundary, 'store', load.matched_tokens)
        if load.handoff is not None:
            seq.handoff.restored = load.boundary
            self.store.record_handoff(load.boundary)
            return None     # (an unaligned boundary: no trie node to keep it on)
        return self._keep_restored(seq, load.boundary)

    def _keep_restored(self, seq, boundary: int) -> tuple | None:
        """Keep a host or Store restore of ``seq`` at ``boundary`` locally: a hybrid's as a
        checkpoint the engine copies the restored state into (``(node, lease)``, then
        :meth:`restored_kept`); a marker model's as a marker published now (nothing to copy: None)."""
        if not self.markers:
            return self.local.cache_restored(seq, self.hashes(seq), boundary)
        saved = self.local.restored_marker(seq, self.hashes(seq), boundary)
        if isinstance(saved, str):
            self._skip(seq, saved)
        else:
            self._count_save('restored')
        return None

    def restored_kept(self, node, lease, copied: bool) -> None:
        """Publish the local copy of a Store restore (or release it if the copy raised, or if
        another restore of the same prefix in this step published its copy first)."""
        lease.release()
        slot = lease.slot
        stats = self.local.checkpoint_stats(node, node.depth * self.block_size, 'restored') if copied else None
        if self.local.publish_checkpoint(slot, node, stats):
            self._count_save('restored')

    # after the forward (scheduler) -------------------------------------------------------
    def plan_saves(self, chunks, saves: SavePlan) -> None:
        """Cache the new full blocks of this step's chunks and plan the saves at save points
        (and, with ``decode_save_last``, the staging copies at block boundaries)."""
        B, taken = self.block_size, set()
        for chunk in chunks:
            seq, end = chunk.seq, chunk.end
            if not self.local.is_hybrid:
                self._plan_block_saves(chunk, saves)
                continue
            save = seq.plan is not None and seq.plan.is_save_point(end)
            full = end // B
            if self.decode_save_last and not save and end % B == 0 and end >= seq.num_prompt_tokens // B * B:
                self._stage(seq, end, saves)
            if not save and not self.local.needs_extend(seq, full):
                continue
            node = self.local.extend(seq, self.hashes(seq), full)
            if not save:
                continue
            planned = self.local.plan_checkpoint(seq, node, end, taken, self._save_reason(seq, end),
                                                 self._continuation.get(seq.seq_id, False))
            if isinstance(planned, str):
                self._skip(seq, planned)
            else:
                taken.add(id(node))
                saves.checkpoints.append(planned)
            if self.store is not None:
                saves.store_puts.append(StorePut(self.hashes(seq)[:full], seq.block_ids[:full], end, seq.state_slot,
                                                 self._window_table(seq, full)))

    def _plan_block_saves(self, chunk, saves: SavePlan) -> None:
        """A model without state: cache the chunk's new full blocks, and put (and, with markers,
        publish a marker at) each save point ``b`` the chunk passed (``start < b <= end``: its
        blocks are computed and, sliding or not, still held, since a sequence gives back only
        blocks no query from ``start`` on reads). The plan's ``local_only`` point (the marker at
        the prompt's last full block boundary) is not put: the Store gets what a hybrid's
        prefill puts, the save points of the turn's policy."""
        seq, B = chunk.seq, self.block_size
        full = chunk.end // B
        if self.local.needs_extend(seq, full):
            self.local.extend(seq, self.hashes(seq), full)
        if self.turn_end_markers and chunk.start < full * B and full * B >= seq.num_prompt_tokens // B * B:
            # the deepest block boundary the chunk passed, from the prompt's last one on: where
            # a turn-end marker may fall; its window blocks are still held now
            self.local.stage_window(seq, self.local.extend(seq, self.hashes(seq), full),
                                    2 if seq.stop_strings is not None else 1)
        if (self.store is None and not self.markers) or seq.plan is None:
            return
        for b in seq.plan.save_points:
            if not chunk.start < b <= chunk.end:
                continue
            if self.markers:
                self._save_marker(seq, b)
            if self.store is not None and b != seq.plan.local_only:
                saves.store_puts.append(StorePut(self.hashes(seq)[:b // B], seq.block_ids[:b // B], b, None,
                                                 self._window_table(seq, b // B)))

    def _window_table(self, seq, full: int) -> list[int] | None:
        """The first ``full`` entries of ``seq``'s window-group table when the window layers keep
        a pool of their own (a copy: the table changes after this step), else None."""
        return list(seq.window_block_ids[:full]) if self.local.window_pool is not None else None

    def _save_marker(self, seq, boundary: int) -> None:
        """Publish a marker of ``seq`` at ``boundary`` (counted as a checkpoint saved), or count
        why it is skipped."""
        node = self.local.extend(seq, self.hashes(seq), boundary // self.block_size)
        reason = self._save_reason(seq, boundary)
        saved = self.local.save_marker(seq, node, boundary, reason, self._continuation.get(seq.seq_id, False))
        if isinstance(saved, str):
            self._skip(seq, saved)
            return
        seq.stats.save_points.append(boundary)
        self.counters['checkpoints_saved'] += 1
        self._count_save(reason)

    @staticmethod
    def _save_reason(seq, end: int) -> str:
        """Why the plan of ``seq`` saves at ``end`` (one of :data:`~.eviction.SAVE_REASONS`)."""
        plan = seq.plan
        if end == plan.junction:
            return 'junction'
        if end == getattr(plan, 'shared_head', None):
            return 'shared_head'
        return 'prefill_last' if end == max(plan.save_points) else 'prefill'

    def _count_save(self, reason: str) -> None:
        by_reason = self.counters['checkpoints_saved_by_reason']
        by_reason[reason] = by_reason.get(reason, 0) + 1

    def _stage(self, seq, boundary: int, saves: SavePlan) -> None:
        staging = self._staging.get(seq.seq_id)
        if staging is None:
            slot = self.local.alloc_checkpoint()
            if slot is None:
                return          # no slot now; a later boundary tries again
            staging = self._staging[seq.seq_id] = _Staging([slot], [0], [self._stage_lease(seq, slot)])
        if len(staging.slots) == 1 and staging.boundaries[0] and seq.stop_strings is not None:
            slot = self.local.alloc_checkpoint()    # none free: one slot, as without stop strings
            if slot is not None:
                staging.slots.append(slot)
                staging.boundaries.append(0)
                staging.leases.append(self._stage_lease(seq, slot))
        saves.snapshots.append(StateSnapshot(seq, seq.state_slot, staging.slots[staging.next_slot()], boundary))

    def _stage_lease(self, seq, slot: int):
        return self.local.take_pin(slot, 'staging', seq.seq_id)

    def saves_done(self, saves: SavePlan, copied: bool) -> None:
        """Publish checkpoints whose copy ran (never before); ``copied=False`` releases their
        slots unpublished and counts the skips. Staging copies record their boundary."""
        for save in saves.checkpoints:
            self.local.checkpoint_done(save, copied)
            if copied:
                save.seq.stats.save_points.append(save.boundary)
                self.counters['checkpoints_saved'] += 1
                self._count_save(save.reason)
                if save.seq.plan is not None and save.boundary == save.seq.plan.junction:
                    self.counters['junction_checkpoints_saved'] += 1
                if save.seq.plan is not None and save.boundary == save.seq.plan.shared_head:
                    self.counters['shared_head_checkpoints_saved'] += 1
            else:
                self._skip(save.seq, 'copy_failed')
        for snap in saves.snapshots:
            staging = self._staging.get(snap.seq.seq_id)
            if staging is not None and snap.dst in staging.slots:
                staging.boundaries[staging.slots.index(snap.dst)] = snap.boundary if copied else 0

    def finish_turn(self, seq, saves: SavePlan) -> None:
        """``seq`` finished: publish its turn-end checkpoint at the last block boundary of its
        computed tokens (if a forward ended there) and plan its Store put. A reply ended by a stop string counts only
        the tokens wholly before the stop string (``seq.num_kept_tokens``): a checkpoint past
        the cut would hold text no next turn sends. With markers (a model without state), a
        turn-end marker at a boundary :meth:`LocalTier.stage_window` kept."""
        if self.turn_end_markers:
            self._publish_turn_end_marker(seq, saves)
            return
        self._publish_turn_end(seq, saves)

    def _publish_turn_end_marker(self, seq, saves: SavePlan) -> None:
        """Publish ``seq``'s turn-end marker and plan its Store put, as a hybrid puts its turn-end
        checkpoint: also where the turn's own local-only marker (the prompt's last block boundary,
        which a hybrid's prefill does not save) already is, never at or below the restored prefix.
        The Store tier skips the put when ``seq`` gave back a window block it reads (a decode past
        the boundary's window), as a hybrid's."""
        tokens = seq.num_computed_tokens
        if seq.num_kept_tokens is not None:
            tokens = min(tokens, seq.num_kept_tokens)
        boundary = tokens // self.block_size * self.block_size
        if boundary == 0 or boundary not in self.local.staged_boundaries(seq):
            return
        node = self.local.extend(seq, self.hashes(seq), boundary // self.block_size)
        saved = self.local.save_marker(seq, node, boundary, 'turn_end', True)
        plan = seq.plan
        put = (self.store is not None and plan is not None and boundary > plan.cached_tokens
               and (not isinstance(saved, str) or (saved == 'exists' and boundary == plan.local_only)))
        if isinstance(saved, str):
            self._skip(seq, saved)
        else:
            seq.stats.turn_end_point = boundary
            self.counters['turn_end_checkpoints_saved'] += 1
            self._count_save('turn_end')
        if put:
            full = boundary // self.block_size
            saves.store_puts.append(StorePut(self.hashes(seq)[:full], seq.block_ids[:full], boundary, None,
                                             self._window_table(seq, full)))

    def _publish_turn_end(self, seq, saves: SavePlan) -> bool:
        """Publish ``seq``'s turn-end checkpoint; True when its Store put is planned."""
        staging = self._staging.get(seq.seq_id)
        tokens = seq.num_computed_tokens
        if seq.num_kept_tokens is not None:
            tokens = min(tokens, seq.num_kept_tokens)
        boundary = tokens // self.block_size * self.block_size
        if staging is None or boundary not in staging.boundaries or boundary == 0:
            return False
        node = self.local.extend(seq, self.hashes(seq), boundary // self.block_size)
        if node is None or node.checkpoint_slot is not None:
            self._skip(seq, 'hash_collision' if node is None else 'exists')
            return False
        # (a window block the reply's decode already gave back leaves it unrestorable: it keeps no
        # window rows and is never offered)
        self.local.keep_window(seq, node)
        i = staging.boundaries.index(boundary)
        slot = staging.slots.pop(i)     # the others are released with the request (_drop_staging)
        staging.boundaries.pop(i)
        staging.leases.pop(i).release()
        stats = self.local.checkpoint_stats(node, boundary, 'turn_end', True)
        if not self.local.publish_checkpoint(slot, node, stats):     # (checked above: cannot happen)
            return False
        seq.stats.turn_end_point = boundary
        self.counters['turn_end_checkpoints_saved'] += 1
        self._count_save('turn_end')
        if self.store is None:
            return False
        full = boundary // self.block_size
        saves.store_puts.append(StorePut(self.hashes(seq)[:full], seq.block_ids[:full], boundary,
                                         self.local.checkpoint_ref(slot), self._window_table(seq, full)))
        return True

    def _drop_staging(self, seq) -> None:
        self.local.drop_staged(seq)
        staging = self._staging.pop(seq.seq_id, None)
        for slot, lease in zip(staging.slots, staging.leases) if staging is not None else ():
            lease.release()
            self.local.release_checkpoint(slot)

    def _skip(self, seq, reason: str) -> None:
        seq.stats.skipped[reason] += 1
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    # leaving -----------------------------------------------------------------------------
    def release(self, seq, cache_blocks: bool) -> None:
        """``seq`` gives its blocks back: cache its computed full blocks first (unless they hold
        no valid data, e.g. a failed Store load)."""
        self._drop_staging(seq)
        self.local.release_pins(seq.seq_id)
        if cache_blocks:
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
            self.local.release(seq, self.hashes(seq) if full else [], full)
        else:
            self.local.forget(seq)

    def forget(self, seq) -> None:
        """``seq`` is finished or aborted: drop its bookkeeping (and any pin it still owns)."""
        self._drop_staging(seq)
        self.local.release_pins(seq.seq_id)
        self._continuation.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._store_views.pop(seq.seq_id, None)

    def requeued(self, seq) -> None:
        """``seq`` went back to the waiting queue (preemption): ask the Store again."""
        view = self._store_views.get(seq.seq_id)
        if view is not None:
            view.boundary = None

    # capacity ----------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """KV blocks held by the local tier's trie (referenced by running sequences or not)."""
        return self.local.num_cached_blocks

    def cached_nodes(self) -> list:
        """Every node of the local tier's trie (introspection, tests)."""
        return self.local.cached_nodes()

    @property
    def num_evictable_blocks(self) -> int:
        """Cached KV blocks the local tier can free now (see :meth:`LocalTier.num_evictable_blocks`)."""
        return self.local.num_evictable_blocks

    @property
    def window_pool(self):
        """The window group's pool whose rows the local tier keeps, or None."""
        return self.local.window_pool

    @property
    def num_window_blocks(self) -> int:
        """Window-pool blocks the local tier holds (0 without window rows)."""
        return self.local.num_window_blocks

    @property
    def num_evictable_window_blocks(self) -> int:
        """Window-pool blocks the local tier can free now (:meth:`LocalTier.num_evictable_window_blocks`)."""
        return self.local.num_evictable_window_blocks

    def evict_window(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` window-pool blocks (:meth:`LocalTier.evict_window`)."""
        return self.local.evict_window(num_blocks)

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` cached blocks of the local tier; returns how many were freed."""
        return self.local.evict(num_blocks)

    def stats(self) -> dict:
        """Cumulative counters: queried/hit tokens, checkpoints saved and skipped by reason,
        state-miss tokens, and the Store tier's counters."""
        out = dict(self.counters)
        out['checkpoints_saved_by_reason'] = dict(self.counters['checkpoints_saved_by_reason'])
        out['prefix_cache_evictions'] = self.local.num_evictions
        out['checkpoints_skipped'] = dict(self.skipped)
        if self.store is not None:
            out.update(self.store.stats())
        out.update(self.host.stats())
        return out
