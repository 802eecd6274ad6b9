"""The CPU implementation of the Mamba-2 decode step ``ssd_step``: one native pass over the state
(:func:`ssd_step_native`, C source ``lm_ssd_step`` in ``csrc/cpu_native.c``, built and loaded with
the other native kernels by :mod:`.cpu_native`), else the torch step.

A decode step reads and writes each sequence's whole SSM state ``[H, P, Dn]`` once. The torch
form issues about ten ops (exp, broadcasts, an outer product, a multiply-add, a batched
matrix-vector product, the skip), each streaming the state or a temporary of its size; the
native pass updates each state row and dots it with ``C`` while the row is in registers, in one
call. A decode step whose sequences hold one run of slots (the usual case: see
:func:`~lmdeploy.pytorch.kernels.slot_range`) runs on that slice of the cache in place (the
varlen driver, :func:`~.state_varlen.varlen_state_scan`, does that for every state op), without
gathering the states into a copy and scattering them back.
Measured on the 2-core machine (Granite-4.0-H-Small's layer: 128 heads x 64 x 128 state,
float32, one thread, best of 5, the machine shared with other jobs, load ~3):

    sequences      1          16
    torch        1.6 ms     141 ms
    native       0.10 ms    8.1 ms
"""
from __future__ import annotations

import torch

from . import register_kernel
from .cpu_native import CALLS, native_available, state_step_library
from .mamba2 import ssd_step as ssd_step_torch

__all__ = ['ssd_step_native', 'ssd_step_cpu']


def ssd_step_native(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, state: torch.Tensor) -> torch.Tensor | None:
    """One decode token of the Mamba-2 recurrence for ``N`` sequences, the state updated in
    place, or ``None`` when the native kernel does not apply (the caller runs torch).

    ``a = exp(dt A)``; ``S <- a S + dt x B^T``; ``y = S C + D x`` per head, heads split into
    ``G`` equal groups that share ``B`` and ``C`` (Dao & Gu, "Transformers are SSMs:
    Generalized Models and Efficient Algorithms Through Structured State Space Duality",
    ICML 2024, the SSD recurrence).

    Args:
        x: float32 ``[N, H, P]``.
        dt: float32 ``[N, H]``, the step sizes (already ``softplus(dt + dt_bias)``, clamped).
        A: float32 ``[H]`` (negative).
        B, C: float32 ``[N, G, Dn]`` with ``H % G == 0``.
        D: float32 ``[H]`` skip weights, or ``None`` (no skip).
        state: float32 ``[N, H, P, Dn]`` with unit stride along ``Dn`` (a view of the cache's
            rows is fine); updated in place.

    Returns:
        float32 ``y [N, H, P]``, or ``None`` (dtype, device, shapes, strides, autograd, or no
        library).
    """
    if state.dim() != 4:
        return None
    N, H, P, Dn = state.shape
    G = B.shape[1] if B.dim() == 3 else 0
    lib = state_step_library((x, dt, A, B, C) + (() if D is None else (D,)), state,
                             G and H % G == 0 and x.shape == (N, H, P) and dt.shape == (N, H) and A.shape == (H,)
                             and B.shape == C.shape == (N, G, Dn) and (D is None or D.shape == (H,)))
    if lib is None:
        return None
    x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
    D = None if D is None else D.contiguous()
    y = torch.empty(N, H, P, dtype=torch.float32)
    if N and H and P:
        CALLS['ssd_step'] += 1
        lib.lm_ssd_step(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
                        None if D is None else D.data_ptr(), state.data_ptr(), N, H, P, G, Dn, state.stride(0),
                        state.stride(1), state.stride(2), y.data_ptr(), torch.get_num_threads())
    return y


@register_kernel('ssd_step', device_type='cpu', priority=5, available=native_available)
def ssd_step_cpu(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """:func:`~.mamba2.ssd_step` on CPU (same contract: float32 ``y [N, H, P]``, the state
    updated in place): one native pass for float32 inputs, else the torch step."""
    y = ssd_step_native(x, dt, A, B, C, D, state)
    return ssd_step_torch(x, dt, A, B, C, D, state) if y is None else y
