"""Serving another API's request through the chat-completion path.

``/v1/responses`` and ``/v1/messages`` translate their bodies into chat-completion fields and
run them here: the same :class:`~.protocol.ChatCompletionRequest` validation, the same planning
(template rendering, tool and reasoning parsers, forced call openings, request checks) and the
same generation (:class:`~.api_server._Generation`: cancellation, shutdown, metrics) as
``/v1/chat/completions``, so a feature of the chat path is a feature of both. Only the wire
format of the reply differs, and the callers own it.
"""
from __future__ import annotations

from contextlib import aclosing

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from .api_server import _Generation, _Server
from .chat_output import ChatOutput
from .errors import APIError, api_error_from_validation
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


class ChatRun:
    """One translated request (one choice) on the chat path.

    Args:
        server: the app's request handlers.
        chat: the validated chat request (``n`` must be 1).
    """

    def __init__(self, server: _Server, chat: ChatCompletionRequest):
        self.server, self.chat = server, chat
        self.gen: _Generation | None = None
        self.output: ChatOutput | None = None

    async def start(self) -> None:
        """Render, tokenize and check (worker thread); nothing is generated yet.

        Raises:
            APIError: 400 for a request the chat path refuses.
        """
        self.server._check_model(self.chat.model)
        plan = await run_in_threadpool(self.server._plan_chat, self.chat)
        self.output = plan.outputs[0]
        self.gen = _Generation(self.server, plan.jobs, 1, plan.multimodal, [self.output.first_call_stop()])

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

    def usage(self) -> dict:
        """The chat usage so far (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details``)."""
        return self.gen.usage()
