"""The Store write simulator's model: scenarios, save policies, per-turn results, and the
planner loop that charges ``saves·S + new_blocks·K_blk`` per request.

With a sliding window ``W`` (every paged layer slides: ``window``) a save at b puts only the
blocks its window reads, ``[window_first_block(b), b/B)`` (``floor((b - W + 1)/B)`` on), so
``new_blocks`` counts only those; a model without state is charged ``S = 0`` per save (its
state object is an empty marker).

A model of global and sliding-window layers whose window layers keep a pool of their own
(``window_rows`` = W of that group, ``window_block_bytes`` = K_win; ``kv_block_bytes`` is then
K_glob, the global layers' row) puts, per save at b, the global rows of every block below b not
yet put and the window rows of the blocks ``[window_first_block(b, W), b/B)`` not yet put, as
objects of their own: ``len(save_points)·S + new_global_blocks·K_glob + new_window_blocks·K_win``.
A turn-end save whose window blocks the reply's decode gave back (``window_first_block(te, W) <
window_first_block(n + out - 1, W)``) is neither restorable nor put.

The byte formula, the cache-hit rule and the policies are described in
``benchmark/simulate_store_writes.py`` (the CLI, which re-exports every name here) and in
docs/en/advance/store.md, "The byte formula".
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmdeploy.pytorch.cache_specs import window_first_block  # noqa: E402
from lmdeploy.pytorch.paging.prefill_plan import PrefillPlan, is_reusable, plan_prefill, with_last_block_end  # noqa: E402

KTOK = 1024
DEFAULT_CHUNK, DEFAULT_BLOCK, DEFAULT_ALIGNMENT = 8192, 64, 1024


@dataclass(frozen=True)
class Request:
    """One request of a scenario, as the simulator sees it.

    Attributes:
        num_tokens: n, tokens of its input.
        output_tokens: tokens of its reply (>= 1; the last one is sampled, never computed).
        common_prefix: for each earlier request, in order, how many leading tokens the two
            share (tokens).
        head_tokens: tokens of its shared head (a chat's system prompt and tools; the engine
            saves at its last reusable boundary too), or None.
    """

    num_tokens: int
    output_tokens: int
    common_prefix: tuple[int, ...] = ()
    head_tokens: int | None = None


@dataclass(frozen=True)
class Scenario:
    """An append-only conversation: ``input_lengths[t]`` tokens are the input of turn t; each
    turn starts with the same ``head_tokens`` tokens of system prompt and tools (None: no head)."""

    name: str
    input_lengths: tuple[int, ...]
    output_tokens: int = 16
    head_tokens: int | None = None

    def scaled(self, factor: Fraction) -> 'Scenario':
        """The scenario with every token count multiplied by ``factor`` (exactly).

        Raises:
            ValueError (``scale``): a scaled input length is not a positive integer.
        """
        def one(x: int) -> int:
            y = Fraction(x) * factor
            if y.denominator != 1 or y < 1:
                raise ValueError(f'scale {factor} makes {x} tokens of {self.name!r} non-integral')
            return int(y)
        # the reply length is informational (already inside the next input): round it leniently
        return Scenario(self.name, tuple(one(n) for n in self.input_lengths),
                        max(1, math.floor(self.output_tokens * factor)),
                        None if self.head_tokens is None else one(self.head_tokens))

    def requests(self) -> list[Request]:
        """The turns as requests: turn t shares with turn j < t its input and reply (as far as
        turn t's input reaches), ``min(n_j + output_tokens, n_t)`` tokens.

        Raises:
            ValueError (``input_lengths``): empty or decreasing turns, a turn < 1 token, or
            ``output_tokens`` < 1; (``head_tokens``) negative or longer than the first turn.
        """
        lengths = self.input_lengths
        if not lengths or any(b < a for a, b in zip(lengths, lengths[1:])) or lengths[0] < 1:
            raise ValueError(f'scenario input_lengths must be non-empty, positive and non-decreasing, got {lengths}')
        if self.output_tokens < 1:
            raise ValueError(f'scenario output_tokens must be >= 1, got {self.output_tokens}')
        if self.head_tokens is not None and not 0 <= self.head_tokens <= lengths[0]:
            raise ValueError(f'scenario head_tokens must be in [0, {lengths[0]}] (the first turn), got {self.head_tokens}')
        return [Request(n, self.output_tokens, tuple(min(m + self.output_tokens, n) for m in lengths[:t]),
                        self.head_tokens) for t, n in enumerate(lengths)]


@dataclass(frozen=True)
class Branching:
    """``siblings`` requests sent one after another; each is ``shared_tokens`` tokens common to
    all of them followed by ``suffix_tokens`` tokens of its own (they differ from the first one).
    The first ``head_tokens`` of the shared tokens are a chat's shared head (system prompt and
    tools, where the engine also saves), or None: sessions of one agent."""

    name: str
    shared_tokens: int
    suffix_tokens: int
    siblings: int = 4
    output_tokens: int = 512
    head_tokens: int | None = None

    @property
    def input_lengths(self) -> tuple[int, ...]:
        return (self.shared_tokens + self.suffix_tokens, ) * self.siblings

    def scaled(self, factor: Fraction) -> 'Branching':
        """The scenario with every token count multiplied by ``factor`` (exactly).

        Raises:
            ValueError (``scale``): a scaled token count is not an integer.
        """
        def one(x: int) -> int:
            y = Fraction(x) * factor
            if y.denominator != 1:
                raise ValueError(f'scale {factor} makes {x} tokens of {self.name!r} non-integral')
            return int(y)
        return Branching(self.name, one(self.shared_tokens), one(self.suffix_tokens), self.siblings,
                         max(1, math.floor(self.output_tokens * factor)),
                         None if self.head_tokens is None else one(self.head_tokens))

    def requests(self) -> list[Request]:
        """The siblings as requests; any two share exactly ``shared_tokens`` tokens.

        Raises:
            ValueError (``branching``): ``shared_tokens`` < 0, ``suffix_tokens`` < 1,
            ``siblings`` < 1 or ``output_tokens`` < 1; (``head_tokens``) negative or more than
            ``shared_tokens``.
        """
        if self.shared_tokens < 0 or self.suffix_tokens < 1 or self.siblings < 1 or self.output_tokens < 1:
            raise ValueError(f'branching scenario needs shared_tokens >= 0, suffix_tokens >= 1, siblings >= 1 and '
                             f'output_tokens >= 1, got {self}')
        if self.head_tokens is not None and not 0 <= self.head_tokens <= self.shared_tokens:
            raise ValueError(f'branching head_tokens must be in [0, shared_tokens={self.shared_tokens}], '
                             f'got {self.head_tokens}')
        n = self.shared_tokens + self.suffix_tokens
        return [Request(n, self.output_tokens, (self.shared_tokens, ) * i, self.head_tokens)
                for i in range(self.siblings)]


def seed_scenarios() -> list[Scenario]:
    """The six seed-table scenarios (K = 1024 tokens)."""
    singles = [Scenario(f'{k}K+64', (k * KTOK + 64, ), 16) for k in (8, 16, 32, 64)]
    multi = [Scenario(f'32K+64 x5 turns, +{g}K/turn', tuple(32 * KTOK + 64 + t * g * KTOK for t in range(5)), 512)
             for g in (4, 16)]
    return singles + multi


def branching_scenario() -> Branching:
    """Four siblings sharing 20K + 320 tokens, each with a 2K suffix of its own, 512-token replies."""
    return Branching('4 siblings 20K+320 +2K', 20 * KTOK + 320, 2 * KTOK, 4, 512)


@dataclass(frozen=True)
class Policy:
    """A checkpoint save policy: the engine config fields it turns on."""

    last_only: bool = False           # prefill_save_last_only
    decode_save_last: bool = False    # turn-end checkpoint when a request finishes
    save_junction: bool = False       # one save at a branch point
    # the former turn-end rule, for comparison only (no engine config): the turn-end put replaced
    # the Store put of the last prefill save point, which then served no regenerate or edit
    replacing: bool = False

    @property
    def name(self) -> str:
        extras = (['turn-end-replacing' if self.replacing else 'turn-end'] * self.decode_save_last
                  + ['junction'] * self.save_junction)
        return '+'.join(['last-only' if self.last_only else 'default'] + extras)

    @classmethod
    def parse(cls, name: str) -> 'Policy':
        """``'default'``, ``'last-only'``, optionally followed by ``+turn-end`` (or the former
        rule, ``+turn-end-replacing``) and/or ``+junction``.

        Raises:
            ValueError (``policies``): an unknown name.
        """
        base, *extras = name.strip().split('+')
        turn_end = {'turn-end', 'turn-end-replacing'} & set(extras)
        if base not in ('default', 'last-only') or not set(extras) <= {'turn-end', 'turn-end-replacing', 'junction'} \
                or len(turn_end) > 1:
            raise ValueError(f'policies: unknown policy {name!r} '
                             f'(want default|last-only[+turn-end|+turn-end-replacing][+junction])')
        return cls(base == 'last-only', bool(turn_end), 'junction' in extras, 'turn-end-replacing' in extras)


DEFAULT, LAST_ONLY = Policy(), Policy(last_only=True)
TURN_END, JUNCTION = Policy(True, decode_save_last=True), Policy(True, save_junction=True)


@dataclass(frozen=True)
class TurnResult:
    """Store writes of one turn (request) under one policy. Bytes are per rank.

    ``save_points`` are the prefill save points taken (a junction and the shared head's included),
    ``turn_end_point`` the turn-end checkpoint, ``junction`` the save point added at a branch point,
    ``shared_head`` the save point at the end of the shared head (taken), ``local_only``
    the save point kept in the local cache only (the former ``+turn-end-replacing`` rule: the turn-end put replaced its Store put).
    """

    num_tokens: int
    cached_tokens: int
    chunk_ends: list[int]
    save_points: list[int]
    new_kv_blocks: int
    state_bytes: int
    kv_bytes: int
    turn_end_point: int | None = None
    junction: int | None = None
    local_only: int | None = None
    shared_head: int | None = None
    new_window_blocks: int = 0      # window objects put (window rows; else 0)
    window_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.kv_bytes + self.window_bytes

    @property
    def num_saves(self) -> int:
        """State snapshots put to the Store (a save point kept ``local_only`` is not one)."""
        return len(self.save_points) + (self.turn_end_point is not None) - (self.local_only is not None)

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens computed by the prefill, ``n - c`` (what drives TTFT)."""
        return self.num_tokens - self.cached_tokens


@dataclass(frozen=True)
class PolicyResult:
    """All turns of a scenario under one policy."""

    turns: list[TurnResult]

    @property
    def total_bytes(self) -> int:
        return sum(t.total_bytes for t in self.turns)

    @property
    def num_saves(self) -> int:
        return sum(t.num_saves for t in self.turns)


@dataclass(frozen=True)
class SimulationResult:
    """Both policies on one scenario; ``reduction`` = 1 - last_only bytes / default bytes (exact)."""

    scenario: Scenario
    default: PolicyResult
    last_only: PolicyResult

    @property
    def reduction(self) -> Fraction:
        if self.default.total_bytes == 0:
            return Fraction(0)
        return 1 - Fraction(self.last_only.total_bytes, self.default.total_bytes)


def _junction(n: int, cached: int, matched: int, block_size: int, alignment: int, token_lookahead: int,
              recompute_blocks: int) -> int | None:
    """The largest reusable boundary ``j`` of an ``n``-token input with ``cached < j <= matched``."""
    for b in range(matched // alignment * alignment, cached, -alignment):
        if is_reusable(b, n, block_size, alignment, token_lookahead, recompute_blocks):
            return b
    return None


def simulate_policy(requests: Sequence[Request], policy: Policy, state_bytes: int, kv_block_bytes: int,
                     chunk_size: int, block_size: int, alignment: int, token_lookahead: int,
                     recompute_blocks: int, window: int | None = None, window_block_bytes: int = 0,
                     window_rows: int | None = None) -> PolicyResult:
    B, r = block_size, recompute_blocks
    windowed: set[tuple[int, int]] = set()          # Store window objects (prefix owner, block index)
    checkpoints: list[tuple[int, int, bool]] = []   # (request, boundary, is turn-end) of every save so far
    saved: set[tuple[int, int]] = set()             # Store state objects (prefix owner, boundary)
    stored: set[tuple[int, int]] = set()            # Store KV objects (prefix owner, block index)
    computed: list[int] = []                        # tokens each earlier request computed (its blocks stay cached)
    turns = []
    for i, req in enumerate(requests):
        n, common = req.num_tokens, req.common_prefix

        def owner(tokens: int) -> int:
            """The first request whose leading ``tokens`` tokens equal this one's: Store keys
            hash the prefix, so equal prefixes are one object."""
            return next((j for j in range(i) if common[j] >= tokens), i)

        # full blocks cached locally from earlier requests; one prompt token is always computed
        matched_blocks = min((n - 1) // B, max((min(common[j], computed[j]) // B for j in range(i)), default=0))

        def restorable(b: int, turn_end: bool) -> bool:
            # a turn-end boundary is a block boundary; aligned ones keep the rules with A
            return b // B + r <= matched_blocks and is_reusable(b, n, B, B if turn_end else alignment,
                                                                token_lookahead, r)

        cached = max((b for j, b, turn_end in checkpoints if b <= common[j] and restorable(b, turn_end)), default=0)
        plan = plan_prefill(n, cached, chunk_size, B, alignment, policy.last_only, token_lookahead, r,
                            shared_head_tokens=req.head_tokens)
        chunk_ends, save_points, junction = list(plan.chunk_ends), list(plan.save_points), None
        if policy.save_junction and matched_blocks * B > cached:
            j = _junction(n, cached, matched_blocks * B, B, alignment, token_lookahead, r)
            if j is not None and j not in save_points:
                junction = j        # the chunk containing j is split there: a forward ends at j
                chunk_ends, save_points = sorted(set(chunk_ends) | {j}), sorted(save_points + [j])
        done = n + req.output_tokens - 1        # the last sampled token is never computed
        turn_end = None
        if policy.decode_save_last:
            # as the engine plans it: a prompt forward also ends at floor_B(n) (with_last_block_end)
            chunk_ends = with_last_block_end(PrefillPlan(chunk_ends, save_points, cached, junction), B,
                                             token_lookahead).chunk_ends
            te = done // B * B
            # decode forwards end at every count in [n, done]; prompt forwards at the chunk ends
            if te >= n // B * B and (te >= n or te in chunk_ends) and te > max(save_points + [cached]) \
                    and window_first_block(te, window_rows, B) >= window_first_block(done, window_rows, B):
                turn_end = te       # (with window rows: only while the sequence still holds te's window)
        # every save point is put, the turn end too: the turn-end state serves only the exact
        # continuation, the prompt's own one a regenerate or an edited reply. (The former rule,
        # ``replacing``, kept the last prefill save point local only.)
        local_only = None
        if turn_end is not None and policy.replacing:
            local_only = max((b for b in save_points if b != junction), default=None)
        taken, new_blocks, new_window, puts = [], 0, 0, 0
        for b in save_points + ([turn_end] if turn_end is not None else []):
            if b == local_only:
                taken.append(b)
                checkpoints.append((i, b, False))
                continue
            if (owner(b), b) in saved:
                continue            # the object exists: the save is skipped
            saved.add((owner(b), b))
            taken.append(b)
            puts += 1
            checkpoints.append((i, b, b == turn_end))
            for k in range(window_first_block(b, window, B), b // B):
                block = (owner((k + 1) * B), k)
                if block not in stored:
                    stored.add(block)
                    new_blocks += 1
            for k in range(window_first_block(b, window_rows, B), b // B if window_rows else 0):
                block = (owner((k + 1) * B), k)
                if block not in windowed:
                    windowed.add(block)
                    new_window += 1
        computed.append(done)
        turns.append(TurnResult(n, cached, chunk_ends, [b for b in taken if b != turn_end], new_blocks,
                                puts * state_bytes, new_blocks * kv_block_bytes,
                                turn_end if turn_end in taken else None, junction if junction in taken else None,
                                local_only, plan.shared_head if plan.shared_head in taken else None,
                                new_window, new_window * window_block_bytes))
    return PolicyResult(turns)


def _requests(scenario: Scenario | Branching | Sequence[int]) -> tuple[Scenario | Branching, list[Request]]:
    if not isinstance(scenario, (Scenario, Branching)):
        scenario = Scenario('custom', tuple(int(n) for n in scenario))
    return scenario, scenario.requests()


def _check_sizes(state_bytes: int, kv_block_bytes: int, window: int | None = None, window_block_bytes: int = 0,
                 window_rows: int | None = None) -> None:
    for name, w in (('window', window), ('window_rows', window_rows)):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f'{name} must be an int >= 1 tokens or None, got {w!r}')
    if window is not None and window_rows is not None:
        raise ValueError('window (every paged layer slides) and window_rows (a window group of its own) '
                         'exclude each other')
    if window_block_bytes < 0:
        raise ValueError(f'window_block_bytes must be >= 0, got {window_block_bytes}')
    if state_bytes < 0:
        raise ValueError(f'state_bytes must be >= 0, got {state_bytes}')
    if kv_block_bytes < 0:
        raise ValueError(f'kv_block_bytes must be >= 0, got {kv_block_bytes}')


def simulate(scenario: Scenario | Branching | Sequence[int], state_bytes: int, kv_block_bytes: int, *,
             chunk_size: int, block_size: int, alignment: int, token_lookahead: int = 0,
             recompute_blocks: int = 0, window: int | None = None, window_block_bytes: int = 0,
             window_rows: int | None = None) -> SimulationResult:
    """Store bytes and save points of every turn of ``scenario`` under the default and last-only policies.

    Args:
        scenario: a :class:`Scenario`, a :class:`Branching`, or the input lengths (tokens) of a
            conversation's turns, non-decreasing.
        state_bytes: S, bytes of one state snapshot (or relative units).
        kv_block_bytes: K_blk, bytes of one KV block over all full-attention layers.
        chunk_size, block_size, alignment, token_lookahead, recompute_blocks: P, B, A, ℓ, r.
        window: W, tokens, when every paged layer slides (a save puts only its window's
            blocks); None: every block below the save point.
        window_block_bytes: K_win, bytes of one block row of a window group with a pool of its
            own (``kv_block_bytes`` is then K_glob, the global layers' row).
        window_rows: that group's window W (tokens): a save puts its global rows of every block
            and its window rows of the blocks its window reads; None: no such group.

    Raises:
        ValueError: a size is negative, turns shrink, a planning argument is invalid,
            ``window`` or ``window_rows`` is below 1, or both are given.
    """
    scenario, requests = _requests(scenario)
    _check_sizes(state_bytes, kv_block_bytes, window, window_block_bytes, window_rows)
    args = (state_bytes, kv_block_bytes, chunk_size, block_size, alignment, token_lookahead, recompute_blocks,
            window, window_block_bytes, window_rows)
    return SimulationResult(scenario, simulate_policy(requests, DEFAULT, *args),
                            simulate_policy(requests, LAST_ONLY, *args))


def simulate_policies(scenario: Scenario | Branching | Sequence[int], state_bytes: int, kv_block_bytes: int, *,
                      policies: Sequence[Policy | str], chunk_size: int, block_size: int, alignment: int,
                      token_lookahead: int = 0, recompute_blocks: int = 0,
                      window: int | None = None, window_block_bytes: int = 0,
                      window_rows: int | None = None) -> dict[str, PolicyResult]:
    """Every turn of ``scenario`` under each of ``policies`` (:class:`Policy` or its name).

    Arguments as :func:`simulate`. Returns ``{policy name: PolicyResult}`` in the given order.

    Raises:
        ValueError: as :func:`simulate`, or an unknown policy name (``policies``).
    """
    scenario, requests = _requests(scenario)
    _check_sizes(state_bytes, kv_block_bytes, window, window_block_bytes, window_rows)
    args = (state_bytes, kv_block_bytes, chunk_size, block_size, alignment, token_lookahead, recompute_blocks,
            window, window_block_bytes, window_rows)
    chosen = [p if isinstance(p, Policy) else Policy.parse(p) for p in policies]
    return {p.name: simulate_policy(requests, p, *args) for p in chosen}
