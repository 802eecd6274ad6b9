"""Decoding strategies, as far as the prefix cache is concerned.

A strategy tells the planner two integers: ``token_lookahead`` (ℓ, input tokens past
a chunk's end its forward also reads, e.g. MTP's shifted inputs) and ``recompute_blocks`` (r,
full cached blocks past a restored boundary that a restore must also match). Every sequence
carries its strategy's values, so ``plan_prefill`` is called with real numbers, not constants.

=================  ==  ==  ==========================================================
strategy           ℓ   r   why
=================  ==  ==  ==========================================================
autoregressive     0   0   a forward reads only its own tokens
n-gram drafts      0   0   drafts are verified by the target alone; nothing shifted
mtp                1   0   the MTP layer's rows at position t are computed from token t + 1
                           (every family's MTP head: Qwen3-Next / Qwen3.5-MoE ``mtp.*``,
                           GLM-5.3-Flash's NextN DSA block; alias ``qwen3_next_mtp``)
=================  ==  ==  ==========================================================
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ['DecodingStrategy', 'AUTOREGRESSIVE', 'MTP', 'QWEN3_NEXT_MTP', 'strategy_for']


@dataclass(frozen=True)
class DecodingStrategy:
    """Restore requirements of a decoding strategy.

    Attributes:
        name: strategy name (for logs).
        token_lookahead: ℓ in tokens; 0 without speculative decoding.
        recompute_blocks: r in blocks; 0 unless the strategy recomputes blocks after a hit.

    Raises:
        ValueError: a negative value (names the field).
    """
    name: str = 'autoregressive'
    token_lookahead: int = 0
    recompute_blocks: int = 0

    def __post_init__(self):
        for field in ('token_lookahead', 'recompute_blocks'):
            if getattr(self, field) < 0:
                raise ValueError(f'{field} must be >= 0, got {getattr(self, field)}')


AUTOREGRESSIVE = DecodingStrategy()


MTP = DecodingStrategy('mtp', token_lookahead=1, recompute_blocks=0)
QWEN3_NEXT_MTP = MTP      # the older name of the same strategy


def strategy_for(speculative_config) -> DecodingStrategy:
    """The strategy of a :class:`~lmdeploy.messages.SpeculativeConfig` (None: autoregressive)."""
    if speculative_config is not None and speculative_config.method == 'mtp':   # aliases normalised on validation
        return MTP
    return AUTOREGRESSIVE
