"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` (the OpenAI Responses API).

A request is translated into a chat completion (:mod:`.responses_protocol`) and served through
the chat path (:mod:`.chat_bridge`); its reply becomes ``output`` items in order: a
``reasoning`` item (the ``<think>`` text, as ``reasoning_text`` content), a ``message`` item
(``output_text``), then one ``function_call`` item per tool call.

Streaming (``"stream": true``) sends server-sent events named by their ``type``::

    response.created, response.in_progress
    per item:  response.output_item.added
               reasoning: response.content_part.added, response.reasoning_text.delta ...,
                          response.reasoning_text.done, response.content_part.done
               message:   response.content_part.added, response.output_text.delta ...,
                          response.output_text.done, response.content_part.done
               call:      response.function_call_arguments.delta ..., response.function_call_arguments.done
               response.output_item.done
    response.completed (or response.incomplete when max_output_tokens ran out, response.failed)

An item is closed when the next one opens. ``sequence_number`` counts every event from 0.

With ``include: ["message.output_text.logprobs"]`` the ``output_text`` part's ``logprobs`` holds
``{token, logprob, bytes, top_logprobs}`` per token of its text (``top_logprobs`` alternatives
each); streamed, each ``response.output_text.delta`` carries the entries of the tokens its text
added (so the deltas' entries together are the done event's), and entries left when the text is
complete (a token that only ends a character) come in one last delta with empty text before
``response.output_text.done``.

``store`` (default true, as OpenAI's) keeps the response and its conversation in the bounded
:class:`~.response_store.ResponseStore`; ``previous_response_id`` continues it: the stored
conversation (without the earlier ``instructions``, which are not carried over) is followed by
the new ``input``, and renders to the same tokens as before, so the prefix cache covers the
previous reply. With API keys a stored response is its key's: another key's ``GET``, ``DELETE``
and ``previous_response_id`` find nothing (404 / 400), as for an id never stored.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import Request

from .chat_bridge import ChatRun, EngineFailed, ShuttingDown, chat_request
from .errors import APIError, located_error
from .generation import SSEResponse
from .handlers import MessageNames, current_tenant
from .response_store import ResponseStore
from .responses_protocol import CHAT_RENAMES, PASSTHROUGH, ResponsesRequest, chat_fields, input_messages, split_call_name

__all__ = ['ResponsesAPI']


def _id(prefix: str) -> str:
    return f'{prefix}_{uuid.uuid4().hex}'


def _usage(chat: dict) -> dict:
    cached = (chat.get('prompt_tokens_details') or {}).get('cached_tokens', 0)
    return {'input_tokens': chat['prompt_tokens'], 'input_tokens_details': {'cached_tokens': cached},
            'output_tokens': chat['completion_tokens'], 'output_tokens_details': {'reasoning_tokens': 0},
            'total_tokens': chat['total_tokens']}


def _reasoning_item(text: str, status: str = 'completed', rid: str | None = None) -> dict:
    return {'id': rid or _id('rs'), 'type': 'reasoning', 'summary': [],
            'content': [{'type': 'reasoning_text', 'text': text}] if status == 'completed' else [], 'status': status}


def _text_part(text: str, logprobs: list | None = None) -> dict:
    return {'type': 'output_text', 'text': text, 'annotations': [], 'logprobs': logprobs or []}


def _message_item(text: str, status: str = 'completed', mid: str | None = None, logprobs: list | None = None) -> dict:
    return {'id': mid or _id('msg'), 'type': 'message', 'role': 'assistant', 'status': status,
            'content': [_text_part(text, logprobs)] if status != 'in_progress' else []}


def _call_item(call_id: str, name: str, arguments: str, status: str = 'completed', fid: str | None = None,
               namespace: str | None = None) -> dict:
    item = {'id': fid or _id('fc'), 'type': 'function_call', 'call_id': call_id, 'name': name,
            'arguments': arguments, 'status': status}
    if namespace is not None:
        item['namespace'] = namespace
    return item


def _assistant_message(items: list[dict]) -> dict:
    """The chat assistant message of a reply's output items (what the next turn replays)."""
    msg: dict = {'role': 'assistant', 'content': None}
    for item in items:
        if item['type'] == 'reasoning':
            msg['reasoning_content'] = (msg.get('reasoning_content') or '') + item['content'][0]['text']
        elif item['type'] == 'message':
            msg['content'] = (msg['content'] or '') + item['content'][0]['text']
        else:
            name = f"{item['namespace']}.{item['name']}" if item.get('namespace') else item['name']
            msg.setdefault('tool_calls', []).append({'id': item['call_id'], 'type': 'function', 'function': {
                'name': name, 'arguments': item['arguments']}})
    return msg


class _Events:
    """Builds the output items of a streamed reply and the events that announce them."""

    def __init__(self, req: ResponsesRequest, run: ChatRun):
        self.req, self.run = req, run
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None       # the item being streamed
        self.text = ''                      # its text (reasoning / message)
        self.calls: dict[int, dict] = {}    # tool-call index -> its item
        self.sent_logprobs = 0              # entries of the open message item's text sent so far

    def event(self, type: str, **fields) -> str:
        body = {'type': type, 'sequence_number': self.seq, **fields}
        self.seq += 1
        return f'event: {type}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n'

    def _index(self) -> int:
        return len(self.items) - 1

    def close(self, status: str = 'completed'):
        item, self.open = self.open, None
        if item is None:
            return
        i = self._index()
        if item['type'] == 'reasoning':
            part = {'type': 'reasoning_text', 'text': self.text}
            yield self.event('response.reasoning_text.done', item_id=item['id'], output_index=i, content_index=0,
                             text=self.text)
            yield self.event('response.content_part.done', item_id=item['id'], output_index=i, content_index=0,
                             part=part)
            item.update(content=[part], status='completed')
        elif item['type'] == 'message':
            part = _text_part(self.text, self.run.content_logprobs(self.text))
            if len(part['logprobs']) > self.sent_logprobs:
                yield self.event('response.output_text.delta', item_id=item['id'], output_index=i, content_index=0,
                                 delta='', logprobs=part['logprobs'][self.sent_logprobs:])
            yield self.event('response.output_text.done', item_id=item['id'], output_index=i, content_index=0,
                             text=self.text, logprobs=part['logprobs'])
            yield self.event('response.content_part.done', item_id=item['id'], output_index=i, content_index=0,
                             part=part)
            item.update(content=[part], status=status)
        else:
            yield self.event('response.function_call_arguments.done', item_id=item['id'], output_index=i,
                             arguments=item['arguments'], name=item['name'])
            item['status'] = 'completed'
        yield self.event('response.output_item.done', output_index=i, item=item)

    def _open(self, item: dict):
        yield from self.close()
        self.items.append(item)
        self.open, self.text, self.sent_logprobs = item, '', 0
        yield self.event('response.output_item.added', output_index=self._index(), item=dict(item))
        part = {'reasoning': {'type': 'reasoning_text', 'text': ''}, 'message': _text_part('')}.get(item['type'])
        if part is not None:
            yield self.event('response.content_part.added', item_id=item['id'], output_index=self._index(),
                             content_index=0, part=part)

    def delta(self, delta: dict):
        """Events for one chat ``delta``."""
        if delta.get('reasoning_content'):
            if self.open is None or self.open['type'] != 'reasoning':
                yield from self._open(_reasoning_item('', 'in_progress'))
            self.text += delta['reasoning_content']
            yield self.event('response.reasoning_text.delta', item_id=self.open['id'], output_index=self._index(),
                             content_index=0, delta=delta['reasoning_content'])
        if delta.get('content'):
            if self.open is None or self.open['type'] != 'message':
                yield from self._open(_message_item('', 'in_progress'))
            self.text += delta['content']
            entries = self.run.content_logprobs(self.text)[self.sent_logprobs:] if self.req.logprobs else []
            self.sent_logprobs += len(entries)
            yield self.event('response.output_text.delta', item_id=self.open['id'], output_index=self._index(),
                             content_index=0, delta=delta['content'], logprobs=entries)
        for frag in delta.get('tool_calls') or []:
            fn = frag.get('function') or {}
            item = self.calls.get(frag['index'])
            if item is None:
                namespace, name = split_call_name(self.req, fn.get('name', ''))
                item = self.calls[frag['index']] = _call_item(frag.get('id') or _id('call'), name, '', 'in_progress',
                                                              namespace=namespace)
                yield from self._open(item)
            if fn.get('arguments'):
                item['arguments'] += fn['arguments']
                yield self.event('response.function_call_arguments.delta', item_id=item['id'],
                                 output_index=self.items.index(item), delta=fn['arguments'])


class ResponsesAPI:
    """The Responses endpoints over one server.

    Args:
        server: the app's chat request handlers (``api_server.Server``).
        store: where ``store: true`` responses are kept.
    """

    def __init__(self, server, store: ResponseStore):
        self.server, self.store = server, store

    def _body(self, req: ResponsesRequest, rid: str, created: float, output: list[dict], status: str,
              usage: dict | None, incomplete: bool = False) -> dict:
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format \
            else {'type': 'text'}
        choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, 'model_dump') else (req.tool_choice or 'auto')
        return {'id': rid, 'object': 'response', 'created_at': created, 'status': status,
                'completed_at': time.time() if status in ('completed', 'incomplete') else None, 'error': None,
                'incomplete_details': {'reason': 'max_output_tokens'} if incomplete else None,
                'instructions': req.instructions, 'max_output_tokens': req.max_output_tokens,
                'model': self.server.model_name, 'output': output, 'parallel_tool_calls': req.parallel_tool_calls,
                'previous_response_id': req.previous_response_id,
                'reasoning': {'effort': req.reasoning.effort if req.reasoning else None, 'summary': None},
                'store': req.store, 'temperature': req.temperature, 'text': {'format': fmt}, 'tool_choice': choice,
                'tools': [t.model_dump(exclude_none=True) for t in req.tools or []], 'top_p': req.top_p,
                'truncation': req.truncation or 'disabled', 'usage': usage, 'metadata': req.metadata or {}}

    def _conversation(self, req: ResponsesRequest, image_parts: dict | None = None) -> list[dict]:
        """The chat messages before ``instructions``: the stored turns, then this input;
        ``image_parts`` (when given) is filled as :func:`.responses_protocol.input_messages` does,
        with indices into the returned list."""
        history = []
        if req.previous_response_id is not None:
            entry = self.store.get(req.previous_response_id, current_tenant())
            if entry is None:
                raise APIError(400, f'previous_response_id: no stored response {req.previous_response_id!r} (never '
                               'stored, deleted, or evicted from the bounded store)', param='previous_response_id',
                               code='previous_response_not_found')
            history = entry.messages
        try:
            own: dict[tuple[int, int], str] = {}
            conversation = history + input_messages(req.input, own)
        except ValueError as err:
            raise located_error(str(err), 'input') from err
        if image_parts is not None:
            image_parts.update(((i + len(history), j), w) for (i, j), w in own.items())
        return conversation

    async def create(self, req: ResponsesRequest, request: Request):
        refused = req.refused()
        if refused:
            raise APIError(400, f'{refused[0]}: {refused[1]}', param=refused[0], code='unsupported_parameter')
        image_parts: dict[tuple[int, int], str] = {}
        conversation = self._conversation(req, image_parts)
        owner = current_tenant()
        system = [{'role': 'system', 'content': req.instructions}] if req.instructions else []
        chat = chat_request(dict(chat_fields(req), model=req.model, messages=system + conversation), CHAT_RENAMES,
                            PASSTHROUGH)
        names = MessageNames('input', 'input_image parts',
                             {(i + len(system), j): w for (i, j), w in image_parts.items()},
                             req.function_schema_fields())
        run = ChatRun(self.server, chat, names)
        try:
            await run.start()
        except APIError as err:     # name the client's field (the chat path names its own)
            if err.param == 'response_format':
                err.param, err.message = 'text.format', err.message.replace('response_format', 'text.format', 1)
            raise
        rid, created = _id('resp'), time.time()
        if req.stream:
            return SSEResponse(self._events(req, run, rid, created, conversation, owner))
        msg, reason, usage = await run.collect(request)
        incomplete = reason == 'length'
        output = []
        if msg.get('reasoning_content'):
            output.append(_reasoning_item(msg['reasoning_content']))
        if msg.get('content'):
            output.append(_message_item(msg['content'], 'incomplete' if incomplete else 'completed',
                                        logprobs=run.content_logprobs(msg['content'])))
        for call in msg.get('tool_calls') or []:
            namespace, name = split_call_name(req, call['function']['name'])
            output.append(_call_item(call['id'], name, call['function']['arguments'], namespace=namespace))
        body = self._body(req, rid, created, output, 'incomplete' if incomplete else 'completed', _usage(usage),
                          incomplete)
        self._keep(req, body, conversation, output, owner)
        return body

    def _keep(self, req: ResponsesRequest, body: dict, conversation: list[dict], output: list[dict],
              owner: str | None) -> None:
        if req.store:
            self.store.put(body['id'], body, conversation + [_assistant_message(output)], owner)

    async def _events(self, req: ResponsesRequest, run: ChatRun, rid: str, created: float, conversation: list[dict],
                      owner: str | None):
        ev = _Events(req, run)
        head = self._body(req, rid, created, [], 'in_progress', None)
        yield ev.event('response.created', response=head)
        yield ev.event('response.in_progress', response=head)
        reason = None
        try:
            async for delta, finish in run.deltas():
                for line in ev.delta(delta):
                    yield line
                reason = finish or reason
        except (ShuttingDown, EngineFailed) as err:
            message = 'the server is shutting down; the reply is incomplete' if isinstance(err, ShuttingDown) \
                else 'the engine failed while generating'
            for line in ev.close():
                yield line
            failed = self._body(req, rid, created, ev.items, 'failed', _usage(run.usage()))
            failed['error'] = {'code': 'server_error', 'message': message}
            yield ev.event('response.failed', response=failed)
            return
        incomplete = reason == 'length'
        for line in ev.close('incomplete' if incomplete else 'completed'):
            yield line
        body = self._body(req, rid, created, ev.items, 'incomplete' if incomplete else 'completed',
                          _usage(run.usage()), incomplete)
        self._keep(req, body, conversation, ev.items, owner)
        yield ev.event('response.incomplete' if incomplete else 'response.completed', response=body)

    async def get(self, response_id: str) -> dict:
        """``GET /v1/responses/{id}``: the stored response, or 404."""
        entry = self.store.get(response_id, current_tenant())
        if entry is None:
            raise _not_found(response_id)
        return entry.body

    async def delete(self, response_id: str) -> dict:
        """``DELETE /v1/responses/{id}``: forget it, or 404."""
        if not self.store.delete(response_id, current_tenant()):
            raise _not_found(response_id)
        return {'id': response_id, 'object': 'response', 'deleted': True}


def _not_found(rid: str) -> APIError:
    return APIError(404, f'no stored response with id {rid!r} (never stored, deleted, or evicted from the bounded '
                    'store)', param='response_id', code='not_found')

