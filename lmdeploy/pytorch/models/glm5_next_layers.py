"""GLM-5.3-Flash (``glm5_next``) building blocks that Kimi-Linear does not have: manifold-
constrained hyper-connections (mHC), the DSA lightning indexer over pooled keys and NoPE MLA
attention restricted to the indexer's selection (the clamped SwiGLUs are
:class:`~.blocks.moe.LimitedSwiGLUMLP` / :class:`~.blocks.moe.LimitedExperts` with
:func:`~.blocks.moe.clamped_swiglu`).

Per DSA layer the paged cache holds, per token::

    latent      [kv_lora_rank]         kv_a_layernorm(kv_a_proj_with_mqa(h))   (all heads)
    index_keys  [2 * index_head_dim]   [k_norm(wk(h)) | h @ index_kpool_compress_gate^T]
                                        (layers whose indexer_types entry is 'full' only)

``index_keys`` is what the indexer re-pools on every step, so a chunk's (or a restored
prefix's) selection sees the earlier tokens' keys without recomputing them. transformers also
caches a per-token validity bit (its padding mask); the engine never pads, so every cached
token is valid and the bit is not stored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import find_kernel
from ..kernels.linear import linear
from ..model_inputs import StepContext
from .layers import Linear, RMSNorm

__all__ = ['HyperConnection', 'DSAIndexer', 'DSAAttention', 'top_pools', 'pools_mask']


class HyperConnection(nn.Module):
    """mHC (Xie et al., "mHC: Manifold-Constrained Hyper-Connections", 2026) around one block.

    The residual is ``N = hc_mult`` streams ``x [T, N, D]``. From ``RMS(x.flatten)`` (no
    weight) one linear map ``fn`` gives per token ``N + N + N*N`` logits; with ``base`` and
    the three ``scale`` entries: ``pre = sigmoid(.) + eps`` (collapse the streams into the
    block input), ``post = 2 sigmoid(.)`` (spread the block output over the streams) and
    ``comb = Sinkhorn(softmax(.) + eps)`` (an approximately doubly-stochastic ``N x N`` mix of
    the input streams: column-normalised, then ``hc_sinkhorn_iters - 1`` row / column rounds).
    All in float32. The layer output is ``post * y + comb^T x``.
    """

    def __init__(self, config):
        super().__init__()
        self.n, self.iters, self.eps = config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps
        self.norm_eps = config.rms_norm_eps
        n = self.n
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, N, D]`` → ``(post [T, N], comb [T, N, N]`` float32, block input ``[T, D]`` in ``x.dtype)``."""
        n = self.n
        flat = x.reshape(x.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mix = linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Block output ``y [T, D]`` and input streams ``residual [T, N, D]`` → new streams
        ``post[..., None] * y + comb^T @ residual`` ``[T, N, D]`` (in ``y.dtype``)."""
        dtype = y.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                              residual)


def top_pools(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores of each row, ties going to the lower index.

    ``torch.topk`` picks among exactly equal scores by an unspecified rule that depends on the
    row length, i.e. on how many pools a prefill chunk sees, so the kept pools (and the logits)
    changed with the chunk size wherever scores tie (e.g. all of them, on a checkpoint whose
    indexer projections are zero). A stable descending sort keeps equal scores in index order.
    Where the scores of the kept pools are distinct from the rest, the set equals ``topk``'s.

    Args:
        scores: ``[L, n]`` float scores.
        k: pools to keep, ``0 <= k <= n``.

    Returns:
        ``[L, k]`` int64 indices, best first.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def pools_mask(pools: torch.Tensor, kv_len: int, pool: int, tail: bool) -> torch.Tensor:
    """The ``[1, kv_len]`` key mask of one decode query's selection: the tokens of the pools in
    ``pools`` (int64 ``[K]``, ``-1`` = none; ``pool`` tokens each) and, when ``tail`` and
    ``pool > 1``, the tokens after the last complete pool."""
    pos = torch.arange(kv_len, device=pools.device)
    mask = (pos[:, None] // pool == pools[None, :]).any(dim=1) & (pos < kv_len // pool * pool)
    if tail and pool > 1:
        mask |= pos >= kv_len // pool * pool
    return mask[None]


class DSAIndexer(nn.Module):
    """DeepSeek Sparse Attention lightning indexer (DeepSeek-V3.2, 2025) over key pools.

    Per token ``t`` it caches ``k = LayerNorm(wk(h))`` and the pooling logits
    ``g = h @ index_kpool_compress_gate^T`` (``index_head_dim`` each). The keys of a sequence
    are cut, from its first token, into pools of ``P = index_kpool`` tokens; a complete pool's
    key is ``sum_j softmax_j(g_j + ape_j) * k_j`` (per channel, ``ape = index_kpool_compress_ape``).
    A query at position ``p`` with ``q = wq_b(q_resid)`` (``index_n_heads`` heads) scores pool
    ``m`` as ``sum_h w_h relu(q_h . key_m / sqrt(d))``, ``w = weights_proj(h) / sqrt(heads)``;
    pools not wholly at or before ``p`` are excluded. The best ``index_topk / P`` pools are
    kept (:func:`top_pools`: among equal scores the earlier pool), and, with
    ``index_kpool_always_select_tail``, the ``(p + 1) mod P``
    tokens of ``p``'s incomplete pool. Scores are float32.
    """

    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.pool, self.topk = config.index_kpool, config.index_topk
        self.select_tail = bool(config.index_kpool_always_select_tail)
        hidden, d = config.hidden_size, self.head_dim
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * d, bias=False)
        self.wk = Linear(hidden, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = Linear(hidden, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.pool, d))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(d, hidden))
        self.scale = d ** -0.5

    def token_keys(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, hidden]`` → the cached per-token entries ``[T, 2 * index_head_dim]``."""
        return torch.cat((self.k_norm(self.wk(hidden)), linear(hidden, self.index_kpool_compress_gate)), dim=-1)

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor, entries: torch.Tensor,
               history: int) -> torch.Tensor:
        """Visible-key mask of one sequence's new tokens.

        Args:
            hidden: ``[L, hidden]`` the new tokens' (normed) layer inputs.
            q_resid: ``[L, q_lora_rank]`` their ``q_a_layernorm(q_a_proj(hidden))``.
            entries: ``[S, 2 * index_head_dim]`` the cached entries of all ``S = history + L``
                tokens (:meth:`token_keys`).
            history: tokens before the first new one.

        Returns:
            ``[L, S]`` bool: which keys each query attends to.
        """
        L, S, P, d = hidden.shape[0], entries.shape[0], self.pool, self.head_dim
        pos = torch.arange(history, history + L, device=hidden.device)
        allowed = torch.zeros(L, S, dtype=torch.bool, device=hidden.device)
        n_pools = S // P
        if n_pools:
            keys, gates = entries[:n_pools * P].view(n_pools, P, 2 * d).split([d, d], dim=-1)
            prob = torch.softmax(gates.float() + self.index_kpool_compress_ape.float(), dim=1).to(keys.dtype)
            pool_keys = (prob * keys).sum(dim=1)                                     # [n_pools, d]
            q = self.wq_b(q_resid).view(L, self.n_heads, d)
            scores = F.relu(torch.matmul(q.float(), pool_keys.float().T) * self.scale)     # [L, heads, n_pools]
            w = self.weights_proj(hidden).float() * self.n_heads ** -0.5
            index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)         # [L, n_pools]
            ends = torch.arange(n_pools, device=hidden.device) * P + (P - 1)
            valid = ends[None, :] <= pos[:, None]
            index_scores = index_scores.masked_fill(~valid, torch.finfo(index_scores.dtype).min)
            chosen = top_pools(index_scores, min(self.topk // P, n_pools))
            pools = torch.zeros(L, n_pools, dtype=torch.bool, device=hidden.device)
            pools.scatter_(1, chosen, valid.gather(1, chosen))
            allowed[:, :n_pools * P] = pools.repeat_interleave(P, dim=1)
        if self.select_tail and P > 1:
            count = pos + 1
            start = count - count.remainder(P)
            cols = torch.arange(S, device=hidden.device)[None, :]
            allowed |= (cols >= start[:, None]) & (cols < count[:, None])
        return allowed

    @torch.no_grad()
    def select_decode(self, hidden: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, ctx: StepContext,
                      kernel) -> torch.Tensor:
        """The selected pools of a decode step (one query per sequence, at its last position),
        with shapes that do not depend on the lengths (the registry's ``dsa_select``, ``kernel``).

        Args:
            hidden: ``[N, hidden]`` the queries' (normed) layer inputs.
            q_resid: ``[N, q_lora_rank]`` their ``q_a_layernorm(q_a_proj(hidden))``.
            keys: the layer's ``index_keys`` cache ``[num_blocks, block_size, 2 * index_head_dim]``
                (this step's entries written).
            ctx: the step (``block_table``, ``kv_seqlens_t`` read as tensors).
            kernel: the ``dsa_select`` implementation for the device.

        Returns:
            int64 ``[N, index_topk // index_kpool]``: per sequence its ``min(index_topk //
            index_kpool, kv_len // index_kpool)`` best complete pools, best first (equal scores:
            the earlier pool, as :func:`top_pools`), then ``-1``. Every complete pool lies at or
            before the query, and the incomplete pool's tokens are the tail the attention adds.
        """
        N, d = hidden.shape[0], self.head_dim
        q = self.wq_b(q_resid).view(N, self.n_heads, d)
        w = self.weights_proj(hidden).float() * self.n_heads ** -0.5
        return kernel(q, w, keys, self.index_kpool_compress_ape, ctx.block_table, ctx.kv_seqlens_t,
                      self.topk // self.pool, self.scale)


class DSAAttention(nn.Module):
    """NoPE MLA (``qk_rope_head_dim = 0``) over a paged latent cache, each query attending
    only to the keys its layer's indexer selects (``indexer_types 'full'``) or the previous
    layer's selection (``'shared'``: no indexer, no ``index_keys`` cache).

    ``q = q_b_proj(q_a_layernorm(q_a_proj(h)))`` per head; keys / values are ``kv_b_proj`` of
    the cached latents; softmax scale ``qk_nope_head_dim ** -0.5``.

    Args:
        config: the text config (``Glm5NextTextConfig``).
        layer_idx: index into ``StepContext.kv_caches`` (``(latent,)`` or ``(latent, index_keys)``).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.v_dim, self.kv_lora_rank = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        hidden, bias, eps = config.hidden_size, config.attention_bias, config.rms_norm_eps
        self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.nope, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = self.nope ** -0.5
        self.indexer = DSAIndexer(config) if config.indexer_types[layer_idx] == 'full' else None
        self.pool, self.select_tail = config.index_kpool, bool(config.index_kpool_always_select_tail)

    def forward(self, hidden: torch.Tensor, ctx: StepContext, shared: list[torch.Tensor] | torch.Tensor | None
                ) -> tuple[torch.Tensor, list[torch.Tensor] | torch.Tensor]:
        """``[T, hidden]`` → (``[T, hidden]``, the selection); writes the new tokens' latents
        (and index keys) into their blocks. ``shared``: the previous layer's selection (required
        without an indexer).

        A step of one new token per sequence takes :meth:`_decode` (shapes independent of the
        lengths: a decode graph replays it); its selection is the pools tensor
        (:meth:`DSAIndexer.select_decode`). Other steps loop over their sequences; their
        selection is per sequence its ``[L, S]`` key mask. A shared layer reads either form.

        Raises:
            ValueError: a shared layer without ``shared``; a decode step's length, block id or
                pool id out of range (the ``dsa_*`` kernels)."""
        T, H = hidden.shape[0], self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(T, H, self.nope)
        caches = ctx.kv_caches[self.layer_idx]
        blocks, offsets = ctx.kv_write_index
        caches[0][blocks, offsets] = self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden)).to(caches[0].dtype)
        if self.indexer is not None:
            caches[1][blocks, offsets] = self.indexer.token_keys(hidden).to(caches[1].dtype)
        elif shared is None:
            raise ValueError(f'layer {self.layer_idx}: a shared DSA layer needs the previous layer\'s selection')
        decoded = self._decode(hidden, q_resid, q, ctx, shared)
        if decoded is not None:
            return decoded
        out = q.new_empty(T, H, self.v_dim)
        masks = []
        block_size = caches[0].shape[1]
        for i, (hist, kv_len) in enumerate(zip(ctx.history_lens, ctx.kv_seqlens)):
            table = ctx.block_tables[i].to(hidden.device)[:-(-kv_len // block_size)]
            sl = ctx.seq_slice(i)
            latent = caches[0][table].flatten(0, 1)[:kv_len].to(q.dtype)
            if self.indexer is not None:
                entries = caches[1][table].flatten(0, 1)[:kv_len].to(q.dtype)
                mask = self.indexer.select(hidden[sl], q_resid[sl], entries, hist)
            elif isinstance(shared, torch.Tensor):     # the previous layer took the decode path
                mask = pools_mask(shared[i], kv_len, self.pool, self.select_tail)
            else:
                mask = shared[i]
            masks.append(mask)
            kv = self.kv_b_proj(latent).view(kv_len, H, self.nope + self.v_dim)
            keys, values = kv.split([self.nope, self.v_dim], dim=-1)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                               values.transpose(0, 1)[None], attn_mask=mask, scale=self.scale)
            out[sl] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(T, -1)), masks

    def _decode(self, hidden: torch.Tensor, q_resid: torch.Tensor, q: torch.Tensor, ctx: StepContext,
                shared) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step of one new token per sequence (this step's rows already written) by the
        registry's ``dsa_select`` (own indexer) and ``dsa_attend`` between two batched products
        over heads: the key up-projection folded into the query (``q_c[h] = W_uk[h]^T q[h]``),
        attention over the selected tokens' latents, the value up-projection applied to the
        attended latent (the absorbed form of MLA; equal to up-projecting every selected row to
        float rounding). Reads the lengths and block tables as tensors only, so its shapes do
        not depend on them.

        Returns:
            (``[T, hidden]``, pools int64 ``[T, index_topk // index_kpool]``), or ``None`` (a
            prefill chunk, an FP8 ``kv_b_proj``, a shared selection in the per-sequence form, or
            no kernel for the device).
        """
        T, H, R = hidden.shape[0], self.num_heads, self.kv_lora_rank
        if not (T == len(ctx.q_seqlens) and all(n == 1 for n in ctx.q_seqlens) and self.kv_b_proj.fp8_block is None
                and (self.indexer is not None or isinstance(shared, torch.Tensor))):
            return None
        select, attend = find_kernel('dsa_select', hidden.device), find_kernel('dsa_attend', hidden.device)
        if select is None or attend is None:
            return None
        caches = ctx.kv_caches[self.layer_idx]
        pools = shared if self.indexer is None else self.indexer.select_decode(hidden, q_resid, caches[1], ctx, select)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, R).to(q.dtype)
        q_c = torch.bmm(q.transpose(0, 1), w[:, :self.nope])                              # [H, T, R]
        latent = attend(q_c, caches[0], ctx.block_table, ctx.kv_seqlens_t, pools, self.pool, self.select_tail,
                        self.scale)
        out = torch.bmm(latent.to(q.dtype), w[:, self.nope:].transpose(1, 2)).transpose(0, 1)   # [T, H, v]
        return self.o_proj(out.reshape(T, -1)), pools
