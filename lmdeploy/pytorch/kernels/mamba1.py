"""Mamba-1 selective scan in plain torch: the chunked scan of one sequence, the one-token step,
and their varlen driver over the engine's state slots.

Recurrence (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023,
sec. 3.2, Algorithm 2), per channel ``d`` of ``D`` with a state row ``S[d] [N]``::

    a_t[d, n] = dt_t[d] * A[d, n]                 # A < 0, dt > 0: a log decay per (channel, state)
    S_t[d, n] = exp(a_t[d, n]) S_{t-1}[d, n] + dt_t[d] x_t[d] B_t[n]
    y_t[d]    = sum_n S_t[d, n] C_t[n] + D[d] x_t[d]

Unlike Mamba-2 (one scalar decay per head) the decay differs per state entry, so the scan has no
matrix-product (SSD) form. Chunked form: split the sequence into chunks of ``Q`` tokens; inside a
chunk the pairs ``(exp(a_t), dt_t x_t B_t)`` of the linear recurrence ``S_t = e^{a_t} S_{t-1} +
b_t`` are combined by a log-step parallel scan (:func:`_scan_in_place`: ``ceil(log2 Q)``
vectorised steps over ``[Q, D, N]`` tensors, memory linear in ``Q``), which gives every token's
state from a zero start and the product of its decays since the chunk start::

    S_i = (e^{a_1} ... e^{a_i}) S0 + scan_i          (S0: the chunk's start state)

then ``y_i = S_i . C_i``. Only the chunk-to-chunk hand-over is sequential. ``Q`` is the caller's
``chunk_size``, cut so a ``[Q, D, N]`` tensor stays under :data:`CHUNK_ELEMENTS` elements; a
short chunk (16 tokens) keeps those tensors in the CPU cache and the log-step count low. Decays
are only ever multiplied (never subtracted as cumulative logs), so nothing overflows.

Invariants: ``dt`` arrives already as ``softplus(dt_proj(..) + dt_bias)`` (the caller owns that);
states are float32; :func:`selective_scan_chunk` never modifies its initial state;
:func:`selective_scan_varlen` rewrites exactly the slots it is given, and a sequence without
history starts from a zero state whatever its slot holds. The output gate ``y * silu(z)`` is the
caller's.

Registered ops (names a Triton or native CPU implementation registers under):
``selective_scan_chunk``, ``selective_scan_step``, ``selective_scan_varlen``.
"""
from __future__ import annotations

import torch

from . import get_kernel, register_kernel
from .state_varlen import ssm_varlen

__all__ = ['selective_scan_chunk', 'selective_scan_step', 'selective_scan_varlen', 'selective_scan_reference',
           'CHUNK_ELEMENTS']

# the largest per-chunk tensor [Q, D, N] (float32 elements) the torch scan builds
CHUNK_ELEMENTS = 1 << 22


def _check(x, dt, A, B, C, D):
    """Validate shapes; returns ``(D, N)``."""
    if x.dim() != 2 or dt.shape != x.shape or A.dim() != 2 or A.shape[0] != x.shape[1] or D.shape != x.shape[1:]:
        raise ValueError(f'x and dt must be [L, D], A [D, N], D [D]; got x {tuple(x.shape)}, dt {tuple(dt.shape)}, '
                         f'A {tuple(A.shape)}, D {tuple(D.shape)}')
    if B.shape != (x.shape[0], A.shape[1]) or C.shape != B.shape:
        raise ValueError(f'B and C must be [L, N] = {(x.shape[0], A.shape[1])}; got B {tuple(B.shape)}, '
                         f'C {tuple(C.shape)}')
    return A.shape


def chunk_tokens(chunk_size: int, d: int, n: int) -> int:
    """Tokens per chunk: ``chunk_size``, cut so the chunk's ``[Q, d, n]`` float32 decays and
    inputs stay under :data:`CHUNK_ELEMENTS` elements each (at least 1)."""
    return max(1, min(chunk_size, CHUNK_ELEMENTS // max(1, d * n)))


def _scan_in_place(decay: torch.Tensor, inp: torch.Tensor) -> None:
    """The linear recurrence ``S_i = decay_i * S_{i-1} + inp_i`` (``S_{-1} = 0``) along axis 0 of
    two ``[q, ...]`` float32 tensors, in ``ceil(log2 q)`` vectorised steps; on return ``inp[i]``
    is ``S_i`` and ``decay[i]`` the product ``decay_0 * ... * decay_i``.

    The pairs ``(decay, inp)`` compose associatively (``(a1, b1)`` then ``(a2, b2)`` is
    ``(a1 a2, a2 b1 + b2)``), so after the step of offset ``k = 1, 2, 4, ...`` row ``i`` holds
    the composition of rows ``(i - 2k, i]`` (Hillis & Steele, "Data Parallel Algorithms", CACM
    1986). Memory stays linear in ``q``, and the decays are multiplied, never divided or taken as
    differences of cumulative logs, so nothing overflows and no precision is lost to cancellation
    (products of values in ``(0, 1]`` can only underflow to 0, their limit).
    """
    q, k = decay.shape[0], 1
    while k < q:
        carried = decay[k:] * inp[:-k]          # both right-hand sides are read before either write
        composed = decay[k:] * decay[:-k]
        inp[k:] += carried
        decay[k:] = composed
        k *= 2


@register_kernel('selective_scan_chunk', device_type='any')
def selective_scan_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         D: torch.Tensor, initial_state: torch.Tensor | None, chunk_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the chunked selective scan (module docstring).

    Args:
        x: ``[L, D]`` inputs (any float dtype), ``L >= 0``.
        dt: ``[L, D]`` float32 step sizes (already biased and softplus'd).
        A: ``[D, N]`` float32, negative (``-exp(A_log)``).
        B, C: ``[L, N]``.
        D: ``[D]`` skip weights.
        initial_state: ``[D, N]`` float32, or None (zeros). Read only.
        chunk_size: tokens per chunk (cut further by :func:`chunk_tokens`; the result does not
            depend on it beyond rounding).

    Returns:
        ``(y [L, D] float32 including D * x, final state [D, N] float32)``.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    if chunk_size <= 0:
        raise ValueError(f'chunk_size must be positive, got {chunk_size}')
    Dd, N = _check(x, dt, A, B, C, D)
    if initial_state is not None and initial_state.shape != (Dd, N):
        raise ValueError(f'initial_state must be [D, N] = {(Dd, N)}; got {tuple(initial_state.shape)}')
    L = x.shape[0]
    state = x.new_zeros(Dd, N, dtype=torch.float32) if initial_state is None else initial_state.float()
    out = x.new_empty(L, Dd, dtype=torch.float32)
    if L == 0:
        return out, state.clone()
    Q = chunk_tokens(chunk_size, Dd, N)
    xf, dtf, Af, Bf, Cf = x.float(), dt.float(), A.float(), B.float(), C.float()
    for s in range(0, L, Q):
        e = min(L, s + Q)
        decay = (dtf[s:e, :, None] * Af).exp_()                                     # [q, D, N] a_t
        inp = (dtf[s:e] * xf[s:e])[:, :, None] * Bf[s:e, None, :]                     # [q, D, N] b_t
        _scan_in_place(decay, inp)
        states = inp.addcmul_(decay, state)                                          # [q, D, N] S_i
        out[s:e] = torch.linalg.vecdot(states, Cf[s:e, None, :])
        state = states[-1]
    return out + D.float() * xf, state.clone()


@register_kernel('selective_scan_step', device_type='any')
def selective_scan_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of ``M`` sequences (decode).

    Args:
        x: ``[M, D]``; dt: ``[M, D]`` float32 (as in :func:`selective_scan_chunk`); A: ``[D, N]``;
            D: ``[D]``.
        B, C: ``[M, N]``.
        state: ``[M, D, N]`` float32, updated in place to the state after the token.

    Returns:
        ``y [M, D]`` float32 including ``D * x``.

    Raises:
        ValueError: inconsistent shapes.
    """
    Dd, N = _check(x, dt, A, B, C, D)
    if state.shape != (x.shape[0], Dd, N):
        raise ValueError(f'state must be [M, D, N] = {(x.shape[0], Dd, N)}; got {tuple(state.shape)}')
    xf, dtf = x.float(), dt.float()
    state.mul_((dtf[:, :, None] * A.float()).exp())
    state.addcmul_((dtf * xf)[:, :, None], B.float()[:, None, :])
    return torch.linalg.vecdot(state, C.float()[:, None, :]) + D.float() * xf


def selective_scan_reference(x, dt, A, B, C, D, initial_state=None):
    """Token-by-token float64 form of the recurrence (the test reference; not registered):
    arguments as :func:`selective_scan_chunk`; returns ``(y [L, D], state [D, N])`` float64."""
    Dd, N = _check(x, dt, A, B, C, D)
    state = torch.zeros(Dd, N, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    ys = []
    for t in range(x.shape[0]):
        state = torch.exp(dt[t].double()[:, None] * A.double()) * state \
            + (dt[t].double() * x[t].double())[:, None] * B[t].double()[None, :]
        ys.append(state @ C[t].double() + D.double() * x[t].double())
    y = torch.stack(ys) if ys else torch.zeros(0, Dd, dtype=torch.float64)
    return y, state


@register_kernel('selective_scan_varlen', device_type='any')
def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor, state_cache: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                          has_history: torch.Tensor, chunk_size: int, slot_span=...) -> torch.Tensor:
    """The selective scan over a flat batch of sequences, each continuing its state slot.

    Single-token sequences run together through ``selective_scan_step``; longer ones one at a
    time through ``selective_scan_chunk`` (both looked up in the registry for the device), by
    :func:`~.state_varlen.ssm_varlen`.

    Args:
        x: ``[T, D]``; dt: ``[T, D]`` float32; A: ``[D, N]``; D: ``[D]``; B, C: ``[T, N]``.
        state_cache: ``[num_slots, D, N]`` float32 (may be a strided view); rows ``slots`` are
            read, then overwritten with each sequence's state after its last row.
        cu_seqlens: int64 ``[M + 1]`` row offsets (every sequence has >= 1 row);
        slots: int64 ``[M]`` distinct slots; has_history: bool ``[M]`` (False: start from zeros).
        chunk_size: tokens per scan chunk.
        slot_span: :func:`~lmdeploy.pytorch.kernels.slot_range` of ``slots`` when the caller has
            it (``StepContext.slot_span``), else computed here.

    Returns:
        ``y [T, D]`` float32 including ``D * x``.
    """
    step, scan = get_kernel('selective_scan_step', x.device), get_kernel('selective_scan_chunk', x.device)
    return ssm_varlen(step, scan, x, dt, A, B, C, D, state_cache, cu_seqlens, slots, has_history, chunk_size,
                      slot_span)
