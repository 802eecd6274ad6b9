"""Prefill chunk plans and state-checkpoint save points (the rules are documented in docs/en/advance/prefix_caching.md).

This module owns the *arithmetic* of chunked prefill for hybrid models: which token
boundaries may carry a reusable recurrent-state checkpoint, where each prefill chunk of a
turn ends, and at which chunk ends the state is saved. Everything here is a pure function
of integers (no torch, no engine objects), so the scheduler, the cache engine, the tests
and ``benchmark/simulate_store_writes.py`` all share one definition.

Chunk ends are a function of the input alone (:func:`prefill_grid`): the same with prefix
caching off and on and under every save policy, so a prefill computes the same floating-point
numbers whatever is cached (each forward's rounding depends on where it starts and ends). Save
points are chosen among those ends; only a junction (which depends on the cache's contents) and
the turn-end block boundary (``decode_save_last``) add ends of their own.

Invariants of every :class:`PrefillPlan` returned by :func:`plan_prefill`:

* ``chunk_ends`` is strictly increasing, its last element is ``num_tokens`` and the first
  chunk starts at ``cached_tokens``;
* no chunk end splits a multimodal span: no end ``b < num_tokens`` has ``s < b < e`` or
  ``s < b + ℓ < e`` for a span ``[s, e)`` (see :func:`is_chunk_end_allowed`);
* every chunk holds at most ``chunk_size`` tokens, except a chunk that no allowed end within
  the budget can close (a span, widened by ℓ, longer than the budget): it ends at the first
  allowed end past the budget, so an image is never split even if its forward is larger;
* ``save_points`` is a subset of ``chunk_ends``; each one is reusable (:func:`is_reusable`) and greater
  than ``cached_tokens`` -- a state exists there because a forward ends exactly there;
* ``chunk_ends == prefill_grid(num_tokens, cached_tokens, ...)`` under either policy;
* last-only plans save at ``last_reusable(num_tokens)`` and, given a shared head, at its
  boundary (:func:`shared_head_boundary`), each only when above ``cached_tokens``.

Example, n = 16448 (16K + 64), c = 0, P = 8192, A = 1024, B = 64::

    tokens   0            8192           16384  16448
             |------------|--------------|------|
    chunks   [  chunk 0   ][   chunk 1   ][ c2  ]       chunk_ends  [8192, 16384, 16448]
    default               S              S              save_points [8192, 16384]
    last-only                            S              save_points [16384]

With a shared head of 9500 tokens (system prompt + tools; its boundary is 9216) a forward also
ends at 9216 and saves there under both policies, and the next forward starts from it::

    chunk_ends  [8192, 9216, 16384, 16448]
    default     save_points [8192, 9216, 16384]      last-only  save_points [9216, 16384]

Chunk ends obey the span rule too, not only save points: a chunk end that would fall inside
an image's tokens (or, with lookahead ℓ, whose forward would read into them) moves down to
the span's start edge (``s - ℓ``). So every image is embedded by exactly one forward, which
runs its vision encoder once per request; no embedding needs to outlive a step::

    tokens    ...text...  [ s ====== image ====== e )  ...text...
    budget end                       ^ (inside)
    moved to             ^ s - ℓ                      (or e, when nothing before fits)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ['PrefillPlan', 'ReuseRules', 'is_reusable', 'last_reusable', 'plan_prefill', 'prefill_grid',
           'shared_head_boundary', 'with_junction', 'with_last_block_end', 'num_remaining_chunks', 'next_chunk_end',
           'is_chunk_end_allowed', 'plain_chunk_ends']

Span = tuple[int, int]


@dataclass(frozen=True)
class PrefillPlan:
    """Chunk ends and save points of one turn's prefill.

    Attributes:
        chunk_ends: token counts (absolute, from position 0) at which each prefill forward
            ends; strictly increasing, last = ``num_tokens``.
        save_points: the chunk ends after which the recurrent state is checkpointed.
        cached_tokens: tokens restored at admission; the first chunk starts here.
        junction: the save point added at a branch point (``save_junction``), or None.
        shared_head: the save point at the end of the request's shared head (its system prompt
            and tool definitions, :func:`shared_head_boundary`), or None.
        local_only: a save point kept in this process only, never put to the Store: the marker a
            model without state adds at its prompt's last full block boundary (a hybrid saves no
            checkpoint there), or None.
    """

    chunk_ends: list[int]
    save_points: list[int]
    cached_tokens: int = 0
    junction: int | None = None
    shared_head: int | None = None
    local_only: int | None = None
    _saves: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, '_saves', frozenset(self.save_points))

    @property
    def num_chunks(self) -> int:
        """Number of prefill forwards (chunks) in the plan."""
        return len(self.chunk_ends)

    @property
    def num_tokens(self) -> int:
        """Tokens of the turn (the last chunk end)."""
        return self.chunk_ends[-1]

    @property
    def chunk_starts(self) -> list[int]:
        """Start token of each chunk: ``[cached_tokens] + chunk_ends[:-1]``."""
        return [self.cached_tokens] + self.chunk_ends[:-1]

    def is_save_point(self, num_tokens: int) -> bool:
        """Whether the state after exactly ``num_tokens`` tokens is to be checkpointed."""
        return num_tokens in self._saves


def _validate_boundary_args(num_tokens: int, block_size: int, alignment: int, token_lookahead: int,
                            recompute_blocks: int, multimodal_spans: Sequence[Span]) -> None:
    if num_tokens < 1:
        raise ValueError(f'num_tokens must be >= 1, got {num_tokens}')
    if block_size < 1:
        raise ValueError(f'block_size must be >= 1, got {block_size}')
    if alignment < 1 or alignment % block_size != 0:
        raise ValueError(f'alignment (prefill_save_alignment) must be a positive multiple of '
                         f'block_size={block_size}, got {alignment}')
    if token_lookahead < 0:
        raise ValueError(f'token_lookahead must be >= 0, got {token_lookahead}')
    if recompute_blocks < 0:
        raise ValueError(f'recompute_blocks must be >= 0, got {recompute_blocks}')
    for span in multimodal_spans:
        start, end = span
        if not 0 <= start < end:
            raise ValueError(f'multimodal_spans entries must satisfy 0 <= s < e, got {span}')


def _upper_bound(num_tokens: int, block_size: int, token_lookahead: int, recompute_blocks: int) -> int:
    """Largest b allowed by rules 2 and 3 of is_reusable (may be <= 0)."""
    rule2 = num_tokens - max(1, token_lookahead)
    rule3 = (num_tokens - 1) // block_size * block_size - recompute_blocks * block_size
    return min(rule2, rule3)


def _span_conflict(b: int, token_lookahead: int, spans: Sequence[Span]) -> int | None:
    """Largest candidate below ``b`` that may clear the first span violating rule 4, or None.

    A span with ``s < b < e`` is cleared by any b' <= s; one with ``s < b + ℓ < e`` by any
    b' <= s - ℓ (moving down can only clear it from below).
    """
    for start, end in spans:
        if start < b < end:
            return start
        if start < b + token_lookahead < end:
            return start - token_lookahead
    return None


def _largest_reusable_at_most(limit: int, num_tokens: int, block_size: int, alignment: int,
                              token_lookahead: int, recompute_blocks: int,
                              spans: Sequence[Span]) -> int | None:
    """Largest reusable b <= ``limit`` for an input of ``num_tokens`` tokens, or None."""
    bound = min(limit, _upper_bound(num_tokens, block_size, token_lookahead, recompute_blocks))
    b = bound // alignment * alignment
    while b > 0:
        clear_below = _span_conflict(b, token_lookahead, spans)
        if clear_below is None:
            return b
        # jump straight past the offending span, in whole alignments (clear_below < b)
        b = clear_below // alignment * alignment
    return None


def is_chunk_end_allowed(b: int, num_tokens: int, token_lookahead: int = 0,
                         multimodal_spans: Sequence[Span] = ()) -> bool:
    """Whether a prefill forward may end after ``b`` tokens: ``b == num_tokens`` (the input's end
    never splits anything), or no span ``[s, e)`` has ``s < b < e`` or ``s < b + ℓ < e``."""
    return b == num_tokens or _span_conflict(b, token_lookahead, multimodal_spans) is None


def _chunk_end(start: int, limit: int, num_tokens: int, token_lookahead: int, spans: Sequence[Span]) -> int:
    """Where a chunk from ``start`` with budget end ``limit`` ends: the largest allowed end in
    ``(start, limit]``; if there is none (a span wider than the budget), the smallest allowed
    end above ``limit`` (at most ``num_tokens``)."""
    b = limit
    while b > start:
        if b == num_tokens:
            return b
        clear_below = _span_conflict(b, token_lookahead, spans)
        if clear_below is None:
            return b
        b = clear_below                        # < b: jump to the offending span's lower edge
    b = limit + 1
    while b < num_tokens:
        # the lowest end that clears every span violated at b (each candidate only moves up)
        up = b
        for s, e in spans:
            if s < b < e:
                up = max(up, e)
            elif s < b + token_lookahead < e:
                up = max(up, e - token_lookahead)
        if up == b:
            return b
        b = up
    return num_tokens


def plain_chunk_ends(start: int, num_tokens: int, chunk_size: int, token_lookahead: int = 0,
                     multimodal_spans: Sequence[Span] = ()) -> list[int]:
    """Chunk ends of tokens ``[start, num_tokens)`` without save points: chunks of ``chunk_size``
    tokens, each end moved to a span edge as in :func:`plan_prefill` (empty when
    ``start >= num_tokens``)."""
    ends, h = [], start
    while h < num_tokens:
        h = _chunk_end(h, min(h + chunk_size, num_tokens), num_tokens, token_lookahead, multimodal_spans)
        ends.append(h)
    return ends


def is_reusable(b: int, num_tokens: int, block_size: int, alignment: int, token_lookahead: int = 0,
                recompute_blocks: int = 0, multimodal_spans: Sequence[Span] = ()) -> bool:
    """Whether boundary ``b`` (tokens) of an ``num_tokens``-token input is reusable.

    Rules: (1) ``b > 0`` and ``b % alignment == 0``; (2) ``b <= n - max(1, ℓ)``;
    (3) ``b + r·B <= floor_B(n - 1)``; (4) no span ``[s, e)`` has ``s < b < e`` or
    ``s < b + ℓ < e``.

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    _validate_boundary_args(num_tokens, block_size, alignment, token_lookahead, recompute_blocks,
                            multimodal_spans)
    if b <= 0 or b % alignment != 0:
        return False
    if b > _upper_bound(num_tokens, block_size, token_lookahead, recompute_blocks):
        return False
    return _span_conflict(b, token_lookahead, multimodal_spans) is None


def last_reusable(num_tokens: int, block_size: int, alignment: int, token_lookahead: int = 0,
                  recompute_blocks: int = 0, multimodal_spans: Sequence[Span] = ()) -> int | None:
    """The largest reusable boundary (tokens) of an ``num_tokens``-token input, or None.

    Candidates are multiples of ``alignment`` visited downward from the bound set by rules 2
    and 3; a span violating rule 4 makes the search jump below it, so the cost is
    O(len(spans) · visited candidates) with at most one candidate per span.

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    _validate_boundary_args(num_tokens, block_size, alignment, token_lookahead, recompute_blocks,
                            multimodal_spans)
    return _largest_reusable_at_most(num_tokens, num_tokens, block_size, alignment, token_lookahead,
                                     recompute_blocks, multimodal_spans)


def shared_head_boundary(shared_head_tokens: int | None, num_tokens: int, block_size: int, alignment: int,
                         token_lookahead: int = 0, recompute_blocks: int = 0,
                         multimodal_spans: Sequence[Span] = ()) -> int | None:
    """The checkpoint boundary (tokens) of a request's shared head: the largest reusable boundary
    ``<= shared_head_tokens``, or None (no head given, or no reusable boundary in it).

    The shared head is the part of a chat prompt every session of the same agent sends: the
    rendered system/developer messages and tool definitions, up to the first user or assistant
    message (``shared_head_tokens``, computed by the serving layer from the chat template).

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    _validate_boundary_args(num_tokens, block_size, alignment, token_lookahead, recompute_blocks,
                            multimodal_spans)
    if shared_head_tokens is None:
        return None
    if shared_head_tokens < 0:
        raise ValueError(f'shared_head_tokens must be >= 0 or None, got {shared_head_tokens}')
    return _largest_reusable_at_most(shared_head_tokens, num_tokens, block_size, alignment, token_lookahead,
                                     recompute_blocks, multimodal_spans)


def _grid(start: int, chunk_size: int, head: int | None, args: tuple) -> list[int]:
    """The chunk ends of :func:`prefill_grid` from ``start`` (validated arguments; ``head`` is
    the shared head's boundary or None)."""
    num_tokens, _, _, token_lookahead, _, spans = args
    ends, h = [], start
    while h < num_tokens:
        end = min(h + chunk_size, num_tokens)
        if head is not None and h < head < end:
            end = head                          # the head's boundary is reusable: an allowed end
        else:
            boundary = _largest_reusable_at_most(end, *args)
            if boundary is not None and boundary > h:
                end = boundary
            else:
                # no reusable boundary within the budget: the plain end, off any span (which may
                # run past the budget to the end of a span)
                end = _chunk_end(h, end, num_tokens, token_lookahead, spans)
        ends.append(end)
        h = end
    return ends


def prefill_grid(num_tokens: int, start: int, chunk_size: int, block_size: int, alignment: int,
                 token_lookahead: int = 0, recompute_blocks: int = 0, multimodal_spans: Sequence[Span] = (),
                 shared_head_tokens: int | None = None) -> list[int]:
    """Where the prefill forwards of a hybrid model's input end, from token ``start`` on: the
    same ends with prefix caching off and on, under every save policy.

    From h = ``start`` each forward ends at ``min(h + P, n)``, moved down to the largest reusable
    boundary in ``(h, end]`` if there is one, else to the largest allowed chunk end
    (:func:`is_chunk_end_allowed`) in ``(h, end]``, else up to the first allowed end past it;
    a forward that would cross the shared head's boundary (:func:`shared_head_boundary`) ends
    there instead. Each end depends only on h and the input (n, P, A, B, ℓ, r, spans, head), so
    a restore at an end of the cold grid continues on that grid, and in floating point every
    forward after it computes the same numbers as the cold prefill. The largest reusable
    boundary b* is always an end (no step can pass it: it is the largest reusable boundary at
    most any budget end at or past it).

    Returns:
        The chunk ends (tokens, absolute), strictly increasing, the last one ``num_tokens``;
        empty when ``start >= num_tokens``.

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    _validate_boundary_args(num_tokens, block_size, alignment, token_lookahead, recompute_blocks,
                            multimodal_spans)
    if chunk_size < 1:
        raise ValueError(f'chunk_size must be >= 1, got {chunk_size}')
    args = (num_tokens, block_size, alignment, token_lookahead, recompute_blocks, tuple(multimodal_spans))
    head = shared_head_boundary(shared_head_tokens, *args)
    return _grid(start, chunk_size, head, args)


def plan_prefill(num_tokens: int, cached_tokens: int, chunk_size: int, block_size: int, alignment: int,
                 last_only: bool, token_lookahead: int = 0, recompute_blocks: int = 0,
                 multimodal_spans: Sequence[Span] = (), shared_head_tokens: int | None = None) -> PrefillPlan:
    """Plan one turn's prefill chunks and state save points.

    Args:
        num_tokens: n, tokens of the turn's input (>= 1).
        cached_tokens: c, tokens restored from a cache hit (0 <= c < n).
        chunk_size: P, most tokens per prefill chunk (``max_prefill_token_num``).
        block_size: B, tokens per KV block.
        alignment: A, checkpoint boundaries are multiples of A (a positive multiple of B).
        last_only: True for ``prefill_save_last_only``: save only at ``b* = last_reusable(n)``
            (and at the shared head's boundary); False for the default policy: save at every
            reusable chunk end.
        token_lookahead: ℓ, input tokens past a chunk end its forward also reads.
        recompute_blocks: r, full blocks past a restored boundary a restore must also match.
        multimodal_spans: half-open ``(s, e)`` token ranges never split by a save point or a
            chunk end.
        shared_head_tokens: tokens of the request's shared head (system prompt and tools), or
            None: its boundary (:func:`shared_head_boundary`) is a chunk end and, when above c,
            a save point under either policy.

    Returns:
        :class:`PrefillPlan` whose chunk ends are :func:`prefill_grid` from c, under either
        policy. Default: every reusable chunk end is a save point. Last-only: b* (always a
        chunk end of the grid) is the save point, plus the shared head's boundary; no save
        point at or below c.

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    _validate_boundary_args(num_tokens, block_size, alignment, token_lookahead, recompute_blocks,
                            multimodal_spans)
    if not 0 <= cached_tokens < num_tokens:
        raise ValueError(f'cached_tokens must satisfy 0 <= cached_tokens < num_tokens={num_tokens}, '
                         f'got {cached_tokens}')
    if chunk_size < 1:
        raise ValueError(f'chunk_size must be >= 1, got {chunk_size}')
    args = (num_tokens, block_size, alignment, token_lookahead, recompute_blocks, tuple(multimodal_spans))
    head = shared_head_boundary(shared_head_tokens, *args)
    chunk_ends = _grid(cached_tokens, chunk_size, head, args)
    if last_only:
        target = _largest_reusable_at_most(num_tokens, *args)
        save_points = sorted({b for b in (target, head) if b is not None and b > cached_tokens})
    else:
        save_points = [b for b in chunk_ends if b < num_tokens and is_reusable(b, *args)]
    return PrefillPlan(chunk_ends=chunk_ends, save_points=save_points, cached_tokens=cached_tokens,
                       shared_head=head if head is not None and head > cached_tokens else None)


@dataclass(frozen=True)
class ReuseRules:
    """The reusability rules of one input, as one value: the planner, the local prefix-cache
    match and the Store lookup all ask it, so the rules are written once.

    Attributes:
        num_tokens: n, tokens of the input (for a re-admitted sequence: prompt plus the tokens
            generated so far).
        block_size: B, tokens per KV block.
        alignment: A, checkpoint boundaries are multiples of A (a positive multiple of B).
        token_lookahead: ℓ, input tokens past a chunk end that its forward also reads.
        recompute_blocks: r, full blocks past a restored boundary a restore must also match.
        multimodal_spans: half-open ``(s, e)`` token ranges that no boundary may split.

    Raises:
        ValueError: an argument is out of range (the message names it).
    """
    num_tokens: int
    block_size: int
    alignment: int
    token_lookahead: int = 0
    recompute_blocks: int = 0
    multimodal_spans: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        _validate_boundary_args(self.num_tokens, self.block_size, self.alignment, self.token_lookahead,
                                self.recompute_blocks, self.multimodal_spans)

    @classmethod
    def for_sequence(cls, seq, block_size: int, alignment: int) -> 'ReuseRules':
        """The rules for a sequence as it stands now (its tokens, ℓ, r and spans)."""
        return cls(seq.num_tokens, block_size, alignment, seq.token_lookahead, seq.recompute_blocks,
                   tuple(seq.multimodal_spans))

    @property
    def _args(self) -> tuple:
        return (self.num_tokens, self.block_size, self.alignment, self.token_lookahead, self.recompute_blocks,
                self.multimodal_spans)

    def is_reusable(self, b: int) -> bool:
        """Whether boundary ``b`` (tokens) may carry a reusable checkpoint of this input."""
        return is_reusable(b, *self._args)

    def last_reusable(self) -> int | None:
        """The largest reusable boundary, or None."""
        return _largest_reusable_at_most(self.num_tokens, *self._args)

    def last_reusable_at_most(self, limit: int) -> int | None:
        """The largest reusable boundary ``<= limit``, or None."""
        return _largest_reusable_at_most(limit, *self._args)

    def restorable(self, b: int, matched_blocks: int) -> bool:
        """Whether a cached prefix of ``b`` tokens may seed this input when ``matched_blocks``
        leading full blocks of it are known cached: ``b`` is reusable and the r blocks a
        restore also needs are among the matched ones."""
        return b // self.block_size + self.recompute_blocks <= matched_blocks and self.is_reusable(b)

    def restore_candidates(self, above: int, matched_blocks: int) -> list[int]:
        """Reusable boundaries ``b > above`` with ``b / B + r <= matched_blocks``, deepest first."""
        top = min(self.num_tokens, (matched_blocks - self.recompute_blocks) * self.block_size)
        top = top // self.alignment * self.alignment
        return [b for b in range(top, above, -self.alignment) if b > 0 and self.is_reusable(b)]

    def plan(self, cached_tokens: int, chunk_size: int, last_only: bool,
             shared_head_tokens: int | None = None) -> PrefillPlan:
        """:func:`plan_prefill` for this input."""
        return plan_prefill(self.num_tokens, cached_tokens, chunk_size, self.block_size, self.alignment, last_only,
                            self.token_lookahead, self.recompute_blocks, self.multimodal_spans, shared_head_tokens)

    def grid(self, start: int, chunk_size: int, shared_head_tokens: int | None = None) -> list[int]:
        """:func:`prefill_grid` for this input: the chunk ends without any save point."""
        return prefill_grid(self.num_tokens, start, chunk_size, self.block_size, self.alignment, self.token_lookahead,
                            self.recompute_blocks, self.multimodal_spans, shared_head_tokens)


def with_junction(plan: PrefillPlan, junction: int) -> PrefillPlan:
    """``plan`` with one more save point at ``junction`` (a reusable boundary inside the plan's
    range): the chunk containing it is split there, so a forward ends exactly at it. Chunks only
    get shorter, so every chunk still holds at most the plan's chunk size."""
    if junction in plan.save_points or not plan.cached_tokens < junction < plan.num_tokens:
        return plan
    return PrefillPlan(sorted(set(plan.chunk_ends) | {junction}), sorted(plan.save_points + [junction]),
                       plan.cached_tokens, junction, plan.shared_head)


def with_last_block_end(plan: PrefillPlan, block_size: int, token_lookahead: int = 0,
                        multimodal_spans: Sequence[Span] = ()) -> PrefillPlan:
    """``plan`` with a forward also ending at the input's last block boundary ``t = floor_B(n)``,
    so the recurrent state there exists even when the reply then crosses no block boundary: the
    turn-end checkpoint (``decode_save_last``) is taken at ``floor_B(n + output - 1)``, which is
    ``t`` for a reply shorter than ``B - (n - t) + 1`` tokens. The chunk holding ``t`` is split
    there (one more forward of ``n - t < B`` tokens), so chunks only get shorter.

    Unchanged when ``t`` is already a chunk end, is not above ``cached_tokens``, equals ``n``,
    leaves fewer than ``ℓ`` tokens after it, or is not an allowed chunk end (inside a multimodal
    span, :func:`is_chunk_end_allowed`). Save points are kept as they are.
    """
    n = plan.num_tokens
    t = n // block_size * block_size
    if (t in plan.chunk_ends or not plan.cached_tokens < t < n or t + token_lookahead > n
            or not is_chunk_end_allowed(t, n, token_lookahead, multimodal_spans)):
        return plan
    return PrefillPlan(sorted(plan.chunk_ends + [t]), list(plan.save_points), plan.cached_tokens, plan.junction,
                       plan.shared_head)


def num_remaining_chunks(plan: PrefillPlan, num_computed: int) -> int:
    """Prefill forwards still to run once ``num_computed`` tokens (absolute) are computed."""
    return sum(1 for end in plan.chunk_ends if end > num_computed)


def next_chunk_end(plan: PrefillPlan, num_computed: int) -> int | None:
    """Where the next prefill forward ends after ``num_computed`` tokens, or None when done."""
    for end in plan.chunk_ends:
        if end > num_computed:
            return end
    return None
