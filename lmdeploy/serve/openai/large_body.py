"""Decode large JSON request bodies off the event loop, in slices short enough that the loop
keeps answering (``/health`` among them) while a multi-megabyte body is parsed.

A thread alone does not help: ``json.loads`` of a 4 MB token-id body is one C call that holds
the GIL for ~0.1-0.2 s, and the event loop waits for it. So :func:`decode_json` cuts every long
array of integers (the token ids of a prompt) out of the body and parses it ``_SLICE`` bytes at
a time; between slices the interpreter hands the GIL to the loop (every
``sys.getswitchinterval()`` s). Finding those arrays is sliced the same way (:func:`_int_arrays`:
one regex call over a 4 MB array held the GIL ~40 ms). The rest of the body, now small, is
parsed in one call::

    {"model": "m", "prompt": [17, 9, 4711, ......... 12]}      body
    {"model": "m", "prompt": "\\u0000ids:0"}                    parsed at once
                             [17, 9, 4711, .., 12]             parsed slice by slice, put back

:class:`OffLoopJSONRoute` applies it to FastAPI routes: a body over :data:`LARGE_BODY` bytes is
read, decoded in the thread pool, and handed to FastAPI as the request's JSON; its integer arrays
are :class:`~.protocol.DecodedInts`, which validation passes through without visiting each item.
A body nested deeper than the JSON decoder recurses (about ``sys.getrecursionlimit()`` levels) is a
400 naming the body, as FastAPI answers a small one (never a 500).
"""
from __future__ import annotations

import json
import re

from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from .errors import APIError
from .protocol import DecodedInts

__all__ = ['LARGE_BODY', 'OffLoopJSONRoute', 'decode_json']

LARGE_BODY = 256 << 10          # bytes; smaller bodies parse in well under a millisecond per KB
_SLICE = 64 << 10               # bytes of an integer array parsed per call (~1-2 ms)
_MARK = '\u0000ids:'


def _parse_ints(raw: bytes, slice_bytes: int) -> DecodedInts:
    """``raw`` = ``b'[1, 2, ...]'`` as a list, parsed ``slice_bytes`` bytes at a time.

    Raises:
        ValueError: not a JSON array of numbers.
    """
    out = DecodedInts()      # only digits, signs, commas and blanks were cut out: the items are ints
    inner, start = raw[1:-1], 0
    while start < len(inner):
        end = inner.find(b',', start + slice_bytes)
        end = len(inner) if end == -1 else end
        out.extend(json.loads(b'[' + inner[start:end] + b']'))
        start = end + 1
    return out


_INT_CHARS = re.compile(rb'[0-9\s,\-]*')


def _int_arrays(body: bytes, min_bytes: int, window: int = _SLICE):
    """``(start, end)`` of each ``[...]`` in ``body`` holding only digits, signs, commas and
    blanks, at least ``min_bytes`` of them, left to right: the spans of
    ``re.finditer(rb'\\[[0-9\\s,\\-]{min_bytes,}\\]', body)``. A run is matched ``window`` bytes
    per regex call, since one call over a 4 MB array held the GIL ~40 ms; between calls the
    event loop gets its turn."""
    pos, n = 0, len(body)
    while True:
        start = body.find(b'[', pos)
        if start == -1:
            return
        end = start + 1
        while True:             # extend the run one window at a time
            stop = min(n, end + window)
            end = _INT_CHARS.match(body, end, stop).end()
            if end < stop or stop == n:      # the run ended inside this window (or with the body)
                break
        if end - start - 1 >= min_bytes and body[end:end + 1] == b']':
            yield start, end + 1
            pos = end + 1
        else:
            pos = start + 1


def _substitute(obj, arrays: list):
    """``obj`` with each placeholder string replaced by its array; raises LookupError when a
    placeholder sits inside a longer string (the array was text, not a value)."""
    if isinstance(obj, str):
        if obj.startswith(_MARK) and obj[len(_MARK):].isdigit():
            return arrays[int(obj[len(_MARK):])]
        if _MARK in obj:
            raise LookupError(obj)
        return obj
    if isinstance(obj, list):
        return [_substitute(v, arrays) for v in obj]
    if isinstance(obj, dict):
        return {k: _substitute(v, arrays) for k, v in obj.items()}
    return obj


def decode_json(body: bytes, slice_bytes: int = _SLICE):
    """``json.loads(body)``, with long integer arrays parsed in slices (see the module
    docstring; arrays of at least ``slice_bytes`` bytes, that many bytes per call); equal to
    ``json.loads`` on every input (it falls back to it when a cut-out array
    turns out to be part of a string, or a slice is not valid JSON).

    Raises:
        ValueError: ``body`` is not valid JSON (``json.JSONDecodeError``, as ``json.loads``).
    """
    if _MARK.encode() in body or b'\\u0000ids:' in body:     # the placeholder itself: nothing to cut
        return json.loads(body)
    arrays, pieces, last = [], [], 0
    try:
        for start, end in _int_arrays(body, slice_bytes, slice_bytes):
            pieces += [body[last:start], json.dumps(f'{_MARK}{len(arrays)}').encode()]
            arrays.append(_parse_ints(body[start:end], slice_bytes))
            last = end
        if not arrays:
            return json.loads(body)
        pieces.append(body[last:])
        return _substitute(json.loads(b''.join(pieces)), arrays)
    except (ValueError, LookupError):
        return json.loads(body)


class OffLoopJSONRoute(APIRoute):
    """A FastAPI route whose JSON bodies over :data:`LARGE_BODY` bytes are decoded by
    :func:`decode_json` in the thread pool (FastAPI then validates the decoded value as usual;
    an invalid body still gets FastAPI's own error)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            length = request.headers.get('content-length', '')
            if length.isdigit() and int(length) > LARGE_BODY:
                body = await request.body()
                try:
                    request._json = await run_in_threadpool(decode_json, body)   # what request.json() returns
                except ValueError:
                    pass        # FastAPI decodes it again and answers with its usual error
                except RecursionError:
                    raise APIError(400, 'request body: JSON nested too deeply to decode', param='body',
                                   code='invalid_json') from None
            return await handler(request)
        return route
