"""Triton Mamba-2 (SSD) kernels: the CUDA implementations of ``ssd_step`` and ``ssd_chunk_scan``.

The recurrence (Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", ICML 2024), per head ``h`` of group ``g = h / (H / G)``::

    a_t = exp(dt_t A_h);   S_t = a_t S_{t-1} + dt_t x_t B_t^T   ([P, Dn]);   y_t = S_t C_t + D_h x_t

``ssd_step`` (decode): one program per (sequence, head, block of ``P``) loads its state tile,
updates it and reads it against ``C`` in registers, one pass over the state.

``ssd_chunk_scan`` (prefill, the SSD chunked form): one program per (head, block of ``P``)
walks the sequence in chunks of ``CHUNK`` tokens, carrying the state tile in registers. With
``c_t`` the running sum of ``dt A`` inside a chunk (``c_t - c_s <= 0`` for ``s <= t``)::

    y_t   = exp(c_t) C_t S_in  +  sum_{s<=t} (C_t . B_s) exp(c_t - c_s) dt_s x_s   (+ D x_t)
    S_out = exp(c_T) S_in      +  sum_s exp(c_T - c_s) dt_s x_s B_s^T

three matrix products per chunk (``C S^T``, ``C B^T`` then its masked product with ``x``, and
``x^T B``), run at full float32 precision (``input_precision='ieee'``: no TF32, whose 10-bit
mantissa would cost the model's 1e-4 logit agreement). The chunk length only changes the
rounding, not the result: the kernel uses its own (:data:`CHUNK`), whatever ``chunk_size`` the
caller's torch path would use. The state tile ``[32, Dn]`` stays in registers across chunks
(8 warps per program).

Registered for CUDA when triton imports; runs on CPU tensors under ``TRITON_INTERPRET=1`` (how
tests/test_mamba2_accel_kernels.py checks them against the torch versions). Importing this module never
needs triton or a GPU.
"""
from __future__ import annotations

import torch

from . import once, register_kernel, static_loop_end, triton_available

__all__ = ['ssd_step_triton', 'ssd_chunk_scan_triton', 'CHUNK']

CHUNK = 64          # tokens per chunk of the scan kernel (a power of two >= 16: tl.dot's smallest side);
                    # 32 for state sizes over 128, so a chunk's B and C tiles stay as large
_BLOCK_P_STEP = 32  # head-dim rows per decode program
_BLOCK_P_SCAN = 32  # head-dim rows per scan program


@once
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _step(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, s_ptr, y_ptr,
              sx_n, sx_h, sdt_n, sb_n, sb_g, sc_n, sc_g, ss_n, ss_h, ss_p, sy_n, sy_h,
              per_group, P, Dn, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        j = tl.arange(0, BLOCK_N)
        p_ok, j_ok = p < P, j < Dn
        g = h // per_group
        dt = tl.load(dt_ptr + n * sdt_n + h).to(tl.float32)
        decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
        x = tl.load(x_ptr + n * sx_n + h * sx_h + p, mask=p_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + n * sb_n + g * sb_g + j, mask=j_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + n * sc_n + g * sc_g + j, mask=j_ok, other=0.0).to(tl.float32)
        tile = p_ok[:, None] & j_ok[None, :]
        rows = s_ptr + n * ss_n + h * ss_h + p[:, None] * ss_p + j[None, :]
        s = tl.load(rows, mask=tile, other=0.0)
        s = s * decay + (dt * x)[:, None] * b[None, :]
        tl.store(rows, s, mask=tile)
        y = tl.sum(s * c[None, :], axis=1)
        if HAS_D:
            y += tl.load(d_ptr + h).to(tl.float32) * x
        tl.store(y_ptr + n * sy_n + h * sy_h + p, y, mask=p_ok)

    @triton.jit
    def _scan(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, s0_ptr, y_ptr, sf_ptr, L,
              sx_l, sx_h, sdt_l, sb_l, sb_g, sc_l, sc_g, sy_l, sy_h, per_group, P, Dn,
              HAS_INIT: tl.constexpr, HAS_D: tl.constexpr, CH: tl.constexpr, BLOCK_P: tl.constexpr,
              BLOCK_N: tl.constexpr, STATIC_L: tl.constexpr):
        h = tl.program_id(0)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        j = tl.arange(0, BLOCK_N)
        t = tl.arange(0, CH)
        p_ok, j_ok = p < P, j < Dn
        g = h // per_group
        A = tl.load(a_ptr + h).to(tl.float32)
        tile = p_ok[:, None] & j_ok[None, :]
        state_at = h.to(tl.int64) * P * Dn + p[:, None] * Dn + j[None, :]
        if HAS_INIT:
            state = tl.load(s0_ptr + state_at, mask=tile, other=0.0).to(tl.float32)
        else:
            state = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
        causal = t[:, None] >= t[None, :]
        # STATIC_L: the loop end under the interpreter, -1 compiled (kernels.static_loop_end); not
        # assigned to a name first: the interpreter would turn it back into a one-element array
        for c0 in range(0, STATIC_L if STATIC_L >= 0 else L, CH):
            pos = (c0 + t).to(tl.int64)
            t_ok = pos < L
            dt = tl.load(dt_ptr + pos * sdt_l + h, mask=t_ok, other=0.0).to(tl.float32)
            cs = tl.cumsum(dt * A, axis=0)                       # [CH], rows past L add 0
            x = tl.load(x_ptr + pos[:, None] * sx_l + h * sx_h + p[None, :], mask=t_ok[:, None] & p_ok[None, :],
                        other=0.0).to(tl.float32)
            tn = t_ok[:, None] & j_ok[None, :]
            bm = tl.load(b_ptr + pos[:, None] * sb_l + g * sb_g + j[None, :], mask=tn, other=0.0).to(tl.float32)
            cm = tl.load(c_ptr + pos[:, None] * sc_l + g * sc_g + j[None, :], mask=tn, other=0.0).to(tl.float32)
            y = tl.dot(cm, tl.trans(state), input_precision='ieee') * tl.exp(cs)[:, None]
            cb = tl.dot(cm, tl.trans(bm), input_precision='ieee')
            gap = tl.where(causal, cs[:, None] - cs[None, :], 0.0)
            mix = tl.where(causal, cb * tl.exp(gap) * dt[None, :], 0.0)
            y += tl.dot(mix, x, input_precision='ieee')
            if HAS_D:
                y += tl.load(d_ptr + h).to(tl.float32) * x
            tl.store(y_ptr + pos[:, None] * sy_l + h * sy_h + p[None, :], y, mask=t_ok[:, None] & p_ok[None, :])
            total = tl.sum(dt * A, axis=0)
            w = tl.exp(total - cs) * dt                          # [CH], 0 past L (dt = 0 there)
            state = state * tl.exp(total) + tl.dot(tl.trans(x * w[:, None]), bm, input_precision='ieee')
        tl.store(sf_ptr + state_at, state, mask=tile)

    return triton, _step, _scan


def _unit_last(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _check_groups(H: int, G: int) -> None:
    if G < 1 or H % G:
        raise ValueError(f'heads ({H}) must be a multiple of the B/C groups ({G})')


@register_kernel('ssd_step', device_type='cuda', priority=10, available=triton_available)
def ssd_step_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, state: torch.Tensor) -> torch.Tensor:
    """One decode token of the Mamba-2 recurrence for ``N`` sequences (the contract of the
    torch ``ssd_step``), the state updated in place.

    Args:
        x: ``[N, H, P]``; dt: float32 ``[N, H]`` (already ``softplus(dt + dt_bias)``, clamped).
        A: float32 ``[H]`` (negative); D: ``[H]`` skip weights or ``None``.
        B, C: ``[N, G, Dn]``, ``H % G == 0``.
        state: float32 ``[N, H, P, Dn]`` with unit stride along ``Dn`` (views of cache rows are fine).

    Returns:
        float32 ``y [N, H, P]``.

    Raises:
        ValueError: heads not a multiple of the groups, or a state without unit stride along ``Dn``
            or not float32.
    """
    N, H, P, Dn = state.shape
    G = B.shape[1]
    _check_groups(H, G)
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f'state must be float32 with unit stride along d_state; got {state.dtype}, '
                         f'strides {state.stride()}')
    y = torch.empty(N, H, P, dtype=torch.float32, device=x.device)
    if N == 0 or H == 0 or P == 0:
        return y
    triton, step, _ = _kernels()
    x, B, C = _unit_last(x, B, C)
    dt = dt.contiguous()
    grid = (N, H, triton.cdiv(P, _BLOCK_P_STEP))
    step[grid](x, dt, A.contiguous(), B, C, A if D is None else D.contiguous(), state, y,
               x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
               state.stride(0), state.stride(1), state.stride(2), y.stride(0), y.stride(1),
               H // G, P, Dn, HAS_D=D is not None, BLOCK_P=_BLOCK_P_STEP,
               BLOCK_N=max(16, triton.next_power_of_2(Dn)))
    return y


@register_kernel('ssd_chunk_scan', device_type='cuda', priority=10, available=triton_available)
def ssd_chunk_scan_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, initial_state: torch.Tensor | None,
                          chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence over one sequence of ``L`` tokens in SSD chunks (the contract of
    the torch ``ssd_chunk_scan``).

    Args:
        x: ``[L, H, P]``; dt: float32 ``[L, H]``; A: float32 ``[H]``; B, C: ``[L, G, Dn]``.
        D: ``[H]`` or ``None``; initial_state: float32 ``[H, P, Dn]`` or ``None`` (zeros).
        chunk_size: the caller's chunk length; not used here (the kernel's chunk is
            :data:`CHUNK`; the result is the same up to float32 rounding).

    Returns:
        ``(y, final_state)``: float32 ``[L, H, P]`` (``D x`` included) and float32 ``[H, P, Dn]``.

    Raises:
        ValueError: heads not a multiple of the groups.
    """
    L, H, P = x.shape
    G, Dn = B.shape[1], B.shape[2]
    _check_groups(H, G)
    y = torch.empty(L, H, P, dtype=torch.float32, device=x.device)
    final = torch.empty(H, P, Dn, dtype=torch.float32, device=x.device)
    if H == 0 or P == 0:
        return y, final
    if L == 0:
        final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return y, final
    triton, _, scan = _kernels()
    x, B, C = _unit_last(x, B, C)
    dt = dt.contiguous()
    init = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    grid = (H, triton.cdiv(P, _BLOCK_P_SCAN))
    block_n = max(16, triton.next_power_of_2(Dn))
    scan[grid](x, dt, A.contiguous(), B, C, A if D is None else D.contiguous(), final if init is None else init, y,
               final, L, x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
               y.stride(0), y.stride(1), H // G, P, Dn, HAS_INIT=init is not None, HAS_D=D is not None,
               CH=CHUNK if block_n <= 128 else CHUNK // 2, BLOCK_P=_BLOCK_P_SCAN, BLOCK_N=block_n,
               STATIC_L=static_loop_end(scan, L), num_warps=8)
    return y, final
