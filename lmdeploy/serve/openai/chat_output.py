"""From generated text and tokens to OpenAI response fields: reasoning / content / tool-call
splitting of chat replies, and ``logprobs`` objects.

:class:`ChatOutput` owns one chat choice's parsers. The streamed deltas it produces and the
message it builds for a non-streaming response follow the same rules (see
:mod:`.tool_parser` and :mod:`.reasoning_parser`): reasoning first, then the content is split
into text and tool calls. A reply with at least one call finishes with ``"tool_calls"``.
"""
from __future__ import annotations

from .reasoning_parser import ThinkReasoningParser
from .tool_parser import ToolParser

__all__ = ['ChatOutput', 'TokenTexts', 'chat_logprobs', 'completion_logprobs']


class ChatOutput:
    """Post-processing of one chat choice.

    Args:
        reasoning: the reasoning parser, or None to keep ``<think>`` text in the content.
        thinking_started: the prompt ended inside an open reasoning block.
        tools: the tool-call parser, or None when the request has no tools (or ``tool_choice``
            is ``"none"``).
        prefix: text the server wrote after the generation prompt (a forced call's opening);
            it is parsed as the start of the reply but never sent as content.
        parallel_tool_calls: False keeps only the first call.
    """

    def __init__(self, reasoning: ThinkReasoningParser | None, thinking_started: bool, tools: ToolParser | None,
                 prefix: str = '', parallel_tool_calls: bool = True):
        self.reasoning, self.started = reasoning, thinking_started
        self.tools, self.prefix, self.parallel = tools, prefix, parallel_tool_calls
        self._rs = reasoning.stream(thinking_started) if reasoning else None
        self._ts = tools.stream() if tools else None
        self._fed_prefix = False
        self.has_calls = False

    # streaming --------------------------------------------------------------------------
    def _split(self, reasoning: str, content: str, frags: list[dict]) -> dict:
        delta = {}
        if reasoning:
            delta['reasoning_content'] = reasoning
        if content:
            delta['content'] = content
        if not self.parallel:
            frags = [f for f in frags if f['index'] == 0]
        if frags:
            self.has_calls = True
            delta['tool_calls'] = frags
        return delta

    def feed(self, text: str) -> dict:
        """The next generated text in; the chunk's ``delta`` fields out (may be empty)."""
        if not self._fed_prefix:
            text, self._fed_prefix = self.prefix + text, True
        reasoning, content = self._rs.feed(text) if self._rs else ('', text)
        frags = []
        if self._ts is not None:
            content, frags = self._ts.feed(content)
        return self._split(reasoning, content, frags)

    def finish(self) -> dict:
        """End of the reply: the last ``delta`` fields (what was held back)."""
        reasoning, content = self._rs.finish() if self._rs else ('', '')
        frags = []
        if self._ts is not None:
            c1, f1 = self._ts.feed(content)
            c2, f2 = self._ts.finish()
            content, frags = c1 + c2, f1 + f2
        return self._split(reasoning, content, frags)

    # whole reply ------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """``choices[i].message`` of a non-streaming response for the whole reply ``text``."""
        text = self.prefix + text
        reasoning, content = self.reasoning.parse(text, self.started) if self.reasoning else (None, text)
        msg = {'role': 'assistant', 'content': content}
        if self.reasoning:
            msg['reasoning_content'] = reasoning
        if self.tools is not None:
            parsed = self.tools.parse(content or '')
            calls = parsed.calls[:1] if not self.parallel else parsed.calls
            if calls:
                self.has_calls = True
                msg['content'] = parsed.content
                msg['tool_calls'] = [c.to_openai() for c in calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``"tool_calls"`` when the reply made a call and ended normally, else the engine's."""
        if self.has_calls and engine_reason in ('stop', 'length'):
            return 'tool_calls'
        return engine_reason


class TokenTexts:
    """Token id → its text (decoded alone, special tokens kept), memoised per server."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    text = texts(token_id)
    return {'token': text, 'logprob': logprob, 'bytes': list(text.encode('utf-8'))}


def chat_logprobs(texts: TokenTexts, logprobs: list, top: int) -> dict:
    """Chat ``choices[i].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.

    Args:
        texts: token-text lookup.
        logprobs: :class:`~lmdeploy.pytorch.engine.sampler.TokenLogprob` per generated token.
        top: alternatives per token (``top_logprobs``; 0 = none).
    """
    return {'content': [dict(_entry(texts, lp.token_id, lp.logprob),
                             top_logprobs=[_entry(texts, t, v) for t, v in lp.top[:top]]) for lp in logprobs]}


def completion_logprobs(texts: TokenTexts, logprobs: list, top: int, offset: int = 0) -> dict:
    """Completions ``choices[i].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (``{token text: logprob}`` per token) and ``text_offset`` (characters, from ``offset``)."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(offset)
        tokens.append(texts(lp.token_id))
        offset += len(tokens[-1])
    return {'tokens': tokens, 'token_logprobs': [lp.logprob for lp in logprobs],
            'top_logprobs': [{texts(t): v for t, v in lp.top[:top]} for lp in logprobs], 'text_offset': offsets}
