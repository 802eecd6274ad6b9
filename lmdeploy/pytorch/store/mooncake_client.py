"""Byte-level client of the Mooncake Store, and a dict-backed fake for fault tests.

This module owns the one ``mooncake.store.MooncakeDistributedStore`` handle of a process and
its failure policy. Invariants:

- Only :meth:`StoreClient.connect` raises (:class:`StoreUnavailableError`). After it returns,
  every failure is returned (``False`` / ``None``) and counted in :class:`StoreClientStats`,
  never raised into the engine.
- The native handle is never touched after :meth:`StoreClient.close` or before a successful
  setup: mooncake 0.3.13 segfaults on an operation against a closed or never-set-up store.
- A master that stops answering costs at most one slow call per caller: the first RPC failure
  (or a caller's :meth:`StoreClient.trip`, e.g. after a call missed the Store tier's deadline)
  opens a breaker, and until a health probe succeeds (at most once per ``retry_interval_s``)
  operations fail at once. The probe is a TCP connect and then a real native existence query
  that must answer within ``probe_timeout_s``: a stopped master (SIGSTOP) still accepts TCP
  connections, so a connect alone would close the breaker again.
- No lock is held across a native call: the native client is called from several threads at
  once (the Store tier's writers and its engine-side callers), so one stuck call never
  queues the others behind a lock. The one registered read-back buffer has its own lock.
- On a loopback setup (advertised address or master on loopback) the transfer engine's own listeners,
  which Mooncake binds to every interface, are pinned to the loopback interface right after
  setup (:mod:`.listeners`); if that is impossible, connect refuses.

Facts about ``mooncake-transfer-engine-non-cuda`` 0.3.13 this relies on (checked by
tests/test_mooncake_store.py):

- ``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
  rdma_devices, master_server_addr)`` returns 0 on success; ``global_segment_size=0`` is
  accepted (the process then contributes no memory and objects live in other processes'
  segments, e.g. a standalone ``mooncake_client``). Against an unreachable master it retries
  for ~90 s (20 tries x ~4.4 s), hence the TCP probe before it.
- ``put(key, value)`` returns 0 on success, **also when the key already exists** (the first
  value is kept, nothing is transferred) and when another put of the key is still in progress
  or died half-way (the key then stays absent); -600 when the value does not fit the local
  buffer (``local_buffer_size`` bounds the largest object); -900 (RPC failure) when the master
  is gone. There is no put-if-absent: ``batch_put_session_start`` reserves a key atomically
  but offers no way to fill it from Python.
- ``upsert(key, value)`` overwrites, also a half-written object (whose own end then fails).
- ``get_into_ranges`` reads a byte range of an object into a registered buffer: the range
  length on success, -704 for a missing key, -703 while the object is incomplete, -600 for a
  range past the value's end.
- ``remove(key, force)`` returns 0, or -704 for a missing key; -703 for an incomplete object.
- ``get(key)`` returns ``bytes``; ``b''`` both for a missing key and for a failure.
- ``is_exist(key)`` returns 1 / 0 / negative error; ``batch_is_exist(keys)`` a list of those.
- A put of an incomplete key (a writer killed mid-put) succeeds after the master's
  ``put_start_discard_timeout_sec`` (30 s by default); ``upsert`` succeeds at once.
- With the master killed, the first call fails at once and later ones take ~4.3 s each
  (an internal reconnect loop); the native calls release the GIL.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ...messages import split_host_port
from .backend import PutResult
from .listeners import is_loopback, listening_fds, pin_new_listeners

logger = logging.getLogger('lmdeploy')

OK = 0
ERR_INVALID_PARAMS = -600          # e.g. the value does not fit the local buffer
ERR_OBJECT_NOT_READY = -703        # a put of the key has started and not ended (or died)
ERR_OBJECT_NOT_FOUND = -704
ERR_OBJECT_ALREADY_EXISTS = -705   # not observed from put() in 0.3.13 (it returns 0), kept as success
ERR_RPC_FAIL = -900                # the master does not answer
_PUT_SUCCESS = (OK, ERR_OBJECT_ALREADY_EXISTS)


class StoreUnavailableError(RuntimeError):
    """The Store cannot be reached at connect time; the message names the address."""


@dataclass
class StoreClientStats:
    """Counters of one client since connect (objects, bytes). ``last_error`` is a short text of
    the most recent failure, for logs."""
    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    get_failures: int = 0
    exists_failures: int = 0
    existing: int = 0            # puts that found a complete value (another writer's or an earlier one)
    incomplete_found: int = 0    # keys a put reported stored that stayed absent (half-written objects)
    repaired: int = 0            # half-written or unusable objects replaced
    evicted: int = 0             # values a size-limited backend removed (least recently used first)
    last_error: str = ''


def buffer_bytes_needed(object_bytes: int) -> int:
    """Smallest ``local_buffer_size`` (bytes) through which an ``object_bytes``-byte value can
    be put or read.

    Mooncake 0.3.13 carves transfers out of the local buffer with an offset allocator whose size
    classes keep 3 bits below the leading one: a request is rounded up to a multiple of
    ``2**(bit_length - 4)``, e.g. 4144 -> 4608 and 16944 -> 18432 bytes; a buffer one byte
    smaller than that fails the put with -600 (measured against the real client for sizes from
    8 bytes to 4 MiB). Values below 8 bytes are not rounded.

    Raises:
        ValueError: ``object_bytes`` is negative.
    """
    if object_bytes < 0:
        raise ValueError(f'object_bytes must be >= 0, got {object_bytes}')
    if object_bytes < 8:
        return object_bytes
    step = 1 << (object_bytes.bit_length() - 4)
    return -(-object_bytes // step) * step


def parse_host_port(value: str, field_name: str) -> tuple[str, int]:
    """Split ``'host:port'``; raises ``ValueError`` naming ``field_name`` when malformed."""
    parsed = split_host_port(str(value))
    if parsed is None:
        raise ValueError(f'{field_name} must be "host:port" (an IPv6 host in brackets), got {value!r}')
    return parsed


def tcp_reachable(host: str, port: int, timeout_s: float) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _metadata_endpoint(metadata_server: str) -> tuple[str, int] | None:
    """Host and port of an ``http://`` metadata server URL; None for other schemes."""
    url = urlsplit(metadata_server)
    if url.scheme not in ('http', 'https') or not url.hostname:
        return None
    return url.hostname, url.port or (443 if url.scheme == 'https' else 80)


PROBE_BYTES = 64         # how much of a stored value a put reads back to see whose value it is
REPAIR_WAIT_S = 2.0      # how long a put waits for another writer's put of the key to complete,
SLOW_BYTES_PER_S = 100e6  # plus the time a slow writer takes for a value of this size
_POLL_S = 0.05
PROBE_TIMEOUT_S = 0.5    # a breaker health probe's native call must answer within this (seconds)
CLOSE_WAIT_S = 5.0       # close waits this long for native calls in progress (seconds)
HEALTH_KEY = 'lmdeploy-store-health'   # the key a health probe asks about (never stored)


class StoreClient:
    """A connected Mooncake Store client (bytes in, bytes out), a :class:`.backend.StoreBackend`;
    create with :meth:`connect`.

    The client may be shared between threads: native calls run concurrently (they block; the
    GIL is released meanwhile); only the breaker and counters are under a lock.

    Exact put results with concurrent writers: Mooncake's put keeps the first value of a key
    and reports success either way, so after a successful put the client reads back the first
    :data:`PROBE_BYTES` bytes of the stored value (one small ranged read) and compares them
    with its own. Values whose leading bytes are unique per writer (the object header carries a
    random writer id) therefore answer ``STORED`` for exactly one writer, ``EXISTS`` for the
    others. A key that stays absent for :data:`REPAIR_WAIT_S` seconds (plus its size at
    :data:`SLOW_BYTES_PER_S`, so a live writer of a large value is not cut off) after a
    successful put holds a half-written object (its writer died mid-put); the client replaces it with
    ``upsert`` and answers ``REPAIRED`` (``stats.incomplete_found``, ``stats.repaired``).
    """

    def __init__(self, native, master: tuple[str, int], local_buffer_size: int, retry_interval_s: float,
                 probe=None, repair_wait_s: float = REPAIR_WAIT_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
                 max_transfers: int = 1):
        self._store = native
        self._probe = probe                  # registered numpy buffer for ranged reads
        self.repair_wait_s = repair_wait_s
        self._master = master
        self._local_buffer_size = local_buffer_size
        self._retry_interval_s = retry_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._lock = threading.Lock()        # breaker, counters, _active; never held across a native call
        self._read_lock = threading.Lock()   # the registered read-back buffer
        # puts and gets each take room in the local buffer: at most this many at once, so that
        # concurrent writers never fail for want of buffer space
        self._transfers = threading.BoundedSemaphore(max(1, max_transfers))
        self._drained = threading.Condition(self._lock)
        self._active = 0                     # native calls in progress
        self._prober: threading.Thread | None = None
        self._closed = False
        self._down_since: float | None = None     # breaker open since (monotonic s)
        self._next_probe = 0.0
        self.stats = StoreClientStats()

    @classmethod
    def connect(cls, master_address: str, metadata_server: str, protocol: str = 'tcp',
                local_hostname: str = '127.0.0.1', segment_size: int = 0,
                local_buffer_size: int = 64 << 20, *, rdma_devices: str = '',
                connect_timeout_s: float = 2.0, retry_interval_s: float = 5.0,
                max_transfers: int = 1) -> 'StoreClient':
        """Set up a Mooncake Store client in this process.

        Args:
            master_address: ``'host:port'`` of ``mooncake_master``'s RPC port.
            metadata_server: metadata URL, e.g. ``'http://127.0.0.1:8080/metadata'``.
            protocol: ``'tcp'`` or ``'rdma'``.
            local_hostname: address this process's transfer engine advertises; also used as
                ``MC_TCP_BIND_ADDRESS`` when that variable is unset. When the advertised address
                (``MC_TCP_BIND_ADDRESS``) or the master is on loopback, the transfer engine's
                listeners are pinned to the loopback interface.
            segment_size: bytes of memory this process contributes to the Store (0 allowed).
            local_buffer_size: bytes of the transfer buffer; a value larger than this cannot
                be put (bytes).
            rdma_devices: RDMA device names (``protocol='rdma'`` only).
            connect_timeout_s: bound on each TCP probe of master/metadata server (seconds).
            retry_interval_s: after an RPC failure, operations fail fast for this long before
                the master is probed again (seconds).
            max_transfers: most puts and gets in progress at once (each takes room in the
                local buffer): ``local_buffer_size`` divided by the buffer one object needs.

        Raises:
            ValueError: a malformed argument (named).
            StoreUnavailableError: the master or metadata server does not accept connections,
                the ``mooncake`` package is missing, or setup fails; names the address.
            ExposedPortError: on a loopback setup a transfer port could not be pinned to
                loopback (see :mod:`.listeners`).
        """
        master = parse_host_port(master_address, 'master_address')
        if protocol not in ('tcp', 'rdma'):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        for name, value in (('segment_size', segment_size), ('local_buffer_size', local_buffer_size)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f'{name} must be a non-negative int (bytes), got {value!r}')
        if not local_hostname:
            raise ValueError('local_hostname must be non-empty')
        if not tcp_reachable(*master, connect_timeout_s):
            raise StoreUnavailableError(f'Mooncake master {master_address} is unreachable '
                                        f'(no TCP connection within {connect_timeout_s} s)')
        meta = _metadata_endpoint(metadata_server)
        if meta is not None and not tcp_reachable(*meta, connect_timeout_s):
            raise StoreUnavailableError(f'Mooncake metadata server {metadata_server} is unreachable '
                                        f'(no TCP connection within {connect_timeout_s} s)')
        # Mooncake binds its transfer listeners to this address (default: the first NIC).
        os.environ.setdefault('MC_TCP_BIND_ADDRESS', local_hostname)
        # Bound the native setup's own retry loop (20 x ~4.4 s by default) for a master that
        # accepts TCP but does not answer.
        os.environ.setdefault('MC_STORE_CLIENT_SETUP_RETRIES', '3')
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreUnavailableError(f'cannot use Mooncake master {master_address}: the mooncake package is '
                                        f'not installed (pip install -r requirements/store.txt): {e}') from e
        native = MooncakeDistributedStore()
        before = listening_fds()
        rc = native.setup(local_hostname, metadata_server, segment_size, local_buffer_size, protocol,
                          rdma_devices, master_address)
        if rc != OK:
            # A failed setup leaves nothing to close; the handle is dropped unused.
            raise StoreUnavailableError(f'Mooncake setup against master {master_address} (metadata '
                                        f'{metadata_server}) failed with code {rc}')
        # a loopback master means every Store peer is on this machine, and local peers reach any
        # of its addresses through the loopback interface: pinning can never cut one off
        if is_loopback(os.environ['MC_TCP_BIND_ADDRESS']) or is_loopback(master[0]):
            try:
                pin_new_listeners(before, f'Mooncake client of master {master_address}')
            except BaseException:
                native.close()
                raise
        import numpy as np
        probe = np.zeros(PROBE_BYTES, dtype=np.uint8)
        rc = native.register_buffer(probe.ctypes.data, probe.nbytes)
        if rc != OK:
            native.close()
            raise StoreUnavailableError(f'Mooncake client of master {master_address}: registering a '
                                        f'{PROBE_BYTES}-byte read buffer failed with code {rc}')
        return cls(native, master, local_buffer_size, retry_interval_s, probe, max_transfers=max_transfers)

    # -- failure policy -------------------------------------------------------------------

    def _enter(self) -> bool:
        """Admit one native call (counted in ``_active`` until :meth:`_exit`): False while
        closed, or while the breaker is open and the master has not passed a health probe (at
        most one every ``retry_interval_s``). The lock is never held across a native call."""
        with self._lock:
            if self._closed:
                return False
            if self._down_since is None:
                self._active += 1
                return True
            now = time.monotonic()
            if now < self._next_probe or (self._prober is not None and self._prober.is_alive()):
                return False
            self._next_probe = now + self._retry_interval_s
        if not self._health_probe():
            return False
        with self._lock:
            if self._closed:
                return False
            self._down_since = None
            self._active += 1
            return True

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._drained.notify_all()

    def _health_probe(self) -> bool:
        """Whether the master answers: a TCP connect (a killed master fails it at once), then
        one native existence query on its own thread that must answer within
        ``probe_timeout_s`` (a stopped master accepts TCP but never answers). A probe still
        stuck from an earlier attempt makes the next attempts fail without starting another."""
        if not tcp_reachable(*self._master, timeout_s=min(0.5, self._retry_interval_s)):
            return False
        answer: list[int] = []

        def ask():
            try:
                answer.append(self._store.is_exist(HEALTH_KEY))
            finally:
                self._exit()

        with self._lock:
            if self._closed:
                return False
            self._active += 1
            self._prober = threading.Thread(target=ask, name='lmdeploy-store-health', daemon=True)
            prober = self._prober
        prober.start()
        prober.join(self._probe_timeout_s)
        return bool(answer) and answer[0] >= 0

    def _note(self, rc: int, what: str) -> None:
        """Record a failed native call; an RPC failure opens the breaker. Lock held."""
        self.stats.last_error = f'{what}: code {rc}'
        if rc == ERR_RPC_FAIL and self._down_since is None:
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + self._retry_interval_s

    def trip(self) -> None:
        """Open the breaker now, e.g. because a caller saw a call miss its deadline: operations
        fail at once until a health probe (a native call answered within ``probe_timeout_s``)
        succeeds, at most one every ``retry_interval_s`` seconds."""
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._next_probe = self._down_since + self._retry_interval_s
                self.stats.last_error = 'breaker tripped: a call missed its deadline'

    @property
    def available(self) -> bool:
        """False when closed or while the breaker is open (the master failed recently)."""
        return not self._closed and self._down_since is None

    # -- operations -----------------------------------------------------------------------

    def put(self, key: str, value, *, replace: bool = False) -> PutResult:
        """Store ``value`` (bytes-like) under ``key``; see the class docstring for what each
        :class:`PutResult` means. ``replace=True`` overwrites a complete value (``upsert``).
        ``FAILED`` is counted in ``stats.put_failures``; a value larger than
        ``local_buffer_size`` fails without I/O."""
        view = memoryview(value).cast('B')
        size = view.nbytes
        if size > self._local_buffer_size:
            with self._lock:
                self.stats.put_failures += 1
                self.stats.last_error = f'put {key}: {size} bytes exceed local_buffer_size {self._local_buffer_size}'
            return PutResult.FAILED
        if not self._enter():
            with self._lock:
                self.stats.put_failures += 1
            return PutResult.FAILED
        try:
            with self._transfers:
                rc = self._store.upsert(key, value) if replace else self._store.put(key, value)
            holder = self._holder(key, view) if rc in _PUT_SUCCESS else None
        finally:
            self._exit()
        if holder is None:
            return self._put_failed(rc, f'put {key}')
        deadline = time.monotonic() + self.repair_wait_s + size / SLOW_BYTES_PER_S
        while holder == 'absent' and time.monotonic() < deadline:
            time.sleep(_POLL_S)              # another writer's put may still be transferring
            if not self._enter():
                holder = 'failed'
                break
            try:
                holder = self._holder(key, view)
            finally:
                self._exit()
        if holder == 'absent':               # put said yes, the key says no: a half-written object
            with self._lock:
                self.stats.incomplete_found += 1
            if not self._enter():
                return self._put_failed(ERR_RPC_FAIL, f'repair {key}')
            try:
                with self._transfers:
                    rc = self._store.upsert(key, value)
                holder = self._holder(key, view) if rc in _PUT_SUCCESS else None
            finally:
                self._exit()
            if holder is None:
                return self._put_failed(rc, f'repair {key}')
            replace = True
        with self._lock:
            if holder == 'ours':
                self.stats.puts += 1
                self.stats.put_bytes += size
                if replace:
                    self.stats.repaired += 1
                return PutResult.REPAIRED if replace else PutResult.STORED
            if holder == 'other':
                self.stats.existing += 1
                return PutResult.EXISTS
        return self._put_failed(ERR_RPC_FAIL if holder == 'failed' else ERR_OBJECT_NOT_READY, f'put {key}')

    def _put_failed(self, rc: int, what: str) -> PutResult:
        """Count a failed put."""
        with self._lock:
            self._note(rc, what)
            self.stats.put_failures += 1
        return PutResult.FAILED

    def _holder(self, key: str, view: memoryview) -> str:
        """Whose value ``key`` holds: ``'ours'`` (its first bytes equal ``view``'s), ``'other'``,
        ``'absent'`` (missing or incomplete) or ``'failed'`` (the read failed). Inside
        :meth:`_enter`; the one registered read-back buffer is used by one thread at a time."""
        n = min(PROBE_BYTES, view.nbytes)
        if n == 0:
            rc = self._store.is_exist(key)
            return 'ours' if rc == 1 else 'absent' if rc == 0 else 'failed'
        with self._read_lock:
            rc = self._store.get_into_ranges([self._probe.ctypes.data], [[key]], [[[0]]], [[[0]]], [[[n]]])[0][0][0]
            head = self._probe[:n].tobytes() if rc == n else b''
        if rc == n:
            return 'ours' if head == view[:n].tobytes() else 'other'
        if rc in (ERR_OBJECT_NOT_FOUND, ERR_OBJECT_NOT_READY):
            return 'absent'
        if rc == ERR_INVALID_PARAMS:         # the stored value is shorter than ours: not ours
            return 'other'
        with self._lock:
            self._note(rc, f'read back {key}')
        return 'failed'

    def remove(self, key: str) -> bool:
        """Remove ``key`` (forced: leases and replication tasks are skipped); True when it is
        gone afterwards (also when it was missing). An incomplete object cannot be removed."""
        if not self._enter():
            return False
        try:
            rc = self._store.remove(key, True)
        finally:
            self._exit()
        if rc in (OK, ERR_OBJECT_NOT_FOUND):
            return True
        with self._lock:
            self._note(rc, f'remove {key}')
        return False

    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None when it is missing (``stats.get_misses``)
        or cannot be read (``stats.get_failures``: master down, value larger than the local
        buffer, transfer error)."""
        if not self._enter():
            with self._lock:
                self.stats.get_failures += 1
            return None
        try:
            with self._transfers:
                data = self._store.get(key)
            # get() returns b'' for a miss and for a failure alike; ask which one.
            rc = None if data else self._store.is_exist(key)
        finally:
            self._exit()
        with self._lock:
            if data:
                self.stats.gets += 1
                self.stats.get_bytes += len(data)
                return data
            if rc == 0:
                self.stats.get_misses += 1
            elif rc < 0:
                self._note(rc, f'get {key}')
                self.stats.get_failures += 1
            else:
                self.stats.get_failures += 1
                self.stats.last_error = f'get {key}: exists but could not be read (larger than the local buffer?)'
            return None

    def exists(self, key: str) -> bool:
        """True when ``key`` holds a complete value; False when it does not or the query failed."""
        return bool((self.batch_exists([key]) or [False])[0])

    def batch_exists(self, keys: list[str]) -> list[bool] | None:
        """Per key: True when a complete value is stored, False when not; None when the query
        failed for any key (counted in ``stats.exists_failures``)."""
        if not keys:
            return []
        if not self._enter():
            with self._lock:
                self.stats.exists_failures += len(keys)
            return None
        try:
            codes = self._store.batch_is_exist(list(keys)) if len(keys) > 1 else [self._store.is_exist(keys[0])]
        finally:
            self._exit()
        failed = [c for c in codes if c < 0]
        if failed:
            with self._lock:
                self._note(failed[0], f'exists ({len(failed)} of {len(keys)} keys)')
                self.stats.exists_failures += len(failed)
            return None
        return [c == 1 for c in codes]

    def close(self) -> None:
        """Release the native client (idempotent); later operations fail without I/O. Waits
        up to :data:`CLOSE_WAIT_S` seconds for native calls in progress; if one is still stuck
        (a master that stopped answering), the handle is left open rather than closed under
        a running call (which would crash the process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            drained = self._drained.wait_for(lambda: self._active == 0, CLOSE_WAIT_S)
        if not drained:
            logger.warning('Mooncake client: %d native calls still running after %d s; the handle is left open',
                           self._active, CLOSE_WAIT_S)
            return
        self._store.close()


@dataclass
class FakeStoreClient:
    """Dict-backed stand-in of :class:`StoreClient` for unit-level fault injection only.

    ``fail_puts`` / ``fail_gets`` / ``fail_exists`` hold how many upcoming calls of that kind
    fail; ``down=True`` fails every call (a dead master). ``put_keys`` records every attempted
    put in order, for asserting what was written and when.
    """
    objects: dict = field(default_factory=dict)
    fail_puts: int = 0
    fail_gets: int = 0
    fail_exists: int = 0
    down: bool = False
    put_keys: list = field(default_factory=list)
    stats: StoreClientStats = field(default_factory=StoreClientStats)
    closed: bool = False
    # one put at a time: concurrent writers of a key get one STORED, as from the real Store
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def available(self) -> bool:
        return not self.closed and not self.down

    def _fail(self, counter: str) -> bool:
        if not self.available:
            return True
        if getattr(self, counter) > 0:
            setattr(self, counter, getattr(self, counter) - 1)
            return True
        return False

    def put(self, key: str, value, *, replace: bool = False) -> PutResult:
        with self._lock:
            return self._put(key, value, replace)

    def _put(self, key: str, value, replace: bool) -> PutResult:
        self.put_keys.append(key)
        if self._fail('fail_puts'):
            self.stats.put_failures += 1
            return PutResult.FAILED
        data = bytes(value)
        if key in self.objects and not replace:     # "already exists" keeps the first value
            self.stats.existing += 1
            return PutResult.EXISTS
        self.objects[key] = data
        self.stats.puts += 1
        self.stats.put_bytes += len(data)
        return PutResult.REPAIRED if replace else PutResult.STORED

    def remove(self, key: str) -> bool:
        if not self.available:
            return False
        self.objects.pop(key, None)
        return True

    def get(self, key: str) -> bytes | None:
        if self._fail('fail_gets'):
            self.stats.get_failures += 1
            return None
        data = self.objects.get(key)
        if data is None:
            self.stats.get_misses += 1
            return None
        self.stats.gets += 1
        self.stats.get_bytes += len(data)
        return data

    def exists(self, key: str) -> bool:
        return bool((self.batch_exists([key]) or [False])[0])

    def batch_exists(self, keys: list[str]) -> list[bool] | None:
        if self._fail('fail_exists'):
            self.stats.exists_failures += len(keys)
            return None
        return [k in self.objects for k in keys]

    def close(self) -> None:
        self.closed = True
