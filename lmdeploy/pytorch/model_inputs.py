"""The inputs of one model forward: a flat batch of new tokens plus cache handles.

The model runner builds one :class:`StepContext` per forward; model layers read it to find
where each sequence's tokens are, which KV blocks and which state slot belong to it::

    flat tokens  | seq 0 (prefill chunk, 5 new) | seq 1 (decode, 1 new) |
    q_start_loc    0                              5
    q_seqlens      5                              1
    kv_seqlens     133 (128 cached + 5 new)       41 (40 cached + 1 new)
    history_len    128                            40

A sequence whose ``history_len`` is 0 starts from a zero recurrent state; otherwise its
state slot holds the state after exactly ``history_len`` tokens.

Batched kernels take the same layout as tensors, built once per step on first use and then
shared by every layer (so a layer never loops over sequences in Python to find its rows)::

    cu_seqlens      [0, 5, 6]           int64 [N + 1], sequence i owns rows [cu[i], cu[i+1])
    seq_ids         [0,0,0,0,0, 1]      int64 [T], the sequence of each flat token
    slots           [slot0, slot1]      int64 [N]
    has_history     [True, True]        bool  [N], history_len > 0 (else start from zeros)
    slot_span       (lo, order) | None  decode only: the slots as one range of the state caches
    block_table     [[b, b, b], [b, b, 0]]  int64 [N, max_blocks], short rows padded with 0

A model whose sliding-window layers have block tables of their own (a mixed model, see
:func:`~lmdeploy.pytorch.cache_specs.paged_groups`) gets them in ``window_block_tables``; a
sliding layer's kernel reads its blocks through :meth:`StepContext.paged_group`, the same
context with those tables in place of the global ones (built once per step).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

__all__ = ['StepContext', 'fused_state_rows', 'kv_gather_index', 'slot_range']

# Steps of at most this many new tokens (decode-sized) build StepContext.seq_ids and .kv_positions
# with Python over the per-sequence lists and one tensor copy: about 10 small tensor ops cost more
# (measured on CPU, 2 threads: 0.04 ms tensor form against 0.01 ms for one token; the list form
# grows by about 0.15 us a token and passes the tensor form's 0.16 ms near 1,000 tokens).
HOST_INDEX_TOKENS = 256


def kv_gather_index(block_table: torch.Tensor, kv_seqlens: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each key position of each sequence lives in a paged cache.

    Args:
        block_table: int64 ``[N, W]`` block ids per sequence (rows padded with any valid id).
        kv_seqlens: int64 ``[N]`` keys per sequence (each ``>= 1``).
        block_size: tokens per block.

    Returns:
        ``(block id, offset, valid)``, each ``[N, S]`` with ``S = W * block_size``. Positions
        ``>= kv_seqlen`` point at position 0 of the sequence (always written, so finite) and are
        ``valid == False``: a cache entry never written may hold NaN, and NaN survives masking
        (``0 * NaN``).
    """
    S = block_table.shape[1] * block_size
    pos = torch.arange(S, device=block_table.device)[None, :]
    valid = pos < kv_seqlens[:, None]
    pos = torch.where(valid, pos, 0)
    return block_table.gather(1, pos // block_size), pos % block_size, valid


@dataclass
class StepBatch:
    """One forward's inputs as plain lists: what the engine builds from the scheduled chunks
    (:meth:`~lmdeploy.pytorch.engine.model_runner.ModelRunner.step_batch`, or the shifted
    positions of an MTP step) and broadcasts to every tensor-parallel rank. See
    :class:`StepContext` for the meaning of the fields; :meth:`context` is the one place a
    :class:`StepContext` is made from them.

    Attributes:
        input_ids, positions: flat token ids and positions, ``T`` each.
        q_seqlens, q_start_loc, kv_seqlens, state_slots: one entry per sequence (state slot
            ``-1``: no recurrent state, e.g. an MTP step).
        block_tables: one list of block ids per sequence.
        window_block_tables: one list of block ids per sequence in the sliding-window group's own
            pool (a mixed model's window layers: :func:`~lmdeploy.pytorch.cache_specs.paged_groups`),
            or empty when every paged layer reads ``block_tables``.
        sample_rows: flat rows whose logits are needed (each sampled chunk's last token, and
            with speculative decoding the positions of its drafts before it).
        all_logits: also compute the logits of every row (tests).
        prompt_rows: flat rows whose logits predict prompt tokens (prompt log-probabilities).
        prompt_lens: per sequence, the tokens of its request's prompt (positions below it are
            prompt tokens, the rest were generated); empty where the caller has none.
        images: only for a step of a model with images whose batch holds an image (Qwen3.5):
            rank 0's :class:`~lmdeploy.pytorch.models.qwen3_5.ImageInputs` — M-RoPE positions
            int64 ``[3, T]``, image rows int64 ``[R]`` and the vision tower's ``[R, hidden]``
            output in the model dtype (on the CPU when other ranks receive them); ``None``
            otherwise (plain integers only).
    """
    input_ids: list[int]
    positions: list[int]
    q_seqlens: list[int]
    q_start_loc: list[int]
    kv_seqlens: list[int]
    block_tables: list[list[int]]
    state_slots: list[int]
    sample_rows: list[int] = field(default_factory=list)
    all_logits: bool = False
    images: object = None
    prompt_rows: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    window_block_tables: list[list[int]] = field(default_factory=list)

    def context(self, device: torch.device, kv_caches, state_caches, block_size: int) -> 'StepContext':
        """The :class:`StepContext` of this batch on ``device`` over the given caches (a rank's
        :class:`~lmdeploy.pytorch.cache_engine.CacheEngine` tensors)."""
        window = None
        if self.window_block_tables:
            window = [torch.tensor(t, dtype=torch.long, device=device) for t in self.window_block_tables]
        return StepContext(input_ids=torch.tensor(self.input_ids, dtype=torch.long, device=device),
                           positions=torch.tensor(self.positions, dtype=torch.long, device=device),
                           q_seqlens=self.q_seqlens, q_start_loc=self.q_start_loc, kv_seqlens=self.kv_seqlens,
                           block_tables=[torch.tensor(t, dtype=torch.long, device=device) for t in self.block_tables],
                           state_slots=self.state_slots, kv_caches=kv_caches, state_caches=state_caches,
                           block_size=block_size, prompt_lens=self.prompt_lens, window_block_tables=window)


@dataclass
class StepContext:
    """One forward's batch (all sequences' new tokens concatenated).

    Attributes:
        input_ids: ``[T]`` int64, the new tokens of every sequence, concatenated.
        positions: ``[T]`` int64, absolute position of each token in its sequence.
        q_seqlens: new tokens per sequence (length = number of sequences).
        q_start_loc: offset of each sequence's first new token in ``input_ids``.
        kv_seqlens: tokens in each sequence's cache after this forward (history + new).
        block_tables: per sequence, ``[num_blocks]`` int64 block ids covering ``kv_seqlens``.
        state_slots: per sequence, the runtime state slot (``-1`` for models without state).
        kv_caches: per layer, ``(k_cache, v_cache)`` each ``[num_blocks, block_size,
            num_kv_heads, head_dim]`` for full-attention layers, else ``None``.
        state_caches: per layer, ``(conv_state [num_slots, conv_dim, kernel_size - 1],
            recurrent_state [num_slots, num_v_heads, k_head_dim, v_head_dim] float32)`` for
            linear-attention layers, else ``None``.
        block_size: tokens per KV block.
        sequences: per sequence, the engine's :class:`~lmdeploy.pytorch.paging.sequence.Sequence`
            (models with images read its ``multimodal`` list); empty where the caller has none.
        prompt_lens: per sequence, the tokens of its request's prompt; empty where the caller
            has none (see :attr:`prompt_token_mask`).
        window_block_tables: per sequence, ``[num_blocks]`` int64 block ids of the
            sliding-window group's own pool (leading entries out of the window point at any valid
            row: never read), or None when sliding layers read :attr:`block_tables` too.
        kernel_memo: index tensors a kernel derives from this step's layout once and every
            layer reuses, keyed by the kernel (e.g. the window attention's gather plan per window).
            Each paged group's view (:meth:`paged_group`) has a memo of its own: a plan built
            from one group's block tables is never found by a layer reading the other's.
    """
    input_ids: torch.Tensor
    positions: torch.Tensor
    q_seqlens: list[int]
    q_start_loc: list[int]
    kv_seqlens: list[int]
    block_tables: list[torch.Tensor]
    state_slots: list[int]
    kv_caches: list = field(default_factory=list)
    state_caches: list = field(default_factory=list)
    block_size: int = 64
    sequences: list = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    window_block_tables: list[torch.Tensor] | None = None
    kernel_memo: dict = field(default_factory=dict, repr=False, compare=False)

    def paged_group(self, window: int | None) -> 'StepContext':
        """The context whose block tables address the K/V of a layer with sliding ``window``
        (None: a global layer): this one, or for a sliding layer of a model whose window group
        has tables of its own, a copy holding those as its :attr:`block_tables` (one per step,
        shared by every sliding layer, so its batched tables are built once) and an empty
        :attr:`kernel_memo` of its own."""
        if window is None or self.window_block_tables is None:
            return self
        return self._window_view

    @cached_property
    def _window_view(self) -> 'StepContext':
        # A fresh memo: memo keys name the kernel and its parameters, not the block tables, so a
        # shared memo would hand a sliding layer a plan gathered from the global tables.
        return replace(self, block_tables=self.window_block_tables, window_block_tables=None, kernel_memo={})

    @property
    def num_seqs(self) -> int:
        """Sequences in this forward."""
        return len(self.q_seqlens)

    @property
    def history_lens(self) -> list[int]:
        """Tokens already cached for each sequence before this forward."""
        return [kv - q for kv, q in zip(self.kv_seqlens, self.q_seqlens)]

    @property
    def device(self) -> torch.device:
        """Device of the flat batch."""
        return self.input_ids.device

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[N + 1]`` cumulative new-token counts: sequence ``i`` owns flat rows
        ``[cu_seqlens[i], cu_seqlens[i + 1])``."""
        starts = list(self.q_start_loc) + [self.q_start_loc[-1] + self.q_seqlens[-1] if self.q_seqlens else 0]
        return torch.tensor(starts, dtype=torch.int64, device=self.device)

    @cached_property
    def seq_ids(self) -> torch.Tensor:
        """int64 ``[T]``: index of the sequence each flat token belongs to."""
        if self.input_ids.shape[0] <= HOST_INDEX_TOKENS:
            ids = [i for i, q in enumerate(self.q_seqlens) for _ in range(int(q))]
            return torch.tensor(ids, dtype=torch.int64, device=self.device)
        counts = torch.tensor(self.q_seqlens, dtype=torch.int64, device=self.device)
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=self.device), counts)

    @cached_property
    def slots(self) -> torch.Tensor:
        """int64 ``[N]``: each sequence's runtime state slot (``-1`` for models without state)."""
        return torch.tensor(self.state_slots, dtype=torch.int64, device=self.device)

    @cached_property
    def has_history(self) -> torch.Tensor:
        """bool ``[N]``: the sequence has cached tokens (its slot holds a state to continue)."""
        return torch.tensor([h > 0 for h in self.history_lens], dtype=torch.bool, device=self.device)

    @cached_property
    def slot_span(self) -> tuple[int, torch.Tensor | None] | None:
        """For a step of one new token per sequence, :func:`slot_range`
        of its slots (the decode kernels then update that slice of the state caches in place);
        ``None`` otherwise. Computed once per step for all layers."""
        if not self.q_seqlens or any(q != 1 for q in self.q_seqlens):
            return None
        return slot_range(self.slots, self.has_history)

    @cached_property
    def kv_seqlens_t(self) -> torch.Tensor:
        """int64 ``[N]``: :attr:`kv_seqlens` as a tensor."""
        return torch.tensor(self.kv_seqlens, dtype=torch.int64, device=self.device)

    @cached_property
    def block_table(self) -> torch.Tensor:
        """int64 ``[N, max_blocks]``: :attr:`block_tables` stacked, short rows padded with block 0
        (padding is never read: every kernel masks positions ``>= kv_seqlen``)."""
        rows = [t.tolist() for t in self.block_tables]
        width = max([len(r) for r in rows] + [1])
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64, device=self.device)

    @cached_property
    def kv_positions(self) -> torch.Tensor:
        """int64 ``[T]``: cache position of each flat token (``history_len + j`` for its ``j``-th
        new token), where its K/V is written: ``history_len + row - q_start_loc`` for each flat
        ``row`` of the sequence (rows taken in :attr:`seq_ids` order)."""
        if self.input_ids.shape[0] <= HOST_INDEX_TOKENS:
            pos, row = [], 0
            for kv, q, start in zip(self.kv_seqlens, self.q_seqlens, self.q_start_loc):
                q = int(q)
                first = int(kv) - q + row - int(start)
                pos.extend(range(first, first + q))
                row += q
            return torch.tensor(pos, dtype=torch.int64, device=self.device)
        history = self.kv_seqlens_t - torch.tensor(self.q_seqlens, dtype=torch.int64, device=self.device)
        rows = torch.arange(self.input_ids.shape[0], device=self.device)
        return history[self.seq_ids] + rows - self.cu_seqlens[self.seq_ids]

    @cached_property
    def kv_write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block id, offset in block)``, each int64 ``[T]``: where each flat token's K/V goes."""
        pos = self.kv_positions
        return self.block_table[self.seq_ids, pos // self.block_size], pos % self.block_size

    @cached_property
    def kv_gather_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`kv_gather_index` of this step's :attr:`block_table` (built once, shared by all layers)."""
        return kv_gather_index(self.block_table, self.kv_seqlens_t, self.block_size)

    @cached_property
    def prompt_token_mask(self) -> torch.Tensor:
        """bool ``[T]``: the flat token is part of its request's prompt (position below its
        sequence's :attr:`prompt_lens` entry), not a generated token a decode step feeds back.
        Without ``prompt_lens`` (a context built by hand) a sequence's tokens count as prompt
        unless it adds one token to a non-empty history (a decode step). Zamba2 reads it: its
        ``transformers`` reference treats prompt and decode tokens differently."""
        if self.prompt_lens:
            lens = torch.tensor(self.prompt_lens, dtype=torch.int64, device=self.device)
            return self.positions < lens[self.seq_ids]
        prompt = [not (q == 1 and h > 0) for q, h in zip(self.q_seqlens, self.history_lens)]
        return torch.tensor(prompt, dtype=torch.bool, device=self.device)[self.seq_ids]

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token to a non-empty history (a pure decode step)."""
        return all(q == 1 for q in self.q_seqlens) and all(h > 0 for h in self.history_lens)

    def seq_slice(self, i: int) -> slice:
        """The slice of the flat token axis that belongs to sequence ``i``."""
        start = self.q_start_loc[i]
        return slice(start, start + self.q_seqlens[i])


def slot_range(slots: torch.Tensor, has_history: torch.Tensor) -> tuple[int, torch.Tensor | None] | None:
    """Whether a decode step's state slots can be updated in place as one slice of the cache.

    Args:
        slots: int64 ``[N]`` distinct state slots of the step's sequences.
        has_history: bool ``[N]``.

    Returns:
        ``(lo, order)`` when ``slots`` are exactly ``lo .. lo + N - 1`` in some order and every
        sequence has history (``order`` the permutation sorting them, ``None`` when already
        sorted); otherwise ``None``. Always ``None`` for device tensors (reading them would
        synchronise).
    """
    if slots.device.type != 'cpu' or not bool(has_history.all()):
        return None
    ids = slots.tolist()
    if not ids:
        return None
    lo = min(ids)
    if ids == list(range(lo, lo + len(ids))):
        return lo, None
    if sorted(ids) == list(range(lo, lo + len(ids))):
        return lo, torch.argsort(slots)
    return None


def fused_state_rows(ctx: 'StepContext', x: torch.Tensor, state: torch.Tensor) -> slice | None:
    """The rows of a layer's state caches that a fused float32 decode kernel updates in place in
    step ``ctx``: ``slice(lo, lo + N)`` when ``x`` (the layer's ``[N, ...]`` input) and the
    ``state`` cache are float32, ``x`` has one row per sequence and ``ctx.slot_span`` is one
    sorted range; otherwise ``None`` (the layer runs its unfused path)."""
    if x.dtype != torch.float32 or state.dtype != torch.float32 or x.shape[0] != ctx.slots.shape[0]:
        return None
    span = ctx.slot_span
    if span is None or span[1] is not None:
        return None
    return slice(span[0], span[0] + x.shape[0])
