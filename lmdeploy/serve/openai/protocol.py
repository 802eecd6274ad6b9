"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate their own ranges, so a bad value is a pydantic error that the server turns
into a 400 naming the field. Unknown request fields are ignored (OpenAI clients send many
options this engine does not implement, e.g. ``logprobs``, ``tools``, ``presence_penalty``).
Extensions beyond OpenAI: ``top_k``, ``ignore_eos``, ``repetition_penalty``.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

__all__ = ['ChatMessage', 'ChatCompletionRequest', 'CompletionRequest', 'StreamOptions', 'Usage',
           'PromptTokensDetails', 'ModelCard', 'ModelList', 'new_id', 'now']

MAX_CHOICES = 128       # n (times prompts for /v1/completions) above this is refused
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1     # what torch.Generator.manual_seed accepts


def new_id(prefix: str) -> str:
    """A unique response id, e.g. ``chatcmpl-<32 hex>``."""
    return f'{prefix}-{uuid.uuid4().hex}'


def now() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra='ignore')


class TextPart(BaseModel):
    """One part of a multi-part message content; only ``text`` parts are served."""
    model_config = ConfigDict(extra='ignore')
    type: Literal['text']
    text: StrictStr


class ChatMessage(BaseModel):
    """One conversation message. ``content`` may be a string, text parts, or null."""
    model_config = ConfigDict(extra='ignore')
    role: Literal['system', 'user', 'assistant', 'tool']
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, null as empty)."""
        if self.content is None:
            return ''
        if isinstance(self.content, str):
            return self.content
        return ''.join(p.text for p in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and no choices."""
    model_config = ConfigDict(extra='ignore')
    include_usage: bool = False


class _Sampling(_Request):
    """Sampling fields shared by both generation endpoints.

    ``temperature`` absent or 0 means greedy decoding (this engine's default; OpenAI's default
    of 1.0 sampling is not applied). ``top_p``/``top_k`` only matter when sampling.
    """
    model: StrictStr
    max_tokens: int | None = Field(None, ge=0, description='Most tokens to generate.')
    temperature: float | None = Field(None, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description='-1 or 0: no top-k filter.')
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_words(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        if self.stop is None:
            return []
        words = [self.stop] if isinstance(self.stop, str) else self.stop
        return [w for w in words if w]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a string, strings, token ids, or token-id lists.

    ``max_tokens`` defaults to 16, as in OpenAI's legacy completions API.
    """
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=0)

    def prompts(self) -> list:
        """The prompt as a list of single prompts (a string or a token-id list each)."""
        p = self.prompt
        if isinstance(p, str):
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
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""
    object: Literal['list'] = 'list'
    data: list[ModelCard]
