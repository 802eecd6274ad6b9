"""Cache-only trace replay: the engine's own scheduler and prefix-cache code, without a model.

:func:`simulate_trace` feeds a request trace (``benchmark/traces.py``'s format: per request its
prompt length, reply length and one hash id per 512-token block) through the real
:class:`~lmdeploy.pytorch.engine.scheduler.Scheduler`, :class:`~lmdeploy.pytorch.prefix_cache.coordinator.PrefixCache`,
block trie, state slots and eviction policy, at real model byte sizes: every step is scheduled,
admitted, chunked, saved and evicted exactly as in the engine, while the forward, the copies and
the sampling are skipped (each copy "succeeds"). The published 4,000-request trace (61 M prompt
tokens) takes about 13 s of CPU, so eviction policies, save policies and memory budgets can be
compared at full scale; the cost is the engine's per-block work (a hash, a trie lookup and a
token check per prompt block, a node made and evicted per new block; choosing a victim is
O(log N)), and prompts exist only while in flight, so memory follows the requests, not their
tokens. The cyclic garbage collector is off during a replay (its full collections walked every
trie node); young garbage is collected every few thousand requests.

Geometry: one KV block row is ``kv_block_bytes``; a checkpoint takes ``ceil(state_bytes /
kv_block_bytes)`` rows of the same pool (one memory budget), so ``budget_bytes`` buys
``budget_bytes // kv_block_bytes`` rows, shared by KV blocks and checkpoints as the workload asks.
Runtime state slots are outside the budget. ``budget_bytes=None`` is an infinite cache: the
ideal at the save policy's checkpoint granularity, and its ``peak_bytes`` is the working set.

Simplifications (stated, not hidden): every request generates ``min(output_length, max_output)``
tokens of its own (they are not the tokens the trace's next turn sends, which are in that turn's
hash ids anyway); ``concurrency`` requests are in flight at once, admitted in trace order
(timestamps are ignored); ``'optimal'`` is Belady's rule on checkpoints — the next use of a
checkpoint is the next request whose prompt holds its prefix at a reusable boundary — with every
other decision as in the engine.
"""
from __future__ import annotations

import bisect
import gc
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence as Seq

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmdeploy.messages import GenerationConfig  # noqa: E402
from lmdeploy.pytorch.config import SchedulerConfig  # noqa: E402
from lmdeploy.pytorch.engine.scheduler import Scheduler  # noqa: E402
from lmdeploy.pytorch.paging.block_manager import BlockManager  # noqa: E402
from lmdeploy.pytorch.paging.sequence import Sequence  # noqa: E402
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes  # noqa: E402
from lmdeploy.pytorch.prefix_cache.coordinator import PrefixCache  # noqa: E402
from lmdeploy.pytorch.prefix_cache.eviction import OfflineOptimalPolicy, make_policy  # noqa: E402
from lmdeploy.pytorch.prefix_cache.host_tier import HostTier  # noqa: E402
from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier  # noqa: E402
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache  # noqa: E402

__all__ = ['SimResult', 'simulate_trace', 'request_tokens', 'TRACE_BLOCK_TOKENS']

TRACE_BLOCK_TOKENS = 512      # tokens per hash id in the trace format
_VOCAB_LO, _VOCAB_SPAN = 16, 150_000


@dataclass
class SimResult:
    """What one replay measured.

    Attributes:
        prompt_tokens: prompt tokens of every request.
        hit_tokens: prompt tokens restored from the cache (every tier).
        hit_tokens_by_tier: ``device`` / ``host`` / ``store``.
        checkpoints_saved: published checkpoints by reason.
        evictions: entries evicted by kind (``checkpoint``, ``kv``).
        peak_bytes: most bytes the device tier held (KV blocks + checkpoints).
        per_request_hit_tokens: hit tokens of each request, in trace order.
        budget_rows: block rows of the budget (None: unlimited).
        rows_per_checkpoint: rows one checkpoint takes.
        peak_checkpoint_bytes: most bytes checkpoints held at once.
    """
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict = field(default_factory=lambda: {'device': 0, 'host': 0, 'store': 0})
    checkpoints_saved: dict = field(default_factory=dict)
    evictions: dict = field(default_factory=dict)
    peak_bytes: int = 0
    per_request_hit_tokens: list = field(default_factory=list)
    budget_rows: int | None = None
    rows_per_checkpoint: int = 0
    peak_checkpoint_bytes: int = 0


def request_tokens(hash_ids: Seq[int], input_length: int, scale: int = 1) -> list[int]:
    """Token ids of a trace prompt: each hash id stands for ``512 / scale`` tokens, a deterministic
    function of (id, position), so equal ids give equal tokens; the last block is cut to
    ``input_length / scale`` tokens in all.

    Raises:
        ValueError: ``scale`` does not divide 512.
    """
    if TRACE_BLOCK_TOKENS % scale:
        raise ValueError(f'scale must divide {TRACE_BLOCK_TOKENS}, got {scale}')
    per = TRACE_BLOCK_TOKENS // scale
    n = max(1, input_length // scale)
    ids = np.asarray(list(hash_ids[:-(-n // per)]), dtype=np.int64)
    base = (ids * 2654435761) & 0xFFFFFFFF
    # int64 is exact here: base < 2**32 and i * 40503 < 2**25
    out = (base[:, None] + np.arange(per, dtype=np.int64)[None, :] * 40503) % _VOCAB_SPAN + _VOCAB_LO
    return out.ravel()[:n].tolist()


def _num_tokens(hash_ids: Seq[int], input_length: int, scale: int) -> int:
    """``len(request_tokens(hash_ids, input_length, scale))`` without making them."""
    return min(max(1, input_length // scale), len(hash_ids) * (TRACE_BLOCK_TOKENS // scale))


class _Oracle:
    """Future uses of prefixes for Belady's rule: for each chained block hash at a reusable
    aligned boundary, the indices of the requests whose prompt holds it. :meth:`advance` moves
    the present and rescores the checkpoints whose next use it passed (the policy's heap stays
    exact at O(log N) per use)."""

    def __init__(self, token_lists: Iterable[list[int]], block_size: int, alignment: int):
        step = alignment // block_size
        self.uses: dict[bytes, list[int]] = {}
        self.keys_of: list[list[bytes]] = []
        for r, tokens in enumerate(token_lists):      # one prompt at a time: only the keys are kept
            hashes = chain_block_hashes(tokens, block_size)
            keys = [hashes[i] for i in range(step - 1, min(len(hashes), (len(tokens) - 1) // block_size), step)]
            self.keys_of.append(keys)
            for key in keys:
                self.uses.setdefault(key, []).append(r)
        self.now = 0
        self.policy: OfflineOptimalPolicy | None = None

    def next_use(self, key, clock) -> float:
        uses = self.uses.get(key)
        if not uses:
            return math.inf
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else math.inf

    def advance(self, now: int) -> None:
        """The earliest request in flight is now ``now`` (never decreases in a replay)."""
        if now == self.now:
            return
        lo, hi = min(now, self.now), max(now, self.now)
        self.now = now
        for r in range(lo + 1, min(hi, len(self.keys_of) - 1) + 1):
            self.policy.refresh(self.keys_of[r], 0)


def simulate_trace(requests, *, state_bytes: int, kv_block_bytes: int, save_policy: str = 'last_only',
                   eviction: str = 'reuse', budget_bytes: int | None = None, host_bytes: int = 0,
                   block_size: int = 64, alignment: int = 1024, chunk: int = 8192, concurrency: int = 4,
                   scale: int = 1, max_output: int = 1, checkpoint_share: float | None = None) -> SimResult:
    """Replay ``requests`` through the scheduler and prefix cache (module docstring).

    Args:
        requests: trace rows with ``input_length``, ``output_length``, ``hash_ids`` and optionally
            ``shared_head_tokens`` and ``continuation``.
        state_bytes: S, bytes of one checkpoint; kv_block_bytes: K_blk, bytes of one block.
        save_policy: ``'default'`` (a checkpoint at every chunk end) or ``'last_only'``.
        eviction: ``'reuse'``, ``'lru'``, ``'optimal'`` (Belady, from the whole trace) or
            ``'legacy'``: the engine before one memory budget — a fixed split (``checkpoint_share``
            of the budget in checkpoint slots of their own, the rest KV blocks) and LRU for both.
        checkpoint_share: with ``'legacy'``, the budget share of checkpoint slots (default 0.25;
            the benchmark passes the unlimited run's share).
        budget_bytes: device bytes for KV blocks and checkpoints; None = unlimited.
        host_bytes: bytes of a host tier that keeps what the device evicts (0: none); its
            promotions count as ``hit_tokens_by_tier['host']``.
        block_size, alignment, chunk: B, A and P in tokens (at the trace's scale).
        concurrency: requests in flight at once.
        scale: trace tokens per simulated token (512 / scale tokens per hash id).
        max_output: generated tokens per request at most.

    Raises:
        ValueError: an unknown policy.
    """
    if save_policy not in ('default', 'last_only'):
        raise ValueError(f'save_policy must be default or last_only, got {save_policy!r}')
    rows_per_ckpt = -(-state_bytes // kv_block_bytes)
    # prompts are made when admitted and dropped when they finish: a long trace fits in memory
    make_tokens = lambda r: request_tokens(r.hash_ids, r.input_length, scale)     # noqa: E731
    lengths = [_num_tokens(r.hash_ids, r.input_length, scale) for r in requests]
    if budget_bytes is None:
        # room for every block of every prompt and a checkpoint at every aligned boundary
        num_rows = sum(-(-n // block_size) + 1 + (n // alignment + 2) * rows_per_ckpt for n in lengths)
    else:
        num_rows = max(1, budget_bytes // kv_block_bytes)
    oracle = None
    legacy_slots = None
    if eviction == 'legacy':
        if budget_bytes is None:
            raise ValueError("eviction='legacy' needs a budget")
        share = 0.25 if checkpoint_share is None else checkpoint_share
        legacy_slots = max(1, int(budget_bytes * share) // state_bytes)
        num_rows = max(1, (budget_bytes - legacy_slots * state_bytes) // kv_block_bytes)
        policy = make_policy('lru')
    elif eviction == 'optimal':
        oracle = _Oracle((make_tokens(r) for r in requests), block_size, alignment)
        policy = OfflineOptimalPolicy(oracle.next_use)
        oracle.policy = policy
    else:
        policy = make_policy(eviction)
    bm = BlockManager(num_rows)
    if legacy_slots is not None:
        sc = StateCache(concurrency, legacy_slots, policy=policy)
    else:
        sc = StateCache(concurrency, None, block_manager=bm, rows_per_checkpoint=rows_per_ckpt, policy=policy)
    local = LocalTier(bm, block_size, sc, state_bytes=state_bytes, block_bytes=kv_block_bytes)
    host = HostTier(None, host_bytes, block_size, state_bytes, kv_block_bytes) if host_bytes else None
    cache = PrefixCache(local, None, block_size=block_size, alignment=alignment, host=host)
    sched = Scheduler(SchedulerConfig(block_size, concurrency, chunk, alignment, save_policy == 'last_only'),
                      bm, sc, cache)
    result = SimResult(budget_rows=None if budget_bytes is None else num_rows, rows_per_checkpoint=rows_per_ckpt)
    prompt = [0] * len(requests)
    hits = [0] * len(requests)
    # The trie holds millions of long-lived nodes: CPython's cyclic collector would walk them all
    # at every full collection (about 40 % of a replay's time). Nothing here depends on when cycles
    # are collected, so it is off during the loop and the young generations are collected every
    # _GC_EVERY finished requests (a finished request's garbage is young then).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _replay(requests, sched, cache, bm, sc, host, oracle, make_tokens, concurrency, scale, max_output,
                prompt, hits, peaks := [0, 0])
    finally:
        if gc_was_enabled:
            gc.enable()
    peak_rows, peak_ckpt = peaks
    stats = cache.stats()
    result.prompt_tokens = sum(prompt)
    result.per_request_hit_tokens = hits
    result.hit_tokens = sum(hits)
    result.hit_tokens_by_tier['device'] = stats['prefix_cache_hit_tokens']
    result.hit_tokens_by_tier['host'] = stats.get('host_hit_tokens', 0)
    result.checkpoints_saved = {k: v for k, v in stats['checkpoints_saved_by_reason'].items() if v}
    result.evictions = dict(stats['prefix_cache_evictions'])
    result.peak_bytes = peak_rows * kv_block_bytes + (peak_ckpt * state_bytes if legacy_slots is not None else 0)
    result.peak_checkpoint_bytes = peak_ckpt * (state_bytes if legacy_slots is not None
                                                else rows_per_ckpt * kv_block_bytes)
    return result


_GC_EVERY = 4096      # finished requests between two collections of the young generations


def _replay(requests, sched, cache, bm, sc, host, oracle, make_tokens, concurrency: int, scale: int,
            max_output: int, prompt: list, hits: list, peaks: list) -> None:
    """The replay loop of :func:`simulate_trace`: admit in trace order, step the scheduler, let
    every copy succeed, append one token per finished chunk; fills ``prompt`` / ``hits`` (per
    request) and ``peaks`` (``[block rows, checkpoints]`` held at most)."""
    nxt, in_flight, peak_rows, peak_ckpt, finished = 0, 0, 0, 0, 0
    while nxt < len(requests) or sched.has_work:
        while nxt < len(requests) and in_flight < concurrency:
            req = requests[nxt]
            gen = GenerationConfig(max_new_tokens=max(1, min(req.output_length // scale, max_output)),
                                   ignore_eos=True)
            seq = Sequence(make_tokens(req), gen)
            head = getattr(req, 'shared_head_tokens', None)
            if head:
                seq.shared_head_tokens = head // scale
            seq.continuation = bool(getattr(req, 'continuation', False))
            seq.trace_index = nxt
            sched.add(seq)
            nxt += 1
            in_flight += 1
        if oracle is not None:
            oracle.advance(min((s.trace_index for s in sched.running + list(sched.waiting)), default=nxt))
        out = sched.schedule()
        for load in list(out.loads.host_loads):
            ok = host.load(load)
            keep = cache.host_loaded(load, ok)
            if not ok:
                sched.rollback(load.seq, out)
            elif keep is not None:
                cache.restored_kept(*keep, True)
        if out.loads:
            cache.loads_done(out.loads, True)
        if not out.chunks:
            if not sched.running and sched.waiting:
                raise RuntimeError('the budget cannot admit the next request (too small for one prompt)')
            continue
        cache.saves_done(saves := sched.computed(out), True)
        del saves
        for c in out.chunks:
            seq = c.seq
            if c.end < seq.num_tokens:
                continue
            seq.token_ids.append(_VOCAB_LO + (seq.num_tokens * 7 + seq.seq_id) % _VOCAB_SPAN)
            if seq.num_generated >= seq.gen_config.max_new_tokens:
                cache.saves_done(sched.finish(seq, 'length'), True)
                prompt[seq.trace_index], hits[seq.trace_index] = seq.num_prompt_tokens, seq.num_cached_tokens
                in_flight -= 1
                finished += 1
                if finished % _GC_EVERY == 0:
                    gc.collect(1)
        used = bm.num_blocks - bm.num_free
        peak_rows = max(peak_rows, used)
        peak_ckpt = max(peak_ckpt, sc.num_allocated)
    peaks[:] = [peak_rows, peak_ckpt]
