"""Fused decode steps of the recurrent token mixers that share a block across families: one call
for everything a layer runs between its input and output projections on a float32 CPU decode
step, like ``gdn_decode`` (:mod:`.fused_decode`) for Gated DeltaNet::

    kda_decode      q | k | v, forget gate, b, output gate rows -> three convs, q/k L2 norm, decay
                    gate, beta, per-channel delta rule, sigmoid-gated RMS norm -> o_proj input
                    (Kimi-Linear, GLM-5.3-Flash, Ling 3: blocks/kda.py)
    mamba2_decode   in_proj row [z | x | B | C | dt] -> conv, step sizes, SSD step, grouped gated
                    RMS norm -> out_proj input (Nemotron-H, Granite-4.0-H, Bamba, Mamba-2,
                    Falcon-H1, Zamba2: blocks/mamba2.py)

A layer's torch glue around its kernels (splits, gate activations, casts, the norm) is a few dozen
ops of 3-10 us each at batch 1, more than the arithmetic; one native call replaces them.

Each op is registered for the CPU only (``find_kernel`` answers ``None`` elsewhere, and the blocks
then run their unfused path): the native kernel (``lm_kda_decode`` / ``lm_mamba2_decode`` in
``csrc/cpu_native.c``) when it applies, else the torch form defined here, which equals it to
float32 rounding (the tests compare them and the blocks' unfused paths).

Invariant: the states given (views of the cache rows of the step's slots) are updated in place
exactly as the unfused path updates them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel
from .cpu_native import CALLS, is_plain, native_available, state_step_library
from .gated_delta_rule import l2norm

__all__ = ['kda_decode_native', 'kda_decode_torch', 'mamba2_decode_native', 'mamba2_decode_torch']


def _conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor) -> torch.Tensor:
    """One token of a depthwise causal conv with SiLU: ``x [N, C]``, ``weight [C, K]``, ``bias
    [C]`` or None, ``window [N, C, K - 1]`` (shifted in place) -> ``[N, C]``."""
    full = torch.cat((window, x[:, :, None]), dim=2)                               # [N, C, K]
    y = (full * weight).sum(-1)
    if bias is not None:
        y = y + bias
    window.copy_(full[:, :, 1:])
    return F.silu(y)


def kda_decode_native(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor,
                      conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor], A_log: torch.Tensor,
                      dt_bias: torch.Tensor, lower_bound: float | None, state: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """A Kimi Delta Attention layer's decode step between its projections (Kimi Team, "Kimi Linear",
    2025), one token for each of ``N`` sequences, in one native call: the three depthwise causal
    convs with SiLU, q/k L2 norm (q scaled by ``d**-0.5``), the decay gate, ``beta = sigmoid(b)``,
    the per-channel delta rule and the sigmoid-gated RMS norm; the conv windows and the state
    updated in place. ``None`` when it does not apply (:func:`kda_decode_cpu` then runs
    :func:`kda_decode_torch`).

    Args:
        qkv: float32 ``[N, 3 * D]`` (``D = H * d``; q | k | v before their convs), unit stride
            along the row (a view of the packed projection's output is fine); likewise
        f: float32 ``[N, D]``: the forget gate before its bias (``f_b(f_a(h))`` or ``f_proj(h)``);
        b: float32 ``[N, H]``; gate: float32 ``[N, D]``: the output gate before its sigmoid.
        conv_weights: three float32 ``[D, K]`` (q, k, v).
        conv_states: three float32 ``[N, D, K - 1]`` with equal strides, unit stride along the
            window (views of the caches' rows).
        A_log: float32 ``[H]``; dt_bias: float32 ``[D]``.
        lower_bound: None: log decay ``-exp(A_log) * softplus(f + dt_bias)``; else ``b < 0``:
            ``b * sigmoid(exp(A_log) * (f + dt_bias))`` (GLM-5.3-Flash's safe gate).
        state: float32 ``[N, H, d, d]``, unit stride along the last dim.
        norm_weight: float32 ``[d]``; eps: the norm's epsilon.

    Returns:
        float32 ``[N, D]`` (the output projection's input), or ``None`` (dtype, device, shapes,
        strides, autograd, or no library).
    """
    if state.dim() != 4 or qkv.dim() != 2 or len(conv_weights) != 3 or len(conv_states) != 3:
        return None
    N, H, d, d2 = state.shape
    D, K = H * d, conv_weights[0].shape[-1]
    rows = (qkv, f, b, gate)
    ok = (d == d2 and qkv.shape == (N, 3 * D) and f.shape == gate.shape == (N, D) and b.shape == (N, H)
          and all(t.stride(-1) == 1 for t in rows)
          and all(w.shape == (D, K) for w in conv_weights)
          and all(s.shape == (N, D, K - 1) and s.stride() == conv_states[0].stride() for s in conv_states)
          and (K == 1 or conv_states[0].stride(2) == 1)
          and A_log.shape == (H,) and dt_bias.shape == (D,) and norm_weight.shape == (d,)
          and (lower_bound is None or lower_bound < 0)
          and all(is_plain(t) for t in (*conv_weights, *conv_states, A_log, dt_bias, norm_weight)))
    lib = state_step_library(rows, state, bool(ok))
    if lib is None:
        return None
    qw, kw, vw, A_log, dt_bias, norm_weight = (t.contiguous() for t in (*conv_weights, A_log, dt_bias, norm_weight))
    qs, ks, vs = conv_states
    out = torch.empty(N, D, dtype=torch.float32)
    if N:
        CALLS['kda_decode'] += 1
        lib.lm_kda_decode(qkv.data_ptr(), qkv.stride(0), f.data_ptr(), f.stride(0), b.data_ptr(), b.stride(0),
                          gate.data_ptr(), gate.stride(0), qw.data_ptr(), kw.data_ptr(), vw.data_ptr(),
                          qs.data_ptr(), ks.data_ptr(), vs.data_ptr(), qs.stride(0), qs.stride(1), A_log.data_ptr(),
                          dt_bias.data_ptr(), int(lower_bound is not None),
                          0.0 if lower_bound is None else float(lower_bound), state.data_ptr(), state.stride(0),
                          state.stride(1), state.stride(2), norm_weight.data_ptr(), eps, N, H, d, K, out.data_ptr(),
                          torch.get_num_threads())
    return out


def kda_decode_torch(qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor,
                     conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor], A_log: torch.Tensor,
                     dt_bias: torch.Tensor, lower_bound: float | None, state: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch form of :func:`kda_decode_native` (same arguments and result; float32)."""
    N, H, d, _ = state.shape
    q, k, v = (_conv_silu(x, w, None, s).view(N, H, d)
               for x, w, s in zip(qkv.chunk(3, dim=-1), conv_weights, conv_states))
    k, q = l2norm(k), l2norm(q) * d ** -0.5
    u = (f + dt_bias).view(N, H, d)
    rate = A_log.exp().view(H, 1)
    g = -rate * F.softplus(u) if lower_bound is None else lower_bound * torch.sigmoid(rate * u)
    state.mul_(g.exp()[..., None])
    delta = torch.sigmoid(b)[..., None] * (v - (k[..., None] * state).sum(2))
    state.addcmul_(k[..., None], delta[..., None, :])
    o = (q[..., None] * state).sum(2)
    o = norm_weight * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)) * torch.sigmoid(gate.view(N, H, d))
    return o.reshape(N, H * d)


@register_kernel('kda_decode', device_type='cpu')
def kda_decode_cpu(*args) -> torch.Tensor:
    """:func:`kda_decode_native` when it applies, else :func:`kda_decode_torch`."""
    out = kda_decode_native(*args) if native_available() else None
    return kda_decode_torch(*args) if out is None else out


def mamba2_decode_native(proj: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                         conv_state: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                         dt_min: float, dt_max: float, state: torch.Tensor, norm_weight: torch.Tensor, n_groups: int,
                         eps: float) -> torch.Tensor | None:
    """A Mamba-2 layer's decode step between its projections (Dao & Gu, "Transformers are SSMs",
    ICML 2024), one token for each of ``N`` sequences, in one native call: the depthwise causal
    conv with SiLU over ``x | B | C``, ``dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)``, the
    SSD step with ``A = -exp(A_log)`` and the skip ``D``, and the grouped gated RMS norm
    (``r = y * silu(z)`` normalised over each of the ``G`` groups of ``H * P / G`` channels, times
    the weight); both states updated in place. ``None`` when it does not apply
    (:func:`mamba2_decode_cpu` then runs :func:`mamba2_decode_torch`).

    Args:
        proj: float32 ``[N, 2 * H * P + 2 * G * Dn + H]``: ``in_proj``'s output ``[z | x | B | C |
            dt]``, unit stride along the row.
        conv_weight: float32 ``[C, K]`` (``C = H * P + 2 * G * Dn``); conv_bias: ``[C]`` or None.
        conv_state: float32 ``[N, C, K - 1]``, unit stride along the window (a view of the
            cache's rows).
        dt_bias, A_log, D: float32 ``[H]``; dt_min, dt_max: the step sizes' clamp.
        state: float32 ``[N, H, P, Dn]``, unit stride along ``Dn``.
        norm_weight: float32 ``[H * P]``; n_groups: ``G`` (divides ``H``); eps: the norm's epsilon.

    Returns:
        float32 ``[N, H * P]`` (the output projection's input), or ``None`` (dtype, device,
        shapes, strides, autograd, or no library).
    """
    if state.dim() != 4 or proj.dim() != 2 or conv_state.dim() != 3 or conv_weight.dim() != 2:
        return None
    N, H, P, Dn = state.shape
    G = n_groups
    C, K = conv_weight.shape
    di = H * P
    ok = (G > 0 and H % G == 0 and C == di + 2 * G * Dn and proj.shape == (N, di + C + H) and proj.stride(1) == 1
          and conv_state.shape == (N, C, K - 1) and (K == 1 or conv_state.stride(2) == 1)
          and (conv_bias is None or (conv_bias.shape == (C,) and is_plain(conv_bias)))
          and dt_bias.shape == A_log.shape == D.shape == (H,) and norm_weight.shape == (di,)
          and all(is_plain(t) for t in (conv_weight, conv_state, dt_bias, A_log, D, norm_weight)))
    lib = state_step_library((proj,), state, bool(ok))
    if lib is None:
        return None
    conv_weight, dt_bias, A_log, D, norm_weight = (t.contiguous() for t in (conv_weight, dt_bias, A_log, D,
                                                                           norm_weight))
    if conv_bias is not None:
        conv_bias = conv_bias.contiguous()
    work = torch.empty(N, C, dtype=torch.float32)
    out = torch.empty(N, di, dtype=torch.float32)
    if N:
        CALLS['mamba2_decode'] += 1
        lib.lm_mamba2_decode(proj.data_ptr(), proj.stride(0), conv_weight.data_ptr(),
                             None if conv_bias is None else conv_bias.data_ptr(), conv_state.data_ptr(),
                             conv_state.stride(0), conv_state.stride(1), dt_bias.data_ptr(), A_log.data_ptr(),
                             D.data_ptr(), float(dt_min), float(dt_max), state.data_ptr(), state.stride(0),
                             state.stride(1), state.stride(2), norm_weight.data_ptr(), eps, N, H, P, G, Dn, K,
                             work.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def mamba2_decode_torch(proj: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                        conv_state: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                        dt_min: float, dt_max: float, state: torch.Tensor, norm_weight: torch.Tensor, n_groups: int,
                        eps: float) -> torch.Tensor:
    """The torch form of :func:`mamba2_decode_native` (same arguments and result; float32)."""
    N, H, P, Dn = state.shape
    G, di = n_groups, H * P
    z, xbc, dt = proj.split([di, conv_weight.shape[0], H], dim=-1)
    x, B, C = _conv_silu(xbc, conv_weight, conv_bias, conv_state).split([di, G * Dn, G * Dn], dim=-1)
    dt = F.softplus(dt + dt_bias).clamp(dt_min, dt_max)
    x = x.view(N, H, P)
    B, C = (t.view(N, G, 1, Dn).expand(N, G, H // G, Dn).reshape(N, H, Dn) for t in (B, C))
    state.mul_((dt * -A_log.exp()).exp()[..., None, None])
    state.addcmul_((x * dt[..., None])[..., None], B[:, :, None, :])
    y = (state * C[:, :, None, :]).sum(-1) + D[:, None] * x
    r = (y.reshape(N, di) * F.silu(z)).view(N, G, di // G)
    return norm_weight * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)).view(N, di)


@register_kernel('mamba2_decode', device_type='cpu')
def mamba2_decode_cpu(*args) -> torch.Tensor:
    """:func:`mamba2_decode_native` when it applies, else :func:`mamba2_decode_torch`."""
    out = mamba2_decode_native(*args) if native_available() else None
    return mamba2_decode_torch(*args) if out is None else out
