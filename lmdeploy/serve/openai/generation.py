"""One HTTP request's generation: its engine requests, the merging of their deltas, and how it ends.

:class:`Generation` runs each choice (``n`` per prompt) as one engine request in its own asyncio
task feeding one queue. Whatever ends the response early — the client disconnecting, a
non-streaming client going away, an error, the shutdown deadline — cancels those tasks, and
cancelling a task aborts its engine request (``Pipeline.generate``), which frees its blocks,
slots and pins before the next engine step. Also here: the SSE framing shared by the streaming
endpoints (:func:`sse`, :func:`stream_error`, :class:`SSEResponse`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...messages import Response as EngineResponse
from ...pytorch.engine.requests import CheckedRequest
from .errors import APIError, error_body
from .lifecycle import ShuttingDown
from .protocol import Usage

__all__ = ['Choice', 'Generation', 'SSEResponse', 'failed_response', 'shutting_down', 'sse', 'stream_error']

logger = logging.getLogger('lmdeploy')

_DISCONNECT_POLL_S = 0.25   # how often a non-streaming request checks that its client is still there
_END = object()             # queue sentinel: the shutdown deadline ended this generation


class Choice:
    """Accumulates one choice's deltas and timings (``time.perf_counter()`` seconds)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.text = ''
        self.token_ids: list[int] = []     # generated, the stop token excluded
        self.stop_token_id: int | None = None
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None    # TokenLogprob per prompt token after the first
        self.num_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.handoff_id: str | None = None     # (role prefill) the Store key of the hand-off
        self.first: float | None = None
        self.last: float | None = None

    def add(self, r) -> None:
        t = time.perf_counter()
        if r.token_ids:
            self.first = self.first or t
            self.last = t
        self.text += r.text
        self.token_ids += r.token_ids or []
        if getattr(r, 'stop_token_id', None) is not None:
            self.stop_token_id = r.stop_token_id
        self.logprobs += r.logprobs or []
        if r.prompt_logprobs is not None:
            self.prompt_logprobs = r.prompt_logprobs
        self.num_tokens = max(self.num_tokens, r.generate_token_len)
        self.cached_tokens = max(self.cached_tokens, r.cached_tokens)
        self.finish_reason = r.finish_reason or self.finish_reason
        self.handoff_id = getattr(r, 'handoff_id', None) or self.handoff_id


class Generation:
    """The choices of one HTTP request: submission, merging of their deltas, cancellation,
    usage and metrics.

    Args:
        server: the owning server (:class:`~.api_server.Server`: its pipe, metrics, drain).
        jobs: one checked request per choice (:class:`~lmdeploy.pytorch.engine.requests.CheckedRequest`:
            token ids, options, the prompt's images and shared head), prompt-major (choice i =
            prompt i // n).
        n: choices per prompt.
        stops: per choice, None or a function of the choice's text so far that returns how many
            characters to keep once the reply must end (``parallel_tool_calls: false``: just after
            the first call); the choice then ends with ``"stop"`` and its engine request is
            finished as a completed turn (cached, put to the Store), so no further token is
            generated or billed.
    """

    def __init__(self, server, jobs: list[CheckedRequest], n: int, stops: list | None = None):
        self.server = server
        self.jobs = jobs
        self.stops = stops or [None] * len(jobs)
        self.n = n
        self.start = time.perf_counter()
        self.choices = [Choice(len(job.token_ids)) for job in jobs]
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

        async def run(index: int, job: CheckedRequest):
            try:
                async with aclosing(pipe.generate(job, stop_at=self.stops[index])) as gen:
                    async for r in gen:
                        queue.put_nowait((index, r))
            except Exception as err:      # handed to the consumer, which answers with an error
                queue.put_nowait((index, err))

        metrics.requests_running.inc(len(self.jobs))
        metrics.prompt_tokens.inc(sum(len(job.token_ids) for job in self.jobs))
        tasks = [asyncio.create_task(run(i, job)) for i, job in enumerate(self.jobs)]
        drain.add(self)
        live = len(tasks)
        try:
            while live:
                index, item = await queue.get()
                if item is _END:
                    raise ShuttingDown()
                if isinstance(item, Exception):
                    logger.error('generation failed: %r', item)
                    item = failed_response()
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

    def _finished(self, choice: Choice) -> None:
        metrics = self.server.metrics
        metrics.requests_running.dec()
        metrics.observe_choice(self.start, choice.first, choice.last, choice.num_tokens, choice.finish_reason)

    def matched_stop(self, index: int, stops: list[str]) -> str | int | None:
        """What ended choice ``index`` (the ``matched_stop`` field): the stop token id, or the
        stop string of ``stops`` (the first one completed) that ended it; None when it ended
        otherwise (length, a grammar, a call) or is still running."""
        choice = self.choices[index]
        if choice.finish_reason != 'stop':
            return None
        if choice.stop_token_id is not None:
            return choice.stop_token_id
        if not stops:
            return None
        # the text ends just before the stop string; the tokens go on to the one that completed it
        full = self.server.pipe.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        tail = full[len(choice.text):] if full.startswith(choice.text) else ''
        return min((w for w in stops if w and tail.startswith(w)), key=len, default=None)

    def kv_transfer_params(self) -> dict:
        """``{'kv_transfer_params': {...}}`` for a prefill server's response (every choice handed
        off): the Store keys of the hand-offs, which a PD router forwards to the decode server with
        the request (docs/en/advance/pd_disaggregation.md); ``{}`` otherwise."""
        if not self.choices or any(c.finish_reason != 'handoff' for c in self.choices):
            return {}
        return {'kv_transfer_params': {'handoff_ids': [c.handoff_id for c in self.choices]}}

    def usage(self) -> dict:
        """Usage over all choices; each prompt's tokens (and cached tokens) count once."""
        heads = self.choices[::self.n]
        prompt = sum(c.prompt_len for c in heads)
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={'cached_tokens': sum(c.cached_tokens for c in heads)}).model_dump()

    async def sse_deltas(self, events: Callable[[int, EngineResponse], Iterable[str]]) -> AsyncIterator[str]:
        """The streaming endpoints' loop over :meth:`deltas`: ``events(index, delta)`` gives each
        delta's SSE events (any number), yielded as they come. An engine failure, or the shutdown
        deadline, ends the events with one :func:`stream_error` event (the caller then ends its
        stream as usual); the deltas are closed however the loop ends."""
        try:
            async with aclosing(self.deltas()) as stream:
                async for i, r in stream:
                    if r.finish_reason == 'error':
                        yield stream_error(RuntimeError())
                        return
                    for event in events(i, r):
                        yield event
        except ShuttingDown as err:
            yield stream_error(err)

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
                raise shutting_down()
            task.result()       # re-raise a bug in the merge loop as a 500
        if any(c.finish_reason == 'error' for c in self.choices):
            raise APIError(500, 'the engine failed while generating; see the server log', code='engine_error')


def failed_response() -> EngineResponse:
    return EngineResponse(finish_reason='error')


def shutting_down() -> APIError:
    return APIError(503, 'the server is shutting down; retry on another instance', code='shutting_down',
                    type='server_error')


def sse(body: dict | str) -> str:
    return f'data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n'


def stream_error(err: Exception) -> str:
    if isinstance(err, ShuttingDown):
        return sse(error_body('the server is shutting down; the reply is incomplete', 'server_error',
                               code='shutting_down'))
    return sse(error_body('the engine failed while generating', 'server_error', code='engine_error'))


class SSEResponse(StreamingResponse):
    """A stream whose body generator is always closed when the response ends, however it ends,
    so abandoned choices are aborted now rather than whenever the generator is collected."""
    media_type = 'text/event-stream'

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
