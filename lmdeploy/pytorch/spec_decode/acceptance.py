"""Which draft tokens the target model accepts, so outputs are those of plain decoding.

The verify forward gives the target's logits at the last token and after each of the ``K``
drafts: row ``i`` is the target's distribution ``p_i`` for the token after draft ``i``
(row 0: after the last real token). Acceptance walks the rows in order::

    greedy    accept d_i while d_i == argmax p_i; the first mismatch is replaced by argmax p_i
    sampling  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection
              draw from norm(max(0, p_i - q_i)) and stop
    both      all K accepted: one more token from p_K (the "bonus" token)

The sampling rule is speculative sampling (Leviathan, Kalman & Matias, "Fast Inference from
Transformers via Speculative Decoding", ICML 2023, Algorithm 1; Chen et al., "Accelerating
Large Language Model Decoding with Speculative Sampling", 2023): every emitted token has
exactly the target distribution. Our drafters propose deterministically (n-gram lookup, or the
argmax of the MTP head), so ``q_i`` is a point mass on ``d_i``: accept with probability
``p_i(d_i)``, and a rejected row draws from ``p_i`` with ``d_i`` removed, renormalised.

``p_i`` is the sampler's own distribution (:func:`~lmdeploy.pytorch.sampling.sampler.target_distribution`:
repetition penalty, temperature, top-k, top-p), with the drafts before position ``i`` counted
as already generated.
"""
from __future__ import annotations

import torch

from ..sampling.sampler import request_generator, target_distribution

__all__ = ['verify_drafts', 'speculative_sample']


def speculative_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling with point-mass drafts (see the module docstring).

    Args:
        probs: ``[K + 1, vocab]`` float target probabilities; row ``i`` for the token after
            draft ``i`` (row 0: after the last real token). Rows sum to 1.
        drafts: the ``K`` draft tokens.
        generator: CPU generator for the uniform draws and the residual samples.

    Returns:
        The emitted tokens: the accepted drafts, then one token drawn from the residual (first
        rejection) or from ``probs[K]`` (all accepted); length ``1..K + 1``.

    Raises:
        ValueError: ``probs`` does not have ``len(drafts) + 1`` rows.
    """
    K = len(drafts)
    if probs.dim() != 2 or probs.shape[0] != K + 1:
        raise ValueError(f'probs must be [K + 1, vocab] = [{K + 1}, vocab]; got {tuple(probs.shape)}')
    probs = probs.float().cpu()
    out = []
    for i, d in enumerate(drafts):
        p_d = float(probs[i, d])
        if float(torch.rand((), generator=generator)) < p_d:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[K], 1, generator=generator)))
    return out


def verify_drafts(logits: torch.Tensor, drafts: list[int], seq) -> list[int]:
    """The tokens a sequence emits after a verify forward.

    Args:
        logits: ``[K + 1, vocab]`` float32 target logits (row 0 at the last real token).
        drafts: the ``K`` draft tokens scored by that forward.
        seq: the :class:`~lmdeploy.pytorch.paging.sequence.Sequence` (sampling options, tokens).

    Returns:
        Accepted drafts plus one target token (``1..K + 1`` tokens). Greedy: exactly the tokens
        plain greedy decoding would produce; sampling: the same distribution.
    """
    logits = logits.float().cpu()
    out: list[int] = []
    if seq.gen_config.greedy:
        for i in range(len(drafts) + 1):
            token, _, _ = target_distribution(logits[i], seq, drafts[:i])
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                return out
    probs = torch.stack([target_distribution(logits[i], seq, drafts[:i])[1] for i in range(len(drafts) + 1)])
    return speculative_sample(probs, drafts, request_generator(seq))
