"""Sequences: one request's tokens and the resources it holds.

A sequence counts tokens, not phases (prefill and decode are the same step with other counts)::

    token_ids        [ prompt ............................ | generated ... ]
    num_computed     ----------------------^  KV/state exist for these tokens
    prefill          num_computed < len(token_ids) - 1  (chunks follow `plan`)
    decode           num_computed == len(token_ids) - 1 (one new token per step)

A sequence holds what the forward needs — its block table and runtime state slot — and
nothing of the prefix cache's bookkeeping (hashes, trie paths, pins), which the cache tiers own
(:mod:`lmdeploy.pytorch.prefix_cache`). Leading blocks attached from the prefix cache are
read-only: the sequence only ever writes blocks after them.
"""
from __future__ import annotations

import enum
import itertools
from collections import Counter
from dataclasses import dataclass, field

import torch

from ...messages import GenerationConfig
from .prefill_plan import PrefillPlan, next_chunk_end

__all__ = ['SeqStatus', 'Sequence', 'SequenceStats', 'FREED_BLOCK']

FREED_BLOCK = -1    # a block-table entry whose block the sequence gave back (out of its group's window)

_SEQ_IDS = itertools.count()


class SeqStatus(enum.Enum):
    """Lifecycle: WAITING → RUNNING → FINISHED/ABORTED (RUNNING → WAITING on preemption)."""
    WAITING = 'waiting'
    RUNNING = 'running'
    FINISHED = 'finished'
    ABORTED = 'aborted'


@dataclass
class SequenceStats:
    """What the prefix cache did for one sequence (read by tests and metrics).

    Attributes:
        save_points: boundaries (tokens) whose checkpoint this sequence saved.
        skipped: checkpoints skipped, by reason (e.g. ``'no_free_slot'``, ``'exists'``).
        prefill_forwards: prefill forwards run, one per plan chunk.
        hit_tokens: prompt tokens restored from the local prefix cache.
        store_hit_tokens: prompt tokens restored from the Store.
        plans: the prefill plans used (one per admission).
        turn_end_point: boundary (tokens) of the turn-end checkpoint saved at finish, or None.
    """
    save_points: list[int] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    prefill_forwards: int = 0
    hit_tokens: int = 0
    store_hit_tokens: int = 0
    plans: list[PrefillPlan] = field(default_factory=list)
    turn_end_point: int | None = None


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    Attributes:
        token_ids: prompt followed by generated tokens.
        num_prompt_tokens: tokens of the input turn.
        gen_config: sampling/stopping options.
        multimodal_spans: half-open ``[s, e)`` token ranges never split by a checkpoint.
        token_lookahead: ℓ of the decoding strategy (MTP); 0 without speculative decoding.
        recompute_blocks: r of the decoding strategy; 0 by default.
        eos_token_ids: ids that end generation unless ``gen_config.ignore_eos``.
        draft_ids: speculative tokens proposed for the next decode step (verified, never
            trusted: see :mod:`lmdeploy.pytorch.spec_decode`); empty without speculation.
        multimodal: the request's images (:class:`~lmdeploy.pytorch.multimodal.MultimodalInput`),
            in prompt order; their spans join ``multimodal_spans`` and their content hashes
            the block hashes.
        encoder_cache: the model's per-image encoder outputs kept between forwards of this
            sequence (keyed by index in ``multimodal``); owned by the model.
        guide: the grammar matcher of a request with ``gen_config.structured_output``
            (:class:`~lmdeploy.pytorch.engine.guided.Guide`), advanced by every appended token and
            closed when the sequence ends; None otherwise.
        prompt_logprobs: with ``gen_config.prompt_logprobs``, one
            :class:`~lmdeploy.pytorch.sampling.sampler.TokenLogprob` per prompt token after the first
            (filled as the prefill chunks run).
        stop_strings: the :class:`~lmdeploy.pytorch.engine.stop_strings.Detokenizer` that
            watches the output for ``gen_config.stop_words`` (None without stop strings).
        num_kept_tokens: once a stop string ended the reply, the tokens (prompt included)
            whose text lies wholly before it — what a next turn re-sending the visible reply
            shares with this sequence; None otherwise.
        shared_head_tokens: tokens of the prompt's shared head — a chat request's rendered
            system/developer messages and tool definitions, which every session of the same
            agent sends — or None (raw prompts): the planner adds a forward end and a save
            point at its last reusable boundary.
        block_ids: the table of the first paged group (the one the prefix cache indexes: the
            global layers, or every paged layer when they all slide): the block of each
            ``block_size`` tokens, in order; :data:`FREED_BLOCK` for a leading block that fell
            out of the group's sliding window (see
            :meth:`~lmdeploy.pytorch.engine.scheduler.Scheduler.computed`), or that a restore did
            not need (below the window of the restored boundary: neither attached nor allocated
            at admission).
        num_freed_blocks: how many leading entries of ``block_ids`` are :data:`FREED_BLOCK`.
        window_block_ids: the table of a sliding-window group with a pool of its own (a model
            of global and sliding layers, :func:`~lmdeploy.pytorch.cache_specs.paged_groups`),
            same indexing, leading entries :data:`FREED_BLOCK` once out of the window; empty
            otherwise.
        num_window_freed_blocks: how many leading entries of ``window_block_ids`` are
            :data:`FREED_BLOCK`.
        handoff: the request's prefill/decode hand-off
            (:class:`~lmdeploy.pytorch.paging.handoff.Handoff`) on an engine with a ``role``
            other than ``'both'``; None otherwise.
    """
    token_ids: list[int]
    gen_config: GenerationConfig
    multimodal_spans: tuple[tuple[int, int], ...] = ()
    token_lookahead: int = 0
    recompute_blocks: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    multimodal: tuple = ()
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    plan: PrefillPlan | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stats: SequenceStats = field(default_factory=SequenceStats)
    generator: torch.Generator | None = None
    draft_ids: list[int] = field(default_factory=list)
    encoder_cache: dict = field(default_factory=dict, repr=False)
    guide: object | None = field(default=None, repr=False)
    prompt_logprobs: list = field(default_factory=list, repr=False)
    stop_strings: object = field(default=None, repr=False)
    num_kept_tokens: int | None = None
    shared_head_tokens: int | None = None
    num_freed_blocks: int = 0
    window_block_ids: list[int] = field(default_factory=list)
    num_window_freed_blocks: int = 0
    handoff: object = field(default=None, repr=False)

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)
        if self.multimodal:
            self.multimodal_spans = tuple(sorted(set(self.multimodal_spans) | {m.span for m in self.multimodal}))
        if self.gen_config.random_seed is not None:
            self.generator = torch.Generator().manual_seed(self.gen_config.random_seed)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefill(self) -> bool:
        """More than one token is still to be computed."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        """The sequence has ended: finished normally or aborted."""
        return self.status in (SeqStatus.FINISHED, SeqStatus.ABORTED)

    def next_chunk_end(self) -> int:
        """End (exclusive, in tokens) of the next forward: the next plan chunk end while
        prefilling, else the last token (one token past ``num_computed_tokens`` in plain
        decoding; more after speculative drafts were accepted without their state)."""
        end = next_chunk_end(self.plan, self.num_computed_tokens) if self.plan is not None else None
        return max(self.num_tokens, self.num_computed_tokens + 1) if end is None else end
