"""Triton paged sliding-window attention: the CUDA implementation of ``paged_window_attention``.

Same contract and semantics as the torch version (:mod:`.window_attention`): a query at position
``p`` sees the keys ``max(0, p - W + 1) .. p`` (all of ``0 .. p`` with no window), and a per-head
sink logit ``s_h`` rescales its output by ``sigmoid(lse - s_h)``.

One program per (query tile, KV head). A tile is up to ``ROWS`` consecutive new queries of one
sequence (one for a decode sequence); the program stacks the ``G`` query heads of its KV head
and the tile's rows into one ``[G * ROWS]`` axis (GQA: each key tile is loaded once for the
group) and walks the tile's keys ``BLOCK_N`` positions at a time with an online softmax
(Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018)::

    program (tile, kv head):   rows i = (g, r): head kv_head * G + g, position a + r
      keys [lo, hi):  lo = max(0, a - W + 1), hi = a + rows     (a: the tile's first position)
      for k0 in lo, lo + BLOCK_N, ... < hi:
          pos = k0 + n;  block = table[seq, pos // block_size]  (only for lo <= pos < hi)
          s   = q . K[block, pos % block_size] * scale,  -inf where pos > p_i or pos <= p_i - W
          m' = max(m, max s);  l = l e^(m - m') + sum e^(s - m');  acc = acc e^(m - m') + e^(s - m') V
      out = acc / l  (* sigmoid(m + log l - s_h) with sinks)

Block-table entries are looked up per key position and only for positions in ``[lo, hi)``, so
a block wholly before the first query's window is never read (its id may be garbage: the block
may be freed and reused), and neither is a table entry past the sequence. Key positions of the
tile that a given row may not see are loaded (they are live keys of the tile) but masked to
``-inf``; loads outside ``[lo, hi)`` are masked to 0, so no unwritten entry reaches a product.

Both products run in float32 at full precision (``input_precision='ieee'``; Triton's default
for float32 ``tl.dot`` is TF32), on float32 copies of any cache dtype, as the torch version
does; the result is rounded to ``q.dtype`` once. The tiles of a step (``[n, 4]`` int32: first
flat row, rows, first position, table row) depend only on its layout, so they are built once
per step and tile height and kept in ``StepContext.kernel_memo`` for every layer.

The same kernel serves Inkling's attention (``relative_bias_attention``, the contract of the torch
path in ``models/inkling.py``): an additive bias ``rel_p . proj[:, p - j]`` on each score whose
distance ``p - j`` is below the extent ``E`` (``proj`` float32 ``[d_rel, E]``, gathered one
``d_rel`` channel at a time), then the sum times a per-query multiplier ``tau_p``, before the mask.

Registered for CUDA when triton imports; runs on CPU tensors under ``TRITON_INTERPRET=1`` (how
tests/test_window_attention_triton.py checks it against ``paged_window_attention_reference`` and
Inkling's torch loop). Importing this module never needs triton.
"""
from __future__ import annotations

import torch

from . import once, register_kernel, triton_available
from .attention import fill_kv_cache
from ..model_inputs import StepContext

__all__ = ['paged_window_attention_triton', 'relative_bias_attention_triton', 'window_tiles', 'tile_rows',
           'NO_WINDOW']

TILE_HEIGHT = 64      # stacked (head, row) pairs a program aims at: rows per tile = TILE_HEIGHT // G
NO_WINDOW = 1 << 30   # the window passed for none: larger than any position (positions stay < 2^30)


def tile_rows(group: int) -> int:
    """Query rows per tile of a multi-token chunk for ``group`` query heads per KV head: the
    largest count whose ``group * rows`` stacked rows fit :data:`TILE_HEIGHT` (at least 1)."""
    return max(1, TILE_HEIGHT // group)


def window_tiles(ctx: StepContext, rows: int) -> list[tuple[int, torch.Tensor]]:
    """The step's query tiles, as ``(rows per tile, int32 [n, 4] tiles)`` per launch: one tile
    of one row per decode sequence (one new token) and tiles of ``rows`` rows over each
    multi-token chunk (a short last tile holds what is left). Each tile row is ``(first flat row,
    rows in the tile, position of its first query, sequence index)``. Built once per step and
    ``rows`` (kept in ``ctx.kernel_memo``).

    Args:
        ctx: the step's batch layout.
        rows: tile height of the multi-token chunks (:func:`tile_rows`).

    Returns:
        Up to two launches (decode tiles first); none for an empty step.
    """
    key = ('paged_window_attention_triton', rows)
    plan = ctx.kernel_memo.get(key)
    if plan is not None:
        return plan
    single, multi = [], []
    for i, (n, kv, start) in enumerate(zip(ctx.q_seqlens, ctx.kv_seqlens, ctx.q_start_loc)):
        n, first = int(n), int(kv) - int(n)
        if n == 1:
            single.append((int(start), 1, first, i))
        for j in range(0, n if n > 1 else 0, rows):
            multi.append((int(start) + j, min(rows, n - j), first + j, i))
    plan = [(r, torch.tensor(t, dtype=torch.int32, device=ctx.device)) for r, t in ((1, single), (rows, multi)) if t]
    ctx.kernel_memo[key] = plan
    return plan


@once
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _window_attention(q_ptr, k_ptr, v_ptr, out_ptr, sink_ptr, table_ptr, tiles_ptr, rel_ptr, proj_ptr, tau_ptr,
                          scale, window, extent,
                          stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                          stride_on, stride_oh, stride_tn, stride_rn, stride_rh, group, block_size, head_dim,
                          ROWS: tl.constexpr, HAS_SINK: tl.constexpr, HAS_BIAS: tl.constexpr, D_REL: tl.constexpr,
                          HAS_TAU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        row0 = tl.load(tiles_ptr + tile * 4)
        nrows = tl.load(tiles_ptr + tile * 4 + 1)
        pos0 = tl.load(tiles_ptr + tile * 4 + 2)
        seq = tl.load(tiles_ptr + tile * 4 + 3).to(tl.int64)
        i = tl.arange(0, BLOCK_M)
        g = i // ROWS
        r = i % ROWS
        i_ok = (g < group) & (r < nrows)
        head = kv_head * group + g
        q_pos = pos0 + r
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_rows = (row0 + r).to(tl.int64) * stride_qn + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        rel_rows = rel_ptr + (row0 + r).to(tl.int64) * stride_rn + head * stride_rh
        if HAS_TAU:
            tau = tl.load(tau_ptr + row0 + r, mask=i_ok, other=1.0).to(tl.float32)
        lo = tl.maximum(pos0 - window + 1, 0)
        hi = pos0 + nrows
        n = tl.arange(0, BLOCK_N)
        m = tl.full((BLOCK_M,), float('-inf'), tl.float32)
        denom = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        table = table_ptr + seq * stride_tn
        # a while loop to loaded bounds (Triton's interpreter cannot range() over a loaded value;
        # attention_triton.py says why that costs nothing compiled)
        k0 = lo
        while k0 < hi:
            k_pos = k0 + n
            k_ok = k_pos < hi
            block = tl.load(table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
            slot = k_pos % block_size
            k_at = block * stride_kb + slot * stride_kt + kv_head * stride_kh
            k_t = tl.load(k_ptr + k_at[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None],
                          other=0.0).to(tl.float32)                                     # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, k_t, input_precision='ieee') * scale
            if HAS_BIAS:
                # bias(p, d) = rel_p . proj[:, d] for distances 0 <= d < extent: one column of proj
                # per (row, key), gathered channel by channel (no [M, N, d_rel] block in registers)
                dist = q_pos[:, None] - k_pos[None, :]
                near = (dist >= 0) & (dist < extent) & i_ok[:, None] & k_ok[None, :]
                dist = tl.where(near, dist, 0)
                bias = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for c in range(D_REL):
                    rel_c = tl.load(rel_rows + c, mask=i_ok, other=0.0).to(tl.float32)
                    bias += rel_c[:, None] * tl.load(proj_ptr + c * extent + dist, mask=near, other=0.0)
                s += bias
            if HAS_TAU:
                s = s * tau[:, None]
            seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window) & k_ok[None, :]
            s = tl.where(seen, s, float('-inf'))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # a row that has seen no key yet (a later row of a windowed tile) keeps m = -inf:
            # subtract 0 there, not -inf (e^(-inf - -inf) is NaN)
            m_ref = tl.where(m_new == float('-inf'), 0.0, m_new)
            p = tl.exp(s - m_ref[:, None])
            alpha = tl.exp(m - m_ref)
            v_at = block * stride_vb + slot * stride_vt + kv_head * stride_vh
            v = tl.load(v_ptr + v_at[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)                                       # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision='ieee')
            denom = denom * alpha + tl.sum(p, axis=1)
            m = m_new
            k0 += BLOCK_N
        denom = tl.where(i_ok, denom, 1.0)          # padding rows saw nothing; they are not stored
        out = acc / denom[:, None]
        if HAS_SINK:
            sink = tl.load(sink_ptr + head, mask=i_ok, other=0.0)
            lse = tl.where(i_ok, m, 0.0) + tl.log(denom)
            out = out / (1.0 + tl.exp(sink - lse))[:, None]          # * sigmoid(lse - sink)
        o_rows = (row0 + r).to(tl.int64) * stride_on + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=i_ok[:, None] & d_ok[None, :])

    return triton, _window_attention


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext, scale: float,
            window: int | None, sinks: torch.Tensor | None, rel: torch.Tensor | None = None,
            proj: torch.Tensor | None = None, tau: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's launches over a step whose K/V are in the cache (``ctx`` addresses them):
    ``[T, heads, head_dim]`` in ``q.dtype``. ``rel`` / ``proj`` / ``tau``: Inkling's relative
    bias and logit multipliers (:func:`relative_bias_attention_triton`), or None."""
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = H // Hkv
    sink = None if sinks is None else sinks.float().contiguous()
    if rel is not None:
        rel = rel if rel.stride(-1) == 1 else rel.contiguous()
        proj = proj.float().contiguous()
    tau = None if tau is None else tau.float().contiguous()
    table = ctx.block_table
    triton, kernel = _kernel()
    block_d = max(16, triton.next_power_of_2(D))
    block_n = 64 if block_d <= 64 else 32
    for rows, tiles in window_tiles(ctx, tile_rows(group)):
        kernel[(tiles.shape[0], Hkv)](
            q, k_cache, v_cache, out, q if sink is None else sink, table, tiles, q if rel is None else rel,
            q if proj is None else proj, q if tau is None else tau, float(scale),
            NO_WINDOW if window is None else int(window), 1 if proj is None else proj.shape[1],
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), table.stride(0),
            0 if rel is None else rel.stride(0), 0 if rel is None else rel.stride(1), group, ctx.block_size, D,
            ROWS=rows, HAS_SINK=sink is not None, HAS_BIAS=rel is not None, D_REL=1 if rel is None else rel.shape[2],
            HAS_TAU=tau is not None, BLOCK_M=max(16, triton.next_power_of_2(group * rows)), BLOCK_N=block_n,
            BLOCK_D=block_d)
    return out


@register_kernel('paged_window_attention', device_type='cuda', priority=10, available=triton_available)
def paged_window_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, ctx: StepContext, scale: float, window: int | None,
                                  sinks: torch.Tensor | None) -> torch.Tensor:
    """Store the new K/V in the paged cache, then attend each new query to its window: the
    contract of :func:`~lmdeploy.pytorch.kernels.window_attention.paged_window_attention`, as
    one or two Triton launches (module docstring).

    Args:
        q: ``[T, num_heads, head_dim]`` queries of the flat batch (any strides).
        k, v: ``[T, num_kv_heads, head_dim]`` new keys / values (already rotated).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, unit stride along
            ``head_dim`` (views into a byte buffer are fine).
        ctx: batch layout; a sliding layer reads the tables of :meth:`StepContext.paged_group`.
        scale: softmax scale.
        window: keys per query (itself included), or None for full causal attention.
        sinks: ``[num_heads]`` sink logits, or None for none.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        ValueError: ``window`` below 1, heads not a multiple of KV heads, or a cache whose
            ``head_dim`` is not contiguous.
    """
    if window is not None and window < 1:
        raise ValueError(f'sliding_window must be >= 1, got {window}')
    _check_heads(q, k_cache, v_cache)
    ctx = ctx.paged_group(window)       # a sliding layer's blocks may have tables of their own
    fill_kv_cache(k, v, k_cache, v_cache, ctx)
    return _attend(q, k_cache, v_cache, ctx, scale, window, sinks)


@register_kernel('relative_bias_attention', device_type='cuda', priority=10, available=triton_available)
def relative_bias_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor,
                                   proj: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
                                   scale: float, window: int | None, tau: torch.Tensor | None) -> torch.Tensor:
    """Inkling's attention with relative logits (the contract of
    :func:`~lmdeploy.pytorch.models.inkling.relative_bias_attention`, whose torch path other
    devices run): the same kernel with the bias ``rel_p . proj[:, p - j]`` (distances
    ``0 <= p - j < E``) added to each float32 score and the sum times ``tau_p``, before the mask.

    Args:
        q: ``[T, heads, head_dim]``; k, v: ``[T, kv_heads, head_dim]`` new keys / values.
        rel: ``[T, heads, d_rel]`` relative states; proj: ``[d_rel, E]`` bias profiles.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, unit stride along
            ``head_dim``.
        ctx: batch layout; scale: the logit scale; window: keys per query, or None.
        tau: ``[T]`` float32 logit multipliers, or None.

    Returns:
        ``[T, heads, head_dim]`` in ``q.dtype``.

    Raises:
        ValueError: ``window`` below 1, heads not a multiple of KV heads, a cache whose
            ``head_dim`` is not contiguous, or ``rel`` / ``proj`` of other shapes.
    """
    if window is not None and window < 1:
        raise ValueError(f'sliding_window must be >= 1, got {window}')
    _check_heads(q, k_cache, v_cache)
    if rel.shape[:2] != q.shape[:2] or proj.dim() != 2 or rel.shape[2] != proj.shape[0]:
        raise ValueError(f'rel must be [T, heads, d_rel] and proj [d_rel, E]; got rel {tuple(rel.shape)}, '
                         f'proj {tuple(proj.shape)} for q {tuple(q.shape)}')
    ctx = ctx.paged_group(window)
    fill_kv_cache(k, v, k_cache, v_cache, ctx)
    return _attend(q, k_cache, v_cache, ctx, scale, window, None, rel, proj, tau)


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError before the cache is written when the kernel could not run on these shapes."""
    H, Hkv = q.shape[1], k_cache.shape[2]
    if H % Hkv or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError('paged_window_attention_triton needs heads % kv_heads == 0 and caches with a contiguous '
                         f'head_dim; got {H} heads, {Hkv} kv heads, k_cache strides {k_cache.stride()}')
