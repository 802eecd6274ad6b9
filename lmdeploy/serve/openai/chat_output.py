"""From generated text and tokens to OpenAI response fields: reasoning / content / tool-call
splitting of chat replies, and ``logprobs`` objects.

:class:`ChatOutput` owns one chat choice's parsers. The streamed deltas it produces and the
message it builds for a non-streaming response follow the same rules (see
:mod:`.tool_parser` and :mod:`.reasoning_parser`): reasoning first, then the content is split
into text and tool calls. A reply with at least one call finishes with ``"tool_calls"`` (with
``"length"`` when ``max_tokens`` cut it). A call streams as soon as its name is read: its first
fragment carries ``id`` and ``name``, the next ones pieces of ``arguments``.
"""
from __future__ import annotations

import codecs
import re

from .reasoning_parser import ThinkGuard, ThinkReasoningParser
from .tool_call import ToolParser, merge_tool_call_fragments

__all__ = ['ChatOutput', 'TokenTexts', 'TextOffsets', 'StreamedLogprobs', 'chat_logprobs', 'completion_logprobs']


class ChatOutput:
    """Post-processing of one chat choice.

    Args:
        reasoning: the reasoning parser, or None to keep ``<think>`` text in the content.
        thinking_started: the prompt ended inside an open reasoning block.
        tools: the tool-call parser, or None when the request has no tools (or ``tool_choice``
            is ``"none"``).
        prefix: text the server wrote after the generation prompt (a forced call's opening);
            it is parsed as the start of the reply: part of the call when the call completes,
            content otherwise (the same streamed or not).
        parallel_tool_calls: False keeps only the first call.

    With tools but no reasoning parser, a leading ``<think>`` block is still found
    (:class:`~.reasoning_parser.ThinkGuard`) and passed to the content as it is, never to the
    tool-call parser: a call the model drafts while thinking is not a call.
    """

    def __init__(self, reasoning: ThinkReasoningParser | None, thinking_started: bool, tools: ToolParser | None,
                 prefix: str = '', parallel_tool_calls: bool = True):
        self.reasoning, self.started = reasoning, thinking_started
        self.tools, self.prefix, self.parallel = tools, prefix, parallel_tool_calls
        self._rs = reasoning.stream(thinking_started) if reasoning else None
        self._ts = tools.stream() if tools else None
        self._guard = ThinkGuard(thinking_started) if tools and not reasoning else None
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
            delta['tool_calls'] = merge_tool_call_fragments(frags)
        return delta

    @staticmethod
    def merge_deltas(a: dict, b: dict) -> dict:
        """Two ``delta`` dicts of one chunk as one: strings concatenated, tool-call fragments
        merged so that each ``index`` appears once (:func:`merge_tool_call_fragments`)."""
        out = dict(a)
        for key, value in b.items():
            out[key] = out[key] + value if key in out else value
        if 'tool_calls' in out:
            out['tool_calls'] = merge_tool_call_fragments(out['tool_calls'])
        return out

    def feed(self, text: str) -> dict:
        """The next generated text in; the chunk's ``delta`` fields out (may be empty)."""
        if not self._fed_prefix:
            text, self._fed_prefix = self.prefix + text, True
        reasoning, content = self._rs.feed(text) if self._rs else ('', text)
        frags, block = [], ''
        if self._guard is not None:
            block, content = self._guard.feed(content)
        if self._ts is not None:
            content, frags = self._ts.feed(content)
        return self._split(reasoning, block + content, frags)

    def finish(self) -> dict:
        """End of the reply: the last ``delta`` fields (what was held back; and the prefix when
        no text was fed, e.g. a reply that ended at once)."""
        head = {} if self._fed_prefix else self.feed('')
        reasoning, content = self._rs.finish() if self._rs else ('', '')
        frags, block = [], ''
        if self._guard is not None:
            block, content = self._guard.finish()
        if self._ts is not None:
            c1, f1 = self._ts.feed(content)
            c2, f2 = self._ts.finish()
            content, frags = c1 + c2, f1 + f2
        return self.merge_deltas(head, self._split(reasoning, block + content, frags))

    # whole reply ------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """``choices[i].message`` of a non-streaming response for the whole reply ``text``."""
        text = self.prefix + text
        reasoning, content = self.reasoning.parse(text, self.started) if self.reasoning else (None, text)
        msg = {'role': 'assistant', 'content': content}
        if self.reasoning:
            msg['reasoning_content'] = reasoning
        if self.tools is not None:
            block = ''
            if not self.reasoning:
                guard = ThinkGuard(self.started)
                (b1, r1), (b2, r2) = guard.feed(content or ''), guard.finish()
                block, content = b1 + b2, r1 + r2
            parsed = self.tools.parse(content or '')
            calls = parsed.calls[:1] if not self.parallel else parsed.calls
            if calls:
                self.has_calls = True
                msg['content'] = (block + (parsed.content or '')) or None
                msg['tool_calls'] = [c.to_openai() for c in calls]
        return msg

    def first_call_stop(self) -> _FirstCallStop | None:
        """With ``parallel_tool_calls`` false and tools in use: a :class:`_FirstCallStop` that
        tells where the reply should end (just after its first complete call, so the server
        stops generating there); None otherwise."""
        if self.tools is None or self.parallel:
            return None
        return _FirstCallStop(self)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``"tool_calls"`` when the reply made a call and ended normally, else the engine's
        (``"length"`` too: a call cut off by ``max_tokens`` has arguments closed where it
        ended, and the client must know they are incomplete)."""
        if self.has_calls and engine_reason == 'stop':
            return 'tool_calls'
        return engine_reason


class _FirstCallStop:
    """Finds the end of the first complete tool call in a growing reply (content only: a call
    inside the reasoning block does not count, as in :meth:`ChatOutput.message`)."""

    def __init__(self, output: ChatOutput):
        self.out = output
        self.content_from: int | None = None    # offset in prefix + text where the content starts
        self.resume = 0

    def _content_start(self, full: str) -> int | None:
        reasoning = self.out.reasoning or ThinkGuard     # unsplit reasoning is not searched either
        if not self.out.started:
            lead = full.lstrip()
            if not lead.startswith(reasoning.start_tag):
                return None if reasoning.start_tag.startswith(lead) else 0
        end = full.find(reasoning.end_tag)
        return None if end == -1 else end + len(reasoning.end_tag)

    def __call__(self, text: str) -> int | None:
        """The reply so far (without the server's prefix) in; how many of its characters to
        keep out, once it holds a complete call (None before)."""
        full = self.out.prefix + text
        if self.content_from is None:
            self.content_from = self._content_start(full)
            if self.content_from is None:
                return None
            self.resume = self.content_from
        end, self.resume = self.out.tools.first_call_end(full, max(self.resume, self.content_from))
        return None if end is None else end - len(self.out.prefix)


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's byte -> character table, inverted (character -> byte value).

    Byte-level BPE vocabularies spell every byte as one printable character: the bytes that are
    printable Latin-1 characters (``!``..``~``, ``\xa1``..``\xac``, ``\xae``..``\xff``) stand
    for themselves; each of the other 68 bytes (controls, space, DEL, NBSP, soft hyphen) is
    written as the character ``U+0100 + k`` where k counts those bytes in increasing order.
    """
    printable = set(range(0x21, 0x7f)) | set(range(0xa1, 0xad)) | set(range(0xae, 0x100))
    table, k = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(0x100 + k)] = byte
            k += 1
    return table


_BYTE_LEVEL = _byte_level_chars()
_BYTE_TOKEN = re.compile(r'<0x([0-9A-Fa-f]{2})>')


def _decoder_kind(tokenizer) -> str:
    """``'byte_level'`` (GPT-2 / Qwen style byte-level BPE), ``'metaspace'`` (sentencepiece
    style, ``▁`` for a space) or ``''`` (unknown), read from the tokenizer's decoder."""
    if getattr(tokenizer, 'byte_decoder', None):        # transformers' slow GPT-2 tokenizers
        return 'byte_level'
    if getattr(tokenizer, 'sp_model', None) is not None:    # slow sentencepiece tokenizers
        return 'metaspace'
    decoder = getattr(getattr(tokenizer, 'backend_tokenizer', None), 'decoder', None)
    try:
        state = decoder.__getstate__()
    except Exception:       # no Rust backend, or a decoder that cannot be serialised
        return ''
    state = state.decode() if isinstance(state, bytes) else str(state)
    if '"ByteLevel"' in state:
        return 'byte_level'
    if '"Metaspace"' in state or '\u2581' in state:      # Metaspace, or Replace('▁', ' ')
        return 'metaspace'
    return ''


class TokenTexts:
    """Token id → its text (decoded alone, special tokens kept) and its raw UTF-8 bytes,
    memoised per server.

    The text of a token that holds only part of a multi-byte character decodes to ``\ufffd``;
    its bytes are the token's own bytes, so that the bytes of consecutive tokens concatenate to
    the bytes of the text they generate. Bytes come from the vocabulary entry: byte-level BPE
    characters mapped back through the byte table, a byte-fallback token ``<0xNN>``, or a
    sentencepiece piece with ``▁`` read as a space; any other token (added/special tokens,
    unknown vocabularies) gives the UTF-8 bytes of its text.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._kind = _decoder_kind(tokenizer)
        self._added = set(getattr(tokenizer, 'added_tokens_decoder', None) or ())
        self.special = set(getattr(tokenizer, 'all_special_ids', None) or ())   # ids the text skips
        self.metaspace = self._kind == 'metaspace'     # sentencepiece: decoding strips the opening space

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def raw_bytes(self, token_id: int) -> list[int]:
        """The token's raw UTF-8 bytes (``logprobs.content[i].bytes``)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> list[int]:
        if token_id not in self._added:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except Exception:       # an id outside the vocabulary (padded embedding rows)
                piece = None
            if isinstance(piece, str) and piece:
                if self._kind == 'byte_level' and all(c in _BYTE_LEVEL for c in piece):
                    return [_BYTE_LEVEL[c] for c in piece]
                match = _BYTE_TOKEN.fullmatch(piece)
                if match:
                    return [int(match.group(1), 16)]
                if self._kind == 'metaspace':
                    return list(piece.replace('\u2581', ' ').encode('utf-8'))
        return list(self(token_id).encode('utf-8'))


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    return {'token': texts(token_id), 'logprob': logprob, 'bytes': texts.raw_bytes(token_id)}


def chat_logprobs(texts: TokenTexts, logprobs: list, top: int) -> dict:
    """Chat ``choices[i].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.

    Args:
        texts: token-text lookup.
        logprobs: :class:`~lmdeploy.pytorch.sampling.sampler.TokenLogprob` per generated token.
        top: alternatives per token (``top_logprobs``; 0 = none).
    """
    return {'content': [dict(_entry(texts, lp.token_id, lp.logprob),
                             top_logprobs=[_entry(texts, t, v) for t, v in lp.top[:top]]) for lp in logprobs]}


class TextOffsets:
    """Character offsets of generated tokens in the completion text, kept across stream chunks.

    The text is the output decoded as a whole (special tokens skipped), so a token's offset is
    the number of characters of complete characters before it: the bytes of the earlier tokens
    (:meth:`TokenTexts.raw_bytes`) run through one incremental UTF-8 decoder, which holds back a
    character split over tokens until its last byte arrives (the token that completes it starts
    at that character). Special tokens add no characters; with a sentencepiece (``▁``)
    vocabulary the space that opens the output is not counted (decoding strips it).

    Args:
        texts: the server's token lookup.
    """

    def __init__(self, texts: TokenTexts):
        self.texts, self.chars = texts, 0
        self._utf8 = codecs.getincrementaldecoder('utf-8')(errors='replace')
        self._opening = texts.metaspace

    def next(self, token_id: int) -> int:
        """The offset of ``token_id`` (the next generated token), then advance past it."""
        offset = self.chars
        if token_id in self.texts.special:
            return offset
        raw = bytes(self.texts.raw_bytes(token_id))
        held = self._utf8.getstate()[0]
        text = self._utf8.decode(raw)
        if held:
            # bytes held from earlier tokens that this token shows are not a character: their
            # U+FFFD come before this token in the text
            alone = codecs.getincrementaldecoder('utf-8')(errors='replace').decode(raw)
            head = len(text) - len(alone)
            if head > 0 and text.endswith(alone) and text[:head] == '\ufffd' * head:
                offset += head
        if self._opening and text:
            text, self._opening = (text[1:] if text[0] == ' ' else text), False
        self.chars += len(text)
        return offset


def _top_with_sampled(texts: TokenTexts, lp, top: int) -> dict:
    """``{token text: logprob}`` of the ``top`` alternatives and, as OpenAI's completions do,
    the sampled token (one more entry when it is not among them; alone when ``top`` is 0)."""
    out = {texts(t): v for t, v in lp.top[:top]}
    out.setdefault(texts(lp.token_id), lp.logprob)
    return out


def completion_logprobs(texts: TokenTexts, logprobs: list, top: int, offsets: TextOffsets | None = None,
                        starts: list[int] | None = None) -> dict:
    """Completions ``choices[i].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (``{token text: logprob}`` per token: the ``top`` alternatives and the sampled token) and
    ``text_offset`` (characters of the choice's text before each token, see
    :class:`TextOffsets`; pass the choice's ``offsets`` to continue across stream chunks, or the
    ``starts`` a :class:`StreamedLogprobs` computed)."""
    if starts is None:
        offsets = offsets or TextOffsets(texts)
        starts = [offsets.next(lp.token_id) for lp in logprobs]
    return {'tokens': [texts(lp.token_id) for lp in logprobs], 'token_logprobs': [lp.logprob for lp in logprobs],
            'top_logprobs': [_top_with_sampled(texts, lp, top) for lp in logprobs], 'text_offset': list(starts)}


class StreamedLogprobs:
    """Keeps a streamed choice's text and its log-probability entries in step.

    The server holds generated text back (a possible stop string, an unfinished UTF-8
    character) while the tokens' log-probabilities arrive at once. With logprobs requested, a
    chunk's text ends at a token boundary: the end (from :class:`TextOffsets`) of the last token
    whose text has arrived in full, and the chunk carries exactly the entries of those tokens.
    The last chunk carries all text and every entry left (tokens a stop string cut off
    included, as in the non-streamed response).

    Args:
        texts: the server's token lookup.
    """

    def __init__(self, texts: TokenTexts):
        self.offsets = TextOffsets(texts)
        self.pending: list[tuple[object, int, int]] = []     # (TokenLogprob, start, end) in characters
        self.held = ''          # text received but not sent
        self.sent = 0           # characters sent

    def feed(self, logprobs: list | None, text: str, final: bool) -> tuple[str, list, list[int]]:
        """A step's entries and text in; ``(text to send, its entries, their start offsets)``."""
        for lp in logprobs or []:
            start = self.offsets.next(lp.token_id)
            self.pending.append((lp, start, self.offsets.chars))
        self.held += text
        if final:
            k, upto = len(self.pending), self.sent + len(self.held)
        else:
            have = self.sent + len(self.held)
            k = next((j for j, (_, _, end) in enumerate(self.pending) if end > have), len(self.pending))
            upto = max([self.sent] + [end for _, _, end in self.pending[:k]])
        ready, self.pending = self.pending[:k], self.pending[k:]
        out, self.held = self.held[:upto - self.sent], self.held[upto - self.sent:]
        self.sent = upto
        return out, [lp for lp, _, _ in ready], [start for _, start, _ in ready]
