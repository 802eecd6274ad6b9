"""The Mooncake Store tier of the prefix cache (SPEC §5–7).

It answers the same questions as the local prefix cache (STYLE lesson 6) — how deep a prefix
does the Store hold, load it, save it — and is the one owner of Store objects: which keys
this engine has stored, the background put worker and the Store counters.

Save at boundary b (called right after the forward that ends at b)::

    copy out now:   state payload (runtime slot) + KV payloads of blocks in [0, b) not yet stored
    worker later:   put kv/{hash_i} for each new block  →  all ok?  →  put state/{hash_b}

so a visible state object implies its whole KV prefix is stored. Blocks of ``[0, b)`` that an
earlier, still queued job is putting are not copied again; the job records them as
dependencies, and the worker (one thread, jobs in FIFO order) puts the state only if they all
succeeded. A failed put is counted, is not marked stored, and a later save of the same prefix
retries it. Bytes counted are payload bytes (the 48-byte header and 32-byte MAC of each object
excluded), so a turn's put bytes equal ``len(save_points)·S + new_blocks·K_blk``.

Restore at admission: the deepest boundary above the local hit that is reusable for this
input (SPEC §3, all four rules) and whose state object and every KV object below it exist;
payloads are verified (header, namespace, token count, checksum, MAC) and copied into fresh blocks
and the sequence's runtime slot. Any mismatch is a counted miss, never an error to the user; a
failed existence query at lookup counts as a get failure.

Known limits: Mooncake never overwrites a key, so a corrupt object stays a (counted) miss until
the Store evicts it; objects evicted by the Store after this engine put them are still believed
stored by this engine, so it will not put them again (another engine's lookup then finds the
prefix incomplete and misses).
"""
from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
from collections import OrderedDict
import time
from dataclasses import dataclass, field

import torch

from ..paging.prefill_plan import is_reusable
from .mooncake_client import StoreClient, buffer_bytes_needed
from .identity import engine_namespace, resolve_secret
from .object_format import OBJECT_OVERHEAD, StoreObjectError, decode_object, encode_object, object_key

__all__ = ['StoreTier', 'build_store_tier']

logger = logging.getLogger('lmdeploy')


@dataclass
class _SaveJob:
    kv: list[tuple[bytes, int, torch.Tensor]]     # (block hash, end token, payload)
    state: tuple[bytes, int, torch.Tensor] | None  # (prefix hash, boundary, payload)
    deps: list[str] = field(default_factory=list)  # KV keys of [0, b) queued by earlier jobs


STORED_KEYS_CAPACITY = 1 << 18   # keys remembered as stored (~40 MB); older ones are asked again


class _KeySet:
    """A set of Store keys that forgets the oldest beyond ``capacity``: forgetting costs one
    existence query (or one harmless re-put of an existing key), never correctness."""

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


class StoreTier:
    """Store-backed prefix tier for one engine.

    Args:
        client: a connected :class:`StoreClient`.
        cache_engine: where payloads are read from and written to.
        namespace: 16-byte namespace digest (SPEC §7).
        block_size: tokens per block (B).
        alignment: checkpoint alignment (A).
        queue_size: most pending save jobs; a full queue makes the save wait (back-pressure).
        services: embedded Mooncake services to stop on :meth:`close`, or None.
        secret: the Store secret keying every object's MAC (None: unauthenticated objects).
    """

    def __init__(self, client: StoreClient, cache_engine, namespace: bytes, block_size: int, alignment: int,
                 queue_size: int = 64, services=None, secret: bytes | None = None):
        self.client = client
        self.secret = secret
        self.cache_engine = cache_engine
        self.namespace = namespace
        self.ns_hex = namespace.hex()
        self.block_size = block_size
        self.alignment = alignment
        self.services = services
        self._stored = _KeySet(STORED_KEYS_CAPACITY)   # keys known to be in the Store (bounded)
        self._pending: set[str] = set()     # keys queued for a put
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._inflight = 0
        self._idle = threading.Condition(self._lock)   # notified when _inflight drops to 0
        self.counters = {'store_put_bytes': {'state': 0, 'kv': 0}, 'store_put_objects': {'state': 0, 'kv': 0},
                         'store_put_failures': 0, 'store_get_failures': 0, 'store_hit_tokens': 0,
                         'store_rejected_objects': 0}
        self._worker = threading.Thread(target=self._run, name='lmdeploy-store', daemon=True)
        self._worker.start()

    def _key(self, kind: str, h: bytes) -> str:
        return object_key(self.ns_hex, kind, h.hex())

    # restore -------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], seq, local_cached: int, below: int | None = None) -> int:
        """Deepest boundary ``local_cached < b < below`` the Store can restore for ``seq``, or 0.

        ``b`` is reusable for this input (SPEC §3: aligned, leaves the required suffix, room for
        the r recompute blocks, not inside a multimodal span); the state object at ``b`` and KV
        objects for blocks ``[0, b/B + r)`` must exist.
        """
        B, A, n = self.block_size, self.alignment, seq.num_tokens
        top = n // A * A if below is None else min(n // A * A, below - A)
        candidates = [b for b in range(top, local_cached, -A)
                      if b // B + seq.recompute_blocks <= len(hashes)
                      and is_reusable(b, n, B, A, seq.token_lookahead, seq.recompute_blocks, seq.multimodal_spans)]
        if not candidates:
            return 0
        state_keys = [self._key('state', hashes[b // B - 1]) for b in candidates]
        present = self._exists(state_keys)
        for b, ok in zip(candidates, present):
            if not ok:
                continue
            kv_keys = [self._key('kv', h) for h in hashes[:b // B + seq.recompute_blocks]]
            if all(self._exists(kv_keys)):
                return b
        return 0

    def _exists(self, keys: list[str]) -> list[bool]:
        with self._lock:
            known = [k in self._stored for k in keys]
        missing = [k for k, ok in zip(keys, known) if not ok]
        if not missing:
            return known
        failures = self.client.stats.exists_failures
        found = dict(zip(missing, self.client.batch_exists(missing)))
        with self._lock:      # present objects are never put again by this engine
            self._stored.update(k for k, ok in found.items() if ok)
            if self.client.stats.exists_failures != failures:    # the query failed, not "absent"
                self.counters['store_get_failures'] += 1
        return [ok or found.get(k, False) for k, ok in zip(keys, known)]

    def load(self, hashes: list[bytes], boundary: int, block_ids: list[int], slot: int, first_block: int) -> bool:
        """Copy the prefix ``[0, boundary)`` from the Store into ``block_ids[first_block:]`` and
        state slot ``slot``; False (counted) if any object is missing or fails verification."""
        B = self.block_size
        try:
            state = self._get('state', hashes[boundary // B - 1], boundary)
            for i in range(first_block, boundary // B):
                payload = self._get('kv', hashes[i], (i + 1) * B)
                self.cache_engine.write_kv_block(block_ids[i], payload)
            self.cache_engine.write_state(slot, state)
        except (KeyError, StoreObjectError) as err:
            logger.info('Store restore at %d tokens failed: %s', boundary, err)
            return False
        return True

    def record_hit(self, tokens: int) -> None:
        """Count ``tokens`` prompt tokens served from the Store (called once the admission that
        loaded them has committed)."""
        with self._lock:
            self.counters['store_hit_tokens'] += tokens

    def _get(self, kind: str, h: bytes, num_tokens: int) -> torch.Tensor:
        data = self.client.get(self._key(kind, h))
        if data is None:
            with self._lock:
                self.counters['store_get_failures'] += 1
            raise KeyError(f'{kind} object missing')
        try:
            payload = decode_object(data, kind, self.namespace, num_tokens, self.secret)
        except StoreObjectError:
            with self._lock:
                self.counters['store_rejected_objects'] += 1
            raise
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    # save ----------------------------------------------------------------------------------
    def save(self, hashes: list[bytes], block_ids: list[int], boundary: int, slot: int) -> None:
        """Queue the save of prefix ``[0, boundary)`` (``hashes``/``block_ids``: its
        ``boundary / B`` blocks; ``slot``: the runtime state slot holding the state after
        exactly ``boundary`` tokens). Payloads are copied out before returning; the puts run on
        the worker. Blocks already stored or queued by an earlier job are not copied again."""
        B = self.block_size
        state_key = self._key('state', hashes[-1])
        with self._lock:
            if state_key in self._stored or state_key in self._pending:
                return
            keys = [self._key('kv', h) for h in hashes]
            new = [i for i, k in enumerate(keys) if k not in self._stored and k not in self._pending]
            deps = [k for k in keys if k in self._pending]
            self._pending.update(keys[i] for i in new)
            self._pending.add(state_key)
            self._inflight += 1
        try:
            payloads = self.cache_engine.read_kv_blocks([block_ids[i] for i in new]) if new else []
            kv = [(hashes[i], (i + 1) * B, payloads[j]) for j, i in enumerate(new)]
            job = _SaveJob(kv, (hashes[-1], boundary, self.cache_engine.read_state(slot)), deps)
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

    def _put(self, kind: str, h: bytes, num_tokens: int, payload: torch.Tensor) -> bool:
        key = self._key(kind, h)
        data = encode_object(kind, self.namespace, num_tokens, payload.numpy().tobytes(), self.secret)
        ok = self.client.put(key, data)
        with self._lock:
            self._pending.discard(key)
            if ok:
                self._stored.add(key)
                self.counters['store_put_bytes'][kind] += payload.numel()
                self.counters['store_put_objects'][kind] += 1
            else:
                self.counters['store_put_failures'] += 1
        return ok

    def _execute(self, job: _SaveJob) -> None:
        for h, end, payload in job.kv:
            if not self._put('kv', h, end, payload):
                return      # leave the rest, and the state, to a later save of this prefix
        with self._lock:    # blocks queued by earlier jobs: those jobs have run (FIFO, one worker)
            missing = [k for k in job.deps if k not in self._stored]
        h, b, payload = job.state
        if missing:
            logger.info('Store save at %d tokens: state not put, %d of its blocks failed earlier', b, len(missing))
            return
        self._put('state', h, b, payload)

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
        """Store counters (SPEC §9)."""
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


def build_store_tier(engine) -> StoreTier:
    """Connect the engine to the Mooncake Store named by its config (starting embedded services
    for ``mooncake_master='local'``, stopped again if the connection fails).

    Raises:
        ValueError: an explicit ``mooncake_local_buffer_size`` cannot carry the largest Store object (a
            state snapshot or KV block plus the header, rounded up to Mooncake's allocation
            size), ``mooncake_metadata_server`` is missing for an external master, or
            ``store_secret_file`` cannot be read or holds fewer than 16 bytes.
        StoreUnavailableError: the master is unreachable (the message names the address).
    """
    cfg = engine.config
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
    elif secret is None:
        logger.warning('Store objects are NOT authenticated: no store_secret_file and no LMDEPLOY_STORE_SECRET. '
                       'Anyone who can reach the Mooncake master %s can put objects that change this engine\'s '
                       'outputs. Give every engine sharing the Store the same secret.', master)
    # the first start on a checkpoint hashes every weight byte (logged); later starts hit the digest cache
    namespace = engine_namespace(engine.model_path, dtype=str(engine.dtype), block_size=cfg.block_size,
                                 layers=[repr(s) for s in engine.specs], tp_rank=0, tp_size=1, adapter=None,
                                 override=cfg.store_namespace, secret=secret)
    services = None
    if master == 'local':
        from .services import MooncakeServices
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
    return StoreTier(client, engine.cache_engine, namespace, cfg.block_size, cfg.prefill_save_alignment,
                     cfg.store_queue_size, services, secret)
