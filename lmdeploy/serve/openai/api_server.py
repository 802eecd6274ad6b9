"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`~lmdeploy.serve.pipeline.Pipeline`.

Endpoints::

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
  prompt never stalls other clients or ``/health``; only JSON decoding and pydantic validation
  run on the event loop.
- Requests are validated (ranges by pydantic, prompt counts before tokenizing, messages / token
  ids / length by the pipeline and the engine) before anything is submitted, so a bad request
  is a 4xx with nothing to clean up.
- With API keys set, ``/v1/*``, ``/debug/*``, ``/docs`` and ``/openapi.json`` require
  ``Authorization: Bearer <key>``; ``/health`` is always open; ``/metrics`` is open unless
  ``protect_metrics`` (so a plain Prometheus scrape works) — it holds counters, never text.
- Decoding is greedy unless ``temperature`` > 0 (an absent temperature means greedy here, unlike
  OpenAI's default of 1.0), which makes served output reproducible by default.
"""
from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ...messages import GenerationConfig
from ...messages import Response as EngineResponse
from ...metrics import HTTPMetricsMiddleware, ServerMetrics
from ..images import ImageFetchLimits, fetch_http_images
from .chat_output import ChatOutput, StreamedLogprobs, TextOffsets, TokenTexts, chat_logprobs, completion_logprobs
from .prompt_logprobs import echo_logprobs, merge_completion_logprobs, vllm_prompt_logprobs
from .errors import APIError, error_body, install_error_handlers
from .large_body import OffLoopJSONRoute
from .lifecycle import BodySizeLimit, Drain, GracefulServer, KeyCheck, ShuttingDown
from .protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, ErrorBody, ModelCard, ModelList, \
    NamedToolChoice, Usage, new_id, now
from .reasoning_parser import get_reasoning_parser
from .structured import from_response_format, from_tool_choice, grammar_tool_format
from .tool_parser import detect_tool_format, get_tool_parser

__all__ = ['create_app', 'run_server', 'default_model_name', 'DEFAULT_MAX_REQUEST_BYTES',
           'DEFAULT_SHUTDOWN_TIMEOUT']

logger = logging.getLogger('lmdeploy')

_KNOWN_PATHS = frozenset({'/v1/models', '/v1/chat/completions', '/v1/completions', '/v1/responses', '/v1/messages',
                          '/v1/messages/count_tokens', '/health', '/metrics',
                          '/debug/ledger', '/docs', '/openapi.json'})
# one model's path (its id may hold slashes), one stored response's
_PATH_TEMPLATES = {'/v1/models/': '/v1/models/{model}', '/v1/responses/': '/v1/responses/{id}'}
_DISCONNECT_POLL_S = 0.25   # how often a non-streaming request checks that its client is still there
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
_END = object()             # queue sentinel: the shutdown deadline ended this generation


def default_model_name(model_path: str) -> str:
    """The served model name when none is given: the model directory's basename."""
    return os.path.basename(os.path.normpath(model_path))


def _resolve_parser(choice: str, template: str, marker: str, default: str) -> str | None:
    """``auto`` → ``default`` when the chat template mentions ``marker``; ``none`` → None."""
    if choice == 'none':
        return None
    if choice == 'auto':
        return default if marker in (template or '') else None
    return choice


class _Choice:
    """Accumulates one choice's deltas and timings (``time.perf_counter()`` seconds)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.text = ''
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None    # TokenLogprob per prompt token after the first
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
        self.logprobs += r.logprobs or []
        if r.prompt_logprobs is not None:
            self.prompt_logprobs = r.prompt_logprobs
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
        multimodal: the prompt's images (chat requests: one prompt).
        stops: per choice, None or a function of the choice's text so far that returns how many
            characters to keep once the reply must end (``parallel_tool_calls: false``: just after
            the first call); the choice then ends with ``"stop"`` and its engine request is
            finished as a completed turn (cached, put to the Store), so no further token is
            generated or billed.
    """

    def __init__(self, server: _Server, jobs: list[tuple[list[int], GenerationConfig]], n: int,
                 multimodal: tuple = (), stops: list | None = None):
        self.server = server
        self.jobs = jobs
        self.stops = stops or [None] * len(jobs)
        self.multimodal = multimodal        # the prompt's images (chat requests: one prompt)
        self.n = n
        self.start = time.perf_counter()
        self.choices = [_Choice(len(ids)) for ids, _ in jobs]
        self.queue: asyncio.Queue = asyncio.Queue()

    def end(self) -> None:
        """End this generation now (the shutdown deadline): :meth:`deltas` raises ShuttingDown."""
        self.queue.put_nowait((None, _END))

    async def deltas(self):
        """Async generator of ``(choice_index, Response)`` in arrival order until every choice
        finished. Closing it early aborts the unfinished choices.

        Raises:
            ShuttingDown: the shutdown deadline passed before every choice finished.
        """
        queue = self.queue
        pipe, metrics, drain = self.server.pipe, self.server.metrics, self.server.drain

        async def run(index: int, ids: list[int], cfg: GenerationConfig):
            try:
                async with aclosing(pipe.generate(ids, cfg, multimodal=self.multimodal,
                                                  stop_at=self.stops[index])) as gen:
                    async for r in gen:
                        queue.put_nowait((index, r))
            except Exception as err:      # handed to the consumer, which answers with an error
                queue.put_nowait((index, err))

        metrics.requests_running.inc(len(self.jobs))
        metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in self.jobs))
        tasks = [asyncio.create_task(run(i, ids, cfg)) for i, (ids, cfg) in enumerate(self.jobs)]
        drain.add(self)
        live = len(tasks)
        try:
            while live:
                index, item = await queue.get()
                if item is _END:
                    raise ShuttingDown()
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
            drain.discard(self)
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
        """Run every choice to the end; aborts them if the client disconnects meanwhile.

        Raises:
            APIError: 503 when the shutdown deadline ended the request, 500 when the engine failed.
        """
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
            if isinstance(task.exception(), ShuttingDown):
                raise _shutting_down()
            task.result()       # re-raise a bug in the merge loop as a 500
        if any(c.finish_reason == 'error' for c in self.choices):
            raise APIError(500, 'the engine failed while generating; see the server log', code='engine_error')


def _failed() -> EngineResponse:
    return EngineResponse(finish_reason='error')


def _shutting_down() -> APIError:
    return APIError(503, 'the server is shutting down; retry on another instance', code='shutting_down',
                    type='server_error')


def _sse(body: dict | str) -> str:
    return f'data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n'


def _stream_error(err: Exception) -> str:
    if isinstance(err, ShuttingDown):
        return _sse(error_body('the server is shutting down; the reply is incomplete', 'server_error',
                               code='shutting_down'))
    return _sse(error_body('the engine failed while generating', 'server_error', code='engine_error'))


class _SSEResponse(StreamingResponse):
    """A stream whose body generator is always closed when the response ends, however it ends,
    so abandoned choices are aborted now rather than whenever the generator is collected."""
    media_type = 'text/event-stream'

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _ChatPlan:
    """What the worker thread prepared for a chat request: the jobs and per-choice output parsers."""
    jobs: list[tuple[list[int], GenerationConfig]]
    outputs: list[ChatOutput]
    multimodal: tuple = ()


class _Server:
    """Request handlers bound to one pipeline.

    Args:
        pipe: the pipeline.
        model_name: the served name.
        api_keys: accepted bearer tokens (empty: no authentication).
        tool_call_parser: ``auto`` (``qwen_xml`` when the chat template writes ``<function=NAME>``
            calls, else ``hermes`` when it mentions ``<tool_call>``), ``none``, or a registered
            parser name.
        reasoning_parser: ``auto`` (``think`` when the chat template mentions ``<think>``),
            ``none``, or a registered parser name.
        shutdown_timeout: seconds in-flight requests may run after SIGTERM.
    """

    def __init__(self, pipe, model_name: str, api_keys: list[str] | None, tool_call_parser: str = 'auto',
                 reasoning_parser: str = 'auto', shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        self.pipe = pipe
        self.model_name = model_name
        self.api_keys = [k for k in (api_keys or []) if k]
        self.metrics = ServerMetrics(lambda: pipe.loop.call(lambda engine: engine.stats(), timeout=30),
                                     lambda: pipe.loop.call(lambda engine: engine.ledger(), timeout=30))
        template = getattr(pipe.tokenizer, 'chat_template', None) or ''
        template = template if isinstance(template, str) else json.dumps(template)
        self.tool_parser_name = _resolve_parser(tool_call_parser, template, '<tool_call>',
                                                detect_tool_format(template) or 'hermes')
        self.reasoning_parser_name = _resolve_parser(reasoning_parser, template, '<think>', 'think')
        if self.tool_parser_name:           # an unknown name fails now, not at the first request
            get_tool_parser(self.tool_parser_name)
        if self.reasoning_parser_name:
            get_reasoning_parser(self.reasoning_parser_name)
        self.texts = TokenTexts(pipe.tokenizer)
        self.drain = Drain(shutdown_timeout)
        self.image_fetch = ImageFetchLimits()     # http(s) image_url parts: size and time limits

    # request checks ---------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        """FastAPI dependency: 503 once shutting down; 401 unless the bearer token is one of the
        keys (when keys are set)."""
        if self.drain.draining:
            raise _shutting_down()
        anthropic = request.headers.get('x-api-key')        # Anthropic clients send the key this way
        if not self.key_valid(request.headers.get('authorization', '')) and \
                not (anthropic and self.key_valid('Bearer ' + anthropic)):
            raise APIError(401, 'missing or invalid API key: send "Authorization: Bearer <key>" (or "x-api-key: '
                           '<key>")', code='invalid_api_key')

    def key_valid(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (always True without
        keys); compared in constant time."""
        if not self.api_keys:
            return True
        scheme, _, token = authorization.partition(' ')
        token = token.strip().encode()
        return scheme.lower() == 'bearer' and any(hmac.compare_digest(token, k.encode()) for k in self.api_keys)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f'the model {name!r} does not exist; this server serves {self.model_name!r}',
                           param='model', code='model_not_found')

    def _encode(self, prompt, param: str) -> list[int]:
        """Raw token ids of a completions prompt (worker thread)."""
        try:
            return self.pipe.encode(prompt, do_preprocess=False)
        except Exception as err:   # ValueError, or the tokenizer refusing the text
            raise APIError(400, f'{param}: {err}', param=param, code='invalid_value') from err

    def _jobs(self, req, prompts_ids: list[list[int]], max_new: int | None, param: str, logprobs: int | None,
              structured=None, structured_param: str = 'response_format', prompt_logprobs: int | None = None):
        """One ``(ids, GenerationConfig)`` per choice (worker thread); 400 if the engine would
        refuse one. ``max_new`` is clamped to what the session has left after the prompt.
        ``structured``: the :class:`~lmdeploy.messages.StructuredOutput` of the request (an
        invalid schema is a 400 naming ``structured_param``)."""
        session_len = self.pipe.engine.session_len
        jobs = []
        bias = req.token_bias()
        try:
            self.pipe.engine.validate([0], GenerationConfig(logit_bias=bias))
        except ValueError as err:
            raise APIError(400, str(err), param='logit_bias', code='invalid_value') from err
        if prompt_logprobs is not None:
            try:
                self.pipe.engine.validate([0], GenerationConfig(prompt_logprobs=prompt_logprobs))
            except ValueError as err:
                raise APIError(400, str(err), param='prompt_logprobs', code='invalid_value') from err
        if structured is not None:
            try:
                self.pipe.engine.validate([0], GenerationConfig(structured_output=structured))
            except ValueError as err:
                raise APIError(400, f'{structured_param}: {err}', param=structured_param,
                               code='invalid_value') from err
        for ids in prompts_ids:
            try:
                self.pipe.engine.validate(ids, GenerationConfig())
            except ValueError as err:
                raise APIError(400, f'{param}: {err}', param=param, code='invalid_value') from err
            room = max(0, session_len - len(ids))
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % (1 << 64)   # torch's 64-bit seed space
                sampling = bool(req.temperature)
                cfg = GenerationConfig(
                    max_new_tokens=room if max_new is None else min(max_new, room),
                    do_sample=sampling, temperature=req.temperature if sampling else 1.0, top_p=req.top_p,
                    top_k=max(req.top_k, 0), repetition_penalty=req.repetition_penalty,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=bias,
                    stop_words=req.stop_words(), ignore_eos=req.ignore_eos, random_seed=seed, logprobs=logprobs,
                    min_tokens=req.min_tokens, structured_output=structured, cache_salt=req.cache_salt,
                    prompt_logprobs=prompt_logprobs)
                jobs.append((ids, cfg))
        return jobs

    def _plan_chat(self, req: ChatCompletionRequest) -> _ChatPlan:
        """Render, tokenize and check a chat request (worker thread)."""
        use_tools = bool(req.tools) and req.tool_choice != 'none'
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
        parser = get_tool_parser(self.tool_parser_name, tools) if use_tools and self.tool_parser_name else None
        prefix = ''
        structured, structured_param = self._structured(req.response_format), 'response_format'
        forced = use_tools and (req.tool_choice == 'required' or isinstance(req.tool_choice, NamedToolChoice))
        tool_format = grammar_tool_format(self.tool_parser_name) if forced else None
        if forced and structured is not None:
            raise APIError(400, 'response_format: cannot be combined with a tool_choice that forces a call',
                           param='response_format', code='invalid_value')
        if tool_format is not None:       # the grammar writes the call; its parser reads it back
            parser = get_tool_parser(self.tool_parser_name or 'hermes')
        if parser is not None and req.tool_choice == 'required':
            prefix = parser.forced_prefix(None)
        elif parser is not None and isinstance(req.tool_choice, NamedToolChoice):
            prefix = parser.forced_prefix(req.tool_choice.function.name)
        if tool_format is not None:
            # the opening goes into the prompt (it re-tokenizes as the history will); the grammar
            # continues after it
            structured = from_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format)
            structured = structured.model_copy(update={'prefix': prefix})
            structured_param = 'tools'
        messages = [m.for_template() for m in req.messages]
        if self.tool_parser_name:       # history calls as this format's template wants them
            history = parser or get_tool_parser(self.tool_parser_name)
            messages = [history.history_message(m) for m in messages]
        images = ()
        try:
            if any(m.has_images() for m in req.messages):
                if not self.pipe.accepts_images:
                    i, j = next((i, j) for i, m in enumerate(req.messages) if m.has_images()
                                for j, p in enumerate(m.content) if p.type == 'image_url')
                    raise APIError(400, f'messages[{i}].content[{j}]: model {self.model_name!r} does not accept '
                                   f'image_url parts', param='messages', code='invalid_value')
                text, pil = self.pipe.render_with_images(fetch_http_images(messages, self.image_fetch),
                                                         tools, req.chat_template_kwargs)
                wheres = [f'messages[{i}].content[{j}]' for i, m in enumerate(messages)
                          if isinstance(m.get('content'), list)
                          for j, p in enumerate(m['content']) if p.get('type') == 'image_url']
                ids, images = self.pipe.expand_images(text + prefix, pil, wheres)
                self.pipe.engine.make_sequence(ids, multimodal=images)      # checks the images; queues nothing
            else:
                text = self.pipe.render(messages, tools, req.chat_template_kwargs)
                if structured is not None and text.rstrip().endswith('<think>'):
                    # the template opened a reasoning block: close it empty, so that the grammar's
                    # output is the reply itself (constrained replies have no reasoning)
                    text += '\n\n</think>\n\n'
                ids = self.pipe.tokenize(text + prefix)
        except ValueError as err:
            raise APIError(400, f'messages: {err}', param='messages', code='invalid_value') from err
        reasoning = None
        if self.reasoning_parser_name and req.separate_reasoning:
            reasoning = get_reasoning_parser(self.reasoning_parser_name)
        # the prompt ends inside an open <think>: also when reasoning is not split out (the
        # tool-call parser must skip it either way)
        started = not prefix and text.rstrip().endswith('<think>')
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        jobs = self._jobs(req, [ids], req.max_new(), 'messages', logprobs, structured, structured_param,
                          req.prompt_logprobs)
        outputs = [ChatOutput(reasoning, started, parser, prefix, req.parallel_tool_calls) for _ in jobs]
        return _ChatPlan(jobs, outputs, images)

    @staticmethod
    def _structured(response_format):
        """The engine constraint of a ``response_format`` (None for text); 400 naming it."""
        try:
            return from_response_format(response_format)
        except ValueError as err:
            raise APIError(400, f'response_format: {err}', param='response_format', code='invalid_value') from err

    # endpoints ------------------------------------------------------------------------------
    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_name, max_model_len=self.pipe.engine.session_len)

    async def models(self) -> dict:
        return ModelList(data=[self._card()]).model_dump()

    async def model(self, model_id: str) -> dict:
        """``GET /v1/models/{model_id}``: the served model's card, or 404 naming the id."""
        self._check_model(model_id)
        return self._card().model_dump()

    async def chat(self, req: ChatCompletionRequest, request: Request):
        self._check_model(req.model)
        plan = await run_in_threadpool(self._plan_chat, req)
        gen = _Generation(self, plan.jobs, req.n, plan.multimodal, [out.first_call_stop() for out in plan.outputs])
        rid, created = new_id('chatcmpl'), now()
        head = {'id': rid, 'object': 'chat.completion', 'created': created, 'model': self.model_name}
        top = req.top_logprobs or 0
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._chat_events(gen, plan.outputs, dict(head, object='chat.completion.chunk'),
                                                  include_usage, req.logprobs, top, req.prompt_logprobs))
        await gen.collect(request)
        choices = []
        for i, (c, out) in enumerate(zip(gen.choices, plan.outputs)):
            choices.append({'index': i, 'message': out.message(c.text),
                            'logprobs': chat_logprobs(self.texts, c.logprobs, top) if req.logprobs else None,
                            'finish_reason': out.finish_reason(c.finish_reason)})
        extra = {}
        if req.prompt_logprobs is not None:
            extra['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, gen.choices[0].prompt_logprobs,
                                                            req.prompt_logprobs)
        return dict(head, choices=choices, usage=gen.usage(), **extra)

    async def _chat_events(self, gen: _Generation, outputs: list[ChatOutput], head: dict, include_usage: bool,
                           logprobs: bool, top: int, prompt_logprobs: int | None = None):
        def chunk(choices, usage=None, **extra):
            body = dict(head, choices=choices, **extra)
            if include_usage:
                body['usage'] = usage
            return _sse(body)
        for i in range(len(gen.choices)):
            yield chunk([{'index': i, 'delta': {'role': 'assistant', 'content': ''}, 'logprobs': None,
                          'finish_reason': None}])
        aligned = [StreamedLogprobs(self.texts) for _ in gen.choices]     # entries in step with the text
        try:
            async with aclosing(gen.deltas()) as stream:
                async for i, r in stream:
                    if r.finish_reason == 'error':
                        yield _stream_error(RuntimeError())
                        break
                    out = outputs[i]
                    text, lp = r.text, None
                    if logprobs:    # the text up to a token boundary, with exactly its tokens' entries
                        text, ready, _ = aligned[i].feed(r.logprobs, r.text, bool(r.finish_reason))
                        lp = chat_logprobs(self.texts, ready, top) if ready else None
                    delta = out.feed(text) if text else {}
                    reason = None
                    if r.finish_reason:
                        delta = ChatOutput.merge_deltas(delta, out.finish())
                        reason = out.finish_reason(r.finish_reason)
                    extra = {}
                    if prompt_logprobs is not None and r.prompt_logprobs is not None and i == 0:
                        extra['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, r.prompt_logprobs, prompt_logprobs)
                    if delta or reason or lp or extra:
                        yield chunk([{'index': i, 'delta': delta, 'logprobs': lp, 'finish_reason': reason}], **extra)
        except ShuttingDown as err:
            yield _stream_error(err)
        if include_usage:
            yield chunk([], gen.usage())
        yield _sse('[DONE]')

    async def completions(self, req: CompletionRequest, request: Request):
        self._check_model(req.model)
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, 'prompt: must not be empty', param='prompt', code='invalid_value')
        if len(prompts) * req.n > MAX_CHOICES:       # before any tokenization
            raise APIError(400, f'{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices',
                           param='prompt' if len(prompts) > 1 else 'n', code='invalid_value')

        def plan():
            ids = [self._encode(p, 'prompt') for p in prompts]
            # echo: each choice's text starts with its prompt's text (token ids decoded)
            echo = [p if isinstance(p, str) else self.pipe.tokenizer.decode(i) for p, i in zip(prompts, ids)] \
                if req.echo else None
            # echo with logprobs: the prompt's tokens get theirs too (as many alternatives)
            wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
            return self._jobs(req, ids, req.max_tokens, 'prompt', req.logprobs, self._structured(req.response_format),
                              prompt_logprobs=max(wanted) if wanted else None), echo
        jobs, echo = await run_in_threadpool(plan)
        echoed = [echo[i // req.n] for i in range(len(jobs))] if echo else None
        gen = _Generation(self, jobs, req.n)
        head = {'id': new_id('cmpl'), 'object': 'text_completion', 'created': now(), 'model': self.model_name}
        top = req.logprobs or 0
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._completion_events(gen, head, include_usage, req.logprobs is not None, top,
                                                        echoed, [ids for ids, _ in jobs], req.prompt_logprobs))
        await gen.collect(request)
        choices = []
        for i, c in enumerate(gen.choices):
            choice = {'index': i, 'text': (echoed[i] if echoed else '') + c.text, 'logprobs': None,
                      'finish_reason': c.finish_reason}
            if req.logprobs is not None:
                offsets = TextOffsets(self.texts)
                head_lp = echo_logprobs(self.texts, jobs[i][0], c.prompt_logprobs, top, offsets) if echoed else None
                choice['logprobs'] = merge_completion_logprobs(head_lp, completion_logprobs(self.texts, c.logprobs,
                                                                                           top, offsets))
            if req.prompt_logprobs is not None:
                choice['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, c.prompt_logprobs, req.prompt_logprobs)
            choices.append(choice)
        return dict(head, choices=choices, usage=gen.usage())

    async def _completion_events(self, gen: _Generation, head: dict, include_usage: bool, logprobs: bool,
                                 top: int, echoed: list[str] | None = None, prompts: list | None = None,
                                 prompt_logprobs: int | None = None):
        aligned = [StreamedLogprobs(self.texts) for _ in gen.choices]     # entries in step with the text
        usage = {'usage': None} if include_usage else {}
        # echo: the prompt first, as each choice's first text; with logprobs (which come with the
        # choice's first output) it waits for them
        pending_echo = dict(enumerate(echoed or []))
        if not logprobs:
            for i, text in pending_echo.items():
                yield _sse(dict(head, choices=[{'index': i, 'text': text, 'logprobs': None, 'finish_reason': None}],
                                **usage))
            pending_echo = {}
        try:
            async with aclosing(gen.deltas()) as stream:
                async for i, r in stream:
                    if r.finish_reason == 'error':
                        yield _stream_error(RuntimeError())
                        break
                    extra = {}
                    if prompt_logprobs is not None and r.prompt_logprobs is not None:
                        extra['prompt_logprobs'] = vllm_prompt_logprobs(self.texts, r.prompt_logprobs,
                                                                        prompt_logprobs)
                    if i in pending_echo:
                        lp = echo_logprobs(self.texts, prompts[i], r.prompt_logprobs, top, aligned[i].offsets)
                        aligned[i].sent = aligned[i].offsets.chars     # generated text starts after the echo
                        choice = {'index': i, 'text': pending_echo.pop(i), 'logprobs': lp, 'finish_reason': None}
                        yield _sse(dict(head, choices=[dict(choice, **extra)], **usage))
                        extra = {}
                    text, lp = r.text, None
                    if logprobs:    # the text up to a token boundary, with exactly its tokens' entries
                        text, ready, starts = aligned[i].feed(r.logprobs, r.text, bool(r.finish_reason))
                        lp = completion_logprobs(self.texts, ready, top, starts=starts) if ready else None
                    if text or r.finish_reason or lp or extra:
                        choice = {'index': i, 'text': text, 'logprobs': lp, 'finish_reason': r.finish_reason,
                                  **extra}
                        yield _sse(dict(head, choices=[choice], **usage))
        except ShuttingDown as err:
            yield _stream_error(err)
        if include_usage:
            yield _sse(dict(head, choices=[], usage=gen.usage()))
        yield _sse('[DONE]')

    async def health(self):
        if self.drain.draining:
            raise _shutting_down()
        return {'status': 'ok'}

    def prometheus(self) -> Response:
        # a plain def: FastAPI runs it in a worker thread, since reading engine stats waits for a step
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def ledger(self) -> dict:
        return await run_in_threadpool(self.pipe.ledger)


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


def create_app(pipe, model_name: str, api_keys: list[str] | None = None, *, tool_call_parser: str = 'auto',
               reasoning_parser: str = 'auto', max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, protect_metrics: bool = False,
               image_fetch: ImageFetchLimits | None = None, response_store=None) -> FastAPI:
    """Build the FastAPI app serving ``pipe`` (a :class:`~lmdeploy.serve.pipeline.Pipeline`).

    Args:
        pipe: the pipeline; the app does not close it.
        model_name: the name clients must send as ``model`` (others get 404).
        api_keys: accepted bearer tokens; None or an empty list disables authentication (an
            empty key is refused). With keys, ``/v1/*``, ``/debug/*``, ``/docs`` and
            ``/openapi.json`` need one; ``/metrics`` too with ``protect_metrics``; ``/health``
            never does.
        tool_call_parser: see :class:`_Server`.
        reasoning_parser: see :class:`_Server`.
        max_request_bytes: larger bodies get 413; 0 = no limit.
        shutdown_timeout: seconds in-flight requests may run after a shutdown signal.
        protect_metrics: ``/metrics`` needs a key as well (when keys are set).
        image_fetch: limits and host policy for ``http(s)`` ``image_url`` parts (default
            :class:`~lmdeploy.serve.images.ImageFetchLimits`: 20 MiB, 10 s, public hosts only).
        response_store: bounds of the ``/v1/responses`` store
            (:class:`~lmdeploy.serve.openai.response_store.ResponseStoreLimits`; default 1024
            entries, 256 MiB, one hour).

    Raises:
        ValueError: an unknown parser name, or an empty API key.
    """
    if api_keys and any(not k or not k.strip() for k in api_keys):
        raise ValueError('api_keys (--api-keys): a key must not be empty; pass no keys to serve without '
                         'authentication')
    server = _Server(pipe, model_name, api_keys, tool_call_parser, reasoning_parser, shutdown_timeout)
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
    from .anthropic import MessagesAPI
    from .response_store import ResponseStore
    from .responses import ResponsesAPI
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
        ValueError: naming ``--server-port`` / ``--server-name`` and the OS error.
    """
    with socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
        try:
            sock.bind((host, port))
        except OverflowError:
            raise ValueError(f'--server-port must be a port number 0-65535, got {port}') from None
        except socket.gaierror as err:
            raise ValueError(f'cannot serve on {host}:{port}: --server-name {host!r} is not an address or a '
                             f'name this machine resolves ({err.strerror})') from None
        except OSError as err:
            hint = {errno.EADDRINUSE: '; is another server running there?',
                    errno.EADDRNOTAVAIL: f'; {host} is not an address of this machine'}.get(err.errno, '')
            raise ValueError(f'cannot serve on {host}:{port} (--server-name/--server-port): {err.strerror}'
                             f'{hint}') from None


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
               api_keys: list[str] | None = None, log_level: str = 'info', model_name: str | None = None, *,
               tool_call_parser: str = 'auto', reasoning_parser: str = 'auto',
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, protect_metrics: bool = False,
               image_fetch: ImageFetchLimits | None = None, response_store=None) -> None:
    """Load the model and serve it until SIGINT/SIGTERM (blocking).

    Either signal shuts down gracefully (see :mod:`.lifecycle`): the server stops accepting,
    in-flight requests get ``shutdown_timeout`` seconds to finish, the rest are ended with an
    error event / a 503, then the pipeline is closed (Store saves flushed, embedded Mooncake
    services stopped); SIGTERM then exits with ``SystemExit(143)``, SIGINT with
    ``KeyboardInterrupt``. Other arguments as :func:`create_app`.

    Raises:
        ValueError: ``server_port`` is already taken on ``server_name`` (checked before the slow
            model load), or a bad model path, engine configuration (from
            :class:`~lmdeploy.serve.pipeline.Pipeline`) or parser name.
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

    def engine_died(err):   # e.g. a tensor-parallel worker died: requests failed, end the server
        logger.critical('engine stopped: %s; shutting the server down', err)
        os.kill(os.getpid(), signal.SIGTERM)
    pipe.loop.on_fatal = engine_died
    logger.info('engine ready in %.1f s: %s', time.perf_counter() - started, _engine_summary(pipe.engine))
    try:
        app = create_app(pipe, model_name or default_model_name(model_path), api_keys,
                         tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                         max_request_bytes=max_request_bytes, shutdown_timeout=shutdown_timeout,
                         protect_metrics=protect_metrics, image_fetch=image_fetch, response_store=response_store)
        server = app.state.server
        logger.info('serving %s as %r on http://%s:%d (tool calls: %s, reasoning: %s)', model_path,
                    server.model_name, server_name, server_port, server.tool_parser_name, server.reasoning_parser_name)
        # uvicorn's own deadline comes after ours, so the drain (not a task cancellation) ends late requests
        config = uvicorn.Config(app, host=server_name, port=server_port, log_level=log_level.lower(),
                                timeout_graceful_shutdown=shutdown_timeout + 5)
        GracefulServer(config, server.drain).run()
    finally:
        pipe.close()
