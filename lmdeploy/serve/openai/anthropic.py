"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the Anthropic Messages API).

A request is translated into a chat completion and served through the chat path
(:mod:`.chat_bridge`)::

    system (string or text blocks)        → the system message (blocks joined by newlines)
    user: text / image blocks             → a user message (image: base64 or url source)
    user: tool_result blocks              → tool messages (before the user's other blocks)
    assistant: thinking / text / tool_use → one assistant message: reasoning_content, content,
                                            tool_calls (input as JSON arguments)
    system (inside messages): text blocks → a user message holding the text (Claude Code sends
                                            one after the first user turn; chat templates take a
                                            system message only first, and a user turn keeps
                                            the earlier prefix, so the cache, as it was)
    tools[] {name, description, input_schema} → functions
    tool_choice auto / any / tool / none  → "auto" / "required" / the named function / "none";
                                            disable_parallel_tool_use → parallel_tool_calls false
    thinking {"type": "disabled"}         → the template's enable_thinking=false
    output_config.format {"type": "json_schema", "schema"} (or the older top-level
    output_format)                        → response_format json_schema: the reply's text is
                                            JSON valid against the schema (constrained decoding)
    stop_sequences, max_tokens, temperature, top_p, top_k → their chat fields

The reply's content blocks are, in order: ``thinking`` (the ``<think>`` text; ``signature`` is
empty), ``text``, then one ``tool_use`` per call. ``stop_reason``: ``tool_use`` after calls,
``max_tokens`` when the budget ran out, ``stop_sequence`` when one of ``stop_sequences`` ended
the reply (``stop_sequence`` then holds it; the text ends before it, as Anthropic's does), else
``end_turn``. Usage follows Anthropic's accounting:
``input_tokens`` are the prompt tokens *not* read from the prefix cache, which are
``cache_read_input_tokens``; ``cache_creation_input_tokens`` is 0.

Streaming sends ``message_start`` (with the input usage, once the engine admitted the request),
per block ``content_block_start``, ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta`` — tool arguments as they are parsed), ``content_block_stop``, then
``message_delta`` (stop reason, output usage) and ``message_stop``; a failure mid-stream is an
``error`` event. Errors have Anthropic's shape (see :mod:`.errors`); the key may be sent as
``x-api-key``.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from starlette.concurrency import run_in_threadpool

from .chat_bridge import ChatRun, EngineFailed, ShuttingDown, chat_request
from .errors import APIError
from .handlers import MessageNames
from .generation import SSEResponse
from .protocol import MAX_TOKENS, ChatCompletionRequest, Text, FINITE, FunctionName, StrictModel

__all__ = ['MessagesAPI', 'MessagesRequest', 'CountTokensRequest', 'to_chat']

_RENAMES = {'max_completion_tokens': 'max_tokens', 'stop': 'stop_sequences', 'response_format': 'output_config.format'}
_PASSTHROUGH = ('cache_salt',)


class _Text(StrictModel):
    type: Literal['text']
    text: Text


class _ImageSource(StrictModel):
    type: Literal['base64', 'url']
    media_type: Text | None = None
    data: Text | None = None
    url: Text | None = None


class _Image(StrictModel):
    type: Literal['image']
    source: _ImageSource


class _ToolUse(StrictModel):
    type: Literal['tool_use']
    id: Text
    name: Text
    input: dict[str, Any]


class _ToolResult(StrictModel):
    type: Literal['tool_result']
    tool_use_id: Text
    content: Text | list[Annotated[_Text | _Image, Field(discriminator='type')]] = ''
    is_error: bool = False


class _Thinking(StrictModel):
    type: Literal['thinking']
    thinking: Text
    signature: Text | None = None


class _RedactedThinking(StrictModel):
    type: Literal['redacted_thinking']
    data: Text


_Block = Annotated[_Text | _Image | _ToolUse | _ToolResult | _Thinking | _RedactedThinking,
                   Field(discriminator='type')]


class _Message(StrictModel):
    role: Literal['user', 'assistant', 'system']
    content: Text | list[_Block]

    @field_validator('content')
    @classmethod
    def _blocks(cls, v, info: ValidationInfo):
        # an empty block list would leave no chat message at all (the turn silently dropped);
        # Anthropic's API refuses it too (only a final assistant message may be empty)
        if isinstance(v, list) and not v and info.data.get('role') in ('user', 'system'):
            raise ValueError(f'a {info.data["role"]} message needs at least one content block, got an empty list')
        return v


class _Tool(StrictModel):
    type: Literal['custom'] | None = None
    name: FunctionName
    description: Text | None = None
    input_schema: dict[str, Any]


class _ToolChoice(StrictModel):
    type: Literal['auto', 'any', 'tool', 'none']
    name: Text | None = None
    disable_parallel_tool_use: bool = False


class _ThinkingConfig(StrictModel):
    type: Literal['enabled', 'disabled', 'adaptive']
    budget_tokens: int | None = Field(None, ge=0)


class _OutputFormat(StrictModel):
    """``output_config.format``: structured output, a JSON document valid against ``schema``."""
    model_config = ConfigDict(extra='ignore', strict=True, populate_by_name=True)
    type: Literal['json_schema']
    schema_: dict[str, Any] = Field(alias='schema')


class _OutputConfig(StrictModel):
    """``output_config``: ``format`` is enforced; other members (``effort``) are ignored."""
    format: _OutputFormat | None = None


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""
    model_config = ConfigDict(extra='allow')     # extras: read for the pass-through fields, else ignored
    model: Text
    messages: list[_Message] = Field(min_length=1)
    system: Text | list[_Text] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _ThinkingConfig | None = None
    output_config: _OutputConfig | None = None
    output_format: _OutputFormat | None = None      # the structured-outputs beta's name of output_config.format


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1, **FINITE)
    top_p: float | None = Field(None, gt=0, le=1, **FINITE)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    metadata: dict[str, Any] | None = None


def _image_url(block: _Image, where: str) -> str:
    src = block.source
    if src.type == 'url' and src.url:
        return src.url
    if src.type == 'base64' and src.data and src.media_type:
        return f'data:{src.media_type};base64,{src.data}'
    raise ValueError(f'{where}.source: a base64 source needs media_type and data, a url source needs url')


def _result_text(block: _ToolResult, where: str) -> str:
    if isinstance(block.content, str):
        return block.content
    if any(b.type == 'image' for b in block.content):
        raise ValueError(f'{where}.content: images in a tool_result are not supported')
    return ''.join(b.text for b in block.content)


def to_chat(req: CountTokensRequest, image_parts: dict[tuple[int, int], str] | None = None) -> dict:
    """The chat-completion fields of a Messages request.

    Args:
        image_parts: when given, filled with ``(chat message index, chat part index) ->
            messages[i].content[j]`` (the image block's own location) for each image block.

    Raises:
        ValueError: content this server cannot render (the message names the block).
    """
    msgs: list[dict] = []
    if req.system:
        text = req.system if isinstance(req.system, str) else '\n'.join(b.text for b in req.system)
        msgs.append({'role': 'system', 'content': text})
    for i, m in enumerate(req.messages):
        blocks = [_Text(type='text', text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == 'system':
            if any(b.type != 'text' for b in blocks):
                raise ValueError(f'messages[{i}].content: a system message holds text blocks only')
            msgs.append({'role': 'user', 'content': ''.join(b.text for b in blocks)})
            continue
        if m.role == 'assistant':
            msg: dict = {'role': 'assistant', 'content': None}
            for j, b in enumerate(blocks):
                if b.type == 'thinking':
                    msg['reasoning_content'] = (msg.get('reasoning_content') or '') + b.thinking
                elif b.type == 'text':
                    msg['content'] = (msg['content'] or '') + b.text
                elif b.type == 'tool_use':
                    msg.setdefault('tool_calls', []).append({'id': b.id, 'type': 'function', 'function': {
                        'name': b.name, 'arguments': json.dumps(b.input, ensure_ascii=False)}})
                elif b.type != 'redacted_thinking':
                    raise ValueError(f'messages[{i}].content[{j}]: a {b.type} block belongs to a user message')
            msgs.append(msg)
            continue
        parts: list[dict] = []
        wheres: list[str | None] = []      # each part's block, for image errors
        for j, b in enumerate(blocks):
            where = f'messages[{i}].content[{j}]'
            if b.type == 'tool_result':
                text = _result_text(b, where)
                msgs.append({'role': 'tool', 'tool_call_id': b.tool_use_id, 'content': text})
            elif b.type == 'text':
                parts.append({'type': 'text', 'text': b.text})
                wheres.append(None)
            elif b.type == 'image':
                parts.append({'type': 'image_url', 'image_url': {'url': _image_url(b, where)}})
                wheres.append(where)
            else:
                raise ValueError(f'{where}: a {b.type} block belongs to an assistant message')
        if parts:
            images = any(p['type'] == 'image_url' for p in parts)
            if images and image_parts is not None:
                image_parts.update(((len(msgs), k), w) for k, w in enumerate(wheres) if w is not None)
            msgs.append({'role': 'user', 'content': parts if images else ''.join(p['text'] for p in parts)})
    out: dict[str, Any] = {'model': req.model, 'messages': msgs}
    if req.tools:
        out['tools'] = [{'type': 'function', 'function': {k: v for k, v in (
            ('name', t.name), ('description', t.description), ('parameters', t.input_schema)) if v is not None}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == 'tool':
            if not choice.name:
                raise ValueError('tool_choice: type "tool" needs "name"')
            out['tool_choice'] = {'type': 'function', 'function': {'name': choice.name}}
        else:
            out['tool_choice'] = {'auto': 'auto', 'any': 'required', 'none': 'none'}[choice.type]
        if choice.disable_parallel_tool_use:
            out['parallel_tool_calls'] = False
    fmt = (req.output_config.format if req.output_config else None) or req.output_format
    if fmt is not None:
        out['response_format'] = {'type': 'json_schema', 'json_schema': {'name': 'output', 'schema': fmt.schema_,
                                                                         'strict': True}}
    if req.thinking is not None and req.thinking.type == 'disabled':
        out['chat_template_kwargs'] = {'enable_thinking': False}
    if isinstance(req, MessagesRequest):
        out['max_completion_tokens'] = req.max_tokens
        for key in ('temperature', 'top_p', 'top_k'):
            if getattr(req, key) is not None:
                out[key] = getattr(req, key)
        if req.stop_sequences:
            out['stop'] = req.stop_sequences
    for key in _PASSTHROUGH:
        if key in (req.model_extra or {}):
            out[key] = req.model_extra[key]
    return out


def _usage(chat: dict, output: bool = True) -> dict:
    cached = (chat.get('prompt_tokens_details') or {}).get('cached_tokens', 0)
    usage = {'input_tokens': chat['prompt_tokens'] - cached, 'cache_read_input_tokens': cached,
             'cache_creation_input_tokens': 0}
    if output:
        usage['output_tokens'] = chat['completion_tokens']
    return usage


def _stop(reason: str | None, sequence: str | None) -> dict:
    """``stop_reason`` and ``stop_sequence`` of a reply with chat finish ``reason`` that the stop
    string ``sequence`` (or None) ended; calls win over a stop string (the client must run them)."""
    if reason == 'stop' and sequence is not None:
        return {'stop_reason': 'stop_sequence', 'stop_sequence': sequence}
    return {'stop_reason': {'tool_calls': 'tool_use', 'length': 'max_tokens'}.get(reason, 'end_turn'),
            'stop_sequence': None}


def _sse(type: str, body: dict) -> str:
    return f'event: {type}\ndata: {json.dumps(dict(type=type, **body), ensure_ascii=False)}\n\n'


class MessagesAPI:
    """The Messages endpoints over one server (``api_server.Server``)."""

    def __init__(self, server):
        self.server = server

    def _chat(self, req: CountTokensRequest) -> tuple[ChatCompletionRequest, MessageNames]:
        """The validated chat request of ``req`` and how its errors name the image blocks."""
        image_parts: dict[tuple[int, int], str] = {}
        try:
            fields = to_chat(req, image_parts)
        except ValueError as err:
            raise APIError(400, str(err), code='invalid_value') from err
        schemas = tuple(f'tools[{i}].input_schema' for i in range(len(req.tools or ())))
        return chat_request(fields, _RENAMES, _PASSTHROUGH), MessageNames('messages', 'image blocks', image_parts,
                                                                          schemas)

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        """``{"input_tokens": N}``: the tokens the prompt would take (rendered as a request would be)."""
        chat, names = self._chat(req)
        self.server.check_model(chat.model)
        plan = await run_in_threadpool(self.server.plan_chat, chat, names)
        return {'input_tokens': len(plan.jobs[0].token_ids)}

    async def create(self, req: MessagesRequest, request: Request):
        run = ChatRun(self.server, *self._chat(req))
        try:
            await run.start()
        except APIError as err:     # name the client's field (the chat path names its own)
            if err.param == 'response_format':
                err.param, err.message = 'output_config.format', err.message.replace(
                    'response_format', 'output_config.format', 1)
            raise
        mid = f'msg_{uuid.uuid4().hex}'
        if req.stream:
            return SSEResponse(self._events(run, mid))
        msg, reason, usage = await run.collect(request)
        content = []
        if msg.get('reasoning_content'):
            content.append({'type': 'thinking', 'thinking': msg['reasoning_content'], 'signature': ''})
        if msg.get('content'):
            content.append({'type': 'text', 'text': msg['content']})
        for call in msg.get('tool_calls') or []:
            args = json.loads(call['function']['arguments'])
            # tool_use.input must be an object; a model that wrote another JSON value as its
            # arguments string gets it wrapped rather than an invalid block
            content.append({'type': 'tool_use', 'id': call['id'], 'name': call['function']['name'],
                            'input': args if isinstance(args, dict) else {'arguments': args}})
        return {'id': mid, 'type': 'message', 'role': 'assistant', 'model': self.server.model_name,
                'content': content, **_stop(reason, run.stop_sequence()), 'usage': _usage(usage)}

    async def _events(self, run: ChatRun, mid: str):
        blocks: list[str] = []          # block kinds in index order; the last one is open
        calls: dict[int, int] = {}      # tool-call index -> block index
        started, reason = False, None

        def start() -> str:
            head = {'id': mid, 'type': 'message', 'role': 'assistant', 'model': self.server.model_name,
                    'content': [], 'stop_reason': None, 'stop_sequence': None,
                    'usage': dict(_usage(run.usage(), output=False), output_tokens=0)}
            return _sse('message_start', {'message': head})

        def open_block(kind: str, block: dict):
            if blocks:
                yield _sse('content_block_stop', {'index': len(blocks) - 1})
            blocks.append(kind)
            yield _sse('content_block_start', {'index': len(blocks) - 1, 'content_block': block})

        try:
            async for delta, finish in run.deltas():
                if not started:
                    started = True
                    yield start()
                if delta.get('reasoning_content'):
                    if not blocks or blocks[-1] != 'thinking':
                        for line in open_block('thinking', {'type': 'thinking', 'thinking': '', 'signature': ''}):
                            yield line
                    yield _sse('content_block_delta', {'index': len(blocks) - 1, 'delta': {
                        'type': 'thinking_delta', 'thinking': delta['reasoning_content']}})
                if delta.get('content'):
                    if not blocks or blocks[-1] != 'text':
                        for line in open_block('text', {'type': 'text', 'text': ''}):
                            yield line
                    yield _sse('content_block_delta', {'index': len(blocks) - 1, 'delta': {
                        'type': 'text_delta', 'text': delta['content']}})
                for frag in delta.get('tool_calls') or []:
                    fn = frag.get('function') or {}
                    if frag['index'] not in calls:
                        for line in open_block('tool_use', {'type': 'tool_use', 'id': frag.get('id'),
                                                            'name': fn.get('name', ''), 'input': {}}):
                            yield line
                        calls[frag['index']] = len(blocks) - 1
                    if fn.get('arguments'):
                        yield _sse('content_block_delta', {'index': calls[frag['index']], 'delta': {
                            'type': 'input_json_delta', 'partial_json': fn['arguments']}})
                reason = finish or reason
        except (ShuttingDown, EngineFailed) as err:
            kind, message = ('overloaded_error', 'the server is shutting down; the reply is incomplete') \
                if isinstance(err, ShuttingDown) else ('api_error', 'the engine failed while generating')
            yield _sse('error', {'error': {'type': kind, 'message': message}})
            return
        if not started:
            yield start()
        if blocks:
            yield _sse('content_block_stop', {'index': len(blocks) - 1})
        usage = run.usage()
        yield _sse('message_delta', {'delta': _stop(reason, run.stop_sequence()), 'usage': _usage(usage)})
        yield _sse('message_stop', {})
