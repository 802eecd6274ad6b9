"""Prompt log-probabilities in the API's shapes.

The engine returns one :class:`~lmdeploy.pytorch.sampling.sampler.TokenLogprob` per prompt token
after the first (``GenerationConfig.prompt_logprobs``: the model's own ``log_softmax``, no
penalty or temperature); the first token has no context and so no value. Two shapes:

- completions ``echo`` + ``logprobs``: the prompt's tokens lead the choice's ``logprobs``
  (``token_logprobs[0]`` and ``top_logprobs[0]`` null), as OpenAI's legacy completions API;
- ``prompt_logprobs`` (vLLM's extension): a list with ``null`` for the first token, then per
  token ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the prompt token and its
  most likely alternatives (rank 1 = most likely).
"""
from __future__ import annotations

from .chat_output import TextOffsets, TokenTexts

__all__ = ['echo_logprobs', 'merge_completion_logprobs', 'vllm_prompt_logprobs']


def echo_logprobs(texts: TokenTexts, prompt_ids: list[int], logprobs: list | None, top: int,
                  offsets: TextOffsets) -> dict:
    """The completions ``logprobs`` of the echoed prompt (``offsets`` advanced past it, so the
    generated tokens' offsets continue after the prompt's text)."""
    lps = [None] + list(logprobs or [])
    lps += [None] * (len(prompt_ids) - len(lps))
    return {'tokens': [texts(t) for t in prompt_ids],
            'token_logprobs': [lp.logprob if lp is not None else None for lp in lps],
            'top_logprobs': [{texts(t): v for t, v in lp.top[:top]} if lp is not None else None for lp in lps],
            'text_offset': [offsets.next(t) for t in prompt_ids]}


def merge_completion_logprobs(first: dict | None, second: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other (``first`` may be None)."""
    if first is None:
        return second
    return {k: first[k] + second[k] for k in second}


def vllm_prompt_logprobs(texts: TokenTexts, logprobs: list | None, top: int) -> list | None:
    """``prompt_logprobs`` of one prompt (None when the engine returned none)."""
    if logprobs is None:
        return None
    out: list = [None]
    for lp in logprobs:
        entry = {str(lp.token_id): {'logprob': lp.logprob, 'rank': lp.rank, 'decoded_token': texts(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top[:top], start=1):
            entry.setdefault(str(t), {'logprob': v, 'rank': rank, 'decoded_token': texts(t)})
        out.append(entry)
    return out
