"""Tool-call parsers: the registry that maps ``--tool-call-parser`` names to output formats, and
format ``hermes``.

The contract every format keeps (:meth:`~.tool_call.ToolParser.parse` and its streaming form)
is in :mod:`.tool_call`.

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

from .json_prefix import JSONPrefix
from .qwen_xml_parser import QwenXMLToolParser
from .tool_call import (JSON_WHITESPACE, STRICT_JSON, ParsedCall, StateMachineSegmenter, ToolParser, partial_suffix,
                        top_level_members)

__all__ = ['HermesToolParser', 'register_tool_parser', 'get_tool_parser', 'detect_tool_format', 'TOOL_PARSERS']

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
        members = top_level_members(body)
        if members is None:
            return None
        name = members.get('name', (None, ''))[0]
        if not isinstance(name, str) or not name:
            return None
        args, raw = members.get('arguments', members.get('parameters', ({}, '{}')))
        if isinstance(args, str):
            try:
                STRICT_JSON.decode(args)
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
        while i < len(text) and text[i] in JSON_WHITESPACE:
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
            keep = partial_suffix(rest, self.start_tag)
            rest = rest[:len(rest) - keep]
        if rest:
            out.append(('text', rest))
        return out, pos + len(rest)



def _stream_head(text: str, i: int) -> tuple[str, str | None, int]:
    """Reads ``{"name": NAME, "arguments": {`` (any whitespace; ``parameters`` for ``arguments``)
    from ``text[i]`` (a ``{``) up to the first character of the arguments' content. Returns
    ``('yes', name, index of the arguments' '{')``, ``('need', None, 0)`` when the text so far
    could still become that, or ``('no', None, 0)``."""
    def skip(j):
        while j < len(text) and text[j] in JSON_WHITESPACE:
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


class _HermesSegmenter(StateMachineSegmenter):
    """The incremental segmenter of the hermes format (see :class:`HermesToolParser`). States:
    ``text``; ``head`` (a ``<tool_call>`` and ``{`` read, the name not yet); ``args`` (the call
    is open, its arguments stream through :class:`JSONPrefix`); ``tail`` (the arguments closed:
    ``}`` and ``</tool_call>`` expected); ``rest`` (the call object's other members, dropped up to
    ``</tool_call>``); ``block`` (a block of another shape, parsed whole once it ends)."""

    def __init__(self, parser: HermesToolParser):
        super().__init__(parser)
        self.json: JSONPrefix | None = None

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
            while buf[brace] in JSON_WHITESPACE:    # the text state saw the '{' after the tag
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
            lead = buf.lstrip(JSON_WHITESPACE)
            if lead.startswith('}'):
                lead = lead[1:].lstrip(JSON_WHITESPACE)
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


register_tool_parser('qwen_xml')(QwenXMLToolParser)
