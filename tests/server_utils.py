"""Launch ``lmdeploy serve api_server`` as a subprocess on 127.0.0.1 for tests.

    with ApiServer(model_path, '--enable-prefix-caching') as server:
        client = openai.OpenAI(base_url=server.base_url + '/v1', api_key=server.api_key or 'none')

The server binds 127.0.0.1 at a free port, its output goes to a log file (no pipe to fill up),
and :meth:`ApiServer.start` returns once ``GET /health`` answers 200. Several servers can be
started first and waited for together (:meth:`launch` then :meth:`wait_ready`) so their model
loads overlap, as :func:`running` does for a dict of them.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ['ApiServer', 'free_port', 'http_json']


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 60,
              method: str | None = None) -> tuple[int, dict | str]:
    """Send a request (JSON ``body`` → POST); returns ``(status, parsed JSON or text)``, also for 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={'Content-Type': 'application/json',
                                                                        **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors='replace')


class ApiServer:
    """One ``python -m lmdeploy.cli.entrypoint serve api_server`` process.

    Args:
        model_path: model directory.
        *flags: extra command-line flags (``--server-name``/``--server-port`` are added).
        api_key: if set, passed as ``--api-keys`` and used by :meth:`get` / :meth:`post`.
        startup_timeout: seconds to wait for ``/health``.
        launcher: the command before ``serve api_server`` (default: ``python -m lmdeploy.cli.entrypoint``;
            tests/scripted_server.py for a scripted sampler).
        env: extra environment variables of the process.
    """

    def __init__(self, model_path: str, *flags: str, api_key: str | None = None, startup_timeout: float = 180,
                 launcher: list[str] | None = None, env: dict[str, str] | None = None):
        self.model_path = model_path
        self.launcher = launcher or [sys.executable, '-m', 'lmdeploy.cli.entrypoint']
        self.extra_env = dict(env or {})
        self.flags = list(flags)
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f'http://127.0.0.1:{self.port}'

    @property
    def auth(self) -> dict:
        return {'Authorization': f'Bearer {self.api_key}'} if self.api_key else {}

    def launch(self) -> ApiServer:
        """Start the process (does not wait)."""
        self.port = free_port()
        cmd = [*self.launcher, 'serve', 'api_server', self.model_path,
               '--server-name', '127.0.0.1', '--server-port', str(self.port), '--log-level', 'WARNING',
               *self.flags]
        if self.api_key:
            cmd += ['--api-keys', self.api_key]
        self._log = tempfile.NamedTemporaryFile('w+', prefix='api_server_', suffix='.log', delete=False)
        env = dict(os.environ, **self.extra_env,
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get('PYTHONPATH')])))
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        return self

    def log(self) -> str:
        """Everything the server printed so far."""
        with open(self._log.name, errors='replace') as f:
            return f.read()

    def wait_ready(self) -> ApiServer:
        """Block until ``/health`` answers 200.

        Raises:
            RuntimeError: the process exited or did not answer in time (message has its log tail).
        """
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f'api_server exited with {self.proc.returncode}:\n{self.log()[-4000:]}')
            try:
                with urllib.request.urlopen(self.base_url + '/health', timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f'api_server did not become healthy in {self.startup_timeout} s:\n{self.log()[-4000:]}')

    def start(self) -> ApiServer:
        """Launch and wait until healthy."""
        return self.launch().wait_ready()

    def stop(self) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after 10 s) and remove its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None

    def get(self, path: str, timeout: float = 60) -> tuple[int, dict | str]:
        """``GET path`` with the API key; returns ``(status, JSON or text)``."""
        return http_json(self.base_url + path, headers=self.auth, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, dict | str]:
        """``POST path`` with a JSON body and the API key; returns ``(status, JSON or text)``."""
        return http_json(self.base_url + path, body, headers=self.auth, timeout=timeout)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def running(servers: dict[str, ApiServer]):
    """Launch every server of ``servers`` (their model loads overlap), wait until each is
    healthy and yield ``servers``; every one is stopped on exit, whatever happened (a server
    that failed to start included).

    Raises:
        RuntimeError: a server did not become healthy (:meth:`ApiServer.wait_ready`).
    """
    try:
        for p in servers.values():
            p.launch()
        for p in servers.values():
            p.wait_ready()
        yield servers
    finally:
        for p in servers.values():
            p.stop()
