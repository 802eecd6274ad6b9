"""Lightning attention (MiniMax-01, 2025; Qin et al., "Lightning Attention-2", 2024) in plain
torch: linear attention with one fixed exponential decay per head, the chunked form of one
sequence, the one-token step, and their varlen driver over the engine's state slots.

Recurrence per head ``h`` with decay rate ``s_h > 0`` (``lambda_h = exp(-s_h)``) and a state
``S [d_k, d_v]``::

    S_t = lambda_h S_{t-1} + k_t^T v_t;      o_t = q_t S_t

Chunked form: split the sequence into chunks of ``Q`` tokens; inside a chunk starting from
``S0``, with ``i, j`` the positions in the chunk (0-based)::

    o_i   = lambda^(i+1) q_i S0 + sum_{j<=i} lambda^(i-j) (q_i . k_j) v_j
    S_end = lambda^Q S0 + sum_j lambda^(Q-1-j) k_j^T v_j

one masked ``[Q, Q]`` decay matrix per head (``exp(-s (i - j))`` below the diagonal, zero above;
the exponent is never positive, so nothing overflows). Only the chunk-to-chunk hand-over is
sequential. The chunk size does not change the result beyond rounding.

Invariants: states are float32; :func:`lightning_attention_chunk` never modifies its initial
state; :func:`lightning_attention_varlen` rewrites exactly the slots it is given, and a sequence
without history starts from a zero state whatever its slot holds. The activation of q / k / v,
the output norm and gate are the caller's.

Registered ops (names a Triton implementation registers under):
``lightning_attention_chunk``, ``lightning_attention_step``, ``lightning_attention_varlen``.
"""
from __future__ import annotations

import torch

from . import get_kernel, register_kernel
from .state_varlen import varlen_state_scan

__all__ = ['lightning_attention_chunk', 'lightning_attention_step', 'lightning_attention_varlen',
           'lightning_attention_reference']


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes; returns ``(H, d_k, d_v)``."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f'q and k must be [L, H, d_k], v [L, H, d_v]; got q {tuple(q.shape)}, k {tuple(k.shape)}, '
                         f'v {tuple(v.shape)}')
    if slope.shape != (q.shape[1],):
        raise ValueError(f'slope must be [H] = {(q.shape[1],)}; got {tuple(slope.shape)}')
    return q.shape[1], q.shape[2], v.shape[2]


@register_kernel('lightning_attention_chunk', device_type='any')
def lightning_attention_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                              initial_state: torch.Tensor | None, chunk_size: int = 64
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the chunked recurrence (module docstring).

    Args:
        q, k: ``[L, H, d_k]``; v: ``[L, H, d_v]`` (any float dtype), ``L >= 0``.
        slope: ``[H]`` float32 decay rates ``s_h > 0`` (``lambda_h = exp(-s_h)`` per token).
        initial_state: ``[H, d_k, d_v]`` float32, or None (zeros). Read only.
        chunk_size: tokens per chunk.

    Returns:
        ``(o [L, H, d_v] float32, final state [H, d_k, d_v] float32)``.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    if chunk_size <= 0:
        raise ValueError(f'chunk_size must be positive, got {chunk_size}')
    H, dk, dv = _check(q, k, v, slope)
    if initial_state is not None and initial_state.shape != (H, dk, dv):
        raise ValueError(f'initial_state must be [H, d_k, d_v] = {(H, dk, dv)}; got {tuple(initial_state.shape)}')
    L = q.shape[0]
    state = q.new_zeros(H, dk, dv, dtype=torch.float32) if initial_state is None else initial_state.float()
    out = q.new_empty(L, H, dv, dtype=torch.float32)
    if L == 0:
        return out, state.clone()
    s = slope.float().view(H, 1, 1)
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))              # [H, L, d]
    for start in range(0, L, chunk_size):
        end = min(L, start + chunk_size)
        n = end - start
        pos = torch.arange(n, device=q.device, dtype=torch.float32)
        gap = pos[:, None] - pos[None, :]                                       # i - j
        decay = torch.exp(-s * gap.clamp(min=0)).masked_fill(gap < 0, 0.0)     # [H, n, n]
        qc, kc, vc = qf[:, start:end], kf[:, start:end], vf[:, start:end]
        intra = ((qc @ kc.transpose(1, 2)) * decay) @ vc
        inter = (qc * torch.exp(-s * (pos[None, :, None] + 1))) @ state
        out[start:end] = (intra + inter).transpose(0, 1)
        state = torch.exp(-s * n) * state + (kc * torch.exp(-s * (n - 1 - pos)[None, :, None])).transpose(1, 2) @ vc
    return out, state.clone()


@register_kernel('lightning_attention_step', device_type='any')
def lightning_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                             state: torch.Tensor) -> torch.Tensor:
    """One token for each of ``M`` sequences (decode).

    Args:
        q, k: ``[M, H, d_k]``; v: ``[M, H, d_v]``; slope: ``[H]`` float32.
        state: ``[M, H, d_k, d_v]`` float32, updated in place to the state after the token.

    Returns:
        ``o [M, H, d_v]`` float32.

    Raises:
        ValueError: inconsistent shapes.
    """
    H, dk, dv = _check(q, k, v, slope)
    if state.shape != (q.shape[0], H, dk, dv):
        raise ValueError(f'state must be [M, H, d_k, d_v] = {(q.shape[0], H, dk, dv)}; got {tuple(state.shape)}')
    state.mul_(torch.exp(-slope.float()).view(1, H, 1, 1))
    state.add_(k.float()[..., :, None] * v.float()[..., None, :])
    return (q.float()[..., None, :] @ state)[..., 0, :]


def lightning_attention_reference(q, k, v, slope, initial_state=None):
    """Token-by-token float64 form of the recurrence (the test reference; not registered):
    arguments as :func:`lightning_attention_chunk`; returns ``(o [L, H, d_v], state [H, d_k, d_v])``
    float64."""
    H, dk, dv = _check(q, k, v, slope)
    state = torch.zeros(H, dk, dv, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    lam = torch.exp(-slope.double()).view(H, 1, 1)
    outs = []
    for t in range(q.shape[0]):
        state = lam * state + k[t].double()[:, :, None] * v[t].double()[:, None, :]
        outs.append((q[t].double()[:, None, :] @ state)[:, 0])
    o = torch.stack(outs) if outs else torch.zeros(0, H, dv, dtype=torch.float64)
    return o, state


@register_kernel('lightning_attention_varlen', device_type='any')
def lightning_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                               state_cache: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                               has_history: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Lightning attention over a flat batch of sequences, each continuing its state slot.

    Single-token sequences run together through ``lightning_attention_step``; longer ones one at
    a time through ``lightning_attention_chunk`` (both looked up in the registry for the device),
    by the shared varlen driver :func:`~.state_varlen.varlen_state_scan` with rows ``q, k, v`` and
    ``slope`` shared.

    Args:
        q, k: ``[T, H, d_k]``; v: ``[T, H, d_v]``; slope: ``[H]`` float32.
        state_cache: ``[num_slots, H, d_k, d_v]`` float32 (may be a strided view); rows ``slots``
            are read, then overwritten with each sequence's state after its last row.
        cu_seqlens: int64 ``[M + 1]`` row offsets (every sequence has >= 1 row);
        slots: int64 ``[M]`` distinct slots; has_history: bool ``[M]`` (False: start from zeros).
        chunk_size: tokens per chunk of the chunked form.

    Returns:
        ``o [T, H, d_v]`` float32.

    Raises:
        ValueError: inconsistent shapes.
    """
    _check(q, k, v, slope)
    step = get_kernel('lightning_attention_step', q.device)
    chunk = get_kernel('lightning_attention_chunk', q.device)
    return varlen_state_scan(
        (q, k, v), state_cache, cu_seqlens, slots, has_history,
        step=lambda q, k, v, state: step(q, k, v, slope, state),
        chunk=lambda q, k, v, initial: chunk(q, k, v, slope, initial, chunk_size),
        out_shape=v.shape[1:], out_dtype=torch.float32)
