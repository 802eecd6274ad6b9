"""The CPU implementation of the Mamba-1 decode step ``selective_scan_step``: one native pass over
the state (:func:`selective_scan_step_native`, C source ``lm_selective_step`` in
``csrc/cpu_native.c``, built and loaded with the other native kernels by :mod:`.cpu_native`), else
the torch step.

A decode step reads and writes each sequence's whole SSM state ``[D, N]`` once. The torch form
issues several ops (the decay's product and exp, an in-place multiply, an outer-product add, a
dot product with ``C``, the skip), each streaming the state or a temporary of its size; the native
pass updates each state row (its exponentials by a vectorizable polynomial, ``expf_nonpos`` in
the C source, ~1e-7 relative) and dots it with ``C`` while the row is in cache, in one call.
Measured on the 2-core machine (a Falcon-Mamba-7B layer: 8192 channels x state 16, float32, one
thread, best of 7, the machine shared with other jobs):

    sequences      1          16
    torch        0.27 ms    5.6 ms
    native       0.13 ms    2.0 ms
"""
from __future__ import annotations

import torch

from . import register_kernel
from .cpu_native import CALLS, native_available, state_step_library
from .mamba1 import selective_scan_step as selective_scan_step_torch

__all__ = ['selective_scan_step_native', 'selective_scan_step_cpu']


def selective_scan_step_native(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                               D: torch.Tensor, state: torch.Tensor) -> torch.Tensor | None:
    """One decode token of the Mamba-1 recurrence for ``M`` sequences, the state updated in place,
    or ``None`` when the native kernel does not apply (the caller runs torch).

    ``S[d] <- exp(dt[d] A[d]) * S[d] + dt[d] x[d] B``; ``y[d] = S[d] . C + D[d] x[d]`` (Gu & Dao,
    "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023, Algorithm 2).

    Args:
        x: float32 ``[M, D]``; dt: float32 ``[M, D]`` (already biased and softplus'd).
        A: float32 ``[D, N]`` (negative); D: float32 ``[D]`` skip weights.
        B, C: float32 ``[M, N]``.
        state: float32 ``[M, D, N]`` with unit stride along ``N`` (a view of the cache's rows is
            fine); updated in place.

    Returns:
        float32 ``y [M, D]``, or ``None`` (dtype, device, shapes, strides, autograd, or no
        library).
    """
    if state.dim() != 3:
        return None
    M, Dd, N = state.shape
    lib = state_step_library((x, dt, A, B, C, D), state, x.shape == dt.shape == (M, Dd) and A.shape == (Dd, N)
                             and B.shape == C.shape == (M, N) and D.shape == (Dd,))
    if lib is None:
        return None
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    y = torch.empty(M, Dd, dtype=torch.float32)
    if M and Dd:
        CALLS['selective_scan_step'] += 1
        lib.lm_selective_step(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                              state.data_ptr(), M, Dd, N, state.stride(0), state.stride(1), y.data_ptr(),
                              torch.get_num_threads())
    return y


@register_kernel('selective_scan_step', device_type='cpu', priority=5, available=native_available)
def selective_scan_step_cpu(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                            D: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """:func:`~.mamba1.selective_scan_step` on CPU (same contract: float32 ``y [M, D]``, the
    state updated in place): one native pass for float32 inputs, else the torch step."""
    y = selective_scan_step_native(x, dt, A, B, C, D, state)
    return selective_scan_step_torch(x, dt, A, B, C, D, state) if y is None else y
