"""Inkling (Thinking Machines; ``transformers`` model types ``inkling_text`` and the multimodal
``inkling_mm_model``, whose text part is served here): every layer is attention followed by a MoE
or dense MLP, with short depthwise convolutions around them and no rotary embedding; positions
enter only through a learned, hidden-state-conditioned relative bias on the attention logits.

``config.layer_types`` picks each layer's attention: ``'hybrid_sliding'`` (a window of
``sliding_window_size`` keys, the ``swa_*`` head counts) or ``'hybrid'`` (global, the plain head
counts, optional log scaling of the logits)::

    h = rms_norm(embed(ids))                                   (the normed embedding)
    layer i:  h = h + sconv_attn(attention(input_layernorm(h)))
              h = h + sconv_mlp(mlp(post_attention_layernorm(h)))
    logits = lm_head(norm(h) / logits_mup_width_multiplier)    (columns >= unpadded_vocab_size: -inf)

    sconv(x) = x + conv(x)          depthwise causal conv of width conv_kernel_size, no bias, no
                                    activation, in float32 (weights and state float32)
    attention: q = q_norm(q_proj h) per head,  k = k_norm(sconv_k(k_proj h)),  v = sconv_v(v_proj h)
               r = r_proj h   [T, heads, d_rel]
               score(p, j) = tau(p) (q_p . k_j / head_dim + bias_h(p, p - j)),  j visible to p
               bias_h(p, d) = (r_p,h @ proj)[d]  for 0 <= d < E, else 0
                 E = sliding_window_size on sliding layers, rel_extent on global ones
               tau(p) = 1 + log_scaling_alpha * log(max(1, (p + 1) / log_scaling_n_floor))
                 on global layers when log_scaling_n_floor is set, else 1
    mlp:  'dense'  SwiGLU(intermediate_size) * global_scale
          'sparse' top-k routed SwiGLU experts + n_shared_experts shared ones, weighted together:
                   z = x W_gate^T (float32, E routed + S shared logits), choose k routed by
                   sigmoid(z) + e_score_correction_bias; weights of the k chosen and the S shared
                   = sigmoid(z) / sum of them, times route_scale * global_scale

On CUDA the registry's ``relative_bias_attention`` runs the attention: the Triton window attention
kernel with the bias as an additive input (``kernels/window_attention_triton.py``, streaming the
keys with an online softmax). Elsewhere this file's torch path does
(:func:`relative_bias_attention`). A decode step (one new token per sequence) is batched
(:func:`single_query_attention`): every sequence's visible keys are gathered from the paged cache in
order of distance into one padded ``[seqs, keys, kv_heads, head_dim]`` block, so the bias is the
same ``E`` columns of ``rel @ proj`` for every sequence, then one masked softmax (key tiles merged
online past :data:`GATHER_BUDGET`). A prefill chunk goes per sequence and per tile of queries
(:func:`tiled_attention`: at most :data:`QUERY_TILE`, fewer when ``heads x tile x keys`` would pass
:data:`SCORE_BUDGET`): it gathers the visible keys, computes the float32 scores and adds the bias
over the keys within ``E`` tokens of some query of the tile (a gather from ``[tile, heads, E]``).
Its cost against the fused kernels: the whole score block in memory (no flash-style streaming), a
padded key block as long as the batch's longest history on global layers at decode, one Python
iteration per prefilling sequence and an ``E``-wide product per query and head for the bias. The
algorithm is ``transformers``' (``InklingRelativeLogits`` added to the eager attention's logits,
``models/inkling/modeling_inkling.py``), computed over paged blocks.

Caches, two entries per layer ``i`` (as Falcon-H1's): ``2 i`` the paged K/V (a
:class:`SlidingWindowSpec` with ``sliding_window_size`` for a sliding layer, a
:class:`FullAttentionSpec` for a global one, so a prefix keeps every block), ``2 i + 1`` the four
conv states of the layer's short convolutions (:func:`conv_state_spec`), float32 as
``transformers`` keeps them::

    state entry 2i+1   k_conv [kv_heads*head_dim, K-1] | v_conv [same] | attn_conv [hidden, K-1] | mlp_conv [same]

Tensor parallelism (``parallel_plan``): attention by head (:func:`attention_split`; sliding and
global layers split their own counts, and their K/V and k/v conv states carry their own range
names), the dense MLP by intermediate rows (:func:`dense_mlp_split`); routers, experts, the
residual convs after the row-parallel sums and the norms are replicated.

Weight names: the published checkpoint's (``model.llm.*``: ``attn.wq_du`` / ``wk_dv`` / ``wv_dv`` /
``wr_du`` / ``wo_ud``, ``attn_norm`` / ``mlp_norm``, ``mlp.gate.bias``, ``w13`` tensors whose gate and
up rows interleave, ``unembed``), as ``transformers``' conversion mapping for ``inkling_mm_model``
renames them, and ``transformers``' in-memory names (``model.language_model.*`` or ``model.*``,
``k_sconv.conv1d.weight``, fused ``mlp.experts.gate_up_proj``, or one tensor per expert). The
vision and audio towers and the MTP layers (``model.mtp.*``) are not loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_specs import CacheTensor, FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec, StateSpec
from ..kernels import find_kernel, get_kernel
from ..kernels.attention import fill_kv_cache
from ..kernels.linear import linear
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.moe import FusedExperts, load_expert_tensor
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import Linear, RMSNorm, WeightLoader
from .parallel_plan import Axis, Block, BlockSplit, ParallelPlan, Piece, cols, rows

__all__ = ['InklingForCausalLM', 'InklingForConditionalGeneration', 'check_config', 'conv_state_spec',
           'relative_bias_attention', 'single_query_attention', 'tiled_attention', 'QUERY_TILE', 'SCORE_BUDGET',
           'GATHER_BUDGET']

SLIDING, GLOBAL = 'hybrid_sliding', 'hybrid'
DENSE, SPARSE = 'dense', 'sparse'
QUERY_TILE = 256          # most query rows per score block (prefill)
SCORE_BUDGET = 1 << 24    # float32 scores per block ([heads, tile, keys], 64 MiB): long contexts take fewer rows
GATHER_BUDGET = 1 << 24   # float32 key elements gathered at once by a decode step ([seqs, keys, kv_heads, head_dim])
# the four conv states of a layer, in the order of its state entry (transformers' conv_idx 0-3)
CONV_NAMES = ('k_conv', 'v_conv', 'attn_conv', 'mlp_conv')


def _attn_dims(config, sliding: bool) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` of a sliding or global layer."""
    if sliding:
        return config.swa_num_attention_heads, config.swa_num_key_value_heads, config.swa_head_dim
    return config.num_attention_heads, config.num_key_value_heads, config.head_dim


def _positive_int(config, name: str) -> None:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'{name} must be an int >= 1, got {value!r}')


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly (reads the text config of
    a multimodal one).

    Raises:
        ValueError: naming the field: ``layer_types`` (``'hybrid_sliding'`` or ``'hybrid'`` per
            layer), ``mlp_layer_types`` (``'dense'`` or ``'sparse'`` per layer),
            ``sliding_window_size`` / ``rel_extent`` / ``d_rel`` / ``conv_kernel_size`` (ints >= 1;
            the conv at least 2 wide), ``num_key_value_heads`` / ``swa_num_key_value_heads``
            (must divide the layer's query heads), ``hidden_act`` (``'silu'`` only),
            ``num_experts_per_tok`` (1 .. ``n_routed_experts``), ``n_shared_experts`` (>= 1 with a
            sparse layer: the router's last logits are theirs), ``log_scaling_n_floor`` (None or
            an int >= 1), ``unpadded_vocab_size`` (None or 1 .. ``vocab_size``).
    """
    text = config.get_text_config()
    n = text.num_hidden_layers
    types = list(getattr(text, 'layer_types', None) or [])
    if len(types) != n or any(t not in (SLIDING, GLOBAL) for t in types):
        raise ValueError(f'layer_types must list {SLIDING!r} or {GLOBAL!r} for each of the {n} layers, got {types}')
    mlp_types = list(getattr(text, 'mlp_layer_types', None) or [])
    if len(mlp_types) != n or any(t not in (DENSE, SPARSE) for t in mlp_types):
        raise ValueError(f'mlp_layer_types must list {DENSE!r} or {SPARSE!r} for each of the {n} layers, '
                         f'got {mlp_types}')
    for name in ('sliding_window_size', 'rel_extent', 'd_rel', 'conv_kernel_size'):
        _positive_int(text, name)
    if text.conv_kernel_size < 2:
        raise ValueError(f'conv_kernel_size must be at least 2 (a width-1 conv keeps no state), '
                         f'got {text.conv_kernel_size}')
    for sliding, field in ((True, 'swa_num_key_value_heads'), (False, 'num_key_value_heads')):
        if (SLIDING if sliding else GLOBAL) in types:
            heads, kv_heads, _ = _attn_dims(text, sliding)
            if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
                raise ValueError(f'{field} ({kv_heads}) must divide the query heads ({heads})')
    if text.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {text.hidden_act!r}")
    if SPARSE in mlp_types:
        if not 1 <= text.num_experts_per_tok <= text.n_routed_experts:
            raise ValueError(f'num_experts_per_tok must be in 1..n_routed_experts ({text.n_routed_experts}), '
                             f'got {text.num_experts_per_tok}')
        if text.n_shared_experts < 1:
            raise ValueError(f'n_shared_experts must be >= 1 (the router splits its logits at -n_shared_experts), '
                             f'got {text.n_shared_experts}')
    floor = text.log_scaling_n_floor
    if floor is not None and (not isinstance(floor, int) or isinstance(floor, bool) or floor < 1):
        raise ValueError(f'log_scaling_n_floor must be None or an int >= 1, got {floor!r}')
    unpadded = text.unpadded_vocab_size
    if unpadded is not None and not 1 <= unpadded <= text.vocab_size:
        raise ValueError(f'unpadded_vocab_size must be None or in 1..vocab_size ({text.vocab_size}), got {unpadded}')


# CacheTensor.tp_split names: each attention kind has its own head counts, so its own ranges
KV_SPLIT = {False: 'kv_heads', True: 'inkling_swa_kv_heads'}                   # K / V: KV heads
KV_CONV_SPLIT = {False: 'inkling_kv_channels', True: 'inkling_swa_kv_channels'}  # k/v conv states: their channels


@dataclass(frozen=True)
class InklingWindowSpec(SlidingWindowSpec):
    """A sliding layer's K/V (:class:`SlidingWindowSpec`), split under tensor parallelism by the
    sliding layers' own KV heads (``swa_num_key_value_heads``, range name ``KV_SPLIT[True]``)."""

    def tensors(self) -> tuple[CacheTensor, ...]:
        shape, split = (self.num_kv_heads, self.head_dim), KV_SPLIT[True]
        return CacheTensor('k', shape, self.dtype, split), CacheTensor('v', shape, self.dtype, split)


def conv_state_spec(config, sliding: bool) -> StateSpec:
    """The four short-conv states of one layer (float32, the last ``conv_kernel_size - 1``
    inputs of each conv): ``k_conv`` and ``v_conv`` ``[kv_heads * head_dim, K - 1]`` of the
    layer's attention kind (split with its KV heads under tensor parallelism), ``attn_conv`` and
    ``mlp_conv`` ``[hidden_size, K - 1]`` (whole on every rank: they run after the row-parallel
    sums)."""
    _, kv_heads, head_dim = _attn_dims(config, sliding)
    K = config.conv_kernel_size
    kv, hidden = (kv_heads * head_dim, K - 1), (config.hidden_size, K - 1)
    split = KV_CONV_SPLIT[sliding]
    return StateSpec(tuple(CacheTensor(name, shape, torch.float32, tp)
                           for name, shape, tp in zip(CONV_NAMES, (kv, kv, hidden, hidden), (split, split, None, None))))


def attention_split(sliding: bool):
    """The tensor-parallel split of a sliding (``swa_*`` counts) or global attention block, as a
    split factory: by head, like grouped-query attention: ``q_proj`` rows and ``r_proj`` rows
    (``d_rel`` per head) by query head, ``k_proj`` / ``v_proj`` rows and the ``k_sconv`` /
    ``v_sconv`` filters by KV head (fewer KV heads than ranks are shared), ``o_proj`` columns
    (row-parallel); the norms and ``rel_logits_proj`` whole. Published spellings
    (``wq_du`` ...) too. Local config: the kind's two head counts."""
    prefix = 'swa_' if sliding else ''
    q, kv = f'{prefix}q_heads', f'{prefix}kv_heads'

    def split(config, size: int) -> BlockSplit:
        heads, kv_heads, d = _attn_dims(config, sliding)
        q_field = 'swa_num_attention_heads' if sliding else 'num_attention_heads'
        kv_field = 'swa_num_key_value_heads' if sliding else 'num_key_value_heads'
        axes = (Axis(q, heads, q_field, q_field), Axis(kv, kv_heads, kv_field, kv_field, shared=True))
        tensors = (rows(('q_proj', 'wq_du'), Piece(q, d)), rows(('r_proj', 'wr_du'), Piece(q, config.d_rel)),
                   rows(('k_proj', 'v_proj', 'wk_dv', 'wv_dv', 'k_sconv', 'v_sconv'), Piece(kv, d)),
                   cols(('o_proj.weight', 'wo_ud.weight'), Piece(q, d)))
        caches = ((KV_SPLIT[sliding], (Piece(kv),)), (KV_CONV_SPLIT[sliding], (Piece(kv, d),)))
        return BlockSplit(axes, tensors, row_parallel=('o_proj',), caches=caches)

    return split


def dense_mlp_split(config, size: int) -> BlockSplit:
    """The dense MLP's split (a split factory): intermediate rows of ``gate_proj`` / ``up_proj``
    (the published ``w13_dn``, gate and up rows interleaved: the rank's rows of both are one
    contiguous run of twice the count), columns of ``down_proj`` / ``w2_md`` (row-parallel);
    ``global_scale`` whole (it scales the summed output)."""
    n = config.intermediate_size
    a = Axis('intermediate', n, 'intermediate_size', 'intermediate_size')
    tensors = (rows(('gate_proj', 'up_proj'), Piece(a.name)), rows('w13_dn', Piece(a.name, 2)),
               cols(('down_proj.weight', 'w2_md.weight'), Piece(a.name)))
    return BlockSplit((a,), tensors, row_parallel=('down_proj',))


class _Float32(nn.Module):
    """A module whose own parameters named in ``float32_params`` stay float32 whatever dtype the
    model is cast to (``transformers``' ``_keep_in_fp32_modules_strict``: the short convs, the
    router's scale and correction bias)."""
    float32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in self.float32_params:
            p = getattr(self, name)
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self


class ShortConvResidual(_Float32):
    """``x + conv(x)`` in float32: a depthwise causal conv (width ``kernel``, no bias, no
    activation) continuing each sequence's state (``transformers``' ``InklingShortConvolution``).

    Args:
        channels: conv channels.
        kernel: ``conv_kernel_size``.
        entry: index into ``StepContext.state_caches`` (the layer's state entry).
        index: which of the entry's four tensors is this conv's state (:data:`CONV_NAMES`).
    """
    float32_params = ('weight',)

    def __init__(self, channels: int, kernel: int, entry: int, index: int):
        super().__init__()
        self.entry, self.index = entry, index
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))   # the checkpoint's conv1d weight

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, channels]`` → ``[T, channels]`` in ``x.dtype``; rewrites the sequences' states."""
        xf = x.float()
        state = ctx.state_caches[self.entry][self.index]
        y = get_kernel('causal_conv1d_varlen', x.device)(
            xf, self.weight.squeeze(1), None, state, ctx.cu_seqlens, ctx.seq_ids, ctx.slots, ctx.has_history, None,
            slot_span=ctx.slot_span)
        return (y.float() + xf).to(x.dtype)


def relative_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: torch.Tensor,
                            proj: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
                            scale: float, window: int | None, tau: torch.Tensor | None) -> torch.Tensor:
    """Store the new K/V in the paged cache, then causal attention with Inkling's relative
    logits: ``softmax_j(tau_p (q_p . k_j * scale + bias(p, p - j)))`` over the visible keys
    ``j`` (``p - window < j <= p``, or ``j <= p`` without a window), in float32.

    The sequences of the step with one new token (decode) are attended all at once
    (:func:`single_query_attention`); those with more (prefill chunks) per sequence in query
    tiles (:func:`tiled_attention`).

    Args:
        q: ``[T, heads, head_dim]`` queries of the flat batch (normed).
        k, v: ``[T, kv_heads, head_dim]`` new keys / values; query head ``h`` reads KV head
            ``h // (heads / kv_heads)``.
        rel: ``[T, heads, d_rel]`` relative states (``r_proj`` of the layer input).
        proj: ``[d_rel, E]`` the bias profiles; ``bias(p, d) = rel_p @ proj[:, d]`` for
            ``0 <= d < E``, 0 beyond (distances in tokens).
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
        ctx: the step's layout; every sequence's blocks cover ``kv_seqlens`` (blocks wholly
            before its window are not read).
        scale: the logit scale (``1 / head_dim`` for Inkling's normed q / k).
        window: keys per query (itself included), or None.
        tau: ``[T]`` float32 multipliers of each query's logits and bias, or None.

    Returns:
        ``[T, heads, head_dim]`` in ``q.dtype``.
    """
    ctx = ctx.paged_group(window)      # a sliding layer's own block tables when its group has a pool
    fill_kv_cache(k, v, k_cache, v_cache, ctx)
    if all(n == 1 for n in ctx.q_seqlens):                     # a decode step: every row its own sequence
        return single_query_attention(q, rel, proj, k_cache, v_cache, ctx.block_table, ctx.kv_positions,
                                      max(ctx.kv_seqlens), scale, window, tau)
    out = torch.empty_like(q)
    single = [i for i, n in enumerate(ctx.q_seqlens) if n == 1]
    if single:                                                  # decodes riding along with prefill chunks
        rows = torch.tensor([ctx.q_start_loc[i] for i in single], dtype=torch.long, device=q.device)
        table = ctx.block_table[torch.tensor(single, dtype=torch.long, device=q.device)]
        out[rows] = single_query_attention(q[rows], rel[rows], proj, k_cache, v_cache, table, ctx.kv_positions[rows],
                                           max(ctx.kv_seqlens[i] for i in single), scale, window,
                                           None if tau is None else tau[rows])
    tiled_attention(q, rel, proj, k_cache, v_cache, ctx, scale, window, tau, out,
                    [i for i, n in enumerate(ctx.q_seqlens) if n > 1])
    return out


def single_query_attention(q: torch.Tensor, rel: torch.Tensor, proj: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                           max_keys: int, scale: float, window: int | None,
                           tau: torch.Tensor | None) -> torch.Tensor:
    """Relative-logits attention of ``N`` sequences with one query each, batched: no Python
    work per sequence (the cache already holds every key, the query's own included).

    The keys are gathered in order of distance, column ``j`` holding position ``p - j`` of each
    sequence, into a padded ``[N, keys, kv_heads, head_dim]`` block (``keys`` up to ``window``,
    or to the longest history on a global layer): the bias is then the same columns
    ``profile[..., :E]`` for every sequence (``profile = rel @ proj``, no gather), and columns
    past a sequence's own keys are masked (they read the query's own position, written and so
    finite: an unwritten cache entry may hold NaN, and NaN survives masking). At most
    :data:`GATHER_BUDGET` float32 key elements are gathered at once: longer histories go in
    tiles of distances whose softmax is merged online (the running maximum and sum of
    Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018).

    Args:
        q: ``[N, heads, head_dim]``.
        rel: ``[N, heads, d_rel]``.
        proj: ``[d_rel, E]`` (see :func:`relative_bias_attention`).
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_table: int64 ``[N, max_blocks]``, row ``i`` the blocks of sequence ``i`` (covering
            its window at least).
        positions: int64 ``[N]`` each query's cache position (its sequence's keys are
            ``0 .. positions[i]``).
        max_keys: ``max(positions) + 1`` (tokens), read on the host so that no device value is.
        scale, window: as :func:`relative_bias_attention`.
        tau: ``[N]`` float32 logit multipliers, or None.

    Returns:
        ``[N, heads, head_dim]`` in ``q.dtype``.
    """
    N, H, D = q.shape
    Hkv, B, E = k_cache.shape[2], k_cache.shape[1], proj.shape[1]
    G = H // Hkv
    keys_max = max_keys if window is None else min(max_keys, window)
    tile = max(1, min(keys_max, GATHER_BUDGET // max(1, N * Hkv * D)))
    qf = q.float().view(N, Hkv, G, D)
    profile = (rel.float() @ proj.float()).view(N, Hkv, G, E)                   # bias of distance d: column d
    pos = positions.view(N, 1)
    scale_rows = None if tau is None else tau.float().view(N, 1, 1, 1)
    m = s = acc = None
    for d0 in range(0, keys_max, tile):
        d1 = min(d0 + tile, keys_max)
        key_pos = pos - torch.arange(d0, d1, device=q.device)                      # [N, K]
        visible = key_pos >= 0              # the window is within keys_max: distances < window
        key_pos = torch.where(visible, key_pos, pos)
        blocks, offsets = block_table.gather(1, key_pos // B), key_pos % B
        keys, values = k_cache[blocks, offsets].float(), v_cache[blocks, offsets].float()   # [N, K, Hkv, D]
        scores = torch.einsum('nhgd,nkhd->nhgk', qf, keys) * scale                 # [N, Hkv, G, K]
        if d0 < E:
            scores[..., :min(E, d1) - d0] += profile[..., d0:min(E, d1)]
        if scale_rows is not None:
            scores = scores * scale_rows
        scores = scores.masked_fill(~visible[:, None, None, :], float('-inf'))
        if d0 == 0 and d1 == keys_max:      # one tile: the plain softmax
            return torch.einsum('nhgk,nkhd->nhgd', scores.softmax(-1), values).reshape(N, H, D).to(q.dtype)
        # the first tile holds distance 0 (always visible), so the running maximum is finite from it on
        m_new = scores.amax(-1) if m is None else torch.maximum(m, scores.amax(-1))
        p = torch.exp(scores - m_new[..., None])
        o = torch.einsum('nhgk,nkhd->nhgd', p, values)
        if m is None:
            s, acc = p.sum(-1), o
        else:
            alpha = torch.exp(m - m_new)
            s, acc = s * alpha + p.sum(-1), acc * alpha[..., None] + o
        m = m_new
    return (acc / s[..., None]).reshape(N, H, D).to(q.dtype)


def tiled_attention(q: torch.Tensor, rel: torch.Tensor, proj: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, ctx: StepContext, scale: float, window: int | None,
                    tau: torch.Tensor | None, out: torch.Tensor, seqs: list[int]) -> None:
    """Relative-logits attention of the sequences ``seqs`` of ``ctx``, per sequence and per tile
    of queries (at most :data:`QUERY_TILE` rows, fewer when ``heads x tile x keys`` would pass
    :data:`SCORE_BUDGET`), written into their rows of ``out``. The keys are already in the
    cache, addressed by ``ctx.block_tables``; arguments as :func:`relative_bias_attention`'s.
    Any sequence may be given (one query too: the reference the tests hold
    :func:`single_query_attention` to)."""
    T, H, D = q.shape
    Hkv, B, E = k_cache.shape[2], ctx.block_size, proj.shape[1]
    G = H // Hkv
    projf = proj.float()
    kv_seqlens, q_seqlens = ctx.kv_seqlens, ctx.q_seqlens
    for i in seqs:
        n = q_seqlens[i]
        hist, first = kv_seqlens[i] - n, ctx.q_start_loc[i]
        table = ctx.block_tables[i].to(q.device)
        # query rows per score block: at most QUERY_TILE, fewer when the keys are many
        keys_max = hist + n if window is None else window + QUERY_TILE
        tile = max(1, min(QUERY_TILE, SCORE_BUDGET // (H * keys_max)))
        for start in range(0, n, tile):
            end = min(start + tile, n)
            rows = slice(first + start, first + end)
            L = end - start
            lo, hi = (0 if window is None else max(0, hist + start - window + 1)), hist + end
            b0 = lo // B
            blocks = table[b0:-(-hi // B)]
            keys = k_cache[blocks].flatten(0, 1)[lo - b0 * B:hi - b0 * B].float().transpose(0, 1)    # [Hkv, K, D]
            values = v_cache[blocks].flatten(0, 1)[lo - b0 * B:hi - b0 * B].float().transpose(0, 1)
            qt = q[rows].float().view(L, Hkv, G, D).permute(1, 2, 0, 3)                               # [Hkv, G, L, D]
            dist = (torch.arange(hist + start, hist + end, device=q.device)[:, None]
                    - torch.arange(lo, hi, device=q.device)[None, :])                                 # [L, K]
            scores = torch.einsum('hgld,hkd->hglk', qt, keys) * scale                                 # [Hkv, G, L, K]
            # the bias is zero past E tokens back: build it only over the keys [near, hi) some query reaches
            near = max(lo, hist + start - E + 1)
            d = dist[:, near - lo:]
            profile = rel[rows].float() @ projf                                                       # [L, H, E]
            bias = profile.gather(-1, d.clamp(0, E - 1)[:, None, :].expand(L, H, -1))                 # [L, H, K']
            bias = bias.masked_fill(((d < 0) | (d >= E))[:, None, :], 0.0)
            scores[..., near - lo:] += bias.permute(1, 0, 2).view(Hkv, G, L, -1)
            if tau is not None:
                scores = scores * tau[rows].float().view(1, 1, L, 1)
            visible = dist >= 0
            if window is not None:
                visible &= dist < window
            scores = scores.masked_fill(~visible, float('-inf'))
            o = torch.einsum('hglk,hkd->hgld', scores.softmax(-1), values)
            out[rows] = o.permute(2, 0, 1, 3).reshape(L, H, D).to(q.dtype)


class InklingAttention(nn.Module):
    """Sliding or global attention of one layer: per-head q/k RMSNorm, short convs on K and V,
    the relative-logits bias (``rel_logits_proj.proj [d_rel, E]``) and, on global layers, the
    optional log scaling of the logits; K/V in the paged cache.

    Args:
        config: the text config.
        layer_idx: the decoder layer (its cache entries are ``2 layer_idx`` and ``+ 1``).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        sliding = config.layer_types[layer_idx] == SLIDING
        self.entry = 2 * layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = _attn_dims(config, sliding)
        self.window = config.sliding_window_size if sliding else None
        extent = config.sliding_window_size if sliding else config.rel_extent
        self.log_floor = None if sliding else config.log_scaling_n_floor
        self.log_alpha = config.log_scaling_alpha
        H, kv, hidden = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, config.hidden_size
        self.q_proj = Linear(hidden, H, bias=False)
        self.k_proj = Linear(hidden, kv, bias=False)
        self.v_proj = Linear(hidden, kv, bias=False)
        self.r_proj = Linear(hidden, self.num_heads * config.d_rel, bias=False)
        self.o_proj = Linear(H, hidden, bias=False)
        self.k_sconv = ShortConvResidual(kv, config.conv_kernel_size, self.entry + 1, 0)
        self.v_sconv = ShortConvResidual(kv, config.conv_kernel_size, self.entry + 1, 1)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rel_logits_proj = nn.Module()
        self.rel_logits_proj.proj = nn.Parameter(torch.zeros(config.d_rel, extent))
        self.scale = 1.0 / self.head_dim      # q and k are RMS-normed per head: 1/d, not 1/sqrt(d)

    def log_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """``[T]`` float32 ``tau`` of each query position (see the module docstring), or None
        when the layer does not scale."""
        if self.log_floor is None:
            return None
        ratio = ((positions + 1).float() / self.log_floor).clamp(min=1.0)
        return 1.0 + self.log_alpha * torch.log(ratio)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; writes this layer's K/V and K/V conv states."""
        T = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_sconv(self.k_proj(hidden), ctx).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_sconv(self.v_proj(hidden), ctx).view(T, self.num_kv_heads, self.head_dim)
        rel = self.r_proj(hidden).view(T, self.num_heads, -1)
        k_cache, v_cache = ctx.kv_caches[self.entry]
        attend = find_kernel('relative_bias_attention', q.device) or relative_bias_attention   # Triton on CUDA
        out = attend(q, k, v, rel, self.rel_logits_proj.proj, k_cache, v_cache, ctx, self.scale, self.window,
                     self.log_scale(ctx.positions))
        return self.o_proj(out.reshape(T, -1))


class InklingMLP(nn.Module):
    """The dense MLP: ``SwiGLU(x) * global_scale``."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) * self.global_scale


class InklingRouter(_Float32):
    """The router of a sparse layer, in float32: ``weight [E + S, hidden]`` (routed rows, then
    the shared experts' rows; the model dtype, read as float32), ``global_scale [1]`` and
    ``e_score_correction_bias [E]`` (float32)."""
    float32_params = ('global_scale', 'e_score_correction_bias')

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_shared, self.route_scale = (config.num_experts_per_tok, config.n_shared_experts,
                                                         config.route_scale)
        E = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(E + self.num_shared, config.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` → ``(routed weights [T, k], routed expert index [T, k] int64, shared
        weights [T, S])``, weights in float32 (see the module docstring: the routed and shared
        weights share one normalisation)."""
        logits = linear(x.float(), self.weight.float())
        routed, shared = logits[:, :-self.num_shared], logits[:, -self.num_shared:]
        index = torch.topk(routed.sigmoid() + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        chosen = F.logsigmoid(torch.cat([routed.gather(-1, index), shared], dim=-1))
        weights = torch.softmax(chosen, dim=-1) * (self.route_scale * self.global_scale)
        return weights[:, :self.top_k], index, weights[:, self.top_k:]


class InklingSharedExperts(nn.Module):
    """``n_shared_experts`` SwiGLU experts, each weighted by its router weight:
    ``gate_proj`` / ``up_proj [S, I, hidden]``, ``down_proj [S, hidden, I]``."""

    def __init__(self, config):
        super().__init__()
        S, I, H = config.n_shared_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_proj = nn.Parameter(torch.zeros(S, I, H))
        self.up_proj = nn.Parameter(torch.zeros(S, I, H))
        self.down_proj = nn.Parameter(torch.zeros(S, H, I))

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, ``gammas [T, S]`` → ``[T, hidden]`` (the experts summed in float32)."""
        gate = torch.einsum('th,sih->sti', x, self.gate_proj)
        up = torch.einsum('th,sih->sti', x, self.up_proj)
        act = F.silu(gate) * up * gammas.to(x.dtype).t()[..., None]
        return torch.einsum('sti,shi->sth', act, self.down_proj).float().sum(0).to(x.dtype)


class InklingMoE(nn.Module):
    """A sparse layer's MLP: routed experts (:class:`FusedExperts`) plus the shared ones."""

    def __init__(self, config):
        super().__init__()
        self.gate = InklingRouter(config)
        self.experts = FusedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = InklingSharedExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        weights, index, gammas = self.gate(x)
        return self.experts(x, index, weights.to(x.dtype)) + self.shared_experts(x, gammas)


class InklingDecoderLayer(nn.Module):
    """Attention then the MLP, each followed by its residual short conv."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = InklingAttention(config, layer_idx)
        self.mlp = InklingMoE(config) if config.mlp_layer_types[layer_idx] == SPARSE else InklingMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        entry = 2 * layer_idx + 1
        self.attn_sconv = ShortConvResidual(config.hidden_size, config.conv_kernel_size, entry, 2)
        self.mlp_sconv = ShortConvResidual(config.hidden_size, config.conv_kernel_size, entry, 3)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        hidden = hidden + self.attn_sconv(self.self_attn(self.input_layernorm(hidden), ctx), ctx)
        return hidden + self.mlp_sconv(self.mlp(self.post_attention_layernorm(hidden)), ctx)


class InklingModel(nn.Module):
    """The normed embedding, the decoder layers and the final norm."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # a sibling of embed_tokens (checkpoints: embed_tokens.embed_norm), which tensor parallelism
        # replaces with its vocabulary-parallel embedding
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(InklingDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat tokens."""
        hidden = self.embed_norm(self.embed_tokens(ctx.input_ids))
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        return self.norm(hidden)


_TOWERS = ('model.vision_tower.', 'model.audio_tower.', 'model.multi_modal_projector.', 'model.audio.',
           'model.visual.', 'model.mtp.')
# the published checkpoint's names -> ours (the renames transformers' conversion mapping for
# inkling_mm_model applies at load, read from its source; the w13 tensors are split by load_tensor)
_PUBLISHED = [(re.compile(p), r) for p, r in (
    (r'^model\.llm\.embed\.weight$', 'model.embed_tokens.weight'),
    (r'^model\.llm\.embed_norm\.weight$', 'model.embed_norm.weight'),
    (r'^model\.embed_tokens\.embed_norm\.', 'model.embed_norm.'),
    (r'^model\.llm\.unembed\.weight$', 'lm_head.weight'),
    (r'^model\.llm\.', 'model.'),
    (r'\.attn\.wq_du\.', '.self_attn.q_proj.'),
    (r'\.attn\.wk_dv\.', '.self_attn.k_proj.'),
    (r'\.attn\.wv_dv\.', '.self_attn.v_proj.'),
    (r'\.attn\.wr_du\.', '.self_attn.r_proj.'),
    (r'\.attn\.wo_ud\.', '.self_attn.o_proj.'),
    (r'\.attn\.(q_norm|k_norm|k_sconv|v_sconv|rel_logits_proj)\.', r'.self_attn.\1.'),
    (r'\.attn_norm\.', '.input_layernorm.'),
    (r'\.mlp_norm\.', '.post_attention_layernorm.'),
    (r'\.mlp\.gate\.bias$', '.mlp.gate.e_score_correction_bias'),
    (r'\.mlp\.w2_md\.weight$', '.mlp.down_proj.weight'),
    (r'\.mlp\.experts\.w2_weight$', '.mlp.experts.down_proj'),
    (r'\.mlp\.shared_experts\.shared_w2_weight$', '.mlp.shared_experts.down_proj'),
)]
# published w13 tensors: gate and up rows interleaved (gate 0, up 0, gate 1, up 1, ...) along
# this axis; -> (our gate parameter, our up parameter), or one fused [gate | up] parameter
_W13 = {'.mlp.w13_dn.weight': (0, ('.mlp.gate_proj.weight', '.mlp.up_proj.weight')),
        '.mlp.experts.w13_weight': (1, ('.mlp.experts.gate_up_proj',)),
        '.mlp.shared_experts.shared_w13_weight': (1, ('.mlp.shared_experts.gate_proj', '.mlp.shared_experts.up_proj'))}


def load_interleaved_w13(loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """Copy a published ``w13`` tensor (gate and up rows interleaved along one axis) into our
    gate / up parameters, or the fused ``gate_up_proj`` (gate rows first); False for any other name.

    Raises:
        KeyError: no matching parameter.
        ValueError: a shape mismatch.
    """
    suffix = next((k for k in _W13 if name.endswith(k)), None)
    if suffix is None:
        return False
    axis, targets = _W13[suffix]
    prefix = name[:-len(suffix)]
    index = [slice(None)] * tensor.dim()
    index[axis] = slice(0, None, 2)
    gate = tensor[tuple(index)]
    index[axis] = slice(1, None, 2)
    up = tensor[tuple(index)]
    if len(targets) == 1:
        loader.load(prefix + targets[0], torch.cat([gate, up], dim=axis))
    else:
        loader.load(prefix + targets[0], gate)
        loader.load(prefix + targets[1], up)
    return True


class InklingForCausalLM(CausalLM):
    """``inkling_text`` causal LM in the engine's layers.

    Args:
        config: a ``transformers`` ``InklingTextConfig`` (or, for the subclass, ``InklingConfig``).

    Raises:
        ValueError: see :func:`check_config`.
    """
    # sliding, global, sliding, global: a 40-token window (off the 16-token blocks and the 32-token
    # prefill chunks), a 48-token bias extent on global layers and log scaling from position 32, so
    # 150- and 700-token prompts reach past both; sliding and global layers with other head counts
    # and head dims; a dense first layer then sparse ones (8 experts, top 2, 2 shared)
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, layer_types=[SLIDING, GLOBAL, SLIDING, GLOBAL],
                       mlp_layer_types=[DENSE, SPARSE, SPARSE, SPARSE], num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=8,
                       sliding_window_size=40, d_rel=4, rel_extent=48, log_scaling_n_floor=32,
                       log_scaling_alpha=0.1, conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32,
                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, route_scale=2.5,
                       logits_mup_width_multiplier=4.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
    # transformers reads inkling_text experts fused (gate_up_proj / down_proj), with no per-expert conversion
    tiny_expert_prefixes = ()

    # every config field transformers reads (the whole modeling file, towers included), and what
    # the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'rope_parameters': INERT,                 # no rotary embedding: never read
        'max_position_embeddings': INERT,         # no position table: only a context-length hint
        'attention_bias': INERT,                  # not read: every projection is bias-free
        'layer_types': CHECKED,                   # 'hybrid_sliding' / 'hybrid' per layer
        'mlp_layer_types': CHECKED,               # 'dense' / 'sparse' per layer
        'swa_num_attention_heads': IMPLEMENTED,
        'swa_num_key_value_heads': CHECKED,       # divides swa_num_attention_heads
        'swa_head_dim': IMPLEMENTED,
        'num_key_value_heads': CHECKED,           # divides num_attention_heads
        'sliding_window_size': CHECKED,           # an int >= 1: the window and the sliding layers' bias extent
        'sconv_kernel_size': IMPLEMENTED,         # transformers' alias of conv_kernel_size
        'conv_kernel_size': CHECKED,              # >= 2
        'd_rel': CHECKED,                         # >= 1
        'rel_extent': CHECKED,                    # >= 1: the global layers' bias extent
        'log_scaling_n_floor': CHECKED,           # None or an int >= 1
        'log_scaling_alpha': IMPLEMENTED,
        'moe_intermediate_size': IMPLEMENTED,
        'n_routed_experts': IMPLEMENTED,
        'num_experts_per_tok': CHECKED,           # 1 .. n_routed_experts
        'n_shared_experts': CHECKED,              # >= 1 with a sparse layer
        'route_scale': IMPLEMENTED,
        'logits_mup_width_multiplier': IMPLEMENTED,
        'unpadded_vocab_size': CHECKED,           # None or <= vocab_size: logits past it are -inf
        # the multimodal wrapper and its towers: images and audio are refused, the towers never run
        'get_text_config': INERT, 'text_config': INERT, 'vision_config': INERT, 'audio_config': INERT,
        'image_token_id': INERT, 'audio_token_id': INERT, 'codebook_size': INERT, 'mel_vocab_size': INERT,
        'n_mel_bins': INERT, 'num_codebooks': INERT, 'num_channels': INERT, 'patch_size': INERT,
        'temporal_patch_size': INERT, 'text_hidden_size': INERT,
    }
    rotary_class = None   # no rotary embedding: positions enter through the relative bias only
    check_config = staticmethod(check_config)
    model_class = InklingModel
    # attention by head (each kind its own counts), the dense MLP by intermediate rows; the routers,
    # routed and shared experts, the residual short convs and every norm replicated
    parallel_plan = ParallelPlan(
        layers=lambda config: [(kind, mlp) for kind, mlp in zip(config.layer_types, config.mlp_layer_types)],
        blocks={SLIDING: (Block(attention_split(True), ('self_attn', 'attn')),),
                GLOBAL: (Block(attention_split(False), ('self_attn', 'attn')),),
                DENSE: (Block(dense_mlp_split, 'mlp'),), SPARSE: ()},
        renames=(('model.llm.embed.', 'model.embed_tokens.'), ('model.llm.unembed.', 'lm_head.'),
                 ('model.llm.', 'model.'), ('model.language_model.', 'model.')))

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Two entries per layer ``i``: ``2 i`` an :class:`InklingWindowSpec` (a :class:`SlidingWindowSpec`)
        (``swa_num_key_value_heads x swa_head_dim`` per token, window ``sliding_window_size``) or
        a :class:`FullAttentionSpec` (``num_key_value_heads x head_dim``), K/V in ``dtype``; ``2 i + 1``
        the layer's four float32 conv states (:func:`conv_state_spec`).

        Raises:
            ValueError: see :func:`check_config`.
        """
        text = config.get_text_config()
        specs: list[LayerCacheSpec] = []
        for kind in text.layer_types:
            sliding = kind == SLIDING
            _, kv_heads, head_dim = _attn_dims(text, sliding)
            specs.append(InklingWindowSpec(kv_heads, head_dim, dtype, text.sliding_window_size) if sliding
                         else FullAttentionSpec(kv_heads, head_dim, dtype))
            specs.append(conv_state_spec(text, sliding))
        return specs

    def __init__(self, config):
        super().__init__(config)
        text = config.get_text_config()
        self.mup = float(text.logits_mup_width_multiplier)
        self.unpadded_vocab_size = text.unpadded_vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` → ``[N, vocab_size]`` float32 logits of ``hidden / logits_mup_width_multiplier``;
        the columns from ``unpadded_vocab_size`` on (padding rows ``transformers`` drops) are -inf,
        so no sampler picks them and the softmax over the rest is ``transformers``'."""
        logits = self.lm_head(hidden / self.mup).float()
        if self.unpadded_vocab_size is not None:
            logits[:, self.unpadded_vocab_size:] = float('-inf')
        return logits

    @property
    def tie_word_embeddings(self) -> bool:
        """Never tied: ``transformers`` declares no tied weights for Inkling."""
        return False

    def rename_weight(self, name: str) -> str | None:
        """Published or ``transformers`` names → ours (see the module docstring); the towers and
        the MTP layers are dropped; a conv's ``.conv1d.weight`` is the module's ``weight``."""
        if name.startswith(_TOWERS):
            return None
        if name.startswith('model.language_model.'):
            name = 'model.' + name[len('model.language_model.'):]
        for pattern, repl in _PUBLISHED:
            name = pattern.sub(repl, name)
        return name.replace('_sconv.conv1d.weight', '_sconv.weight')

    def load_tensor(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
        """The published interleaved ``w13`` tensors (:func:`load_interleaved_w13`) and per-expert
        tensors (:func:`load_expert_tensor`)."""
        return load_interleaved_w13(loader, name, tensor) or load_expert_tensor(loader, name, tensor)


class InklingForConditionalGeneration(InklingForCausalLM):
    """``inkling_mm_model``: the text model of the multimodal checkpoint (``text_config``); its
    text tensors load into the text stack (published ``model.llm.*`` or ``transformers``'
    ``model.language_model.*``), the vision and audio towers are dropped; ``supports_images``
    stays False, so the engine refuses a request with image data (a ``RequestError`` naming
    ``multimodal``), and it has no audio input at all."""
