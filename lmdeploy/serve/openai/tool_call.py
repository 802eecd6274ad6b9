"""What a tool-call parser is: the contract every output format keeps, and the pieces they share.

A parser owns one output format (:mod:`.tool_parser`: ``hermes`` and the registry;
:mod:`.qwen_xml_parser`: ``qwen_xml``). Each parser answers two questions about the same text:

- :meth:`ToolParser.parse` — the whole reply at once (non-streaming responses);
- :meth:`ToolParser.stream` — a :class:`ToolCallStream` fed the reply delta by delta, which
  emits content deltas and OpenAI-style ``delta.tool_calls`` fragments.

Invariant: for every text and every way of cutting it into deltas, the streamed content
concatenates to ``parse(text).content`` (or ``''`` for None) and the streamed fragments, merged
per ``index`` (name from the first fragment, ``arguments`` concatenated), equal
``parse(text).calls``. A block that is not a well-formed call stays in the content: malformed
model output degrades to text, never to an error.

Also here, for the formats' segmenters: strict JSON decoding (:data:`STRICT_JSON`: no ``NaN``),
:func:`top_level_members` and :func:`partial_suffix`.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

__all__ = ['ParsedCall', 'ParseResult', 'ToolParser', 'StateMachineSegmenter', 'ToolCallStream',
           'merge_tool_call_fragments', 'STRICT_JSON', 'JSON_WHITESPACE', 'top_level_members', 'partial_suffix']


@dataclass
class ParsedCall:
    """One generated call: the function name and its arguments as a JSON string."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f'call_{uuid.uuid4().hex[:24]}')

    def to_openai(self) -> dict:
        """``message.tool_calls[i]`` of a chat completion."""
        return {'id': self.id, 'type': 'function', 'function': {'name': self.name, 'arguments': self.arguments}}


@dataclass
class ParseResult:
    """``content`` (None when empty) and the ``calls`` found, in order."""
    content: str | None
    calls: list[ParsedCall]


class ToolParser:
    """Base class of a tool-call output format (see the module docstring for the contract).

    Segments are ``('text', str)``, ``('call', ParsedCall)`` (a whole call), or, for formats
    that stream a call's arguments, ``('open', ParsedCall)`` (name and id known, ``arguments``
    empty) followed by ``('args', str)`` pieces of the open call's arguments JSON.

    Args:
        tools: the request's ``tools`` (OpenAI shape); see :func:`get_tool_parser`.
    """
    name = ''
    start_tag = ''       # text that may open a call; used by the streaming hold-back

    def __init__(self, tools: list[dict] | None = None):
        self.schemas: dict[str, dict] = {}
        for tool in tools or []:
            fn = tool.get('function') or {}
            if fn.get('name'):
                self.schemas[fn['name']] = fn.get('parameters') or {}

    def parse(self, text: str) -> ParseResult:
        """Split a whole reply into content and calls."""
        pieces, calls = [], []
        for kind, value in self.segmenter().feed(text, final=True):
            if kind == 'text':
                pieces.append(value)
            elif kind == 'args':
                calls[-1].arguments += value
            else:
                calls.append(value)
        content = ''.join(pieces)
        if calls:
            content = content.rstrip()
        return ParseResult(content or None, calls)

    def segmenter(self):
        """A new incremental segmenter: ``feed(delta, final) -> segments`` of the text fed so far
        (what may still change is held back until ``final``). The default one re-runs the
        stateless :meth:`segments` on the unconsumed text."""
        return _BufferedSegmenter(self)

    def history_message(self, message: dict) -> dict:
        """A chat message as this format's chat template wants it in the history (the default:
        unchanged; templates that iterate ``arguments`` as a mapping get a dict)."""
        return message

    def forced_prefix(self, name: str | None) -> str:
        """Text that opens a call (of function ``name``, or of any function when None); the
        server appends it to the prompt for ``tool_choice`` ``"required"`` / a named function,
        and parses it as the start of the reply."""
        raise NotImplementedError

    def segments(self, text: str, final: bool) -> tuple[list[tuple[str, object]], int]:
        """Split ``text`` into ``('text', str)`` and ``('call', ParsedCall)`` segments.

        Returns the segments and how many characters of ``text`` they cover; the rest (an
        unfinished call, or what may be the start of one) waits for more text unless ``final``.
        """
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        """A new incremental parser for one reply."""
        return ToolCallStream(self)

    def first_call_end(self, text: str, start: int = 0) -> tuple[int | None, int]:
        """Where the first well-formed call at or after ``start`` ends in ``text``.

        Returns ``(end, resume)``: ``end`` is the offset just past the first complete call that
        :meth:`parse` would return (None while there is none yet); ``resume`` is an offset from
        which a later search of the same text grown longer can start (what lies before it holds
        no call, and no unfinished block starts there).
        """
        raise NotImplementedError


def _no_constant(name: str):
    raise ValueError(f'{name} is not JSON')      # NaN / Infinity: Python's json takes them, clients do not


STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)
JSON_WHITESPACE = ' \t\n\r'


def top_level_members(text: str) -> dict[str, tuple[object, str]] | None:
    """``{key: (value, value's exact source text)}`` of a JSON object, or None when ``text``
    (surrounding whitespace aside) is not exactly one JSON object. A repeated key keeps its last
    value, as ``json.loads`` does."""
    def skip(i: int) -> int:
        while i < len(text) and text[i] in JSON_WHITESPACE:
            i += 1
        return i

    i = skip(0)
    if i >= len(text) or text[i] != '{':
        return None
    members, i = {}, skip(i + 1)
    try:
        if i < len(text) and text[i] == '}':
            return members if skip(i + 1) == len(text) else None
        while True:
            if i >= len(text) or text[i] != '"':
                return None
            key, i = json.decoder.scanstring(text, i + 1)
            i = skip(i)
            if i >= len(text) or text[i] != ':':
                return None
            start = skip(i + 1)
            value, end = STRICT_JSON.raw_decode(text, start)
            members[key] = (value, text[start:end])
            i = skip(end)
            if i < len(text) and text[i] == ',':
                i = skip(i + 1)
                continue
            if i < len(text) and text[i] == '}':
                return members if skip(i + 1) == len(text) else None
            return None
    except ValueError:      # json.JSONDecodeError: a malformed key or value
        return None


def merge_tool_call_fragments(frags: list[dict]) -> list[dict]:
    """``delta.tool_calls`` fragments with at most one entry per ``index``, in first-seen order.

    Fragments of one index are merged as a client merges them across chunks: ``id``, ``type``
    and ``function.name`` from the first fragment that has them, ``function.arguments``
    concatenated. The input is not modified.
    """
    merged: dict[int, dict] = {}
    for frag in frags:
        into = merged.get(frag['index'])
        if into is None:
            merged[frag['index']] = dict(frag, function=dict(frag.get('function') or {}))
            continue
        for key in ('id', 'type'):
            if key in frag and key not in into:
                into[key] = frag[key]
        fn, into_fn = frag.get('function') or {}, into['function']
        if 'name' in fn and 'name' not in into_fn:
            into_fn['name'] = fn['name']
        if 'arguments' in fn:
            into_fn['arguments'] = into_fn.get('arguments', '') + fn['arguments']
    return list(merged.values())


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class _BufferedSegmenter:
    """Incremental segmentation over a stateless :meth:`ToolParser.segments`."""

    def __init__(self, parser: ToolParser):
        self.parser, self.buffer = parser, ''

    def feed(self, delta: str, final: bool) -> list:
        self.buffer += delta
        segments, used = self.parser.segments(self.buffer, final)
        self.buffer = '' if final else self.buffer[used:]
        return segments


class StateMachineSegmenter:
    """An incremental segmenter written as a state machine over the text not yet consumed
    (``buf``; ``state`` starts at ``'text'``): :meth:`feed` appends a delta and runs
    :meth:`_step` until it needs more text. Formats that stream a call's arguments subclass it."""

    def __init__(self, parser: ToolParser):
        self.p = parser
        self.state, self.buf = 'text', ''

    def feed(self, delta: str, final: bool) -> list:
        """Segments of ``delta`` (and of what was held back), in order; with ``final`` all is out."""
        self.buf += delta
        out: list = []
        while self._step(out, final):
            pass
        return out

    def _step(self, out: list, final: bool) -> bool:
        """One transition, appending segments to ``out``; False when it needs more text (or,
        when ``final``, all is out)."""
        raise NotImplementedError


class ToolCallStream:
    """Incremental form of :meth:`ToolParser.parse` for one streamed reply.

    :meth:`feed` takes the next text delta and returns ``(content_delta, tool_call_fragments)``;
    :meth:`finish` flushes what was held back. A call is emitted once its block is complete, as
    one fragment ``{index, id, type, function: {name, arguments}}`` (OpenAI never repeats an
    ``index`` inside one chunk; see :func:`merge_tool_call_fragments`). Whitespace at the end
    of the content so far is held back until more content follows, so that it can be dropped if
    the reply ends with calls.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.segmenter = parser.segmenter()
        self.pending_ws = ''      # content whitespace held back
        self.num_calls = 0
        self.calls: list[ParsedCall] = []

    def _content(self, text: str) -> str:
        text = self.pending_ws + text
        stripped = text.rstrip()
        self.pending_ws = text[len(stripped):]
        return stripped

    def _emit(self, segments) -> tuple[str, list[dict]]:
        content, frags = '', []
        for kind, value in segments:
            if kind == 'text':
                content += self._content(value)
            elif kind == 'args':
                self.calls[-1].arguments += value
                frags.append({'index': self.num_calls - 1, 'function': {'arguments': value}})
            else:
                i = self.num_calls
                self.num_calls += 1
                self.calls.append(ParsedCall(value.name, value.arguments, value.id))
                frags.append({'index': i, 'id': value.id, 'type': 'function',
                              'function': {'name': value.name, 'arguments': value.arguments}})
        return content, frags

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """Next text delta in; ``(content delta, tool-call fragments)`` out."""
        return self._emit(self.segmenter.feed(delta, False))

    def finish(self) -> tuple[str, list[dict]]:
        """End of the reply: flush held text (trailing whitespace is dropped after a call)."""
        content, frags = self._emit(self.segmenter.feed('', True))
        if not self.num_calls:
            content += self.pending_ws
        self.pending_ws = ''
        return content, frags
