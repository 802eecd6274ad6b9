"""An incremental check of one JSON value, character by character, that can close it at any
point: what the hermes tool-call stream (:mod:`.tool_parser`) uses to send a call's arguments as
the model writes them and to end a cut-off call with strict JSON.

Strict RFC 8259 (no ``NaN`` / ``Infinity``, no trailing commas, no control characters in
strings). What goes out is always a prefix of the input that :meth:`JSONPrefix.closing` can
complete to valid JSON without inventing a member::

    in    {"a": [1, 2.5], "b": "xy", "c": 1
    out   {"a": [1, 2.5], "b": "xy"          ', "c": 1' held: the number may go on
    close {"a": [1, 2.5], "b": "xy", "c": 1}  (a complete number is kept; "1." would be dropped)
"""
from __future__ import annotations

import re

__all__ = ['JSONPrefix']

_WHITESPACE = ' \t\n\r'
_NUMBER = re.compile(r'-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?')
_NUMBER_PREFIX = re.compile(r'-?|-?(?:0|[1-9]\d*)(?:\.\d*)?|-?(?:0|[1-9]\d*)(?:\.\d+)?[eE][+-]?\d*')
_LITERALS = ('true', 'false', 'null')
_ESCAPES = '"\\/bfnrtu'


class JSONPrefix:
    """Checks a JSON value character by character (strict RFC 8259: no NaN, no trailing commas)
    and tells, at any point, the text that closes what is open (so a cut-off value becomes valid
    JSON). Separators and keys are held back (:attr:`held`) until the next value begins, so a cut
    never leaves a dangling ``,`` or a key without its value.

    :meth:`push` takes one character and returns ``(text now final, state)``: state ``'ok'``,
    ``'done'`` (the top-level value just closed) or ``'bad'`` (the character cannot continue JSON;
    it was not taken).
    """

    def __init__(self):
        self.stack: list[str] = []      # open containers: '{' or '['
        self.expect = 'value'           # value | key | colon | after | first (just after '{' / '[')
        self.token = ''                 # the scalar being read (string with quotes, number, literal)
        self.kind = ''                  # '' | 'string' | 'key' | 'number' | 'literal'
        self.escape = ''                # inside a string: '' | '\\' | '\\u' + hex digits so far
        self.held = ''                  # separators and a key waiting for the next value

    def _value_starts(self, ch: str) -> tuple[str, str]:     # the held text goes out with it
        out, self.held = self.held + ch, ''
        return out, 'ok'

    def _end_value(self) -> str:
        self.expect = 'after'
        return 'done' if not self.stack else 'ok'

    def push(self, ch: str) -> tuple[str, str]:
        if self.kind in ('string', 'key'):
            return self._string(ch)
        if self.kind == 'number':       # held whole until it ends: a number cut short is left out
            if _NUMBER_PREFIX.fullmatch(self.token + ch):
                self.token += ch
                return '', 'ok'
            if not _NUMBER.fullmatch(self.token):
                return '', 'bad'
            flushed, self.held = self.held + self.token, ''
            self.kind, self.token = '', ''
            if self._end_value() == 'done':
                return flushed, 'done'
            text, state = self.push(ch)
            return flushed + text, state
        if self.kind == 'literal':
            word = self.token + ch
            if any(w.startswith(word) for w in _LITERALS):
                self.token = word
                if word in _LITERALS:
                    self.kind, self.token = '', ''
                    return ch, self._end_value()
                return ch, 'ok'
            return '', 'bad'
        if ch in _WHITESPACE:
            if self.expect in ('after', 'first') and self.held == '':
                return ch, 'ok'
            self.held += ch
            return '', 'ok'
        if self.expect in ('value', 'first'):
            if self.expect == 'first' and ch == ('}' if self.stack[-1] == '{' else ']'):
                self.stack.pop()
                return ch, self._end_value()
            if self.expect == 'first' and self.stack[-1] == '{':
                if ch != '"':
                    return '', 'bad'
                self.kind, self.token, self.held = 'key', '"', self.held + ch
                return '', 'ok'
            if ch in '{[':
                self.stack.append(ch)
                self.expect = 'first'
                return self._value_starts(ch)
            if ch == '"':
                self.kind, self.token = 'string', '"'
                return self._value_starts(ch)
            if ch == '-' or ch.isdigit() and ch.isascii():
                self.kind, self.token = 'number', ch
                return '', 'ok'
            if any(w.startswith(ch) for w in _LITERALS):
                self.kind, self.token = 'literal', ch
                return self._value_starts(ch)
            return '', 'bad'
        if self.expect == 'key':
            if ch != '"':
                return '', 'bad'
            self.kind, self.held = 'key', self.held + ch
            return '', 'ok'
        if self.expect == 'colon':
            if ch != ':':
                return '', 'bad'
            self.held += ch
            self.expect = 'value'
            return '', 'ok'
        # after a value: a separator or the end of the open container
        if not self.stack:
            return '', 'bad'
        if ch == ',':
            self.held += ch
            self.expect = 'key' if self.stack[-1] == '{' else 'value'
            return '', 'ok'
        if ch == ('}' if self.stack[-1] == '{' else ']'):
            self.stack.pop()
            out, self.held = self.held + ch, ''
            return out, self._end_value()
        return '', 'bad'

    def _string(self, ch: str) -> tuple[str, str]:
        key = self.kind == 'key'
        if self.escape == '\\':
            if ch not in _ESCAPES:
                return '', 'bad'
            self.escape = '\\u' if ch == 'u' else ''
        elif self.escape:
            if ch not in '0123456789abcdefABCDEF':
                return '', 'bad'
            self.escape = '' if len(self.escape) == 5 else self.escape + ch
        elif ch == '\\':
            self.escape = '\\'
        elif ch == '"':
            self.kind = ''
            if key:
                self.held += ch
                self.expect = 'colon'
                return '', 'ok'
            return ch, self._end_value()
        elif ord(ch) < 0x20:
            return '', 'bad'
        if key:
            self.held += ch
            return '', 'ok'
        return ch, 'ok'

    def pending(self) -> str:
        """The text taken but not given out yet (separators, a key, a number being read)."""
        return self.held + (self.token if self.kind == 'number' else '')

    def closing(self) -> str:
        """The text that ends the value here as valid JSON: a complete number still held, the
        rest of a cut string or literal, the open containers' ends (a held key or separator and
        a number cut short are left out)."""
        out = ''
        if self.kind == 'string':
            if self.escape == '\\':
                out += '\\'
            elif self.escape:
                out += '0' * (6 - len(self.escape))
            out += '"'
        elif self.kind == 'number' and _NUMBER.fullmatch(self.token):
            out += self.held + self.token
        elif self.kind == 'literal':
            out += next(w for w in _LITERALS if w.startswith(self.token))[len(self.token):]
        for opened in reversed(self.stack):
            out += '}' if opened == '{' else ']'
        return out
