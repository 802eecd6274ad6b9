"""Request bodies of ``POST /v1/responses`` (the OpenAI Responses API) and their translation into
the chat-completion request the server already serves.

A Responses request is served as one chat completion: ``instructions`` become the system
message, the stored conversation of ``previous_response_id`` follows, then the ``input`` items
as chat messages (:func:`input_messages`), and the generation fields map onto their chat names
(``max_output_tokens`` → ``max_completion_tokens``, ``text.format`` → ``response_format``,
``tools[]`` → ``tools[].function``, ``{"type": "function", "name"}`` → a named ``tool_choice``).
Every check, limit and feature of the chat path (tool parsing, reasoning, forced calls, and what
the chat request will learn to enforce) therefore holds here too; a chat field's error is reported
under the Responses field's name.

Input items::

    "text"                                  → a user message
    {"role", "content"} / {"type": "message"} → a message (input_text / output_text / input_image parts)
    {"type": "reasoning", "content" | "summary"} → reasoning_content of the next assistant message
    {"type": "function_call", "call_id", "name", "arguments"} → a tool call of the assistant message
                                            (``namespace`` + ``name``: the call ``NAMESPACE.NAME``)
    {"type": "function_call_output", "call_id", "output"}     → a tool message

Consecutive assistant items (reasoning, message, function calls) form one assistant message, as
the model produced them in one turn, so the history renders to the generated tokens.

Tools (``tools[]`` by ``type``)::

    function                 → a chat function
    namespace {name, tools}  → its function tools, offered as ``NAMESPACE.NAME`` (OpenAI function
                               names cannot hold a dot, so it names no plain function); a call of
                               one comes back as a function_call item with ``namespace`` and
                               ``name``
    web_search, web_search_preview (and their dated names)
                             → accepted and not offered to the model: a search is a tool OpenAI's
                               servers run, which a model may always decline to call, and this
                               server never calls it (a tool_choice naming it is a 400)
    any other type           → a 400 naming tools[i] and the type (file_search, code_interpreter,
                               image_generation, mcp, computer_use_preview, local_shell, shell,
                               apply_patch, custom ...: hosted tools this server cannot run, or
                               client tools whose call items it does not produce)

Log-probabilities: ``include: ["message.output_text.logprobs"]`` adds the entries of the tokens of
each ``output_text`` (``top_logprobs`` alternatives each, 0-20, default 0); ``top_logprobs``
without that ``include`` returns none, as OpenAI's API does.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from .protocol import MAX_TOKENS, Text, FINITE, FunctionName, StrictModel

__all__ = ['ResponsesRequest', 'input_messages', 'chat_fields', 'split_call_name', 'CHAT_RENAMES', 'PASSTHROUGH',
           'LOGPROBS_INCLUDE']

LOGPROBS_INCLUDE = 'message.output_text.logprobs'
# hosted tools a model may always decline to call: accepted, never offered (see the module doc)
DECLINABLE_TOOLS = ('web_search', 'web_search_preview', 'web_search_preview_2025_03_11', 'web_search_2025_08_26')

# extensions a client may send to any generation endpoint; passed to the chat request when it has
# the field, a 400 naming it while it does not (never silently dropped)
PASSTHROUGH = ('cache_salt', 'min_tokens')
CHAT_RENAMES = {'messages': 'input', 'max_completion_tokens': 'max_output_tokens', 'response_format': 'text.format'}


class _InputText(StrictModel):
    type: Literal['input_text', 'output_text']
    text: Text


class _Refusal(StrictModel):
    type: Literal['refusal']
    refusal: Text


class _InputImage(StrictModel):
    type: Literal['input_image']
    image_url: Text | None = None
    file_id: Text | None = None
    detail: Text | None = None


_Part = Annotated[_InputText | _Refusal | _InputImage, Field(discriminator='type')]


class _Message(StrictModel):
    type: Literal['message'] = 'message'
    role: Literal['user', 'assistant', 'system', 'developer']
    content: Text | list[_Part]


class _CallItem(StrictModel):
    """What a function call and its output item share: the call they belong to, and the fields a
    client echoes back from an earlier response (the item id, the call's namespace, its status)."""
    call_id: Text
    id: Text | None = None
    namespace: Text | None = None
    status: Text | None = None


class _FunctionCall(_CallItem):
    type: Literal['function_call']
    name: Text
    arguments: Text


class _FunctionCallOutput(_CallItem):
    type: Literal['function_call_output']
    output: Text | list[_Part]


class _ReasoningText(StrictModel):
    type: Literal['reasoning_text', 'summary_text']
    text: Text


class _Reasoning(StrictModel):
    type: Literal['reasoning']
    id: Text | None = None
    summary: list[_ReasoningText] = []
    content: list[_ReasoningText] | None = None
    encrypted_content: Text | None = None


InputItem = Annotated[_Message | _FunctionCall | _FunctionCallOutput | _Reasoning, Field(discriminator='type')]


class FunctionTool(StrictModel):
    """``tools[]``: a function (the only tool type served)."""
    type: Literal['function']
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(StrictModel):
    """``tools[]``: function tools grouped under a namespace (called as ``NAMESPACE.NAME``)."""
    type: Literal['namespace']
    name: Text = Field(min_length=1, pattern=r'^[^.]+$')
    description: Text | None = None
    tools: list[FunctionTool]


class OtherTool(StrictModel):
    """``tools[]`` of any other type: kept for :meth:`ResponsesRequest.refused` (a 400 naming it,
    or accepted and not offered for :data:`DECLINABLE_TOOLS`)."""
    model_config = ConfigDict(extra='allow')
    type: Text


def _tool_kind(tool) -> str:
    kind = tool.get('type') if isinstance(tool, dict) else getattr(tool, 'type', None)
    return kind if kind in ('function', 'namespace') else 'other'


Tool = Annotated[Annotated[FunctionTool, Tag('function')] | Annotated[NamespaceTool, Tag('namespace')]
                 | Annotated[OtherTool, Tag('other')], Discriminator(_tool_kind)]


class _NamedFunction(StrictModel):
    type: Literal['function']
    name: Text


class _Format(StrictModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal['text', 'json_object']
    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias='schema')
    strict: bool | None = None


class _SchemaFormat(_Format):
    """``text.format`` of type ``json_schema``: its ``schema`` is required, as in OpenAI's API (a
    400 naming ``text.format.schema`` when missing)."""
    type: Literal['json_schema']
    json_schema: dict[str, Any] = Field(alias='schema')


class _TextConfig(StrictModel):
    format: Annotated[_Format | _SchemaFormat, Field(discriminator='type')] | None = None
    verbosity: Literal['low', 'medium', 'high'] | None = None


class _ReasoningConfig(StrictModel):
    effort: Literal['none', 'minimal', 'low', 'medium', 'high', 'xhigh'] | None = None
    summary: Literal['auto', 'concise', 'detailed'] | None = None
    generate_summary: Literal['auto', 'concise', 'detailed'] | None = None


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``. Fields this server cannot honour (``background``, ``conversation``,
    ``prompt``, tool types other than function / namespace / web_search) are refused rather than
    ignored; see docs/en/api_server.md."""
    model_config = ConfigDict(extra='allow')     # extras: read for PASSTHROUGH, else ignored
    model: Text
    input: Text | list[InputItem] = Field(min_length=1)
    instructions: Text | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal['none', 'auto', 'required'] | _NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2, **FINITE)
    top_p: float | None = Field(None, gt=0, le=1, **FINITE)
    reasoning: _ReasoningConfig | None = None
    text: _TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = None
    truncation: Literal['auto', 'disabled'] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[Text] | None = None
    user: Text | None = None

    @model_validator(mode='before')
    @classmethod
    def _typed_items(cls, data):
        """An input item without ``type`` is a message (the SDKs' ``EasyInputMessage``)."""
        if isinstance(data, dict) and isinstance(data.get('input'), list):
            data = dict(data, input=[dict(i, type='message') if isinstance(i, dict) and 'type' not in i else i
                                     for i in data['input']])
        return data

    def refused(self) -> tuple[str, str] | None:
        """``(field, why)`` of the first field set that this server cannot honour, else None."""
        if self.background:
            return 'background', 'background responses are not supported; omit it or send false'
        if self.conversation is not None:
            return 'conversation', 'conversations are not supported; use previous_response_id'
        if self.prompt is not None:
            return 'prompt', 'stored prompt templates are not supported'
        for i, tool in enumerate(self.tools or []):
            if tool.type not in ('function', 'namespace') + DECLINABLE_TOOLS:
                return f'tools[{i}]', (f'tool type {tool.type!r} is not served: this server runs only "function" '
                                        'tools (also grouped in a "namespace"); "web_search" is accepted and never '
                                        'called')
        if self.tool_choice == 'required' and self.tools and not self.functions():
            return 'tool_choice', ('"required" with only web_search tools: this server never calls web_search; '
                                   'send a function tool or tool_choice "auto"')
        return None

    def functions(self) -> list[tuple[str | None, FunctionTool]]:
        """``(namespace or None, function)`` of every function the model is offered."""
        out = []
        for tool in self.tools or []:
            if tool.type == 'function':
                out.append((None, tool))
            elif tool.type == 'namespace':
                out += [(tool.name, f) for f in tool.tools]
        return out

    def function_schema_fields(self) -> tuple[str, ...]:
        """Where each of :meth:`functions` (in its order) has its parameters schema in this
        request: ``tools[i].parameters``, or ``tools[i].tools[j].parameters`` in a namespace."""
        out = []
        for i, tool in enumerate(self.tools or []):
            if tool.type == 'function':
                out.append(f'tools[{i}].parameters')
            elif tool.type == 'namespace':
                out += [f'tools[{i}].tools[{j}].parameters' for j in range(len(tool.tools))]
        return tuple(out)

    @property
    def logprobs(self) -> bool:
        """The reply's output_text log-probabilities were asked for (``include``)."""
        return LOGPROBS_INCLUDE in (self.include or [])


def _text_of(parts) -> str:
    if isinstance(parts, str):
        return parts
    return ''.join(p.text if p.type != 'refusal' else p.refusal for p in parts if p.type != 'input_image')


def _chat_content(content, where: str):
    """A message's content as chat content: a string, or text / image_url parts."""
    if isinstance(content, str):
        return content
    if not any(p.type == 'input_image' for p in content):
        return _text_of(content)
    parts = []
    for j, p in enumerate(content):
        if p.type == 'input_image':
            if not p.image_url:
                raise ValueError(f'{where}.content[{j}]: an input_image needs "image_url" (file_id is not '
                                 'supported)')
            parts.append({'type': 'image_url', 'image_url': {'url': p.image_url}})
        else:
            parts.append({'type': 'text', 'text': p.text if p.type != 'refusal' else p.refusal})
    return parts


def input_messages(items: str | list, image_parts: dict[tuple[int, int], str] | None = None) -> list[dict]:
    """Chat messages (``ChatMessage`` input dicts) of a request's ``input``.

    Args:
        image_parts: when given, filled with ``(chat message index, chat part index) ->
            input[i].content[j]`` (the ``input_image`` part's own location) for each image part.

    Raises:
        ValueError: an item that has no chat form (message names the item).
    """
    if isinstance(items, str):
        return [{'role': 'user', 'content': items}]
    msgs: list[dict] = []
    reasoning: list[str] = []
    open_turn = False           # the last message is an assistant message of the current model turn

    def assistant() -> dict:
        nonlocal open_turn
        if not open_turn:
            msgs.append({'role': 'assistant', 'content': None})
            open_turn = True
        if reasoning:
            msg = msgs[-1]
            msg['reasoning_content'] = (msg.get('reasoning_content') or '') + ''.join(reasoning)
            reasoning.clear()
        return msgs[-1]

    for i, item in enumerate(items):
        where = f'input[{i}]'
        if item.type == 'reasoning':
            reasoning.append(''.join(p.text for p in (item.content or item.summary)))
        elif item.type == 'function_call':
            msg = assistant()
            name = f'{item.namespace}.{item.name}' if item.namespace else item.name
            msg.setdefault('tool_calls', []).append(
                {'id': item.call_id, 'type': 'function', 'function': {'name': name, 'arguments': item.arguments}})
        elif item.type == 'function_call_output':
            open_turn = False
            msgs.append({'role': 'tool', 'tool_call_id': item.call_id, 'content': _text_of(item.output)})
        elif item.role == 'assistant':
            if open_turn and (msgs[-1].get('content') or msgs[-1].get('tool_calls')):
                open_turn = False       # a second assistant message: its own turn
            msg = assistant()
            msg['content'] = (msg['content'] or '') + _text_of(item.content)
        else:
            open_turn = False
            content = _chat_content(item.content, where)
            if image_parts is not None and isinstance(content, list):
                # an image message's chat parts are its content parts, one for one
                image_parts.update(((len(msgs), j), f'{where}.content[{j}]') for j, p in enumerate(content)
                                   if p['type'] == 'image_url')
            msgs.append({'role': item.role, 'content': content})
    if reasoning:
        assistant()
    return msgs


def chat_fields(req: ResponsesRequest) -> dict:
    """The chat-completion request fields (other than ``model`` and ``messages``) of ``req``.

    Raises:
        ValueError: ``(field, message)`` as its args: a pass-through extension the chat request
            does not have yet.
    """
    out: dict[str, Any] = {'parallel_tool_calls': req.parallel_tool_calls}
    if req.max_output_tokens is not None:
        out['max_completion_tokens'] = req.max_output_tokens
    if req.temperature is not None:
        out['temperature'] = req.temperature
    if req.top_p is not None:
        out['top_p'] = req.top_p
    functions = req.functions()
    if functions:
        out['tools'] = [{'type': 'function', 'function': dict(t.model_dump(exclude_none=True, exclude={'type'}),
                                                                name=f'{ns}.{t.name}' if ns else t.name)}
                        for ns, t in functions]
    if isinstance(req.tool_choice, str):
        if functions or req.tool_choice not in ('auto', 'none') or not req.tools:
            out['tool_choice'] = req.tool_choice    # (only web_search tools: auto / none mean no call)
    elif req.tool_choice is not None:
        out['tool_choice'] = {'type': 'function', 'function': {'name': req.tool_choice.name}}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == 'json_object':
        out['response_format'] = {'type': 'json_object'}
    elif fmt is not None and fmt.type == 'json_schema':
        schema = {'name': fmt.name or 'output', 'schema': fmt.json_schema or {}}
        schema.update({k: v for k, v in (('description', fmt.description), ('strict', fmt.strict)) if v is not None})
        out['response_format'] = {'type': 'json_schema', 'json_schema': schema}
    if req.logprobs:
        out['logprobs'] = True
        out['top_logprobs'] = req.top_logprobs or 0
    if req.reasoning is not None and req.reasoning.effort in ('none', 'minimal'):
        out['chat_template_kwargs'] = {'enable_thinking': False}
    for key in PASSTHROUGH:
        if key in (req.model_extra or {}):
            out[key] = req.model_extra[key]
    return out


def split_call_name(req: ResponsesRequest, name: str) -> tuple[str | None, str]:
    """``(namespace, name)`` of a parsed call's chat name: a namespaced function of ``req``'s tools
    is called ``NAMESPACE.NAME``; any other name has no namespace."""
    ns, dot, rest = name.partition('.')
    if dot and any(n == ns and t.name == rest for n, t in req.functions()):
        return ns, rest
    return None, name
