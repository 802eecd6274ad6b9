"""Token sampling: greedy, or temperature / top-k / top-p with a per-request seed.

Order of logit processing: repetition penalty (Keskar et al., "CTRL", 2019: divide positive
logits, multiply negative ones, for tokens already in the sequence) → temperature → top-k →
top-p (Holtzman et al., "The Curious Case of Neural Text Degeneration", 2020) → sample with
the request's own ``torch.Generator`` so the same seed gives the same output regardless of
batching.

Extreme but valid settings (a temperature or repetition penalty near 0) would overflow float32
logits to ±inf or NaN: temperature scaling is applied to max-shifted logits, and
:func:`_finite` maps what still overflows to a finite limit, so that one request's settings can
never make the step fail for every sequence in the batch.
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


def _finite(row: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``row`` with NaN as -inf and, if any entry overflowed to +inf, the limit of that scaling:
    +inf entries → 0, the rest → -inf (uniform over the overflowed maxima). All -inf (e.g. every
    entry NaN) → the raw ``fallback`` logits. ``[vocab]`` float32 in and out."""
    row = torch.nan_to_num(row, nan=float('-inf'), posinf=float('inf'), neginf=float('-inf'))
    top = torch.isposinf(row)
    if bool(top.any()):
        row = torch.zeros_like(row).masked_fill_(~top, float('-inf'))
    if bool(torch.isneginf(row).all()):
        return torch.nan_to_num(fallback, nan=0.0, posinf=0.0, neginf=0.0)
    return row


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick the next token of each sequence.

    Args:
        logits: ``[N, vocab]`` float32, one row per sequence in ``seqs``.
        seqs: the sequences being sampled.

    Returns:
        One token id per sequence.
    """
    logits = logits.float().cpu()
    # Plain greedy rows (no penalty) in one argmax: NaN -> -inf as in _finite; argmax already
    # picks the first +inf, and an all -inf row gives 0 like _finite's zeroed fallback.
    plain = [i for i, s in enumerate(seqs) if s.gen_config.greedy and s.gen_config.repetition_penalty == 1.0]
    fast = []
    if plain:
        inf = float('inf')
        fast = torch.nan_to_num(logits, nan=-inf, posinf=inf, neginf=-inf).argmax(-1).tolist()
    out = []
    for i, (row, seq) in enumerate(zip(logits, seqs)):
        cfg = seq.gen_config
        if cfg.greedy and cfg.repetition_penalty == 1.0:
            out.append(fast[i])
            continue
        raw = row
        row = _finite(_process(row.clone(), seq), raw)
        if cfg.greedy:
            out.append(int(row.argmax()))
            continue
        # shifted by the max first: the same distribution as row / T, but a temperature near 0
        # sends the others to -inf instead of the max to +inf (inf - inf is NaN in the softmax)
        row = _finite((row - row.max()) / cfg.temperature, raw)
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
