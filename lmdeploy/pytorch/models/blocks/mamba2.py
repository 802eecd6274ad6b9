"""The Mamba-2 token mixer (Dao & Gu, "Transformers are SSMs", ICML 2024), shared by the Mamba-2
hybrids (Nemotron-H, Granite-4.0-H): the layer, its cached state, and its tensor-parallel split.

One layer, per token (``H`` heads of ``P`` channels, ``d_inner = H * P``, ``G`` groups of
state size ``Dn``)::

    in_proj(h) = [ z (d_inner) | x (d_inner) | B (G*Dn) | C (G*Dn) | dt (H) ]
    x, B, C    = silu(causal_conv1d(x | B | C))      conv state: the last K - 1 inputs
    dt         = clamp(softplus(dt + dt_bias), dt_min, dt_max)
    y          = SSD(x, dt, A = -exp(A_log), B, C) + D * x   SSM state [H, P, Dn] float32
    out        = out_proj(norm(y * silu(z)))   RMS norm over each of the G groups of d_inner / G

Both states live in the engine's per-sequence state slots (:func:`mamba2_state_spec`): the conv
state ``[conv_dim = d_inner + 2 G Dn, K - 1]`` in the activation dtype and the SSM state
``[H, P, Dn]`` in float32 (it accumulates over the whole sequence). The kernels come from the
registry (``causal_conv1d_varlen``, ``mamba2_ssd_varlen``, ``grouped_gated_rms_norm``), so the
layer never looks at the device. A float32 CPU decode step whose slots are one sorted range with
history runs everything between ``in_proj`` and ``out_proj`` as one call instead (the registry's
``mamba2_decode``, native when built, see :mod:`~lmdeploy.pytorch.kernels.fused_recurrent`),
unless the norm spans ranks or a subclass's own :meth:`Mamba2Mixer.step_sizes` rule is no clamp
for the step (:meth:`Mamba2Mixer.decode_step_limits`; :meth:`Mamba2Mixer.fused_decode`, which a
family's own forward may call too).

Parameter names are the checkpoints' (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
``norm``, ``out_proj``). Under tensor parallelism (:func:`mamba2_split`) a rank holds whole
heads. With ``G`` divisible by the TP size it also holds whole groups; with the TP size a
multiple of ``G`` (Granite-4.0-H: ``G = 1``) a group's heads span ``size / G`` ranks, each of
which holds a copy of the group's ``B`` / ``C`` rows and conv channels, and the group's norm
sums its squares over those ranks (:class:`CrossRankGroupNorm`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...cache_specs import CacheTensor, StateSpec
from ...kernels import find_kernel, get_kernel
from ...model_inputs import StepContext, fused_state_rows
from ..layers import Linear
from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows

__all__ = ['Mamba2Dims', 'Mamba2Mixer', 'mamba2_split', 'CrossRankGroupNorm', 'check_time_step_limit',
           'mamba2_state_spec']

# CacheTensor.tp_split names of the two state tensors (their ranges: mamba2_split)
CONV_SPLIT, HEAD_SPLIT = 'mamba_conv_channels', 'mamba_heads'


@dataclass(frozen=True)
class Mamba2Dims:
    """The sizes and constants of one Mamba-2 mixer (each family maps its config fields here).

    Attributes:
        hidden_size: model width.
        num_heads, head_dim: ``H``, ``P``.
        n_groups, state_size: ``G`` (dividing ``H``), ``Dn``.
        conv_kernel: ``K`` of the depthwise causal conv.
        chunk_size: tokens per SSD chunk (a speed knob; the outputs do not depend on it).
        conv_bias, proj_bias: the conv has a bias; ``in_proj`` / ``out_proj`` have biases.
        dt_min, dt_max: ``dt`` is clamped to ``[dt_min, dt_max]`` after the softplus
            (``0, inf`` for Nemotron-H and Granite-4.0-H: see :func:`check_time_step_limit`).
        norm_eps: epsilon of the grouped gated RMS norm.
    """
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float
    dt_max: float
    norm_eps: float

    def __post_init__(self):
        if self.n_groups <= 0 or self.num_heads % self.n_groups:
            raise ValueError(f'n_groups ({self.n_groups}) must divide the number of Mamba heads ({self.num_heads})')
        if self.conv_kernel < 2:
            raise ValueError(f'conv_kernel must be at least 2, got {self.conv_kernel}')
        if self.chunk_size <= 0:
            raise ValueError(f'chunk_size must be positive, got {self.chunk_size}')

    @property
    def d_inner(self) -> int:
        """``H * P``: the channels of ``x``, ``z`` and the norm."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """``d_inner + 2 G Dn``: the conv channels ``x | B | C``."""
        return self.d_inner + 2 * self.n_groups * self.state_size

    def local(self, size: int) -> 'Mamba2Dims':
        """This rank's dims at TP size ``size``: heads divided evenly; groups divided evenly when
        ``size`` divides ``G``, else one group (a share of a group that spans ``size / G`` ranks)."""
        import dataclasses
        return dataclasses.replace(self, num_heads=self.num_heads // size, n_groups=local_groups(self.n_groups, size))


def local_groups(n_groups: int, size: int) -> int:
    """A rank's Mamba-2 group count at TP size ``size``: ``G / size``, or 1 when ``size`` is a
    multiple of ``G`` (the rank holds part of one group's heads and a copy of its ``B`` / ``C``)."""
    return n_groups // size if n_groups >= size else 1


def check_time_step_limit(limit) -> None:
    """Refuse a ``time_step_limit`` (``dt``'s clamp after the softplus) other than the default
    ``(0.0, inf)``, which changes nothing (``softplus > 0``).

    ``transformers`` (5.25; Nemotron-H and Granite-4.0-H alike) clamps ``dt`` to the limit in its
    chunked scan only, not in its one-token decode step, so with any other limit the same token
    gets another ``dt`` when decoded than when prefilled: no chunking of the engine's (prefill
    chunks, prefix-cache restores, decode) reproduces that.

    Args:
        limit: ``config.time_step_limit``, a ``(low, high)`` pair (list or tuple) or None (the
            default).

    Raises:
        ValueError: naming ``time_step_limit`` and the value, for any other limit.
    """
    got = (0.0, float('inf')) if limit is None else tuple(limit)
    if got != (0.0, float('inf')):
        raise ValueError(f'time_step_limit must be (0.0, inf), got {got}: transformers clamps dt to it only when '
                         'it prefills, not in its decode step, which chunked prefill and decode cannot reproduce')


def mamba2_state_spec(dims: Mamba2Dims, dtype: torch.dtype) -> StateSpec:
    """A Mamba-2 layer's per-sequence state: ``conv [conv_dim, K - 1]`` in ``dtype`` (split by
    the rank's ``x | B | C`` channels) and ``ssm [H, P, Dn]`` float32 (split by head)."""
    return StateSpec((CacheTensor('conv', (dims.conv_dim, dims.conv_kernel - 1), dtype, CONV_SPLIT, 0),
                      CacheTensor('ssm', (dims.num_heads, dims.head_dim, dims.state_size), torch.float32,
                                  HEAD_SPLIT, 0)))


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer over the step's flat tokens (see the module docstring).

    Args:
        dims: its sizes (this rank's, under tensor parallelism).
        layer_idx: index into ``StepContext.state_caches`` (``(conv, ssm)``).

    Attributes:
        cross_rank_norm: None, or the :class:`CrossRankGroupNorm` the tensor-parallel layout
            sets (through :func:`mamba2_split`'s collective) when this rank's group spans ranks.
    """

    def __init__(self, dims: Mamba2Dims, layer_idx: int):
        super().__init__()
        self.dims, self.layer_idx = dims, layer_idx
        d = dims
        self.in_proj = Linear(d.hidden_size, d.d_inner + d.conv_dim + d.num_heads, bias=d.proj_bias)
        # weight holder [conv_dim, 1, K] (the checkpoint shape); the conv kernel runs it
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=d.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(d.num_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_heads))
        self.D = nn.Parameter(torch.ones(d.num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(d.d_inner))
        self.out_proj = Linear(d.d_inner, d.hidden_size, bias=d.proj_bias)
        # set by the tensor-parallel layout when this rank's group spans ranks
        self.cross_rank_norm: CrossRankGroupNorm | None = None

    def step_sizes(self, dt: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``in_proj``'s ``dt [T, H]`` → float32 ``softplus(dt + dt_bias)`` clamped to
        ``[dt_min, dt_max]`` for every token (a family whose reference clamps some tokens only
        overrides this)."""
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dims.dt_min, self.dims.dt_max)

    def decode_step_limits(self, ctx: StepContext) -> tuple[float, float] | None:
        """``(low, high)`` when :meth:`step_sizes` is ``clamp(softplus(dt + dt_bias), low, high)``
        for every token of ``ctx`` (the fused decode step then applies that clamp), else None.
        Here ``(dt_min, dt_max)``; a subclass with its own :meth:`step_sizes` gets None unless it
        overrides this too."""
        if type(self).step_sizes is not Mamba2Mixer.step_sizes:
            return None
        return self.dims.dt_min, self.dims.dt_max

    def fused_decode(self, proj: torch.Tensor, ctx: StepContext, limits: tuple[float, float] | None = None
                     ) -> torch.Tensor | None:
        """Everything between the projections of a decode step in one call, the registry's
        ``mamba2_decode``, on the slice of the state caches the step's slots span, with the step
        sizes ``clamp(softplus(dt + dt_bias), *limits)`` and the grouped gated norm (gate first);
        or ``None``: not a float32 pure decode step over one sorted slot range with history, no
        such kernel for the device, a norm spanning ranks, or no clamp for the step's tokens.

        Args:
            proj: ``in_proj``'s output ``[N, d_inner + conv_dim + H]`` (``[z | x | B | C | dt]``).
            ctx: the step.
            limits: the clamp; None: :meth:`decode_step_limits` (a family whose own forward has
                its own rule passes it).

        Returns:
            float32 ``[N, d_inner]``: the output projection's input, or ``None``.
        """
        if self.cross_rank_norm is not None:
            return None
        conv_cache, ssm_cache = ctx.state_caches[self.layer_idx]
        rows = fused_state_rows(ctx, proj, conv_cache)
        fused = find_kernel('mamba2_decode', proj.device)
        if rows is None or fused is None:
            return None
        limits = self.decode_step_limits(ctx) if limits is None else limits
        if limits is None:
            return None
        d = self.dims
        return fused(proj, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_cache[rows], self.dt_bias,
                     self.A_log, self.D, limits[0], limits[1], ssm_cache[rows], self.norm.weight, d.n_groups,
                     d.norm_eps)

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; reads and rewrites each sequence's state slot."""
        d, T = self.dims, hidden.shape[0]
        H, P, G, Dn = d.num_heads, d.head_dim, d.n_groups, d.state_size
        proj = self.in_proj(hidden)
        y = self.fused_decode(proj, ctx)
        if y is not None:
            return self.out_proj(y)
        z, xbc, dt = proj.split([d.d_inner, d.conv_dim, H], dim=-1)
        conv_cache, ssm_cache = ctx.state_caches[self.layer_idx]
        xbc = get_kernel('causal_conv1d_varlen', hidden.device)(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_cache, ctx.cu_seqlens, ctx.seq_ids,
            ctx.slots, ctx.has_history, 'silu', slot_span=ctx.slot_span)
        x, B, C = xbc.split([d.d_inner, G * Dn, G * Dn], dim=-1)
        dt = self.step_sizes(dt, ctx)
        A = -torch.exp(self.A_log.float())
        y = get_kernel('mamba2_ssd_varlen', hidden.device)(
            x.view(T, H, P), dt, A, B.view(T, G, Dn), C.view(T, G, Dn), self.D, ssm_cache, ctx.cu_seqlens,
            ctx.slots, ctx.has_history, d.chunk_size, slot_span=ctx.slot_span)
        if self.cross_rank_norm is not None:
            y = self.cross_rank_norm(y.view(T, d.d_inner), z, self.norm.weight, d.norm_eps)
        else:
            y = get_kernel('grouped_gated_rms_norm', hidden.device)(
                y.view(T, d.d_inner), z, self.norm.weight, d.d_inner // G, d.norm_eps)
        return self.out_proj(y.to(hidden.dtype))


def mamba2_split(dims_of, heads_field: str = 'num_heads', groups_field: str = 'n_groups', *,
                 local_fields: bool = False, refuse_shared_groups=None):
    """The tensor-parallel split of a Mamba-2 layer (Megatron-style), as a split factory.

    A rank holds heads ``[h0, h1)`` (``H / size``, axis ``mamba_heads``) and groups ``[g0, g1)``
    (axis ``mamba_groups``): ``in_proj`` rows of its ``z``, ``x``, ``B``, ``C`` and ``dt``
    pieces; ``conv1d`` rows of its ``x | B | C`` channels; ``dt_bias``, ``A_log``, ``D`` of its
    heads; ``norm`` of its channels; ``out_proj`` columns (row-parallel, its bias whole). Two
    cases:

    - ``size`` divides ``G``: ``G / size`` whole groups; the grouped norm needs no communication.
    - ``size`` is a multiple of ``G``: the one group its heads belong to (``g0 = r * G // size``);
      the ``size / G`` ranks of a group each read (and cache) the same ``B`` / ``C`` rows, and the
      layer's norm all-reduces the group's sum of squares (:class:`CrossRankGroupNorm`, handed to
      the mixer's ``cross_rank_norm``).

    Cache splits :data:`CONV_SPLIT` (the ``x | B | C`` channels) and :data:`HEAD_SPLIT`.

    Args:
        dims_of: ``config -> Mamba2Dims`` of the full model (the family's dims reader).
        heads_field, groups_field: the config fields of ``H`` and ``G`` (named by errors).
        local_fields: the local config sets those two fields to the rank's counts; False: it sets
            ``mamba_tp_size`` and ``dims_of`` divides (``Mamba2Dims.local``).
        refuse_shared_groups: None, or ``(config, size) -> str``: a non-empty message refuses a
            group spanning ranks (a layer whose norm cannot be summed over ranks; it names the
            field).
    """

    def split(config, size: int) -> BlockSplit:
        d = dims_of(config)
        P, Dn, di = d.head_dim, d.state_size, d.d_inner
        gdn = d.n_groups * Dn
        h, g = 'mamba_heads', 'mamba_groups'
        channels = (Piece(h, P), Piece(g, Dn, di), Piece(g, Dn, di + gdn))
        axes = (Axis(h, d.num_heads, heads_field, heads_field if local_fields else None),
                Axis(g, d.n_groups, groups_field, groups_field if local_fields else None, shared=True,
                     refuse_shared=refuse_shared_groups(config, size) if refuse_shared_groups else '',
                     why='a rank holds whole Mamba-2 groups or part of one group'))

        def cross_rank_norm(mixer, part, all_reduce) -> None:
            if d.n_groups < size:       # the rank's group spans ranks
                mixer.cross_rank_norm = CrossRankGroupNorm(all_reduce, part(g)[0], d.n_groups, di // d.n_groups)

        return BlockSplit(
            axes,
            (rows('in_proj', Piece(h, P), *(Piece(p.axis, p.unit, di + p.offset) for p in channels),
                  Piece(h, 1, di + d.conv_dim)),
             rows('conv1d', *channels),
             rows(('dt_bias', 'A_log', 'D'), Piece(h)),
             rows('norm', Piece(h, P)),
             cols('out_proj.weight', Piece(h, P))),
            row_parallel=('out_proj',), caches=((CONV_SPLIT, channels), (HEAD_SPLIT, (Piece(h),))),
            config=() if local_fields else (('mamba_tp_size', size),), collective=cross_rank_norm)

    return split


class CrossRankGroupNorm:
    """Mamba-2's grouped gated RMS norm (``grouped_gated_rms_norm``: ``h = x * silu(z)`` in
    float32, ``h * rsqrt(mean(h^2) + eps)`` over the group, then ``weight * h``) for a rank that
    holds ``D_local`` channels of one group of ``group_size`` channels spread over several ranks.

    Each rank puts its partial sum of squares ``[T]`` into column ``group`` of a zero
    ``[T, n_groups]`` float32 tensor and all ranks sum it (one all-reduce of ``T * G`` floats;
    ranks of other groups fill other columns), so every rank divides by its group's full sum.

    Args:
        all_reduce: sums a tensor over all ranks in place and returns it.
        group: the rank's group index; n_groups: ``G`` of the full model.
        group_size: the full group's channels (``d_inner / G``).
    """

    def __init__(self, all_reduce, group: int, n_groups: int, group_size: int):
        self.all_reduce, self.group, self.n_groups, self.group_size = all_reduce, group, n_groups, group_size

    def __call__(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x``, ``z`` ``[T, D_local]``, ``weight [D_local]`` → ``[T, D_local]`` (dtype as the kernel's)."""
        h = x.float() * F.silu(z.float())
        sums = h.new_zeros(h.shape[0], self.n_groups)
        sums[:, self.group] = h.pow(2).sum(-1)
        sums = self.all_reduce(sums)[:, self.group:self.group + 1]
        h = h * torch.rsqrt(sums / self.group_size + eps)
        return weight * h.to(x.dtype)
