"""Tool-call parsers: turn a model's reply text into OpenAI ``tool_calls``.

A parser owns one output format; the registry maps ``--tool-call-parser`` names to parsers.
Each parser answers two questions about the same text:

- :meth:`ToolParser.parse` — the whole reply at once (non-streaming responses);
- :meth:`ToolParser.stream` — a :class:`ToolCallStream` fed the reply delta by delta, which
  emits content deltas and OpenAI-style ``delta.tool_calls`` fragments.

Invariant: for every text and every way of cutting it into deltas, the streamed content
concatenates to ``parse(text).content`` (or ``''`` for None) and the streamed fragments, merged
per ``index`` (name from the first fragment, ``arguments`` concatenated), equal
``parse(text).calls``. A block that is not a well-formed call stays in the content: malformed
model output degrades to text, never to an error.

Format ``hermes`` (Qwen2.5 / Qwen3 / Hermes chat templates)::

    optional text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>...</tool_call>

Content is the text outside the call blocks; when the reply has at least one call, trailing
whitespace of the content is dropped and whitespace-only content becomes None. A ``<tool_call>``
tag that is not followed (after whitespace) by ``{`` is prose: it is released as content at once,
so a model that writes the tag in a sentence never stalls the stream.

Streaming (:class:`_HermesSegmenter`): once ``{"name": NAME, "arguments": {`` and the first
character of the arguments (``"`` or ``}``) have been read, the call is committed: its name goes
out at once, then the arguments as the model writes them (its own text), each member once its
value has begun (a key and its separators are held until then, a number until it ends). The
arguments end at their closing ``}``; a reply cut off inside them (``max_tokens``) still makes
the call, with the arguments closed where it ended (a cut string closed, open objects and arrays
ended, a member whose value had not begun left out), so they are always strict JSON; so does a
character JSON does not allow (``NaN``), where the text from the unfinished member on is
content. Other shapes (``arguments`` first, arguments as a JSON string) are parsed once the
block ends, as a whole.

Format ``qwen_xml`` (Qwen3.5 / Qwen3.6 / Qwen3-Coder templates) lives in :mod:`.qwen_xml_parser`;
:func:`detect_tool_format` picks the format a chat template renders.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .json_prefix import JSONPrefix

__all__ = ['ParsedCall', 'ParseResult', 'ToolParser', 'ToolCallStream', 'HermesToolParser', 'register_tool_parser',
           'get_tool_parser', 'merge_tool_call_fragments', 'detect_tool_format', 'TOOL_PARSERS']

TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str):
    """Class decorator: make a :class:`ToolParser` subclass available as ``name``."""
    def wrap(cls):
        TOOL_PARSERS[name] = cls
        cls.name = name
        return cls
    return wrap


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A new parser instance by registry name.

    Args:
        name: a registered format (``hermes``, ``qwen_xml``).
        tools: the request's ``tools`` (OpenAI shape, dicts); formats that write argument values
            as untyped text (``qwen_xml``) type them by each function's parameter schema.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f'unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}')
    return TOOL_PARSERS[name](tools)


def detect_tool_format(template: str) -> str | None:
    """The tool-call format a chat template renders: ``qwen_xml`` when it writes
    ``<function=NAME>`` blocks, ``hermes`` when it mentions ``<tool_call>`` otherwise, else None."""
    template = template or ''
    if '<tool_call>' not in template:
        return None
    return 'qwen_xml' if '<function=' in template else 'hermes'


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


@register_tool_parser('hermes')
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen, Hermes)."""
    start_tag = '<tool_call>'
    end_tag = '</tool_call>'

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return self.start_tag + '\n'
        # ends at the colon, not after the space: a prompt ending in a lone space token would not
        # re-tokenize as the history's ' {' (one token), and the next turn would miss the cache
        return self.start_tag + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        """The call a block's JSON body holds, or None when it is not one. An object of
        arguments is returned as the model wrote it (its exact text: spacing, key order,
        escapes), so that the reply sent back in the history renders to the tokens the model
        generated (chat templates print a string ``arguments`` as it is) and the next turn
        reuses the cached prefix past the reply."""
        members = _top_level_members(body)
        if members is None:
            return None
        name = members.get('name', (None, ''))[0]
        if not isinstance(name, str) or not name:
            return None
        args, raw = members.get('arguments', members.get('parameters', ({}, '{}')))
        if isinstance(args, str):
            try:
                _DECODER.decode(args)
            except ValueError:
                return None
            return ParsedCall(name, args)
        if not isinstance(args, dict):
            return None
        return ParsedCall(name, raw)

    def _opening(self, text: str, start: int) -> bool | None:
        """Whether the tag at ``start`` opens a call: its next non-space character is ``{``
        (None while only whitespace follows)."""
        i = start + len(self.start_tag)
        while i < len(text) and text[i] in _WHITESPACE:
            i += 1
        return None if i == len(text) else text[i] == '{'

    def first_call_end(self, text: str, start: int = 0) -> tuple[int | None, int]:
        pos = start
        while True:
            begin = text.find(self.start_tag, pos)
            if begin == -1:     # a start tag may still be forming at the very end
                return None, max(pos, len(text) - len(self.start_tag) + 1)
            opening = self._opening(text, begin)
            if opening is None:
                return None, begin
            if not opening:         # prose: the tag is text
                pos = begin + len(self.start_tag)
                continue
            end = text.find(self.end_tag, begin + len(self.start_tag))
            if end == -1:
                return None, begin
            block_end = end + len(self.end_tag)
            if self._call(text[begin + len(self.start_tag):end]) is not None:
                return block_end, begin
            pos = block_end     # malformed: stays text, as in segments()

    def segmenter(self) -> _HermesSegmenter:
        return _HermesSegmenter(self)

    def segments(self, text: str, final: bool, stop_at_call: bool = False):
        """As :meth:`ToolParser.segments`; with ``stop_at_call`` the text before the first block
        that opens a call (``<tool_call>`` then ``{``) is returned and the count stops at its tag
        (also while only whitespace follows the tag), for :class:`_HermesSegmenter`."""
        out, pos = [], 0
        while True:
            start = text.find(self.start_tag, pos)
            if start == -1:
                break
            opening = self._opening(text, start)
            if opening is False:    # the tag in prose: text now, the search goes on after it
                after = start + len(self.start_tag)
                out.append(('text', text[pos:after]))
                pos = after
                continue
            if stop_at_call and (opening or not final):
                if start > pos:
                    out.append(('text', text[pos:start]))
                return out, start
            if stop_at_call:        # the text ends with the tag and whitespace: text
                break
            end = text.find(self.end_tag, start + len(self.start_tag))
            if end == -1:
                if not final:
                    if start > pos:
                        out.append(('text', text[pos:start]))
                    return out, start
                break
            if start > pos:
                out.append(('text', text[pos:start]))
            block_end = end + len(self.end_tag)
            call = self._call(text[start + len(self.start_tag):end])
            out.append(('call', call) if call is not None else ('text', text[start:block_end]))
            pos = block_end
        rest = text[pos:]
        if not final:
            keep = _partial_suffix(rest, self.start_tag)
            rest = rest[:len(rest) - keep]
        if rest:
            out.append(('text', rest))
        return out, pos + len(rest)


def _no_constant(name: str):
    raise ValueError(f'{name} is not JSON')      # NaN / Infinity: Python's json takes them, clients do not


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_WHITESPACE = ' \t\n\r'


def _top_level_members(text: str) -> dict[str, tuple[object, str]] | None:
    """``{key: (value, value's exact source text)}`` of a JSON object, or None when ``text``
    (surrounding whitespace aside) is not exactly one JSON object. A repeated key keeps its last
    value, as ``json.loads`` does."""
    def skip(i: int) -> int:
        while i < len(text) and text[i] in _WHITESPACE:
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
            value, end = _DECODER.raw_decode(text, start)
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


def _partial_suffix(text: str, tag: str) -> int:
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


def _stream_head(text: str, i: int) -> tuple[str, str | None, int]:
    """Reads ``{"name": NAME, "arguments": {`` (any whitespace; ``parameters`` for ``arguments``)
    from ``text[i]`` (a ``{``) up to the first character of the arguments' content. Returns
    ``('yes', name, index of the arguments' '{')``, ``('need', None, 0)`` when the text so far
    could still become that, or ``('no', None, 0)``."""
    def skip(j):
        while j < len(text) and text[j] in _WHITESPACE:
            j += 1
        return j

    j = skip(i + 1)
    for step in ('"name"', ':', 'NAME', ',', 'ARGS', ':'):
        j = skip(j)
        if step == 'NAME':
            if j == len(text):
                return 'need', None, 0
            if text[j] != '"':
                return 'no', None, 0
            try:
                name, j = json.decoder.scanstring(text, j + 1)
            except ValueError as err:
                return ('need' if 'Unterminated' in str(err) else 'no'), None, 0
            if not name:
                return 'no', None, 0
            continue
        words = ('"arguments"', '"parameters"') if step == 'ARGS' else (step,)
        rest = text[j:]
        word = next((w for w in words if rest.startswith(w)), None)
        if word is None:
            return ('need' if any(w.startswith(rest) for w in words) else 'no'), None, 0
        j += len(word)
    j = skip(j)
    if j == len(text):
        return 'need', None, 0
    if text[j] != '{':
        return 'no', None, 0
    k = skip(j + 1)         # the arguments' content must start like an object's
    if k == len(text):
        return 'need', None, 0
    return ('yes', name, j) if text[k] in '"}' else ('no', None, 0)


class _HermesSegmenter:
    """The incremental segmenter of the hermes format (see :class:`HermesToolParser`). States:
    ``text``; ``head`` (a ``<tool_call>`` and ``{`` read, the name not yet); ``args`` (the call
    is open, its arguments stream through :class:`JSONPrefix`); ``tail`` (the arguments closed:
    ``}`` and ``</tool_call>`` expected); ``rest`` (the call object's other members, dropped up to
    ``</tool_call>``); ``block`` (a block of another shape, parsed whole once it ends)."""

    def __init__(self, parser: HermesToolParser):
        self.p = parser
        self.state, self.buf = 'text', ''
        self.json: JSONPrefix | None = None

    def feed(self, delta: str, final: bool) -> list:
        self.buf += delta
        out: list = []
        while self._step(out, final):
            pass
        return out

    def _close_args(self, out: list) -> None:
        closing = self.json.closing()
        if closing:
            out.append(('args', closing))
        self.json = None

    def _step(self, out: list, final: bool) -> bool:
        p, buf = self.p, self.buf
        if self.state == 'text':
            segments, used = p.segments(buf, final, stop_at_call=True)
            out.extend(segments)
            self.buf = buf[used:]
            if used < len(buf) and buf.startswith(p.start_tag, used) and p._opening(buf, used):
                self.state = 'head'
                return True
            return False
        if self.state == 'head':
            brace = len(p.start_tag)
            while buf[brace] in _WHITESPACE:    # the text state saw the '{' after the tag
                brace += 1
            status, name, at = _stream_head(buf, brace)
            if status == 'yes':
                out.append(('open', ParsedCall(name, '')))
                self.json, self.buf, self.state = JSONPrefix(), buf[at:], 'args'
                return True
            if status == 'need' and not final:
                return False
            self.state = 'block'
            return True
        if self.state == 'block':
            end = buf.find(p.end_tag, len(p.start_tag))
            if end == -1:
                if final:
                    out.append(('text', buf))
                    self.buf, self.state = '', 'text'
                return False
            block_end = end + len(p.end_tag)
            call = p._call(buf[len(p.start_tag):end])
            out.append(('call', call) if call is not None else ('text', buf[:block_end]))
            self.buf, self.state = buf[block_end:], 'text'
            return True
        if self.state == 'args':
            piece = ''
            for i, ch in enumerate(buf):
                emitted, state = self.json.push(ch)
                piece += emitted
                if state == 'ok':
                    continue
                if piece:
                    out.append(('args', piece))
                if state == 'done':
                    self.json, self.buf, self.state = None, buf[i + 1:], 'tail'
                else:       # not JSON: the arguments end before it; the text from there is content
                    held = self.json.pending()
                    self._close_args(out)
                    self.buf, self.state = held + buf[i:], 'text'
                return True
            if piece:
                out.append(('args', piece))
            self.buf = ''
            if final:       # cut off: the arguments are closed where the reply ended
                self._close_args(out)
                self.state = 'text'
            return False
        if self.state == 'tail':
            lead = buf.lstrip(_WHITESPACE)
            if lead.startswith('}'):
                lead = lead[1:].lstrip(_WHITESPACE)
            if lead.startswith(p.end_tag):
                self.buf, self.state = lead[len(p.end_tag):], 'text'
                return True
            if lead.startswith(','):
                self.buf, self.state = lead, 'rest'
                return True
            if p.end_tag.startswith(lead):      # the call's closing so far ('' included)
                if final:                       # cut off there: nothing of it is content
                    self.buf, self.state = '', 'text'
                return False
            self.buf, self.state = lead, 'text'
            return True
        # rest: the call object's other members
        end = buf.find(p.end_tag)
        if end == -1:
            self.buf = '' if final else buf[max(0, len(buf) - len(p.end_tag) + 1):]
            if final:
                self.state = 'text'
            return False
        self.buf, self.state = buf[end + len(p.end_tag):], 'text'
        return True


from . import qwen_xml_parser  # noqa: E402,F401  (registers 'qwen_xml'; it builds on this module)
