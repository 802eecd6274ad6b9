"""The tensor-parallel split of multi-head latent attention (MLA; DeepSeek-V2, 2024) as
Kimi-Linear's MLA layers and GLM-5.3-Flash's DSA layers run it: by query head.

Each query head up-projects its own K and V from the shared latent, so a rank holds its query
heads' rows of the up-projections and leaves the latent producers whole::

    q_proj / q_b_proj     rows of its heads, (qk_nope + qk_rope) each    column-parallel
    kv_b_proj             rows of its heads, (qk_nope + v_head_dim) each  column-parallel
    o_proj                columns of its heads, v_head_dim each            row-parallel
    q_a_proj, kv_a_proj_with_mqa, their norms, an indexer               whole

so the cached latent (``tp_split=None``) is the same on every rank and the Store holds it once.
"""
from __future__ import annotations

from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows

__all__ = ['mla_split']


def mla_split(config, size: int) -> BlockSplit:
    """The split of an MLA layer (a split factory; see the module docstring): axis ``q_heads``
    (``num_attention_heads``); the local config sets both ``num_attention_heads`` and
    ``num_key_value_heads`` (one K/V per query head) to the rank's query heads."""
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    return BlockSplit((Axis('q_heads', config.num_attention_heads, 'num_attention_heads', 'num_attention_heads'),),
                      (rows(('q_proj.weight', 'q_b_proj.weight'), Piece('q_heads', nope + rope)),
                       rows('kv_b_proj.weight', Piece('q_heads', nope + v)),
                       cols('o_proj.weight', Piece('q_heads', v))),
                      row_parallel=('o_proj',), config=(('num_key_value_heads', config.num_attention_heads // size),))
