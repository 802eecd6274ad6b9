"""Mixture-of-experts blocks: SwiGLU experts as stacked weights (:class:`FusedExperts`, and
:func:`load_expert_tensor` for checkpoints that ship one tensor per expert), the Qwen-MoE block
(softmax top-k router + sigmoid-gated shared expert, :class:`SparseMoeBlock`) and the
DeepSeek-V3-style block (sigmoid router with a correction bias and group-limited top-k,
:class:`GroupLimitedMoE`) that Kimi-Linear and GLM-5.3-Flash use.

Under tensor parallelism the experts, routers and Qwen's shared expert are replicated (a MoE
layer kind composes no block split); Granite's shared MLP splits by intermediate rows
(:data:`GRANITE_SHARED_MLP_SPLIT`).

A float32 CPU step of a few tokens (decode) runs :class:`SparseMoeBlock` as three products and
two native calls: one product of the router, the shared-expert gate and the shared expert's
gate/up rows stacked (a cached copy of those rows, rebuilt when a weight changes), the routing
and shared activation in one call (the registry's CPU ``moe_route_shared``), the shared down
product and the experts kernel;
the dozen small torch ops between them cost more than their arithmetic at batch 1. The
DeepSeek-V3 router (:func:`group_limited_route`) runs its selection as one call the same way.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import find_kernel, get_kernel
from ...kernels.fused_decode import FUSED_MOE_TOKENS, group_limited_route_torch
from ...kernels.linear import linear
from ...kernels.moe import clamped_swiglu, clipped_swiglu, moe_experts_one_token, moe_experts_sorted
from ..layers import Linear, PackedLinear, SwiGLUMLP, WeightLoader, mlp_split

__all__ = ['FusedExperts', 'GraniteMoE', 'GRANITE_MOE_RENAMES', 'GRANITE_SHARED_MLP_SPLIT', 'SparseMoeBlock', 'GroupLimitedMoE', 'group_limited_route', 'load_expert_tensor', 'MIXTRAL_EXPERT_RENAMES',
           'LimitedExperts', 'LimitedGroupMoE', 'LimitedSwiGLUMLP', 'check_group_limited', 'clamped_swiglu',
           'clipped_swiglu']


class FusedExperts(nn.Module):
    """SwiGLU experts as stacked weights: ``gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``down_proj [E, H, I]``, the ``transformers`` in-memory layout."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, chosen experts ``index [T, k]`` with ``weights [T, k]`` → ``[T, H]``, by
        the registry's ``moe_experts`` (:mod:`~lmdeploy.pytorch.kernels.moe`: the whole layer
        natively for float32 decode steps on CPU, grouped matmuls on CUDA)."""
        return get_kernel('moe_experts', x.device)(x, index, weights, self.gate_up_proj, self.down_proj)

    def forward_one_token(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for ``x [1, H]`` by :func:`~lmdeploy.pytorch.kernels.moe.moe_experts_one_token`."""
        return moe_experts_one_token(x, index, weights, self.gate_up_proj, self.down_proj)

    def forward_sorted(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for any ``T`` by :func:`~lmdeploy.pytorch.kernels.moe.moe_experts_sorted`."""
        return moe_experts_sorted(x, index, weights, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Module):
    """Top-k softmax-routed experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

    Router (Qwen-MoE style): ``p = softmax(gate(x))`` in float32, keep the top ``k``,
    renormalise them to sum 1 when ``norm_topk_prob``.

    Args:
        config: reads ``hidden_size``, ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``shared_expert_intermediate_size`` and, unless
            ``norm_topk_prob`` is given, ``config.norm_topk_prob``.
        norm_topk_prob: overrides the config (Qwen3.5-MoE's router always renormalises and its
            config has no such field).
    """

    def __init__(self, config, norm_topk_prob: bool | None = None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob if norm_topk_prob is None else norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def _stacked_weight(self) -> torch.Tensor | None:
        """float32 ``[E + 1 + 2*I, hidden]``: the router, shared-expert gate and shared gate/up
        rows stacked for one product (a copy, about ``(E + 1 + 2I) * hidden * 4`` bytes, rebuilt
        when any of them is replaced or written in place); ``None`` unless all three are plain
        float32 bias-free weights."""
        parts = (self.gate, self.shared_expert_gate, self.shared_expert.gate_up_proj)
        if any(m.fp8_block is not None or m.bias is not None or m.weight.dtype != torch.float32 for m in parts):
            return None
        key = tuple((m.weight.data_ptr(), m.weight._version) for m in parts)
        cached = self.__dict__.get('_stacked')
        if cached is None or cached[0] != key:
            cached = (key, torch.cat([m.weight.detach() for m in parts]))
            self.__dict__['_stacked'] = cached
        return cached[1]

    def _fused_decode(self, x: torch.Tensor) -> torch.Tensor | None:
        """:meth:`forward` for a float32 step of at most ``FUSED_MOE_TOKENS`` tokens by one
        stacked product and the registry's ``moe_route_shared``, or ``None`` (another dtype, more
        tokens, a quantized weight, or no such kernel for the device)."""
        if not (x.dtype == torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= FUSED_MOE_TOKENS):
            return None
        route = find_kernel('moe_route_shared', x.device)
        weight = None if route is None else self._stacked_weight()
        if weight is None:
            return None
        weights, index, act = route(linear(x, weight), self.gate.out_features, self.top_k, self.norm_topk_prob,
                                    self.shared_expert.down_proj.in_features)
        return self.experts(x, index, weights) + self.shared_expert.down_proj(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        fused = self._fused_decode(x)
        if fused is not None:
            return fused
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = self.experts(x, index, weights.to(x.dtype))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


_PER_EXPERT = re.compile(r'^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$')


def load_expert_tensor(loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """Copy a per-expert checkpoint tensor (``<prefix>.mlp.experts.{e}.{gate,up,down}_proj.weight``)
    into its slice of the fused :class:`FusedExperts` parameters; False for any other name.

    Raises:
        KeyError: no such experts parameter, or the expert index is out of range.
        ValueError: a shape mismatch.
    """
    match = _PER_EXPERT.match(name)
    if not match:
        return False
    params = loader.params
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    target = f'{prefix}.down_proj' if part == 'down_proj' else f'{prefix}.gate_up_proj'
    if target not in params or expert >= params[target].shape[0]:
        raise KeyError(f'checkpoint tensor {name!r} has no parameter in {type(loader.module).__name__}')
    dst = params[target][expert]
    if part != 'down_proj':
        half = dst.shape[0] // 2
        dst = dst[:half] if part == 'gate_proj' else dst[half:]
    per_expert = 1 if part == 'down_proj' else 2
    loader.copy_part(target, dst, (expert, part), per_expert * params[target].shape[0], name, tensor)
    return True


#: ``(pattern, replacement)`` pairs for ``re.sub``: a checkpoint's per-expert ``w1`` (gate) /
#: ``w3`` (up) / ``w2`` (down) under ``.mlp.experts.{e}`` (Mixtral's spelling) → the
#: ``gate_proj`` / ``up_proj`` / ``down_proj`` names :func:`load_expert_tensor` reads
W123_EXPERT_RENAMES = [
    (re.compile(r'(\.mlp\.experts\.\d+)\.w1\.weight$'), r'\1.gate_proj.weight'),
    (re.compile(r'(\.mlp\.experts\.\d+)\.w3\.weight$'), r'\1.up_proj.weight'),
    (re.compile(r'(\.mlp\.experts\.\d+)\.w2\.weight$'), r'\1.down_proj.weight'),
]


def group_limited_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
                        top_k: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 router (DeepSeek-V3 technical report, 2024), in float32.

    ``s = sigmoid(x W^T)``; experts are chosen with ``s + bias``: keep the ``topk_group`` of the
    ``n_group`` equal groups with the largest sum of their two best scores, then the top ``k``
    experts there; each chosen expert is weighted by its ``s`` (not the biased score),
    renormalised to sum 1 when ``norm_topk_prob``, times ``scaling``.

    A float32 step takes the router product and the registry's ``group_limited_route`` (one
    native call on CPU for the dozen small ops of the selection); other dtypes and devices run
    :func:`~lmdeploy.pytorch.kernels.fused_decode.group_limited_route_torch` on the float32 logits.

    Args:
        x: ``[T, hidden]``.
        weight: the router ``[E, hidden]``; bias: the score correction ``[E]``.

    Returns:
        ``(weights [T, k] float32, expert index [T, k] int64)``; the order of the ``k`` experts
        is the implementation's (the weighted sum over them does not depend on it beyond
        float32 rounding).
    """
    fused = find_kernel('group_limited_route', x.device) if x.dtype == weight.dtype == torch.float32 else None
    if fused is not None:
        return fused(linear(x, weight), bias, n_group, topk_group, top_k, norm_topk_prob, scaling)
    return group_limited_route_torch(F.linear(x.float(), weight.float()), bias, n_group, topk_group, top_k,
                                     norm_topk_prob, scaling)


class GroupLimitedMoE(nn.Module):
    """DeepSeek-V3-style MoE: sigmoid router with a score-correction bias and group-limited
    top-k, weights renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``,
    plus always-on shared experts.

    Router (float32): ``s = sigmoid(x W^T)``; choose with ``s + bias``: keep the ``topk_group``
    groups with the largest sum of their two best scores, then the top ``k`` experts there;
    weight each chosen expert by its ``s`` (not the biased score).
    """

    def __init__(self, config):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_local_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)
        self.experts = FusedExperts(self.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` → ``(weights [T, k] float32, expert index [T, k])``."""
        return group_limited_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.n_group,
                                   self.topk_group, self.top_k, self.norm_topk_prob, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        weights, index = self.route(x)
        return self.experts(x, index, weights.to(x.dtype)) + self.shared_experts(x)


class GraniteMoE(nn.Module):
    """Softmax-routed experts (GraniteMoE): the router's ``k`` largest logits (float32), a
    softmax over those ``k`` as the weights; SwiGLU experts, gate rows first."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = FusedExperts(config.num_local_experts, config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        logits, index = self.router(x).float().topk(self.top_k, dim=-1)
        return self.experts(x, index, torch.softmax(logits, dim=-1).to(x.dtype))


#: Mixtral-style published expert names (``block_sparse_moe``, ``experts.{e}.w1`` gate / ``w3`` up /
#: ``w2`` down) -> transformers' (``mlp``, ``gate_proj`` / ``up_proj`` / ``down_proj``), which
#: :func:`load_expert_tensor` then copies into the fused experts
MIXTRAL_EXPERT_RENAMES = [
    (re.compile(r'\.block_sparse_moe\.'), '.mlp.'),
    (re.compile(r'(\.mlp\.experts\.\d+)\.w1\.weight$'), r'\1.gate_proj.weight'),
    (re.compile(r'(\.mlp\.experts\.\d+)\.w3\.weight$'), r'\1.up_proj.weight'),
    (re.compile(r'(\.mlp\.experts\.\d+)\.w2\.weight$'), r'\1.down_proj.weight'),
]


# Granite checkpoints' published MoE and shared-MLP names -> the engine's module names
GRANITE_MOE_RENAMES = [
    (re.compile(r'\.block_sparse_moe\.input_linear\.weight$'), '.block_sparse_moe.experts.gate_up_proj'),
    (re.compile(r'\.block_sparse_moe\.output_linear\.weight$'), '.block_sparse_moe.experts.down_proj'),
    (re.compile(r'\.block_sparse_moe\.router\.layer\.weight$'), '.block_sparse_moe.router.weight'),
    (re.compile(r'\.shared_mlp\.input_linear\.weight$'), '.shared_mlp.gate_up_proj.weight'),
    (re.compile(r'\.shared_mlp\.output_linear\.weight$'), '.shared_mlp.down_proj.weight'),
]


#: the split of Granite's shared MLP (``shared_mlp``: ``input_linear`` stacks the gate and up rows,
#: ``output_linear`` is the engine's ``down_proj``) by ``shared_intermediate_size`` rows
GRANITE_SHARED_MLP_SPLIT = mlp_split(field='shared_intermediate_size', up=('input_linear',), down='output_linear',
                                     fused=True, down_module='down_proj', axis='shared_intermediate')


# ---- SwiGLUs with a limit (Ling 3, GLM-5.3-Flash) and the group-limited MoE built from them ----

#: ``act(gate [.., I], up [.., I], limit) -> [.., I]``: a SwiGLU activation with a limit
LimitedSwiGLU = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class LimitedSwiGLUMLP(nn.Module):
    """``down(act(gate(x), up(x), limit))``, gate and up packed into one matmul (loaded from
    ``gate_proj`` / ``up_proj``); ``x, out: [T, hidden]``.

    Args:
        hidden_size, intermediate_size: the widths (channels).
        limit: the activation's limit.
        act: :func:`clipped_swiglu` or :func:`clamped_swiglu`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, act: LimitedSwiGLU):
        super().__init__()
        self.limit, self.act = float(limit), act
        self.gate_up_proj = PackedLinear(hidden_size, {'gate_proj': intermediate_size, 'up_proj': intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        gate, up = self.gate_up_proj.forward_split(x)
        return self.down_proj(self.act(gate, up, self.limit))


_LIMITED_ACT_NAMES = {clipped_swiglu: 'clipped', clamped_swiglu: 'clamped'}


class LimitedExperts(FusedExperts):
    """:class:`FusedExperts` (same stacked weights and names) whose SwiGLU is ``act(gate, up,
    limit)``: the ``limited_swiglu_experts`` kernel (on CPU one native call for a float32 decode
    step, nothing read into Python, so a decode graph replays it; on CUDA the gathered form for a
    decode-sized batch, nothing read on the host, so a CUDA graph captures it)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float,
                 act: LimitedSwiGLU):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.limit, self.act = float(limit), act

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, chosen experts ``index [T, k]`` (long) with ``weights [T, k]`` → ``[T, H]``."""
        return get_kernel('limited_swiglu_experts', x.device)(x, index, weights, self.gate_up_proj, self.down_proj,
                                                              _LIMITED_ACT_NAMES[self.act], self.limit)


class LimitedGroupMoE(GroupLimitedMoE):
    """:class:`GroupLimitedMoE` (same router and names) whose routed and shared SwiGLUs take a
    limit: Ling 3's per-layer clips, GLM-5.3-Flash's clamp.

    Args:
        config: as :class:`GroupLimitedMoE`.
        act: :func:`clipped_swiglu` or :func:`clamped_swiglu`.
        routed_limit: the routed experts' limit; None keeps the unlimited fused experts.
        shared_limit: the shared experts' limit.
    """

    def __init__(self, config, act: LimitedSwiGLU, routed_limit: float | None, shared_limit: float):
        super().__init__(config)
        H, I = config.hidden_size, config.moe_intermediate_size
        if routed_limit is not None:
            self.experts = LimitedExperts(self.num_experts, H, I, routed_limit, act)
        self.shared_experts = LimitedSwiGLUMLP(H, I * config.n_shared_experts, shared_limit, act)


def check_group_limited(config) -> None:
    """Refuse a :class:`GroupLimitedMoE` grouping the router cannot run: every group needs its
    two best scores.

    Raises:
        ValueError: ``n_group`` does not divide ``num_local_experts`` into groups of >= 2, or
            ``topk_group`` is not in ``[1, n_group]``.
    """
    if (config.num_local_experts % config.n_group or config.num_local_experts // config.n_group < 2
            or not 1 <= config.topk_group <= config.n_group):
        raise ValueError(f'n_group ({config.n_group}) must divide num_local_experts ({config.num_local_experts}) '
                         f'into groups of >= 2 and topk_group ({config.topk_group}) be in [1, n_group]')
