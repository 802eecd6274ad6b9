"""Token sampling: greedy, or temperature / top-k / top-p with a per-request seed.

Order of logit processing: repetition penalty (Keskar et al., "CTRL", 2019: divide positive
logits, multiply negative ones, for tokens already in the sequence) → presence and frequency
penalties (OpenAI's definition: subtract ``presence_penalty`` from the logit of every token the
reply has generated so far and ``frequency_penalty`` times the number of times it did; the
prompt does not count) → ``logit_bias`` (added to the listed tokens' logits) → the grammar mask of
a guided request (:mod:`.guided`: -inf for every token that would leave it; after the bias, so no
bias can unban a token) → ``min_tokens`` (EOS and stop ids -inf until reached) → temperature → top-k →
top-p (Holtzman et al., "The Curious Case of Neural Text Degeneration", 2020) → sample with
the request's own ``torch.Generator`` so the same seed gives the same output regardless of
batching.

Extreme but valid settings (a temperature or repetition penalty near 0) would overflow float32
logits to ±inf or NaN: temperature scaling is applied to max-shifted logits, and
:func:`_finite` maps what still overflows to a finite limit, so that one request's settings can
never make the step fail for every sequence in the batch.

A greedy row with none of those settings (no penalty, bias, grammar, logprobs or pending
``min_tokens``) is the argmax of its raw logits; :func:`greedy_tokens` takes every such row of the
batch in one ``max`` reduction, so the usual decode batch costs one torch op however many rows
it has (the rest loop over their own rows only).

Log-probabilities (when a request sets ``GenerationConfig.logprobs``) are those of the
distribution the token was drawn from: ``log_softmax`` of the penalised logits for greedy
decoding, the log of the final temperature / top-k / top-p probabilities when sampling.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..paging.sequence import Sequence

__all__ = ['sample_tokens', 'sample', 'greedy_tokens', 'TokenLogprob', 'target_distribution', 'request_generator',
           'prompt_token_logprobs']


@dataclass
class TokenLogprob:
    """The log-probability of one sampled token and of the most likely alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability (finite, <= 0).
        top: up to ``GenerationConfig.logprobs`` ``(token_id, logprob)`` pairs, most likely
            first; tokens with probability 0 (filtered by top-k / top-p) are left out.
    """
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None     # prompt tokens: 1 + how many tokens were more likely


def prompt_token_logprobs(logits: torch.Tensor, next_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Log-probabilities of prompt tokens under the model's raw distribution (no penalty, bias
    or temperature: what the model itself assigns, as ``log_softmax`` of its logits).

    Args:
        logits: ``[n, vocab]`` logits at n prompt positions.
        next_ids: the n prompt tokens that follow those positions.
        num_top: alternatives kept per token (most likely first).

    Returns:
        One :class:`TokenLogprob` per position, with its ``rank``.
    """
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    ids = torch.tensor(next_ids, dtype=torch.long)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    out = []
    for row, token, value, rank in zip(logp, next_ids, chosen.tolist(), ranks.tolist()):
        top = []
        if num_top > 0:
            vals, idx = torch.topk(row, min(num_top, row.numel()))
            top = [(int(i), float(v)) for v, i in zip(vals, idx)]
        out.append(TokenLogprob(int(token), value, top, int(rank)))
    return out


def _process(logits: torch.Tensor, seq: Sequence, extra_ids=()) -> torch.Tensor:
    """Apply ``seq``'s penalties to its ``[vocab]`` float32 ``logits`` in place; ``extra_ids``
    count as tokens after ``seq.token_ids`` (drafts being verified)."""
    cfg = seq.gen_config
    if cfg.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids).union(extra_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / cfg.repetition_penalty, vals * cfg.repetition_penalty)
    if cfg.presence_penalty or cfg.frequency_penalty:
        generated = seq.token_ids[seq.num_prompt_tokens:] + list(extra_ids)
        if generated:
            ids, counts = torch.tensor(generated, dtype=torch.long).unique(return_counts=True)
            logits[ids] -= cfg.presence_penalty + cfg.frequency_penalty * counts.to(logits.dtype)
    if cfg.logit_bias:
        ids = torch.tensor(list(cfg.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(cfg.logit_bias.values()), dtype=logits.dtype)
    if seq.guide is not None:
        if extra_ids:
            raise ValueError('a guided sequence is never verified with drafts (no grammar state at a draft)')
        seq.guide.mask_(logits)
    if cfg.min_tokens and seq.num_generated + len(extra_ids) < cfg.min_tokens:
        _ban_stops(logits, seq)
    return logits


def _ban_stops(logits: torch.Tensor, seq: Sequence) -> None:
    """``min_tokens`` not reached: EOS (unless ignored) and ``stop_token_ids`` to -inf in the
    ``[vocab]`` ``logits`` — unless nothing else is left (a grammar that can only end here wins)."""
    cfg = seq.gen_config
    stops = set(cfg.stop_token_ids) | (set() if cfg.ignore_eos else set(seq.eos_token_ids))
    stops = [t for t in stops if t < logits.numel()]
    if not stops:
        return
    ids = torch.tensor(stops, dtype=torch.long)
    kept = logits[ids].clone()
    logits[ids] = float('-inf')
    if not bool((logits > float('-inf')).any()):
        logits[ids] = kept


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


def _logprob(logp: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """``logp``: ``[vocab]`` float32 log-probabilities (may hold -inf)."""
    top = []
    if num_top > 0:
        vals, idx = torch.topk(logp, min(num_top, logp.numel()))
        top = [(int(i), float(v)) for v, i in zip(vals, idx) if torch.isfinite(v)]
    return TokenLogprob(token, float(logp[token]), top)


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick the next token of each sequence (see :func:`sample`); returns one id per sequence."""
    return sample(logits, seqs)[0]


def _greedy_argmax(seq: Sequence) -> bool:
    """The next token is the argmax of the (grammar-masked) raw logits: greedy, no penalty,
    bias, logprobs or pending min_tokens."""
    cfg = seq.gen_config
    return (cfg.greedy and cfg.repetition_penalty == 1.0 and not cfg.presence_penalty and not cfg.frequency_penalty
            and not cfg.logit_bias and cfg.logprobs is None
            and (not cfg.min_tokens or seq.num_generated >= cfg.min_tokens))


def _plain_greedy(seq: Sequence) -> bool:
    return seq.guide is None and _greedy_argmax(seq)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick the next token of each sequence.

    Args:
        logits: ``[N, vocab]`` float32, one row per sequence in ``seqs``.
        seqs: the sequences being sampled.

    Returns:
        One token id per sequence, and per sequence a :class:`TokenLogprob` when its
        ``gen_config.logprobs`` is set (None otherwise).
    """
    plain = [_plain_greedy(s) for s in seqs]
    out = greedy_tokens(logits) if any(plain) else [0] * len(seqs)
    logprobs = [None] * len(seqs)
    if all(plain):      # the usual decode batch: one reduction, no per-row work
        return out, logprobs
    logits = logits.float().cpu()
    for i, seq in enumerate(seqs):
        if plain[i]:
            continue
        cfg, row = seq.gen_config, logits[i]
        if _greedy_argmax(seq):      # guided greedy: the argmax of the masked row (as _finite would pick)
            masked = seq.guide.mask_(torch.nan_to_num(row, nan=float('-inf')))
            if bool(torch.isfinite(masked).any()) or bool(torch.isposinf(masked).any()):
                out[i] = int(masked.argmax())
                continue
        token, probs, logp = target_distribution(row, seq)
        if token is None:
            token = int(torch.multinomial(probs, 1, generator=request_generator(seq)))
        out[i] = token
        logprobs[i] = None if cfg.logprobs is None else _logprob(logp, token, cfg.logprobs)
    return out, logprobs


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``[N, vocab]`` logits (any float dtype, any device), as the
    sampler's full path picks it for a greedy row without penalties: NaN entries count as -inf,
    the first maximum wins (the first +inf when a row overflowed), and a row of nothing but NaN
    and -inf gives token 0.

    One reduction (``max`` returns each row's value and index together) and two host
    transfers; a row whose maximum is NaN, so that holds a NaN, is then recomputed with its NaN
    entries mapped to -inf. Rows without NaN are never copied or rewritten: the per-step cost
    of an all-greedy decode batch does not grow with the vocabulary beyond the reduction.
    """
    values, index = logits.max(-1)
    tokens = index.tolist()
    for i, value in enumerate(values.tolist()):
        if value != value:       # NaN: torch's max propagates it; rare (a broken forward)
            inf = float('inf')      # (nan_to_num's defaults would make ±inf finite)
            tokens[i] = int(torch.nan_to_num(logits[i].float(), nan=-inf, posinf=inf, neginf=-inf).argmax())
    return tokens


def request_generator(seq: Sequence) -> torch.Generator:
    """The sequence's own CPU generator (made from a random seed on first use when the
    request gave none)."""
    if seq.generator is None:
        seq.generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    return seq.generator


def target_distribution(row: torch.Tensor, seq: Sequence, extra_ids=()):
    """The distribution the sampler draws ``seq``'s next token from, given logits ``row``.

    Args:
        row: ``[vocab]`` float32 logits (not modified).
        seq: the sequence (its ``gen_config`` and, for the penalties, its tokens).
        extra_ids: tokens counted as already in the sequence besides ``seq.token_ids`` (the
            draft tokens before this position, when verifying speculative drafts).

    Returns:
        ``(token, None, logp)`` for greedy decoding (``token`` the argmax, ``logp`` the
        ``[vocab]`` log-softmax of the penalised logits), or ``(None, probs, log(probs))`` for
        sampling, ``probs`` ``[vocab]`` float32 after temperature, top-k and top-p.
    """
    cfg = seq.gen_config
    raw = row
    row = _finite(_process(row.clone(), seq, extra_ids), raw)
    if cfg.greedy:
        return int(row.argmax()), None, torch.log_softmax(row, dim=-1)
    # shifted by the max first: the same distribution as row / T, but a temperature near 0
    # sends the others to -inf instead of the max to +inf (inf - inf is NaN in the softmax)
    # (a temperature below float32's smallest normal would round to 0 and make 0/0: the
    # smallest normal gives the same one-hot distribution)
    row = _finite((row - row.max()) / max(cfg.temperature, torch.finfo(row.dtype).tiny), raw)
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
    return None, probs, torch.log(probs)
