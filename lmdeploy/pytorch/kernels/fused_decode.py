"""Fused decode-step ops: one call for the glue a layer runs between its products on a float32
CPU decode step, where a few microseconds per torch op add up to more than the arithmetic at
batch 1 (a layer issued dozens of small ops around its kernels).

Each op is registered for the CPU only (``find_kernel`` answers ``None`` elsewhere, and the
shared blocks then run their unfused path): the native kernel (built with the others of
:mod:`.cpu_native`, wrapped here as ``*_native``) when it applies, else the torch form defined
here, which the tests compare it with::

    gdn_decode            in_proj row -> conv, q/k L2 norm, gates, delta rule, gated norm -> out_proj input
    gdn_varlen            gdn_decode over sequences of any lengths (prefill chunks; native only)
    moe_route_shared      [router | shared gate | shared gate/up] row -> top-k weights, ids, shared activation
    qk_norm_rope_store    qkv row -> q/k RMS norm (or none), key scale, rotary, gate sigmoid; K/V into the
                          paged caches (the attention layers with q/k norms and the plain GQA ones)
    add_rms_norm          x + residual and its RMS norm
    mla_decode            absorbed query + [c | k_rope] row -> latent row written (norm, interleaved
                          rotary), attention over the paged latent rows in latent space
    group_limited_route   router logits -> the DeepSeek-V3 group-limited sigmoid top-k weights and ids

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

__all__ = ['FUSED_MOE_TOKENS', 'GDN_VARLEN_TOKENS', 'gdn_decode_native', 'gdn_varlen_native', 'moe_route_native',
           'qk_norm_rope_store_native', 'add_rms_norm_native', 'mla_decode_native', 'group_limited_route_native',
           'gdn_decode_torch', 'moe_route_shared_torch', 'qk_norm_rope_store_torch', 'add_rms_norm_torch', 'mla_decode_torch',
           'group_limited_route_torch']

# tokens up to which a Qwen-MoE block takes the fused route (decode steps; the native experts
# kernel's window, beyond which MKL's packed GEMMs win)
FUSED_MOE_TOKENS = NATIVE_EXPERT_TOKENS


def _gdn_dims(proj: torch.Tensor, cols: torch.Tensor, conv_weight: torch.Tensor, conv: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, norm_weight: torch.Tensor,
              num_k_heads: int) -> tuple[int, int, int, int, int, int] | None:
    """The checks :func:`gdn_decode_native` and :func:`gdn_varlen_native` share: ``(Hk, Hv, dk, dv,
    C, K)`` when ``proj [*, P]``, ``conv [*, C, K - 1]`` (unit stride along the window), ``state [*,
    Hv, dk, dv]``, ``cols``, ``conv_weight [C, K]``, ``A_log``, ``dt_bias``, ``norm_weight`` and
    ``num_k_heads`` agree and every tensor but ``cols`` and ``state`` :func:`is_plain` (float32
    CPU, no autograd), else None. The leading dims (rows, slots) are the caller's to check."""
    if proj.dim() != 2 or state.dim() != 4 or conv.dim() != 3:
        return None
    _, Hv, dk, dv = state.shape
    C, K = conv_weight.shape
    Hk = num_k_heads
    ok = (Hk and Hv % Hk == 0 and C == 2 * Hk * dk + Hv * dv and proj.stride(1) == 1
          and conv.shape[1:] == (C, K - 1) and (K == 1 or conv.stride(2) == 1)
          and cols.shape == (C + Hv * dv + 2 * Hv,) and cols.dtype == torch.int64 and cols.is_contiguous()
          and A_log.shape == dt_bias.shape == (Hv,) and norm_weight.shape == (dv,)
          and all(is_plain(t) for t in (proj, conv_weight, conv, A_log, dt_bias, norm_weight)))
    return (Hk, Hv, dk, dv, C, K) if ok else None


def _gdn_run(lib, name: str, rows: int, num_seqs: int, dims: tuple[int, int, int, int, int, int],
             proj: torch.Tensor, cols: torch.Tensor, conv_weight: torch.Tensor, conv: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, state: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, seq_args: tuple = ()) -> torch.Tensor:
    """Run the native ``lm_<name>`` (``gdn_decode`` or ``gdn_varlen``) on operands
    :func:`_gdn_dims` accepted (``dims`` is its result): ``conv_weight``, ``A_log``, ``dt_bias``
    and ``norm_weight`` made contiguous, a float32 scratch ``[rows, C]`` and the output
    ``[rows, Hv*dv]``; ``seq_args`` (the varlen kernel's sequence pointers) go between ``eps``
    and the sizes. No call when ``num_seqs`` is 0 (the output is then left uninitialised).
    Returns the output."""
    Hk, Hv, dk, dv, C, K = dims
    conv_weight, A_log, dt_bias, norm_weight = (t.contiguous() for t in (conv_weight, A_log, dt_bias, norm_weight))
    work = torch.empty(rows, C, dtype=torch.float32)
    out = torch.empty(rows, Hv * dv, dtype=torch.float32)
    if num_seqs:
        CALLS[name] += 1
        getattr(lib, 'lm_' + name)(proj.data_ptr(), proj.stride(0), cols.data_ptr(), conv_weight.data_ptr(),
                                   conv.data_ptr(), conv.stride(0), conv.stride(1), A_log.data_ptr(),
                                   dt_bias.data_ptr(), beta_scale, state.data_ptr(), state.stride(0),
                                   state.stride(1), state.stride(2), norm_weight.data_ptr(), eps, *seq_args,
                                   num_seqs, Hk, Hv, dk, dv, K, work.data_ptr(), out.data_ptr(),
                                   torch.get_num_threads())
    return out


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
    dims = _gdn_dims(proj, cols, conv_weight, conv_state, A_log, dt_bias, state, norm_weight, num_k_heads)
    if dims is None:
        return None
    N = state.shape[0]
    lib = state_step_library((proj,), state, proj.shape[0] == N and conv_state.shape[0] == N)
    if lib is None:
        return None
    return _gdn_run(lib, 'gdn_decode', N, N, dims, proj, cols, conv_weight, conv_state, A_log, dt_bias, beta_scale,
                    state, norm_weight, eps)


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


# longest sequence (rows) up to which a float32 CPU step runs a Gated DeltaNet layer by
# gdn_varlen_native, row by row (the default prefill chunk, max_prefill_token_num). On the 2-core
# AMD EPYC benchmark host it beats the chunked torch form at every length measured: a whole layer
# of the 99M benchmark model (8 value heads of 128, projections included), one thread's CPU time,
# chunked / native: 32 rows 9.6 / 7.0 ms, 64 rows 12.3 / 10.7, 256 rows 43.5 / 35.7, 1024 rows
# 163 / 137, 2048 rows 346 / 277. (Its parallelism is sequences x value heads, so a host with more
# threads than that for one long prompt may prefer the chunked form's threaded matmuls.)
GDN_VARLEN_TOKENS = 8192


def gdn_varlen_native(proj: torch.Tensor, cols: torch.Tensor, conv_weight: torch.Tensor, conv_cache: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float, state_cache: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, num_k_heads: int, cu_seqlens: torch.Tensor,
                      slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor | None:
    """:func:`gdn_decode_native` over a flat batch of ``N`` sequences of any lengths, each
    continuing its state slot, in one native call; ``None`` when it does not apply (the caller
    runs the unfused layer).

    Each sequence's rows run in order through the decode step's arithmetic, so a prompt of
    ``L`` rows leaves bit for bit the states (and gives the outputs) of ``L`` decode steps; the
    chunked form of the unfused layer equals it to float32 rounding. For a short prompt this
    replaces some 60 torch ops per layer (the conv's index copies, the chunked delta rule's
    padding, triangular solve and small matmuls) by one pass over the rows; for long ones it is
    still the faster form on the benchmark host (:data:`GDN_VARLEN_TOKENS`).

    Args:
        proj: float32 ``[T, P]``, the packed input projection's output, sequences' rows
            concatenated (unit stride along P).
        cols: as :func:`gdn_decode_native`.
        conv_weight: float32 ``[C, K]``; conv_cache: float32 ``[S, C, K - 1]`` (unit stride along
            the window); rows ``slots`` are read and rewritten in place.
        A_log, dt_bias, beta_scale, norm_weight, eps, num_k_heads: as :func:`gdn_decode_native`.
        state_cache: float32 ``[S, Hv, dk, dv]`` (unit stride along dv); rows ``slots`` are
            read and rewritten in place.
        cu_seqlens: int64 ``[N + 1]`` row offsets (``cu_seqlens[0] == 0``, ``cu_seqlens[N] == T``).
        slots: int64 ``[N]`` distinct slots in ``[0, S)`` (the caller's invariant, not checked).
        fresh: uint8 ``[N]``, nonzero for a sequence with no history (its slot rows are zeroed
            first, whatever they held).

    Returns:
        float32 ``[T, Hv*dv]``, or ``None`` (dtype, device, shapes, strides, autograd, or no
        library).
    """
    dims = _gdn_dims(proj, cols, conv_weight, conv_cache, A_log, dt_bias, state_cache, norm_weight, num_k_heads)
    if dims is None:
        return None
    T, N = proj.shape[0], slots.shape[0]
    ok = (cu_seqlens.shape == (N + 1,) and cu_seqlens.dtype == slots.dtype == torch.int64
          and fresh.shape == (N,) and fresh.dtype == torch.uint8
          and all(t.device.type == 'cpu' and t.is_contiguous() for t in (cu_seqlens, slots, fresh)))
    lib = state_step_library((proj,), state_cache, ok)
    if lib is None:
        return None
    return _gdn_run(lib, 'gdn_varlen', T, N, dims, proj, cols, conv_weight, conv_cache, A_log, dt_bias, beta_scale,
                    state_cache, norm_weight, eps, (cu_seqlens.data_ptr(), slots.data_ptr(), fresh.data_ptr()))


register_kernel('gdn_varlen', device_type='cpu', available=native_available)(gdn_varlen_native)


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
                              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                              zero_centered: bool, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k_scale: float = 1.0
                              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A decode attention layer's work between its qkv projection and the attention itself, in
    one native call: per-head q/k RMS norms (Zhang & Sennrich, 2019) when given, the keys times
    ``k_scale``, rotary positions on the leading ``rot`` channels (Su et al., "RoFormer", 2021, in
    the two-halves layout), the output gate's sigmoid, and the new K/V written into the paged
    caches; ``None`` when it does not apply (the caller runs the torch path: the norm modules,
    ``apply_rotary``, ``fill_kv_cache``).

    Args:
        proj: float32 ``[T, P]``, unit stride along P: per token ``[q | k | v]``, q per head
            ``[q (D) | gate (D)]`` when ``gated`` else ``[q (D)]``, k and v ``[Hkv * D]``.
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D``.
        q_weight, k_weight: float32 ``[D]`` each, or both ``None`` (no norms: the plain GQA
            layers); eps, zero_centered: as :func:`~.cpu_native.rms_norm_native` (unused without norms).
        cos, sin: float32 ``[T, rot]``, ``rot`` even and at most ``D`` (0: no rotary).
        k_cache, v_cache: float32 ``[num_blocks, block_size, Hkv, D]``, unit stride along D, equal
            strides (views into the cache's byte rows are fine).
        blocks, offsets: int64 ``[T]``: where each token's K/V goes.
        k_scale: the keys' multiplier, applied after the norm and before the rotary (Falcon-H1's
            ``key_multiplier``; rotary is linear, so the order does not change the value).

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
            and ((q_weight is None and k_weight is None)
                 or (q_weight is not None and k_weight is not None and q_weight.shape == k_weight.shape == (D,)
                     and is_plain(q_weight) and is_plain(k_weight)))
            and k_cache.shape == v_cache.shape == (nb, bs, Hkv, D)
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and blocks.shape == offsets.shape == (T,) and blocks.dtype == offsets.dtype == torch.int64
            and blocks.device.type == offsets.device.type == 'cpu'
            and all(is_plain(t) for t in (proj, cos, sin, k_cache, v_cache))):
        return None
    lib = native_library()
    if lib is None:
        return None
    cos, sin, blocks, offsets = (t.contiguous() for t in (cos, sin, blocks, offsets))
    if q_weight is not None:
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    q = torch.empty(T, H, D, dtype=torch.float32)
    gate = torch.empty(T, H * D, dtype=torch.float32) if gated else None
    if T:
        CALLS['qk_norm_rope_store'] += 1
        status = lib.lm_qk_norm_rope_store(proj.data_ptr(), proj.stride(0), T, H, Hkv, D, int(gated),
                                           None if q_weight is None else q_weight.data_ptr(),
                                           None if k_weight is None else k_weight.data_ptr(), eps,
                                           int(zero_centered), float(k_scale), cos.data_ptr(), sin.data_ptr(), rot,
                                           q.data_ptr(),
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
                             q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                             zero_centered: bool, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k_scale: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    k = k.reshape(T, Hkv, D)
    if q_weight is not None:
        q, k = rms_norm_torch(q, q_weight, eps, zero_centered), rms_norm_torch(k, k_weight, eps, zero_centered)
    if k_scale != 1.0:
        k = k * k_scale
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v.reshape(T, Hkv, D)
    return q, gate


@register_kernel('qk_norm_rope_store', device_type='cpu')
def qk_norm_rope_store_cpu(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`qk_norm_rope_store_native` when it applies, else
    :func:`qk_norm_rope_store_torch`."""
    out = qk_norm_rope_store_native(*args, **kwargs) if native_available() else None
    return qk_norm_rope_store_torch(*args, **kwargs) if out is None else out


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


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on interleaved pairs of ``x [T, ..., R]`` (DeepSeek's layout), written
    de-interleaved ``[even' | odd']`` (``cos``, ``sin`` ``[T, R]`` tables of ``cat(f, f)``; the
    first half is used). The kernels' copy of the MLA block's ``rotate_interleaved``: kernels do
    not import models."""
    half = cos.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos[:, :half].reshape(shape), sin[:, :half].reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _check_paged_lengths(block_table: torch.Tensor, kv_seqlens: torch.Tensor, block_size: int,
                         num_blocks: int) -> None:
    """ValueError unless every length is in ``[1, W * block_size]`` and every block id it reaches
    is in ``[0, num_blocks)`` (the native kernels' checks, for their torch forms)."""
    W = block_table.shape[1]
    if kv_seqlens.numel() and (kv_seqlens.min() < 1 or kv_seqlens.max() > W * block_size):
        raise ValueError(f'kv_seqlens must be in [1, {W * block_size}]; got {kv_seqlens.tolist()}')
    reached = torch.arange(W)[None, :] * block_size < kv_seqlens[:, None]
    ids = block_table[reached]
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f'block_table holds a block id outside [0, {num_blocks}) within kv_seqlens')


def mla_decode_native(q_c: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: torch.Tensor,
                      blocks: torch.Tensor, offsets: torch.Tensor, block_table: torch.Tensor,
                      kv_seqlens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The absorbed decode step of multi-head latent attention (DeepSeek-V2, 2024) between the
    layer's products, one new token for each of ``N`` sequences, in one native call: each
    sequence's latent row ``[rms_norm(c) | k_rope]`` (``k_rope`` rotated on interleaved pairs when
    ``cos`` is given) written into the paged cache, then every query head scores its sequence's
    rows in latent space (``q_c . latent[:R] + q_rope' . latent[R:]``, ``q_rope'`` rotated alike)
    and attends their latent parts (an online softmax); ``None`` when it does not apply.

    The key up-projection is folded into ``q_c`` and the value up-projection applies to the
    result (both batched products over heads, the caller's), so a step reads each cached row once
    per group of up to 8 heads instead of up-projecting it.

    Args:
        q_c: float32 ``[H, N, R]`` contiguous: ``W_uk[h]^T q_nope[n, h]`` per head.
        q_rope: float32 ``[N, H, P]``, unit stride along P (a view of the query is fine).
        kv: float32 ``[N, R + P]``, unit stride along the row: ``[c | k_rope]`` (the
            ``kv_a_proj_with_mqa`` output).
        norm_weight: float32 ``[R]`` (``kv_a_layernorm``, plain convention); eps: its epsilon.
        cos, sin: float32 ``[N, P]`` (``cat(f, f)`` tables) or both ``None`` (no rotary).
        cache: float32 ``[num_blocks, block_size, R + P]``, unit stride along the row.
        blocks, offsets: int64 ``[N]``: where each new row goes.
        block_table: int64 ``[N, W]``; kv_seqlens: int64 ``[N]`` (the new row included).
        scale: the softmax scale.

    Returns:
        float32 ``[H, N, R]``: the attended latent per head, or ``None`` (dtype, device, shapes,
        strides, autograd, or no library).

    Raises:
        ValueError: a write index, a length or a reached block id out of range (nothing written).
    """
    if not (q_c.dim() == 3 and q_rope.dim() == 3 and kv.dim() == 2 and cache.dim() == 3):
        return None
    H, N, R = q_c.shape
    P = q_rope.shape[2]
    nb, bs = cache.shape[:2]
    rot = 0 if cos is None else P
    ok = (q_rope.shape[:2] == (N, H) and kv.shape == (N, R + P) and cache.shape[2] == R + P
          and norm_weight.shape == (R,) and q_c.is_contiguous() and q_rope.stride(2) == 1 and kv.stride(1) == 1
          and cache.stride(2) == 1 and (cos is None) == (sin is None)
          and (cos is None or (cos.shape == sin.shape == (N, P) and P % 2 == 0 and is_plain(cos) and is_plain(sin)))
          and blocks.shape == offsets.shape == kv_seqlens.shape == (N,) and block_table.dim() == 2
          and block_table.shape[0] == N
          and all(t.dtype == torch.int64 and t.device.type == 'cpu' for t in (blocks, offsets, block_table, kv_seqlens))
          and all(is_plain(t) for t in (q_c, q_rope, kv, norm_weight, cache)))
    lib = native_library() if ok else None
    if lib is None:
        return None
    norm_weight, blocks, offsets, block_table, kv_seqlens = (t.contiguous() for t in (norm_weight, blocks, offsets,
                                                                                     block_table, kv_seqlens))
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(H, N, R, dtype=torch.float32)
    if not (N and H):
        return out
    CALLS['mla_decode'] += 1
    status = lib.lm_mla_decode(q_c.data_ptr(), q_rope.data_ptr(), q_rope.stride(0), q_rope.stride(1), kv.data_ptr(),
                               kv.stride(0), norm_weight.data_ptr(), eps, None if cos is None else cos.data_ptr(),
                               None if sin is None else sin.data_ptr(), rot, cache.data_ptr(), cache.stride(0),
                               cache.stride(1), blocks.data_ptr(), offsets.data_ptr(), block_table.data_ptr(),
                               block_table.stride(0), kv_seqlens.data_ptr(), N, H, R, P, bs, block_table.shape[1], nb,
                               scale, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise ValueError(f'latent write index out of range: block ids must be in [0, {nb}) and offsets in [0, {bs})')
    if status == -2:
        raise ValueError(f'kv_seqlens must be in [1, {block_table.shape[1] * bs}]; got {kv_seqlens.tolist()}')
    if status == -3:
        raise ValueError(f'block_table holds a block id outside [0, {nb}) within kv_seqlens')
    return out


def mla_decode_torch(q_c: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None, cache: torch.Tensor,
                     blocks: torch.Tensor, offsets: torch.Tensor, block_table: torch.Tensor,
                     kv_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch form of :func:`mla_decode_native` (same arguments, result and errors; the
    softmax over a padded gather of each sequence's rows)."""
    H, N, R = q_c.shape
    nb, bs = cache.shape[:2]
    if N and (blocks.min() < 0 or blocks.max() >= nb or offsets.min() < 0 or offsets.max() >= bs):
        raise ValueError(f'latent write index out of range: block ids must be in [0, {nb}) and offsets in [0, {bs})')
    _check_paged_lengths(block_table, kv_seqlens, bs, nb)
    c, k_rope = kv.split([R, kv.shape[1] - R], dim=-1)
    if cos is not None:
        k_rope, q_rope = _rotate_interleaved(k_rope, cos, sin), _rotate_interleaved(q_rope, cos, sin)
    cache[blocks, offsets] = torch.cat((rms_norm_torch(c, norm_weight, eps, False), k_rope), dim=-1)
    S = block_table.shape[1] * bs
    pos = torch.arange(S).expand(N, S)
    rows = cache[block_table.gather(1, pos // bs), pos % bs]                       # [N, S, R + P]
    scores = (torch.einsum('hnr,nsr->nhs', q_c, rows[..., :R])
              + torch.einsum('nhp,nsp->nhs', q_rope, rows[..., R:])) * scale
    scores = scores.masked_fill(~(pos < kv_seqlens[:, None])[:, None, :], float('-inf'))
    return torch.einsum('nhs,nsr->hnr', scores.softmax(-1), rows[..., :R])


@register_kernel('mla_decode', device_type='cpu')
def mla_decode_cpu(*args) -> torch.Tensor:
    """:func:`mla_decode_native` when it applies, else :func:`mla_decode_torch`."""
    out = mla_decode_native(*args) if native_available() else None
    return mla_decode_torch(*args) if out is None else out


def group_limited_route_native(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                               norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The DeepSeek-V3 router (DeepSeek-V3 technical report, 2024) from its logits in one native
    call, or ``None`` when it does not apply.

    ``s = sigmoid(logits)``; experts are chosen with ``s + bias``: the ``topk_group`` of the
    ``n_group`` equal groups with the largest sum of their two best scores, then the top ``k``
    experts there (descending, ties: the lower id); each chosen expert is weighted by its ``s``,
    divided by their sum (``+ 1e-20``) when ``norm_topk_prob``, times ``scaling``.

    Args:
        logits: float32 ``[T, E]``, unit stride along E.
        bias: float32 ``[E]``, the score correction.
        n_group, topk_group, top_k: groups, groups kept, experts chosen.

    Returns:
        ``(weights [T, k] float32, index [T, k] int64)``, or ``None`` (dtype, device, shapes, a
        group of fewer than two experts, fewer than ``k`` experts in the kept groups, or no
        library: the torch form then raises or answers as it does).
    """
    if not (logits.dim() == 2 and is_plain(logits) and is_plain(bias) and logits.stride(1) == 1):
        return None
    T, E = logits.shape
    per = E // n_group if n_group > 0 else 0
    if not (bias.shape == (E,) and per >= 2 and per * n_group == E and 1 <= topk_group <= n_group
            and 1 <= top_k <= topk_group * per):
        return None
    lib = native_library()
    if lib is None:
        return None
    index = torch.empty(T, top_k, dtype=torch.int64)
    weights = torch.empty(T, top_k, dtype=torch.float32)
    if T:
        CALLS['group_limited_route'] += 1
        lib.lm_group_route(logits.data_ptr(), logits.stride(0), bias.contiguous().data_ptr(), T, E, n_group,
                           topk_group, top_k, int(norm_topk_prob), scaling, index.data_ptr(), weights.data_ptr(),
                           torch.get_num_threads())
    return weights, index


def group_limited_route_torch(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                              norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form of :func:`group_limited_route_native` (same arguments and result, but the
    chosen experts in ``topk``'s unsorted order), in float32 whatever the logits' dtype."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    T, E = logits.shape
    group_scores = choice.view(T, n_group, -1).topk(2, dim=-1)[0].sum(-1)            # [T, groups]
    groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~mask.repeat_interleave(E // n_group, dim=1), float('-inf'))
    index = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, index


@register_kernel('group_limited_route', device_type='cpu')
def group_limited_route_cpu(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_limited_route_native` when it applies, else :func:`group_limited_route_torch`."""
    out = group_limited_route_native(*args) if native_available() else None
    return group_limited_route_torch(*args) if out is None else out
