"""Fused decode-step ops: one call for the glue a layer runs between its products on a float32
CPU decode step, where a few microseconds per torch op add up to more than the arithmetic at
batch 1 (a layer issued dozens of small ops around its kernels).

Each op is registered for the CPU only (``find_kernel`` answers ``None`` elsewhere, and the
shared blocks then run their unfused path): the native kernel (built with the others of
:mod:`.cpu_native`, wrapped here as ``*_native``) when it applies, else the torch form defined
here, which the tests compare it with::

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
from .cpu_native import CALLS, NATIVE_EXPERT_TOKENS, is_plain, native_available, native_library, state_step_library
from .gated_delta_rule import l2norm
from .norm import gated_rms_norm_torch, rms_norm_torch

__all__ = ['FUSED_MOE_TOKENS', 'gdn_decode_native', 'moe_route_native', 'qk_norm_rope_store_native',
           'add_rms_norm_native', 'gdn_decode_torch', 'moe_route_shared_torch', 'qk_norm_rope_store_torch',
           'add_rms_norm_torch']

# tokens up to which a Qwen-MoE block takes the fused route (decode steps; the native experts
# kernel's window, beyond which MKL's packed GEMMs win)
FUSED_MOE_TOKENS = NATIVE_EXPERT_TOKENS


def gdn_decode_native(proj: torch.Tensor, cols: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, state: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, num_k_heads: int) -> torch.Tensor | None:
    """A Gated DeltaNet layer's decode step between its input and output projections, one
    token for each of ``N`` sequences, in one native call (conv + SiLU, q/k L2 norm, gates, the
    delta rule, gated RMS norm; Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025), both
    states updated in place; ``None`` when it does not apply (:func:`gdn_decode_cpu` then runs
    :func:`gdn_decode_torch`, which it equals to float32 rounding).

    Args:
        proj: float32 ``[N, P]``, the packed input projection's output (unit stride along P).
        cols: int64 ``[C + Hv*dv + 2*Hv]``: the column of ``proj`` holding each conv channel
            (``C = 2*Hk*dk + Hv*dv``, q | k | v), each ``z`` element (head-major), each ``b``,
            each ``a``; every entry in ``[0, P)`` (the caller's invariant, not checked here).
        conv_weight: float32 ``[C, K]``; conv_state: float32 ``[N, C, K - 1]``, unit stride along
            the window (a view of the cache's rows).
        A_log, dt_bias: float32 ``[Hv]``; beta_scale: ``beta = beta_scale * sigmoid(b)``.
        state: float32 ``[N, Hv, dk, dv]``, unit stride along dv (a view of the cache's rows).
        norm_weight: float32 ``[dv]``; eps: the gated norm's epsilon.
        num_k_heads: ``Hk`` (divides ``Hv``; key head ``h // (Hv // Hk)`` serves value head ``h``).

    Returns:
        float32 ``[N, Hv*dv]`` (the output projection's input), or ``None`` (dtype, device,
        shapes, strides, autograd, or no library).
    """
    if proj.dim() != 2 or state.dim() != 4 or conv_state.dim() != 3:
        return None
    N, Hv, dk, dv = state.shape
    C, K = conv_weight.shape
    Hk = num_k_heads
    ok = (Hk and Hv % Hk == 0 and C == 2 * Hk * dk + Hv * dv and proj.shape[0] == N and proj.stride(1) == 1
          and conv_state.shape == (N, C, K - 1) and (K == 1 or conv_state.stride(2) == 1)
          and cols.shape == (C + Hv * dv + 2 * Hv,) and cols.dtype == torch.int64 and cols.is_contiguous()
          and A_log.shape == dt_bias.shape == (Hv,) and norm_weight.shape == (dv,)
          and all(is_plain(t) for t in (proj, conv_weight, conv_state, A_log, dt_bias, norm_weight)))
    lib = state_step_library((proj,), state, bool(ok))
    if lib is None:
        return None
    conv_weight, A_log, dt_bias, norm_weight = (t.contiguous() for t in (conv_weight, A_log, dt_bias, norm_weight))
    work = torch.empty(N, C, dtype=torch.float32)
    out = torch.empty(N, Hv * dv, dtype=torch.float32)
    if N:
        CALLS['gdn_decode'] += 1
        lib.lm_gdn_decode(proj.data_ptr(), proj.stride(0), cols.data_ptr(), conv_weight.data_ptr(),
                          conv_state.data_ptr(), conv_state.stride(0), conv_state.stride(1), A_log.data_ptr(),
                          dt_bias.data_ptr(), beta_scale, state.data_ptr(), state.stride(0), state.stride(1),
                          state.stride(2), norm_weight.data_ptr(), eps, N, Hk, Hv, dk, dv, K, work.data_ptr(),
                          out.data_ptr(), torch.get_num_threads())
    return out


def gdn_decode_torch(proj: torch.Tensor, cols: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, state: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float, num_k_heads: int) -> torch.Tensor:
    """The torch form of :func:`gdn_decode_native` (same arguments and result;
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
    """:func:`gdn_decode_native` when it applies, else :func:`gdn_decode_torch`."""
    out = gdn_decode_native(*args) if native_available() else None
    return gdn_decode_torch(*args) if out is None else out


def moe_route_native(proj: torch.Tensor, num_experts: int, top_k: int, norm_topk_prob: bool,
                     shared_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The routing of a softmax top-k MoE router (Qwen-MoE) and the activation of its
    sigmoid-gated SwiGLU shared expert in one native call, or ``None`` when it does not apply.

    Args:
        proj: float32 ``[T, E + 1 + 2*I]`` (unit stride along the row): per token the router
            logits, the shared-expert gate logit, then the shared expert's gate and up rows.
        num_experts: ``E``; top_k: ``k`` in ``[1, E]``; norm_topk_prob: renormalise the kept
            probabilities to sum 1; shared_size: ``I``.

    Returns:
        ``(weights [T, k] float32, index [T, k] int64, act [T, I] float32)``: the ``k`` largest
        of ``softmax(logits)`` in descending order (ties: the lower id), and
        ``sigmoid(shared gate) * silu(gate) * up`` (the shared expert's down-projection input,
        already scaled by its gate); ``None`` (dtype, device, shape, autograd, or no library).
    """
    E, k, I = num_experts, top_k, shared_size
    if not (proj.dim() == 2 and proj.shape[1] == E + 1 + 2 * I and 1 <= k <= E and is_plain(proj)
            and proj.stride(1) == 1):
        return None
    lib = native_library()
    if lib is None:
        return None
    T = proj.shape[0]
    index = torch.empty(T, k, dtype=torch.int64)
    weights = torch.empty(T, k, dtype=torch.float32)
    act = torch.empty(T, I, dtype=torch.float32)
    if T:
        CALLS['moe_route'] += 1
        lib.lm_moe_route(proj.data_ptr(), proj.stride(0), T, E, k, int(norm_topk_prob), I, index.data_ptr(),
                         weights.data_ptr(), act.data_ptr(), torch.get_num_threads())
    return weights, index, act


def moe_route_shared_torch(proj: torch.Tensor, num_experts: int, top_k: int, norm_topk_prob: bool,
                           shared_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch form of :func:`moe_route_native` (same arguments and result)."""
    logits, gate_logit, gate, up = proj.split([num_experts, 1, shared_size, shared_size], dim=-1)
    weights, index = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index, torch.sigmoid(gate_logit) * (F.silu(gate) * up)


@register_kernel('moe_route_shared', device_type='cpu')
def moe_route_shared_cpu(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_route_native` when it applies, else :func:`moe_route_shared_torch`."""
    out = moe_route_native(*args) if native_available() else None
    return moe_route_shared_torch(*args) if out is None else out


def qk_norm_rope_store_native(proj: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, gated: bool,
                              q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, zero_centered: bool,
                              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              blocks: torch.Tensor, offsets: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A decode attention layer's work between its qkv projection and the attention itself, in
    one native call: per-head q/k RMS norms (Zhang & Sennrich, 2019), rotary positions on the
    leading ``rot`` channels (Su et al., "RoFormer", 2021, in the two-halves layout), the output
    gate's sigmoid, and the new K/V written into the paged caches; ``None`` when it does not
    apply (the caller runs the torch path: the norm modules, ``apply_rotary``, ``fill_kv_cache``).

    Args:
        proj: float32 ``[T, P]``, unit stride along P: per token ``[q | k | v]``, q per head
            ``[q (D) | gate (D)]`` when ``gated`` else ``[q (D)]``, k and v ``[Hkv * D]``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D``.
        q_weight, k_weight: float32 ``[D]``; eps, zero_centered: as :func:`~.cpu_native.rms_norm_native`.
        cos, sin: float32 ``[T, rot]``, ``rot`` even and at most ``D``.
        k_cache, v_cache: float32 ``[num_blocks, block_size, Hkv, D]``, unit stride along D, equal
            strides (views into the cache's byte rows are fine).
        blocks, offsets: int64 ``[T]``: where each token's K/V goes.

    Returns:
        ``(q [T, H, D], sigmoid(gate) [T, H * D] or None)`` float32, or ``None`` (dtype, device,
        shapes, strides, autograd, or no library).

    Raises:
        ValueError: a block id outside ``[0, num_blocks)`` or an offset outside
            ``[0, block_size)`` (nothing is written).
    """
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    T = proj.shape[0] if proj.dim() == 2 else -1
    rot = cos.shape[-1] if cos.dim() == 2 else -1
    nb, bs = k_cache.shape[:2] if k_cache.dim() == 4 else (0, 0)
    if not (T >= 0 and proj.shape[1] == H * D * (2 if gated else 1) + 2 * Hkv * D and proj.stride(1) == 1
            and 0 <= rot <= D and rot % 2 == 0 and cos.shape == sin.shape == (T, rot)
            and q_weight.shape == k_weight.shape == (D,) and k_cache.shape == v_cache.shape == (nb, bs, Hkv, D)
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and blocks.shape == offsets.shape == (T,) and blocks.dtype == offsets.dtype == torch.int64
            and blocks.device.type == offsets.device.type == 'cpu'
            and all(is_plain(t) for t in (proj, q_weight, k_weight, cos, sin, k_cache, v_cache))):
        return None
    lib = native_library()
    if lib is None:
        return None
    cos, sin, q_weight, k_weight, blocks, offsets = (t.contiguous() for t in (cos, sin, q_weight, k_weight, blocks,
                                                                              offsets))
    q = torch.empty(T, H, D, dtype=torch.float32)
    gate = torch.empty(T, H * D, dtype=torch.float32) if gated else None
    if T:
        CALLS['qk_norm_rope_store'] += 1
        status = lib.lm_qk_norm_rope_store(proj.data_ptr(), proj.stride(0), T, H, Hkv, D, int(gated),
                                           q_weight.data_ptr(), k_weight.data_ptr(), eps, int(zero_centered),
                                           cos.data_ptr(), sin.data_ptr(), rot, q.data_ptr(),
                                           None if gate is None else gate.data_ptr(), k_cache.data_ptr(),
                                           v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                                           k_cache.stride(2), blocks.data_ptr(), offsets.data_ptr(), nb, bs,
                                           torch.get_num_threads())
        if status != 0:
            raise ValueError(f'K/V write index out of range: block ids must be in [0, {nb}) and offsets in '
                             f'[0, {bs})')
    return q, gate


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
    """The torch form of :func:`qk_norm_rope_store_native` (same arguments, result
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
    """:func:`qk_norm_rope_store_native` when it applies, else
    :func:`qk_norm_rope_store_torch`."""
    out = qk_norm_rope_store_native(*args) if native_available() else None
    return qk_norm_rope_store_torch(*args) if out is None else out


def add_rms_norm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``s = x + residual`` and :func:`~.cpu_native.rms_norm_native` of ``s`` in one native pass (a pre-norm
    layer's residual add and its next norm), or ``None`` when it does not apply.

    Args:
        x, residual: float32 ``[R, D]``, contiguous.
        weight: float32 ``[D]``; eps, zero_centered: as :func:`~.cpu_native.rms_norm_native`.

    Returns:
        ``(s, norm(s))``, float32 ``[R, D]`` each; ``None`` (dtype, device, shape, layout,
        autograd, or no library).
    """
    if not (x.dim() == 2 and residual.shape == x.shape and weight.shape == (x.shape[1],) and x.is_contiguous()
            and residual.is_contiguous() and all(is_plain(t) for t in (x, residual, weight))):
        return None
    lib = native_library()
    if lib is None:
        return None
    R, D = x.shape
    total = torch.empty(R, D, dtype=torch.float32)
    out = torch.empty(R, D, dtype=torch.float32)
    if R and D:
        CALLS['add_rms_norm'] += 1
        lib.lm_add_rms_norm(x.data_ptr(), residual.data_ptr(), R, D, weight.contiguous().data_ptr(), eps,
                            int(zero_centered), total.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return total, out


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of :func:`add_rms_norm_native`: ``(x + residual, its norm)``."""
    total = x + residual
    return total, rms_norm_torch(total, weight, eps, zero_centered)


@register_kernel('add_rms_norm', device_type='cpu')
def add_rms_norm_cpu(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_native` when it applies, else :func:`add_rms_norm_torch`."""
    out = add_rms_norm_native(*args) if native_available() else None
    return add_rms_norm_torch(*args) if out is None else out
