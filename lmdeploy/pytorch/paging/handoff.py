"""Prefill/decode hand-off: where a prompt is handed from a prefill engine to a decode engine.

A prefill engine (``role='prefill'``) computes a prompt of n tokens up to the hand-off point h
and puts what it computed through the Store; a decode engine (``role='decode'``) restores
exactly h tokens, computes the rest of the prompt (normally the one token ``n - 1``) and
samples, so the first sampled token comes from the same forward as in colocated serving::

    prompt     [0 ................................ h | n-1 ]
    prefill    forwards of the prompt's chunk grid, the last one cut at h; no sampling
    Store      KV blocks [0, floor_B(h))  (shared with every other prefix, put once)
               + one hand-off object: the partial block [floor_B(h), h) and the state at h
    decode     restore [0, h), forward [h, n), sample, decode

h is the largest token count ``<= n - max(1, ℓ)`` that splits no multimodal span (so the
decode engine never computes part of an image), normally ``n - 1``; h is not aligned to A or B
(a save point only a hand-off uses). A prompt with h = 0 has nothing to hand off.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ['ROLES', 'Handoff', 'handoff_point']

ROLES = ('both', 'prefill', 'decode')


def handoff_point(num_tokens: int, token_lookahead: int = 0, spans: Sequence[tuple[int, int]] = ()) -> int:
    """The hand-off point h of an ``num_tokens``-token prompt (tokens, ``0 <= h < num_tokens``).

    ``h = num_tokens - max(1, token_lookahead)``, moved down to the start of any multimodal span
    ``[s, e)`` with ``s < h < e`` (repeatedly, for adjacent spans); 0 when nothing is left.

    Raises:
        ValueError: ``num_tokens < 1`` or ``token_lookahead < 0``.
    """
    if num_tokens < 1:
        raise ValueError(f'num_tokens must be >= 1, got {num_tokens}')
    if token_lookahead < 0:
        raise ValueError(f'token_lookahead must be >= 0, got {token_lookahead}')
    h = max(0, num_tokens - max(1, token_lookahead))
    moved = True
    while moved:
        moved = False
        for s, e in spans:
            if s < h < e:
                h, moved = s, True
    return h


@dataclass(eq=False)
class Handoff:
    """The hand-off of one request (``Sequence.handoff``).

    Attributes:
        role: ``'prefill'`` (compute to ``point``, put, finish with reason ``'handoff'``) or
            ``'decode'`` (restore ``point`` tokens from the hand-off object when the Store has it).
        point: h, tokens handed off.
        key: the hand-off object's Store key (set when the prefix cache plans its put or probe).
        restored: tokens the decode engine restored from the hand-off (0: none, computed).
    """
    role: str
    point: int
    key: str | None = None
    restored: int = 0
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _ok: bool = field(default=False, repr=False)

    def resolve(self, ok: bool) -> None:
        """Record the outcome of the prefill side's put (called once, by the Store tier)."""
        self._ok = ok
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the prefill side's put is over (at most ``timeout`` seconds); True when
        the hand-off object and every KV block below it are in the Store."""
        return self._done.wait(timeout) and self._ok
