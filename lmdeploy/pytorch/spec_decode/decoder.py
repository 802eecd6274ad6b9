"""The engine side of speculative decoding: drafts in, accepted tokens out, state rolled back.

:class:`SpecDecoder` owns everything speculative between the scheduler and the model runner;
the engine calls it at three points of its step::

    schedule()          decode chunks carry seq.draft_ids (the scheduler takes KV slots for them)
    before_forward()    hybrid: copy each verifying sequence's runtime state → its scratch slot
    forward()           target logits of last token + drafts; acceptance (model runner)
    after_forward()     truncate at stop conditions, append the tokens, set how far the chunk
                        really computed (rolling the state back where needed), run the MTP head
    computed(), saves   the prefix cache sees only accepted tokens
    propose()           n-gram drafts for the next step (MTP drafts were made in after_forward)

Rollback (hybrid models). The verify forward leaves each linear-attention layer's conv and
recurrent state after the *last draft*. If every draft was kept that is exactly the state the
sequence needs. Otherwise the state is restored from the snapshot taken before the forward
(the state after ``chunk.start`` tokens) and the sequence's computed tokens go back to
``chunk.start``: the next forward recomputes the accepted tokens together with the new drafts
(a few extra tokens in a decode forward; no kernel keeps per-position states). Full-attention
layers need no rollback: KV of rejected drafts sits past the computed tokens, is never
published to the prefix cache and is overwritten by the next forward. No checkpoint is taken at
a draft position: save points and turn-end copies only see ``chunk.end`` after this step has
moved it to a position whose state is exact.

Scratch slots: runtime slot ``s`` has scratch slot ``scratch_base + s`` in the same state
buffer (one more slot per runtime slot, allocated only with speculative decoding on).
"""
from __future__ import annotations

import torch

from ...messages import SpeculativeConfig
from ..model_inputs import StepBatch
from .mtp import MTPBatch
from .ngram import propose_ngram

__all__ = ['SpecDecoder']


class SpecDecoder:
    """Engine-side speculative decoding.

    Args:
        config: the speculative configuration.
        runner: the :class:`~lmdeploy.pytorch.engine.model_runner.ModelRunner` (its model,
            cache engine, and the hidden states of its last forward).
        scratch_base: first scratch state slot (None for models without recurrent state).
        finish_reason: ``(seq, token) -> str | None`` the engine's stop rule, applied after
            ``token`` was appended to ``seq``.
        mtp: rank 0's MTP head (method ``mtp``; every rank's worker holds its part
            and runs the steps, through ``runner.mtp_step``), else None.
        session_len: longest sequence in tokens.
        block_align: block size B when turn-end checkpoints are kept (``decode_save_last``):
            drafts then never carry a forward past the next block boundary, so decoding still
            ends a forward on every boundary; None otherwise.
    """

    def __init__(self, config: SpeculativeConfig, runner, scratch_base: int | None, finish_reason,
                 mtp=None, session_len: int = 1 << 30, block_align: int | None = None):
        self.config = config
        self.runner = runner
        self.model = runner.model
        self.cache_engine = runner.cache_engine
        self.scratch_base = scratch_base
        self.finish_reason = finish_reason
        self.mtp = mtp
        self.session_len = session_len
        self.block_align = block_align
        self.finished: dict[int, str] = {}     # seq_id -> finish reason found in after_forward
        self._valid_end: dict[int, int] = {}   # seq_id -> end of the exact positions of its verify chunk
        self.counters = {'spec_decode_draft_tokens': 0, 'spec_decode_accepted_tokens': 0,
                         'spec_decode_verify_steps': 0, 'spec_decode_rollbacks': 0}

    # before the forward --------------------------------------------------------------------
    def before_forward(self, sched) -> None:
        """Snapshot the runtime state of every sequence that verifies drafts in this forward."""
        self.finished, self._valid_end = {}, {}
        if self.scratch_base is None:
            return
        slots = [c.seq.state_slot for c in sched.chunks if c.drafts]
        if slots:
            self.cache_engine.copy_states(slots, [self.scratch_base + s for s in slots])

    # after the forward ---------------------------------------------------------------------
    def after_forward(self, sched, new_tokens: dict[int, list[int]]) -> None:
        """Book the verify chunks of ``sched`` (see the module docstring) and run the MTP head.

        For each chunk with drafts, its tokens in ``new_tokens`` are cut at the first stop
        condition and appended to the sequence here (the prefix cache must hash them when the
        scheduler books the forward); the engine then only reports them.
        """
        restore = []
        for chunk in sched.chunks:
            if not chunk.drafts or chunk.seq.seq_id not in new_tokens:
                continue
            seq, K = chunk.seq, len(chunk.drafts)
            tokens = new_tokens[chunk.seq.seq_id]
            self.counters['spec_decode_verify_steps'] += 1
            self.counters['spec_decode_draft_tokens'] += K
            self.counters['spec_decode_accepted_tokens'] += len(tokens) - 1
            kept = []
            for token in tokens:
                seq.token_ids.append(token)
                kept.append(token)
                reason = self.finish_reason(seq, token)
                if reason:
                    self.finished[seq.seq_id] = reason
                    break
            new_tokens[seq.seq_id] = kept
            # the forward computed chunk.end + K positions; exact KV for the first end + len(kept) - 1
            valid_end = self._valid_end[seq.seq_id] = chunk.end + len(kept) - 1
            if self.scratch_base is None or len(kept) == K + 1:
                chunk.end = valid_end
            else:
                restore.append(seq.state_slot)
                chunk.end = chunk.start
        if restore:
            self.counters['spec_decode_rollbacks'] += len(restore)
            self.cache_engine.copy_states([self.scratch_base + s for s in restore], restore)
        if self.mtp is not None:
            self._run_mtp(sched, new_tokens)

    # drafts for the next step ------------------------------------------------------------
    def _draft_room(self, seq, pending: int = 0) -> int:
        """How many drafts ``seq`` may verify next step (0: none), ``pending`` tokens not yet
        appended. Requests that asked for log-probabilities, and guided requests (a grammar
        state exists only at the sequence's last token), decode plainly."""
        cfg = seq.gen_config
        if seq.is_finished or cfg.logprobs is not None or seq.guide is not None:
            return 0
        room = min(cfg.max_new_tokens - seq.num_generated, self.session_len - seq.num_tokens) - 1 - pending
        if self.block_align:
            # the verify chunk ends at num_tokens; all K kept -> computed = num_tokens + K <= boundary
            room = min(room, -(seq.num_tokens + pending) % self.block_align)
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, sched, new_tokens: dict[int, list[int]]) -> None:
        """Set ``draft_ids`` of the sequences that emitted tokens in this step, for their next
        decode step (n-gram; called once the tokens are appended). MTP drafts were set by
        :meth:`after_forward`."""
        if self.mtp is not None:
            return
        cfg = self.config
        for chunk in sched.chunks:
            seq = chunk.seq
            seq.draft_ids = []
            k = self._draft_room(seq) if seq.seq_id in new_tokens else 0
            if k:
                seq.draft_ids = propose_ngram(seq.token_ids, k, cfg.ngram_min, cfg.ngram_max)

    # MTP ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run_mtp(self, sched, new_tokens: dict[int, list[int]]) -> None:
        """Run the MTP head over every position whose target hidden state this forward computed
        exactly (writing the MTP layer's KV there) and draft from the last one.

        Position ``p`` reads token ``p + 1``: a prompt token (lookahead, for chunks that stop
        inside the prompt) or a token emitted now. A sequence that emitted tokens gets
        ``draft_ids`` from the MTP logits at its last such position (chained for K > 1 while
        its blocks have room for the extra MTP KV). Only integers go into the steps
        (:class:`~.mtp.MTPBatch`); this method alone decides the drafts."""
        fwd_starts = self._forward_starts()
        rows, ids, pos, q_lens, starts, kv_lens, tables, seqs = [], [], [], [], [], [], [], []
        for i, chunk in enumerate(sched.chunks):
            seq = chunk.seq
            seq.draft_ids = []
            end = self._valid_end.get(seq.seq_id, chunk.end)
            pending = [] if chunk.drafts else new_tokens.get(seq.seq_id, [])
            tokens = seq.token_ids + pending
            end = min(end, len(tokens) - 1)          # position p needs token p + 1
            if end <= chunk.start:
                continue
            first = fwd_starts[i]
            rows.extend(range(first, first + end - chunk.start))
            ids.extend(tokens[chunk.start + 1:end + 1])
            pos.extend(range(chunk.start, end))
            starts.append(sum(q_lens))
            q_lens.append(end - chunk.start)
            kv_lens.append(end)
            tables.append(list(seq.block_ids))
            seqs.append((seq, chunk.seq.seq_id in new_tokens, tokens, len(pending)))
        if not rows:
            return
        block_size = self.cache_engine.block_size
        last_rows = [s + n - 1 for s, n in zip(starts, q_lens)]
        drafting = [(j, seq, tokens, self._draft_room(seq, pending)) for j, (seq, emitted, tokens, pending)
                    in enumerate(seqs) if emitted and seq.seq_id not in self.finished]
        drafting = [d for d in drafting if d[3] > 0]
        flat = StepBatch(ids, pos, q_lens, starts, kv_lens, tables, [-1] * len(q_lens))
        first_drafts = self._mtp_run(MTPBatch(False, rows, flat, [last_rows[d[0]] for d in drafting]))
        if not drafting:
            return
        chains = [[int(t)] for t in first_drafts]
        for step in range(1, self.config.num_speculative_tokens):
            live = [k for k, (_, seq, tokens, room) in enumerate(drafting)
                    if len(chains[k]) == step and step < room
                    and len(tokens) - 1 + step < len(seq.block_ids) * block_size]
            if not live:
                break
            p = [len(drafting[k][2]) - 2 + step for k in live]
            n = len(live)
            flat = StepBatch([chains[k][-1] for k in live], p, [1] * n, list(range(n)), [x + 1 for x in p],
                             [list(drafting[k][1].block_ids) for k in live], [-1] * n)
            toks = self._mtp_run(MTPBatch(True, live, flat, list(range(n))))
            for idx, k in enumerate(live):
                chains[k].append(int(toks[idx]))
        for k, (_, seq, _, room) in enumerate(drafting):
            seq.draft_ids = chains[k][:room]

    def _mtp_run(self, batch: MTPBatch) -> list[int]:
        """Run one MTP step on every rank (each over its own last forward's hidden states);
        returns the draft ids of ``batch.draft_rows``."""
        return self.runner.mtp_step(batch)

    def _forward_starts(self) -> list[int]:
        """First flat row of each chunk in the last forward."""
        return self.runner.last_batch.q_start_loc

    def stats(self) -> dict[str, int]:
        """Cumulative counters: draft tokens proposed and accepted, verify steps, rollbacks."""
        return dict(self.counters)
