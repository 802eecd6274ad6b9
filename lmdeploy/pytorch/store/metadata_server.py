"""Mooncake's HTTP metadata server, bound to one address, as its own process.

Usage (started by :class:`~.services.MooncakeServices`, or by hand for shared services)::

    python3 -m lmdeploy.pytorch.store.metadata_server --host HOST --port 8080

Why not the master's embedded one: Mooncake 0.3.13's ``mooncake_master`` ignores
``--http_metadata_server_host`` and listens on every interface. Why a process of its own: the
native Mooncake setup holds the GIL while it registers with this server, so the server cannot
be a thread of a process that runs a Mooncake client.

The protocol is Mooncake's: ``GET|PUT|DELETE /metadata?key=K`` with the value as the body; 404
for a missing key, 400 without a key. It is unauthenticated (anyone who reaches it can rewrite
where segments live), so bind it to an address only trusted processes reach.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

__all__ = ['MetadataServer', 'main', 'set_process_name']


def set_process_name(name: str) -> None:
    """Set this process's name as ``ps``/``/proc/PID/comm`` show it (Linux ``prctl(PR_SET_NAME)``,
    at most 15 bytes; a no-op elsewhere), so the Store's helpers read as ``mooncake_*``."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _MetadataHandler(BaseHTTPRequestHandler):
    """Mooncake's HTTP metadata verbs over the server's dict."""
    protocol_version = 'HTTP/1.1'

    def log_message(self, fmt, *args):      # keep the owner's log for errors only
        pass

    def _key(self) -> str | None:
        url = urlsplit(self.path)
        key = parse_qs(url.query).get('key', [''])[0].strip()
        if url.path != '/metadata' or not key:
            self._reply(404 if url.path != '/metadata' else 400, b'use /metadata?key=KEY')
            return None
        return key

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            value = self.server.values.get(key)
        self._reply(200, value) if value is not None else self._reply(404, b'metadata not found')

    def do_PUT(self):
        key = self._key()
        length = int(self.headers.get('Content-Length') or 0)
        body = self.rfile.read(length)
        if key is None:
            return
        with self.server.lock:
            self.server.values[key] = body
        self._reply(200, b'metadata updated')

    def do_DELETE(self):
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            found = self.server.values.pop(key, None) is not None
        self._reply(200, b'metadata deleted') if found else self._reply(404, b'metadata not found')


class MetadataServer(ThreadingHTTPServer):
    """Mooncake HTTP metadata server on ``(host, port)``, serving from a daemon thread after
    :meth:`start`. Unauthenticated: bind it to an address only trusted processes reach."""
    daemon_threads = True

    def __init__(self, host: str, port: int):
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()
        super().__init__((host, port), _MetadataHandler)

    def start(self) -> 'MetadataServer':
        """Serve from a daemon thread (for a process that runs no Mooncake client)."""
        threading.Thread(target=self.serve_forever, name='mooncake-metadata', daemon=True).start()
        return self


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    parser = argparse.ArgumentParser(prog='python3 -m lmdeploy.pytorch.store.metadata_server',
                                     description='Mooncake HTTP metadata server on one address.')
    parser.add_argument('--host', required=True, help='address to listen on')
    parser.add_argument('--port', type=int, required=True, help='port to listen on')
    args = parser.parse_args(argv)
    set_process_name('mooncake_meta')
    server = MetadataServer(args.host, args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    return 0


if __name__ == '__main__':
    sys.exit(main())
