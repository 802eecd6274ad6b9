"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate their own ranges, so a bad value is a pydantic error that the server turns
into a 400 naming the field. Types are strict (no coercion: ``"3"`` or ``true`` is not an
integer, ``1`` or ``"yes"`` is not a boolean; an integer is accepted where a number is). An
explicit ``null`` means "the default" for every optional field (SDKs and proxies send nulls).
Every numeric field has a finite range (see the ``Field`` bounds and docs/en/api_server.md);
infinities and NaN are refused. Every string must be valid Unicode (a lone UTF-16 surrogate
such as ``"\\ud800"`` is refused). Unknown request fields are ignored (OpenAI clients send
options this engine does not implement, e.g. ``user``, ``metadata``); known options it cannot
honour (``suffix``, any ``best_of`` other than ``n``, ``audio`` and non-text ``modalities``) are
refused.
Extensions beyond OpenAI: ``top_k``, ``ignore_eos``, ``repetition_penalty``,
``chat_template_kwargs``, ``separate_reasoning``, ``min_tokens``, ``cache_salt``, ``prompt_logprobs``
(vLLM's names).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo,
                      WrapValidator, field_validator, model_validator)

__all__ = ['ChatMessage', 'ChatCompletionRequest', 'CompletionRequest', 'StreamOptions', 'Usage', 'Tool',
           'ResponseFormat', 'JSONSchemaFormat', 'NamedToolChoice',
           'ToolCall', 'FunctionCall', 'PromptTokensDetails', 'ModelCard', 'ModelList', 'ErrorBody', 'new_id', 'now',
           'MAX_CHOICES', 'MAX_TOKENS', 'MAX_TOP_LOGPROBS', 'StrictModel', 'FINITE', 'Text', 'FunctionName',
           'CONTENT_REQUIRED_ROLES']

MAX_CHOICES = 128       # n (times prompts for /v1/completions) above this is refused
MAX_TOKENS = (1 << 31) - 1      # max_tokens above this is refused; below it, clamped to the session
MAX_TOP_LOGPROBS = 20


class DecodedInts(list):
    """A list the server's large-body decoder (:mod:`.large_body`) built from a JSON array of
    integers: every item is an int, so validation hands it over without visiting each item (a
    million ids would hold the GIL, and stall the event loop, for 30-100 ms)."""


def _decoded_ints(value, handler):
    return value if type(value) is DecodedInts else handler(value)


TokenIds = Annotated[list[StrictInt], WrapValidator(_decoded_ints)]
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1     # what torch.Generator.manual_seed accepts
# template variables a client may not override through chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset({'messages', 'tools', 'documents', 'add_generation_prompt',
                                       'continue_final_message', 'tokenize', 'return_dict', 'chat_template'})


def new_id(prefix: str) -> str:
    """A unique response id, e.g. ``chatcmpl-<32 hex>``."""
    return f'{prefix}-{uuid.uuid4().hex}'


def now() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


def _valid_unicode(text: str) -> str:
    try:
        text.encode('utf-8')
    except UnicodeEncodeError as err:
        raise ValueError(f'invalid Unicode: lone surrogate {text[err.start]!r} at character {err.start}') from None
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
FINITE = dict(allow_inf_nan=False)     # Field(...) keywords of a float that must be finite


class StrictModel(BaseModel):
    """Request models: strict types, unknown fields ignored, ``null`` = the field's default."""
    model_config = ConfigDict(extra='ignore', strict=True)

    @model_validator(mode='before')
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            nulls = [k for k, v in data.items() if v is None and k in cls.model_fields
                     and not cls.model_fields[k].is_required() and cls.model_fields[k].get_default() is not None]
            if nulls:
                data = {k: v for k, v in data.items() if k not in nulls}
        return data


class TextPart(StrictModel):
    """A text part of a multi-part message content."""
    type: Literal['text']
    text: Text


class ImageURL(StrictModel):
    """``image_url`` of an image part: a ``data:`` URL (base64) or an ``http(s)`` URL."""
    url: Text
    detail: Text | None = None


class ImageURLPart(StrictModel):
    """An image part of a user message (served by models that take images, else a 400)."""
    type: Literal['image_url']
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator='type')]


class FunctionCall(StrictModel):
    """``tool_calls[].function``: the function's name and its arguments as a JSON string
    (required, as in OpenAI's API: ``"{}"`` for a call without arguments)."""
    name: Text
    arguments: Text


class ToolCall(StrictModel):
    """One tool call of an assistant message (in history, or generated)."""
    id: Text | None = None
    type: Literal['function'] = 'function'
    function: FunctionCall


# roles whose messages must have content, as in OpenAI's API (an assistant message may have
# none: a message that only calls tools); other roles go to the chat template as they are
CONTENT_REQUIRED_ROLES = frozenset({'system', 'developer', 'user', 'tool'})


class ChatMessage(StrictModel):
    """One conversation message. ``content`` is a string or a non-empty list of parts; it is
    required (not null, not missing) for ``system``, ``developer``, ``user`` and ``tool``
    messages, as in OpenAI's API, and may be null for an assistant message (one that only calls
    tools) and for roles OpenAI does not define.

    ``developer`` is served as ``system``. Assistant messages may carry ``tool_calls`` (and
    ``reasoning_content``); tool messages ``tool_call_id`` and ``name``. Other roles go to the
    chat template as they are: served when it renders them, a 400 when it refuses them.
    """
    role: Annotated[Text, Field(min_length=1, max_length=64)]
    # validated when missing too, so a user message without content is named like a null one
    content: Text | list[ContentPart] | None = Field(None, validate_default=True)
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    @field_validator('content', mode='after')
    @classmethod
    def _content_of_role(cls, v, info: ValidationInfo):
        role = info.data.get('role')
        if v is None and role in CONTENT_REQUIRED_ROLES:
            what = 'the tool\'s result' if role == 'tool' else 'a string or a list of content parts'
            raise ValueError(f'a {role} message needs "content" ({what}), it is null or missing')
        if isinstance(v, list) and not v and role in CONTENT_REQUIRED_ROLES:
            raise ValueError(f'a {role} message needs at least one content part, got an empty list')
        return v

    @model_validator(mode='after')
    def _tool_message(self):
        if self.role == 'tool':
            if self.tool_call_id is None:
                raise ValueError('a tool message needs "tool_call_id" (the id of the call it answers)')
        elif self.tool_call_id is not None:
            raise ValueError(f'"tool_call_id" belongs to tool messages, not {self.role!r}')
        if self.tool_calls is not None and self.role != 'assistant':
            raise ValueError(f'"tool_calls" belongs to assistant messages, not {self.role!r}')
        return self

    def text(self) -> str | None:
        """The content as one string (text parts joined), or None when null."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return ''.join(p.text for p in self.content if p.type == 'text')

    def has_images(self) -> bool:
        """Whether the content has image parts."""
        return isinstance(self.content, list) and any(p.type == 'image_url' for p in self.content)

    def for_template(self) -> dict:
        """The message as the chat template sees it: ``developer`` as ``system``, text parts
        joined into one string (kept as parts when there are image parts), absent optional fields
        left out, ``content`` always present."""
        out = self.model_dump(exclude_none=True)
        out['role'] = 'system' if self.role == 'developer' else self.role
        out['content'] = [p.model_dump(exclude_none=True) for p in self.content] if self.has_images() \
            else self.text()
        return out


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError('must not be empty')
    return text


# a function's name in ``tools`` (every API): a 400 naming the ``name`` field itself when blank
FunctionName = Annotated[Text, AfterValidator(_not_blank)]


class FunctionDefinition(StrictModel):
    """``tools[].function``: a callable function's name, description and JSON-schema parameters."""
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    """One entry of ``tools``."""
    type: Literal['function'] = 'function'
    function: FunctionDefinition


class _NamedFunction(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this tool."""
    type: Literal['function'] = 'function'
    function: _NamedFunction


class StreamOptions(StrictModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and no choices;
    ``continuous_usage_stats`` (vLLM's name) puts the usage so far on every chunk."""
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(StrictModel):
    """``response_format.json_schema``: the schema the reply must match (``schema``), under a
    ``name``; ``strict`` (default true here) refuses properties the schema does not list unless it
    says otherwise."""
    model_config = ConfigDict(extra='ignore', strict=True, populate_by_name=True)
    name: Text = Field('response', max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias='schema')
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (a JSON document valid against ``json_schema.schema``); both JSON modes are
    enforced by constrained decoding (the engine masks every token that would leave the format)."""
    type: Literal['text', 'json_object', 'json_schema']
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode='after')
    def _schema_given(self):
        if self.type == 'json_schema' and self.json_schema is None:
            raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        return self


def _only_with(flag: str, message: str):
    """A field validator: the field may be set (not None) only when the boolean field ``flag``,
    declared before it, is true; else a ValueError with ``message``."""
    def check(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get(flag, False):
            raise ValueError(message)
        return v
    return check


class _Sampling(StrictModel):
    """Sampling fields shared by both generation endpoints.

    ``temperature`` absent or 0 means greedy decoding (this engine's default; OpenAI's default
    of 1.0 sampling is not applied). ``top_p``/``top_k`` only matter when sampling.
    """
    model: Text
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description='Most tokens to generate; clamped to '
                                   'what the session has left after the prompt.')
    temperature: float | None = Field(None, ge=0, le=100, **FINITE, description='0 or absent: greedy.')
    top_p: float = Field(1.0, gt=0, le=1, **FINITE)
    top_k: int = Field(0, ge=-1, le=1 << 20, description='-1 or 0: no top-k filter.')
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: Text | list[Text] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, ge=0.01, le=100, **FINITE)
    presence_penalty: float = Field(0.0, ge=-2, le=2, **FINITE, description='Subtracted from the logit of '
                                    'every token generated so far in this choice.')
    frequency_penalty: float = Field(0.0, ge=-2, le=2, **FINITE, description='Times the number of times a token '
                                     'was generated so far in this choice, subtracted from its logit.')
    logit_bias: dict[Text, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = Field(
        None, max_length=4096, description='Token id (a decimal string) -> bias added to its logit, -100 to 100.')
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description='EOS and stop tokens are masked until this many '
                            'tokens were generated.')
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024, description='Requests with different '
                                    'salts (or none) never share a cached prefix.')
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description='Log-probabilities of the '
                                        'prompt tokens and this many alternatives (the prompt is recomputed).')

    @field_validator('logit_bias')
    @classmethod
    def _token_id_keys(cls, v):
        if v is not None:
            for key in v:
                if not (key.isascii() and key.isdigit()) or len(key) > 12:
                    raise ValueError(f'keys are token ids as decimal strings, e.g. "50256"; got {key!r}')
        return v

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids (empty when absent)."""
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    _only_when_streaming = field_validator('stream_options')(_only_with('stream', 'only allowed with "stream": true'))

    def stop_words(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        if self.stop is None:
            return []
        words = [self.stop] if isinstance(self.stop, str) else self.stop
        return [w for w in words if w]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``.

    ``tools`` / ``tool_choice`` reach the chat template; ``tool_choice`` ``"required"`` or a
    named function makes the reply one or more tool calls (exactly one with
    ``parallel_tool_calls: false``) whose arguments match the function's parameters (constrained
    decoding). ``top_logprobs`` needs ``logprobs: true``.
    """
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[Tool] | None = None
    tool_choice: Literal['none', 'auto', 'required'] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = Field(True, description='Split <think> reasoning into reasoning_content.')
    # output kinds: only text is generated, so asking for audio is refused rather than answered in text
    modalities: list[Text] | None = None
    audio: dict[str, Any] | None = None

    _needs_logprobs = field_validator('top_logprobs')(_only_with('logprobs', 'needs "logprobs": true'))

    @field_validator('modalities')
    @classmethod
    def _text_only(cls, v):
        if v is not None and set(v) - {'text'}:
            raise ValueError(f'only "text" output is served, got {v}')
        return v

    @field_validator('audio')
    @classmethod
    def _no_audio(cls, v):
        if v is not None:
            raise ValueError('audio output is not supported (this server generates text only)')
        return v

    @field_validator('chat_template_kwargs')
    @classmethod
    def _not_reserved(cls, v):
        bad = _RESERVED_TEMPLATE_KWARGS.intersection(v or {})
        if bad:
            raise ValueError(f'may not set {sorted(bad)}')
        return v

    @field_validator('tools')
    @classmethod
    def _distinct_names(cls, v):
        names = [t.function.name for t in v or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f'function names must be distinct; {twice} appear more than once')
        return v

    @field_validator('tool_choice')
    @classmethod
    def _choice_in_tools(cls, v, info: ValidationInfo):
        names = [t.function.name for t in info.data.get('tools') or []]
        if v is not None and 'tools' in info.data and not names:
            raise ValueError('needs a non-empty "tools" list')      # as OpenAI answers
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f'names {v.function.name!r}, which is not in tools')
        if v == 'required' and not names:
            raise ValueError('"required" needs a non-empty tools list')
        return v

    def max_new(self) -> int | None:
        """The requested output budget (``max_completion_tokens`` over ``max_tokens``)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a string, strings, token ids, or token-id lists.

    ``max_tokens`` defaults to 16 (also when sent as null), as in OpenAI's legacy completions
    API. ``logprobs`` = k returns each token's log-probability and its k most likely
    alternatives. ``echo`` puts the prompt's text before each choice's text; with ``logprobs``
    also the prompt tokens' log-probabilities (the first token's is null), as OpenAI's legacy API.
    """
    # tried in this order (a token-id list first): pydantic's default 'smart' union validated a
    # million token ids against list[Text] too, 0.8 s holding the GIL and stalling the server
    prompt: Text | TokenIds | list[Text] | list[TokenIds] = Field(union_mode='left_to_right')
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(False, description='Return the prompt text before each completion.')
    suffix: Text | None = Field(None, description='Refused unless empty: no insertion (fill-in-the-middle) mode.')
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description='Accepted when equal to n.')

    @field_validator('prompt')
    @classmethod
    def _not_empty(cls, v):
        # (not over a decoded token-id array: its items are ints, and visiting a million of them
        # here, on the event loop, stalled it ~80 ms per request)
        if v == [] or isinstance(v, list) and type(v) is not DecodedInts and any(p == [] for p in v):
            raise ValueError('must not be empty: give a string, strings, or token-id lists of at least 1 token')
        return v

    @field_validator('suffix')
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError('not supported (no insertion / fill-in-the-middle mode)')
        return v

    @field_validator('best_of')
    @classmethod
    def _best_of_is_n(cls, v, info: ValidationInfo):
        n = info.data.get('n', 1)
        if v is not None and v != n:
            raise ValueError(f'best_of ({v}) other than n ({n}) is not supported: every generated choice is returned')
        return v

    def prompts(self) -> list:
        """The prompt as a list of single prompts (a string or a token-id list each)."""
        p = self.prompt
        if isinstance(p, (str, DecodedInts)):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: prompt tokens served from the prefix cache / Store."""
    cached_tokens: int = 0


class Usage(BaseModel):
    """Token accounting of one response. Prompt tokens count each prompt once, whatever ``n``."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""
    id: str
    object: Literal['model'] = 'model'
    created: int = Field(default_factory=now)
    owned_by: str = 'lmdeploy'
    root: str | None = Field(None, description='The model the served one is (the model directory\'s name).')
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""
    object: Literal['list'] = 'list'
    data: list[ModelCard]


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """The body of every error response (documented in ``/openapi.json``)."""
    error: _ErrorDetail
