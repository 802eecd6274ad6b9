"""Request traces for the prefix-cache simulator and the trace replay benchmark: the format,
its reader and writer, token ids for a trace's blocks, three agent-shaped generators, and the
working set of a trace.

Format (JSONL, one object per request, the Mooncake trace's fields plus three optional ones)::

    {"timestamp": 1250, "input_length": 41210, "output_length": 312, "hash_ids": [0, 1, ..., 80],
     "shared_head_tokens": 40000, "session": "cc-7", "continuation": true}

- ``timestamp``: arrival time in milliseconds from the start (non-decreasing down the file);
- ``input_length`` / ``output_length``: prompt and generated tokens;
- ``hash_ids``: one id per 512-token block of the prompt (``ceil(input_length / 512)`` ids; the
  last block may be partial). Equal ids are identical blocks, so two prompts share a prefix
  exactly as far as their lists agree from the start. A partial last block has an id of its own:
  when a later request of the session extends that block, the extended block gets a new id
  (its content differs), so turn t+1 repeats turn t's *full* blocks' ids, as in the published
  Mooncake trace;
- optional ``shared_head_tokens``: tokens of the prompt that every session of the same agent
  shares (system prompt + tool definitions); ``session``: a session id; ``continuation``: the
  request continues an earlier request of its session (a chat with history). Readers accept
  their absence.

Block tokens (:func:`prompt_tokens`): a block's token ids are a deterministic function of
(seed, block id, position in the block), so equal ids give equal tokens and prompts share tokens
exactly as far as their ids agree (two different blocks agree on their first m tokens only by
chance, with probability ``(vocab - lo) ** -m``). At scale s a 512-token block is ``512 / s``
tokens.

Generators (pure functions of their arguments and ``seed``; each returns requests sorted by
timestamp). The committed traces in ``benchmark/traces/`` are written by
``python3 benchmark/traces.py --write benchmark/traces`` with the defaults below (seed 0):

======================== ===================================================================
``claude_code.jsonl``     :func:`claude_code_sessions`: 130 sessions of a coding agent. Every
                          session starts with the same 40,000-token head (system prompt + tool
                          definitions), then its own first prompt (300-3,000 tokens: the
                          task, project notes). Then 6-40 requests; each next one appends the
                          previous reply (50-800 tokens) and a tool result (200-8,000 tokens;
                          15 % of turns a user message of 20-1,500 tokens instead). 4 % of
                          turns are a branch (a retry / edit): the prompt is one of the
                          session's last 5 requests cut inside its new content plus a
                          50-2,000-token edited message; the session goes on from the branch.
                          A context past 120,000 tokens is compacted: head + a
                          2,000-6,000-token summary + a user message. Sessions start uniformly
                          over 9 minutes; the gap after a tool turn is decode time
                          (reply / 60 tok/s) + 0.5-20 s of tool run, after a user turn 5-90 s
                          of think time. 3,009 requests over 1,282 s (2.3/s), 196 M prompt
                          tokens, 14,820 distinct blocks; ideal block hit 96.5 %.
``codex.jsonl``           :func:`codex_sessions`: 140 sessions, the same shape with a
                          12,000-token head, first prompts of 200-2,000 tokens, tool outputs of
                          500-16,000 tokens (10 % user messages), 5-35 requests, branches 3 %,
                          compaction past 150,000 tokens, starts over 10 minutes, tool runs
                          0.5-30 s. 2,586 requests over 1,187 s (2.2/s), 145 M prompt tokens,
                          23,102 distinct blocks; ideal block hit 92.3 %.
``short_chats.jsonl``     :func:`many_short_chats`: 2,000 chat sessions; 12 system prompts of
                          300-6,000 tokens picked by a Zipf law (s = 1.1); 1-6 turns (weights
                          35/25/15/10/8/7 %); user messages 20-2,000 tokens, replies
                          50-1,500; 5 % of turns are regenerations (the identical prompt
                          again). Sessions start as a Poisson process over 12 minutes and the
                          user thinks 30-600 s between turns, so a median of ~500 requests
                          separates two turns of a session. 4,941 requests over 2,298 s
                          (2.2/s), 16.8 M prompt tokens, 11,004 distinct blocks; ideal block
                          hit 73.4 %.
======================== ===================================================================

"Ideal block hit" is :func:`working_set`'s ``ideal_hit_fraction``. Ranges "a-b" are log-uniform
(a value's logarithm is uniform), as lengths of real tool output and messages are closer to
log-normal than uniform. The shapes follow what agent clients send:
a long fixed head, append-only turns carrying the reply and a tool result, occasional
retries/edits and context compaction.

:func:`working_set` gives the distinct blocks and the hit of an infinite 512-token-block cache.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

BLOCK_TOKENS = 512
_OPTIONAL = ('shared_head_tokens', 'session', 'continuation')


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (the fields of a trace line; see the module docstring).

    Attributes:
        timestamp_ms: arrival time, milliseconds from the start of the trace.
        input_length: prompt tokens (>= 1).
        output_length: generated tokens (>= 0).
        hash_ids: one id per 512-token block of the prompt, ``ceil(input_length / 512)`` of them.
        shared_head_tokens: prompt tokens shared by every session of the same agent, or None.
        session: the session id, or None.
        continuation: the request continues an earlier request of its session.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    shared_head_tokens: int | None = None
    session: str | None = None
    continuation: bool = False


# reading and writing ---------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _row(obj, where: str) -> TraceRequest:
    """One validated request from a decoded JSON line; ``where`` prefixes every error."""
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f'{where}: field {name!r}: {why}')
    if not isinstance(obj, dict):
        raise ValueError(f'{where}: expected a JSON object, got {type(obj).__name__}')
    for name in ('timestamp', 'input_length', 'output_length', 'hash_ids'):
        if name not in obj:
            raise bad(name, 'missing')
    ts = obj['timestamp']
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise bad('timestamp', f'must be a finite number >= 0 (ms), got {ts!r}')
    n, out = obj['input_length'], obj['output_length']
    if not _is_int(n) or n < 1:
        raise bad('input_length', f'must be an integer >= 1, got {n!r}')
    if not _is_int(out) or out < 0:
        raise bad('output_length', f'must be an integer >= 0, got {out!r}')
    ids = obj['hash_ids']
    if not isinstance(ids, list):
        raise bad('hash_ids', f'must be a list of integers, got {type(ids).__name__}')
    for i, h in enumerate(ids):
        if not _is_int(h) or h < 0:
            raise bad('hash_ids', f'item {i} must be an integer >= 0, got {h!r}')
    want = -(-n // BLOCK_TOKENS)
    if len(ids) != want:
        raise bad('hash_ids', f'has {len(ids)} ids; input_length {n} needs ceil({n}/{BLOCK_TOKENS}) = {want}')
    head = obj.get('shared_head_tokens')
    if head is not None and (not _is_int(head) or not 0 <= head <= n):
        raise bad('shared_head_tokens', f'must be an integer in [0, input_length={n}] or null, got {head!r}')
    session = obj.get('session')
    if session is not None and not isinstance(session, str):
        raise bad('session', f'must be a string or null, got {session!r}')
    cont = obj.get('continuation', False)
    if not isinstance(cont, bool):
        raise bad('continuation', f'must be true or false, got {cont!r}')
    return TraceRequest(float(ts), n, out, tuple(ids), head, session, cont)


def parse_trace(lines: Iterable[str], name: str = '<trace>') -> list[TraceRequest]:
    """Requests from JSONL text lines (blank lines skipped); see :func:`load_trace`."""
    rows: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f'{name}:{lineno}'
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f'{where}: not valid JSON: {err}') from None
        row = _row(obj, where)
        if rows and row.timestamp_ms < rows[-1].timestamp_ms:
            raise ValueError(f'{where}: field \'timestamp\': {obj["timestamp"]!r} is before the previous '
                             f'request\'s {rows[-1].timestamp_ms:g} (timestamps must be non-decreasing)')
        rows.append(row)
    return rows


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read and validate a JSONL trace (format: module docstring).

    Returns:
        The requests in file order. Unknown fields are ignored; the optional ones may be absent.

    Raises:
        ValueError: ``{path}:{line}: field '{name}': ...`` for a missing or malformed field (a
            negative length, a non-integer id, ``len(hash_ids) != ceil(input_length / 512)``, a
            timestamp before the previous line's...), or ``{path}:{line}: not valid JSON``.
        OSError: the file cannot be read.
    """
    with open(path, encoding='utf-8') as f:
        return parse_trace(f, str(path))


def _obj(r: TraceRequest) -> dict:
    ts = int(r.timestamp_ms) if float(r.timestamp_ms).is_integer() else r.timestamp_ms
    obj = {'timestamp': ts, 'input_length': r.input_length, 'output_length': r.output_length,
           'hash_ids': list(r.hash_ids)}
    if r.shared_head_tokens is not None:
        obj['shared_head_tokens'] = r.shared_head_tokens
    if r.session is not None:
        obj['session'] = r.session
    if r.continuation:
        obj['continuation'] = True
    return obj


def write_trace(path: str | Path, rows: Sequence[TraceRequest]) -> None:
    """Write ``rows`` as compact JSONL (optional fields only when set); the rows are validated
    first, so what is written loads back equal.

    Raises:
        ValueError: a row :func:`load_trace` would reject (message names the row and field).
    """
    lines = [json.dumps(_obj(r), separators=(',', ':')) for r in rows]
    parse_trace(lines, f'{path} (row)')
    Path(path).write_text(''.join(line + '\n' for line in lines), encoding='utf-8')


# block tokens ----------------------------------------------------------------------------------
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014): a bijection of uint64 whose outputs look independent."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=65536)
def _block(seed: int, hash_id: int, length: int, lo: int, hi: int) -> tuple[int, ...]:
    with np.errstate(over='ignore'):
        key = _mix(np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(hash_id))
        x = _mix(key + np.arange(1, length + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return tuple(((x % np.uint64(hi - lo)).astype(np.int64) + lo).tolist())


def prompt_tokens(req: TraceRequest, scale: int = 1, vocab_size: int = 32000, seed: int = 0,
                  lo: int = 0) -> list[int]:
    """The token ids of ``req``'s prompt at scale factor ``scale``.

    Each 512-token block becomes ``512 / scale`` tokens, token j of block ``h`` being a
    deterministic function of (``seed``, ``h``, j) drawn from ``[lo, vocab_size)`` (so special
    tokens outside that range never appear). The prompt is ``input_length // scale`` tokens (at
    least 1; rounded down, as ``benchmark/trace_sim.py`` sizes its prompts): its last block is cut
    there, so it may be partial or, when the last block has fewer than ``scale`` tokens, empty.

    Returns:
        A list of ``max(1, input_length // scale)`` ints in ``[lo, vocab_size)``.

    Raises:
        ValueError: ``scale`` is not a positive divisor of 512, or ``not 0 <= lo < vocab_size``.
    """
    if not _is_int(scale) or scale < 1 or BLOCK_TOKENS % scale:
        raise ValueError(f'scale must be a positive divisor of {BLOCK_TOKENS}, got {scale!r}')
    if not (_is_int(lo) and _is_int(vocab_size) and 0 <= lo < vocab_size):
        raise ValueError(f'token range [lo={lo!r}, vocab_size={vocab_size!r}) is empty or negative')
    per = BLOCK_TOKENS // scale
    total = max(1, req.input_length // scale)
    out: list[int] = []
    for i, h in enumerate(req.hash_ids):
        take = min(per, total - i * per)
        if take <= 0:
            break
        out.extend(_block(seed, h, per, lo, vocab_size)[:take])
    return out


# generators ------------------------------------------------------------------------------------
class _Ids:
    """Fresh block ids in allocation order (deterministic for a generator's call)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


@dataclass(frozen=True)
class _Context:
    """A prompt under construction: the ids of its full blocks and its partial tail.

    ``tail_id`` is None only for a context that must be extended before it is sent (a cut, or
    a shared head whose last block the session's own text completes).
    """

    full: tuple[int, ...]
    tail_tokens: int = 0
    tail_id: int | None = None

    @property
    def length(self) -> int:
        return BLOCK_TOKENS * len(self.full) + self.tail_tokens

    def extended(self, n: int, ids: _Ids) -> '_Context':
        """This context + ``n`` new tokens: the block holding the old tail and every block
        after it are new content, so they get new ids."""
        end = self.length + n
        full = self.full + tuple(ids.take(end // BLOCK_TOKENS - len(self.full)))
        tail = end % BLOCK_TOKENS
        return _Context(full, tail, ids.take(1)[0] if tail else None)

    def cut(self, at: int) -> '_Context':
        """The first ``at`` tokens (to be extended before sending)."""
        return _Context(self.full[:at // BLOCK_TOKENS], at % BLOCK_TOKENS, None)

    def hash_ids(self) -> tuple[int, ...]:
        assert self.tail_tokens == 0 or self.tail_id is not None, 'a cut context is sent unextended'
        return self.full + ((self.tail_id,) if self.tail_tokens else ())


def _logu(rng: random.Random, lo: float, hi: float) -> int:
    """A log-uniform integer in [lo, hi]."""
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


@dataclass
class _Pending:
    ts_ms: int
    order: tuple[int, int]
    row: dict = field(default_factory=dict)


def _finish(pending: list[_Pending]) -> list[TraceRequest]:
    pending.sort(key=lambda p: (p.ts_ms, p.order))
    return [TraceRequest(float(p.ts_ms), **p.row) for p in pending]


@dataclass(frozen=True)
class AgentShape:
    """Parameters of one coding agent's sessions (token ranges are log-uniform, times seconds)."""

    name: str
    head_tokens: int
    first_prompt: tuple[int, int]
    turns: tuple[int, int]
    reply: tuple[int, int]
    tool_result: tuple[int, int]
    user_fraction: float
    user_message: tuple[int, int]
    branch_fraction: float
    branch_message: tuple[int, int]
    branch_lookback: int
    compact_at: int
    summary: tuple[int, int]
    start_span_s: float
    tool_time_s: tuple[float, float]
    think_time_s: tuple[float, float]
    decode_tok_per_s: float = 60.0


CLAUDE_CODE = AgentShape('cc', head_tokens=40_000, first_prompt=(300, 3000), turns=(6, 40), reply=(50, 800),
                         tool_result=(200, 8000), user_fraction=0.15, user_message=(20, 1500),
                         branch_fraction=0.04, branch_message=(50, 2000), branch_lookback=5, compact_at=120_000,
                         summary=(2000, 6000), start_span_s=540, tool_time_s=(0.5, 20), think_time_s=(5, 90))
CODEX = AgentShape('codex', head_tokens=12_000, first_prompt=(200, 2000), turns=(5, 35), reply=(50, 800),
                   tool_result=(500, 16_000), user_fraction=0.10, user_message=(20, 1500), branch_fraction=0.03,
                   branch_message=(50, 2000), branch_lookback=5, compact_at=150_000, summary=(2000, 6000),
                   start_span_s=600, tool_time_s=(0.5, 30), think_time_s=(5, 90))


def agent_sessions(shape: AgentShape, num_sessions: int, seed: int = 0, first_id: int = 0) -> list[TraceRequest]:
    """Interleaved sessions of one coding agent (the shape: :class:`AgentShape`, the module
    docstring). Every request of a session extends the previous one's full blocks, except a
    branch (a cut of one of the last ``branch_lookback`` requests inside its new content, plus
    an edited message) and the request after a compaction (head + summary + message).

    ``first_id``: the head's blocks are always ids ``0, 1, ...``; every other block id is
    ``>= first_id`` (so calls with disjoint id ranges share the head and nothing else).

    Raises:
        ValueError: ``num_sessions < 1``.
    """
    if num_sessions < 1:
        raise ValueError(f'num_sessions must be >= 1, got {num_sessions}')
    rng = random.Random(f'{shape.name}-{seed}')
    ids = _Ids()
    head = _Context(tuple(ids.take(shape.head_tokens // BLOCK_TOKENS)), shape.head_tokens % BLOCK_TOKENS)
    ids.next = max(ids.next, first_id)
    pending: list[_Pending] = []
    for s in range(num_sessions):
        name = f'{shape.name}-{s}'
        t = rng.uniform(0, shape.start_span_s)
        ctx = head.extended(_logu(rng, *shape.first_prompt), ids)
        history: list[tuple[int, _Context]] = []      # (where this request's new content starts, its context)
        start = shape.head_tokens
        for turn in range(rng.randint(*shape.turns)):
            out = _logu(rng, *shape.reply)
            pending.append(_Pending(int(round(t * 1000)), (s, turn), dict(
                input_length=ctx.length, output_length=out, hash_ids=ctx.hash_ids(),
                shared_head_tokens=shape.head_tokens, session=name, continuation=turn > 0)))
            history.append((start, ctx))
            user = rng.random() < shape.user_fraction
            t += out / shape.decode_tok_per_s + (rng.uniform(*shape.think_time_s) if user
                                                 else math.exp(rng.uniform(*map(math.log, shape.tool_time_s))))
            if rng.random() < shape.branch_fraction:
                new_from, old = rng.choice(history[-shape.branch_lookback:])
                at = rng.randint(new_from + 1, old.length - 1) if old.length - new_from >= 2 else new_from
                start = at
                ctx = old.cut(at).extended(_logu(rng, *shape.branch_message), ids)
                continue
            added = out + _logu(rng, *(shape.user_message if user else shape.tool_result))
            if ctx.length + added > shape.compact_at:
                start = shape.head_tokens
                ctx = head.extended(_logu(rng, *shape.summary) + _logu(rng, *shape.user_message), ids)
            else:
                start = ctx.length
                ctx = ctx.extended(added, ids)
    return _finish(pending)


def claude_code_sessions(num_sessions: int = 130, seed: int = 0, **shape) -> list[TraceRequest]:
    """Claude-Code-shaped sessions: a 40,000-token shared head, tool-result turns, branches and
    compaction (:data:`CLAUDE_CODE`; ``shape`` overrides its fields, e.g. ``head_tokens=...``)."""
    return agent_sessions(_replace(CLAUDE_CODE, shape), num_sessions, seed)


def codex_sessions(num_sessions: int = 140, seed: int = 0, **shape) -> list[TraceRequest]:
    """Codex-shaped sessions: a 12,000-token shared head and longer tool outputs
    (:data:`CODEX`; ``shape`` overrides its fields)."""
    return agent_sessions(_replace(CODEX, shape), num_sessions, seed)


def agent_fleet(num_requests: int, agent: str = 'codex', sessions_per_wave: int = 140, seed: int = 0,
                **shape) -> Iterator[TraceRequest]:
    """``num_requests`` requests of one agent's sessions, made a wave at a time so that a
    million-request trace streams to disk in bounded memory (:func:`write_trace_rows`).

    Wave ``w`` is :func:`agent_sessions` of ``sessions_per_wave`` sessions (seed
    ``seed * 1_000_003 + w``) with block ids of its own (all waves share the agent's head, ids
    ``0, 1, ...``, and nothing else), shifted in time to start 1 ms after the previous wave's last
    request, so timestamps stay non-decreasing. ``agent``: ``'codex'`` (:data:`CODEX`) or
    ``'claude_code'`` (:data:`CLAUDE_CODE`); ``shape`` overrides its fields (e.g.
    ``compact_at=32_000`` for shorter contexts). Deterministic in its arguments.

    Raises:
        ValueError: ``num_requests < 1``, ``sessions_per_wave < 1``, an unknown agent or field.
    """
    bases = {'codex': CODEX, 'claude_code': CLAUDE_CODE}
    if agent not in bases:
        raise ValueError(f'agent must be one of {sorted(bases)}, got {agent!r}')
    if num_requests < 1 or sessions_per_wave < 1:
        raise ValueError(f'num_requests and sessions_per_wave must be >= 1, got {num_requests}, {sessions_per_wave}')
    spec = _replace(bases[agent], shape)
    made, next_id, t0, wave = 0, 0, 0.0, 0
    while made < num_requests:
        rows = agent_sessions(spec, sessions_per_wave, seed * 1_000_003 + wave, first_id=next_id)
        next_id = 1 + max(max(r.hash_ids) for r in rows)
        for r in rows[:num_requests - made]:
            yield replace(r, timestamp_ms=r.timestamp_ms + t0, session=f'{r.session}-w{wave}')
        made += min(len(rows), num_requests - made)
        t0 += rows[-1].timestamp_ms + 1
        wave += 1


def write_trace_rows(path: str | Path, rows: Iterable[TraceRequest]) -> int:
    """Stream ``rows`` to ``path`` as JSONL (the format of :func:`write_trace`), one line at a
    time, checking that timestamps do not decrease; returns the rows written.

    Raises:
        ValueError: a timestamp before the previous row's.
    """
    n, last = 0, -math.inf
    with open(path, 'w', encoding='utf-8') as f:
        for r in rows:
            if r.timestamp_ms < last:
                raise ValueError(f'row {n}: timestamp {r.timestamp_ms:g} is before the previous {last:g}')
            last = r.timestamp_ms
            f.write(json.dumps(_obj(r), separators=(',', ':')) + '\n')
            n += 1
    return n


def _replace(base: AgentShape, fields: dict) -> AgentShape:
    from dataclasses import fields as dc_fields
    unknown = set(fields) - {f.name for f in dc_fields(AgentShape)}
    if unknown:
        raise ValueError(f'unknown AgentShape field(s): {sorted(unknown)}')
    return replace(base, **fields)


def many_short_chats(num_sessions: int = 2000, seed: int = 0, num_system_prompts: int = 12,
                     system_prompt: tuple[int, int] = (300, 6000), zipf_s: float = 1.1,
                     turn_weights: Sequence[float] = (35, 25, 15, 10, 8, 7), user_message: tuple[int, int] = (20, 2000),
                     reply: tuple[int, int] = (50, 1500), regenerate_fraction: float = 0.05,
                     start_span_s: float = 720, think_time_s: tuple[float, float] = (30, 600)) -> list[TraceRequest]:
    """A production chat service: ``num_sessions`` chats, each under one of
    ``num_system_prompts`` system prompts drawn by Zipf's law (weight of the k-th most popular
    ``k ** -zipf_s``), ``1..len(turn_weights)`` turns, starts a Poisson process over
    ``start_span_s`` seconds, ``think_time_s`` (log-uniform) between a reply and the next turn;
    ``shared_head_tokens`` is the system prompt's length. A regeneration repeats the previous
    prompt exactly.

    Raises:
        ValueError: ``num_sessions < 1`` or ``num_system_prompts < 1``.
    """
    if num_sessions < 1 or num_system_prompts < 1:
        raise ValueError(f'num_sessions and num_system_prompts must be >= 1, got {num_sessions}, '
                         f'{num_system_prompts}')
    rng = random.Random(f'chat-{seed}')
    ids = _Ids()
    heads = []
    for _ in range(num_system_prompts):
        n = _logu(rng, *system_prompt)
        heads.append((n, _Context(tuple(ids.take(n // BLOCK_TOKENS)), n % BLOCK_TOKENS)))
    weights = [(k + 1) ** -zipf_s for k in range(num_system_prompts)]
    pending: list[_Pending] = []
    t = 0.0
    for s in range(num_sessions):
        t += rng.expovariate(num_sessions / start_span_s)
        head_tokens, head = rng.choices(heads, weights)[0]
        ctx = head.extended(_logu(rng, *user_message), ids)
        clock = t
        for turn in range(rng.choices(range(1, len(turn_weights) + 1), turn_weights)[0]):
            out = _logu(rng, *reply)
            pending.append(_Pending(int(round(clock * 1000)), (s, turn), dict(
                input_length=ctx.length, output_length=out, hash_ids=ctx.hash_ids(), shared_head_tokens=head_tokens,
                session=f'chat-{s}', continuation=turn > 0)))
            clock += out / 60.0 + _logu(rng, *think_time_s)
            if rng.random() >= regenerate_fraction:
                ctx = ctx.extended(out + _logu(rng, *user_message), ids)
    return _finish(pending)


# working set -----------------------------------------------------------------------------------
def working_set(rows: Sequence[TraceRequest]) -> dict:
    """What an infinite cache of 512-token blocks would hold and hit for ``rows`` (in order).

    Returns:
        dict with ``requests``; ``prompt_tokens`` (sum of input lengths); ``distinct_blocks``
        (distinct hash ids); ``distinct_block_tokens`` (their tokens: a block's size is the
        most tokens any request puts in it); ``ideal_block_hit_tokens``: summed over requests,
        ``min(512 * j, input_length - 1)`` with j the longest prefix of its ``hash_ids`` that an
        earlier request's ``hash_ids`` began with (a prefix trie of ids, so equal ids under
        different parents are different blocks); ``ideal_hit_fraction`` = that / prompt_tokens.
    """
    root: dict = {}
    sizes: dict[int, int] = {}
    hit = prompt = 0
    for r in rows:
        node, matched = root, 0
        for h in r.hash_ids:
            if h not in node:
                break
            node, matched = node[h], matched + 1
        hit += min(BLOCK_TOKENS * matched, r.input_length - 1)
        prompt += r.input_length
        node = root
        for i, h in enumerate(r.hash_ids):
            node = node.setdefault(h, {})
            sizes[h] = max(sizes.get(h, 0), min(BLOCK_TOKENS, r.input_length - i * BLOCK_TOKENS))
    return dict(requests=len(rows), prompt_tokens=prompt, distinct_blocks=len(sizes),
                distinct_block_tokens=sum(sizes.values()), ideal_block_hit_tokens=hit,
                ideal_hit_fraction=hit / prompt if prompt else 0.0)


GENERATORS = {'claude_code': claude_code_sessions, 'codex': codex_sessions, 'short_chats': many_short_chats}


def main(argv: Sequence[str] | None = None) -> None:
    """``--write DIR``: write the three committed traces (seed ``--seed``); prints each one's
    working set. ``--fleet PATH``: stream :func:`agent_fleet` (``--requests``) to ``PATH``."""
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--write', help='directory for claude_code.jsonl, codex.jsonl, short_chats.jsonl')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--fleet', help='instead: stream agent_fleet(--requests, --agent, shape overrides) to this file')
    p.add_argument('--requests', type=int, default=1_000_000)
    p.add_argument('--agent', default='codex', help='codex | claude_code')
    p.add_argument('--compact-at', type=int, help="context tokens that trigger compaction (default: the agent's)")
    p.add_argument('--head-tokens', type=int, help="tokens of the agent's shared head (default: the agent's)")
    args = p.parse_args(argv)
    if args.fleet:
        extra = {k: v for k, v in (('compact_at', args.compact_at), ('head_tokens', args.head_tokens)) if v is not None}
        n = write_trace_rows(args.fleet, agent_fleet(args.requests, args.agent, seed=args.seed, **extra))
        print(f'{args.fleet}: {n} requests')
        return
    if not args.write:
        p.error('--write DIR or --fleet PATH')
    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    for name, gen in GENERATORS.items():
        rows = gen(seed=args.seed)
        path = out / f'{name}.jsonl'
        write_trace(path, rows)
        ws = working_set(rows)
        span = rows[-1].timestamp_ms / 1000
        print(f'{path}: {len(rows)} requests over {span:.0f} s ({len(rows) / span:.2f}/s), '
              f'{path.stat().st_size / 1e6:.2f} MB; ' + ', '.join(f'{k}={v:.3g}' if isinstance(v, float) else f'{k}={v}'
                                                            for k, v in ws.items()))


if __name__ == '__main__':
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
