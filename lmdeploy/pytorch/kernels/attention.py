"""Paged causal attention over KV blocks (full-attention layers), batched over sequences.

``paged_attention`` first writes the new tokens' K/V into each sequence's blocks, then attends
every new query to keys ``[0, kv_len)`` of its own sequence with a causal offset::

    kv positions  0 ............ history_len ........ kv_len
                  |  cached K/V  |  new K/V (written)  |
    query i (new token at position history_len + i) sees positions <= history_len + i

Two paths, chosen per sequence by its number of new tokens:

- **decode** (1 new token): all such sequences in ONE batched call. Their keys are gathered
  through the padded block table into ``[N, Hkv, S, D]`` (padding points at a written entry)
  and each query group of a KV head becomes the "query length" axis of a 4-D
  ``scaled_dot_product_attention`` (GQA without repeating keys); a padding mask hides
  positions ``>= kv_len``.
- **prefill** (several new tokens): one 4-D ``scaled_dot_product_attention`` per sequence,
  ``is_causal`` when there is no history. 4-D inputs matter on CPU: torch's flash kernel then
  runs in tiles and never materialises the ``[q_len, kv_len]`` score matrix (3-D inputs take the
  math path, quadratic memory). With history, the causal offset needs an explicit mask; queries
  go in tiles of :data:`PREFILL_QUERY_TILE` rows so the mask stays ``tile x kv_len``.

The K/V write is one indexed store per cache for the whole flat batch. The per-sequence
functions at the bottom are the slow, obvious reference the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import get_kernel, register_kernel
from .cpu_native import native_available, paged_decode_attention_native
from ..model_inputs import StepContext, kv_gather_index

__all__ = ['fill_kv_cache', 'paged_decode_attention', 'paged_attention_torch', 'paged_attention_reference',
           'PREFILL_QUERY_TILE']

PREFILL_QUERY_TILE = 1024  # query rows per masked SDPA call (mask memory ~ tile * kv_len)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  ctx: StepContext) -> None:
    """Write new keys/values of the whole flat batch into their blocks (one store per cache).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` for the flat batch of new tokens.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (may be strided
            views into a byte buffer).
        ctx: the step's batch layout; token ``j`` of sequence ``i`` lands at cache position
            ``history_len[i] + j`` (:attr:`StepContext.kv_write_index`).
    """
    blocks, offsets = ctx.kv_write_index
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


@register_kernel('paged_decode_attention', device_type='any')
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           kv_seqlens: torch.Tensor, scale: float,
                           gather_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query token per sequence against its paged keys, all sequences in one call.

    Args:
        q: ``[N, num_heads, head_dim]``; the query of sequence ``i`` is its last token (its K/V
            already written).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (may be strided).
        block_table: int64 ``[N, W]`` block ids, rows padded with any valid id.
        kv_seqlens: int64 ``[N]`` keys per sequence (``1 <= kv_seqlens[i] <= W * block_size``).
        scale: softmax scale.
        gather_index: :func:`~lmdeploy.pytorch.model_inputs.kv_gather_index` of the two
            above, if already built for the step (it is the same for every layer).

    Returns:
        ``[N, num_heads, head_dim]`` in ``q.dtype``.
    """
    N, H, D = q.shape
    Hkv = k_cache.shape[2]
    if gather_index is None:
        gather_index = kv_gather_index(block_table, kv_seqlens, k_cache.shape[1])
    blocks, offsets, valid = gather_index
    keys = k_cache[blocks, offsets].transpose(1, 2).to(q.dtype)      # [N, Hkv, S, D]
    values = v_cache[blocks, offsets].transpose(1, 2).to(q.dtype)
    grouped = q.view(N, Hkv, H // Hkv, D)   # heads of one KV group act as its query rows
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(N, H, D)


@register_kernel('paged_decode_attention', device_type='cpu', priority=5,
                 available=native_available)
def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, kv_seqlens: torch.Tensor, scale: float,
                               gather_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                               ) -> torch.Tensor:
    """:func:`paged_decode_attention` on CPU: the native kernel for float32
    (:func:`~.cpu_native.paged_decode_attention_native`: each cached row read once per KV
    group, no gathered copy of the keys), else the torch form."""
    out = paged_decode_attention_native(q, k_cache, v_cache, block_table, kv_seqlens, scale)
    if out is not None:
        return out
    return paged_decode_attention(q, k_cache, v_cache, block_table, kv_seqlens, scale, gather_index)


def _prefill_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, history: int,
                 scale: float) -> torch.Tensor:
    """``q [L, H, D]`` at positions ``history..history+L-1`` over ``keys/values [history+L, Hkv, D]``."""
    L = q.shape[0]
    q4, k4, v4 = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    gqa = q.shape[1] != keys.shape[1]
    if history == 0:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    out = torch.empty_like(q4)
    for start in range(0, L, PREFILL_QUERY_TILE):
        end = min(start + PREFILL_QUERY_TILE, L)
        kv_end = history + end   # later keys are masked for every row of the tile anyway
        q_pos = torch.arange(history + start, history + end, device=q.device)[:, None]
        mask = torch.arange(kv_end, device=q.device)[None, :] <= q_pos
        out[:, :, start:end] = F.scaled_dot_product_attention(q4[:, :, start:end], k4[:, :, :kv_end],
                                                              v4[:, :, :kv_end], attn_mask=mask, scale=scale,
                                                              enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _gather_keys(cache: torch.Tensor, table: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[kv_len, Hkv, D]`` keys (or values) of one sequence from its block ids."""
    n_blocks = -(-kv_len // cache.shape[1])
    return cache[table[:n_blocks]].flatten(0, 1)[:kv_len].to(dtype)


@register_kernel('paged_attention', device_type='any')
def paged_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
    """Store the new K/V in the paged cache and run causal attention for the new queries.

    Args:
        q: ``[T, num_heads, head_dim]`` queries of the flat batch.
        k, v: ``[T, num_kv_heads, head_dim]`` new keys/values (already normed and rotated).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        ctx: batch layout (see :class:`StepContext`).
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[T, num_heads, head_dim]`` attention output in ``q.dtype``.
    """
    fill_kv_cache(k, v, k_cache, v_cache, ctx)
    decode_fn = get_kernel('paged_decode_attention', q.device)
    if all(n == 1 for n in ctx.q_seqlens):   # pure decode: rows are sequences
        return decode_fn(q, k_cache, v_cache, ctx.block_table, ctx.kv_seqlens_t, scale, ctx.kv_gather_index)
    out = torch.empty_like(q)
    decode = [i for i, n in enumerate(ctx.q_seqlens) if n == 1]
    if decode:
        idx = torch.tensor(decode, dtype=torch.int64, device=q.device)
        rows = ctx.cu_seqlens[idx]
        out[rows] = decode_fn(q[rows], k_cache, v_cache, ctx.block_table[idx], ctx.kv_seqlens_t[idx], scale)
    for i, (hist, kv_len) in enumerate(zip(ctx.history_lens, ctx.kv_seqlens)):
        if ctx.q_seqlens[i] == 1:
            continue
        sl = ctx.seq_slice(i)
        table = ctx.block_tables[i].to(q.device)
        keys = _gather_keys(k_cache, table, kv_len, q.dtype)
        values = _gather_keys(v_cache, table, kv_len, q.dtype)
        out[sl] = _prefill_one(q[sl], keys, values, hist, scale)
    return out


def paged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
    """Per-sequence, per-token reference of :func:`paged_attention_torch` (tests only; slow).

    Writes K/V token by token and attends with an explicit ``[q_len, kv_len]`` causal mask after
    repeating keys per query head. Same arguments and result.
    """
    B = ctx.block_size
    for i, hist in enumerate(ctx.history_lens):
        sl = ctx.seq_slice(i)
        for j, t in enumerate(range(sl.start, sl.stop)):
            block = int(ctx.block_tables[i][(hist + j) // B])
            k_cache[block, (hist + j) % B] = k[t].to(k_cache.dtype)
            v_cache[block, (hist + j) % B] = v[t].to(v_cache.dtype)
    out = torch.empty_like(q)
    rep = q.shape[1] // k_cache.shape[2]
    for i, (hist, kv_len) in enumerate(zip(ctx.history_lens, ctx.kv_seqlens)):
        sl = ctx.seq_slice(i)
        table = ctx.block_tables[i].to(q.device)
        keys = _gather_keys(k_cache, table, kv_len, q.dtype).repeat_interleave(rep, dim=1)
        values = _gather_keys(v_cache, table, kv_len, q.dtype).repeat_interleave(rep, dim=1)
        q_pos = torch.arange(hist, kv_len, device=q.device)[:, None]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos
        scores = torch.einsum('qhd,khd->hqk', q[sl], keys) * scale
        probs = scores.masked_fill(~mask, float('-inf')).softmax(-1)
        out[sl] = torch.einsum('hqk,khd->qhd', probs, values)
    return out
