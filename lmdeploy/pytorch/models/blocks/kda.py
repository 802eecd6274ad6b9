"""Kimi Delta Attention (KDA, Kimi Linear, 2025): the per-channel-decay gated delta rule that
Kimi-Linear and GLM-5.3-Flash use as their recurrent token mixer, its per-sequence state, and
how tensor parallelism splits it (by head).

Per layer and sequence the state slot holds::

    q_conv, k_conv, v_conv  [H, d, kernel - 1]   (dtype)    the three depthwise convs' inputs
    recurrent               [H, d, d]            (float32)  the delta-rule state

all four split by head under tensor parallelism (``tp_split='v_heads'``).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ...cache_specs import CacheTensor, StateSpec
from ...kernels import get_kernel
from ...model_inputs import StepContext
from ..layers import Linear, PackedLinear

__all__ = ['KimiDeltaAttention', 'SigmoidGatedRMSNorm', 'KDATPSplit', 'kda_state_spec']


def kda_state_spec(config, dtype: torch.dtype) -> StateSpec:
    """The state of one KDA layer (see the module docstring) for a config with
    ``linear_num_heads`` (H), ``linear_head_dim`` (d) and ``linear_conv_kernel_dim``."""
    H, d, K = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    return StateSpec(tuple(CacheTensor(name, (H, d, K - 1), dtype, 'v_heads') for name in
                           ('q_conv', 'k_conv', 'v_conv')) +
                     (CacheTensor('recurrent', (H, d, d), torch.float32, 'v_heads'),))


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

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
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


_KDA_ROWS = re.compile(r'^model\.layers\.(\d+)\.self_attn\.(?:forget_gate\.)?'
                       r'(q_proj|k_proj|v_proj|q_conv1d|k_conv1d|v_conv1d|conv1d|f_b_proj|g_b_proj|f_proj|g_proj|'
                       r'b_proj|dt_bias|A_log|o_proj)(?:\.weight)?$')


class KDATPSplit:
    """How a stack of KDA layers and attention layers splits over ``size`` tensor-parallel
    ranks (Megatron-style); a family's plan derives from it and adds its attention rows.

    KDA: by head — ``q/k/v_proj``, their convs, ``f_b_proj``, ``g_b_proj`` (or the full-rank
    ``f_proj`` / ``g_proj``), ``dt_bias`` rows of the rank's heads, ``b_proj`` rows and ``A_log``
    entries of its heads (dimension :attr:`a_log_dim` of the checkpoint tensor), ``o_proj``
    columns (row-parallel, all-reduce); ``f_a_proj`` / ``g_a_proj`` (rank ``head_dim``) replicated. Its four state
    tensors hold the rank's heads (``tp_split='v_heads'``). The rank's query heads of the
    attention layers are :attr:`q_heads`.

    Args:
        config: the text config (``linear_num_heads``, ``linear_head_dim``,
            ``num_attention_heads``, ``layer_types``).
        rank, size: this rank and the tensor-parallel size.

    Raises:
        ValueError: ``tp`` does not divide ``linear_num_heads`` or ``num_attention_heads``.
    """

    row_parallel = (('self_attn', 'o_proj'),)
    a_log_dim = 2        # transformers' / the published Kimi-Linear A_log is [1, 1, H, 1]

    def __init__(self, config, rank: int, size: int):
        self.config, self.rank, self.size = config, rank, size
        for field in ('linear_num_heads', 'num_attention_heads'):
            if getattr(config, field) % size:
                raise ValueError(f'{field} ({getattr(config, field)}) must be divisible by tp ({size})')
        per = config.linear_num_heads // size
        self.heads = (rank * per, (rank + 1) * per)
        q_per = config.num_attention_heads // size
        self.q_heads = (rank * q_per, (rank + 1) * q_per)

    def cache_ranges(self, split: str) -> tuple[tuple[int, int], ...]:
        """The rank's KDA heads for ``'v_heads'`` (attention caches are not split).

        Raises:
            ValueError: another split name.
        """
        if split == 'v_heads':
            return (self.heads,)
        raise ValueError(f"CacheTensor.tp_split: a KDA model splits only 'v_heads', not {split!r}")

    def kda_shard(self, name: str):
        """``(dim, ranges)`` of a KDA layer's checkpoint tensor ``name`` this rank reads; None
        for a tensor that is not a KDA layer's split one."""
        c = self.config
        m = _KDA_ROWS.match(name)
        if not m or c.layer_types[int(m.group(1))] != 'linear_attention':
            return None
        part, d, D = m.group(2), c.linear_head_dim, c.linear_num_heads * c.linear_head_dim
        (h0, h1) = self.heads
        if part == 'conv1d':                # transformers stacks q | k | v
            return 0, tuple((i * D + h0 * d, i * D + h1 * d) for i in range(3))
        if part == 'b_proj':
            return 0, ((h0, h1),)
        if part == 'A_log':
            return self.a_log_dim, ((h0, h1),)
        if part == 'o_proj':
            return 1, ((h0 * d, h1 * d),)
        return 0, ((h0 * d, h1 * d),)
