"""Local Mooncake Store services: a ``mooncake_master``, a metadata server and a segment owner.

This module owns the three child processes of the embedded mode (``--mooncake-master local``)
and of the tests. Invariants:

- Everything listens on, and advertises, ``host`` (default 127.0.0.1): the master's RPC and
  metrics/admin ports (``--rpc_address``, ``--metrics_host``) and the HTTP metadata server
  (:mod:`.metadata_server`) are free ports picked by binding port 0; all run with
  ``MC_TCP_BIND_ADDRESS=host``. The master's own HTTP metadata server is off: Mooncake 0.3.13
  ignores its host flag and would listen on every interface.
- The segment owner (:mod:`.segment_owner`, a Python process) owns the memory segment, so
  objects put by an engine that contributes no memory (segment size 0) stay readable after that
  engine exits, until :meth:`stop`. On a loopback ``host`` its transfer listeners, which
  Mooncake binds to every interface, are pinned to the loopback interface.
- :meth:`MooncakeServices.start` returns only when every process is ready (its port accepts
  connections and, where ``/proc`` tells, the listener is that process: :func:`listens_on`), and
  otherwise raises ``RuntimeError`` naming the address and quoting the last log lines. A start
  that failed because another process took one of the picked ports is made again on new ports
  (:data:`PORT_ATTEMPTS` starts in all).
- :meth:`MooncakeServices.restart_master` (fault tests) brings a fresh, empty master up on the
  same ports and returns once the owner's segment is mounted at it again.

::

    engine (StoreClient, segment 0) --RPC--> mooncake_master (rpc_port, metrics_port)
        |   \\                                     ^
        |    `--TCP transfer--> segment owner ---'  (owns the segment_size-byte segment)
        `--HTTP--> metadata server (metadata_port) <--'  (where each transfer endpoint lives)
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

from .mooncake_client import tcp_reachable

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])     # the folder holding lmdeploy/
PORT_ATTEMPTS = 3     # starts on freshly picked ports when another process took a picked one first

logger = logging.getLogger(__name__)


def find_binary(name: str) -> str | None:
    """Path of the Mooncake executable ``name`` (``mooncake_master``, the only one used; the
    segment is held by :mod:`.segment_owner`, a Python process).

    Prefers the binary shipped inside the installed ``mooncake`` package (the console script on
    PATH is a Python wrapper that execs it), then PATH. None when neither exists.
    """
    try:
        import mooncake
        for folder in mooncake.__path__:
            candidate = Path(folder) / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    except ImportError:
        pass
    return shutil.which(name)


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports that were free on ``host`` a moment ago (bound to port 0 together,
    then released; another process could still take one before it is used)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(host: str, port: int) -> bool:
    """Whether a process listens on TCP ``host:port`` (a bind with ``SO_REUSEADDR`` fails; a
    port left in TIME_WAIT by an ended process counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[int] | None:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 or IPv6) in this network
    namespace, from Linux's ``/proc/net/tcp`` and ``tcp6`` (state ``0A`` is LISTEN); None where
    neither table can be read."""
    found, readable = set(), False
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            try:
                if fields[3] == '0A' and int(fields[1].rsplit(':', 1)[1], 16) == port:
                    found.add(int(fields[9]))
            except (IndexError, ValueError):
                continue
    return found if readable else None


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on TCP ``port``: True or False, or None
    where ``/proc`` cannot tell (not Linux, or the process's descriptors are not readable).

    A port that accepts connections need not be our child's: a port picked free by
    :func:`free_ports` can be taken by another process before the child binds it, and the child
    then exits while the other process answers. Readiness asks this too."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        return None
    for fd in fds:
        try:
            link = os.readlink(f'/proc/{pid}/fd/{fd}')
        except OSError:
            continue
        if link.startswith('socket:[') and link[8:-1].isdigit() and int(link[8:-1]) in inodes:
            return True
    return False


def pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig TERM`` where available, so the services end with their owner even
    when it is killed with SIGKILL (no atexit or finally runs then).

    The kernel sends the signal when the *thread* that spawned the child exits, so it is only
    used when spawning from the main thread, whose end is the process's end. (A ``preexec_fn``
    calling prctl would do the same without the helper binary, but is unsafe in a process that
    already runs other threads, as the engine does.)
    """
    if sys.platform != 'linux' or threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which('setpriv')
    return [setpriv, '--pdeathsig', 'TERM'] if setpriv else []


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a child process's log file (for an error message), or
    ``'<no log>'`` when it cannot be read."""
    try:
        with open(path, errors='replace') as f:
            return ''.join(deque(f, maxlen=lines))
    except OSError:
        return '<no log>'


def _in_log_dir(name: str, doc: str) -> property:
    """A read-only property: the file ``name`` in the instance's ``log_dir`` (a Path)."""
    return property(lambda self: self.log_dir / name, doc=doc)


class MooncakeServices:
    """A ``mooncake_master``, an HTTP metadata server (:mod:`.metadata_server`) and a segment
    owner (:mod:`.segment_owner`, ``segment_size`` bytes of memory), on ``host``. Use as a context manager or call
    :meth:`start` / :meth:`stop`.

    Args:
        segment_size: bytes of memory the standalone client contributes (>= 16 MiB, the
            smallest segment Mooncake 0.3.13 accepts).
        host: the address every port binds to and advertises.
        start_timeout_s: how long each process may take to accept connections (seconds).
        log_dir: folder for ``master.log`` / ``client.log``; default: a new temp dir, removed by
            :meth:`stop` unless ``keep_logs``.
        keep_logs: keep a temp log dir after :meth:`stop`.
        master_args: extra ``mooncake_master`` flags, e.g. ``('--eviction_ratio=0',
            '--eviction_high_watermark_ratio=1.0')`` for a store that refuses puts when full
            instead of evicting objects (its default).
        master_port, metadata_port, metrics_port: fixed ports for the master's RPC, the metadata
            server and the master's metrics endpoint (1-65535, distinct); 0 (default) = a free
            port picked at :meth:`start`.

    Raises:
        ValueError: ``segment_size`` below 16 MiB, a non-positive ``start_timeout_s``, a
            ``host`` this machine cannot bind (not one of its IPv4 addresses), or a port out of
            range or given twice (names the argument).
    """

    def __init__(self, segment_size: int = 256 << 20, *, host: str = '127.0.0.1', start_timeout_s: float = 30.0,
                 log_dir: str | os.PathLike | None = None, keep_logs: bool = False, master_args: tuple[str, ...] = (),
                 master_port: int = 0, metadata_port: int = 0, metrics_port: int = 0):
        fixed = {'master_port': master_port, 'metadata_port': metadata_port, 'metrics_port': metrics_port}
        for name, port in fixed.items():
            if not isinstance(port, int) or not 0 <= port <= 65535:
                raise ValueError(f'{name} must be a port number 1-65535 (0 = pick a free one), got {port!r}')
        chosen = [p for p in fixed.values() if p]
        if len(set(chosen)) != len(chosen):
            raise ValueError(f'master_port, metadata_port and metrics_port must differ, got {fixed}')
        self._fixed_ports = (master_port, metadata_port, metrics_port)
        if not isinstance(segment_size, int) or segment_size < 16 << 20:
            raise ValueError(f'segment_size must be an int >= 16 MiB (bytes), got {segment_size!r}')
        if start_timeout_s <= 0:
            raise ValueError(f'start_timeout_s must be positive, got {start_timeout_s!r}')
        try:
            free_ports(host, 1)
        except OSError as err:
            raise ValueError(f'host {host!r} cannot be bound on this machine ({err}); give one of its IPv4 '
                             f'addresses, e.g. 127.0.0.1') from err
        self.segment_size = segment_size
        self.master_args = tuple(master_args)
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._own_log_dir = log_dir is None
        self._keep_logs = keep_logs
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.rpc_port = self.metadata_port = self.metrics_port = 0
        self._master: subprocess.Popen | None = None
        self._client: subprocess.Popen | None = None       # the segment owner
        self._metadata: subprocess.Popen | None = None
        self._logs: list = []

    @property
    def master_address(self) -> str:
        """``'host:port'`` of the master's RPC service."""
        return f'{self.host}:{self.rpc_port}'

    @property
    def metadata_server(self) -> str:
        """URL of the HTTP metadata server (:mod:`.metadata_server`; the master's embedded one is off)."""
        return f'http://{self.host}:{self.metadata_port}/metadata'

    master_log = _in_log_dir('master.log', 'Log of ``mooncake_master``.')
    client_log = _in_log_dir('client.log', 'Log of the segment owner.')
    metadata_log = _in_log_dir('metadata.log', 'Log of the HTTP metadata server.')
    _ready_file = _in_log_dir('owner.ready', 'The file the segment owner creates once its segment is mounted.')

    def _spawn(self, binary: str, args: list[str], log: Path) -> subprocess.Popen:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=self.host)
        # the segment owner imports this package: the same copy as this process
        env['PYTHONPATH'] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get('PYTHONPATH')) if p)
        out = open(log, 'ab')
        self._logs.append(out)
        return subprocess.Popen([*pdeathsig_prefix(), binary, *args], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=self.log_dir)

    def _wait_ready(self, proc: subprocess.Popen, name: str, endpoints: list[tuple[str, int]], log: Path,
                    ready_file: Path | None = None) -> None:
        """Poll until every endpoint accepts TCP (and ``ready_file`` exists); raise RuntimeError
        on exit or timeout."""
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(endpoints)
        where = '%s:%d' % endpoints[0] if endpoints else f'master {self.master_address}'
        while pending or (ready_file is not None and not ready_file.exists()):
            if proc.poll() is not None:
                tail = log_tail(log)
                self.stop()
                raise RuntimeError(f'{name} for {where} exited with code {proc.returncode} before it was ready; '
                                   f'last lines of {log}:\n{tail}')
            # ready: the port accepts, and the listener is this child (not another process
            # that took the port first; /proc may be unable to tell, then the port alone counts)
            if pending and tcp_reachable(*pending[0], timeout_s=0.2) and listens_on(proc.pid, pending[0][1]) is not False:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                what = 'did not accept connections at %s:%d' % pending[0] if pending else f'for {where} was not ready'
                tail = log_tail(log)
                self.stop()
                raise RuntimeError(f'{name} {what} within {self.start_timeout_s} s; last lines of {log}:\n{tail}')
            time.sleep(0.05)

    def start(self) -> 'MooncakeServices':
        """Start master then segment owner and wait until both are ready (a no-op while
        running; after :meth:`stop` it starts fresh processes on new ports).

        Ports picked free (the ``0`` ones) can be taken by another process before a service binds
        them; a start that fails while one of them is held by another process is made again on
        new ports, up to :data:`PORT_ATTEMPTS` starts in all (a warning is logged).

        Raises:
            ValueError: a fixed port is already in use (names the argument).
            RuntimeError: the binary is missing, or a process exits or is not ready in time
                (names the address, quotes the log; a segment owner that cannot keep its
                transfer ports on loopback exits with the reason in its log).
        """
        if self._master is not None:
            return self
        master_bin = find_binary('mooncake_master')
        if master_bin is None:
            raise RuntimeError('mooncake_master not found; install requirements/store.txt')
        # a fixed port another process listens on would pass the readiness check (it accepts
        # connections) while our service exits at once: refuse it up front, naming it
        for name, port in zip(('master_port', 'metadata_port', 'metrics_port'), self._fixed_ports):
            if port and port_in_use(self.host, port):
                raise ValueError(f'{name}={port}: {self.host}:{port} is already in use by another process '
                                 f'(another Mooncake Store?); pick a free port or 0')
        for attempt in range(1, PORT_ATTEMPTS + 1):
            picked = iter(free_ports(self.host, 3))
            ports = tuple(p or next(picked) for p in self._fixed_ports)
            try:
                return self._start_on(master_bin, ports)
            except RuntimeError:
                self.stop()
                # free when picked, held by another process now: taken in between, which is why
                # the start failed; pick again (any other failure is raised as it is)
                taken = [p for p, fixed in zip(ports, self._fixed_ports) if not fixed and port_in_use(self.host, p)]
                if not taken or attempt == PORT_ATTEMPTS:
                    raise
                logger.warning('Mooncake services: port(s) %s on %s were taken by another process before the '
                               'services bound them; starting again on new ports (attempt %d of %d)',
                               ', '.join(map(str, taken)), self.host, attempt + 1, PORT_ATTEMPTS)
        return self   # not reached: the last attempt returns or raises

    def _start_on(self, master_bin: str, ports: tuple[int, int, int]) -> 'MooncakeServices':
        """One start on ``(rpc, metadata, metrics)`` ports (see :meth:`start`)."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix='lmdeploy-mooncake-'))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.metadata_port, self.metrics_port = ports
        atexit.register(self.stop)
        self._start_master(master_bin)
        self._metadata = self._spawn(sys.executable, [
            '-m', 'lmdeploy.pytorch.store.metadata_server', f'--host={self.host}', f'--port={self.metadata_port}',
        ], self.metadata_log)
        self._wait_ready(self._metadata, 'metadata server', [(self.host, self.metadata_port)], self.metadata_log)
        self._ready_file.unlink(missing_ok=True)
        self._client = self._spawn(sys.executable, [
            '-m', 'lmdeploy.pytorch.store.segment_owner', f'--host={self.host}', f'--metadata={self.metadata_server}',
            f'--master={self.master_address}', f'--segment-size={self.segment_size}', f'--ready={self._ready_file}',
        ], self.client_log)
        # The owner writes the ready file only after its segment is mounted at the master.
        self._wait_ready(self._client, 'segment owner', [], self.client_log, self._ready_file)
        return self

    def _start_master(self, binary: str) -> None:
        self._master = self._spawn(binary, [
            f'--rpc_address={self.host}', f'--rpc_port={self.rpc_port}', '--enable_http_metadata_server=false',
            f'--metrics_host={self.host}', f'--metrics_port={self.metrics_port}', '--enable_metric_reporting=false',
            *self.master_args,
        ], self.master_log)
        self._wait_ready(self._master, 'mooncake_master', [(self.host, self.rpc_port)], self.master_log)

    def kill_master(self) -> None:
        """SIGKILL the master (fault tests); the client keeps running until :meth:`stop`."""
        if self._master is not None and self._master.poll() is None:
            self._master.send_signal(signal.SIGKILL)
            self._master.wait()

    def restart_master(self) -> None:
        """SIGKILL the master and start a fresh one on the same RPC, metadata and metrics ports
        (fault tests); returns once the segment owner has mounted its segment again.

        The new master starts empty: every object put before is gone (their bytes stay in the
        client's segment, but no master knows of them). Nothing needs re-registering by hand
        (checked with mooncake 0.3.13): a Mooncake client pings the master every second and,
        finding it restarted, re-publishes its transfer metadata and remounts its segment
        (~1-2 s). An engine's client sees the first call after the restart fail (its connection
        to the old master broke), then reconnects once its failure breaker lets it retry.

        Raises:
            RuntimeError: the services are not running, the master does not accept connections,
                or the segment is not mounted again within ``start_timeout_s``.
        """
        if self._master is None:
            raise RuntimeError('restart_master: the Mooncake services are not running')
        self.kill_master()
        self._start_master(find_binary('mooncake_master'))
        deadline = time.monotonic() + self.start_timeout_s
        while self.mounted_bytes() < self.segment_size:
            if time.monotonic() > deadline:
                tail = log_tail(self.client_log)
                raise RuntimeError(f'the segment owner did not remount its segment at the restarted master '
                                   f'{self.master_address} within {self.start_timeout_s} s; last lines of '
                                   f'{self.client_log}:\n{tail}')
            time.sleep(0.1)

    def mounted_bytes(self) -> int:
        """Bytes of segments mounted at the master (its ``master_total_capacity_bytes`` metric);
        0 when the metrics endpoint does not answer."""
        try:
            with urllib.request.urlopen(f'http://{self.host}:{self.metrics_port}/metrics', timeout=2) as resp:
                text = resp.read().decode(errors='replace')
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith('master_total_capacity_bytes '):
                return int(float(line.split()[1]))
        return 0

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the three processes at once, so a server's shutdown waits for the slowest, not
        their sum: the master and the metadata server get SIGTERM (SIGKILL if still running
        ``timeout_s`` seconds later), the segment owner SIGKILL at once — its segment dies with
        this master anyway, and Mooncake's clean teardown (unmount, unregister) takes it 2-3 s.
        Idempotent. Removes a temp log dir unless ``keep_logs``."""
        procs = [p for p in (self._master, self._metadata) if p is not None and p.poll() is None]
        if self._client is not None and self._client.poll() is None:
            self._client.kill()
            procs.append(self._client)
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._client = self._master = self._metadata = None
        for f in self._logs:
            f.close()
        self._logs.clear()
        atexit.unregister(self.stop)
        if self._own_log_dir and not self._keep_logs and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None

    def __enter__(self) -> 'MooncakeServices':
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
