"""Model runner: turns scheduled chunks into one flat forward and samples new tokens.

It builds the :class:`~lmdeploy.pytorch.model_inputs.StepContext` from the chunks (token ids,
positions, block tables, state slots), runs the model, computes logits only for chunks that
reach their sequence's last token, and samples them.

A chunk with draft tokens (speculative decoding, :mod:`lmdeploy.pytorch.spec_decode`) is
scored as one longer chunk of its sequence: its drafts follow its tokens in the flat batch
(positions and KV slots continue), and the logits of its last ``1 + K`` positions go to
:func:`~lmdeploy.pytorch.spec_decode.acceptance.verify_drafts` instead of the sampler.
"""
from __future__ import annotations

import torch

from ..model_inputs import StepContext
from .scheduler import SchedulerOutput
from ..cache_engine import CacheEngine
from ..spec_decode.acceptance import verify_drafts
from ..sampling.sampler import TokenLogprob, sample

__all__ = ['ModelRunner', 'tokens_from_logits']


class ModelRunner:
    """Executes forwards of ``model`` against ``cache_engine``.

    Args:
        model: an engine model (``forward(ctx)``, ``compute_logits(hidden)``).
        cache_engine: KV blocks and state slots.
    """

    def __init__(self, model: torch.nn.Module, cache_engine: CacheEngine):
        self.model = model
        self.cache_engine = cache_engine
        self.device = cache_engine.device
        self.last_logits: torch.Tensor | None = None   # [num sampled, vocab], for tests
        # {seq_id: TokenLogprob} of the last forward, for sequences that asked for logprobs
        self.last_logprobs: dict[int, TokenLogprob] = {}
        self.last_hidden: torch.Tensor | None = None   # [T, hidden] of the last forward (MTP drafts)
        self.last_context: StepContext | None = None

    def build_context(self, out: SchedulerOutput) -> StepContext:
        """The flat batch of this step's chunks."""
        ids, pos, q_lens, starts, kv_lens, tables, slots = [], [], [], [], [], [], []
        offset = 0
        for chunk in out.chunks:
            seq = chunk.seq
            n = chunk.end - chunk.start + len(chunk.drafts)
            ids.extend(seq.token_ids[chunk.start:chunk.end])
            ids.extend(chunk.drafts)
            pos.extend(range(chunk.start, chunk.start + n))
            q_lens.append(n)
            starts.append(offset)
            offset += n
            kv_lens.append(chunk.start + n)
            tables.append(torch.tensor(seq.block_ids, dtype=torch.long, device=self.device))
            slots.append(-1 if seq.state_slot is None else seq.state_slot)
        ce = self.cache_engine
        return StepContext(input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                           positions=torch.tensor(pos, dtype=torch.long, device=self.device),
                           q_seqlens=q_lens, q_start_loc=starts, kv_seqlens=kv_lens, block_tables=tables,
                           state_slots=slots, kv_caches=ce.kv_caches, state_caches=ce.state_caches,
                           block_size=ce.block_size, sequences=[c.seq for c in out.chunks])

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, return_all_logits: bool = False) -> dict[int, list[int]]:
        """Run the step's forward.

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
        ctx = self.build_context(out)
        hidden = self.model(ctx)
        self.last_hidden, self.last_context = hidden, ctx
        if return_all_logits:
            self.all_logits = self.model.compute_logits(hidden).cpu()
        rows, plain, verify = [], [], []
        for i, c in enumerate(out.chunks):
            if not c.sample:
                continue
            last = ctx.q_start_loc[i] + ctx.q_seqlens[i] - 1
            (verify if c.drafts else plain).append((c, len(rows)))
            rows.extend(range(last - len(c.drafts), last + 1))
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        return tokens_from_logits(self, logits, plain, verify)


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
        plain_logits = logits[torch.tensor([r for _, r in plain], device=logits.device)]
        runner.last_logits = plain_logits
        seqs = [c.seq for c, _ in plain]
        tokens, logprobs = sample(plain_logits, seqs)
        runner.last_logprobs = {seq.seq_id: lp for seq, lp in zip(seqs, logprobs) if lp is not None}
        new_tokens = {seq.seq_id: [tok] for seq, tok in zip(seqs, tokens)}
    for c, r in verify:
        new_tokens[c.seq.seq_id] = verify_drafts(logits[r:r + len(c.drafts) + 1], list(c.drafts), c.seq)
    return new_tokens
