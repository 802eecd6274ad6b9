"""Tool-call format ``qwen_xml``: the XML calls of Qwen3.5 / Qwen3.6 / Qwen3-Coder templates::

    optional text <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A call is committed once ``<tool_call>`` (then whitespace) ``<function=NAME>`` has been read:
from then on it is streamed as OpenAI argument deltas — ``{"city": "`` as soon as a string
parameter opens, its value as it arrives (JSON-escaped), ``"`` when it closes, ``}`` at
``</function>`` — and it stays a call even when the reply is cut off (the arguments are closed
where it ends; a value that had not begun is left out). A ``<tool_call>`` that is not followed by
``<function=`` is prose and is released as content at once (never stalls the stream). Text the
format does not allow between parameters ends the call's arguments there; the text is content.

Values are text; one newline right after ``<parameter=KEY>`` and one right before
``</parameter>`` belong to the layout. A value is typed by the function's parameter schema
(``tools[].function.parameters.properties[KEY]``): a parameter that may only be a string is a
JSON string of the text; any other (integer, number, boolean, object, array, null, or no schema
and a value that is JSON) is the value's JSON text as the model wrote it when it parses as strict
JSON (``json.loads`` semantics; no ``NaN``; no ``eval``), else a string. Keeping the model's own
text makes a reply sent back in the history render to the tokens it was generated from
(:meth:`QwenXMLToolParser.history_message`), so the next turn reuses the cached prefix.

Invariant (property-tested): any cutting of a reply into deltas streams content and argument
fragments that concatenate to :meth:`~.tool_call.ToolParser.parse` of the whole reply.
"""
from __future__ import annotations

import json

from .tool_call import STRICT_JSON, ParsedCall, StateMachineSegmenter, ToolParser, partial_suffix, top_level_members

__all__ = ['QwenXMLToolParser']

_OPEN, _CLOSE = '<tool_call>', '</tool_call>'
_FN, _FN_END = '<function=', '</function>'
_PARAM, _PARAM_END = '<parameter=', '</parameter>'
_MAX_NAME = 256     # characters of a function or parameter name; longer is not a call
_WS = ' \t\r\n'


def _types(schema) -> set[str]:
    """JSON types a parameter schema allows (from ``type``, ``anyOf``/``oneOf``, ``enum``)."""
    if not isinstance(schema, dict):
        return set()
    kinds = schema.get('type')
    out = {kinds} if isinstance(kinds, str) else {k for k in kinds if isinstance(k, str)} \
        if isinstance(kinds, list) else set()
    for key in ('anyOf', 'oneOf'):
        for sub in schema.get(key) or []:
            out |= _types(sub)
    if not out and 'enum' in schema:
        out = {'string' if isinstance(v, str) else 'number' for v in schema['enum']}
    if not out and 'properties' in schema:
        out = {'object'}
    return out


def _is_json_of(value, types: set[str]) -> bool:
    if not types:
        return True
    names = {bool: 'boolean', int: 'integer', float: 'number', str: 'string', list: 'array', dict: 'object',
             type(None): 'null'}
    kind = names.get(type(value))
    return kind in types or (kind == 'integer' and 'number' in types) or \
        (kind == 'number' and 'integer' in types and value.is_integer())


class _Segmenter(StateMachineSegmenter):
    """The state machine of one reply (see the module docstring). States: ``text``, ``open``
    (after ``<tool_call>``), ``params`` (inside ``<function=...>``), ``value`` (a string
    parameter being streamed), ``close`` (after ``</function>``)."""

    def __init__(self, parser: QwenXMLToolParser):
        super().__init__(parser)
        self.schema: dict = {}          # properties of the open call's function
        self.count = 0                  # parameters written into the open call

    def _args(self, out: list, piece: str) -> None:
        out.append(('args', piece))

    def _key_piece(self, key: str) -> str:
        head = '{' if self.count == 0 else ', '
        self.count += 1
        return head + json.dumps(key, ensure_ascii=False) + ': '

    def _end_call(self, out: list) -> None:
        self._args(out, '{}' if self.count == 0 else '}')
        self.count = 0

    def _step(self, out: list, final: bool) -> bool:
        """One transition; False when it needs more text (or, when ``final``, all is out)."""
        buf = self.buf
        if self.state == 'text':
            at = buf.find(_OPEN)
            if at == -1:
                keep = 0 if final else partial_suffix(buf, _OPEN)
                if len(buf) > keep:
                    out.append(('text', buf[:len(buf) - keep]))
                self.buf = buf[len(buf) - keep:]
                return False
            if at:
                out.append(('text', buf[:at]))
            self.buf, self.state = buf[at + len(_OPEN):], 'open'
            return True
        lead = buf.lstrip(_WS)
        if self.state in ('open', 'close'):
            if self.state == 'close' and lead.startswith(_CLOSE):
                self.buf, self.state = lead[len(_CLOSE):], 'text'
                return True
            if lead.startswith(_FN):
                end = lead.find('>', len(_FN))
                name = lead[len(_FN):] if end == -1 else lead[len(_FN):end]
                if _valid_name(name) and end == -1 and not final:
                    return False
                if _valid_name(name) and end != -1 and name:
                    self.schema = (self.p.schemas.get(name) or {}).get('properties') or {}
                    out.append(('open', ParsedCall(name, '')))
                    self.buf, self.state = lead[end + 1:], 'params'
                    return True
            elif not final and (_FN.startswith(lead) or self.state == 'close' and _CLOSE.startswith(lead)):
                return False
            # not a call (or nothing more after one): text from here on
            if self.state == 'open':
                out.append(('text', _OPEN))
            self.state = 'text'
            return True
        if self.state == 'params':
            if lead.startswith(_PARAM):
                gt = lead.find('>', len(_PARAM))
                key = lead[len(_PARAM):] if gt == -1 else lead[len(_PARAM):gt]
                if _valid_name(key):        # '' is a valid JSON key: <parameter=> carries it
                    body = lead[gt + 1:] if gt != -1 else None
                    if body is None or body == '':
                        if not final:
                            return False
                        self._end_call(out)       # cut off before the value began
                        self.buf, self.state = '', 'text'
                        return True
                    if body.startswith('\n'):
                        body = body[1:]
                    types = _types(self.schema.get(key))
                    if types == {'string'}:
                        self._args(out, self._key_piece(key) + '"')
                        self.buf, self.state = body, 'value'
                        return True
                    end = body.find(_PARAM_END)
                    if end == -1:
                        if not final:
                            return False
                        self._end_call(out)
                        self.buf, self.state = '', 'text'
                        return True
                    raw = body[:end]
                    raw = raw[:-1] if raw.endswith('\n') else raw
                    self._args(out, self._key_piece(key) + _typed(raw, types))
                    self.buf = body[end + len(_PARAM_END):]
                    return True
            elif lead.startswith(_FN_END):
                self._end_call(out)
                self.buf, self.state = lead[len(_FN_END):], 'close'
                return True
            elif not final and (_PARAM.startswith(lead) or _FN_END.startswith(lead)):
                return False
            # the call ends here: cut off, or text the format does not allow
            self._end_call(out)
            self.state = 'text'
            if final and not lead:
                self.buf = ''
                return False
            return True
        # value: a string parameter's text, streamed
        end = buf.find(_PARAM_END)
        if end == -1:
            keep = 0 if final else max(partial_suffix(buf, '\n' + _PARAM_END), partial_suffix(buf, _PARAM_END))
            piece = buf[:len(buf) - keep]
            if piece:
                self._args(out, json.dumps(piece, ensure_ascii=False)[1:-1])
            self.buf = buf[len(piece):]
            if final:
                self._args(out, '"')
                self._end_call(out)
                self.state = 'text'
            return False
        raw = buf[:end]
        raw = raw[:-1] if raw.endswith('\n') else raw
        self._args(out, json.dumps(raw, ensure_ascii=False)[1:-1] + '"' if raw else '"')
        self.buf, self.state = buf[end + len(_PARAM_END):], 'params'
        return True


def _valid_name(name: str) -> bool:
    return len(name) <= _MAX_NAME and not any(c in name for c in '<>\n')


def _typed(raw: str, types: set[str]) -> str:
    """A parameter's text as JSON text: itself when it is strict JSON of an allowed type (or of
    any type when the schema says none), else a JSON string of it."""
    text = raw.strip(_WS)
    if text and types != {'string'}:
        try:
            value = STRICT_JSON.decode(text)
        except ValueError:
            pass
        else:
            if _is_json_of(value, types - {'string'} or types):
                return text
    return json.dumps(raw, ensure_ascii=False)


class QwenXMLToolParser(ToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``."""
    start_tag = _OPEN

    def segmenter(self) -> _Segmenter:
        return _Segmenter(self)

    def forced_prefix(self, name: str | None) -> str:
        # ends with a newline: the history renders '<function=NAME>\n' as its own tokens
        return _OPEN + '\n' if name is None else f'{_OPEN}\n{_FN}{name}>\n'

    def first_call_end(self, text: str, start: int = 0) -> tuple[int | None, int]:
        pos = start
        while True:
            begin = text.find(_OPEN, pos)
            if begin == -1:
                return None, max(pos, len(text) - len(_OPEN) + 1)
            lead_at = begin + len(_OPEN)
            lead = text[lead_at:].lstrip(_WS)
            if not lead.startswith(_FN):
                if _FN.startswith(lead):
                    return None, begin
                pos = lead_at
                continue
            end = text.find(_FN_END, begin)
            if end == -1:
                return None, begin
            end += len(_FN_END)
            tail = text[end:].lstrip(_WS)
            if tail.startswith(_CLOSE):
                return len(text) - len(tail) + len(_CLOSE), begin
            if _CLOSE.startswith(tail):
                return None, begin
            return end, begin

    def history_message(self, message: dict) -> dict:
        """Assistant ``tool_calls`` with ``arguments`` as a mapping (the template iterates its
        items); each value that is not a JSON string is given as its JSON text, which the template
        prints as it is — the model's own text for a reply this parser returned."""
        calls = message.get('tool_calls')
        if not calls:
            return message
        out = []
        for call in calls:
            fn = dict(call.get('function') or {})
            args = fn.get('arguments')
            if isinstance(args, str):
                members = top_level_members(args)
                if members is not None:
                    fn['arguments'] = {k: v if isinstance(v, str) else raw for k, (v, raw) in members.items()}
            out.append(dict(call, function=fn))
        return dict(message, tool_calls=out)
