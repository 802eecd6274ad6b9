"""Paged causal attention with an optional sliding window and per-head attention sinks.

The attention of the sliding-window families (``granitemoe_swa``, ``lfm3``, ``lara_mini``; their
global layers too, with no window). For a new query at position ``p`` and a window of ``W``
tokens, the keys it sees are positions ``max(0, p - W + 1) .. p`` (``W`` keys including itself;
no window: ``0 .. p``)::

    kv positions   0 ...... p-W+1 ............ p
                   | never read | read (window) |

Only the positions some query's window reaches are gathered, so blocks that lie wholly before
``p - W + 1`` for every query are never read: their ids in the block table may point anywhere
(a block that fell out of the window may already be freed and reused).

A per-head sink ``s_h`` is one extra logit in the softmax denominator with no value attached
(the "attention sink" of Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", 2023, as a learned scalar): with ``lse = logsumexp(scores)``::

    out = softmax(scores) @ V * sigmoid(lse - s_h)      (= sum e^s V / (sum e^s + e^{s_h}))

Batched over the sequences of a step, with no Python loop per sequence. Each sequence's new
queries are cut into **tiles** of ``R`` consecutive rows (``R = 1`` for a one-token decode
sequence, :func:`query_tile` rows for a prefill chunk); a tile whose first query is at ``a``
reads the keys ``[max(0, a - W + 1), a + R)``, at most ``R + W - 1`` of them. Every tile of one
kind is padded to the same key count ``K`` and the same ``R``, so all of them run as ONE gather
from the paged cache (through the block table) and one batched masked softmax::

    tiles   [n, R] query rows      (a short last tile repeats its last row; the copies are
                                    written back to that same row with the same value)
    keys    [n, K] cache positions (past a tile's last query: its last query's own position,
                                    masked; so no unwritten or out-of-window entry is read)
    scores  [n, Hkv, G, R, K]      float32, masked by k <= q and k > q - W, G = heads per KV head

Tiles go in groups of at most :data:`SCORE_ELEMENTS` score entries per call (a loop over groups
of equal shape, one group for any decode step). The plan (rows, block ids, offsets, mask) depends
only on the step's layout and the window, so it is built once per step and window and kept in
:attr:`~lmdeploy.pytorch.model_inputs.StepContext.kernel_memo` for every layer.

A float32 decode step with no sinks whose window covers every key (no window, or no sequence
longer than it) is plain paged decode attention: the registry's ``paged_decode_attention``
(native on CPU). Scores and softmax run in float32 otherwise (the ``transformers`` eager reference
does the same). :func:`paged_window_attention_reference` is the per-sequence loop this replaced,
kept as the tests' reference. On CUDA the registry picks the Triton kernel of
:mod:`.window_attention_triton` instead (same contract and semantics, no gathered copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import get_kernel, register_kernel
from .attention import fill_kv_cache
from ..model_inputs import StepContext

__all__ = ['paged_window_attention', 'paged_window_attention_reference', 'window_key_range', 'window_plan',
           'query_tile', 'QUERY_TILE', 'SCORE_ELEMENTS']

QUERY_TILE = 256  # most query rows per tile of a prefill chunk
SCORE_ELEMENTS = 1 << 24  # most float32 score entries (heads x rows x keys) of one batched call


def window_key_range(first_pos: int, end_pos: int, window: int | None) -> tuple[int, int]:
    """``[lo, hi)``: the key positions that queries at positions ``[first_pos, end_pos)`` may see
    (``window`` tokens each, ``None`` for all earlier ones)."""
    lo = 0 if window is None else max(0, first_pos - window + 1)
    return lo, end_pos


def query_tile(window: int | None) -> int:
    """Query rows per tile of a multi-token chunk: the window clamped to ``[16, QUERY_TILE]``
    (:data:`QUERY_TILE` without one). A tile reads ``rows + window - 1`` keys for ``rows``
    queries, so a tile about as long as the window wastes at most about half of the scores on
    masked keys, and a longer one no more."""
    return QUERY_TILE if window is None else min(QUERY_TILE, max(16, window))


@dataclass(frozen=True)
class WindowTiles:
    """One batched call of :func:`paged_window_attention`: ``n`` tiles of ``R`` query rows and
    ``K`` keys each (module docstring).

    Attributes:
        rows: int64 ``[n, R]`` flat query rows (a short tile repeats its last row).
        blocks, offsets: int64 ``[n, K]`` where each key lives in the paged cache.
        hidden: bool ``[n, 1, 1, R, K]`` keys a query may not see (future, outside the window,
            or padding).
        in_order: the rows are exactly ``0 .. T-1`` with ``R == 1`` (a pure decode step): the
            queries need no gather and the output no scatter.
    """
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    hidden: torch.Tensor
    in_order: bool


def _tiles(ctx: StepContext, seqs: list[int], R: int, window: int | None, heads: int) -> list[WindowTiles]:
    """The groups of tiles of ``R`` rows covering the new queries of sequences ``seqs`` (rows
    gathered and scattered; a pure decode step in flat order takes :func:`_decode_tiles`)."""
    dev = ctx.device
    idx = torch.tensor(seqs, dtype=torch.int64)
    qlen = torch.tensor(ctx.q_seqlens, dtype=torch.int64)[idx]
    kv = torch.tensor(ctx.kv_seqlens, dtype=torch.int64)[idx]
    start = torch.tensor(ctx.q_start_loc, dtype=torch.int64)[idx]
    hist = kv - qlen
    n_tiles = (qlen + R - 1) // R
    seq = torch.repeat_interleave(torch.arange(len(seqs)), n_tiles)   # tile -> position in seqs
    j = torch.arange(seq.shape[0]) - (torch.cumsum(n_tiles, 0) - n_tiles)[seq]
    q_first = hist[seq] + j * R                      # position of each tile's first query
    q_last = torch.minimum(q_first + R, kv[seq]) - 1
    k_lo = q_first.new_zeros(q_first.shape) if window is None else (q_first - window + 1).clamp_(min=0)
    K = int((q_last - k_lo).max()) + 1
    q_pos = torch.minimum(q_first[:, None] + torch.arange(R), q_last[:, None])             # [n, R]
    k_pos = k_lo[:, None] + torch.arange(K)                                                 # [n, K]
    hidden = k_pos[:, None, :] > q_pos[:, :, None]
    if window is not None:
        hidden |= k_pos[:, None, :] <= q_pos[:, :, None] - window
    k_pos = torch.minimum(k_pos, q_last[:, None])    # padding keys read the tile's own last key
    rows = start[seq, None] + q_pos - hist[seq, None]
    table_rows = idx.to(dev)[seq.to(dev)]
    k_pos = k_pos.to(dev)
    blocks = ctx.block_table[table_rows].gather(1, k_pos // ctx.block_size)
    offsets = k_pos % ctx.block_size
    rows, hidden = rows.to(dev), hidden.to(dev)[:, None, None]
    per_call = max(1, SCORE_ELEMENTS // (heads * R * K))
    return [WindowTiles(rows[a:a + per_call], blocks[a:a + per_call], offsets[a:a + per_call],
                        hidden[a:a + per_call], False) for a in range(0, rows.shape[0], per_call)]


def _decode_tiles(ctx: StepContext, window: int | None, heads: int) -> list[WindowTiles]:
    """:func:`_tiles` of a pure decode step in flat order (one row per sequence, rows ``0 ..
    N-1``): the same tiles with fewer ops, since each tile's only query is its sequence's last
    position and its keys start where that query's window does."""
    kv = ctx.kv_seqlens_t
    longest = max(ctx.kv_seqlens)
    K = longest if window is None else min(window, longest)
    k_lo = (kv - K).clamp_(min=0)                      # K keys from here reach the query
    k_pos = k_lo[:, None] + torch.arange(K, device=kv.device)
    hidden = k_pos >= kv[:, None]                      # past the query: only where kv < K
    k_pos = torch.minimum(k_pos, (kv - 1)[:, None])
    blocks = ctx.block_table.gather(1, k_pos // ctx.block_size)
    rows = torch.arange(len(ctx.kv_seqlens), device=kv.device)[:, None]
    tiles = WindowTiles(rows, blocks, k_pos % ctx.block_size, hidden[:, None, None, None], True)
    per_call = max(1, SCORE_ELEMENTS // (heads * K))
    if per_call >= rows.shape[0]:
        return [tiles]
    return [WindowTiles(rows[a:a + per_call], blocks[a:a + per_call], tiles.offsets[a:a + per_call],
                        tiles.hidden[a:a + per_call], False) for a in range(0, rows.shape[0], per_call)]


def window_plan(ctx: StepContext, window: int | None, heads: int) -> list[WindowTiles]:
    """Every batched call of one layer's attention in this step: decode sequences (one new token)
    as tiles of one row, the others as tiles of :func:`query_tile` rows. Built once per step,
    window and head count (kept in ``ctx.kernel_memo``).

    Args:
        ctx: the step's batch layout.
        window: keys per query, or None.
        heads: query heads (sizes the groups under :data:`SCORE_ELEMENTS`).

    Returns:
        The calls, each a :class:`WindowTiles`.
    """
    key = ('paged_window_attention', window, heads)
    plan = ctx.kernel_memo.get(key)
    if plan is None:
        T = sum(ctx.q_seqlens)
        if T == ctx.num_seqs and list(ctx.q_start_loc) == list(range(T)):
            plan = _decode_tiles(ctx, window, heads)
            ctx.kernel_memo[key] = plan
            return plan
        single = [i for i, n in enumerate(ctx.q_seqlens) if n == 1]
        multi = [i for i, n in enumerate(ctx.q_seqlens) if n > 1]
        plan = ((_tiles(ctx, single, 1, window, heads) if single else [])
                + (_tiles(ctx, multi, query_tile(window), window, heads) if multi else []))
        ctx.kernel_memo[key] = plan
    return plan


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: WindowTiles, scale: float,
            sink: torch.Tensor | None) -> torch.Tensor:
    """``[n * R, H, D]`` float32 outputs of one group of tiles (rows in ``tiles.rows`` order)."""
    n, R = tiles.rows.shape
    K = tiles.blocks.shape[1]
    H, D = q.shape[1:]
    Hkv = k_cache.shape[2]
    G = H // Hkv
    qt = q if tiles.in_order else q[tiles.rows.flatten()]
    # the heads of one KV head and the tile's rows form one [G * R] query axis per KV head
    qt = qt.float().reshape(n, R, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(n, Hkv, G * R, D)
    keys = k_cache[tiles.blocks, tiles.offsets].float().permute(0, 2, 3, 1)      # [n, Hkv, D, K]
    values = v_cache[tiles.blocks, tiles.offsets].float().transpose(1, 2)        # [n, Hkv, K, D]
    scores = torch.matmul(qt, keys).mul_(scale).view(n, Hkv, G, R, K).masked_fill_(tiles.hidden, float('-inf'))
    o = torch.matmul(scores.softmax(-1).view(n, Hkv, G * R, K), values).view(n, Hkv, G, R, D)
    if sink is not None:
        o = o * torch.sigmoid(torch.logsumexp(scores, -1) - sink).unsqueeze(-1)
    return o.permute(0, 3, 1, 2, 4).reshape(n * R, H, D)


@register_kernel('paged_window_attention', device_type='any')
def paged_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, ctx: StepContext, scale: float, window: int | None,
                           sinks: torch.Tensor | None) -> torch.Tensor:
    """Store the new K/V in the paged cache, then attend each new query to its window, all
    sequences of the step batched (module docstring).

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
    if (sinks is None and q.dtype == k_cache.dtype == torch.float32 and all(n == 1 for n in ctx.q_seqlens)
            and (window is None or max(ctx.kv_seqlens) <= window)):
        return get_kernel('paged_decode_attention', q.device)(q, k_cache, v_cache, ctx.block_table, ctx.kv_seqlens_t,
                                                              scale, ctx.kv_gather_index)
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    sink = None if sinks is None else sinks.float().view(Hkv, H // Hkv, 1)
    plan = window_plan(ctx, window, H)
    if len(plan) == 1 and plan[0].in_order:
        return _attend(q, k_cache, v_cache, plan[0], scale, sink).to(q.dtype)
    out = torch.empty_like(q)
    for tiles in plan:
        out[tiles.rows.flatten()] = _attend(q, k_cache, v_cache, tiles, scale, sink).to(q.dtype)
    return out


def paged_window_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                     v_cache: torch.Tensor, ctx: StepContext, scale: float, window: int | None,
                                     sinks: torch.Tensor | None) -> torch.Tensor:
    """:func:`paged_window_attention` one sequence and one tile of 512 queries at a time (the
    tests' reference; slow): same arguments, result and errors."""
    if window is not None and window < 1:
        raise ValueError(f'sliding_window must be >= 1, got {window}')
    fill_kv_cache(k, v, k_cache, v_cache, ctx)
    T, H, D = q.shape
    Hkv, B = k_cache.shape[2], ctx.block_size
    G = H // Hkv
    sink = None if sinks is None else sinks.float().view(Hkv, G, 1)
    out = torch.empty_like(q)
    for i, hist in enumerate(ctx.history_lens):
        sl = ctx.seq_slice(i)
        table = ctx.block_tables[i].to(q.device)
        for start in range(0, sl.stop - sl.start, 512):
            end = min(start + 512, sl.stop - sl.start)
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
