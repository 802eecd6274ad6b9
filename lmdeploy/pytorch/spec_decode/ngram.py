"""N-gram drafts (prompt lookup): guess the continuation of a sequence from its own tokens.

Agent and code-editing traffic repeats its context (a file is quoted, then rewritten with a
few changes), so the tokens that followed the last earlier occurrence of the current suffix
are a good guess of what comes next (Saxena, "Prompt Lookup Decoding", 2023; Yang et al.,
"Inference with Reference: Lossless Acceleration of Large Language Models", 2023)::

    tokens   ... a b c d e ... x y a b c | ?      suffix n-gram "a b c" (n = 3)
                     ^^^^^ draft = "d e ..."      continuation of its most recent earlier match

The longest suffix n-gram (``max_n`` down to ``min_n``) with an earlier match wins; no
weights and no model call. Drafts are only proposals: the target model verifies them.
"""
from __future__ import annotations

import torch

__all__ = ['propose_ngram']


def propose_ngram(token_ids: list[int] | torch.Tensor, num_draft: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to ``num_draft`` tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram of ``token_ids``.

    Args:
        token_ids: the sequence so far (prompt + generated), int ids.
        num_draft: most draft tokens to return (>= 0).
        min_n, max_n: suffix lengths tried, longest first (``1 <= min_n <= max_n``).

    Returns:
        The draft (possibly shorter than ``num_draft``, empty when no suffix n-gram of length
        ``min_n..max_n`` occurs earlier in the sequence).

    Raises:
        ValueError: ``min_n < 1``, ``min_n > max_n`` or ``num_draft < 0``.
    """
    if min_n < 1 or min_n > max_n or num_draft < 0:
        raise ValueError(f'need 1 <= min_n <= max_n and num_draft >= 0; got min_n={min_n}, max_n={max_n}, '
                         f'num_draft={num_draft}')
    tokens = torch.as_tensor(token_ids, dtype=torch.int64)
    L = tokens.numel()
    if num_draft == 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows[i] = tokens[i:i+n]; the last window is the suffix itself, so look before it
        windows = tokens.unfold(0, n, 1)[:-1]
        hits = (windows == tokens[L - n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start:start + num_draft].tolist()
    return []
