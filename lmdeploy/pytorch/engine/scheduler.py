"""Scheduler: continuous batching with chunked prefill and transactional admission.

Each engine step asks :meth:`Scheduler.schedule` for the forwards of this step:

1. running sequences, oldest first: the next chunk of their prefill plan (or one decode
   token), with the blocks it needs — preempting the newest running sequence (recompute) when
   blocks run out (a sequence in plain decode whose block is already held takes a shortcut,
   :meth:`Scheduler._decode_chunk`, with the same result);
2. waiting sequences, FCFS, while slots and the prefill budget last, each admitted as one
   transaction::

       match (metadata) → pin (shared blocks, checkpoint) → can allocate? (no side effects)
            │ no: unpin, stop admitting                         │ yes
            ▼                                                   ▼
       nothing held, nothing evicted, nothing loaded      commit: evict explicitly, allocate
                                                          runtime slot + blocks of the first
                                                          chunk, plan the prefill, plan the load

Block tables are per paged group (:func:`~lmdeploy.pytorch.cache_specs.paged_groups`): the
first group's table is ``seq.block_ids`` (shared with the prefix cache, evicting to allocate); a
sliding-window group with a pool of its own (a mixed model) is ``seq.window_block_ids``. Every
step reserves each group's blocks for the chunk (preempting when any pool is short), and after
the forward a group with a window gives back the blocks that fell out of it
(:data:`~lmdeploy.pytorch.paging.sequence.FREED_BLOCK` in its table), so its blocks per sequence
stay within ``ceil((W - 1 + chunk) / B) + 1``. With prefixes cached, the prefix cache keeps the
window rows its restores read (:class:`~lmdeploy.pytorch.prefix_cache.local_tier.LocalTier`), a
local restore attaches them (:attr:`PrefixMatch.window_blocks`), and a window pool short of free
blocks evicts checkpoints until their window rows free enough.

The scheduler decides; it never touches tensors or the network. The restores it plans
(:class:`~lmdeploy.pytorch.prefix_cache.plans.LoadPlan`) and the saves it plans after a forward
(:class:`~lmdeploy.pytorch.prefix_cache.plans.SavePlan`) are executed by the engine. A Store
restore that fails at execution is rolled back here (:meth:`Scheduler.rollback`) and the request
waits at the head of the queue for its next admission.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache_specs import window_first_block
from ..config import SchedulerConfig
from ..paging.sequence import FREED_BLOCK, SeqStatus, Sequence
from ..prefix_cache.coordinator import PrefixCache
from ..prefix_cache.null_cache import NullPrefixCache
from ..prefix_cache.plans import LoadPlan, PrefixMatch, SavePlan
from ..prefix_cache.state_cache import StateCache
from ..paging.block_manager import BlockManager
from ..paging.prefill_plan import (PrefillPlan, ReuseRules, num_remaining_chunks, plain_chunk_ends, with_junction,
                           with_last_block_end)

__all__ = ['Scheduler', 'ScheduledChunk', 'SchedulerOutput', 'TableGroup']


@dataclass(frozen=True)
class TableGroup:
    """One paged group as the scheduler sees it: its pool and where a sequence keeps its table.

    Attributes:
        pool: the group's block pool.
        window: the group's sliding window (tokens): its table gives back the blocks out of it;
            None: the table keeps every block.
        ids: the :class:`Sequence` attribute of the table (``'block_ids'``, ``'window_block_ids'``).
        freed: the attribute counting the table's leading ``FREED_BLOCK`` entries.
    """
    pool: BlockManager
    window: int | None
    ids: str = 'block_ids'
    freed: str = 'num_freed_blocks'


@dataclass
class ScheduledChunk:
    """One sequence's tokens ``[start, end)`` in this step's forward, followed by ``drafts``
    (speculative tokens scored in the same forward, at positions ``end, end + 1, ...``; they are
    not tokens of the sequence until accepted)."""
    seq: Sequence
    start: int
    end: int
    drafts: tuple[int, ...] = ()

    @property
    def sample(self) -> bool:
        """The forward reaches the last token, so a new token is sampled."""
        return self.end == len(self.seq.token_ids)

    @property
    def is_prefill(self) -> bool:
        """More than one token, or a chunk that stops short of the last token."""
        return self.end - self.start > 1 or self.end < len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    """What one step runs: the chunks, and the restores to execute before the forward."""
    chunks: list[ScheduledChunk] = field(default_factory=list)
    loads: LoadPlan = field(default_factory=LoadPlan)


class Scheduler:
    """Owns the waiting/running queues, budgets, preemption and every admission decision.

    Args:
        config: scheduler configuration.
        block_manager: the KV block pool.
        state_cache: state slots (runtime slots are taken here), or None for full-attention models.
        prefix_cache: the prefix-cache tiers, or a :class:`NullPrefixCache` (prefix caching
            off), which matches, keeps and saves nothing; omitted, a NullPrefixCache.
        window: the sliding window (tokens) of ``block_manager``'s group when every layer of it
            slides and nothing rolls computed tokens back (no drafts): ``block_ids`` then gives
            back the blocks out of it; None keeps every block.
        window_pool: the pool of a sliding-window group with tables of its own
            (``window_block_ids``), or None.
        pool_window: that group's window (tokens).

    Raises:
        ValueError: a ``window_pool`` with a prefix cache that caches prefixes but keeps no
            window rows of that pool (it could neither keep nor restore its blocks).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, state_cache: StateCache | None,
                 prefix_cache: PrefixCache | NullPrefixCache | None = None, window: int | None = None,
                 window_pool: BlockManager | None = None, pool_window: int | None = None):
        # (None is only the default of the argument: the attribute is always a cache object)
        self.config = config
        self.block_size = config.block_size
        self.block_manager = block_manager
        self.state_cache = state_cache
        self.is_hybrid = state_cache is not None
        self.prefix_cache = prefix_cache if prefix_cache is not None else NullPrefixCache()
        self.last_only = config.prefill_save_last_only and self.is_hybrid
        self.groups = [TableGroup(block_manager, window or None)]
        if window_pool is not None:
            if self.prefix_cache.caches_prefixes and self.prefix_cache.window_pool is not window_pool:
                raise ValueError('a sliding-window group with a pool of its own needs prefix caching off, or a '
                                 'prefix cache keeping its window rows (window_pool)')
            self.groups.append(TableGroup(window_pool, pool_window, 'window_block_ids', 'num_window_freed_blocks'))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (FCFS); it is admitted by a later :meth:`schedule`."""
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        """Some sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and release everything it holds."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        self._forget(seq)
        seq.status = SeqStatus.ABORTED

    def finish(self, seq: Sequence, reason: str) -> SavePlan:
        """Mark ``seq`` finished, cache its computed blocks and release its resources.

        Returns:
            The saves a finished request still makes (the Store put of a turn-end checkpoint),
            for the engine to execute in this step, before any block is reused.
        """
        saves = SavePlan()
        self.prefix_cache.finish_turn(seq, saves)
        self.running.remove(seq)
        self._release(seq)
        self._forget(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        return saves

    def _forget(self, seq: Sequence) -> None:
        self.prefix_cache.forget(seq)

    # scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_prefill_token_num
        any_prefill = False
        running = list(self.running)
        for seq in running:
            # (only a preemption shortens the list: the membership test is needed only after one)
            if len(self.running) != len(running) and seq not in self.running:
                continue        # preempted by an earlier sequence this step
            chunk = self._decode_chunk(seq)
            if chunk is not None:
                out.chunks.append(chunk)
                continue
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, self._chunk_end(seq))
            size = chunk.end - chunk.start
            if chunk.is_prefill and any_prefill and size > budget:
                continue
            if not self._reserve_blocks(seq, chunk.end, out):
                continue
            chunk.drafts = self._drafts(seq, chunk)
            out.chunks.append(chunk)
            if chunk.is_prefill:
                budget -= size
                any_prefill = True
        while self.waiting and len(self.running) < self.config.max_batch_size and budget > 0:
            seq = self.waiting[0]
            if not self._admit(seq, out):
                break
            self.waiting.popleft()
            start, end = seq.num_computed_tokens, seq.next_chunk_end()
            out.chunks.append(ScheduledChunk(seq, start, end))
            budget -= end - start
        return out

    def _decode_chunk(self, seq: Sequence) -> ScheduledChunk | None:
        """The chunk of a running sequence in plain decode — one token to compute, no prefill
        chunk left in its plan, no drafts, one block table, and the block of its last token
        already held — or None for any other sequence (the general path of :meth:`schedule`).

        It is what the general path decides for such a sequence (a one-token chunk, nothing to
        reserve or preempt for, no prefill budget), without asking each of its questions: the
        steady decode step, where every running sequence is in this state, costs a few integer
        comparisons per sequence."""
        start, n = seq.num_computed_tokens, len(seq.token_ids)
        if (start != n - 1 or seq.draft_ids or len(self.groups) > 1 or n > len(seq.block_ids) * self.block_size
                or (seq.plan is not None and seq.plan.chunk_ends[-1] > start)):
            return None
        return ScheduledChunk(seq, start, n)

    def _chunk_end(self, seq: Sequence) -> int:
        """End of a running sequence's next chunk. A decode catch-up (tokens accepted from
        drafts whose state was rolled back) stops at the next block boundary when turn-end
        checkpoints are kept, since those are copied when a forward ends on a block boundary."""
        start, end = seq.num_computed_tokens, seq.next_chunk_end()
        if end - start > 1 and start >= seq.num_prompt_tokens and self.prefix_cache.decode_save_last:
            end = min(end, (start // self.block_size + 1) * self.block_size)
        return end

    def _drafts(self, seq: Sequence, chunk: ScheduledChunk) -> tuple[int, ...]:
        """The sequence's draft tokens, when ``chunk`` is a decode chunk (past the prompt, up to
        the last token) and their KV slots fit in free blocks now (drafts never evict or
        preempt: without room the step decodes plainly)."""
        if not seq.draft_ids or chunk.end != seq.num_tokens or chunk.start < seq.num_prompt_tokens:
            return ()
        need = self._blocks_for(seq, chunk.end + len(seq.draft_ids))
        if need > self.block_manager.num_free:
            return ()
        if need > 0:
            seq.block_ids.extend(self.block_manager.allocate(need))
        return tuple(seq.draft_ids)

    def _blocks_for(self, seq: Sequence, end: int) -> int:
        return -(-end // self.block_size) - len(seq.block_ids)

    def _other_needs(self, seq: Sequence, end: int, held: int | None = None) -> list[int]:
        """Blocks each group after the first lacks for ``end`` tokens (``held``: table entries
        an admission has already, its restored window)."""
        n = -(-end // self.block_size)
        return [n - (len(getattr(seq, g.ids)) if held is None else held) for g in self.groups[1:]]

    def _others_fit(self, needs: list[int]) -> bool:
        """Whether the groups after the first have ``needs`` blocks free, or freeable from the
        window rows the prefix cache keeps (no side effects)."""
        spare = self.prefix_cache.num_evictable_window_blocks if any(
            n > g.pool.num_free for n, g in zip(needs, self.groups[1:])) else 0
        return all(n <= g.pool.num_free + spare for n, g in zip(needs, self.groups[1:]))

    def _allocate_others(self, seq: Sequence, needs: list[int]) -> None:
        for n, g in zip(needs, self.groups[1:]):
            if n > g.pool.num_free:
                self.prefix_cache.evict_window(n - g.pool.num_free)
            if n > 0:
                getattr(seq, g.ids).extend(g.pool.allocate(n))

    def _can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks can be had now, free or by eviction (no side effects)."""
        if n <= self.block_manager.num_free:
            return True
        return n <= self.block_manager.num_free + self.prefix_cache.num_evictable_blocks

    def _allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, evicting cached ones first if the free list is short (callers
        check :meth:`_can_allocate` first)."""
        short = n - self.block_manager.num_free
        if short > 0:
            self.prefix_cache.evict(short)
        return self.block_manager.allocate(n)

    def _reserve_blocks(self, seq: Sequence, end: int, out: SchedulerOutput) -> bool:
        """Ensure ``seq`` has blocks for ``end`` tokens, preempting newer sequences if needed."""
        need, others = self._blocks_for(seq, end), self._other_needs(seq, end)
        while (need > 0 and not self._can_allocate(need)) or not self._others_fit(others):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self._allocate(need))
        self._allocate_others(seq, others)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: free everything, requeue at the front."""
        self.running.remove(seq)
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.prefix_cache.requeued(seq)

    def rollback(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Undo the admission of ``seq`` in this step (its Store restore failed): drop its chunk,
        release its slot and blocks without caching them, and requeue it at the front."""
        self.running.remove(seq)
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        seq.stats.plans.pop()
        self._release(seq, cache_blocks=False)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Admission transaction (module docstring); False with nothing held on failure."""
        if self.is_hybrid and self.state_cache.num_free_runtime == 0:
            return False
        # a cached prefix has no logits: prompt log-probabilities recompute the whole prompt
        # (its blocks still enter the cache)
        recompute = (seq.gen_config.prompt_logprobs is not None
                     and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1)
        match = PrefixMatch() if recompute else self.prefix_cache.match(seq)
        handoff = seq.handoff
        if handoff is not None and handoff.role == 'prefill' and match.cached_tokens >= handoff.point:
            match = PrefixMatch()   # a restore at h leaves no forward to end there (h aligned: rare): compute
        self.prefix_cache.pin(match)
        plan = self._plan(seq, match.cached_tokens, match.matched_tokens)
        # blocks below match.first_block lie out of every window of the restored sequence:
        # neither shared nor allocated (FREED_BLOCK in its table)
        lead = match.first_block
        need = -(-plan.chunk_ends[0] // self.block_size) - max(lead, match.num_shared_blocks)
        # the window group: a local restore attaches its boundary's window rows (match.window_blocks)
        others = self._other_needs(seq, plan.chunk_ends[0], match.window_first + len(match.window_blocks))
        if not self._can_allocate(need) or not self._others_fit(others):
            self.prefix_cache.unpin(match)
            return False
        # commit
        seq.state_slot = self.state_cache.alloc_runtime() if self.is_hybrid else None
        seq.block_ids = ([FREED_BLOCK] * lead + [node.block_id for node in match.nodes[lead:match.num_shared_blocks]]
                         + self._allocate(need))
        seq.num_freed_blocks = lead
        if len(self.groups) > 1:
            # (the pin's references on the window rows become the sequence's)
            group = self.groups[1]
            setattr(seq, group.ids, [FREED_BLOCK] * match.window_first + list(match.window_blocks))
            setattr(seq, group.freed, match.window_first)
        self._allocate_others(seq, others)
        seq.num_computed_tokens = match.cached_tokens
        seq.plan = plan
        seq.stats.plans.append(plan)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.prefix_cache.plan_load(seq, match, out.loads)
        return True

    def _plan(self, seq: Sequence, cached: int, matched: int = 0) -> PrefillPlan:
        """The turn's chunk plan; saves only when a hybrid model caches prefixes, or when a model
        without state puts prefixes to the Store (its save points are then the boundaries whose
        blocks are put, among plain chunks: no forward needs to end there).

        A hybrid model's prompt is chunked on :func:`~..paging.prefill_plan.prefill_grid`, whether
        prefixes are cached or not and under every save policy, so that caching never changes
        where a forward ends (and so, in floating point, what it computes); the save points are
        chosen among those ends, the shared head's boundary (``seq.shared_head_tokens``) among
        them. The input turn is the prompt: a sequence re-admitted after preemption plans its save
        points over the prompt alone, then recomputes its generated tokens in plain chunks, so
        it never takes more checkpoints than its first admission planned. A prefill engine's
        request (``seq.handoff``, role prefill) ends its plan at the hand-off point h. With ``save_junction``
        a prompt whose cached blocks reach ``matched`` tokens, deeper than its restorable
        checkpoint, also saves at the deepest reusable boundary up to ``matched`` (the branch
        point of two conversations), so the next sibling restores there. With ``decode_save_last``
        a forward also ends at the input's last block boundary (:func:`with_last_block_end`), where
        the turn-end checkpoint falls when the reply crosses no block boundary. Those two add chunk
        ends of their own.
        """
        P = self.config.max_prefill_token_num
        ends, saves, start, junction, head, local_only = [], [], cached, None, None, None
        turn = seq.num_prompt_tokens
        if self.is_hybrid and cached < turn:
            rules = ReuseRules(turn, self.block_size, self.config.prefill_save_alignment, seq.token_lookahead,
                               seq.recompute_blocks, tuple(seq.multimodal_spans))
            if self.prefix_cache.caches_prefixes:
                plan = rules.plan(cached, P, self.last_only, seq.shared_head_tokens)
                if self.config.save_junction and matched > cached:
                    junction = rules.last_reusable_at_most(matched)
                    if junction is not None and junction > cached:
                        plan = with_junction(plan, junction)
                ends, saves, junction, head = list(plan.chunk_ends), list(plan.save_points), plan.junction, \
                    plan.shared_head
            else:
                ends = rules.grid(cached, P, seq.shared_head_tokens)
            start = turn
        elif cached < turn and (self.prefix_cache.store is not None or self.prefix_cache.markers):
            # no state: a Store put or a marker at b needs only the blocks below b computed, not
            # a forward ending at b, so the chunks stay plain. The Store's save points are the
            # default policy's (what the Store simulator charges); markers follow the policy and
            # add the prompt's last full block boundary that leaves a token to compute (where a
            # repeated prompt restores; a local marker only, never put to the Store)
            markers = self.prefix_cache.markers
            rules = ReuseRules(turn, self.block_size, self.config.prefill_save_alignment, seq.token_lookahead,
                               seq.recompute_blocks, tuple(seq.multimodal_spans))
            last_only = markers and self.config.prefill_save_last_only
            saves = list(rules.plan(cached, P, last_only, seq.shared_head_tokens).save_points)
            last = (turn - 1) // self.block_size * self.block_size
            if markers and last > cached and last not in saves:
                saves.append(last)
                local_only = last       # (a hybrid puts no checkpoint there: neither does this model)
        # chunks without saves (the rest of the input) still never split a multimodal span
        ends += plain_chunk_ends(start, seq.num_tokens, P, seq.token_lookahead, tuple(seq.multimodal_spans))
        plan = PrefillPlan(ends, saves, cached, junction, head, local_only)
        if self.prefix_cache.decode_save_last:      # (never set for a model without state)
            plan = with_last_block_end(plan, self.block_size, seq.token_lookahead, tuple(seq.multimodal_spans))
        handoff = seq.handoff
        if handoff is not None and handoff.role == 'prefill':
            # the prompt's grid, cut at the hand-off point: the last forward ends at h, samples nothing
            h = handoff.point
            plan = PrefillPlan([e for e in plan.chunk_ends if e < h] + [h], [p for p in plan.save_points if p <= h],
                               cached, plan.junction if (plan.junction or 0) <= h else None,
                               plan.shared_head if (plan.shared_head or 0) <= h else None)
        return plan

    def remaining_prefill_chunks(self, seq: Sequence) -> int:
        """The scheduler's estimate of a sequence's remaining prefill forwards (from its plan)."""
        if seq.plan is None:
            return 0
        return num_remaining_chunks(seq.plan, seq.num_computed_tokens)

    # after the forward -----------------------------------------------------------------
    def computed(self, out: SchedulerOutput) -> SavePlan:
        """The forward of ``out`` ran: advance computed tokens and plan the saves (new full
        blocks into the prefix cache; checkpoints and Store puts at save points)."""
        saves = SavePlan()
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if chunk.start < seq.num_prompt_tokens or (chunk.is_prefill and not chunk.drafts):
                seq.stats.prefill_forwards += 1
        self.prefix_cache.plan_saves(out.chunks, saves)
        for group in self.groups:
            if group.window:
                for chunk in out.chunks:
                    self._free_out_of_window(chunk.seq, group)
        return saves

    def _free_out_of_window(self, seq: Sequence, group: TableGroup) -> None:
        """Give back the leading blocks of the sequence's table in ``group`` that no later query
        reads: with window ``W``, a query at position ``p >= num_computed`` reads positions
        ``> p - W``, so block ``j`` is dead once ``(j + 1) * B <= num_computed - W + 1``. Runs
        after :meth:`plan_saves`, so the prefix cache has taken its own reference on the blocks
        it keeps; the sequence's reference goes, and so the group's blocks per sequence stay
        within ``ceil((W - 1 + chunk) / B) + 1``."""
        table, freed = getattr(seq, group.ids), getattr(seq, group.freed)
        dead = min(window_first_block(seq.num_computed_tokens, group.window, self.block_size), len(table))
        for j in range(freed, dead):
            group.pool.decref(table[j])
            table[j] = FREED_BLOCK
        setattr(seq, group.freed, max(freed, dead))

    # resources ---------------------------------------------------------------------------
    def _release(self, seq: Sequence, cache_blocks: bool = True) -> None:
        """Give back blocks (caching computed full blocks first) and the runtime slot."""
        if seq.block_ids:
            self.prefix_cache.release(seq, cache_blocks)
        for group in self.groups:
            group.pool.free_all(getattr(seq, group.ids)[getattr(seq, group.freed):])
            setattr(seq, group.ids, [])
            setattr(seq, group.freed, 0)
        if seq.state_slot is not None:
            self.state_cache.free_runtime(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0
        seq.plan = None
