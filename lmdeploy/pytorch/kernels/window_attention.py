"""Paged causal attention with an optional sliding window and per-head attention sinks.

The attention of Granite-SWA-style layers (``granitemoe_swa``). For a new query at position
``p`` and a window of ``W`` tokens, the keys it sees are positions ``max(0, p - W + 1) .. p``
(``W`` keys including itself; no window: ``0 .. p``)::

    kv positions   0 ...... p-W+1 ............ p
                   | never read | read (window) |

Only the blocks that hold a query tile's window are gathered, so blocks that lie wholly before
``p - W + 1`` for every query are never read: their ids in the block table may point anywhere
(a block that fell out of the window may already be freed and reused).

A per-head sink ``s_h`` is one extra logit in the softmax denominator with no value attached
(the "attention sink" of Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", 2023, as a learned scalar): with ``lse = logsumexp(scores)``::

    out = softmax(scores) @ V * sigmoid(lse - s_h)      (= sum e^s V / (sum e^s + e^{s_h}))

Scores and softmax run in float32 (the ``transformers`` eager reference does the same), queries
in tiles of :data:`QUERY_TILE` rows so the score block stays ``tile x (tile + W)``.
"""
from __future__ import annotations

import torch

from . import register_kernel
from .attention import fill_kv_cache
from ..model_inputs import StepContext

__all__ = ['paged_window_attention', 'window_key_range', 'QUERY_TILE']

QUERY_TILE = 512  # query rows per score block


def window_key_range(first_pos: int, end_pos: int, window: int | None) -> tuple[int, int]:
    """``[lo, hi)``: the key positions that queries at positions ``[first_pos, end_pos)`` may see
    (``window`` tokens each, ``None`` for all earlier ones)."""
    lo = 0 if window is None else max(0, first_pos - window + 1)
    return lo, end_pos


@register_kernel('paged_window_attention', device_type='any')
def paged_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, ctx: StepContext, scale: float, window: int | None,
                           sinks: torch.Tensor | None) -> torch.Tensor:
    """Store the new K/V in the paged cache, then attend each new query to its window.

    Args:
        q: ``[T, num_heads, head_dim]`` queries of the flat batch.
        k, v: ``[T, num_kv_heads, head_dim]`` new keys / values (already rotated).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        ctx: batch layout (see :class:`StepContext`); block ``j`` of a sequence's table holds
            positions ``[j * block_size, (j + 1) * block_size)``; a sliding layer reads the
            tables of :meth:`StepContext.paged_group`.
        scale: softmax scale.
        window: keys per query (itself included), or None for full causal attention.
        sinks: ``[num_heads]`` sink logits, or None for none.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        ValueError: ``window`` below 1.
    """
    if window is not None and window < 1:
        raise ValueError(f'sliding_window must be >= 1, got {window}')
    ctx = ctx.paged_group(window)       # a sliding layer's blocks may have tables of their own
    fill_kv_cache(k, v, k_cache, v_cache, ctx)
    T, H, D = q.shape
    Hkv, B = k_cache.shape[2], ctx.block_size
    G = H // Hkv
    sink = None if sinks is None else sinks.float().view(Hkv, G, 1)
    out = torch.empty_like(q)
    for i, hist in enumerate(ctx.history_lens):
        sl = ctx.seq_slice(i)
        table = ctx.block_tables[i].to(q.device)
        for start in range(0, sl.stop - sl.start, QUERY_TILE):
            end = min(start + QUERY_TILE, sl.stop - sl.start)
            lo, hi = window_key_range(hist + start, hist + end, window)
            b0 = lo // B
            rows = table[b0:-(-hi // B)]
            keys = k_cache[rows].flatten(0, 1)[lo - b0 * B:hi - b0 * B].float().transpose(0, 1)   # [Hkv, K, D]
            values = v_cache[rows].flatten(0, 1)[lo - b0 * B:hi - b0 * B].float().transpose(0, 1)
            qt = q[sl.start + start:sl.start + end].float().view(end - start, Hkv, G, D).permute(1, 2, 0, 3)
            q_pos = torch.arange(hist + start, hist + end, device=q.device)[:, None]
            k_pos = torch.arange(lo, hi, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            scores = torch.einsum('hgld,hkd->hglk', qt, keys) * scale
            scores = scores.masked_fill(~visible, float('-inf'))
            o = torch.einsum('hglk,hkd->hgld', scores.softmax(-1), values)
            if sink is not None:
                o = o * torch.sigmoid(torch.logsumexp(scores, -1) - sink).unsqueeze(-1)
            out[sl.start + start:sl.start + end] = o.permute(2, 0, 1, 3).reshape(end - start, H, D).to(q.dtype)
    return out
