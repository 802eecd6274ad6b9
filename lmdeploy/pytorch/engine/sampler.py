"""Token sampling: greedy, or temperature / top-k / top-p with a per-request seed.

Order of logit processing: repetition penalty (Keskar et al., "CTRL", 2019: divide positive
logits, multiply negative ones, for tokens already in the sequence) → temperature → top-k →
top-p (Holtzman et al., "The Curious Case of Neural Text Degeneration", 2020) → sample with
the request's own ``torch.Generator`` so the same seed gives the same output regardless of
batching.
"""
from __future__ import annotations

import torch

from .sequence import Sequence

__all__ = ['sample_tokens']


def _process(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    cfg = seq.gen_config
    if cfg.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / cfg.repetition_penalty, vals * cfg.repetition_penalty)
    return logits


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick the next token of each sequence.

    Args:
        logits: ``[N, vocab]`` float32, one row per sequence in ``seqs``.
        seqs: the sequences being sampled.

    Returns:
        One token id per sequence.
    """
    out = []
    for row, seq in zip(logits.float().cpu(), seqs):
        cfg = seq.gen_config
        row = _process(row.clone(), seq)
        if cfg.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / cfg.temperature
        if cfg.top_k > 0 and cfg.top_k < row.numel():
            kth = torch.topk(row, cfg.top_k).values[-1]
            row = row.masked_fill(row < kth, float('-inf'))
        probs = torch.softmax(row, dim=-1)
        if cfg.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = cum - sorted_p > cfg.top_p       # keep the smallest prefix whose mass reaches top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
            probs = probs / probs.sum()
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
        out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return out
