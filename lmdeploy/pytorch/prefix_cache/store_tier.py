"""The Store tier of the prefix cache: recurrent-state snapshots and KV blocks in a Mooncake Store.

It answers the questions of every tier (:class:`~.tier.PrefixTier`) — how deep a prefix does the
Store hold (:meth:`StoreTier.depth`, metadata only), load it (:meth:`StoreTier.load`), save it
(:meth:`StoreTier.save`) — and is the one owner of what this engine knows about Store
objects: which keys are believed stored, which are being put (the in-flight index), the
writer threads and the Store counters.
The byte-level pieces (object format, client, services) live in :mod:`lmdeploy.pytorch.store`.

Save at boundary b (submitted right after the forward that ends at b)::

    engine step:   copy out the state payload (runtime slot) and the KV payloads of blocks in
                   [0, b) neither believed stored nor queued by an earlier job; queue the job,
                   or drop it (counted) when the queue is full: the engine never waits
    a writer:      ask the Store which of those KV keys exist   → put only the missing ones
                   (one ``put_many`` batch when the backend has it)
                   all ok? wait for the earlier jobs that put blocks of [0, b), then
                   ask the Store that every KV key of [0, b) exists
                   → put state/{hash_b} (unless it exists)

so a visible state object implies its whole KV prefix is stored, whatever the number of writers
(``store_writers`` threads take jobs in queue order; a job waits only for earlier ones, so they
cannot wait for each other in a cycle), and bytes are counted only for objects the Store gained
from this engine's put (the backend's :class:`PutResult`; another engine may have put them
first, or at the same moment). Bytes counted are payload bytes (the 64-byte header and 32-byte
MAC of each object excluded): a turn's put bytes are ``len(save_points)·S + new_blocks·K_blk``.
A dropped save releases its keys, so the next save of the same prefix copies and puts them.

In-flight index: every key a queued or running job will put maps to that job, which holds its
copied-out payload. :meth:`probe` counts such keys as present and :meth:`load` reads their
payloads from memory (no Store round trip, nothing to verify: it is this engine's own copy);
a key leaves the index, under the lock, only after its put was booked (believed stored) or
failed, so a load that misses the index reads the Store.

Beliefs are a cache of existence answers, never trusted for correctness: any failed Store
operation (master down or restarted, an object evicted or missing at load or at the prefix
check) forgets every belief, so the next save of a prefix copies and puts what is missing.

Restore: the engine probes the Store once per admission attempt of a waiting sequence (one
existence query for the state keys of its reusable boundaries, one for the KV keys below the
deepest present state). Objects are verified (header, namespace, token count, key digest,
checksum, MAC) at load; a miss or a mismatch is counted, never an error to the user, and the
engine falls back to a shallower boundary or computes the prefix.

Deadline: every Store call the engine thread makes (existence queries, object reads) runs on a
small pool of caller threads and is waited for at most ``timeout_s`` seconds (reads: plus the
object's size at :data:`SLOW_READ_BYTES_PER_S`). A call past its deadline is a counted miss and
opens a breaker: the engine then skips the Store (misses, counted) while a background
existence query, at most one every :data:`STORE_COOLDOWN_S` seconds, checks whether the Store
answers again; the backend's own breaker is tripped too (``trip()``), so the writers fail fast
instead of waiting on it. No lock is held across a backend call.

Sliding windows (``window``, when every paged layer slides): a prefix at b needs only the KV
objects of blocks ``[window_first_block(b), b/B)`` (:func:`~lmdeploy.pytorch.cache_specs.window_first_block`),
so a save copies, puts and checks only those, and the probe asks only for those: a boundary whose
window reaches a block the Store lost is never restored, one whose older blocks are gone still is.
A model without state puts an empty state object (0 payload bytes) after the blocks, as the
marker that they are all stored; a load then writes no state.

Window objects (``window_rows``: a model of global and sliding-window layers whose window layers
keep a pool of their own, window W of that group): a ``kv`` object then holds one block row of the
global layers only, and the window layers' row of a block is a ``window`` object of its own (its
own key, ``{ns}/window/{hash}``, and kind code, so one layout is never read as the other; the
namespace also names the split, so objects of the one-table layout are never read by a split
engine). A prefix at b is its state object, the ``kv`` objects of every block below b and the
``window`` objects of blocks ``[window_first_block(b, W), b/B)`` only::

    kv       |g0|g1|g2|g3|g4|g5|g6|g7|      every block below b (as without windows)
    window   |  |  |  |  |  |w5|w6|w7|      the blocks b's window reads
    state                            |s_b|  put last, once every object above is stored

so a save puts ``S + new_kv·K_glob + new_window·K_win`` bytes, the probe offers b only when all of
them exist, and a load writes the window rows into the window-pool blocks the admission gave the
sequence (which the local tier then keeps as the trie's window rows of the restored checkpoint).
A save whose window blocks the sequence already gave back (a turn end its decode passed) is not
made: the state it would publish could never be restored.

Hand-off (prefill/decode disaggregation, :mod:`~lmdeploy.pytorch.paging.handoff`): a prefill
engine's :meth:`StoreTier.submit_handoff` is a save at its unaligned hand-off point h whose last
object is a ``handoff/{hash}`` object (the partial block ``[floor_B(h), h)`` followed by the state
at h) instead of ``state/{hash_b}``, put by the same writers under the same rule (after every KV
object below ``floor_B(h)`` is stored); the request's
:class:`~lmdeploy.pytorch.paging.handoff.Handoff` learns whether it was. A decode engine asks
:meth:`StoreTier.has_handoff` and loads it with :meth:`StoreTier.load` (a :class:`StoreLoad` with
``handoff`` set): each KV object below ``floor_B(h)`` is read once, the partial block only from
the hand-off object.

Repair: a key whose object failed verification here is remembered as bad: lookups treat it as
absent, and the next save of that prefix overwrites it (``store_repaired_objects``). A
half-written object (a writer killed mid-put) is replaced by the backend's put itself.
"""
from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from ..cache_specs import kv_window, window_first_block
from ..paging.prefill_plan import ReuseRules
from ..store.identity import engine_namespace
from ..store.backend import PutResult, StoreBackend
from ..store.object_format import StoreObjectError, decode_object, encode_object, object_key
from .plans import StoreLoad, StorePut

__all__ = ['StoreTier', 'build_store_tier', 'zero_store_counters', 'FAILURE_LOG_INTERVAL_S', 'STORE_COOLDOWN_S',
           'SLOW_READ_BYTES_PER_S']

FAILURE_LOG_INTERVAL_S = 60     # seconds between two warnings about failed Store operations
STORE_COOLDOWN_S = 5.0          # seconds between two background checks while the breaker is open
SLOW_READ_BYTES_PER_S = 100e6   # an object read's deadline grows by its size at this rate (bytes/s)
_DEADLINE = 'a Store call missed its deadline'
_FAILURES = ('existence query failed', 'put failed', 'restore failed', _DEADLINE)
_CALLERS = 2    # threads running the engine thread's Store calls (a stuck one is replaced by the other)

logger = logging.getLogger('lmdeploy')


def zero_store_counters() -> dict:
    """The Store tier's counters, all 0 (put bytes and objects by kind ``state`` / ``kv``;
    failures, hit tokens, rejected, already-existing and repaired objects, saves dropped on a full
    queue, payload bytes read (objects that verified), cumulative; and ``store_queue_depth``, the
    save jobs waiting in the queue now; hand-off objects and payload bytes put and tokens restored
    from hand-offs, ``store_handoff_*``): what :meth:`StoreTier.stats` starts from, and what an
    engine without a Store reports."""
    return {'store_put_bytes': {'state': 0, 'kv': 0}, 'store_put_objects': {'state': 0, 'kv': 0},
            'store_put_failures': 0, 'store_get_failures': 0, 'store_hit_tokens': 0,
            'store_rejected_objects': 0, 'store_existing_objects': 0, 'store_repaired_objects': 0,
            'store_dropped_puts': 0, 'store_queue_depth': 0, 'store_get_bytes': 0,
            'store_handoff_put_objects': 0, 'store_handoff_put_bytes': 0, 'store_handoff_hit_tokens': 0}


@dataclass(eq=False)
class _SaveJob:
    kv: list[tuple[bytes, int, torch.Tensor]]     # (block hash, end token, payload) copied out
    win: list[tuple[bytes, int, torch.Tensor]]    # the same, for window objects (window rows; else empty)
    state: tuple[bytes, int, torch.Tensor]        # (prefix hash, boundary, payload)
    prefix_keys: list[str] = field(default_factory=list)   # KV (and window) keys the prefix at b reads
    deps: list['_SaveJob'] = field(default_factory=list)   # earlier jobs putting blocks of [0, b)
    payloads: dict[str, torch.Tensor] = field(default_factory=dict)   # key -> payload of what this job puts
    done: threading.Event = field(default_factory=threading.Event)
    last_kind: str = 'state'       # the last object's kind: 'state', or 'handoff' (a hand-off save)
    ok: bool = False               # the last object is in the Store (put or found)
    handoff: object = None         # the Handoff told the outcome (a hand-off save)


STORED_KEYS_CAPACITY = 1 << 18   # keys remembered as stored (~40 MB); older ones are asked again
BAD_KEYS_CAPACITY = 1 << 12      # rejected keys remembered for repair; older ones are rejected again first


class _KeySet:
    """A set of Store keys that forgets the oldest beyond ``capacity``: forgetting costs one
    existence query (or one copy of a payload the worker then finds stored), never correctness."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def update(self, keys) -> None:
        for key in keys:
            self.add(key)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()


class StoreTier:
    """Store-backed prefix tier for one engine.

    Args:
        client: an open :class:`.backend.StoreBackend` (Mooncake, a folder, or a test double).
        cache_engine: where payloads are read from and written to.
        namespace: 16-byte namespace digest.
        block_size: tokens per block (B).
        queue_size: most queued save jobs; a save that finds the queue full is dropped and
            counted (``store_dropped_puts``), never waited for.
        services: embedded Mooncake services to stop on :meth:`close`, or None.
        secret: the Store secret keying every object's MAC (None: unauthenticated objects).
        writers: threads putting objects in parallel (>= 1).
        timeout_s: deadline of each Store call made on the engine thread (seconds, > 0).
        cooldown_s: seconds between two background checks of a Store that missed a deadline.
        window: the model's sliding window (tokens) when every paged layer slides
            (:func:`~lmdeploy.pytorch.cache_specs.kv_window`), else None: a prefix at b is then
            its state object and the KV objects of the blocks its window reads.
        window_rows: the window (tokens) of a mixed model's sliding-window group that keeps a pool
            of its own, else None: KV objects then hold the global layers' rows and window objects
            the window layers' rows of the blocks each prefix's window reads (module docstring).

    Raises:
        ValueError: ``writers`` < 1, ``timeout_s`` / ``cooldown_s`` not > 0, or both ``window``
            and ``window_rows`` given.
    """

    name = 'store'
    bytes_held = 0      # (payloads live in the Store, not in this process)

    def __init__(self, client: StoreBackend, cache_engine, namespace: bytes, block_size: int,
                 queue_size: int = 64, services=None, secret: bytes | None = None, writers: int = 4,
                 timeout_s: float = 0.5, cooldown_s: float = STORE_COOLDOWN_S, window: int | None = None,
                 window_rows: int | None = None):
        if not isinstance(writers, int) or writers < 1:
            raise ValueError(f'store_writers must be an int >= 1, got {writers!r}')
        for name, value in (('store_timeout_s', timeout_s), ('cooldown_s', cooldown_s)):
            if not value > 0:
                raise ValueError(f'{name} must be > 0 seconds, got {value!r}')
        if window and window_rows:
            raise ValueError('window (every paged layer slides) and window_rows (a window group of its own) '
                             'exclude each other')
        self.client = client
        self.secret = secret
        self.cache_engine = cache_engine
        self.namespace = namespace
        self.ns_hex = namespace.hex()
        self.block_size = block_size
        self.window = window or None     # every paged layer slides: a prefix needs its window's blocks only
        self.window_rows = window_rows or None   # a window group of its own: window objects of its window
        # a model that caches nothing per token (pure Mamba-2: K_blk = 0) has no KV objects; a
        # prefix is its state object alone
        self.has_kv = getattr(cache_engine, 'kv_block_bytes', 1) > 0
        self.services = services
        self.timeout_s = float(timeout_s)
        self.cooldown_s = float(cooldown_s)
        self.writer_id = secrets.randbits(64)   # makes this engine's values differ from any other writer's
        self._stored = _KeySet(STORED_KEYS_CAPACITY)   # keys believed to be in the Store (bounded)
        self._bad = _KeySet(BAD_KEYS_CAPACITY)         # keys whose object failed verification here
        # the in-flight index: key -> the queued or running job putting it (None while being copied)
        self._pending: dict[str, _SaveJob | None] = {}
        self._lock = threading.Lock()
        self._last_failure_log = -float('inf')
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._inflight = 0
        self._idle = threading.Condition(self._lock)   # notified when _inflight drops to 0
        self.counters = zero_store_counters()
        if self.window_rows:
            for name in ('store_put_bytes', 'store_put_objects'):
                self.counters[name]['window'] = 0
        self._closed = False
        # the engine thread's Store calls: a caller pool and a breaker
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._callers_busy = 0
        self._skip_until: float | None = None    # breaker open: skip the Store (monotonic s of the next check)
        self._health: Future | None = None       # the background check in progress
        self._health_key = self._key('state', b'\0' * 32)
        self._callers = [threading.Thread(target=self._serve_calls, name=f'lmdeploy-store-call-{i}', daemon=True)
                         for i in range(_CALLERS)]
        self._writers = [threading.Thread(target=self._run, name=f'lmdeploy-store-{i}', daemon=True)
                         for i in range(writers)]
        for thread in self._callers + self._writers:
            thread.start()

    def _key(self, kind: str, h: bytes) -> str:
        return object_key(self.ns_hex, kind, h.hex())

    def _forget_all(self, why: str) -> None:
        """Drop every belief about stored keys (called with the lock held). A failed Store
        operation is also logged as a warning, at most once per :data:`FAILURE_LOG_INTERVAL_S`."""
        if len(self._stored):
            logger.info('Store: forgetting %d keys believed stored (%s)', len(self._stored), why)
        self._stored.clear()
        if why in _FAILURES:
            now = time.monotonic()
            if now - self._last_failure_log >= FAILURE_LOG_INTERVAL_S:
                self._last_failure_log = now
                logger.warning('Store operation failed (%s): is the Mooncake master reachable? Requests are '
                               'still served (prefixes not found locally are computed); the counters '
                               'lmdeploy_store_get_failures_total / lmdeploy_store_put_failures_total count '
                               'the failures. Next warning in %d s at the earliest.', why, FAILURE_LOG_INTERVAL_S)

    # engine-thread calls: deadline and breaker ----------------------------------------------
    def _serve_calls(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fut, fn, args = item
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as err:     # a backend never raises; if one does, it is a failure
                        fut.set_exception(err)
            finally:
                with self._lock:
                    self._callers_busy -= 1

    def _spawn(self, fn, *args) -> Future | None:
        """Hand ``fn(*args)`` to an idle caller thread (lock held); None when every caller is
        still stuck in an earlier call."""
        if self._closed or self._callers_busy >= len(self._callers):
            return None
        self._callers_busy += 1
        fut: Future = Future()
        self._calls.put((fut, fn, args))
        return fut

    def _healthy(self) -> bool:
        return self.client.batch_exists([self._health_key]) is not None

    def _breaker_closed(self) -> bool:
        """Whether the engine thread may call the Store now (lock held). While open, starts a
        background check at most every ``cooldown_s`` seconds and closes when one succeeded."""
        if self._skip_until is None:
            return True
        health = self._health
        if health is not None and health.done():
            self._health = None
            if health.exception() is None and health.result():
                self._skip_until = None
                logger.warning('Store answers again: the engine uses it again')
                return True
        if self._health is None and time.monotonic() >= self._skip_until:
            self._health = self._spawn(self._healthy)
            self._skip_until = time.monotonic() + self.cooldown_s
        return False

    def _trip(self) -> None:
        """Open the breaker (lock held): the engine thread skips the Store for a cool-down."""
        if self._skip_until is None:
            logger.warning('Store: a call missed its %.2f s deadline; the engine skips the Store (prefixes are '
                           'computed) until it answers again', self.timeout_s)
        self._skip_until = time.monotonic() + self.cooldown_s
        self._forget_all(_DEADLINE)

    def _call(self, fn, *args, deadline_s: float) -> tuple[bool, object]:
        """``(True, fn(*args))``, or ``(False, None)`` when the breaker is open or the call did
        not return within ``deadline_s`` seconds (counted in ``store_get_failures``; the latter
        opens the breaker and trips the backend's). Never waits longer than ``deadline_s``."""
        with self._lock:
            fut = self._spawn(fn, *args) if self._breaker_closed() else None
            if fut is None and self._skip_until is not None:
                self.counters['store_get_failures'] += 1
                return False, None
        if fut is not None:
            try:
                return True, fut.result(timeout=deadline_s)
            except FutureTimeout:
                pass
            except Exception:
                logger.exception('Store call raised')
        with self._lock:
            self.counters['store_get_failures'] += 1
            self._trip()
        trip = getattr(self.client, 'trip', None)
        if trip is not None:
            trip()
        return False, None

    # restore -------------------------------------------------------------------------------
    def probe(self, hashes: list[bytes], rules: ReuseRules, below: int | None = None) -> list[int]:
        """Boundaries ``b < below`` the Store can restore for an input, deepest first.

        ``b`` is restorable for ``rules`` (reusable, and its r recompute blocks among
        ``hashes``); the state object at ``b`` and the KV objects of blocks ``[f, b/B + r)``
        exist or are being put by this engine (the in-flight index), ``f`` the first block b's
        window reads (0 without sliding windows), and with ``window_rows`` the window objects of
        blocks ``[window_first_block(b, W), b/B)``. Metadata only: two batched existence queries
        at most, each waited for at most ``timeout_s`` seconds.
        """
        B, r = self.block_size, rules.recompute_blocks
        candidates = [b for b in rules.restore_candidates(0, len(hashes)) if below is None or b < below]
        if not candidates:
            return []
        present = self._exists([self._key('state', hashes[b // B - 1]) for b in candidates])
        candidates = [b for b, ok in zip(candidates, present or ()) if ok]
        if not candidates or not self.has_kv:
            return candidates
        lo = self._first_block(candidates[-1])      # (the shallowest candidate's window starts first)
        top = candidates[0] // B + r
        keys = [self._key('kv', h) for h in hashes[lo:top]]
        wlo = self._window_first(candidates[-1])
        if self.window_rows:
            keys += [self._key('window', h) for h in hashes[wlo:candidates[0] // B]]
        found = self._exists(keys)
        if found is None:
            return []
        kv, win = found[:top - lo], found[top - lo:]
        return [b for b in candidates if all(kv[self._first_block(b) - lo:b // B + r - lo])
                and all(win[self._window_first(b) - wlo:b // B - wlo])]

    def _first_block(self, boundary: int) -> int:
        """The first block a prefix of ``boundary`` tokens needs (the window rule)."""
        return window_first_block(boundary, self.window, self.block_size)

    def _window_first(self, boundary: int) -> int:
        """The first block whose window object a prefix of ``boundary`` tokens needs (with
        ``window_rows``; without, ``boundary / B``: none)."""
        if not self.window_rows:
            return boundary // self.block_size
        return window_first_block(boundary, self.window_rows, self.block_size)

    def depth(self, hashes: list[bytes], rules: ReuseRules, *, shared_blocks: int = 0, above: int = 0,
              below: int | None = None) -> int:
        """The deepest boundary :meth:`probe` finds above ``above`` (tokens), or 0. Every KV block
        below it is asked for, the device's shared ones too (``shared_blocks`` is not used)."""
        return next((b for b in self.probe(hashes, rules, below) if b > above), 0)

    def _exists(self, keys: list[str]) -> list[bool] | None:
        """Per key, whether it is stored or being put (the in-flight index and beliefs first,
        then one batched query with a deadline); None when the query failed or missed its
        deadline (counted as a get failure: a lookup that fails is a miss)."""
        with self._lock:
            known = [k in self._stored or self._pending.get(k) is not None for k in keys]
        missing = [k for k, ok in zip(keys, known) if not ok]
        if not missing:
            return known
        called, answer = self._call(self.client.batch_exists, missing, deadline_s=self.timeout_s)
        with self._lock:
            if not called:
                return None
            if answer is None:               # the query failed, not "absent"
                self.counters['store_get_failures'] += 1
                self._forget_all('existence query failed')
                return None
            # an object this engine rejected is a miss until a save replaces it
            found = {k: ok and k not in self._bad for k, ok in zip(missing, answer)}
            self._stored.update(k for k, ok in found.items() if ok)
        return [ok or found.get(k, False) for k, ok in zip(keys, known)]

    def load(self, load: StoreLoad) -> bool:
        """Execute a :class:`StoreLoad`: fetch, verify and write its objects into the KV blocks
        and the runtime slot (objects still being put by this engine come from their copied-out
        payloads). False (counted; beliefs forgotten) if any object is missing, fails
        verification or is not read within its deadline; the caller then rolls the admission back."""
        B, hashes = self.block_size, load.hashes
        try:
            if load.handoff is not None:
                # the partial block (none when h is a multiple of B or nothing is paged), then the state
                handoff = self._get('handoff', load.handoff, load.boundary)
                tail = self.cache_engine.kv_block_bytes if self.has_kv and load.boundary % B else 0
                if handoff.numel() != tail + self.cache_engine.state_bytes:
                    raise StoreObjectError('length', f'hand-off payload of {handoff.numel()} bytes')
                state = handoff[tail:]
            else:
                state = self._get('state', hashes[load.boundary // B - 1], load.boundary)
            for i in range(load.first_block, load.boundary // B if self.has_kv else 0):
                payload = self._get('kv', hashes[i], (i + 1) * B)
                self.cache_engine.write_kv_block(load.block_ids[i], payload)
            if self.window_rows and load.handoff is None:
                for i in range(self._window_first(load.boundary), load.boundary // B):
                    payload = self._get('window', hashes[i], (i + 1) * B)
                    self.cache_engine.write_window_block(load.window_block_ids[i], payload)
            if load.handoff is not None and tail:
                self.cache_engine.write_kv_block(load.block_ids[load.boundary // B], handoff[:tail])
            if load.slot is not None:       # (None: a model without state; its state object is empty)
                self.cache_engine.write_state(load.slot, state)
        except (KeyError, StoreObjectError) as err:
            logger.info('Store restore at %d tokens failed: %s', load.boundary, err)
            if isinstance(err, StoreObjectError):
                self._find_every_bad_object(load)
            with self._lock:    # a rejected object is not a Store outage: no warning about the master
                self._forget_all('object rejected' if isinstance(err, StoreObjectError) else 'restore failed')
            return False
        return True

    def _find_every_bad_object(self, load: StoreLoad) -> None:
        """One object of the prefix failed verification: verify the others too, so every bad one is
        marked and the next save of the prefix repairs them all (not one per engine that tries)."""
        B, hashes = self.block_size, load.hashes
        objects = [('handoff', load.handoff, load.boundary) if load.handoff is not None
                   else ('state', hashes[load.boundary // B - 1], load.boundary)]
        objects += [('kv', hashes[i], (i + 1) * B)
                    for i in range(load.first_block, load.boundary // B if self.has_kv else 0)]
        if self.window_rows and load.handoff is None:
            objects += [('window', hashes[i], (i + 1) * B)
                        for i in range(self._window_first(load.boundary), load.boundary // B)]
        for kind, h, tokens in objects:
            if self._key(kind, h) in self._bad:
                continue
            try:
                self._get(kind, h, tokens)
            except (KeyError, StoreObjectError):
                pass        # _get marked a rejected object bad; a missing one is put again anyway

    def record_hit(self, tokens: int) -> None:
        """Count ``tokens`` prompt tokens served from the Store (once per request)."""
        with self._lock:
            self.counters['store_hit_tokens'] += tokens

    def record_handoff(self, tokens: int) -> None:
        """Count ``tokens`` prompt tokens restored from a hand-off (also in ``store_hit_tokens``)."""
        with self._lock:
            self.counters['store_handoff_hit_tokens'] += tokens

    def _get(self, kind: str, h: bytes, num_tokens: int) -> torch.Tensor:
        key = self._key(kind, h)
        with self._lock:     # taken under the lock: a put that ends now leaves the key believed stored
            job = self._pending.get(key)
            payload = job.payloads.get(key) if job is not None else None
        if payload is not None:
            return payload
        size = getattr(self.cache_engine, {'kv': 'kv_block_bytes', 'window': 'window_block_bytes'}.get(
            kind, 'state_bytes'), 0)
        size += getattr(self.cache_engine, 'kv_block_bytes', 0) if kind == 'handoff' else 0
        called, data = self._call(self.client.get, key, deadline_s=self.timeout_s + size / SLOW_READ_BYTES_PER_S)
        if not called:
            raise KeyError(f'{kind} object not read: the Store missed its deadline or is being skipped')
        if data is None:
            with self._lock:
                self.counters['store_get_failures'] += 1
            raise KeyError(f'{kind} object missing')
        try:
            payload = decode_object(data, kind, self.namespace, num_tokens, self.secret, key=key)
        except StoreObjectError:
            with self._lock:
                self.counters['store_rejected_objects'] += 1
                self._bad.add(key)           # the next save of this prefix replaces it
            raise
        with self._lock:
            self.counters['store_get_bytes'] += len(payload)     # payload bytes, as store_put_bytes counts
        if not payload:     # (the empty state object of a model without state)
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    # save ----------------------------------------------------------------------------------
    def save(self, put: StorePut) -> None:
        """:meth:`submit` (the tier's save)."""
        self.submit(put)

    def evict(self, num_bytes: int) -> int:
        """Nothing: the Store's backend evicts by its own policy (Mooncake's, the folder's size
        limit). Returns 0."""
        return 0

    def submit(self, put: StorePut) -> None:
        """Queue a :class:`StorePut`; never waits for the writers. Payloads are copied out
        before returning (the slot and blocks may change after this step). Blocks believed
        stored or queued by an earlier job are not copied again. When the queue is full the
        save is dropped (``store_dropped_puts``) and its keys released, so a later save of the
        same prefix copies and puts them."""
        self._submit(put.hashes, put.block_ids, 'state', put.hashes[-1], put.boundary,
                     lambda: (torch.empty(0, dtype=torch.uint8) if put.slot is None
                              else self.cache_engine.read_state(put.slot)), window_block_ids=put.window_block_ids)

    def handoff_key(self, digest: bytes) -> str:
        """The Store key of the hand-off object with hash ``digest``."""
        return self._key('handoff', digest)

    def has_handoff(self, hashes: list[bytes], digest: bytes) -> bool:
        """Whether the Store holds (or this engine is putting) the hand-off object ``digest``
        and the KV objects of the full blocks ``hashes`` below it (metadata only: one batched
        existence query, with the deadline of :meth:`probe`)."""
        keys = [self.handoff_key(digest)] + ([self._key('kv', h) for h in hashes] if self.has_kv else [])
        present = self._exists(keys)
        return present is not None and all(present)

    def submit_handoff(self, put) -> None:
        """Queue a prefill engine's hand-off (a :class:`~.plans.HandoffPut`), as :meth:`submit`
        queues a save: the KV blocks of ``put.hashes`` the Store lacks, then the hand-off object
        (partial block + state, copied out now). ``put.handoff.resolve(ok)`` is called once the
        writers are done with it (False when it was dropped or a put failed)."""
        def payload():
            state = self.cache_engine.read_state(put.slot)
            if put.tail_block is None or not self.has_kv:
                return state
            return torch.cat([self.cache_engine.read_kv_blocks([put.tail_block])[0], state])

        self._submit(put.hashes, put.block_ids, 'handoff', put.handoff_hash, put.boundary, payload, put.handoff)

    def _submit(self, hashes: list[bytes], block_ids: list[int], last_kind: str, last_hash: bytes, boundary: int,
                read_last, handoff=None, window_block_ids: list[int] | None = None) -> None:
        B = self.block_size
        state_key = self._key(last_kind, last_hash)
        # blocks before the first one the boundary's window reads are neither copied, put nor checked
        first = self._first_block(boundary) if last_kind == 'state' else 0
        keys = [self._key('kv', h) for h in hashes[first:]] if self.has_kv else []
        wfirst = self._window_first(boundary) if last_kind == 'state' else boundary // B
        if wfirst < boundary // B:
            ids = window_block_ids or []
            if len(ids) < boundary // B or any(ids[i] < 0 for i in range(wfirst, boundary // B)):
                logger.debug('Store save at %d tokens not made: the sequence gave back window blocks it reads',
                             boundary)
                return
        nkv = len(keys)
        keys += [self._key('window', h) for h in hashes[wfirst:boundary // B]]
        with self._lock:
            if self._closed or state_key in self._stored or state_key in self._pending:
                waits = self._pending.get(state_key)
                if handoff is not None:     # (already stored, or being put by an earlier job)
                    if waits is None:
                        handoff.resolve(state_key in self._stored)
                    else:
                        threading.Thread(target=lambda: handoff.resolve(waits.done.wait() and waits.ok),
                                         daemon=True).start()
                return
            new = [i for i, k in enumerate(keys) if k not in self._stored and k not in self._pending]
            deps = {id(j): j for j in (self._pending.get(k) for k in keys) if j is not None}
            mine = [keys[i] for i in new] + [state_key]
            self._pending.update(dict.fromkeys(mine))
            self._inflight += 1
        job = None
        try:
            new_kv, new_win = [i for i in new if i < nkv], [i for i in new if i >= nkv]
            payloads = self.cache_engine.read_kv_blocks([block_ids[first + i] for i in new_kv]) if new_kv else []
            kv = [(hashes[first + i], (first + i + 1) * B, payloads[j]) for j, i in enumerate(new_kv)]
            wpay = (self.cache_engine.read_window_blocks([window_block_ids[wfirst + i - nkv] for i in new_win])
                    if new_win else [])
            win = [(hashes[wfirst + i - nkv], (wfirst + i - nkv + 1) * B, wpay[j]) for j, i in enumerate(new_win)]
            state = read_last()
            job = _SaveJob(kv, win, (last_hash, boundary, state), keys, list(deps.values()), last_kind=last_kind,
                           handoff=handoff)
            job.payloads = {keys[i]: payloads[j] for j, i in enumerate(new_kv)}
            job.payloads.update({keys[i]: wpay[j] for j, i in enumerate(new_win)})
            job.payloads[state_key] = state
        except BaseException:
            self._job_done(mine, None)
            if handoff is not None:
                handoff.resolve(False)
            raise
        with self._lock:
            for k in mine:
                self._pending[k] = job
            try:
                self._jobs.put_nowait(job)
                return
            except queue.Full:
                self.counters['store_dropped_puts'] += 1
        self._job_done(mine, job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._execute(job)
            except Exception:       # never let one job kill a writer (flush would wait forever)
                logger.exception('Store save job failed')
            finally:
                self._job_done(list(job.payloads), job)

    def _job_done(self, keys: list[str], job: _SaveJob | None) -> None:
        """Release a job's keys still in the in-flight index (those not put stay unstored), its
        in-flight count, and the jobs waiting for it (and its hand-off, told the outcome)."""
        with self._lock:
            for k in keys:
                if k in self._pending and self._pending[k] is job:
                    del self._pending[k]
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()
        if job is not None:
            job.done.set()
            if job.handoff is not None:
                job.handoff.resolve(job.ok)

    def _present(self, keys: list[str]) -> list[bool] | None:
        """Ask the Store (not the beliefs) which ``keys`` hold a usable object (one this engine
        rejected does not); None if the query failed."""
        present = self.client.batch_exists(keys)
        with self._lock:
            if present is None:
                self.counters['store_put_failures'] += 1
                self._forget_all('existence query failed')
                return None
            present = [ok and k not in self._bad for k, ok in zip(keys, present)]
            self._stored.update(k for k, ok in zip(keys, present) if ok)
        return present

    def _put(self, job: _SaveJob, kind: str, items: list[tuple[bytes, int, torch.Tensor]]) -> bool:
        """Put objects of one kind: one ``put_many`` batch when the backend offers it, else one
        put each, stopping at the first failure. Bytes and objects are counted only when the
        Store gained this value (:class:`PutResult`), so concurrent writers of one key count it
        once; a key this engine rejected is overwritten. Each key leaves the in-flight index in
        the same lock section that books it. True when every key now holds a complete object."""
        keys = [self._key(kind, h) for h, _, _ in items]
        with self._lock:
            replace = [k in self._bad for k in keys]
        values = [encode_object(kind, self.namespace, end, payload.numpy().tobytes(), self.secret, key=k,
                                writer=self.writer_id) for k, (_, end, payload) in zip(keys, items)]
        put_many = getattr(self.client, 'put_many', None)
        if put_many is not None and len(items) > 1:
            results = list(put_many(list(zip(keys, values, replace))))[:len(items)]
        else:
            results = []
            for k, v, r in zip(keys, values, replace):
                results.append(self.client.put(k, v, replace=r))
                if not results[-1].ok:
                    break       # leave the rest, and the state, to a later save of this prefix
        with self._lock:
            for k, (_, _, payload), result in zip(keys, items, results):
                if result.gained and kind == 'handoff':
                    self.counters['store_handoff_put_bytes'] += payload.numel()
                    self.counters['store_handoff_put_objects'] += 1
                elif result.gained:
                    self.counters['store_put_bytes'][kind] += payload.numel()
                    self.counters['store_put_objects'][kind] += 1
                    if result is PutResult.REPAIRED:
                        self.counters['store_repaired_objects'] += 1
                elif result is PutResult.EXISTS:
                    self.counters['store_existing_objects'] += 1
                if result.ok:
                    self._stored.add(k)
                    self._bad.discard(k)
                else:
                    self.counters['store_put_failures'] += 1
                if self._pending.get(k) is job:
                    del self._pending[k]
            ok = len(results) == len(items) and all(r.ok for r in results)
            if not ok:
                self._forget_all('put failed')
        return ok

    def _execute(self, job: _SaveJob) -> None:
        h_state, b, state_payload = job.state
        kind = job.last_kind
        state_key = self._key(kind, h_state)
        present = self._present([self._key('kv', h) for h, _, _ in job.kv]
                                + [self._key('window', h) for h, _, _ in job.win] + [state_key])
        if present is None:
            return
        state_present = present.pop()
        with self._lock:
            self.counters['store_existing_objects'] += sum(present) + state_present
        for block_kind, items, found in (('kv', job.kv, present[:len(job.kv)]),
                                         ('window', job.win, present[len(job.kv):])):
            missing = [item for item, exists in zip(items, found) if not exists]
            if missing and not self._put(job, block_kind, missing):
                return      # leave the state to a later save of this prefix
        if state_present:
            job.ok = True
            return
        # blocks of this prefix that earlier jobs put: wait for those jobs (earlier in the queue,
        # so they never wait for this one), then ask the Store, not the beliefs (a restarted
        # master or an evicting Store may have lost blocks put earlier)
        for dep in job.deps:
            dep.done.wait()
        prefix = self._present(job.prefix_keys) if job.prefix_keys else []
        if prefix is None:
            return
        if not all(prefix):
            with self._lock:
                self._forget_all(f'{prefix.count(False)} KV or window objects below {b} tokens are missing')
            logger.info('Store save at %d tokens: state not put, %d of its blocks are not stored', b,
                        prefix.count(False))
            return
        job.ok = self._put(job, kind, [(h_state, b, state_payload)])

    # lifecycle ----------------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        """Save jobs queued or running."""
        with self._lock:
            return self._inflight

    @property
    def queue_depth(self) -> int:
        """Save jobs waiting in the queue (not yet taken by a writer)."""
        return self._jobs.qsize()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait up to ``timeout`` seconds until every queued save has been attempted; True when
        none is left in flight."""
        deadline = time.monotonic() + timeout
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict:
        """Store counters (put bytes/objects by kind, failures, hit tokens, rejected,
        already-existing and repaired objects, dropped saves) and the queue depth now."""
        with self._lock:
            out = json.loads(json.dumps(self.counters))
        out['store_queue_depth'] = self.queue_depth
        return out

    def close(self, timeout: float = 60.0) -> None:
        """Flush (at most ``timeout`` seconds), stop the writers and callers, disconnect, and
        stop embedded services. Idempotent. Writers stuck in a backend call (daemon threads)
        are waited for at most 10 s in all."""
        with self._lock:
            if self._closed:
                return
        if not self.flush(timeout):
            logger.warning('Store: %d save jobs still in flight at close', self.num_inflight)
        with self._lock:
            self._closed = True
        for _ in self._writers:
            try:
                self._jobs.put(None, timeout=1)
            except queue.Full:
                break
        for _ in self._callers:
            self._calls.put(None)
        end = time.monotonic() + 10
        for thread in self._writers + self._callers:
            thread.join(timeout=max(0.0, end - time.monotonic()))
        self.client.close()
        if self.services is not None:
            self.services.stop()


def _namespace(engine, secret: bytes | None) -> bytes:
    cfg = engine.config
    # a window group of its own changes what a KV object holds (the global layers' rows only):
    # its entries join the namespace, so the two layouts never read each other's objects
    groups = _window_groups(engine)
    # the first start on a checkpoint hashes every weight byte (logged); later starts hit the digest cache
    return engine_namespace(engine.model_path, dtype=str(engine.dtype), block_size=cfg.block_size,
                            # payloads hold every head whatever the TP size (see store/layout.py)
                            layers=[repr(s) for s in engine.cache_engine.object_specs], tp_rank=0, tp_size=1,
                            adapter=None, override=cfg.store_namespace, secret=secret,
                            paged_groups=[list(g.entries) for g in groups] if groups else None)


def _window_groups(engine) -> list | None:
    """The engine's paged groups when its window layers keep a pool of their own (window objects), else None."""
    groups = getattr(engine, 'paged_groups', None)
    return groups if getattr(engine, 'window_pool', None) is not None and groups and len(groups) > 1 else None


def build_store_tier(engine, opened) -> StoreTier:
    """The Store tier of ``engine`` over an opened backend (``opened``: a
    :class:`~lmdeploy.pytorch.store.open_backend.OpenedStore`, whatever its scheme); its objects
    are bound to the engine's namespace. If the namespace cannot be computed the backend is
    closed (and its embedded services stopped) before the error propagates.

    Raises:
        ValueError: ``store_namespace`` or the model identity is unusable.
    """
    cfg = engine.config
    try:
        namespace = _namespace(engine, opened.secret)
    except BaseException:
        opened.close()
        raise
    # the window rule is the model's (its specs), whatever the engine's decoding: it is what the
    # objects of this namespace hold
    groups = _window_groups(engine)
    return StoreTier(opened.backend, engine.cache_engine, namespace, cfg.block_size, cfg.store_queue_size,
                     opened.services, opened.secret, cfg.store_writers, cfg.store_timeout_s,
                     window=kv_window(engine.cache_engine.object_specs),
                     window_rows=groups[1].window if groups else None)
