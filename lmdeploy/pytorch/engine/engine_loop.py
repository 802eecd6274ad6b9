"""Runs an :class:`Engine` on a background thread and hands results to callers.

Callers on any thread (the pipeline) or on an asyncio loop (the HTTP server) submit checked
requests (:class:`~.requests.CheckedRequest`) and receive :class:`EngineOutput` deltas through a
:class:`RequestHandle`. Only the loop thread touches the engine, so the engine itself needs no
locks: callers queue typed commands (:class:`Add`, :class:`Abort`, :class:`Finish`,
:class:`Call`), each of which knows how to run on the loop thread (``apply``) and how to end when
the loop can no longer run it (``drop``). A command is applied before the next step, so a
disconnected client stops costing compute within one step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from .engine import Engine
from .requests import CheckedRequest
from ..paging.sequence import Sequence

__all__ = ['EngineLoop', 'RequestHandle', 'EngineOutput', 'Add', 'Abort', 'Finish', 'Call']

logger = logging.getLogger('lmdeploy')


@dataclass
class EngineOutput:
    """A delta of one request: new tokens, and the finish reason once it ends."""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    cached_tokens: int = 0
    num_generated: int = 0
    logprobs: list | None = None    # one sampler.TokenLogprob per token in token_ids, when requested
    prompt_logprobs: list | None = None   # first delta: one TokenLogprob per prompt token after the first


class RequestHandle:
    """One request's output channel (thread-safe; optionally bound to an asyncio loop)."""

    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop | None = None):
        self.seq = seq
        self._loop = loop
        self._queue: queue.Queue | asyncio.Queue = asyncio.Queue() if loop is not None else queue.Queue()

    def push(self, item: EngineOutput) -> None:
        """Hand ``item`` to the caller (from the loop thread)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:
                # the consumer's event loop is closed, so nobody is left to read; raising
                # here would kill the engine thread and hang every other client
                pass
        else:
            self._queue.put(item)

    def get(self, timeout: float | None = None) -> EngineOutput:
        """Next delta (blocking; for handles without a loop)."""
        return self._queue.get(timeout=timeout)

    async def aget(self) -> EngineOutput:
        """Next delta (for handles bound to the running loop)."""
        return await self._queue.get()


def _output(seq: Sequence, tokens: list[int], reason: str | None, logprobs: list | None = None,
            prompt_logprobs: list | None = None) -> EngineOutput:
    return EngineOutput(tokens, reason, seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_generated,
                        logprobs, prompt_logprobs)


@dataclass(frozen=True)
class Add:
    """Queue ``handle.seq`` in the engine (a request of ``max_new_tokens=0`` ends at once with
    ``'length'``)."""
    handle: RequestHandle

    def apply(self, loop: EngineLoop) -> None:
        seq = self.handle.seq
        if seq.gen_config.max_new_tokens == 0:
            loop.engine.release(seq)
            self.handle.push(EngineOutput([], 'length', seq.num_prompt_tokens, 0, 0))
            return
        loop.handles[seq.seq_id] = self.handle
        loop.engine.add(seq)

    def drop(self, loop: EngineLoop, reason: str) -> None:
        loop.engine.release(self.handle.seq)
        self.handle.push(_output(self.handle.seq, [], reason))


@dataclass(frozen=True)
class _End:
    """End a request now (no-op once it finished): its caller gets its last delta."""
    handle: RequestHandle
    reason = ''         # the finish reason when the engine sets none

    def end(self, engine: Engine, seq: Sequence) -> None:
        raise NotImplementedError

    def apply(self, loop: EngineLoop) -> None:
        handle = loop.handles.pop(self.handle.seq.seq_id, None)
        if handle is not None:
            self.end(loop.engine, handle.seq)
            handle.push(_output(handle.seq, [], handle.seq.finish_reason or self.reason))

    def drop(self, loop: EngineLoop, reason: str) -> None:
        pass


class Abort(_End):
    """Stop a request now and free what it holds (:meth:`Engine.abort`)."""
    reason = 'abort'

    def end(self, engine: Engine, seq: Sequence) -> None:
        engine.abort(seq)


class Finish(_End):
    """End a request as completed with ``'stop'`` (:meth:`Engine.finish_early`)."""
    reason = 'finish'

    def end(self, engine: Engine, seq: Sequence) -> None:
        engine.finish_early(seq)


@dataclass(frozen=True)
class Call:
    """Run ``task(engine)`` on the loop thread; when the loop has ended, on the thread that
    drops it (the engine is then no longer stepped)."""
    task: Callable[[Engine], None]

    def apply(self, loop: EngineLoop) -> None:
        self.task(loop.engine)

    def drop(self, loop: EngineLoop, reason: str) -> None:
        self.task(loop.engine)


class EngineLoop:
    """Owns the thread that steps ``engine``.

    Args:
        engine: the engine to drive; no other thread may call it afterwards.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self.handles: dict[int, RequestHandle] = {}     # queued requests by seq_id (loop thread only)
        self._wake = threading.Event()
        self._stop = False
        self._closed = False
        self._close_lock = threading.Lock()     # submit/call against close: nothing queued after the drain
        self.fatal_error: BaseException | None = None   # set when a step failed for good; the loop ended
        self.on_fatal = None    # called with that error on the loop thread (the server shuts down)
        self._thread = threading.Thread(target=self._run, name='lmdeploy-engine', daemon=True)
        self._thread.start()

    def submit(self, request: CheckedRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a checked request (:meth:`~.requests.RequestFactory.check`); its sequence is
        made now, in the caller's thread (nothing is checked again).

        Raises:
            RuntimeError: the loop was closed, or the engine stopped after a fatal error.
        """
        if self.fatal_error is not None:
            raise RuntimeError(f'the engine has stopped: {self.fatal_error}')
        handle = RequestHandle(self.engine.requests.sequence(request), loop)   # immutable engine state only
        self._queue(Add(handle), 'the engine is closed (close() was called); create a new pipeline')
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Abort a request (no-op if it already finished)."""
        self._commands.put(Abort(handle))
        self._wake.set()

    def finish(self, handle: RequestHandle) -> None:
        """End a request as completed with ``'stop'`` (:meth:`Engine.finish_early`: its turn is
        cached and put to the Store as if the engine had stopped it; no-op if it already
        finished). For callers that found a stop string or another end in the text."""
        self._commands.put(Finish(handle))
        self._wake.set()

    def _queue(self, command: Add | Call, closed: str) -> None:
        """Queue ``command`` unless the loop was closed (then RuntimeError(``closed``)); nothing is
        queued after close() drained the queue."""
        with self._close_lock:
            if self._closed:
                if isinstance(command, Add):
                    self.engine.release(command.handle.seq)
                raise RuntimeError(closed)
            self._commands.put(command)
        self._wake.set()

    def call(self, fn, timeout: float = 60.0):
        """Run ``fn(engine)`` on the loop thread and return its result (e.g. the ledger); after a
        fatal error, on the caller's thread (the loop has ended).

        Raises:
            RuntimeError: the loop was closed.
            TimeoutError: the loop did not run it within ``timeout`` seconds.
        """
        if self.fatal_error is not None:
            return fn(self.engine)
        done, box = threading.Event(), {}

        def task(engine):
            try:
                box['value'] = fn(engine)
            except BaseException as err:   # handed back to the caller
                box['error'] = err
            done.set()
        self._queue(Call(task), 'the engine is closed (close() was called)')
        if not done.wait(timeout):
            raise TimeoutError('engine loop did not answer')
        if 'error' in box:
            raise box['error']
        return box['value']

    def _queued_commands(self):
        """Yield every command queued now, removing each (never blocks)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for command in self._queued_commands():
            command.apply(self)

    def _run(self) -> None:
        while not self._stop:
            self._apply_commands()
            if not self.engine.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:   # a bug must not hang every client: fail the requests in flight
                logger.exception('engine step failed; aborting requests in flight')
                for handle in list(self.handles.values()):
                    self.engine.abort(handle.seq)
                    handle.push(_output(handle.seq, [], 'error'))
                self.handles.clear()
                if getattr(err, 'fatal', False):    # e.g. a tensor-parallel worker died: stop serving
                    self.fatal_error = err
                    self._fail_queued()
                    if self.on_fatal is not None:
                        self.on_fatal(err)
                    return
                continue
            for out in outputs:
                handle = self.handles.get(out.seq.seq_id)
                if handle is None:
                    continue
                handle.push(_output(out.seq, out.new_token_ids, out.finish_reason, out.logprobs, out.prompt_logprobs))
                if out.finish_reason:
                    del self.handles[out.seq.seq_id]

    def _fail_queued(self) -> None:
        """After a fatal error: end every request still in the command queue with 'error'."""
        for command in self._queued_commands():
            command.drop(self, 'error')

    def close(self) -> None:
        """Stop the thread and the engine's background workers. Requests in flight or still
        queued end with ``'abort'`` (their callers return); later :meth:`submit` / :meth:`call`
        raise RuntimeError. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():        # the loop thread is gone: the engine is ours now
            for handle in list(self.handles.values()):
                self.engine.abort(handle.seq)
                handle.push(_output(handle.seq, [], 'abort'))
            self.handles.clear()
            for command in self._queued_commands():
                command.drop(self, 'abort')
        self.engine.close()
