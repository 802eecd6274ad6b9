"""A fleet: N ``api_server`` replicas sharing one Store, behind one HTTP router.

This module owns the fleet's child processes: the replicas (``lmdeploy serve api_server`` on
consecutive ports), the router in front of them, and, when the fleet made it, the shared Store
(a ``file:`` folder or the Mooncake services of :class:`~lmdeploy.pytorch.store.services.
MooncakeServices`). Invariants:

- Every replica runs the same engine flags and the same Store flags, so a prefix saved by one
  replica is restored by any other (same namespace, same secret).
- The router starts only after every replica answers ``/health``; :meth:`Fleet.start` returns
  only once the router answers ``/v1/models``, and otherwise stops whatever it started and
  raises ``RuntimeError`` quoting the failed process's log tail.
- :meth:`Fleet.stop` ends the router first (no new requests reach a stopping replica), then
  sends SIGTERM to every replica at once (each shuts down gracefully and flushes its Store
  saves), then SIGKILLs what is left after the grace period. It is idempotent. A
  :class:`SharedStore` is closed by its owner after that (the CLI, lmdeploy/cli/fleet.py).
  Children also get SIGTERM when the fleet process dies (setpriv ``--pdeathsig``, where
  available).
- A replica that dies while the fleet runs is reported once (:meth:`Fleet.poll`); the router
  sends later requests to the others and resends a non-streaming request that was in flight on
  it (a stream that had started ends with the router's error event), and the others restore
  its conversations' prefixes from the Store.

::

    client --> router (host:port, policy) --+--> replica 0 (127.0.0.1:port+1) --+
                                            +--> replica 1 (127.0.0.1:port+2) --+--> Store
                                            +--> ...                           --+   (file:DIR or Mooncake)

Routers (:data:`ROUTERS`) are external programs from PyPI, found next to this Python or on
PATH. ``smg`` (Shepherd Model Gateway) is the default and the one ``pip install
'lmdeploy[fleet]'`` installs: measured on this server (benchmark/README.md, "Fleet") it resent
a request in flight on a killed replica to another replica, where ``vllm-router`` answered 500
(also for later requests, until its circuit breaker opened), and its ``cache_aware`` kept agent
conversations on their replicas (96 % of one 3x-memory engine's local hits with 3 replicas),
where ``vllm-router``'s spread them like round-robin (59 %).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..pytorch.store.services import log_tail, pdeathsig_prefix

__all__ = ['ROUTERS', 'RouterKind', 'Fleet', 'Replica', 'SharedStore', 'find_router']


@dataclass(frozen=True)
class RouterKind:
    """How to run one router program.

    Attributes:
        program: executable name (console script of the PyPI package ``package``).
        package: the PyPI distribution that installs it.
        subcommand: arguments before the flags (``smg launch``).
        policies: ``--router-policy`` values it takes; the first is the fleet's default.
        extra: flags always passed (quiet logs, fast health checks).
        policy_extra: flags passed with a policy (before ``router_args``, which override them).
    """
    program: str
    package: str
    subcommand: tuple[str, ...]
    policies: tuple[str, ...]
    extra: tuple[str, ...] = ()
    policy_extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def command(self, exe: str, host: str, port: int, workers: list[str], policy: str, metrics_port: int,
                extra_args: list[str], api_key: str | None = None) -> list[str]:
        """The router's command line serving ``host:port`` in front of ``workers`` (URLs); with
        ``api_key``, the router sends it to the workers (its own discovery calls need it)."""
        return [exe, *self.subcommand, '--host', host, '--port', str(port), '--worker-urls', *workers,
                '--policy', policy, '--prometheus-host', '127.0.0.1', '--prometheus-port', str(metrics_port),
                *self.extra, *dict(self.policy_extra).get(policy, ()), *(['--api-key', api_key] if api_key else []),
                *extra_args]


# Health checks every 2 s (default 60 s in vllm-router): a killed replica is taken out of
# rotation within seconds even when no request happens to hit it.
#
# smg's cache_aware: a request goes to the replica whose earlier requests share the largest
# fraction of its text, if that fraction is at least --cache-threshold, else to the least-used
# replica. Agent sessions all share a long head (system prompt + tools), so with the default
# threshold 0.3 every new session matched the head's replica and one replica took all requests
# (claude_code trace, 6 sessions, 3 replicas: 118/0/0 requests, local hits 79 % of one
# 3x-memory engine). At 0.9 only the session's own history matches well enough, so new
# sessions spread and each stays where its history is (29/20/69 requests, 95 %);
# benchmark/README.md, "Fleet". --sticky-sessions additionally pins requests that carry a
# session key header (x-smg-routing-key) to one replica, placing new keys on the least-loaded
# replica (--assignment-mode min_load); requests without the header are routed as above.
_SMG_CACHE_AWARE = ('--cache-threshold', '0.9', '--sticky-sessions', '--assignment-mode', 'min_load')

ROUTERS: dict[str, RouterKind] = {
    'smg': RouterKind('smg', 'smg', ('launch',),
                      ('cache_aware', 'round_robin', 'consistent_hashing', 'prefix_hash', 'power_of_two',
                       'least_load', 'random'),
                      ('--log-level', 'warn', '--health-check-interval-secs', '2'),
                      (('cache_aware', _SMG_CACHE_AWARE),)),
    'vllm-router': RouterKind('vllm-router', 'vllm-router', (),
                              ('cache_aware', 'round_robin', 'consistent_hash', 'power_of_two',
                               'sticky_least_loaded', 'random'),
                              ('--log-level', 'warning', '--health-check-interval-secs', '2')),
}


def find_router(name: str) -> str:
    """Path of router ``name``'s executable: next to this Python (a virtual environment's
    ``bin/``, even when it is not activated), else on PATH.

    Raises:
        ValueError: an unknown router, or one that is not installed (names the package).
    """
    if name not in ROUTERS:
        raise ValueError(f'router must be one of {", ".join(ROUTERS)}, got {name!r}')
    kind = ROUTERS[name]
    local = Path(sys.executable).parent / kind.program
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(kind.program)
    if found is None:
        raise ValueError(f'router: {kind.program!r} is not installed; pip install "lmdeploy[fleet]" '
                         f'(or pip install {kind.package})')
    return found


def _http_ok(url: str, timeout: float = 2.0, headers: dict | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


@dataclass
class Replica:
    """One ``api_server`` child: its index, port, process and log file."""
    index: int
    port: int
    host: str
    log: Path
    proc: subprocess.Popen | None = None
    reported: bool = False       # its unexpected exit was printed

    @property
    def url(self) -> str:
        return f'http://{self.host}:{self.port}'


class SharedStore:
    """The Store the replicas share, made by the fleet when its flags name none.

    ``kind`` is ``'file'`` (a ``file:`` folder in ``root``, removed by :meth:`close`) or
    ``'mooncake'`` (:class:`MooncakeServices` on 127.0.0.1, stopped by :meth:`close`). Either
    way a fresh 32-byte secret file is written (mode 0600) and passed to every replica, so the
    replicas accept only objects written by each other.

    Args:
        kind: ``'file'`` or ``'mooncake'``.
        root: folder for the secret (and the ``file:`` objects); removed by :meth:`close`.
        segment_size: bytes of the Mooncake segment (``'mooncake'`` only).

    Raises:
        ValueError: an unknown ``kind``.
        RuntimeError: the Mooncake services did not start (from :meth:`open`).
    """

    def __init__(self, kind: str, root: Path, segment_size: int = 512 << 20):
        if kind not in ('file', 'mooncake'):
            raise ValueError(f'store kind must be "file" or "mooncake", got {kind!r}')
        self.kind, self.root, self.segment_size = kind, Path(root), segment_size
        self.services = None

    def open(self) -> dict[str, str]:
        """Create the Store; returns the engine fields (``store_backend`` or the two
        ``mooncake_*`` addresses, and ``store_secret_file``) every replica gets."""
        self.root.mkdir(parents=True, exist_ok=True)
        secret = self.root / 'store.secret'
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, 'w') as f:
            f.write(os.urandom(32).hex())
        fields = {'store_secret_file': str(secret)}
        if self.kind == 'file':
            (self.root / 'objects').mkdir(exist_ok=True)
            fields['store_backend'] = f'file:{self.root / "objects"}'
            return fields
        from ..pytorch.store.services import MooncakeServices
        self.services = MooncakeServices(self.segment_size, host='127.0.0.1', log_dir=str(self.root / 'mooncake'),
                                         keep_logs=True).start()
        fields.update(mooncake_master=self.services.master_address,
                      mooncake_metadata_server=self.services.metadata_server)
        return fields

    def describe(self) -> str:
        if self.kind == 'file':
            return f'file Store in {self.root / "objects"} (removed at exit)'
        return f'Mooncake Store at {self.services.master_address} (stopped at exit)'

    def close(self) -> None:
        """Stop the services and remove the folder. Idempotent."""
        if self.services is not None:
            self.services.stop()
            self.services = None
        shutil.rmtree(self.root, ignore_errors=True)


class Fleet:
    """N ``lmdeploy serve api_server`` replicas on one machine behind one router.

    Args:
        model_path: the model directory every replica serves.
        replica_flags: ``api_server`` flags every replica gets (engine and Store flags; without
            ``--server-name`` / ``--server-port``, which the fleet sets).
        replicas: how many replicas (>= 1).
        host, port: where the router listens (the fleet's public address).
        replica_ports: the replicas' ports (default ``port + 1 ... port + replicas``); they
            listen on ``replica_host`` (default 127.0.0.1: only the router reaches them).
        router: a key of :data:`ROUTERS`.
        policy: the router's policy (one of its ``RouterKind.policies``; default its first).
        router_args: extra router flags, passed as given.
        log_dir: folder of the logs (``replica-I.log``, ``router.log``); default a new
            temporary folder, kept (the CLI removes it after a clean stop).
        startup_timeout: seconds to wait for every replica and the router to be ready.
        env: extra environment variables of the children.
        launcher: the command before ``serve api_server`` (default this Python running
            ``lmdeploy.cli.entrypoint``).
        api_key: one of the replicas' ``--api-keys``: the router's own calls to the replicas
            (model discovery) and the readiness probe send it.

    Raises:
        ValueError: ``replicas`` < 1, an unknown router or policy, a router that is not
            installed, or a port already in use (each message names the field).
    """

    def __init__(self, model_path: str, replica_flags: list[str], *, replicas: int, host: str = '127.0.0.1',
                 port: int = 23333, replica_ports: list[int] | None = None, replica_host: str = '127.0.0.1',
                 router: str = 'smg', policy: str | None = None, router_args: list[str] | None = None,
                 log_dir: str | None = None, startup_timeout: float = 600, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, api_key: str | None = None):
        if replicas < 1:
            raise ValueError(f'replicas must be >= 1, got {replicas}')
        self.router_exe = find_router(router)
        self.router_kind = ROUTERS[router]
        policy = policy or self.router_kind.policies[0]
        if policy not in self.router_kind.policies:
            raise ValueError(f'router_policy: {router} takes {", ".join(self.router_kind.policies)}, got {policy!r}')
        ports = list(replica_ports) if replica_ports else [port + 1 + i for i in range(replicas)]
        if len(ports) != replicas or len(set(ports + [port])) != replicas + 1:
            raise ValueError(f'replica ports must be {replicas} distinct ports other than the router\'s {port}, '
                             f'got {ports}')
        from ..pytorch.store.services import free_ports, port_in_use
        for name, h, p in [('server_port', host, port), *[('replica port', replica_host, q) for q in ports]]:
            if port_in_use(h, p):
                raise ValueError(f'{name}: {h}:{p} is already in use')
        self.model_path, self.flags = model_path, list(replica_flags)
        self.host, self.port, self.policy = host, port, policy
        self.router_args = list(router_args or [])
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix='lmdeploy-fleet-'))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self.launcher = launcher or [sys.executable, '-m', 'lmdeploy.cli.entrypoint']
        self.replicas = [Replica(i, p, replica_host, self.log_dir / f'replica-{i}.log') for i, p in enumerate(ports)]
        self.router_log = self.log_dir / 'router.log'
        self.api_key = api_key
        self.probe_headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
        self.router_proc: subprocess.Popen | None = None
        self.metrics_port = free_ports('127.0.0.1', 1)[0]
        self._stopped = False

    @property
    def url(self) -> str:
        """The router's base URL (what clients use)."""
        host = '127.0.0.1' if self.host in ('0.0.0.0', '') else self.host
        return f'http://{host}:{self.port}'

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def _spawn(self, cmd: list[str], log: Path) -> subprocess.Popen:
        env = dict(os.environ, **self.env)
        with open(log, 'ab') as out:
            return subprocess.Popen([*pdeathsig_prefix(), *cmd], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def start_replica(self, replica: Replica) -> None:
        """(Re)launch one replica (does not wait for it)."""
        cmd = [*self.launcher, 'serve', 'api_server', self.model_path, '--server-name', replica.host,
               '--server-port', str(replica.port), *self.flags]
        replica.proc, replica.reported = self._spawn(cmd, replica.log), False

    def _wait(self, ready: Callable[[], bool], proc: subprocess.Popen, what: str, log: Path, deadline: float) -> None:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f'{what} exited with code {proc.returncode} during startup; its log '
                                   f'({log}) ends:\n{log_tail(log, 30)}')
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f'{what} was not ready in {self.startup_timeout:g} s; its log ({log}) ends:\n'
                           f'{log_tail(log, 30)}')

    def start(self) -> 'Fleet':
        """Launch every replica (their model loads overlap), wait for their ``/health``, then
        launch the router and wait until it answers ``/v1/models``.

        Raises:
            RuntimeError: a process exited or was not ready in ``startup_timeout`` seconds (the
                message quotes its log); everything started so far is stopped.
        """
        deadline = time.monotonic() + self.startup_timeout
        try:
            for r in self.replicas:
                self.start_replica(r)
            for r in self.replicas:
                self._wait(lambda r=r: _http_ok(r.url + '/health'), r.proc, f'replica {r.index} ({r.url})', r.log,
                           deadline)
            cmd = self.router_kind.command(self.router_exe, self.host, self.port, self.replica_urls, self.policy,
                                           self.metrics_port, self.router_args, self.api_key)
            self.router_proc = self._spawn(cmd, self.router_log)
            self._wait(lambda: _http_ok(self.url + '/v1/models', headers=self.probe_headers), self.router_proc,
                       f'router {self.router_kind.program}', self.router_log, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def poll(self) -> str | None:
        """Check the children once. Returns a message when the router has exited (the fleet
        cannot serve: the caller stops it); prints one line per replica that exited since the
        last call, and returns None while the router runs."""
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is not None and not r.reported:
                r.reported = True
                print(f'lmdeploy fleet: replica {r.index} ({r.url}) exited with code {r.proc.returncode}; the router '
                      f'sends its requests to the others (log: {r.log})', file=sys.stderr, flush=True)
        if self.router_proc is not None and self.router_proc.poll() is not None:
            return (f'the router exited with code {self.router_proc.returncode}; its log ({self.router_log}) '
                    f'ends:\n{log_tail(self.router_log, 30)}')
        return None

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the router, then every replica (SIGTERM together, SIGKILL after ``grace_s``
        seconds). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        _terminate([self.router_proc], 10.0)
        _terminate([r.proc for r in self.replicas], grace_s)

    def __enter__(self) -> 'Fleet':
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate(procs: list[subprocess.Popen | None], grace_s: float) -> None:
    """SIGTERM every running process of ``procs``, wait up to ``grace_s`` seconds in all, then
    SIGKILL the rest (and reap them)."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

