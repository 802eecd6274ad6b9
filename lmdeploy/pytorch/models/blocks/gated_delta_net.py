"""Gated DeltaNet (Yang et al., "Gated Delta Networks", 2024) as Qwen3-Next and Qwen3.5 run
it, and what a stack of Gated DeltaNet and full-attention layers shares: the layer-type names,
the config checks and the cache spec of each layer::

    linear_attention layer: conv state [conv_dim, kernel - 1] (dtype) + recurrent state
                            [num_v_heads, k_head_dim, v_head_dim] (float32), one slot per sequence
    full_attention layer:   K/V per token in paged blocks

Tensor parallelism (:func:`gdn_split`): heads split by *key* head. Key head ``k`` serves value
heads ``[k*r, (k+1)*r)`` (``r = Hv / Hk``), so a rank's value heads, its slice of the recurrent
state ``[Hv/N, dk, dv]`` and its conv channels follow from its key heads. :data:`HYBRID_BLOCKS`
composes the Qwen hybrids' layers (gated attention, Gated DeltaNet, dense MLP, replicated MoE).

Invariant: a sequence with ``history_len == 0`` starts from a zero state whatever its slot
holds; after a forward the slot holds the state after exactly ``kv_seqlen`` tokens.

A float32 CPU decode step whose slots are one sorted range with history runs everything between
the two projections as one call (the registry's CPU ``gdn_decode``, native when built, see
:mod:`~lmdeploy.pytorch.kernels.fused_decode`):
the per-layer torch glue (splits, gates, casts, the conv, delta and norm calls) costs more than
the arithmetic at batch 1. It reads the packed projection in place through a column map that
:meth:`GatedDeltaNet._split_projections` itself defines (so a variant's packing needs no code
here). Any other float32 CPU step whose sequences have at most ``GDN_VARLEN_TOKENS`` (8192)
rows (a prompt's chunk, alone or beside decodes) runs the same step arithmetic row after row per
sequence in one native call (``gdn_varlen``): for a short prompt the sixty-odd torch ops of the
conv and the chunked delta rule per layer cost more than the recurrence itself, and on the
benchmark host the row-by-row pass beats the chunked form at 2048 rows too. Longer chunks, and
every other device, run the unfused path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...cache_specs import FullAttentionSpec, LayerCacheSpec, LinearAttentionSpec
from ...kernels import find_kernel, get_kernel
from ...kernels.fused_decode import GDN_VARLEN_TOKENS
from ...model_inputs import StepContext, fused_state_rows
from ..layers import Linear, PackedLinear, mlp_split
from ..parallel_plan import Axis, Block, BlockSplit, Piece, cols, rows
from .attention import QKNormAttention, attention_head_dim
from .decoder import DecoderLayer
from .gqa import gqa_split

__all__ = ['LINEAR', 'FULL', 'GatedDeltaNet', 'FlatGatedDeltaNet', 'GatedRMSNorm', 'HybridDecoderLayer',
           'attention_head_dim', 'check_hybrid_config', 'gdn_state_spec', 'hybrid_cache_specs', 'gdn_split',
           'hybrid_layer_kinds', 'HYBRID_BLOCKS', 'DENSE', 'MOE', 'TINY_GATED_DELTANET']

#: the Gated DeltaNet + attention stack of the Qwen3-Next / Qwen3.5 tiny configs: three Gated
#: DeltaNet layers (2 key heads, 4 value heads of 16) and one attention layer
TINY_GATED_DELTANET = dict(num_hidden_layers=4, full_attention_interval=4, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_conv_kernel_dim=4)

LINEAR, FULL = 'linear_attention', 'full_attention'
DENSE, MOE = 'dense', 'moe'      # a layer's MLP kind (ParallelPlan layer kinds)


def gdn_split(config, size: int) -> BlockSplit:
    """The tensor-parallel split of a Gated DeltaNet layer (a split factory; see the module
    docstring): axes ``k_heads`` (``linear_num_key_heads``) and ``v_heads``
    (``linear_num_value_heads``), both set to the rank's count in the local config.

    Qwen3-Next groups ``in_proj_qkvz`` / ``in_proj_ba`` per key head (one contiguous range);
    Qwen3.5's flat ``in_proj_qkv`` is ``[q all | k all | v all]`` like the conv channels (three
    ranges), ``in_proj_z`` ``[Hv * dv]`` and ``in_proj_b`` / ``in_proj_a`` ``[Hv]`` follow the
    value heads; Lara-4-Mini's ``in_proj`` fuses those four, rows ``[q | k | v | z | b | a]``
    (``conv_dim + Hv*dv + 2*Hv``), so a rank reads the same rows of each part (six ranges);
    OLMo Hybrid keeps six separate projections (``q_proj`` / ``k_proj`` by key head, ``v_proj`` /
    ``g_proj`` / ``b_proj`` / ``a_proj`` by value head), its published conv filters as
    ``{q,k,v}_conv1d`` (by key, key and value head) and its output projection as ``o_proj``;
    ``dt_bias`` / ``A_log`` by value head; ``out_proj`` columns (row-parallel). Cache splits:
    ``v_heads`` (recurrent state) and ``conv_channels`` (the q | k | v pieces).
    """
    dk, dv, hk = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_num_key_heads
    hv = config.linear_num_value_heads
    r, key_dim = hv // hk, hk * dk
    channels = (Piece('k_heads', dk), Piece('k_heads', dk, key_dim), Piece('v_heads', dv, 2 * key_dim))
    z0 = 2 * key_dim + hv * dv            # the fused in_proj's z rows start after q | k | v (conv_dim)
    b0 = z0 + hv * dv
    fused = channels + (Piece('v_heads', dv, z0), Piece('v_heads', 1, b0), Piece('v_heads', 1, b0 + hv))
    return BlockSplit(
        (Axis('k_heads', hk, 'linear_num_key_heads', 'linear_num_key_heads'),
         Axis('v_heads', hv, 'linear_num_value_heads', 'linear_num_value_heads')),
        (rows('in_proj_qkvz.weight', Piece('k_heads', 2 * dk + 2 * r * dv)),
         rows('in_proj_ba.weight', Piece('k_heads', 2 * r)),
         rows(('conv1d.weight', 'in_proj_qkv.weight'), *channels),
         rows('in_proj_z.weight', Piece('v_heads', dv)),
         rows('in_proj.weight', *fused),
         rows(('q_proj.weight', 'k_proj.weight', 'q_conv1d.weight', 'k_conv1d.weight'), Piece('k_heads', dk)),
         rows(('v_proj.weight', 'g_proj.weight', 'v_conv1d.weight'), Piece('v_heads', dv)),
         rows(('dt_bias', 'A_log', 'in_proj_b.weight', 'in_proj_a.weight', 'b_proj.weight', 'a_proj.weight'),
              Piece('v_heads')),
         cols(('out_proj.weight', 'o_proj.weight'), Piece('v_heads', dv))),
        row_parallel=('out_proj',), caches=(('v_heads', (Piece('v_heads'),)), ('conv_channels', channels)))


def hybrid_layer_kinds(config, dense: bool) -> list[tuple[str, str]]:
    """Each layer's kinds for :data:`HYBRID_BLOCKS`: its ``layer_types`` entry and its MLP kind
    (``dense``: the dense MLPs split; else every MLP is replicated, as MoE)."""
    return [(t, DENSE if dense else MOE) for t in config.layer_types]


#: the Qwen hybrids' layer kinds -> blocks: gated attention by head, Gated DeltaNet by key head,
#: a dense MLP by intermediate rows, MoE (experts, router, shared expert) replicated
HYBRID_BLOCKS = {FULL: (Block(gqa_split(gated=True), 'self_attn'),), LINEAR: (Block(gdn_split, 'linear_attn'),),
                 DENSE: (Block(mlp_split(), 'mlp'),), MOE: ()}


def check_hybrid_config(config) -> None:
    """Reject a Gated DeltaNet + full-attention config (Qwen3-Next, Qwen3.5 text) this
    implementation cannot run exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``linear_num_value_heads``,
            ``hidden_act``; rope fields: see :mod:`..rope`).
    """
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != config.num_hidden_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f'layer_types must list {LINEAR!r} or {FULL!r} for each of the '
                         f'{config.num_hidden_layers} layers, got {types}')
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f'linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of '
                         f'linear_num_key_heads ({config.linear_num_key_heads})')
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")


class GatedRMSNorm(nn.Module):
    """``w * RMSNorm(x) * silu(z)`` per head; ``w`` is stored as is (initialised to ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x, z [..., dim]`` → ``[..., dim]`` in ``x.dtype`` (the registry's ``gated_rms_norm``:
        one native pass for float32 on CPU, see :mod:`~lmdeploy.pytorch.kernels.norm`)."""
        return get_kernel('gated_rms_norm', x.device)(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Yang et al., "Gated Delta Networks", 2024) as in Qwen3-Next.

    ``in_proj_qkvz`` output is grouped per key head: for each of ``Hk`` key heads it holds
    ``[q (dk) | k (dk) | v (r*dv) | z (r*dv)]`` with ``r = Hv / Hk`` value heads per key head;
    ``in_proj_ba`` likewise holds ``[b (r) | a (r)]`` per key head. q, k, v then pass a depthwise
    causal conv (SiLU) over the channels ``[q all heads | k all heads | v all heads]``; the
    delta rule runs with ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` and
    key head ``h // r`` serving value head ``h``; the output is ``out_proj(norm(o) * silu(z))``.

    Args:
        config: HF ``Qwen3NextConfig`` (or any config with the ``linear_*`` fields).
        layer_idx: index into ``StepContext.state_caches``.
    """

    #: beta = beta_scale * sigmoid(b); a variant sets 2.0 to let the recurrence have negative
    #: eigenvalues (OLMo Hybrid's ``linear_allow_neg_eigval``)
    beta_scale: float = 1.0

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.heads_per_key = self.num_v_heads // self.num_k_heads
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        # one matmul for the checkpoint's in_proj_qkvz and in_proj_ba
        self.in_proj = PackedLinear(hidden, {'in_proj_qkvz': 2 * self.key_dim + 2 * self.value_dim,
                                             'in_proj_ba': 2 * self.num_v_heads})
        # Only a weight holder ([conv_dim, 1, K], the checkpoint shape); the conv kernel runs it.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def _split_projections(self, hidden: torch.Tensor):
        """``[T, hidden]`` → mixed q|k|v ``[T, conv_dim]``, z ``[T, Hv, dv]``, b, a ``[T, Hv]``."""
        T, r = hidden.shape[0], self.heads_per_key
        qkvz, ba = self.in_proj.forward_split(hidden)
        qkvz = qkvz.reshape(T, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], -1)
        b, a = ba.reshape(T, self.num_k_heads, 2 * r).split([r, r], -1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return (mixed, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def decode_columns(self) -> torch.Tensor:
        """int64 ``[conv_dim + Hv*dv + 2*Hv]``: the column of ``in_proj``'s output that
        :meth:`_split_projections` puts at each conv channel, each ``z`` element, each ``b`` and
        each ``a``, found once by running it on a row of column numbers (cached; the split is a
        column permutation in every variant)."""
        cols = self.__dict__.get('_decode_cols')
        if cols is None:
            real = self.in_proj
            self._modules['in_proj'] = _ColumnNumbers(real.shard_sizes)
            try:
                parts = self._split_projections(torch.zeros(1, 0))
            finally:
                self._modules['in_proj'] = real
            cols = torch.cat([p.reshape(-1) for p in parts]).to(torch.int64)
            self.__dict__['_decode_cols'] = cols
        return cols

    def _fused_decode(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """The decode step by the registry's ``gdn_decode`` on the slice of the state caches the
        step's slots span, or ``None`` (not a float32 pure decode step over one sorted slot range
        with history, or no such kernel for the device)."""
        conv_cache, recurrent_cache = ctx.state_caches[self.layer_idx]
        rows = fused_state_rows(ctx, hidden, conv_cache)
        fused = find_kernel('gdn_decode', hidden.device)
        if rows is None or fused is None:
            return None
        return self.out_proj(fused(self.in_proj(hidden), self.decode_columns(), self.conv1d.weight.squeeze(1),
                                   conv_cache[rows], self.A_log, self.dt_bias, self.beta_scale,
                                   recurrent_cache[rows], self.norm.weight, self.norm.eps, self.num_k_heads))

    def _fused_varlen(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """A float32 step whose longest sequence has at most ``GDN_VARLEN_TOKENS`` rows (a
        prompt's chunk, alone or beside decodes) by the registry's ``gdn_varlen``: each
        sequence's rows through the decode step's arithmetic, in one call; ``None`` when it does
        not apply (longer chunks, another dtype or device, no such kernel)."""
        fused = find_kernel('gdn_varlen', hidden.device)
        if fused is None or hidden.dtype != torch.float32 or not ctx.q_seqlens \
                or max(ctx.q_seqlens) > GDN_VARLEN_TOKENS:
            return None
        conv_cache, recurrent_cache = ctx.state_caches[self.layer_idx]
        if conv_cache.dtype != torch.float32:
            return None
        fresh = ctx.kernel_memo.get('gdn_varlen.fresh')
        if fresh is None:   # once per step, shared by the layers
            fresh = (~ctx.has_history).to(torch.uint8)   # tensor ops: a decode graph can replay them
            ctx.kernel_memo['gdn_varlen.fresh'] = fresh
        out = fused(self.in_proj(hidden), self.decode_columns(), self.conv1d.weight.squeeze(1), conv_cache,
                    self.A_log, self.dt_bias, self.beta_scale, recurrent_cache, self.norm.weight, self.norm.eps,
                    self.num_k_heads, ctx.cu_seqlens, ctx.slots, fresh)
        return None if out is None else self.out_proj(out)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        fused = self._fused_decode(hidden, ctx)
        if fused is None:
            fused = self._fused_varlen(hidden, ctx)
        if fused is not None:
            return fused
        T = hidden.shape[0]
        mixed, z, b, a = self._split_projections(hidden)
        beta = b.sigmoid()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        if a.dtype == self.A_log.dtype == self.dt_bias.dtype == torch.float32:
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        else:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        conv_cache, recurrent_cache = ctx.state_caches[self.layer_idx]
        device = hidden.device
        # One call per kernel for all sequences; a fresh sequence (history 0) starts from zeros
        # inside the kernels, since its slot may hold another sequence's leftovers.
        y = get_kernel('causal_conv1d_varlen', device)(mixed, self.conv1d.weight.squeeze(1), None, conv_cache,
                                                         ctx.cu_seqlens, ctx.seq_ids, ctx.slots, ctx.has_history,
                                                         'silu', slot_span=ctx.slot_span)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        if self.heads_per_key > 1:
            q = q.repeat_interleave(self.heads_per_key, dim=1)
            k = k.repeat_interleave(self.heads_per_key, dim=1)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        out = get_kernel('gated_delta_rule_varlen', device)(q, k, v, g, beta, recurrent_cache, ctx.cu_seqlens,
                                                              ctx.slots, ctx.has_history, use_qk_l2norm=True,
                                                              slot_span=ctx.slot_span)
        return self.out_proj(self.norm(out, z).reshape(T, -1))


class FlatGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with flat projections (Qwen3.5, Lara-4-Mini): ``in_proj_qkv`` gives
    ``[q all heads | k all heads | v all heads]`` (the conv's channel order directly),
    ``in_proj_z`` ``[Hv * dv]``, ``in_proj_b`` and ``in_proj_a`` ``[Hv]`` each, packed into one
    matmul ``in_proj`` with rows ``[q | k | v | z | b | a]``: exactly a fused published
    ``in_proj.weight`` ``[2·Hk·dk + 2·Hv·dv + 2·Hv, hidden]``, which loads whole, while the four
    separate tensors fill its rows."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.in_proj = PackedLinear(config.hidden_size, {'in_proj_qkv': self.conv_dim, 'in_proj_z': self.value_dim,
                                                         'in_proj_b': self.num_v_heads,
                                                         'in_proj_a': self.num_v_heads})

    def _split_projections(self, hidden: torch.Tensor):
        """``[T, hidden]`` → mixed q|k|v ``[T, conv_dim]``, z ``[T, Hv, dv]``, b, a ``[T, Hv]``."""
        mixed, z, b, a = self.in_proj.forward_split(hidden)
        return mixed, z.reshape(hidden.shape[0], self.num_v_heads, self.head_v_dim), b, a


class _ColumnNumbers(nn.Module):
    """Stands in for a packed projection while :meth:`GatedDeltaNet.decode_columns` reads the
    split: its output row holds each column's own number (float64: exact up to 2**53)."""

    def __init__(self, shard_sizes: list[int]):
        super().__init__()
        self.shard_sizes = list(shard_sizes)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.arange(sum(self.shard_sizes), dtype=torch.float64)[None].split(self.shard_sizes, dim=-1)


def _gdn_or_attention(mixer: nn.Module, normed: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
    """Gated DeltaNet takes no positions; gated attention takes the step's ``(cos, sin)``."""
    if isinstance(mixer, GatedDeltaNet):
        return mixer(normed, ctx)
    cos, sin = rotary
    return mixer(normed, cos, sin, ctx)


class HybridDecoderLayer(DecoderLayer):
    """Pre-norm layer of a Gated DeltaNet + gated-attention stack (Qwen3-Next, Qwen3.5): the token
    mixer ``layer_types[layer_idx]`` picks (``linear_attn``: Gated DeltaNet, state in ``ctx``'s
    slots; or ``self_attn``: :class:`~.attention.QKNormAttention` with an output gate, KV in
    ``ctx``'s blocks), then ``mlp``, each with a residual; all norms zero-centred. Called as
    ``layer(hidden [T, hidden], (cos, sin), ctx)``.

    Args:
        config: the text config.
        layer_idx: the layer's index (into ``layer_types`` and the caches).
        mlp: the layer's MLP / MoE, ``[T, hidden]`` → ``[T, hidden]``.
        linear_attn_class: the Gated DeltaNet variant (its projections' layout).
    """

    def __init__(self, config, layer_idx: int, mlp: nn.Module, linear_attn_class: type = GatedDeltaNet):
        linear = config.layer_types[layer_idx] == LINEAR
        mixer = linear_attn_class(config, layer_idx) if linear else \
            QKNormAttention(config, layer_idx, output_gate=True, zero_centered_norm=True)
        super().__init__(config.hidden_size, config.rms_norm_eps, mixer, mlp, call=_gdn_or_attention,
                         names=('linear_attn' if linear else 'self_attn', 'mlp', 'input_layernorm',
                                'post_attention_layernorm'), zero_centered=True)
        self.layer_type = config.layer_types[layer_idx]


def hybrid_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
    """The cache spec of each layer of a Gated DeltaNet + full-attention stack (Qwen3-Next,
    Qwen3.5 text): conv ``[conv_dim, kernel-1]`` in ``dtype`` and float32 recurrent state
    ``[num_v_heads, k_head_dim, v_head_dim]`` per linear-attention layer, paged KV per
    full-attention layer. ``config`` is not checked here."""
    linear = gdn_state_spec(config, dtype)
    full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
    return [linear if t == LINEAR else full for t in config.layer_types]


def gdn_state_spec(config, dtype: torch.dtype) -> LinearAttentionSpec:
    """The state slot of one Gated DeltaNet layer: conv ``[2·Hk·dk + Hv·dv, kernel - 1]`` in
    ``dtype`` and the float32 recurrent state ``[Hv, dk, dv]`` (``linear_*`` config fields)."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + \
        config.linear_num_value_heads * config.linear_value_head_dim
    return LinearAttentionSpec(conv_shape=(conv_dim, config.linear_conv_kernel_dim - 1), conv_dtype=dtype,
                               recurrent_shape=(config.linear_num_value_heads, config.linear_key_head_dim,
                                                config.linear_value_head_dim))
