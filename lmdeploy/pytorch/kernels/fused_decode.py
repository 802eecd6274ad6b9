"""Fused decode-step ops: one call for the glue a layer runs between its products on a float32
CPU decode step, where a few microseconds per torch op add up to more than the arithmetic at
batch 1 (a layer issued dozens of small ops around its kernels).

Each op is registered for the CPU only (``find_kernel`` answers ``None`` elsewhere, and the
shared blocks then run their unfused path): the native kernel of :mod:`.cpu_native` when it
applies, else the torch form defined here, which the tests compare it with::

    gdn_decode            in_proj row -> conv, q/k L2 norm, gates, delta rule, gated norm -> out_proj input
    moe_route_shared      [router | shared gate | shared gate/up] row -> top-k weights, ids, shared activation
    qk_norm_rope_store    qkv row -> q/k RMS norm, rotary, gate sigmoid; K/V into the paged caches
    add_rms_norm          x + residual and its RMS norm

Invariants: the states and caches given are updated in place exactly as the unfused path does;
nothing is written when a K/V write index is out of range.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel
from .cpu_native import (NATIVE_EXPERT_TOKENS, add_rms_norm_native, gdn_decode_native, moe_route_native, native_available,
                         qk_norm_rope_store_native)
from .gated_delta_rule import l2norm
from .norm import gated_rms_norm_torch, rms_norm_torch

__all__ = ['FUSED_MOE_TOKENS', 'gdn_decode_torch', 'moe_route_shared_torch', 'qk_norm_rope_store_torch', 'add_rms_norm_torch']

# tokens up to which a Qwen-MoE block takes the fused route (decode steps; the native experts
# kernel's window, beyond which MKL's packed GEMMs win)
FUSED_MOE_TOKENS = NATIVE_EXPERT_TOKENS


def gdn_decode_torch(proj: torch.Tensor, cols: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, state: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float, num_k_heads: int) -> torch.Tensor:
    """The torch form of :func:`~.cpu_native.gdn_decode_native` (same arguments and result;
    float32). Raises IndexError for a column outside ``proj``."""
    N, Hv, dk, dv = state.shape
    C, Hk = conv_weight.shape[0], num_k_heads
    x, z, b, a = proj[:, cols].split([C, Hv * dv, Hv, Hv], dim=-1)
    window = torch.cat((conv_state, x[:, :, None]), dim=2)                       # [N, C, K]
    y = F.silu((window * conv_weight).sum(-1))
    conv_state.copy_(window[:, :, 1:])
    q, k, v = y.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    kq = l2norm(torch.stack((k.reshape(N, Hk, dk), q.reshape(N, Hk, dk)), dim=2)).repeat_interleave(Hv // Hk, 1)
    k, q = kq[:, :, 0], kq[:, :, 1] * dk ** -0.5
    beta = b.sigmoid() * beta_scale
    decay = (-A_log.exp() * F.softplus(a + dt_bias)).exp()
    state.mul_(decay[..., None, None])
    delta = beta[..., None] * (v.reshape(N, Hv, dv) - (k[..., None] * state).sum(2))
    state.addcmul_(k[..., None], delta[..., None, :])
    o = (q[..., None] * state).sum(2)
    return gated_rms_norm_torch(o, z.reshape(N, Hv, dv), norm_weight, eps).reshape(N, Hv * dv)


@register_kernel('gdn_decode', device_type='cpu')
def gdn_decode_cpu(*args) -> torch.Tensor:
    """:func:`~.cpu_native.gdn_decode_native` when it applies, else :func:`gdn_decode_torch`."""
    out = gdn_decode_native(*args) if native_available() else None
    return gdn_decode_torch(*args) if out is None else out


def moe_route_shared_torch(proj: torch.Tensor, num_experts: int, top_k: int, norm_topk_prob: bool,
                           shared_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch form of :func:`~.cpu_native.moe_route_native` (same arguments and result)."""
    logits, gate_logit, gate, up = proj.split([num_experts, 1, shared_size, shared_size], dim=-1)
    weights, index = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index, torch.sigmoid(gate_logit) * (F.silu(gate) * up)


@register_kernel('moe_route_shared', device_type='cpu')
def moe_route_shared_cpu(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~.cpu_native.moe_route_native` when it applies, else :func:`moe_route_shared_torch`."""
    out = moe_route_native(*args) if native_available() else None
    return moe_route_shared_torch(*args) if out is None else out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on the leading ``cos.shape[-1]`` channels of ``x [T, heads, D]`` (the
    two-halves layout; Su et al., "RoFormer", 2021)."""
    rot = cos.shape[-1]
    half = rot // 2
    x_rot = x[..., :rot]
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos[:, None] + rotated * sin[:, None], x[..., rot:]), dim=-1)


def qk_norm_rope_store_torch(proj: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, gated: bool,
                             q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, zero_centered: bool,
                             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch form of :func:`~.cpu_native.qk_norm_rope_store_native` (same arguments, result
    and errors)."""
    T, H, Hkv, D = proj.shape[0], num_heads, num_kv_heads, head_dim
    nb, bs = k_cache.shape[:2]
    if T and (blocks.min() < 0 or blocks.max() >= nb or offsets.min() < 0 or offsets.max() >= bs):
        raise ValueError(f'K/V write index out of range: block ids must be in [0, {nb}) and offsets in [0, {bs})')
    qg, k, v = proj.split([H * D * (2 if gated else 1), Hkv * D, Hkv * D], dim=-1)
    gate = None
    if gated:
        q, g = qg.reshape(T, H, 2 * D).chunk(2, dim=-1)
        gate = torch.sigmoid(g).reshape(T, H * D)
    else:
        q = qg.reshape(T, H, D)
    q = _rotate(rms_norm_torch(q, q_weight, eps, zero_centered), cos, sin)
    k = _rotate(rms_norm_torch(k.reshape(T, Hkv, D), k_weight, eps, zero_centered), cos, sin)
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v.reshape(T, Hkv, D)
    return q, gate


@register_kernel('qk_norm_rope_store', device_type='cpu')
def qk_norm_rope_store_cpu(*args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~.cpu_native.qk_norm_rope_store_native` when it applies, else
    :func:`qk_norm_rope_store_torch`."""
    out = qk_norm_rope_store_native(*args) if native_available() else None
    return qk_norm_rope_store_torch(*args) if out is None else out


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of :func:`~.cpu_native.add_rms_norm_native`: ``(x + residual, its norm)``."""
    total = x + residual
    return total, rms_norm_torch(total, weight, eps, zero_centered)


@register_kernel('add_rms_norm', device_type='cpu')
def add_rms_norm_cpu(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.cpu_native.add_rms_norm_native` when it applies, else :func:`add_rms_norm_torch`."""
    out = add_rms_norm_native(*args) if native_available() else None
    return add_rms_norm_torch(*args) if out is None else out
