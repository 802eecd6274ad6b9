"""Runs an :class:`Engine` on a background thread and hands results to callers.

Callers on any thread (the pipeline) or on an asyncio loop (the HTTP server) submit requests
and receive :class:`EngineOutput` deltas through a :class:`RequestHandle`. Only the loop
thread touches the engine, so the engine itself needs no locks. An abort is applied before
the next step, so a disconnected client stops costing compute within one step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from ...messages import GenerationConfig
from .engine import Engine
from ..paging.sequence import Sequence

__all__ = ['EngineLoop', 'RequestHandle', 'EngineOutput']

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

    def _push(self, item: EngineOutput) -> None:
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


class EngineLoop:
    """Owns the thread that steps ``engine``.

    Args:
        engine: the engine to drive; no other thread may call it afterwards.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        self._wake = threading.Event()
        self._stop = False
        self._closed = False
        self._close_lock = threading.Lock()     # submit/call against close: nothing queued after the drain
        self.fatal_error: BaseException | None = None   # set when a step failed for good; the loop ended
        self.on_fatal = None    # called with that error on the loop thread (the server shuts down)
        self._thread = threading.Thread(target=self._run, name='lmdeploy-engine', daemon=True)
        self._thread.start()

    def submit(self, token_ids: list[int], gen_config: GenerationConfig | None = None,
               loop: asyncio.AbstractEventLoop | None = None, **kwargs) -> RequestHandle:
        """Queue a request (validated now, in the caller's thread).

        Raises:
            ValueError: the request is invalid (see :meth:`Engine.validate`).
            RuntimeError: the loop was closed, or the engine stopped after a fatal error.
        """
        if self.fatal_error is not None:
            raise RuntimeError(f'the engine has stopped: {self.fatal_error}')
        seq = self.engine.make_sequence(token_ids, gen_config, **kwargs)   # immutable engine state only
        handle = RequestHandle(seq, loop)
        with self._close_lock:
            if self._closed:
                self.engine.release(seq)
                raise RuntimeError('the engine is closed (close() was called); create a new pipeline')
            self._commands.put(('add', handle))
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Abort a request (no-op if it already finished)."""
        self._commands.put(('abort', handle))
        self._wake.set()

    def finish(self, handle: RequestHandle) -> None:
        """End a request as completed with ``'stop'`` (:meth:`Engine.finish_early`: its turn is
        cached and put to the Store as if the engine had stopped it; no-op if it already
        finished). For callers that found a stop string or another end in the text."""
        self._commands.put(('finish', handle))
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
        with self._close_lock:
            if self._closed:
                raise RuntimeError('the engine is closed (close() was called)')
            self._commands.put(('call', task))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError('engine loop did not answer')
        if 'error' in box:
            raise box['error']
        return box['value']

    def _queued_commands(self):
        """Yield ``(kind, arg)`` of every command queued now, removing each (never blocks)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for kind, arg in self._queued_commands():
            if kind == 'add':
                seq = arg.seq
                if seq.gen_config.max_new_tokens == 0:
                    self.engine.release(seq)
                    arg._push(EngineOutput([], 'length', seq.num_prompt_tokens, 0, 0))
                    continue
                self._handles[seq.seq_id] = arg
                self.engine.scheduler.add(seq)
            elif kind in ('abort', 'finish'):
                handle = self._handles.pop(arg.seq.seq_id, None)
                if handle is not None:
                    if kind == 'abort':
                        self.engine.abort(handle.seq)
                    else:
                        self.engine.finish_early(handle.seq)
                    handle._push(self._output(handle.seq, [], handle.seq.finish_reason or kind))
            elif kind == 'call':
                arg(self.engine)

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], reason: str | None, logprobs: list | None = None,
                prompt_logprobs: list | None = None) -> EngineOutput:
        return EngineOutput(tokens, reason, seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_generated,
                            logprobs, prompt_logprobs)

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
                for handle in list(self._handles.values()):
                    self.engine.abort(handle.seq)
                    handle._push(self._output(handle.seq, [], 'error'))
                self._handles.clear()
                if getattr(err, 'fatal', False):    # e.g. a tensor-parallel worker died: stop serving
                    self.fatal_error = err
                    self._fail_queued()
                    if self.on_fatal is not None:
                        self.on_fatal(err)
                    return
                continue
            for out in outputs:
                handle = self._handles.get(out.seq.seq_id)
                if handle is None:
                    continue
                handle._push(self._output(out.seq, out.new_token_ids, out.finish_reason, out.logprobs,
                                          out.prompt_logprobs))
                if out.finish_reason:
                    del self._handles[out.seq.seq_id]

    def _fail_queued(self) -> None:
        """After a fatal error: end every request still in the command queue with 'error'."""
        for kind, arg in self._queued_commands():
            if kind == 'add':
                arg._push(self._output(arg.seq, [], 'error'))
            elif kind == 'call':
                arg(self.engine)

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
            for handle in list(self._handles.values()):
                self.engine.abort(handle.seq)
                handle._push(self._output(handle.seq, [], 'abort'))
            self._handles.clear()
            for kind, arg in self._queued_commands():
                if kind == 'add':
                    arg._push(self._output(arg.seq, [], 'abort'))
                elif kind == 'call':
                    arg(self.engine)
        self.engine.close()
