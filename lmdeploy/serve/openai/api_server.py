"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`~lmdeploy.serve.pipeline.Pipeline`.

Endpoints (handlers: ``handlers.py`` shared checks and planning, ``chat_route.py``,
``completions_route.py``, ``responses.py``, ``anthropic.py``; ``generation.py`` runs a request's
engine requests)::

    GET  /v1/models             the served model (its name defaults to the model directory's basename)
    POST /v1/chat/completions   messages (+ tools) → reply, reasoning, tool calls; SSE stream when "stream": true
    POST /v1/completions        prompt(s) as text or token ids → continuation(s)
    POST /v1/responses          the OpenAI Responses API (.responses); GET / DELETE /v1/responses/{id}
    POST /v1/messages           the Anthropic Messages API (.anthropic); POST /v1/messages/count_tokens
    GET  /health                200 while serving, 503 once shutting down
    GET  /metrics               Prometheus text (lmdeploy.metrics)
    GET  /docs, /openapi.json   Swagger UI and the OpenAPI schema
    GET  /debug/ledger          the engine's resource ledger (idle checks in tests)

Ownership and invariants:
- Each choice (``n`` per prompt) is one engine request, run as its own asyncio task that feeds a
  per-response queue. Whatever ends the response early — the client disconnecting (Starlette
  cancels the stream), a non-streaming client going away, an error, the shutdown deadline —
  cancels those tasks, and cancelling a task aborts its engine request (``Pipeline.generate``),
  which frees its blocks, slots and pins before the next engine step.
- Chat-template rendering, tokenization and request checks run in worker threads, so one huge
  prompt never stalls other clients or ``/health``; so does JSON decoding of bodies over 256 KB
  (``large_body``); field validation, on the event loop, never visits each token id.
- Requests are validated (ranges by pydantic, prompt counts before tokenizing, messages / token
  ids / length by the pipeline and the engine) before anything is submitted, so a bad request
  is a 4xx with nothing to clean up.
- With API keys set, ``/v1/*``, ``/debug/*``, ``/docs`` and ``/openapi.json`` require
  ``Authorization: Bearer <key>``; ``/health`` is always open; ``/metrics`` is open unless
  ``protect_metrics`` (so a plain Prometheus scrape works) — it holds counters, never text.
  Each key is a tenant: stored responses belong to the key that stored them (another key gets
  404), and each key's requests are cache-salted apart (``cached_tokens`` tells a key nothing
  of another's prompts) unless ``share_prefix_cache_across_keys``.
- Decoding is greedy unless ``temperature`` > 0 (an absent temperature means greedy here, unlike
  OpenAI's default of 1.0), which makes served output reproducible by default.
"""
from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from ...metrics import HTTPMetricsMiddleware
from ..images import ImageFetchLimits
from .anthropic import MessagesAPI
from .chat_route import ChatRoutes
from .completions_route import CompletionRoutes
from .defaults import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_TIMEOUT
from .errors import install_error_handlers
from .handlers import ServerBase
from .large_body import OffLoopJSONRoute
from .lifecycle import BodySizeLimit, GracefulServer, KeyCheck
from .protocol import ErrorBody
from .response_store import ResponseStore
from .responses import ResponsesAPI

__all__ = ['create_app', 'run_server', 'default_model_name', 'Server']

logger = logging.getLogger('lmdeploy')

_KNOWN_PATHS = frozenset({'/v1/models', '/v1/chat/completions', '/v1/completions', '/v1/responses', '/v1/messages',
                          '/v1/messages/count_tokens', '/health', '/metrics',
                          '/debug/ledger', '/docs', '/openapi.json'})
# one model's path (its id may hold slashes), one stored response's
_PATH_TEMPLATES = {'/v1/models/': '/v1/models/{model}', '/v1/responses/': '/v1/responses/{id}'}
# How long a thread running Python may keep the GIL while another waits (CPython's default: 5 ms).
# The event loop needs the GIL a dozen times or more to answer one request; with the worker
# threads decoding, validating or tokenizing a large body it waited a full interval each time:
# /health p99 110 ms, max 230 ms during two 4.9 MB token-id bodies at once; 26 ms / 30 ms at 1 ms
# (benchmark/health_during_large_bodies.py, 2 shared cores). The engine thread works mostly in
# torch with the GIL released, so the shorter slices cost it little.
SWITCH_INTERVAL_S = 0.001


def default_model_name(model_path: str) -> str:
    """The served model name when none is given: the model directory's basename."""
    return os.path.basename(os.path.normpath(model_path))


class Server(ServerBase, ChatRoutes, CompletionRoutes):
    """Every request handler of the app: the shared checks and planning
    (:class:`~.handlers.ServerBase`, whose arguments it takes), chat and completions."""


def _errors(*codes: int) -> dict:
    descriptions = {400: 'invalid request (a field out of range, malformed JSON, a prompt too long ...)',
                    401: 'missing or invalid API key', 404: 'unknown model', 413: 'request body over '
                    '--max-request-bytes', 500: 'server bug or engine failure', 503: 'the server is shutting down'}
    return {c: {'model': ErrorBody, 'description': descriptions[c]} for c in codes}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 responses: validation errors are answered with 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for ops in schema.get('paths', {}).values():
            for op in ops.values():
                op.get('responses', {}).pop('422', None)
        for name in ('HTTPValidationError', 'ValidationError'):
            schema.get('components', {}).get('schemas', {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _add_docs(app: FastAPI, auth: list) -> None:
    """``/openapi.json`` and ``/docs`` behind ``auth`` (FastAPI's own routes would be open)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import JSONResponse

    app.get('/openapi.json', dependencies=auth, include_in_schema=False)(lambda: JSONResponse(app.openapi()))
    app.get('/docs', dependencies=auth, include_in_schema=False)(
        lambda: get_swagger_ui_html(openapi_url='/openapi.json', title=f'{app.title} API'))


def create_app(pipe, model_name: str | list[str], api_keys: list[str] | None = None, *,
               tool_call_parser: str = 'auto', reasoning_parser: str = 'auto',
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, protect_metrics: bool = False,
               image_fetch: ImageFetchLimits | None = None, response_store=None,
               share_prefix_cache_across_keys: bool = False) -> FastAPI:
    """Build the FastAPI app serving ``pipe`` (a :class:`~lmdeploy.serve.pipeline.Pipeline`).

    Args:
        pipe: the pipeline; the app does not close it.
        model_name: the name clients must send as ``model``, or a list of names any of which
            they may send (``/v1/models`` lists them all; replies name the first); others get a
            404 listing the served names.
        api_keys: accepted bearer tokens; None or an empty list disables authentication (an
            empty key is refused). With keys, ``/v1/*``, ``/debug/*``, ``/docs`` and
            ``/openapi.json`` need one; ``/metrics`` too with ``protect_metrics``; ``/health``
            never does.
        tool_call_parser: see :class:`Server`.
        reasoning_parser: see :class:`Server`.
        max_request_bytes: larger bodies get 413; 0 = no limit.
        shutdown_timeout: seconds in-flight requests may run after a shutdown signal.
        protect_metrics: ``/metrics`` needs a key as well (when keys are set).
        image_fetch: limits and host policy for ``http(s)`` ``image_url`` parts (default
            :class:`~lmdeploy.serve.images.ImageFetchLimits`: 20 MiB, 10 s, public hosts only).
        response_store: bounds of the ``/v1/responses`` store
            (:class:`~lmdeploy.serve.openai.response_store.ResponseStoreLimits`; default 1024
            entries, 256 MiB, one hour). Entries belong to the API key that stored them.
        share_prefix_cache_across_keys: with API keys, requests of different keys may share
            cached prefixes (default: each key's are cache-salted apart, see
            :meth:`~.handlers.ServerBase.cache_salt`).

    Raises:
        ValueError: an unknown parser name, or an empty API key.
    """
    if api_keys and any(not k or not k.strip() for k in api_keys):
        raise ValueError('api_keys (--api-keys): a key must not be empty; pass no keys to serve without '
                         'authentication')
    server = Server(pipe, model_name, api_keys, tool_call_parser, reasoning_parser, shutdown_timeout,
                     share_prefix_cache_across_keys)
    if image_fetch is not None:
        server.image_fetch = image_fetch
    # redirect_slashes off: '/v1/chat/completions/' is a 404 with an error body, not a bare 307
    app = FastAPI(title='lmdeploy', version='0.1.0', docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.router.route_class = OffLoopJSONRoute      # multi-megabyte bodies are decoded off the event loop
    install_error_handlers(app)
    auth = [Depends(server.check_key)]
    generation = _errors(400, 401, 404, 413, 500, 503)
    app.get('/v1/models', dependencies=auth, responses=_errors(401, 503))(server.models)
    app.get('/v1/models/{model_id:path}', dependencies=auth, responses=_errors(401, 404, 503))(server.model)
    app.post('/v1/chat/completions', dependencies=auth, responses=generation)(server.chat)
    app.post('/v1/completions', dependencies=auth, responses=generation)(server.completions)
    responses = ResponsesAPI(server, ResponseStore(response_store))
    app.post('/v1/responses', dependencies=auth, responses=generation)(responses.create)
    app.get('/v1/responses/{response_id}', dependencies=auth, responses=_errors(401, 404, 503))(responses.get)
    app.delete('/v1/responses/{response_id}', dependencies=auth, responses=_errors(401, 404, 503))(responses.delete)
    messages = MessagesAPI(server)
    app.post('/v1/messages', dependencies=auth, responses=generation)(messages.create)
    app.post('/v1/messages/count_tokens', dependencies=auth, responses=_errors(400, 401, 404, 413, 503))(
        messages.count_tokens)
    app.get('/debug/ledger', dependencies=auth, responses=_errors(401, 503))(server.ledger)
    app.get('/health', responses=_errors(503))(server.health)
    # the root answers (no data, no key): Claude Code probes its base URL with HEAD / before the first request
    app.api_route('/', methods=['GET', 'HEAD'], include_in_schema=False)(lambda: {'status': 'ok'})
    app.get('/metrics', dependencies=auth if protect_metrics else [])(server.prometheus)
    _add_docs(app, auth)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if server.api_keys:     # outside the size limit and routing: keyless requests learn nothing
        protected = ('/v1/', '/debug/', '/docs', '/openapi.json') + (('/metrics',) if protect_metrics else ())
        app.add_middleware(KeyCheck, check=server.key_valid, prefixes=protected)
    # added last = outermost: 413s are counted too
    app.add_middleware(HTTPMetricsMiddleware, metrics=server.metrics, known_paths=_KNOWN_PATHS,
                       path_templates=_PATH_TEMPLATES)
    app.openapi = lambda: _openapi(app)
    app.state.server = server
    return app


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before the model loads, when ``host:port`` cannot be bound.

    Raises:
        ValueError: naming the argument and its flag (``server_port`` / ``--server-port``,
            ``server_name`` / ``--server-name``) and the OS error.
    """
    with socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
        try:
            sock.bind((host, port))
        except OverflowError:
            raise ValueError(f'server_port (--server-port) must be a port number 0-65535, got {port}') from None
        except socket.gaierror as err:
            raise ValueError(f'cannot serve on {host}:{port}: server_name (--server-name) {host!r} is not an '
                             f'address or a name this machine resolves ({err.strerror})') from None
        except OSError as err:
            hint = {errno.EADDRINUSE: '; is another server running there?',
                    errno.EADDRNOTAVAIL: f'; {host} is not an address of this machine'}.get(err.errno, '')
            raise ValueError(f'cannot serve on {host}:{port} (server_name/server_port, '
                             f'--server-name/--server-port): {err.strerror}{hint}') from None


def _exit_on_sigterm(signum, frame) -> None:
    # uvicorn catches SIGTERM, shuts down, then raises the signal again under the handler it
    # found at startup; under the default disposition that kills the process before run_server's
    # `finally` (and atexit) run, leaving the embedded Mooncake processes orphaned and queued
    # Store saves unflushed. An exception unwinds through `finally` instead.
    raise SystemExit(128 + signum)


def run_server(model_path: str, backend_config=None, server_name: str = '0.0.0.0', server_port: int = 23333,
               api_keys: list[str] | None = None, log_level: str = 'info',
               model_name: str | list[str] | None = None, *,
               tool_call_parser: str = 'auto', reasoning_parser: str = 'auto',
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, protect_metrics: bool = False,
               image_fetch: ImageFetchLimits | None = None, response_store=None,
               share_prefix_cache_across_keys: bool = False) -> None:
    """Load the model and serve it until SIGINT/SIGTERM (blocking).

    Either signal shuts down gracefully (see :mod:`.lifecycle`): the server stops accepting,
    in-flight requests get ``shutdown_timeout`` seconds to finish, the rest are ended with an
    error event / a 503, then the pipeline is closed (Store saves flushed, embedded Mooncake
    services stopped); SIGTERM then exits with ``SystemExit(143)``, SIGINT with
    ``KeyboardInterrupt``. Sets the process's GIL switch interval to :data:`SWITCH_INTERVAL_S`
    and moves the objects built at startup out of the cyclic garbage collector's reach
    (``gc.freeze``).
    Other arguments as :func:`create_app`.

    Raises:
        ValueError: ``server_port`` is already taken on ``server_name`` (checked before the slow
            model load), or a bad model path, engine configuration (from
            :class:`~lmdeploy.serve.pipeline.Pipeline`) or parser name.
    """
    logging.basicConfig(level=log_level.upper(), format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    logger.setLevel(log_level.upper())
    check_port_free(server_name, server_port)
    sys.setswitchinterval(SWITCH_INTERVAL_S)     # the server's whole process: see SWITCH_INTERVAL_S
    started = time.perf_counter()
    logger.info('loading %s', model_path)
    import uvicorn

    from ..pipeline import Pipeline                               # imports torch: seconds
    if threading.current_thread() is threading.main_thread():     # signal handlers: main thread only
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pipe = Pipeline(model_path, backend_config)

    def engine_died(err):   # e.g. a tensor-parallel worker died: requests failed, end the server
        logger.critical('engine stopped: %s; shutting the server down', err)
        os.kill(os.getpid(), signal.SIGTERM)
    pipe.on_engine_failure(engine_died)
    logger.info('engine ready in %.1f s: %s', time.perf_counter() - started, pipe.summary())
    try:
        app = create_app(pipe, model_name or default_model_name(model_path), api_keys,
                         tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                         max_request_bytes=max_request_bytes, shutdown_timeout=shutdown_timeout,
                         protect_metrics=protect_metrics, image_fetch=image_fetch, response_store=response_store,
                         share_prefix_cache_across_keys=share_prefix_cache_across_keys)
        server = app.state.server
        logger.info('serving %s as %s on http://%s:%d (tool calls: %s, reasoning: %s)', model_path,
                    ', '.join(repr(n) for n in server.model_names), server_name, server_port,
                    server.tool_parser_name, server.reasoning_parser_name)
        # uvicorn's own deadline comes after ours, so the drain (not a task cancellation) ends late requests
        config = uvicorn.Config(app, host=server_name, port=server_port, log_level=log_level.lower(),
                                timeout_graceful_shutdown=shutdown_timeout + 5)
        # what startup built (torch, transformers, the model) lives as long as the process: frozen
        # out of the cyclic collector, a full collection no longer walks its ~250k objects
        # (seconds on a loaded 2-core machine, holding the GIL: every request waited)
        gc.collect()
        gc.freeze()
        GracefulServer(config, server.drain).run()
    finally:
        pipe.close()
