"""Model runner: turns scheduled chunks into one flat batch, runs it on every rank, samples.

:meth:`ModelRunner.step_batch` is the engine's one flat-batch builder: the step's chunks become
a :class:`~lmdeploy.pytorch.model_inputs.StepBatch` of plain integers (token ids,
positions, block tables, state slots, the rows whose logits are needed). The executor runs
:meth:`~lmdeploy.pytorch.engine.rank.Worker.forward` on every rank (at tp=1 rank 0's
worker, in this process); the logits come back to rank 0, which samples them here.

A chunk with draft tokens (speculative decoding, :mod:`lmdeploy.pytorch.spec_decode`) is
scored as one longer chunk of its sequence: its drafts follow its tokens in the flat batch
(positions and KV slots continue), and the logits of its last ``1 + K`` positions go to
:func:`~lmdeploy.pytorch.spec_decode.acceptance.verify_drafts` instead of the sampler.
"""
from __future__ import annotations

import torch

from ..model_inputs import StepBatch
from ..sampling.sampler import TokenLogprob, prompt_token_logprobs, sample
from ..spec_decode.acceptance import verify_drafts
from .scheduler import SchedulerOutput

__all__ = ['ModelRunner', 'tokens_from_logits']


class ModelRunner:
    """Executes forwards through ``executor`` and samples on rank 0.

    Args:
        executor: a :class:`~lmdeploy.pytorch.engine.executor.LocalExecutor` or
            :class:`~lmdeploy.pytorch.engine.executor.MultiProcessExecutor`.
        cache_engine: the executor's :class:`~lmdeploy.pytorch.engine.executor.ExecutorCaches`.

    Attributes:
        model: rank 0's model (its vision tower computes the step's image inputs).
        last_batch: the last forward's :class:`StepBatch` (MTP drafting reads its row starts).
        last_logits: ``[plain sampled chunks, vocab]`` float32 logits of the last forward (tests).
        last_logprobs: ``{seq_id: TokenLogprob}`` of the last forward, for sequences that asked.
        all_logits: ``[T, vocab]`` logits of every row of the last forward with
            ``return_all_logits`` (tests).
    """

    def __init__(self, executor, cache_engine):
        self.executor = executor
        self.model = executor.worker.model
        self.cache_engine = cache_engine
        self.device = cache_engine.device
        self.last_logits: torch.Tensor | None = None
        self.last_logprobs: dict[int, TokenLogprob] = {}
        self.last_batch: StepBatch | None = None

    @staticmethod
    def step_batch(out: SchedulerOutput, all_logits: bool = False) -> StepBatch:
        """The plain-integer inputs of the step's chunks: per sequence its block table, and its
        sliding-window group's table when that group has one of its own (then every scheduled
        sequence has one). A chunk with drafts (speculative decoding) is scored as one longer
        chunk, its drafts after its tokens; its logits rows are its last ``1 + K`` positions."""
        b = StepBatch([], [], [], [], [], [], [], [], all_logits)
        offset = 0
        for chunk in out.chunks:
            seq = chunk.seq
            n = chunk.end - chunk.start + len(chunk.drafts)
            b.input_ids.extend(seq.token_ids[chunk.start:chunk.end])
            b.input_ids.extend(chunk.drafts)
            b.positions.extend(range(chunk.start, chunk.start + n))
            b.q_seqlens.append(n)
            b.q_start_loc.append(offset)
            offset += n
            b.kv_seqlens.append(chunk.start + n)
            # a freed entry (FREED_BLOCK) lies wholly before every window the forward reads, so
            # any valid id will do there: the kernel neither reads nor writes it
            b.block_tables.append([max(i, 0) for i in seq.block_ids])
            if seq.window_block_ids:        # the sliding layers' own table (a mixed model's window group)
                b.window_block_tables.append([max(i, 0) for i in seq.window_block_ids])
            b.state_slots.append(-1 if seq.state_slot is None else seq.state_slot)
            b.prompt_lens.append(seq.num_prompt_tokens)
            if chunk.sample:
                b.sample_rows.extend(range(offset - 1 - len(chunk.drafts), offset))
        return b

    def image_inputs(self, out: SchedulerOutput, batch: StepBatch):
        """Rank 0's image inputs of the step (the vision tower runs here, on rank 0 only);
        ``None`` for a model without images or a step without any. Moved to the CPU when other
        ranks receive them (the broadcast pickles them)."""
        history = [kv - q for kv, q in zip(batch.kv_seqlens, batch.q_seqlens)]
        images = self.model.image_inputs([c.seq for c in out.chunks], history, batch.q_seqlens, batch.q_start_loc)
        if images is None or self.executor.size == 1:
            return images
        return images.cpu()

    def forward(self, out: SchedulerOutput, return_all_logits: bool = False) -> dict[int, list[int]]:
        """Run the step's forward on every rank.

        Args:
            out: the scheduled chunks.
            return_all_logits: keep logits of every position in ``self.all_logits`` (tests).

        Returns:
            ``{seq_id: new tokens}`` for chunks that reached their sequence's last token: one
            sampled token, or for a chunk with drafts its accepted drafts plus one token. The
            log-probabilities of sampled tokens (when requested) are left in
            ``self.last_logprobs``.
        """
        self.last_logprobs = {}
        self.last_batch = batch = self.step_batch(out, return_all_logits)
        batch.images = self.image_inputs(out, batch)
        spans = self._prompt_rows(out, batch)
        logits, all_logits, prompt_logits = self.executor.call('forward', batch)
        if return_all_logits:
            self.all_logits = all_logits
        self._record_prompt_logprobs(spans, prompt_logits)
        if logits is None:
            return {}
        plain, verify, row = [], [], 0
        for c in out.chunks:
            if c.sample:
                (verify if c.drafts else plain).append((c, row))
                row += 1 + len(c.drafts)
        return tokens_from_logits(self, logits, plain, verify)

    def mtp_step(self, batch) -> list[int]:
        """Run an MTP step (:class:`~lmdeploy.pytorch.spec_decode.mtp.MTPBatch`) on every rank,
        each over its own last forward's hidden states; returns rank 0's draft token ids (every
        rank computes the same)."""
        return self.executor.call('mtp_step', batch)


    @staticmethod
    def _prompt_rows(out: SchedulerOutput, batch: StepBatch) -> list[tuple]:
        """Add to ``batch.prompt_rows`` the flat rows whose logits predict prompt tokens of the
        sequences that asked for prompt log-probabilities (position p predicts token p + 1;
        positions already recorded, e.g. recomputed after preemption, are skipped). Returns
        ``(seq, first position, stop position)`` per such chunk, in row order."""
        spans = []
        for i, c in enumerate(out.chunks):
            seq = c.seq
            if seq.gen_config.prompt_logprobs is None:
                continue
            first = max(c.start, len(seq.prompt_logprobs))
            last = min(c.end, seq.num_prompt_tokens - 1)
            if first >= last:
                continue
            row0 = batch.q_start_loc[i] - c.start
            batch.prompt_rows.extend(range(row0 + first, row0 + last))
            spans.append((seq, first, last))
        return spans

    @staticmethod
    def _record_prompt_logprobs(spans: list[tuple], logits: torch.Tensor | None) -> None:
        """Append each span's prompt-token log-probabilities (from ``logits``, the rows of
        :meth:`_prompt_rows` in order) to its sequence's ``prompt_logprobs``."""
        row = 0
        for seq, first, last in spans:
            n = last - first
            k = seq.gen_config.prompt_logprobs
            seq.prompt_logprobs.extend(prompt_token_logprobs(logits[row:row + n], seq.token_ids[first + 1:last + 1], k))
            row += n


def tokens_from_logits(runner, logits: torch.Tensor, plain: list, verify: list) -> dict[int, list[int]]:
    """The new tokens of a forward's sampled chunks, from their logits rows.

    Args:
        runner: the model runner; its ``last_logits`` (the plain chunks' rows) and
            ``last_logprobs`` are set here.
        logits: ``[rows, vocab]`` float32: one row per plain chunk, ``1 + K`` per chunk with K drafts.
        plain: ``(chunk, row)`` of chunks without drafts: one token sampled from ``logits[row]``.
        verify: ``(chunk, first row)`` of chunks with drafts: accepted drafts plus one token
            (:func:`~lmdeploy.pytorch.spec_decode.acceptance.verify_drafts`).

    Returns:
        ``{seq_id: new tokens}``.
    """
    new_tokens = {}
    if plain:
        # without drafts the forward computed exactly the plain chunks' rows, in order (no gather)
        plain_logits = (logits if not verify and len(plain) == logits.shape[0]
                        else logits[torch.tensor([r for _, r in plain], device=logits.device)])
        runner.last_logits = plain_logits
        seqs = [c.seq for c, _ in plain]
        tokens, logprobs = sample(plain_logits, seqs)
        runner.last_logprobs = {seq.seq_id: lp for seq, lp in zip(seqs, logprobs) if lp is not None}
        new_tokens = {seq.seq_id: [tok] for seq, tok in zip(seqs, tokens)}
    for c, r in verify:
        new_tokens[c.seq.seq_id] = verify_drafts(logits[r:r + len(c.drafts) + 1], list(c.drafts), c.seq)
    return new_tokens
