"""Serving another API's request through the chat-completion path.

``/v1/responses`` and ``/v1/messages`` translate their bodies into chat-completion fields and
run them here: the same :class:`~.protocol.ChatCompletionRequest` validation, the same planning
(template rendering, tool and reasoning parsers, forced call openings, request checks) and the
same generation (:class:`~.generation.Generation`: cancellation, shutdown, metrics) as
``/v1/chat/completions``, so a feature of the chat path is a feature of both. Only the wire
format of the reply differs, and the callers own it.
"""
from __future__ import annotations

from contextlib import aclosing

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from .chat_output import ChatOutput, TextOffsets, chat_logprobs
from .errors import APIError, api_error_from_validation
from .generation import Generation
from .handlers import MessageNames, ServerBase
from .lifecycle import ShuttingDown
from .protocol import ChatCompletionRequest

__all__ = ['chat_request', 'ChatRun', 'EngineFailed', 'ShuttingDown']


class EngineFailed(Exception):
    """The engine failed while generating a streamed reply."""


def chat_request(fields: dict, rename: dict[str, str], passthrough: tuple[str, ...] = ()) -> ChatCompletionRequest:
    """A validated chat request from translated ``fields``.

    Args:
        fields: chat-completion request fields.
        rename: chat field -> the client's field name, for error messages.
        passthrough: extension fields that must reach the chat request: one the chat request
            does not have yet is refused rather than dropped.

    Raises:
        APIError: 400 naming the client's field.
    """
    for key in passthrough:
        if key in fields and key not in ChatCompletionRequest.model_fields:
            raise APIError(400, f'{key}: not supported by this server yet', param=key, code='unsupported_parameter')
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as err:
        raise api_error_from_validation(err.errors(), fields, rename) from None


class _Recorded(Generation):
    """A generation that also keeps each choice's raw text and output token ids (the end-of-
    sequence token excluded), so a caller can tell which stop string ended it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.texts = [''] * len(self.jobs)
        self.token_ids: list[list[int]] = [[] for _ in self.jobs]

    async def deltas(self):
        async with aclosing(super().deltas()) as stream:
            async for index, item in stream:
                self.texts[index] += item.text or ''
                self.token_ids[index] += item.token_ids or []
                yield index, item


class ChatRun:
    """One translated request (one choice) on the chat path.

    Args:
        server: the app's request handlers.
        chat: the validated chat request (``n`` must be 1).
        names: how the client names the messages and image parts in errors (the chat path's
            own names when None).
    """

    def __init__(self, server: ServerBase, chat: ChatCompletionRequest, names: MessageNames | None = None):
        self.server, self.chat, self.names = server, chat, names or MessageNames()
        self.gen: _Recorded | None = None
        self.output: ChatOutput | None = None

    async def start(self) -> None:
        """Render, tokenize and check (worker thread); nothing is generated yet.

        Raises:
            APIError: 400 for a request the chat path refuses.
        """
        self.server.check_model(self.chat.model)
        plan = await run_in_threadpool(self.server.plan_chat, self.chat, self.names)
        self.output = plan.outputs[0]
        self.gen = _Recorded(self.server, plan.jobs, 1, [self.output.first_call_stop()])

    async def collect(self, request: Request) -> tuple[dict, str | None, dict]:
        """Generate the whole reply: ``(chat message, finish reason, chat usage)``.

        Raises:
            APIError: 503 on shutdown, 500 when the engine failed.
        """
        await self.gen.collect(request)
        choice = self.gen.choices[0]
        return self.output.message(choice.text), self.output.finish_reason(choice.finish_reason), self.gen.usage()

    async def deltas(self):
        """Async generator of ``(delta, finish_reason)``: the chat ``delta`` fields of each engine
        step (``reasoning_content``, ``content``, ``tool_calls`` fragments; may be empty) and, on
        the last, the chat finish reason.

        Raises:
            ShuttingDown: the shutdown deadline ended the reply.
            EngineFailed: the engine failed.
        """
        out = self.output
        async with aclosing(self.gen.deltas()) as stream:
            async for _, r in stream:
                if r.finish_reason == 'error':
                    raise EngineFailed()
                delta = out.feed(r.text) if r.text else {}
                reason = None
                if r.finish_reason:
                    delta = ChatOutput.merge_deltas(delta, out.finish())
                    reason = out.finish_reason(r.finish_reason)
                yield delta, reason

    def content_logprobs(self, content: str | None) -> list[dict]:
        """Chat ``logprobs.content`` entries of the reply's tokens (so far) that make up its
        message ``content`` (not its reasoning or calls): the tokens whose text overlaps where
        ``content`` lies in the generated text (after the reasoning's ``</think>``), so a token
        that also holds a bit of the markup around it is included. As the content grows, the
        list only grows (a streamed reply's entries so far are a prefix of the final ones).
        Empty without content or when logprobs were not asked for."""
        choice = self.gen.choices[0]
        if not content or not self.chat.logprobs:
            return []
        raw = self.gen.texts[0]
        think = raw.find('</think>')
        pos = raw.find(content, think + len('</think>') if think >= 0 else 0)
        if pos < 0:
            pos = raw.find(content)
        offsets, picked = TextOffsets(self.server.texts), []
        for lp in choice.logprobs:
            start = offsets.next(lp.token_id)
            if pos < 0 or (start < pos + len(content) and offsets.chars > pos):
                picked.append(lp)
        return chat_logprobs(self.server.texts, picked, self.chat.top_logprobs or 0)['content']

    def stop_sequence(self) -> str | None:
        """The stop string (of the request's ``stop``) that ended the finished reply, else None
        (it ended on end-of-sequence, its budget, a call, or was cut by ``parallel_tool_calls``).

        The text the client saw ends just before the stop string; the generated tokens go on
        to the token that completed it, so the decoded output continues with the stop string
        (the shortest of those it starts with: the first one completed)."""
        stops = self.chat.stop
        stops = [stops] if isinstance(stops, str) else list(stops or [])
        if not stops or self.gen is None or self.gen.choices[0].finish_reason != 'stop':
            return None
        text = self.gen.texts[0]
        full = self.server.pipe.tokenizer.decode(self.gen.token_ids[0], skip_special_tokens=True)
        if not full.startswith(text):
            return None
        tail = full[len(text):]
        return min((w for w in stops if w and tail.startswith(w)), key=len, default=None)

    def usage(self) -> dict:
        """The chat usage so far (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details``)."""
        return self.gen.usage()
