"""Kimi Delta Attention (KDA, Kimi Linear, 2025): the per-channel-decay gated delta rule that
Kimi-Linear and GLM-5.3-Flash use as their recurrent token mixer, its per-sequence state, and
how tensor parallelism splits it (by head).

Per layer and sequence the state slot holds::

    q_conv, k_conv, v_conv  [H, d, kernel - 1]   (dtype)    the three depthwise convs' inputs
    recurrent               [H, d, d]            (float32)  the delta-rule state

all four split by head under tensor parallelism (``tp_split='v_heads'``).

A float32 CPU decode step whose slots are one sorted range with history runs everything between
the projections' products (the convs, gates, delta rule and gated norm) as one call: the
registry's ``kda_decode`` (native when built, see :mod:`~lmdeploy.pytorch.kernels.fused_recurrent`)
on views of the packed projection's output and of the state rows; the low-rank gates' second
products (``f_b_proj``, ``g_b_proj``) stay products before it. Every other step, and every other
device, runs the unfused path.
"""
from __future__ import annotations

import torch
from torch import nn

from ...cache_specs import CacheTensor, LayerCacheSpec, PagedSpec, StateSpec
from ...kernels import find_kernel, get_kernel
from ...model_inputs import StepContext, fused_state_rows
from ..layers import Linear, PackedLinear, WeightLoader
from ..parallel_plan import Axis, BlockSplit, Piece, TensorSplit, cols, rows

__all__ = ['KimiDeltaAttention', 'SigmoidGatedRMSNorm', 'kda_split', 'kda_state_spec', 'kda_mla_cache_specs',
           'load_kda_tensor']


def kda_state_spec(config, dtype: torch.dtype) -> StateSpec:
    """The state of one KDA layer (see the module docstring) for a config with
    ``linear_num_heads`` (H), ``linear_head_dim`` (d) and ``linear_conv_kernel_dim``."""
    H, d, K = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    return StateSpec(tuple(CacheTensor(name, (H, d, K - 1), dtype, 'v_heads') for name in
                           ('q_conv', 'k_conv', 'v_conv')) +
                     (CacheTensor('recurrent', (H, d, d), torch.float32, 'v_heads'),))


def kda_mla_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
    """Per layer of a KDA + MLA stack (Kimi-Linear, Ling 3; ``layer_types`` entries
    ``'linear_attention'`` / ``'full_attention'``): the KDA state (:func:`kda_state_spec`) or the
    MLA :class:`PagedSpec` of one ``latent [kv_lora_rank + qk_rope_head_dim]`` row per token in
    ``dtype``, the same on every rank (``tp_split=None``)."""
    kda = kda_state_spec(config, dtype)
    mla = PagedSpec((CacheTensor('latent', (config.kv_lora_rank + config.qk_rope_head_dim,), dtype, None),))
    return [kda if t == 'linear_attention' else mla for t in config.layer_types]


def load_kda_tensor(loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """Load a KDA tensor whose checkpoint layout is not the layer's: ``transformers``' stacked
    ``self_attn.conv1d.weight`` (q | k | v convs, split into ``q_conv1d`` / ``k_conv1d`` /
    ``v_conv1d``) and a one-dimensional ``self_attn.A_log [H]`` (the layer's is ``[1, 1, H, 1]``).

    Returns:
        True when ``name`` was one of those (and is loaded), else False.
    """
    if name.endswith('.self_attn.conv1d.weight'):
        stem = name[:-len('conv1d.weight')]
        for part, piece in zip('qkv', tensor.chunk(3, dim=0)):
            loader.load(f'{stem}{part}_conv1d.weight', piece)
        return True
    if name.endswith('.self_attn.A_log') and tensor.dim() == 1:
        loader.load(name, tensor.reshape(1, 1, -1, 1))
        return True
    return False


class SigmoidGatedRMSNorm(nn.Module):
    """``w * RMSNorm(x) * sigmoid(z)`` per head, in float32 (the KDA output gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x, z [..., dim]`` → ``[..., dim]`` in ``x.dtype``."""
        h = x.float()
        h = self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(z.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer (Kimi Linear, 2025): per-channel-decay gated delta rule.

    ``q, k, v = silu(conv_x(x_proj(h)))`` (three depthwise causal convs, each with its own
    state); decay ``g = -exp(A_log[h]) * softplus(f_b(f_a(h)) + dt_bias)`` per channel
    ``[T, H, d]``; ``beta = sigmoid(b_proj(h))``; output ``o_proj(norm(o) * sigmoid(g_b(g_a(h))))``.
    The six projections of the input run as one packed matmul.

    With ``gate_lower_bound = b`` (GLM-5.3-Flash's "safe gate") the decay is instead
    ``g = b * sigmoid(exp(A_log[h]) * (f_b(f_a(h)) + dt_bias))``, so each step's log-decay lies in
    ``(b, 0)``. With ``low_rank_gates=False`` (Ling 3) the two gates are one full-rank
    projection each, ``f_proj`` and ``g_proj`` (``hidden -> H * d``), in place of ``f_b(f_a(.))``
    and ``g_b(g_a(.))``.

    Args:
        config: HF ``KimiLinearConfig`` (or any config with the ``linear_*`` fields).
        layer_idx: index into ``StepContext.state_caches`` (``(q_conv, k_conv, v_conv, recurrent)``).
        gate_lower_bound: None for Kimi-Linear's softplus decay, else the bound ``b < 0``.
        low_rank_gates: the forget and output gates are rank-``d`` products (Kimi, GLM) or
            full-rank projections (Ling 3).
    """

    def __init__(self, config, layer_idx: int, gate_lower_bound: float | None = None, low_rank_gates: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_lower_bound = gate_lower_bound
        self.num_heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        D, hidden, K = self.num_heads * self.head_dim, config.hidden_size, config.linear_conv_kernel_dim
        self.dim = D
        gates = {'f_a_proj': self.head_dim, 'b_proj': self.num_heads, 'g_a_proj': self.head_dim} if low_rank_gates \
            else {'f_proj': D, 'b_proj': self.num_heads, 'g_proj': D}
        self.in_proj = PackedLinear(hidden, {'q_proj': D, 'k_proj': D, 'v_proj': D, **gates})
        # weight holders [D, 1, K] (the checkpoint shape); the conv kernel runs them
        self.q_conv1d = nn.Conv1d(D, D, K, groups=D, bias=False)
        self.k_conv1d = nn.Conv1d(D, D, K, groups=D, bias=False)
        self.v_conv1d = nn.Conv1d(D, D, K, groups=D, bias=False)
        # identity for full-rank gates: their in_proj slices already are the gate inputs
        self.f_b_proj = Linear(self.head_dim, D, bias=False) if low_rank_gates else nn.Identity()
        self.g_b_proj = Linear(self.head_dim, D, bias=False) if low_rank_gates else nn.Identity()
        self.dt_bias = nn.Parameter(torch.zeros(D))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(D, hidden, bias=False)

    def _fused_decode(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """The decode step by the registry's ``kda_decode`` on the slice of the state caches the
        step's slots span, or ``None`` (not a float32 pure decode step over one sorted slot range
        with history, or no such kernel for the device)."""
        caches = ctx.state_caches[self.layer_idx]
        rows = fused_state_rows(ctx, hidden, caches[0])
        fused = find_kernel('kda_decode', hidden.device)
        if rows is None or fused is None:
            return None
        proj = self.in_proj(hidden)
        D = self.dim
        _, _, _, fa, b, ga = proj.split(self.in_proj.shard_sizes, dim=-1)
        return self.o_proj(fused(proj[:, :3 * D], self.f_b_proj(fa), b, self.g_b_proj(ga),
                                 tuple(c.weight.squeeze(1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)),
                                 tuple(c[rows].flatten(1, 2) for c in caches[:3]), self.A_log.view(-1),
                                 self.dt_bias, self.gate_lower_bound, caches[3][rows], self.o_norm.weight,
                                 self.o_norm.eps))

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        fused = self._fused_decode(hidden, ctx)
        if fused is not None:
            return fused
        T, H, d = hidden.shape[0], self.num_heads, self.head_dim
        q, k, v, fa, b, ga = self.in_proj.forward_split(hidden)
        caches = ctx.state_caches[self.layer_idx]
        conv = get_kernel('causal_conv1d_varlen', hidden.device)
        mixed = []
        for x, layer, cache in zip((q, k, v), (self.q_conv1d, self.k_conv1d, self.v_conv1d), caches[:3]):
            mixed.append(conv(x, layer.weight.squeeze(1), None, cache.flatten(1, 2), ctx.cu_seqlens, ctx.seq_ids,
                              ctx.slots, ctx.has_history, 'silu', slot_span=ctx.slot_span).reshape(T, H, d))
        g = (self.f_b_proj(fa).float() + self.dt_bias.float()).view(T, H, d)
        if self.gate_lower_bound is None:
            g = -self.A_log.float().view(H, 1).exp() * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        else:
            g = self.gate_lower_bound * torch.sigmoid(self.A_log.float().view(H, 1).exp() * g)
        beta = torch.sigmoid(b)
        o = get_kernel('kda_varlen', hidden.device)(*mixed, g, beta, caches[3], ctx.cu_seqlens, ctx.slots,
                                                    ctx.has_history, use_qk_l2norm=True, slot_span=ctx.slot_span)
        return self.o_proj(self.o_norm(o, self.g_b_proj(ga).view(T, H, d)).reshape(T, -1))


def kda_split(*, a_log_dim: int = 2, full_rank_gates: bool = False, o: str | tuple[str, ...] = 'o_proj'):
    """The tensor-parallel split of a KDA layer (Megatron-style, by head), as a split factory.

    Axis ``kda_heads`` (``linear_num_heads``, set to the rank's count in the local config).
    ``q/k/v_proj``, their convs, ``f_b_proj``, ``g_b_proj`` (or, with ``full_rank_gates``, the
    full-rank ``f_proj`` / ``g_proj``; under ``forget_gate.`` in transformers' names) and
    ``dt_bias`` rows of the rank's heads, ``conv1d`` (transformers' stacked q | k | v) in three
    pieces, ``b_proj`` rows and ``A_log`` entries of its heads, ``o_proj`` columns
    (row-parallel); ``f_a_proj`` / ``g_a_proj`` (rank ``head_dim``) whole. Its four state
    tensors hold the rank's heads (``tp_split='v_heads'``).

    Args:
        a_log_dim: the head dimension of the checkpoint's ``A_log`` (transformers' / the
            published Kimi-Linear ``[1, 1, H, 1]``: 2; GLM-5.3-Flash's and Ling 3's ``[H]``: 0).
        full_rank_gates: the layer's gates are ``f_proj`` / ``g_proj`` (``hidden -> H * d``,
            Ling 3; ``KimiDeltaAttention(low_rank_gates=False)``).
        o: the checkpoint name(s) of the output projection (Ling 3's published ``dense``); the
            module is ``o_proj`` whatever the spelling.
    """
    o_names = (o,) if isinstance(o, str) else tuple(o)
    gates = ('f_proj', 'g_proj') if full_rank_gates else ('f_b_proj', 'g_b_proj')

    def split(config, size: int) -> BlockSplit:
        d, D = config.linear_head_dim, config.linear_num_heads * config.linear_head_dim

        def names(*parts):
            return tuple(f'{g}{p}.weight' for p in parts for g in ('', 'forget_gate.'))

        h = Piece('kda_heads', d)
        return BlockSplit(
            (Axis('kda_heads', config.linear_num_heads, 'linear_num_heads', 'linear_num_heads'),),
            (rows(names('q_proj', 'k_proj', 'v_proj', 'q_conv1d', 'k_conv1d', 'v_conv1d', *gates)
                  + ('dt_bias', 'forget_gate.dt_bias'), h),
             rows(names('conv1d'), *(Piece('kda_heads', d, i * D) for i in range(3))),
             rows(names('b_proj'), Piece('kda_heads')),
             TensorSplit(('A_log', 'forget_gate.A_log'), a_log_dim, (Piece('kda_heads'),)),
             cols(names(*o_names), h)),
            row_parallel=('o_proj',), caches=(('v_heads', (Piece('kda_heads'),)),))

    return split
