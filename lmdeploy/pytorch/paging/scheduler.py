"""Scheduler: continuous batching with chunked prefill, prefix-cache admission and
checkpoint save planning.

Each engine step asks :meth:`Scheduler.schedule` for the forwards of this step:

1. running sequences, oldest first: the next chunk of their prefill plan (or one decode
   token), with the blocks it needs — preempting the newest running sequence (recompute) when
   blocks run out;
2. waiting sequences, FCFS, while slots and the prefill budget last, each admitted as one
   transaction (STYLE lesson 5)::

       match prefix (local trie, then Store) → pin (blocks, checkpoint) → allocate
       (runtime slot, blocks of the first chunk) → plan_prefill        any failure → rollback

The scheduler decides; it does not touch tensors. Copies it plans (checkpoint → runtime slot
on restore, runtime slot → checkpoint on save) are executed by the cache engine, and a
checkpoint is published only after its copy ran (:meth:`publish_saves`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ...messages import PytorchEngineConfig
from ..engine.sequence import SeqStatus, Sequence
from .block_manager import BlockManager, OutOfBlocks
from .block_trie import BlockTrie, TrieNode, chain_block_hashes
from .prefill_plan import PrefillPlan, is_reusable, num_remaining_chunks, plan_prefill
from .state_cache import StateCache

__all__ = ['Scheduler', 'ScheduledChunk', 'SchedulerOutput', 'SavePlan', 'STORE_RESTORE_ATTEMPTS']

STORE_RESTORE_ATTEMPTS = 3   # Store boundaries tried per admission before computing from the local hit


@dataclass
class ScheduledChunk:
    """One sequence's tokens ``[start, end)`` in this step's forward."""
    seq: Sequence
    start: int
    end: int

    @property
    def sample(self) -> bool:
        """The forward reaches the last token, so a new token is sampled."""
        return self.end == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token, or a chunk that stops short of the last token."""
        return self.end - self.start > 1 or self.end < self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs: the chunks, and the checkpoint restores to copy first."""
    chunks: list[ScheduledChunk] = field(default_factory=list)
    restore_src: list[int] = field(default_factory=list)
    restore_dst: list[int] = field(default_factory=list)
    publish_after_restore: list[tuple[int, TrieNode]] = field(default_factory=list)   # (checkpoint slot, node)


@dataclass
class SavePlan:
    """Checkpoint saves after a forward: copy ``src[i] → dst[i]``, then publish on ``nodes[i]``."""
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    nodes: list[TrieNode] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)


class Scheduler:
    """Owns the waiting/running queues and every admission decision.

    Args:
        config: engine configuration.
        block_manager: KV block owner.
        state_cache: state slot owner, or None for full-attention-only models.
        store: the Store tier (``lookup``/``load``/``save``), or None.
    """

    def __init__(self, config: PytorchEngineConfig, block_manager: BlockManager, state_cache: StateCache | None,
                 store=None):
        self.config = config
        self.block_size = config.block_size
        self.block_manager = block_manager
        self.state_cache = state_cache
        self.is_hybrid = state_cache is not None
        self.trie = BlockTrie(block_manager, self.block_size, state_cache) if config.enable_prefix_caching else None
        self.store = store if config.enable_prefix_caching else None
        self.last_only = config.prefill_save_last_only and self.is_hybrid
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # cumulative counters (SPEC §9), read through Engine.stats()
        self.counters: dict[str, int] = {'prefix_cache_queried_tokens': 0, 'prefix_cache_hit_tokens': 0,
                                         'checkpoints_saved': 0, 'state_miss_tokens': 0}
        self.skipped: dict[str, int] = {}

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
        seq.status = SeqStatus.ABORTED

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished, cache its computed blocks and release its resources."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    # scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_prefill_token_num
        any_prefill = False
        for seq in list(self.running):
            if seq not in self.running:       # preempted by an earlier sequence this step
                continue
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, seq.next_chunk_end())
            size = chunk.end - chunk.start
            if chunk.is_prefill and any_prefill and size > budget:
                continue
            if not self._reserve_blocks(seq, chunk.end):
                continue
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

    def _reserve_blocks(self, seq: Sequence, end: int) -> bool:
        """Ensure ``seq`` has blocks for ``end`` tokens, preempting newer sequences if needed."""
        need = -(-end // self.block_size) - len(seq.block_ids)
        while need > 0:
            try:
                seq.block_ids.extend(self.block_manager.allocate(need))
                return True
            except OutOfBlocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free everything, requeue at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of the sequence's full blocks, computed incrementally."""
        hashes = seq.block_hashes
        full = seq.num_tokens // self.block_size
        if len(hashes) < full:
            hashes[:] = chain_block_hashes(seq.token_ids, self.block_size, full, prefix=hashes)
        return hashes

    def _restorable(self, seq: Sequence, boundary: int) -> bool:
        """A checkpoint at ``boundary`` may seed this turn only if the boundary is reusable for
        this input under every rule of SPEC §3: ≥ max(1, ℓ) tokens remain, the r blocks a restore
        recomputes end by floor_B(n - 1), and no multimodal span (shifted by ℓ) is split."""
        return is_reusable(boundary, seq.num_tokens, self.block_size, self.config.prefill_save_alignment,
                           seq.token_lookahead, seq.recompute_blocks, seq.multimodal_spans)

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Admission transaction: match → pin → allocate → plan; False (nothing held) on failure."""
        B, n = self.block_size, seq.num_tokens
        nodes = self.trie.match(seq.token_ids, self._hashes(seq)) if self.trie is not None else []
        cached, ckpt = 0, None
        if self.is_hybrid:
            for node in reversed(nodes):
                b = node.depth * B
                if (node.checkpoint_slot is not None and self._restorable(seq, b)
                        and node.depth + seq.recompute_blocks <= len(nodes)):
                    cached, ckpt = b, node.checkpoint_slot
                    break
        elif nodes:
            cached = min(len(nodes), (n - 1) // B) * B
        shared = [node.block_id for node in nodes[:cached // B]]
        slot = None
        if self.is_hybrid:
            slot = self.state_cache.alloc_runtime()
            if slot is None:
                return False
        for b in shared:
            self.block_manager.incref(b)
        if ckpt is not None:
            self.state_cache.pin(ckpt)
            self.state_cache.touch(ckpt)
        seq.block_ids, seq.num_shared_blocks, seq.state_slot = list(shared), len(shared), slot
        store_tokens = self._try_store_restore(seq, cached) if self.store is not None else 0
        if store_tokens:
            if ckpt is not None:
                self.state_cache.unpin(ckpt)
                ckpt = None
            cached = store_tokens
        seq.num_computed_tokens = cached
        seq.plan = self._plan(seq, cached)
        if not self._try_allocate(seq, seq.plan.chunk_ends[0]):
            if ckpt is not None:
                self.state_cache.unpin(ckpt)
            self._release(seq, cache_blocks=False)
            return False
        if ckpt is not None:
            out.restore_src.append(ckpt)
            out.restore_dst.append(slot)
            seq.restore_pin = ckpt
        if store_tokens:
            self.store.record_hit(store_tokens)
            self._cache_store_restore(seq, store_tokens, out)
        first = not seq.stats.plans
        seq.stats.plans.append(seq.plan)
        if first:
            seq.num_cached_tokens = cached
            if store_tokens:
                seq.stats.store_hit_tokens = store_tokens
            else:
                seq.stats.hit_tokens = cached
            if self.trie is not None:
                self.counters['prefix_cache_queried_tokens'] += n
                self.counters['prefix_cache_hit_tokens'] += 0 if store_tokens else cached
                matched = min(len(nodes) * B, (n - 1) // B * B)
                self.counters['state_miss_tokens'] += max(0, matched - cached) if self.is_hybrid else 0
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _try_store_restore(self, seq: Sequence, local_cached: int) -> int:
        """Load a deeper prefix than ``local_cached`` from the Store into fresh blocks and the
        runtime slot; returns the restored boundary or 0.

        A boundary whose objects fail to load or verify is skipped for the next shallower one
        the Store holds (at most :data:`STORE_RESTORE_ATTEMPTS` tries per admission).
        """
        hashes, below = self._hashes(seq), None
        for _ in range(STORE_RESTORE_ATTEMPTS):
            found = self.store.lookup(hashes, seq, local_cached, below)
            if not found:
                return 0
            need = found // self.block_size - len(seq.block_ids)
            if not self.block_manager.can_allocate(need):
                return 0
            fresh = self.block_manager.allocate(need)
            blocks = seq.block_ids + fresh
            if self.store.load(hashes, found, blocks, seq.state_slot, seq.num_shared_blocks):
                seq.block_ids = blocks
                return found
            self.block_manager.free_all(fresh)
            below = found
        return 0

    def _cache_store_restore(self, seq: Sequence, boundary: int, out: SchedulerOutput) -> None:
        """Keep a Store restore in the local prefix cache too: insert the loaded blocks and copy
        the restored state into a checkpoint slot (published after the copy runs), so the next
        request with this prefix hits locally instead of reading the Store again."""
        nodes = self.trie.insert(seq.token_ids, seq.block_ids, boundary // self.block_size, self._hashes(seq))
        if len(nodes) != boundary // self.block_size or nodes[-1].checkpoint_slot is not None:
            return
        dst = self.state_cache.alloc_checkpoint()
        if dst is None:
            return
        self.state_cache.pin(dst)
        out.restore_src.append(seq.state_slot)
        out.restore_dst.append(dst)
        out.publish_after_restore.append((dst, nodes[-1]))

    def _try_allocate(self, seq: Sequence, end: int) -> bool:
        need = -(-end // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        if not self.block_manager.can_allocate(need):
            return False
        seq.block_ids.extend(self.block_manager.allocate(need))
        return True

    def _plan(self, seq: Sequence, cached: int) -> PrefillPlan:
        """The turn's chunk plan; saves only when a hybrid model caches prefixes.

        The input turn is the prompt: a sequence re-admitted after preemption plans its save
        points over the prompt alone, then recomputes its generated tokens in plain chunks, so
        it never takes more checkpoints than its first admission planned.
        """
        cfg, P = self.config, self.config.max_prefill_token_num
        ends, saves, start = [], [], cached
        turn = seq.num_prompt_tokens
        if self.is_hybrid and self.trie is not None and cached < turn:
            plan = plan_prefill(turn, cached, P, self.block_size, cfg.prefill_save_alignment, self.last_only,
                                seq.token_lookahead, seq.recompute_blocks, seq.multimodal_spans)
            ends, saves, start = list(plan.chunk_ends), list(plan.save_points), turn
        if start < seq.num_tokens:
            ends += list(range(start + P, seq.num_tokens, P)) + [seq.num_tokens]
        return PrefillPlan(ends, saves, cached)

    def remaining_prefill_chunks(self, seq: Sequence) -> int:
        """The scheduler's estimate of a sequence's remaining prefill forwards (from its plan)."""
        if seq.plan is None:
            return 0
        return num_remaining_chunks(seq.plan, seq.num_computed_tokens)

    def restores_done(self, out: SchedulerOutput, copied: bool = True) -> None:
        """Unpin checkpoints whose restore copy has been executed; publish local copies of
        Store restores (their copy ran with the restores). ``copied=False`` (the copy raised)
        releases those slots unpublished instead (SPEC §8)."""
        for dst, node in out.publish_after_restore:
            self.state_cache.unpin(dst)
            if copied:
                self.state_cache.publish(dst, node)
            else:
                self.state_cache.release_checkpoint(dst)
        for chunk in out.chunks:
            ckpt, chunk.seq.restore_pin = chunk.seq.restore_pin, None
            if ckpt is not None:
                self.state_cache.unpin(ckpt)

    # after the forward -----------------------------------------------------------------
    def plan_saves(self, out: SchedulerOutput) -> SavePlan:
        """Advance computed tokens, cache new full blocks, and plan checkpoint saves."""
        saves = SavePlan()
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if chunk.is_prefill or chunk.start < seq.num_prompt_tokens:
                seq.stats.prefill_forwards += 1
            if self.trie is None:
                continue
            save = self.is_hybrid and seq.plan is not None and seq.plan.is_save_point(chunk.end)
            full = chunk.end // self.block_size
            if full <= seq.num_trie_blocks and not save:   # no new full block: skip the trie walk
                continue
            seq.trie_node = self.trie.extend(seq.trie_node, seq.token_ids, seq.block_ids, full, self._hashes(seq))
            seq.num_trie_blocks = full
            if not save:
                continue
            if self.store is not None:    # the Store copies the state out of the runtime slot now
                self.store.save(self._hashes(seq)[:chunk.end // self.block_size],
                                seq.block_ids[:chunk.end // self.block_size], chunk.end, seq.state_slot)
            node = seq.trie_node if seq.trie_node.depth == full else None
            if node is None:
                self._skip(seq, 'hash_collision')
            elif node.checkpoint_slot is not None or node in saves.nodes:
                # already published, or another sequence of this forward saves the same prefix
                # (one node holds one checkpoint; a second publish would orphan a slot)
                if node.checkpoint_slot is not None:
                    self.state_cache.touch(node.checkpoint_slot)
                self._skip(seq, 'exists')
            else:
                dst = self.state_cache.alloc_checkpoint()
                if dst is None:
                    self._skip(seq, 'no_free_slot')
                    continue
                self.state_cache.pin(dst)
                saves.src.append(seq.state_slot)
                saves.dst.append(dst)
                saves.nodes.append(node)
                saves.seqs.append(seq)
                saves.boundaries.append(chunk.end)
        return saves

    def publish_saves(self, saves: SavePlan, copied: bool = True) -> None:
        """Publish checkpoints whose copy has run (SPEC §8: never before); ``copied=False``
        (the copy raised) releases their slots unpublished and counts the skips."""
        for seq, node, dst, b in zip(saves.seqs, saves.nodes, saves.dst, saves.boundaries):
            self.state_cache.unpin(dst)
            if not copied:
                self.state_cache.release_checkpoint(dst)
                self._skip(seq, 'copy_failed')
                continue
            self.state_cache.publish(dst, node)
            seq.stats.save_points.append(b)
            self.counters['checkpoints_saved'] += 1

    def _skip(self, seq: Sequence, reason: str) -> None:
        seq.stats.skipped[reason] += 1
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    # resources ---------------------------------------------------------------------------
    def _release(self, seq: Sequence, cache_blocks: bool = True) -> None:
        """Give back blocks (caching computed full blocks first) and the runtime slot."""
        ckpt, seq.restore_pin = seq.restore_pin, None
        if ckpt is not None:
            self.state_cache.unpin(ckpt)
        if self.trie is not None and cache_blocks and seq.block_ids:
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
            self.trie.insert(seq.token_ids, seq.block_ids, full, self._hashes(seq))
        self.block_manager.free_all(seq.block_ids)
        seq.block_ids, seq.num_shared_blocks = [], 0
        if seq.state_slot is not None:
            self.state_cache.free_runtime(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0
        seq.num_trie_blocks, seq.trie_node = 0, None
        seq.plan = None
