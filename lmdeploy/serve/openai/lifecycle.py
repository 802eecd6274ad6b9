"""Server lifecycle guards: the request-size limit and graceful shutdown.

:class:`BodySizeLimit` (pure ASGI middleware) refuses a request whose body is larger than
``--max-request-bytes`` with 413 before any of it is parsed: at once when ``Content-Length``
says so, otherwise as soon as the received chunks pass the limit.

Shutdown timeline (SIGTERM or SIGINT)::

    signal ──> stop accepting (uvicorn closes the listener; new requests on open
               │                connections get 503 "shutting_down")
               ├─ in-flight requests keep generating ... up to --shutdown-timeout s
               └─ deadline: every generation still running is ended by the server:
                  streams get an error event and [DONE], non-streaming requests a 503
                  JSON body; their engine requests are aborted; uvicorn then closes the
                  connections and the pipeline is closed.

:class:`Drain` owns the set of running generations and the deadline; :class:`GracefulServer`
is the uvicorn server that starts the drain when a shutdown signal arrives.
"""
from __future__ import annotations

import asyncio
import json
import logging

import uvicorn

from .errors import error_body_for

__all__ = ['BodySizeLimit', 'Drain', 'GracefulServer', 'KeyCheck', 'ShuttingDown']

logger = logging.getLogger('lmdeploy')


class ShuttingDown(Exception):
    """Raised inside a generation that the shutdown deadline ended."""


async def _send_json(send, status: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    await send({'type': 'http.response.start', 'status': status,
                'headers': [(b'content-type', b'application/json'), (b'content-length', str(len(raw)).encode()),
                            (b'connection', b'close')]})
    await send({'type': 'http.response.body', 'body': raw})


class KeyCheck:
    """ASGI middleware: a request to a protected path without a valid key (``Authorization:
    Bearer <key>``, or Anthropic's ``x-api-key: <key>``) gets 401 before
    anything else looks at it — routing (so a keyless client cannot tell an existing route from
    a missing one, 401 rather than 404/405), the body size limit (401 rather than 413) and
    validation.

    Args:
        app: the wrapped ASGI app.
        check: ``(authorization header value) -> bool``, True for a valid key.
        prefixes: paths needing a key: exact paths, or prefixes ending in ``/``.
    """

    def __init__(self, app, check, prefixes: tuple[str, ...]):
        self.app = app
        self.check = check
        self.prefixes = prefixes

    def _protected(self, path: str) -> bool:
        return any(path.startswith(p) if p.endswith('/') else path == p for p in self.prefixes)

    async def __call__(self, scope, receive, send):
        if scope['type'] == 'http' and self._protected(scope.get('path', '')):
            headers = dict(scope.get('headers') or [])
            header = headers.get(b'authorization', b'').decode('latin-1')
            anthropic = headers.get(b'x-api-key')      # Anthropic clients send the key this way
            if not self.check(header) and not (anthropic and self.check('Bearer ' + anthropic.decode('latin-1'))):
                return await _send_json(send, 401, error_body_for(
                    scope.get('path', ''), 401, 'missing or invalid API key: send "Authorization: Bearer <key>" '
                    '(or "x-api-key: <key>")', 'invalid_request_error', code='invalid_api_key'))
        return await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: 413 with an OpenAI error body for bodies over ``max_bytes``.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest accepted body in bytes; 0 or less = no limit.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int | None, path: str = '') -> dict:
        got = f'the request body ({size} bytes)' if size is not None else 'the request body'
        return error_body_for(path, 413, f'{got} exceeds the limit of {self.max_bytes} bytes (--max-request-bytes)',
                              'invalid_request_error', code='request_too_large')

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http' or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        length = dict(scope.get('headers') or []).get(b'content-length')
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_json(send, 413, self._too_large(int(length), scope.get('path', '')))
        # read the body here (the app reads it whole anyway) so an over-long chunked body is
        # refused before the app sees it
        chunks, size = [], 0
        while True:
            message = await receive()
            if message['type'] != 'http.request':
                return await self.app(scope, _replay([message]), send)
            chunks.append(message)
            size += len(message.get('body', b''))
            if size > self.max_bytes:
                return await _send_json(send, 413, self._too_large(None, scope.get('path', '')))
            if not message.get('more_body', False):
                break
        await self.app(scope, _replay(chunks, receive), send)


def _replay(messages: list[dict], then=None):
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()
        return {'type': 'http.disconnect'}
    return receive


class Drain:
    """Tracks running generations; :meth:`start` begins the graceful shutdown.

    Args:
        timeout: seconds in-flight requests may keep running after the signal.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.draining = False
        self.running: set = set()       # objects with an ``end()`` method (_Generation)
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, gen) -> None:
        """Track the running generation ``gen`` (the drain is no longer idle)."""
        self.running.add(gen)
        self._idle.clear()

    def discard(self, gen) -> None:
        """Stop tracking ``gen`` (a no-op if untracked); idle again when none is left."""
        self.running.discard(gen)
        if not self.running:
            self._idle.set()

    def start(self) -> None:
        """Begin draining (idempotent; call on the event loop)."""
        if self.draining:
            return
        self.draining = True
        logger.info('shutting down: %d request(s) in flight get up to %.1f s', len(self.running), self.timeout)
        asyncio.get_running_loop().create_task(self._deadline())

    async def _deadline(self) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout)
        except asyncio.TimeoutError:
            logger.warning('shutdown timeout: ending %d request(s) still running', len(self.running))
            for gen in list(self.running):
                gen.end()


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown signal first starts ``drain`` (uvicorn itself then stops
    accepting and waits for the open connections, see the module docstring).

    Args:
        config: the uvicorn config; its ``timeout_graceful_shutdown`` should exceed
            ``drain.timeout`` so that the drain, not uvicorn, ends late requests.
        drain: the app's drain coordinator.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        """Remember the running event loop (for :meth:`handle_exit`), then start uvicorn."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        """On a shutdown signal, start the drain on the event loop, then let uvicorn shut down."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.drain.start)
        super().handle_exit(sig, frame)
