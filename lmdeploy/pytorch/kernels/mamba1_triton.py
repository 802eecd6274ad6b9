"""Triton Mamba-1 selective-scan kernels: the CUDA implementations of ``selective_scan_step`` and
``selective_scan_chunk`` (contracts of the torch versions in :mod:`.mamba1`).

The recurrence (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
2023, Algorithm 2), per channel ``d`` with a state row ``S[d] [N]``::

    S_t[d] = exp(dt_t[d] A[d]) * S_{t-1}[d] + dt_t[d] x_t[d] B_t;   y_t[d] = S_t[d] . C_t + D[d] x_t[d]

Channels are independent, so both kernels give one program a block of ``BLOCK_D`` channels and
keep its ``[BLOCK_D, N]`` state tile in registers:

- ``selective_scan_step`` (decode): one program per (sequence, channel block): load the tile,
  update it, read it against ``C``, store it; one pass over the state.
- ``selective_scan_chunk`` (prefill): one program per channel block walks the sequence token by
  token (the decay differs per state entry, so there is no matrix-product form to batch tokens
  with); the parallelism is across channels (``d_inner / BLOCK_D`` programs, 256 for a 7B model).

Registered for CUDA when triton imports; runs on CPU tensors under ``TRITON_INTERPRET=1`` (how
tests/test_mamba1_kernels.py checks them against the recurrence). Importing this module never
needs triton or a GPU.
"""
from __future__ import annotations

import torch

from . import once, register_kernel, static_loop_end, triton_available

__all__ = ['selective_scan_step_triton', 'selective_scan_chunk_triton']

_BLOCK_D = 32       # channels per program


@once
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _step(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, s_ptr, y_ptr,
              sx_m, sdt_m, sb_m, sc_m, ss_m, ss_d, sy_m, Dd, N,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        j = tl.arange(0, BLOCK_N)
        d_ok, j_ok = d < Dd, j < N
        tile = d_ok[:, None] & j_ok[None, :]
        x = tl.load(x_ptr + m * sx_m + d, mask=d_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + m * sdt_m + d, mask=d_ok, other=0.0).to(tl.float32)
        A = tl.load(a_ptr + d[:, None] * N + j[None, :], mask=tile, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + m * sb_m + j, mask=j_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + m * sc_m + j, mask=j_ok, other=0.0).to(tl.float32)
        rows = s_ptr + m * ss_m + d[:, None] * ss_d + j[None, :]
        s = tl.load(rows, mask=tile, other=0.0)
        s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * b[None, :]
        tl.store(rows, s, mask=tile)
        y = tl.sum(s * c[None, :], axis=1) + tl.load(d_ptr + d, mask=d_ok, other=0.0).to(tl.float32) * x
        tl.store(y_ptr + m * sy_m + d, y, mask=d_ok)

    @triton.jit
    def _scan(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, s0_ptr, y_ptr, sf_ptr, L,
              sx_l, sdt_l, sb_l, sc_l, sy_l, Dd, N,
              HAS_INIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, STATIC_L: tl.constexpr):
        d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        j = tl.arange(0, BLOCK_N)
        d_ok, j_ok = d < Dd, j < N
        tile = d_ok[:, None] & j_ok[None, :]
        at = d[:, None] * N + j[None, :]
        A = tl.load(a_ptr + at, mask=tile, other=0.0).to(tl.float32)
        skip = tl.load(d_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        if HAS_INIT:
            s = tl.load(s0_ptr + at, mask=tile, other=0.0).to(tl.float32)
        else:
            s = tl.zeros((BLOCK_D, BLOCK_N), tl.float32)
        # STATIC_L: the loop end under the interpreter, -1 compiled (kernels.static_loop_end)
        # the row pointers advance by their strides (64-bit pointer arithmetic: no int32 t * stride)
        xp, dtp, bp, cp, yp = x_ptr + d, dt_ptr + d, b_ptr + j, c_ptr + j, y_ptr + d
        for _ in range(0, STATIC_L if STATIC_L >= 0 else L):
            x = tl.load(xp, mask=d_ok, other=0.0).to(tl.float32)
            dt = tl.load(dtp, mask=d_ok, other=0.0).to(tl.float32)
            b = tl.load(bp, mask=j_ok, other=0.0).to(tl.float32)
            c = tl.load(cp, mask=j_ok, other=0.0).to(tl.float32)
            s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * b[None, :]
            tl.store(yp, tl.sum(s * c[None, :], axis=1) + skip * x, mask=d_ok)
            xp += sx_l
            dtp += sdt_l
            bp += sb_l
            cp += sc_l
            yp += sy_l
        tl.store(sf_ptr + at, s, mask=tile)

    return triton, _step, _scan


def _unit_last(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


@register_kernel('selective_scan_step', device_type='cuda', priority=10, available=triton_available)
def selective_scan_step_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                               D: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One decode token of the Mamba-1 recurrence for ``M`` sequences (the contract of the torch
    ``selective_scan_step``), the state updated in place.

    Args:
        x: ``[M, D]``; dt: float32 ``[M, D]`` (already biased and softplus'd); A: float32
            ``[D, N]`` (negative); D: ``[D]`` skip weights.
        B, C: ``[M, N]``.
        state: float32 ``[M, D, N]`` with unit stride along ``N`` (views of cache rows are fine).

    Returns:
        float32 ``y [M, D]`` including ``D * x``.

    Raises:
        ValueError: a state that is not float32 or has no unit stride along ``N``.
    """
    M, Dd, N = state.shape
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f'state must be float32 with unit stride along the state size; got {state.dtype}, '
                         f'strides {state.stride()}')
    y = torch.empty(M, Dd, dtype=torch.float32, device=x.device)
    if M == 0 or Dd == 0:
        return y
    triton, step, _ = _kernels()
    x, dt, B, C = _unit_last(x, dt, B, C)
    step[(M, triton.cdiv(Dd, _BLOCK_D))](
        x, dt, A.float().contiguous(), B, C, D.contiguous(), state, y, x.stride(0), dt.stride(0), B.stride(0),
        C.stride(0), state.stride(0), state.stride(1), y.stride(0), Dd, N, BLOCK_D=_BLOCK_D,
        BLOCK_N=max(16, triton.next_power_of_2(N)))
    return y


@register_kernel('selective_scan_chunk', device_type='cuda', priority=10, available=triton_available)
def selective_scan_chunk_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                                D: torch.Tensor, initial_state: torch.Tensor | None, chunk_size: int = 16
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-1 recurrence over one sequence of ``L`` tokens (the contract of the torch
    ``selective_scan_chunk``).

    Args:
        x: ``[L, D]``; dt: float32 ``[L, D]``; A: float32 ``[D, N]``; B, C: ``[L, N]``; D: ``[D]``.
        initial_state: float32 ``[D, N]`` or None (zeros). Read only.
        chunk_size: the torch path's chunk; not used here (the kernel walks token by token).

    Returns:
        ``(y [L, D] float32 including D * x, final state [D, N] float32)``.
    """
    L, Dd = x.shape
    N = A.shape[1]
    y = torch.empty(L, Dd, dtype=torch.float32, device=x.device)
    final = torch.empty(Dd, N, dtype=torch.float32, device=x.device)
    if Dd == 0:
        return y, final
    if L == 0:
        final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return y, final
    triton, _, scan = _kernels()
    x, dt, B, C = _unit_last(x, dt, B, C)
    init = None if initial_state is None else initial_state.float().contiguous()
    scan[(triton.cdiv(Dd, _BLOCK_D),)](
        x, dt, A.float().contiguous(), B, C, D.contiguous(), final if init is None else init, y, final, L,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0), y.stride(0), Dd, N, HAS_INIT=init is not None,
        BLOCK_D=_BLOCK_D, BLOCK_N=max(16, triton.next_power_of_2(N)), STATIC_L=static_loop_end(scan, L))
    return y, final
