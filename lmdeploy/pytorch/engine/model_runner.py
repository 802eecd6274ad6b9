"""Model runner: turns scheduled chunks into one flat forward and samples new tokens.

It builds the :class:`~lmdeploy.pytorch.model_inputs.StepContext` from the chunks (token ids,
positions, block tables, state slots), runs the model, computes logits only for chunks that
reach their sequence's last token, and samples them.
"""
from __future__ import annotations

import torch

from ..model_inputs import StepContext
from ..paging.scheduler import SchedulerOutput
from .cache_engine import CacheEngine
from .sampler import TokenLogprob, sample

__all__ = ['ModelRunner']


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

    def build_context(self, out: SchedulerOutput) -> StepContext:
        """The flat batch of this step's chunks."""
        ids, pos, q_lens, starts, kv_lens, tables, slots = [], [], [], [], [], [], []
        offset = 0
        for chunk in out.chunks:
            seq = chunk.seq
            n = chunk.end - chunk.start
            ids.extend(seq.token_ids[chunk.start:chunk.end])
            pos.extend(range(chunk.start, chunk.end))
            q_lens.append(n)
            starts.append(offset)
            offset += n
            kv_lens.append(chunk.end)
            tables.append(torch.tensor(seq.block_ids, dtype=torch.long, device=self.device))
            slots.append(-1 if seq.state_slot is None else seq.state_slot)
        ce = self.cache_engine
        return StepContext(input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                           positions=torch.tensor(pos, dtype=torch.long, device=self.device),
                           q_seqlens=q_lens, q_start_loc=starts, kv_seqlens=kv_lens, block_tables=tables,
                           state_slots=slots, kv_caches=ce.kv_caches, state_caches=ce.state_caches,
                           block_size=ce.block_size)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, return_all_logits: bool = False) -> dict[int, int]:
        """Run the step's forward.

        Args:
            out: the scheduled chunks.
            return_all_logits: keep logits of every position in ``self.all_logits`` (tests).

        Returns:
            ``{seq_id: next token}`` for chunks that reached their sequence's last token; the
            tokens' log-probabilities (when requested) are left in ``self.last_logprobs``.
        """
        self.last_logprobs = {}
        ctx = self.build_context(out)
        hidden = self.model(ctx)
        if return_all_logits:
            self.all_logits = self.model.compute_logits(hidden).cpu()
        rows = [ctx.q_start_loc[i] + ctx.q_seqlens[i] - 1 for i, c in enumerate(out.chunks) if c.sample]
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        self.last_logits = logits
        seqs = [c.seq for c in out.chunks if c.sample]
        tokens, logprobs = sample(logits, seqs)
        self.last_logprobs = {seq.seq_id: lp for seq, lp in zip(seqs, logprobs) if lp is not None}
        return {seq.seq_id: tok for seq, tok in zip(seqs, tokens)}
