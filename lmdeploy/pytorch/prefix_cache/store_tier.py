"""The Store tier of the prefix cache: recurrent-state snapshots and KV blocks in a Mooncake Store.

It answers the same questions as the local tier — how deep a prefix does the Store hold
(:meth:`StoreTier.probe`, metadata only), load it (:meth:`StoreTier.load`), save it
(:meth:`StoreTier.submit`) — and is the one owner of what this engine knows about Store
objects: which keys are believed stored, the background put worker and the Store counters.
The byte-level pieces (object format, client, services) live in :mod:`lmdeploy.pytorch.store`.

Save at boundary b (submitted right after the forward that ends at b)::

    engine step:   copy out the state payload (runtime slot) and the KV payloads of blocks in
                   [0, b) neither believed stored nor queued by an earlier job
    worker later:  ask the Store which of those KV keys exist   → put only the missing ones
                   all ok? ask the Store that every KV key of [0, b) exists
                   → put state/{hash_b} (unless it exists)

so a visible state object implies its whole KV prefix is stored, and bytes are counted only for
objects the Store gained from this engine's put (the backend's :class:`PutResult`; another engine
may have put them first, or at the same moment). Bytes counted are
payload bytes (the 64-byte header and 32-byte MAC of each object excluded): a turn's put bytes
are ``len(save_points)·S + new_blocks·K_blk``.

Beliefs are a cache of existence answers, never trusted for correctness: any failed Store
operation (master down or restarted, an object evicted or missing at load or at the prefix
check) forgets every belief, so the next save of a prefix copies and puts what is missing.

Restore: the engine probes the Store once per admission attempt of a waiting sequence (one
existence query for the state keys of its reusable boundaries, one for the KV keys below the
deepest present state). Objects are verified (header, namespace, token count, key digest,
checksum, MAC) at load; a miss or a mismatch is counted, never an error to the user, and the
engine falls back to a shallower boundary or computes the prefix.

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
from dataclasses import dataclass, field

import torch

from ..paging.prefill_plan import ReuseRules
from ..store.identity import engine_namespace, resolve_secret
from ..store.backend import PutResult, StoreBackend
from ..store.mooncake_client import StoreClient, buffer_bytes_needed
from ..store.object_format import OBJECT_OVERHEAD, StoreObjectError, decode_object, encode_object, object_key
from .plans import StoreLoad, StorePut

__all__ = ['StoreTier', 'build_store_tier', 'zero_store_counters', 'FAILURE_LOG_INTERVAL_S']

FAILURE_LOG_INTERVAL_S = 60     # seconds between two warnings about failed Store operations
_FAILURES = ('existence query failed', 'put failed', 'restore failed')

logger = logging.getLogger('lmdeploy')


def zero_store_counters() -> dict:
    """The Store tier's cumulative counters, all 0 (put bytes and objects by kind ``state`` /
    ``kv``; failures, hit tokens, rejected and already-existing objects): what
    :meth:`StoreTier.stats` starts from, and what an engine without a Store reports."""
    return {'store_put_bytes': {'state': 0, 'kv': 0}, 'store_put_objects': {'state': 0, 'kv': 0},
            'store_put_failures': 0, 'store_get_failures': 0, 'store_hit_tokens': 0,
            'store_rejected_objects': 0, 'store_existing_objects': 0, 'store_repaired_objects': 0}


@dataclass
class _SaveJob:
    kv: list[tuple[bytes, int, torch.Tensor]]     # (block hash, end token, payload) copied out
    state: tuple[bytes, int, torch.Tensor]        # (prefix hash, boundary, payload)
    prefix_keys: list[str] = field(default_factory=list)   # KV keys of every block in [0, b)


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
        queue_size: most pending save jobs; a full queue makes the save wait (back-pressure).
        services: embedded Mooncake services to stop on :meth:`close`, or None.
        secret: the Store secret keying every object's MAC (None: unauthenticated objects).
    """

    def __init__(self, client: StoreBackend, cache_engine, namespace: bytes, block_size: int,
                 queue_size: int = 64, services=None, secret: bytes | None = None):
        self.client = client
        self.secret = secret
        self.cache_engine = cache_engine
        self.namespace = namespace
        self.ns_hex = namespace.hex()
        self.block_size = block_size
        self.services = services
        self.writer_id = secrets.randbits(64)   # makes this engine's values differ from any other writer's
        self._stored = _KeySet(STORED_KEYS_CAPACITY)   # keys believed to be in the Store (bounded)
        self._bad = _KeySet(BAD_KEYS_CAPACITY)         # keys whose object failed verification here
        self._pending: set[str] = set()     # keys queued for a put
        self._lock = threading.Lock()
        self._last_failure_log = -float('inf')
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._inflight = 0
        self._idle = threading.Condition(self._lock)   # notified when _inflight drops to 0
        self.counters = zero_store_counters()
        self._worker = threading.Thread(target=self._run, name='lmdeploy-store', daemon=True)
        self._worker.start()

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

    # restore -------------------------------------------------------------------------------
    def probe(self, hashes: list[bytes], rules: ReuseRules, below: int | None = None) -> list[int]:
        """Boundaries ``b < below`` the Store can restore for an input, deepest first.

        ``b`` is restorable for ``rules`` (reusable, and its r recompute blocks among
        ``hashes``); the state object at ``b`` and the KV objects of blocks ``[0, b/B + r)``
        exist. Metadata only: two batched existence queries at most.
        """
        B, r = self.block_size, rules.recompute_blocks
        candidates = [b for b in rules.restore_candidates(0, len(hashes)) if below is None or b < below]
        if not candidates:
            return []
        present = self._exists([self._key('state', hashes[b // B - 1]) for b in candidates])
        candidates = [b for b, ok in zip(candidates, present or ()) if ok]
        if not candidates:
            return []
        kv = self._exists([self._key('kv', h) for h in hashes[:candidates[0] // B + r]])
        if kv is None:
            return []
        covered = kv.index(False) if False in kv else len(kv)
        return [b for b in candidates if b // B + r <= covered]

    def _exists(self, keys: list[str]) -> list[bool] | None:
        """Per key, whether it is stored (beliefs first, then one batched query); None when the
        query failed (counted as a get failure: a lookup that fails is a miss)."""
        with self._lock:
            known = [k in self._stored for k in keys]
        missing = [k for k, ok in zip(keys, known) if not ok]
        if not missing:
            return known
        answer = self.client.batch_exists(missing)
        with self._lock:
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
        and the runtime slot. False (counted; beliefs forgotten) if any object is missing or
        fails verification; the caller then rolls the admission back."""
        B, hashes = self.block_size, load.hashes
        try:
            state = self._get('state', hashes[load.boundary // B - 1], load.boundary)
            for i in range(load.first_block, load.boundary // B):
                payload = self._get('kv', hashes[i], (i + 1) * B)
                self.cache_engine.write_kv_block(load.block_ids[i], payload)
            self.cache_engine.write_state(load.slot, state)
        except (KeyError, StoreObjectError) as err:
            logger.info('Store restore at %d tokens failed: %s', load.boundary, err)
            with self._lock:    # a rejected object is not a Store outage: no warning about the master
                self._forget_all('object rejected' if isinstance(err, StoreObjectError) else 'restore failed')
            return False
        return True

    def record_hit(self, tokens: int) -> None:
        """Count ``tokens`` prompt tokens served from the Store (once per request)."""
        with self._lock:
            self.counters['store_hit_tokens'] += tokens

    def _get(self, kind: str, h: bytes, num_tokens: int) -> torch.Tensor:
        key = self._key(kind, h)
        data = self.client.get(key)
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
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    # save ----------------------------------------------------------------------------------
    def submit(self, put: StorePut) -> None:
        """Queue a :class:`StorePut`. Payloads are copied out before returning (the slot and
        blocks may change after this step); the puts run on the worker. Blocks believed stored
        or queued by an earlier job are not copied again."""
        B, hashes = self.block_size, put.hashes
        state_key = self._key('state', hashes[-1])
        keys = [self._key('kv', h) for h in hashes]
        with self._lock:
            if state_key in self._stored or state_key in self._pending:
                return
            new = [i for i, k in enumerate(keys) if k not in self._stored and k not in self._pending]
            self._pending.update(keys[i] for i in new)
            self._pending.add(state_key)
            self._inflight += 1
        try:
            payloads = self.cache_engine.read_kv_blocks([put.block_ids[i] for i in new]) if new else []
            kv = [(hashes[i], (i + 1) * B, payloads[j]) for j, i in enumerate(new)]
            job = _SaveJob(kv, (hashes[-1], put.boundary, self.cache_engine.read_state(put.slot)), keys)
        except BaseException:
            self._job_done([keys[i] for i in new] + [state_key])
            raise
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._execute(job)
            except Exception:       # never let one job kill the worker (flush would wait forever)
                logger.exception('Store save job failed')
            finally:
                self._job_done([self._key('kv', h) for h, _, _ in job.kv] + [self._key('state', job.state[0])])
                self._jobs.task_done()

    def _job_done(self, keys: list[str]) -> None:
        """Release a job's pending keys (those not put stay unstored) and its in-flight count."""
        with self._lock:
            self._pending.difference_update(keys)
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

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

    def _put(self, kind: str, h: bytes, num_tokens: int, payload: torch.Tensor) -> bool:
        """Put one object; counts bytes and objects only when the Store gained this value
        (:class:`PutResult`), so concurrent writers of one key count it once. A key this
        engine rejected is overwritten. True when the key now holds a complete object."""
        key = self._key(kind, h)
        data = encode_object(kind, self.namespace, num_tokens, payload.numpy().tobytes(), self.secret, key=key,
                             writer=self.writer_id)
        with self._lock:
            replace = key in self._bad
        result = self.client.put(key, data, replace=replace)
        with self._lock:
            self._pending.discard(key)
            if result.gained:
                self.counters['store_put_bytes'][kind] += payload.numel()
                self.counters['store_put_objects'][kind] += 1
                if result is PutResult.REPAIRED:
                    self.counters['store_repaired_objects'] += 1
            elif result is PutResult.EXISTS:
                self.counters['store_existing_objects'] += 1
            if result.ok:
                self._stored.add(key)
                self._bad.discard(key)
            else:
                self.counters['store_put_failures'] += 1
                self._forget_all('put failed')
        return result.ok

    def _execute(self, job: _SaveJob) -> None:
        h_state, b, state_payload = job.state
        state_key = self._key('state', h_state)
        present = self._present([self._key('kv', h) for h, _, _ in job.kv] + [state_key])
        if present is None:
            return
        state_present = present.pop()
        with self._lock:
            self.counters['store_existing_objects'] += sum(present) + state_present
        for (h, end, payload), exists in zip(job.kv, present):
            if not exists and not self._put('kv', h, end, payload):
                return      # leave the rest, and the state, to a later save of this prefix
        if state_present:
            return
        # the state is visible only above a complete prefix: ask the Store, not the beliefs
        # (a restarted master or an evicting Store may have lost blocks put earlier)
        prefix = self._present(job.prefix_keys)
        if prefix is None:
            return
        if not all(prefix):
            with self._lock:
                self._forget_all(f'{prefix.count(False)} KV objects below {b} tokens are missing')
            logger.info('Store save at %d tokens: state not put, %d of its blocks are not stored', b,
                        prefix.count(False))
            return
        self._put('state', h_state, b, state_payload)

    # lifecycle ----------------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        """Save jobs queued or running."""
        with self._lock:
            return self._inflight

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait up to ``timeout`` seconds until every queued save has been attempted; True when
        none is left in flight."""
        deadline = time.monotonic() + timeout
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict:
        """Store counters (put bytes/objects by kind, failures, hit tokens, rejected and
        already-existing objects)."""
        with self._lock:
            return json.loads(json.dumps(self.counters))

    def close(self, timeout: float = 60.0) -> None:
        """Flush (at most ``timeout`` seconds), stop the worker, disconnect, and stop embedded
        services. Idempotent."""
        if not self._worker.is_alive():
            return
        if not self.flush(timeout):
            logger.warning('Store: %d save jobs still in flight at close', self.num_inflight)
        self._jobs.put(None)
        self._worker.join(timeout=10)
        self.client.close()
        if self.services is not None:
            self.services.stop()


def _namespace(engine, secret: bytes | None) -> bytes:
    cfg = engine.config
    # the first start on a checkpoint hashes every weight byte (logged); later starts hit the digest cache
    return engine_namespace(engine.model_path, dtype=str(engine.dtype), block_size=cfg.block_size,
                            # payloads hold every head whatever the TP size (see store/layout.py)
                            layers=[repr(s) for s in engine.cache_engine.object_specs], tp_rank=0, tp_size=1,
                            adapter=None, override=cfg.store_namespace, secret=secret)


def _build_file_tier(engine) -> StoreTier:
    """The Store tier over a local folder (``store_backend='file:DIR'``)."""
    from ..store.file_backend import FileStore, parse_store_backend
    cfg = engine.config
    _, folder = parse_store_backend(cfg.store_backend)
    secret = resolve_secret(cfg.store_secret_file)
    if secret is None:
        logger.warning('Store objects in %s are NOT authenticated: no store_secret_file and no LMDEPLOY_STORE_SECRET. '
                       'Anyone who can write that folder can put objects that change this engine\'s outputs.', folder)
    client = FileStore(folder, cfg.store_file_max_bytes)
    return StoreTier(client, engine.cache_engine, _namespace(engine, secret), cfg.block_size, cfg.store_queue_size,
                     None, secret)


def build_store_tier(engine) -> StoreTier:
    """Connect the engine to the Store named by its config: a local folder for
    ``store_backend='file:DIR'``, else the Mooncake Store (starting embedded services for
    ``mooncake_master='local'``, stopped again if the connection fails).

    Raises:
        ValueError: an explicit ``mooncake_local_buffer_size`` cannot carry the largest Store object (a
            state snapshot or KV block plus the header, rounded up to Mooncake's allocation
            size), ``mooncake_metadata_server`` is missing for an external master, or
            ``store_secret_file`` cannot be read or holds fewer than 16 bytes, or the
            ``store_backend`` folder cannot be created or written.
        StoreUnavailableError: the master is unreachable (the message names the address).
    """
    cfg = engine.config
    if (cfg.store_backend or '').startswith('file:'):
        return _build_file_tier(engine)
    largest = max(engine.cache_engine.state_bytes, engine.cache_engine.kv_block_bytes) + OBJECT_OVERHEAD
    need = buffer_bytes_needed(largest)
    buffer_size = cfg.mooncake_local_buffer_size or max(64 << 20, need)
    if buffer_size < need:
        raise ValueError(f'mooncake_local_buffer_size ({cfg.mooncake_local_buffer_size} bytes) must be at least '
                         f'{need} bytes: the largest Store object of this model is {largest} bytes (state snapshot '
                         f'{engine.cache_engine.state_bytes} or KV block {engine.cache_engine.kv_block_bytes} plus '
                         f'the {OBJECT_OVERHEAD}-byte header and MAC), rounded up to Mooncake\'s allocation size')
    master, metadata = cfg.mooncake_master, cfg.mooncake_metadata_server
    if master != 'local' and metadata is None:
        raise ValueError('mooncake_metadata_server is required with an external mooncake_master '
                         '(e.g. http://HOST:PORT/metadata of the Store\'s HTTP metadata server)')
    secret = resolve_secret(cfg.store_secret_file)       # a bad secret file fails before anything starts
    if secret is None and master == 'local':
        secret = secrets.token_hex(32).encode()   # embedded services die with this engine: a per-run secret
    namespace = _namespace(engine, secret)
    services = None
    if master == 'local':
        from ..store.services import MooncakeServices
        services = MooncakeServices(segment_size=cfg.mooncake_embedded_segment_size)
        services.start()
        master, metadata = services.master_address, services.metadata_server
    try:
        client = StoreClient.connect(master, metadata, protocol=cfg.mooncake_protocol,
                                     segment_size=cfg.mooncake_segment_size,
                                     local_buffer_size=buffer_size)
    except BaseException:
        if services is not None:
            services.stop()
        raise
    # warned only once the Store is reached: before an unreachable master's fatal error, the
    # warning was the line a user read first, and it is not what stopped the server
    if secret is None:
        logger.warning('Store objects are NOT authenticated: no store_secret_file and no LMDEPLOY_STORE_SECRET. '
                       'Anyone who can reach the Mooncake master %s can put objects that change this engine\'s '
                       'outputs. Give every engine sharing the Store the same secret.', master)
    return StoreTier(client, engine.cache_engine, namespace, cfg.block_size, cfg.store_queue_size, services, secret)
