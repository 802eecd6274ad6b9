"""The Mamba-1 token mixer (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective
State Spaces", 2023), shared by Mamba, FalconMamba and Jamba: the layer, its cached state, and
its tensor-parallel split.

One layer, per token (``D = d_inner`` channels, state size ``N``, ``R = dt_rank``)::

    in_proj(h)  = [ x (D) | z (D) ]
    x           = silu(causal_conv1d(x))          conv state: the last K - 1 inputs [D, K - 1]
    x_proj(x)   = [ dt_low (R) | B (N) | C (N) ]
    (FalconMamba: dt_low, B, C each RMS-normalised, no weight, eps = mixer_rms_eps;
     Jamba: the same norms with a weight each, dt_layernorm / b_layernorm / c_layernorm)
    dt          = softplus(dt_proj.weight @ dt_low + dt_proj.bias)     [D]
    y           = selective_scan(x, dt, A = -exp(A_log) [D, N], B, C) + D_skip * x
                                                  SSM state [D, N] float32
    out         = out_proj(y * silu(z))

Both states live in the engine's per-sequence state slots (:func:`mamba1_state_spec`): the conv
state in the activation dtype, the SSM state in float32 (it accumulates over the whole sequence).
The kernels come from the registry (``causal_conv1d_varlen``, ``selective_scan_varlen``), so the
layer never looks at the device.

Parameter names are the checkpoints' (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
``A_log``, ``D``, ``out_proj``; Jamba's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``).
Under tensor parallelism (:func:`mamba1_split`) a rank holds ``D / size`` channels: its rows of
``in_proj`` (``x`` and ``z``), ``conv1d``, ``dt_proj``, ``A_log``, ``D``; its columns of ``x_proj``
and ``out_proj``, both row-parallel (summed over ranks): ``dt_low``, ``B`` and ``C`` mix every
channel, so every rank gets the full sum before the dt / B / C norms and ``dt_proj``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...cache_specs import CacheTensor, StateSpec
from ...kernels import get_kernel
from ...kernels.linear import linear
from ...model_inputs import StepContext
from ..layers import Linear, RMSNorm
from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows

__all__ = ['Mamba1Dims', 'Mamba1Mixer', 'mamba1_split', 'mamba1_state_spec', 'CHANNEL_SPLIT']

# CacheTensor.tp_split name of both state tensors (the rank's channel range: mamba1_split)
CHANNEL_SPLIT = 'mamba1_channels'


@dataclass(frozen=True)
class Mamba1Dims:
    """The sizes and constants of one Mamba-1 mixer (each family maps its config fields here).

    Attributes:
        hidden_size: model width.
        d_inner: ``D``, the mixer's channels (``expand * hidden_size``).
        state_size: ``N``.
        dt_rank: ``R``, the width of the low-rank ``dt`` projection.
        conv_kernel: ``K`` of the depthwise causal conv.
        conv_bias, proj_bias: the conv has a bias; ``in_proj`` / ``out_proj`` have biases.
        bcdt_norm_eps: None (Mamba), or the epsilon of the RMS norms of ``dt_low``, ``B`` and
            ``C`` (FalconMamba, Jamba).
        bcdt_norm_weight: those norms have a weight each (Jamba; FalconMamba's have none).
        chunk_size: tokens per scan chunk (a speed knob; the outputs do not depend on it).
    """
    hidden_size: int
    d_inner: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    bcdt_norm_eps: float | None = None
    bcdt_norm_weight: bool = False
    chunk_size: int = 16

    def __post_init__(self):
        if self.conv_kernel < 2:
            raise ValueError(f'conv_kernel must be at least 2, got {self.conv_kernel}')
        if self.dt_rank <= 0:
            raise ValueError(f'time_step_rank must be positive, got {self.dt_rank}')

    def local(self, size: int) -> 'Mamba1Dims':
        """This rank's dims at TP size ``size`` (channels divided evenly)."""
        return dataclasses.replace(self, d_inner=self.d_inner // size)


def mamba1_state_spec(dims: Mamba1Dims, dtype: torch.dtype) -> StateSpec:
    """A Mamba-1 layer's per-sequence state: ``conv [d_inner, K - 1]`` in ``dtype`` and
    ``ssm [d_inner, state_size]`` float32, both split by the rank's channels."""
    return StateSpec((CacheTensor('conv', (dims.d_inner, dims.conv_kernel - 1), dtype, CHANNEL_SPLIT, 0),
                      CacheTensor('ssm', (dims.d_inner, dims.state_size), torch.float32, CHANNEL_SPLIT, 0)))


def _weightless_rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    """FalconMamba's norm of ``dt_low`` / ``B`` / ``C``: ``t * rsqrt(mean(t^2) + eps)`` over the
    last axis in float32, back in ``t.dtype``; no weight."""
    f = t.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)


class Mamba1Mixer(nn.Module):
    """The Mamba-1 mixer over the step's flat tokens (see the module docstring).

    Args:
        dims: its sizes (this rank's, under tensor parallelism).
        layer_idx: index into ``StepContext.state_caches`` (``(conv, ssm)``).
    """

    def __init__(self, dims: Mamba1Dims, layer_idx: int):
        super().__init__()
        self.dims, self.layer_idx = dims, layer_idx
        d = dims
        self.in_proj = Linear(d.hidden_size, 2 * d.d_inner, bias=d.proj_bias)
        # weight holder [D, 1, K] (the checkpoint shape); the conv kernel runs it
        self.conv1d = nn.Conv1d(d.d_inner, d.d_inner, d.conv_kernel, groups=d.d_inner, bias=d.conv_bias)
        self.x_proj = Linear(d.d_inner, d.dt_rank + 2 * d.state_size, bias=False)
        self.dt_proj = Linear(d.dt_rank, d.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d.d_inner, d.state_size))
        self.D = nn.Parameter(torch.ones(d.d_inner))
        self.out_proj = Linear(d.d_inner, d.hidden_size, bias=d.proj_bias)
        if d.bcdt_norm_eps is not None and d.bcdt_norm_weight:
            self.dt_layernorm = RMSNorm(d.dt_rank, d.bcdt_norm_eps)
            self.b_layernorm = RMSNorm(d.state_size, d.bcdt_norm_eps)
            self.c_layernorm = RMSNorm(d.state_size, d.bcdt_norm_eps)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        d = self.dims
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        conv_cache, ssm_cache = ctx.state_caches[self.layer_idx]
        x = get_kernel('causal_conv1d_varlen', hidden.device)(
            x.contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_cache, ctx.cu_seqlens, ctx.seq_ids,
            ctx.slots, ctx.has_history, 'silu', slot_span=ctx.slot_span)
        dt, B, C = self.x_proj(x).split([d.dt_rank, d.state_size, d.state_size], dim=-1)
        if d.bcdt_norm_weight:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif d.bcdt_norm_eps is not None:
            dt, B, C = (_weightless_rms(t, d.bcdt_norm_eps) for t in (dt, B, C))
        # the bias is added in float32 with the softplus (where transformers adds it)
        dt = F.softplus(linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        A = -torch.exp(self.A_log.float())
        y = get_kernel('selective_scan_varlen', hidden.device)(
            x, dt, A, B, C, self.D, ssm_cache, ctx.cu_seqlens, ctx.slots, ctx.has_history, d.chunk_size,
            slot_span=ctx.slot_span)
        return self.out_proj((y * F.silu(z.float())).to(hidden.dtype))


def mamba1_split(dims_of, field: str = 'intermediate_size'):
    """The tensor-parallel split of a Mamba-1 layer, as a split factory: a rank holds channels
    ``[c0, c1)`` of ``D / size`` (axis ``mamba_channels``).

    ``in_proj`` rows of its ``x`` and ``z`` channels; ``conv1d``, ``dt_proj`` (weight and bias),
    ``A_log``, ``D`` rows of its channels; ``x_proj`` and ``out_proj`` weight columns (both
    row-parallel); ``out_proj.bias`` and Jamba's ``dt_layernorm`` / ``b_layernorm`` /
    ``c_layernorm`` whole. Both state tensors hold its channels (:data:`CHANNEL_SPLIT`); the local
    config sets ``mamba_tp_size`` (``dims_of`` divides by it).

    Args:
        dims_of: ``config -> Mamba1Dims`` of the full model (the family's dims reader).
        field: the config field (or expression) of ``D`` named by errors.
    """

    def split(config, size: int) -> BlockSplit:
        D = dims_of(config).d_inner
        c = Piece('mamba_channels')
        return BlockSplit((Axis('mamba_channels', D, field, why='a rank holds whole Mamba channels'),),
                          (rows('in_proj', c, Piece('mamba_channels', 1, D)),
                           rows(('conv1d', 'dt_proj', 'A_log', 'D'), c),
                           cols(('x_proj.weight', 'out_proj.weight'), c)),
                          row_parallel=('x_proj', 'out_proj'), caches=((CHANNEL_SPLIT, (c,)),),
                          config=(('mamba_tp_size', size),))

    return split
