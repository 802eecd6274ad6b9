"""Triton lightning-attention kernels: the CUDA implementations of ``lightning_attention_step`` and
``lightning_attention_chunk`` (contracts of the torch versions in :mod:`.lightning_attention`).

The recurrence per head ``h`` (MiniMax-01, 2025), state ``S [d_k, d_v]``::

    S_t = exp(-s_h) S_{t-1} + k_t^T v_t;      o_t = q_t S_t

The columns of ``S`` (one per value channel) are independent, so both kernels give one program
a block of ``BLOCK_V`` value channels of one head and keep its ``[d_k, BLOCK_V]`` state tile in
registers:

- ``lightning_attention_step`` (decode): one program per (sequence, head, value block): load the
  tile, decay it, add ``k^T v``, read it against ``q``, store it.
- ``lightning_attention_chunk`` (prefill): one program per (head, value block) walks the sequence
  token by token; the parallelism is across heads and value blocks.

Registered for CUDA when triton imports; runs on CPU tensors under ``TRITON_INTERPRET=1`` (how
tests/test_lightning_attention.py checks them against the recurrence). Importing this module
never needs triton or a GPU.
"""
from __future__ import annotations

import torch

from . import once, register_kernel, static_loop_end, triton_available

__all__ = ['lightning_attention_step_triton', 'lightning_attention_chunk_triton']

_BLOCK_V = 32       # value channels per program


@once
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _step(q_ptr, k_ptr, v_ptr, slope_ptr, s_ptr, o_ptr,
              sq_m, sq_h, sk_m, sk_h, sv_m, sv_h, ss_m, ss_h, ss_k, so_m, so_h, DK, DV,
              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        c = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        r = tl.arange(0, BLOCK_K)
        r_ok, c_ok = r < DK, c < DV
        tile = r_ok[:, None] & c_ok[None, :]
        q = tl.load(q_ptr + m * sq_m + h * sq_h + r, mask=r_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + m * sk_m + h * sk_h + r, mask=r_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + m * sv_m + h * sv_h + c, mask=c_ok, other=0.0).to(tl.float32)
        lam = tl.exp(-tl.load(slope_ptr + h).to(tl.float32))
        rows = s_ptr + m * ss_m + h * ss_h + r[:, None] * ss_k + c[None, :]
        s = tl.load(rows, mask=tile, other=0.0) * lam + k[:, None] * v[None, :]
        tl.store(rows, s, mask=tile)
        tl.store(o_ptr + m * so_m + h * so_h + c, tl.sum(q[:, None] * s, axis=0), mask=c_ok)

    @triton.jit
    def _scan(q_ptr, k_ptr, v_ptr, slope_ptr, s0_ptr, o_ptr, sf_ptr, L,
              sq_l, sq_h, sk_l, sk_h, sv_l, sv_h, so_l, so_h, DK, DV,
              HAS_INIT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, STATIC_L: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        r = tl.arange(0, BLOCK_K)
        r_ok, c_ok = r < DK, c < DV
        tile = r_ok[:, None] & c_ok[None, :]
        at = h * DK * DV + r[:, None] * DV + c[None, :]
        if HAS_INIT:
            s = tl.load(s0_ptr + at, mask=tile, other=0.0).to(tl.float32)
        else:
            s = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
        lam = tl.exp(-tl.load(slope_ptr + h).to(tl.float32))
        # STATIC_L: the loop end under the interpreter, -1 compiled (kernels.static_loop_end);
        # the row pointers advance by their strides (64-bit pointer arithmetic: no int32 t * stride)
        qp, kp, vp, op = q_ptr + h * sq_h + r, k_ptr + h * sk_h + r, v_ptr + h * sv_h + c, o_ptr + h * so_h + c
        for _ in range(0, STATIC_L if STATIC_L >= 0 else L):
            q = tl.load(qp, mask=r_ok, other=0.0).to(tl.float32)
            k = tl.load(kp, mask=r_ok, other=0.0).to(tl.float32)
            v = tl.load(vp, mask=c_ok, other=0.0).to(tl.float32)
            s = s * lam + k[:, None] * v[None, :]
            tl.store(op, tl.sum(q[:, None] * s, axis=0), mask=c_ok)
            qp += sq_l
            kp += sk_l
            vp += sv_l
            op += so_l
        tl.store(sf_ptr + at, s, mask=tile)

    return triton, _step, _scan


def _unit_last(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


@register_kernel('lightning_attention_step', device_type='cuda', priority=10, available=triton_available)
def lightning_attention_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                                    state: torch.Tensor) -> torch.Tensor:
    """One decode token for ``M`` sequences (the contract of the torch ``lightning_attention_step``),
    the state updated in place.

    Args:
        q, k: ``[M, H, d_k]``; v: ``[M, H, d_v]``; slope: float32 ``[H]``.
        state: float32 ``[M, H, d_k, d_v]`` with unit stride along ``d_v`` (views of cache rows are fine).

    Returns:
        float32 ``o [M, H, d_v]``.

    Raises:
        ValueError: a state that is not float32 or has no unit stride along ``d_v``.
    """
    M, H, DK, DV = state.shape
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f'state must be float32 with unit stride along d_v; got {state.dtype}, '
                         f'strides {state.stride()}')
    o = torch.empty(M, H, DV, dtype=torch.float32, device=q.device)
    if M == 0 or H == 0:
        return o
    triton, step, _ = _kernels()
    q, k, v = _unit_last(q, k, v)
    step[(M, H, triton.cdiv(DV, _BLOCK_V))](
        q, k, v, slope.float().contiguous(), state, o, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1), DK, DV,
        BLOCK_K=max(16, triton.next_power_of_2(DK)), BLOCK_V=_BLOCK_V)
    return o


@register_kernel('lightning_attention_chunk', device_type='cuda', priority=10, available=triton_available)
def lightning_attention_chunk_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                                     initial_state: torch.Tensor | None, chunk_size: int = 64
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence of ``L`` tokens (the contract of the torch
    ``lightning_attention_chunk``).

    Args:
        q, k: ``[L, H, d_k]``; v: ``[L, H, d_v]``; slope: float32 ``[H]``.
        initial_state: float32 ``[H, d_k, d_v]`` or None (zeros). Read only.
        chunk_size: the torch path's chunk; not used here (the kernel walks token by token).

    Returns:
        ``(o [L, H, d_v] float32, final state [H, d_k, d_v] float32)``.
    """
    L, H, DK = q.shape
    DV = v.shape[2]
    o = torch.empty(L, H, DV, dtype=torch.float32, device=q.device)
    final = torch.empty(H, DK, DV, dtype=torch.float32, device=q.device)
    if H == 0:
        return o, final
    if L == 0:
        final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    triton, _, scan = _kernels()
    q, k, v = _unit_last(q, k, v)
    init = None if initial_state is None else initial_state.float().contiguous()
    scan[(H, triton.cdiv(DV, _BLOCK_V))](
        q, k, v, slope.float().contiguous(), final if init is None else init, o, final, L,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        DK, DV, HAS_INIT=init is not None, BLOCK_K=max(16, triton.next_power_of_2(DK)), BLOCK_V=_BLOCK_V,
        STATIC_L=static_loop_end(scan, L))
    return o, final
