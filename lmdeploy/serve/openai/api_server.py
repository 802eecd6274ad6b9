"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`~lmdeploy.serve.pipeline.Pipeline`.

Endpoints::

    GET  /v1/models             the served model (its name defaults to the model directory's basename)
    POST /v1/chat/completions   messages → reply; SSE stream when "stream": true
    POST /v1/completions        prompt(s) as text or token ids → continuation(s)
    GET  /health                200 while serving
    GET  /metrics               Prometheus text (lmdeploy.metrics)
    GET  /debug/ledger          the engine's resource ledger (idle checks in tests)

Ownership and invariants:
- Each choice (``n`` per prompt) is one engine request, run as its own asyncio task that feeds a
  per-response queue. Whatever ends the response early — the client disconnecting (Starlette
  cancels the stream), a non-streaming client going away, an error — cancels those tasks, and
  cancelling a task aborts its engine request (``Pipeline.generate``), which frees its blocks,
  slots and pins before the next engine step.
- Requests are validated (ranges by pydantic, messages / token ids / length by the pipeline and
  the engine) before anything is submitted, so a bad request is a 4xx with nothing to clean up.
- ``/v1/*`` and ``/debug/*`` require ``Authorization: Bearer <key>`` when API keys are set.
- Decoding is greedy unless ``temperature`` > 0 (an absent temperature means greedy here, unlike
  OpenAI's default of 1.0), which makes served output reproducible by default.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
from contextlib import aclosing

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ...messages import GenerationConfig
from ...messages import Response as EngineResponse
from ...metrics import HTTPMetricsMiddleware, ServerMetrics
from .errors import APIError, error_body, install_error_handlers
from .protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, Usage, \
    new_id, now

__all__ = ['create_app', 'run_server', 'default_model_name']

logger = logging.getLogger('lmdeploy')

_KNOWN_PATHS = frozenset({'/v1/models', '/v1/chat/completions', '/v1/completions', '/health', '/metrics',
                          '/debug/ledger'})
_DISCONNECT_POLL_S = 0.25   # how often a non-streaming request checks that its client is still there


def default_model_name(model_path: str) -> str:
    """The served model name when none is given: the model directory's basename."""
    return os.path.basename(os.path.normpath(model_path))


class _Choice:
    """Accumulates one choice's deltas and timings (``time.perf_counter()`` seconds)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.text = ''
        self.num_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.first: float | None = None
        self.last: float | None = None

    def add(self, r) -> None:
        t = time.perf_counter()
        if r.token_ids:
            self.first = self.first or t
            self.last = t
        self.text += r.text
        self.num_tokens = max(self.num_tokens, r.generate_token_len)
        self.cached_tokens = max(self.cached_tokens, r.cached_tokens)
        self.finish_reason = r.finish_reason or self.finish_reason


class _Generation:
    """The choices of one HTTP request: submission, merging of their deltas, cancellation,
    usage and metrics.

    Args:
        server: the owning server.
        jobs: ``(token_ids, gen_config)`` per choice, prompt-major (choice i = prompt i // n).
        n: choices per prompt.
    """

    def __init__(self, server: _Server, jobs: list[tuple[list[int], GenerationConfig]], n: int):
        self.server = server
        self.jobs = jobs
        self.n = n
        self.start = time.perf_counter()
        self.choices = [_Choice(len(ids)) for ids, _ in jobs]

    async def deltas(self):
        """Async generator of ``(choice_index, Response)`` in arrival order until every choice
        finished. Closing it early aborts the unfinished choices."""
        queue: asyncio.Queue = asyncio.Queue()
        pipe, metrics = self.server.pipe, self.server.metrics

        async def run(index: int, ids: list[int], cfg: GenerationConfig):
            try:
                async with aclosing(pipe.generate(ids, cfg)) as gen:
                    async for r in gen:
                        queue.put_nowait((index, r))
            except Exception as err:      # handed to the consumer, which answers with an error
                queue.put_nowait((index, err))

        metrics.requests_running.inc(len(self.jobs))
        metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in self.jobs))
        tasks = [asyncio.create_task(run(i, ids, cfg)) for i, (ids, cfg) in enumerate(self.jobs)]
        live = len(tasks)
        try:
            while live:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    logger.error('generation failed: %r', item)
                    item = _failed()
                choice = self.choices[index]
                choice.add(item)
                if item.finish_reason is not None:
                    live -= 1
                    self._finished(choice)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()       # no await: this may run inside a cancelled scope
            for choice in self.choices:
                if choice.finish_reason is None:
                    choice.finish_reason = 'abort'
                    self._finished(choice)

    def _finished(self, choice: _Choice) -> None:
        metrics = self.server.metrics
        metrics.requests_running.dec()
        metrics.observe_choice(self.start, choice.first, choice.last, choice.num_tokens, choice.finish_reason)

    def usage(self) -> dict:
        """Usage over all choices; each prompt's tokens (and cached tokens) count once."""
        heads = self.choices[::self.n]
        prompt = sum(c.prompt_len for c in heads)
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={'cached_tokens': sum(c.cached_tokens for c in heads)}).model_dump()

    async def collect(self, request: Request) -> None:
        """Run every choice to the end; aborts them if the client disconnects meanwhile."""
        async def drain():
            async with aclosing(self.deltas()) as stream:
                async for _ in stream:
                    pass
        task = asyncio.create_task(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    logger.info('client left %s; aborting its request', request.url.path)
                    break
        finally:
            task.cancel()
        if task.done() and not task.cancelled():
            task.result()       # re-raise a bug in the merge loop as a 500
        if any(c.finish_reason == 'error' for c in self.choices):
            raise APIError(500, 'the engine failed while generating; see the server log', code='engine_error')


def _failed() -> EngineResponse:
    return EngineResponse(finish_reason='error')


def _sse(body: dict | str) -> str:
    return f'data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n'


class _SSEResponse(StreamingResponse):
    """A stream whose body generator is always closed when the response ends, however it ends,
    so abandoned choices are aborted now rather than whenever the generator is collected."""
    media_type = 'text/event-stream'

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Server:
    """Request handlers bound to one pipeline."""

    def __init__(self, pipe, model_name: str, api_keys: list[str] | None):
        self.pipe = pipe
        self.model_name = model_name
        self.api_keys = [k for k in (api_keys or []) if k]
        self.metrics = ServerMetrics(lambda: pipe.loop.call(lambda engine: engine.stats(), timeout=30))

    # request checks ---------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        """FastAPI dependency: 401 unless the bearer token is one of the keys (when keys are set)."""
        if not self.api_keys:
            return
        scheme, _, token = request.headers.get('authorization', '').partition(' ')
        token = token.strip().encode()
        if scheme.lower() != 'bearer' or not any(hmac.compare_digest(token, k.encode()) for k in self.api_keys):
            raise APIError(401, 'missing or invalid API key: send "Authorization: Bearer <key>"',
                           code='invalid_api_key')

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f'the model {name!r} does not exist; this server serves {self.model_name!r}',
                           param='model', code='model_not_found')

    def _encode(self, prompt, param: str) -> list[int]:
        try:
            return self.pipe.encode(prompt)
        except Exception as err:   # ValueError, or the chat template rejecting the conversation
            raise APIError(400, f'{param}: {err}', param=param) from err

    def _jobs(self, req, prompts_ids: list[list[int]], max_new: int | None, param: str):
        """One ``(ids, GenerationConfig)`` per choice; 400 if the engine would refuse one."""
        if len(prompts_ids) * req.n > MAX_CHOICES:
            raise APIError(400, f'{len(prompts_ids)} prompts x n={req.n} exceeds {MAX_CHOICES} choices', param='n')
        session_len = self.pipe.engine.session_len
        jobs = []
        for ids in prompts_ids:
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % (1 << 63)
                sampling = bool(req.temperature)
                cfg = GenerationConfig(
                    max_new_tokens=max(0, session_len - len(ids)) if max_new is None else max_new,
                    do_sample=sampling, temperature=req.temperature if sampling else 1.0, top_p=req.top_p,
                    top_k=max(req.top_k, 0), repetition_penalty=req.repetition_penalty,
                    stop_words=req.stop_words(), ignore_eos=req.ignore_eos, random_seed=seed)
                try:
                    self.pipe.engine.validate(ids, cfg)
                except ValueError as err:
                    raise APIError(400, str(err), param=param) from err
                jobs.append((ids, cfg))
        return jobs

    # endpoints ------------------------------------------------------------------------------
    async def models(self) -> dict:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.pipe.engine.session_len)]
                         ).model_dump()

    async def chat(self, req: ChatCompletionRequest, request: Request):
        self._check_model(req.model)
        messages = [{'role': m.role, 'content': m.text()} for m in req.messages]
        ids = self._encode(messages, 'messages')
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        gen = _Generation(self, self._jobs(req, [ids], max_new, 'messages'), req.n)
        rid, created = new_id('chatcmpl'), now()
        head = {'id': rid, 'object': 'chat.completion', 'created': created, 'model': self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._chat_events(gen, dict(head, object='chat.completion.chunk'), include_usage))
        await gen.collect(request)
        choices = [{'index': i, 'message': {'role': 'assistant', 'content': c.text}, 'logprobs': None,
                    'finish_reason': c.finish_reason} for i, c in enumerate(gen.choices)]
        return dict(head, choices=choices, usage=gen.usage())

    async def _chat_events(self, gen: _Generation, head: dict, include_usage: bool):
        def chunk(choices, usage=None):
            body = dict(head, choices=choices)
            if include_usage:
                body['usage'] = usage
            return _sse(body)
        for i in range(len(gen.choices)):
            yield chunk([{'index': i, 'delta': {'role': 'assistant', 'content': ''}, 'logprobs': None,
                          'finish_reason': None}])
        async with aclosing(gen.deltas()) as stream:
            async for i, r in stream:
                if r.finish_reason == 'error':
                    yield _sse(error_body('the engine failed while generating', 'server_error', code='engine_error'))
                    break
                if r.text or r.finish_reason:
                    delta = {'content': r.text} if r.text else {}
                    yield chunk([{'index': i, 'delta': delta, 'logprobs': None, 'finish_reason': r.finish_reason}])
        if include_usage:
            yield chunk([], gen.usage())
        yield _sse('[DONE]')

    async def completions(self, req: CompletionRequest, request: Request):
        self._check_model(req.model)
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, 'prompt must not be empty', param='prompt')
        ids = [self._encode(p, 'prompt') for p in prompts]
        gen = _Generation(self, self._jobs(req, ids, req.max_tokens, 'prompt'), req.n)
        head = {'id': new_id('cmpl'), 'object': 'text_completion', 'created': now(), 'model': self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._completion_events(gen, head, include_usage))
        await gen.collect(request)
        choices = [{'index': i, 'text': c.text, 'logprobs': None, 'finish_reason': c.finish_reason}
                   for i, c in enumerate(gen.choices)]
        return dict(head, choices=choices, usage=gen.usage())

    async def _completion_events(self, gen: _Generation, head: dict, include_usage: bool):
        async with aclosing(gen.deltas()) as stream:
            async for i, r in stream:
                if r.finish_reason == 'error':
                    yield _sse(error_body('the engine failed while generating', 'server_error', code='engine_error'))
                    break
                if r.text or r.finish_reason:
                    choice = {'index': i, 'text': r.text, 'logprobs': None, 'finish_reason': r.finish_reason}
                    yield _sse(dict(head, choices=[choice], **({'usage': None} if include_usage else {})))
        if include_usage:
            yield _sse(dict(head, choices=[], usage=gen.usage()))
        yield _sse('[DONE]')

    async def health(self) -> dict:
        return {'status': 'ok'}

    def prometheus(self) -> Response:
        # a plain def: FastAPI runs it in a worker thread, since reading engine stats waits for a step
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def ledger(self) -> dict:
        return await run_in_threadpool(self.pipe.ledger)


def create_app(pipe, model_name: str, api_keys: list[str] | None = None) -> FastAPI:
    """Build the FastAPI app serving ``pipe`` (a :class:`~lmdeploy.serve.pipeline.Pipeline`).

    Args:
        pipe: the pipeline; the app does not close it.
        model_name: the name clients must send as ``model`` (others get 404).
        api_keys: accepted bearer tokens; None or empty disables authentication.
    """
    server = _Server(pipe, model_name, api_keys)
    app = FastAPI(title='lmdeploy', version='0.1.0')
    install_error_handlers(app)
    auth = [Depends(server.check_key)]
    app.get('/v1/models', dependencies=auth)(server.models)
    app.post('/v1/chat/completions', dependencies=auth)(server.chat)
    app.post('/v1/completions', dependencies=auth)(server.completions)
    app.get('/debug/ledger', dependencies=auth)(server.ledger)
    app.get('/health')(server.health)
    app.get('/metrics')(server.prometheus)
    app.add_middleware(HTTPMetricsMiddleware, metrics=server.metrics, known_paths=_KNOWN_PATHS)
    app.state.server = server
    return app


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before the model loads, when ``host:port`` cannot be bound.

    Raises:
        ValueError: naming ``--server-port`` / ``--server-name`` and the OS error.
    """
    with socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as err:
            raise ValueError(f'cannot serve on {host}:{port} (--server-name/--server-port): {err.strerror}; '
                             'is another server running there?') from None


def _engine_summary(engine) -> str:
    """One line on what the engine sized: KV blocks, state slots, Store."""
    cfg = engine.config
    parts = [f'{engine.block_manager.num_blocks} KV blocks x {cfg.block_size} tokens on {engine.device}']
    if engine.cache_engine.num_slots:
        parts.append(f'{engine.cache_engine.num_slots} state slots')
    if engine.store is None:
        parts.append('no Store')
    else:
        parts.append('embedded Mooncake Store' if cfg.mooncake_master == 'local' else
                     f'Mooncake Store at {cfg.mooncake_master}')
    return ', '.join(parts)


def _exit_on_sigterm(signum, frame) -> None:
    # uvicorn catches SIGTERM, shuts down, then raises the signal again under the handler it
    # found at startup; under the default disposition that kills the process before run_server's
    # `finally` (and atexit) run, leaving the embedded Mooncake processes orphaned and queued
    # Store saves unflushed. An exception unwinds through `finally` instead.
    raise SystemExit(128 + signum)


def run_server(model_path: str, backend_config=None, server_name: str = '0.0.0.0', server_port: int = 23333,
               api_keys: list[str] | None = None, log_level: str = 'info', model_name: str | None = None) -> None:
    """Load the model and serve it until SIGINT/SIGTERM (blocking). Either signal shuts down
    gracefully: the pipeline is closed (Store saves flushed, embedded Mooncake services stopped);
    SIGTERM then exits with ``SystemExit(143)``, SIGINT with ``KeyboardInterrupt``.

    Raises:
        ValueError: ``server_port`` is already taken on ``server_name`` (checked before the slow
            model load), or a bad model path or engine configuration (from
            :class:`~lmdeploy.serve.pipeline.Pipeline`).
    """
    logging.basicConfig(level=log_level.upper(), format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    logger.setLevel(log_level.upper())
    check_port_free(server_name, server_port)
    started = time.perf_counter()
    logger.info('loading %s', model_path)
    import uvicorn

    from ..pipeline import Pipeline                               # imports torch: seconds
    if threading.current_thread() is threading.main_thread():     # signal handlers: main thread only
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pipe = Pipeline(model_path, backend_config)
    logger.info('engine ready in %.1f s: %s', time.perf_counter() - started, _engine_summary(pipe.engine))
    try:
        app = create_app(pipe, model_name or default_model_name(model_path), api_keys)
        logger.info('serving %s as %r on http://%s:%d', model_path, app.state.server.model_name, server_name,
                    server_port)
        uvicorn.run(app, host=server_name, port=server_port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        pipe.close()
