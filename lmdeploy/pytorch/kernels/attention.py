"""Paged causal attention over KV blocks (full-attention layers).

``paged_attention`` first writes the new tokens' K/V into each sequence's blocks, then attends
every new query to keys ``[0, kv_len)`` of its own sequence with a causal offset::

    kv positions  0 ............ history_len ........ kv_len
                  |  cached K/V  |  new K/V (written)  |
    query i (new token at position history_len + i) sees positions <= history_len + i

The torch implementation gathers the blocks per sequence; it is the CPU/reference path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel
from ..model_inputs import StepContext

__all__ = ['fill_kv_cache', 'paged_attention_torch']


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  ctx: StepContext) -> None:
    """Write new keys/values into their blocks.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` for the flat batch of new tokens.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        ctx: the step's batch layout; token ``j`` of sequence ``i`` lands at position
            ``history_len[i] + j``.
    """
    B = ctx.block_size
    for i, hist in enumerate(ctx.history_lens):
        sl = ctx.seq_slice(i)
        pos = torch.arange(hist, hist + ctx.q_seqlens[i], device=k.device)
        blocks = ctx.block_tables[i].to(k.device)[pos // B]
        k_cache[blocks, pos % B] = k[sl].to(k_cache.dtype)
        v_cache[blocks, pos % B] = v[sl].to(v_cache.dtype)


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
    out = torch.empty_like(q)
    B = ctx.block_size
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for i, (hist, kv_len) in enumerate(zip(ctx.history_lens, ctx.kv_seqlens)):
        sl = ctx.seq_slice(i)
        n_blocks = (kv_len + B - 1) // B
        table = ctx.block_tables[i][:n_blocks].to(q.device)
        keys = k_cache[table].flatten(0, 1)[:kv_len].to(q.dtype)     # [kv_len, Hkv, D]
        values = v_cache[table].flatten(0, 1)[:kv_len].to(q.dtype)
        if num_heads != num_kv_heads:
            rep = num_heads // num_kv_heads
            keys = keys.repeat_interleave(rep, dim=1)
            values = values.repeat_interleave(rep, dim=1)
        q_len = ctx.q_seqlens[i]
        q_pos = torch.arange(hist, hist + q_len, device=q.device)[:, None]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos       # [q_len, kv_len]
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=mask, scale=scale)
        out[sl] = o.transpose(0, 1)
    return out
