"""Multi-head latent attention (MLA, DeepSeek-V2, 2024) over a paged latent cache, as
Kimi-Linear (no rotary) and Ling 3 / ``bailing_hybrid`` (interleaved rotary, a sigmoid output
gate per head) use it.

Per token the paged cache holds one row shared by every head::

    latent [kv_lora_rank + qk_rope_head_dim] = [kv_a_layernorm(c_kv) | k_rope (rotated, if rotary)]

A prefill chunk gathers its sequence's rows and up-projects them through ``kv_b_proj``
(non-absorbed); a decode token uses the absorbed form (the up-projections folded into the query
and the output; measured in benchmark/benchmark_mla.py). A float32 decode step (one token per
sequence) runs all its sequences at once: a batched product over heads folds the key
up-projection into the queries, the registry's ``mla_decode`` (one native call on CPU) writes the
latent rows and attends in latent space, and a second batched product applies the value
up-projection; other steps loop over their sequences.

Under tensor parallelism (:func:`mla_split`) the layer splits by query head. Each query head
up-projects its own K and V from the shared latent, so a rank holds its query heads' rows of the
up-projections and leaves the latent producers whole::

    q_proj / q_b_proj     rows of its heads, (qk_nope + qk_rope) each    column-parallel
    kv_b_proj             rows of its heads, (qk_nope + v_head_dim) each  column-parallel
    g_proj (output gate)  rows of its heads, one each                    column-parallel
    o_proj                columns of its heads, v_head_dim each            row-parallel
    q_a_proj, kv_a_proj_with_mqa, their norms, an indexer               whole

so the cached latent (``tp_split=None``) is the same on every rank and the Store holds it once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import find_kernel
from ...model_inputs import StepContext
from ..layers import Linear, RMSNorm
from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows

__all__ = ['LatentAttention', 'causal_attention', 'mla_split', 'rotate_interleaved']


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, history: int,
                     scale: float) -> torch.Tensor:
    """``q [L, H, Dq]`` at positions ``history..`` over ``keys [S, H, Dq]``, ``values [S, H, Dv]``
    (``S = history + L``) → ``[L, H, Dv]``."""
    q4, k4, v4 = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if history == 0:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    else:
        pos = torch.arange(history, history + q.shape[0], device=q.device)[:, None]
        mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= pos
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout), each
    pair rotated by one frequency; the result is written de-interleaved, ``[even' | odd']``, as
    ``transformers``' ``apply_rotary_pos_emb_interleave`` does (queries and keys alike, so their
    dot products are unchanged).

    Args:
        x: ``[T, ..., R]``; cos, sin: ``[T, R]`` (``cat(f, f)`` tables; the first half is used).
    """
    half = cos.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos[:, :half].reshape(shape), sin[:, :half].reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class LatentAttention(nn.Module):
    """MLA over the paged latent cache (see the module docstring).

    Keys are ``[kv_b_proj(c) nope part | k_rope]`` per head, values the ``kv_b_proj`` value
    part; the softmax scale is ``scale`` (default ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
    With ``rotary`` the rope parts of the query and of ``k_rope`` are rotated by
    :func:`rotate_interleaved` before ``k_rope`` is cached; with ``output_gate`` each head's
    output is multiplied by ``sigmoid(g_proj(h))`` (``g_proj: hidden -> heads``) before ``o_proj``.

    Args:
        config: reads ``num_attention_heads``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
            ``v_head_dim``, ``kv_lora_rank``, ``q_lora_rank``, ``hidden_size``, ``attention_bias``.
        layer_idx: index into ``StepContext.kv_caches`` (``(latent [blocks, block_size, R + P],)``).
        rotary: whether ``forward`` takes ``(cos, sin)`` tables ``[T, qk_rope_head_dim]``.
        output_gate: the per-head sigmoid gate (Ling 3).
        scale: the softmax scale; None for ``(nope + rope) ** -0.5``.
    """

    def __init__(self, config, layer_idx: int, rotary: bool = False, output_gate: bool = False,
                 scale: float | None = None):
        super().__init__()
        self.layer_idx, self.rotary = layer_idx, rotary
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        qk = self.nope + self.rope
        hidden, bias = config.hidden_size, config.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)   # transformers' default eps, not the config's
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.g_proj = Linear(hidden, self.num_heads, bias=False) if output_gate else None
        self.scale = qk ** -0.5 if scale is None else scale

    def _fused_decode(self, hidden: torch.Tensor, q: torch.Tensor, ctx: StepContext,
                      rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """The attention output ``[T, H, v]`` of a float32 decode step (one token per sequence)
        through the registry's ``mla_decode`` between two batched products over heads (the key
        up-projection folded into the query, the value up-projection applied to the attended
        latent), or ``None`` (another dtype, a prefill token, an FP8 ``kv_b_proj``, or no such
        kernel for the device). The same value as :meth:`_absorbed_decode` per sequence."""
        T, H, R = hidden.shape[0], self.num_heads, self.kv_lora_rank
        if not (hidden.dtype == torch.float32 and T == len(ctx.q_seqlens) and all(n == 1 for n in ctx.q_seqlens)
                and self.kv_b_proj.fp8_block is None and self.kv_b_proj.weight.dtype == torch.float32
                and not self.kv_a_layernorm.zero_centered):
            return None
        step = find_kernel('mla_decode', hidden.device)
        (cache,) = ctx.kv_caches[self.layer_idx]
        if step is None or cache.dtype != torch.float32:
            return None
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, R)
        q_c = torch.bmm(q[..., :self.nope].transpose(0, 1), w[:, :self.nope])              # [H, T, R]
        cos, sin = rotary if self.rotary else (None, None)
        blocks, offsets = ctx.kv_write_index
        latent = step(q_c, q[..., self.nope:], self.kv_a_proj_with_mqa(hidden), self.kv_a_layernorm.weight,
                      self.kv_a_layernorm.eps, cos, sin, cache, blocks, offsets, ctx.block_table, ctx.kv_seqlens_t,
                      self.scale)
        return torch.bmm(latent, w[:, self.nope:].transpose(1, 2)).transpose(0, 1)       # [T, H, v]

    def forward(self, hidden: torch.Tensor, ctx: StepContext,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[T, hidden]`` (and ``(cos, sin)`` when built with ``rotary``) → ``[T, hidden]``;
        writes the new tokens' latents into their blocks."""
        T, H = hidden.shape[0], self.num_heads
        q = self.q_proj(hidden) if self.q_lora_rank is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(T, H, self.nope + self.rope)
        fused = self._fused_decode(hidden, q, ctx, rotary)
        if fused is not None:
            return self._output(hidden, fused)
        c, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        if self.rotary:
            q = torch.cat((q[..., :self.nope], rotate_interleaved(q[..., self.nope:], *rotary)), dim=-1)
            k_rope = rotate_interleaved(k_rope, *rotary)
        (cache,) = ctx.kv_caches[self.layer_idx]
        blocks, offsets = ctx.kv_write_index
        cache[blocks, offsets] = torch.cat((self.kv_a_layernorm(c), k_rope), dim=-1).to(cache.dtype)
        out = q.new_empty(T, H, self.v_dim)
        for i, (hist, kv_len) in enumerate(zip(ctx.history_lens, ctx.kv_seqlens)):
            table = ctx.block_tables[i].to(hidden.device)
            latent = cache[table[:-(-kv_len // cache.shape[1])]].flatten(0, 1)[:kv_len].to(q.dtype)
            sl = ctx.seq_slice(i)
            if sl.stop - sl.start == 1 and self.kv_b_proj.fp8_block is None:
                out[sl] = self._absorbed_decode(q[sl], latent)
                continue
            kv = self.kv_b_proj(latent[:, :self.kv_lora_rank]).view(kv_len, H, self.nope + self.v_dim)
            k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
            keys = torch.cat((k_nope, latent[:, None, self.kv_lora_rank:].expand(kv_len, H, self.rope)), dim=-1)
            out[sl] = causal_attention(q[sl], keys, values, hist, self.scale)
        return self._output(hidden, out)

    def _output(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The attention output ``out [T, H, v]`` through the output gate (when built with one)
        and ``o_proj`` → ``[T, hidden]``."""
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden).float()).to(out.dtype)[..., None]
        return self.o_proj(out.reshape(hidden.shape[0], -1))

    def _absorbed_decode(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """One query token ``q [1, H, nope + rope]`` over its sequence's ``latent [L, R + rope]``
        → ``[1, H, v]``, the key and value up-projections folded into the query and the output:
        ``q_c[h] = W_uk[h]^T q_nope[h]`` scores the latent rows directly and the attended latent
        is up-projected once by ``W_uv[h]`` (``kv_b_proj = [W_uk; W_uv]`` per head). The same
        value as up-projecting every row (the prefill path), at ``H * L * (R + rope)`` instead
        of ``L * R * H * (nope + v)`` multiply-adds per step: 13.6x faster at 256 cached tokens,
        33x at 1K and 72x at 4K for Kimi-Linear-48B's layer on the 2-core CPU
        (benchmark/benchmark_mla.py; benchmark/results/mla_decode_kimi48b_*.json). Softmax in
        float32."""
        H, R = self.num_heads, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, R).to(q.dtype)
        q_c = torch.einsum('hd,hdr->hr', q[0, :, :self.nope], w[:, :self.nope])
        scores = torch.cat((q_c, q[0, :, self.nope:]), dim=-1) @ latent.t()
        probs = (scores.float() * self.scale).softmax(-1).to(latent.dtype)
        return torch.einsum('hr,hvr->hv', probs @ latent[:, :R], w[:, self.nope:])[None]


def mla_split(*, output_gate: bool = False, o: str | tuple[str, ...] = 'o_proj'):
    """The tensor-parallel split of an MLA layer by query head (see the module docstring), as a
    split factory.

    Args:
        output_gate: the layer has Ling 3's per-head gate ``g_proj`` (``hidden -> heads``): its
            rows of the rank's heads.
        o: the checkpoint name(s) of the output projection (Ling 3's published ``dense``); the
            module is ``o_proj`` whatever the spelling.

    Returns:
        ``(config, size) -> BlockSplit``: axis ``q_heads`` (``num_attention_heads``); the local
        config sets both ``num_attention_heads`` and ``num_key_value_heads`` (one K/V per query
        head) to the rank's query heads.
    """
    o_names = (o,) if isinstance(o, str) else tuple(o)

    def split(config, size: int) -> BlockSplit:
        nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        tensors = (rows(('q_proj.weight', 'q_b_proj.weight'), Piece('q_heads', nope + rope)),
                   rows('kv_b_proj.weight', Piece('q_heads', nope + v)),
                   cols(tuple(f'{n}.weight' for n in o_names), Piece('q_heads', v)))
        if output_gate:
            tensors += (rows('g_proj.weight', Piece('q_heads')),)
        return BlockSplit((Axis('q_heads', config.num_attention_heads, 'num_attention_heads', 'num_attention_heads'),),
                          tensors, row_parallel=('o_proj',),
                          config=(('num_key_value_heads', config.num_attention_heads // size),))

    return split
