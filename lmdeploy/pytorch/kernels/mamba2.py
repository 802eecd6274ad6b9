"""Mamba-2 state space duality (SSD) in plain torch: the chunked scan, the one-token step, and
their varlen driver over the engine's state slots; plus Mamba-2's grouped gated RMS norm.

Recurrence (Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", ICML 2024, sec. 3 and 7), per head ``h`` with a scalar
decay and a state ``S [P, Dn]`` (``P`` head channels, ``Dn`` state size)::

    a_t = dt_t * A_h                          # A_h < 0, dt_t > 0: a log decay
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T   # x_t [P], B_t [Dn]
    y_t = S_t C_t + D_h x_t

Heads share their ``B`` and ``C`` within a group: head ``h`` reads group ``h // (H / G)``.

Chunked form (the SSD algorithm, sec. 7): split the sequence into chunks of ``Q`` tokens; with
the within-chunk cumulative log decays ``c_i = a_1 + ... + a_i`` and the chunk's start state
``S0``::

    y_i   = exp(c_i) S0 C_i + sum_{j<=i} exp(c_i - c_j) (C_i . B_j) dt_j x_j     (+ D x_i)
    S_end = exp(c_Q) S0     + sum_j      exp(c_Q - c_j) dt_j x_j B_j^T

The intra-chunk part is a masked ``[Q, Q]`` matrix product for every chunk at once; only the
chunk-to-chunk state hand-over is sequential. A last, partial chunk is padded with ``dt = 0``
tokens, which neither decay nor write the state.

Invariants: ``dt`` arrives already as ``softplus(dt_raw + dt_bias)`` clamped to the model's
limits (the caller owns those rules); states are float32; :func:`ssd_chunk_scan` never modifies
its initial state; :func:`mamba2_ssd_varlen` rewrites exactly the slots it is given, and a
sequence without history starts from a zero state whatever its slot holds.

Registered ops (names shared with the native CPU and Triton implementations): ``ssd_chunk_scan``,
``ssd_step``, ``mamba2_ssd_varlen``, ``grouped_gated_rms_norm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import get_kernel, register_kernel
from .state_varlen import ssm_varlen

__all__ = ['ssd_chunk_scan', 'ssd_step', 'mamba2_ssd_varlen', 'grouped_gated_rms_norm', 'ssd_recurrent_reference']


def _check(x, dt, A, B, C, D):
    """Validate shapes; returns ``(H, P, G, Dn)``."""
    if x.dim() != 3 or dt.shape != x.shape[:2] or A.shape != x.shape[1:2] or D.shape != x.shape[1:2]:
        raise ValueError(f'x must be [L, H, P], dt [L, H], A and D [H]; got x {tuple(x.shape)}, dt {tuple(dt.shape)}, '
                         f'A {tuple(A.shape)}, D {tuple(D.shape)}')
    H, P = x.shape[1:]
    if B.dim() != 3 or C.shape != B.shape or B.shape[0] != x.shape[0] or H % B.shape[1]:
        raise ValueError(f'B and C must be [L, G, Dn] with G dividing H = {H}; got B {tuple(B.shape)}, '
                         f'C {tuple(C.shape)}')
    return H, P, B.shape[1], B.shape[2]


def _per_head(t: torch.Tensor, H: int) -> torch.Tensor:
    """``[..., G, Dn]`` → float32 ``[..., H, Dn]``: each group's row repeated for its heads."""
    t = t.float()
    return t if t.shape[-2] == H else t.repeat_interleave(H // t.shape[-2], dim=-2)


@register_kernel('ssd_chunk_scan', device_type='any')
def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, initial_state: torch.Tensor | None, chunk_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the SSD chunked algorithm (module docstring).

    Args:
        x: ``[L, H, P]`` inputs (any float dtype), ``L >= 0``.
        dt: ``[L, H]`` float32 step sizes (already softplus'd, biased and clamped).
        A: ``[H]`` float32, negative (``-exp(A_log)``).
        B, C: ``[L, G, Dn]``, ``G`` dividing ``H``.
        D: ``[H]`` skip weights.
        initial_state: ``[H, P, Dn]`` float32, or None (zeros). Read only.
        chunk_size: tokens per chunk ``Q`` (any ``L`` works; the last chunk may be partial).
            Memory: ``H * L * Q`` float32 for the intra-chunk scores.

    Returns:
        ``(y [L, H, P] float32 including D * x, final state [H, P, Dn] float32)``.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    if chunk_size <= 0:
        raise ValueError(f'chunk_size must be positive, got {chunk_size}')
    H, P, G, Dn = _check(x, dt, A, B, C, D)
    if initial_state is not None and initial_state.shape != (H, P, Dn):
        raise ValueError(f'initial_state must be [H, P, Dn] = {(H, P, Dn)}; got {tuple(initial_state.shape)}')
    # a sequence shorter than a chunk is one chunk of its own length (the result does not depend on
    # the chunk size; a 32-token prefill chunk then costs [32, 32] scores, not [128, 128])
    L = x.shape[0]
    Q = max(1, min(chunk_size, L))
    state = x.new_zeros(H, P, Dn, dtype=torch.float32) if initial_state is None else initial_state.float()
    if L == 0:
        return x.new_zeros(0, H, P, dtype=torch.float32), state.clone()
    xf = x.float()
    skip = D.float()[:, None] * xf
    pad = (-L) % Q
    N = (L + pad) // Q
    xdt = F.pad(xf * dt.float()[..., None], (0, 0, 0, 0, 0, pad))            # [N*Q, H, P]
    a = F.pad(dt.float() * A.float(), (0, 0, 0, pad))                         # [N*Q, H]; padding: no decay
    Bh, Ch = (F.pad(_per_head(t, H), (0, 0, 0, 0, 0, pad)) for t in (B, C))  # [N*Q, H, Dn]
    # head-major chunks: [H, N, Q, ...]
    xdt = xdt.view(N, Q, H, P).permute(2, 0, 1, 3)
    Bh, Ch = (t.view(N, Q, H, Dn).permute(2, 0, 1, 3) for t in (Bh, Ch))
    cum = a.view(N, Q, H).permute(2, 0, 1).cumsum(-1)                         # [H, N, Q]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    # exp(c_i - c_j) for j <= i; masked before exp so the (positive) upper triangle cannot overflow
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float('-inf')).exp()
    scores = (Ch @ Bh.transpose(-1, -2)) * decay                             # [H, N, Q, Q]
    y = scores @ xdt                                                          # intra-chunk part
    to_end = (cum[..., -1:] - cum).exp()                                      # [H, N, Q]
    writes = (xdt * to_end[..., None]).transpose(-1, -2) @ Bh                 # [H, N, P, Dn]
    chunk_decay = cum[..., -1].exp()                                          # [H, N]
    starts = []
    for n in range(N):
        starts.append(state)
        state = chunk_decay[:, n, None, None] * state + writes[:, n]
    start = torch.stack(starts, dim=1)                                        # [H, N, P, Dn]
    y = y + (Ch * cum.exp()[..., None]) @ start.transpose(-1, -2)             # from each chunk's start state
    y = y.permute(1, 2, 0, 3).reshape(N * Q, H, P)[:L]
    return y + skip, state


@register_kernel('ssd_step', device_type='any')
def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of ``N`` sequences (decode).

    Args:
        x: ``[N, H, P]``; dt: ``[N, H]`` float32 (as in :func:`ssd_chunk_scan`); A, D: ``[H]``.
        B, C: ``[N, G, Dn]``.
        state: ``[N, H, P, Dn]`` float32, updated in place to the state after the token.

    Returns:
        ``y [N, H, P]`` float32 including ``D * x``.

    Raises:
        ValueError: inconsistent shapes.
    """
    H, P, G, Dn = _check(x, dt, A, B, C, D)
    if state.shape != (x.shape[0], H, P, Dn):
        raise ValueError(f'state must be [N, H, P, Dn] = {(x.shape[0], H, P, Dn)}; got {tuple(state.shape)}')
    xf, dtf = x.float(), dt.float()
    Bh, Ch = _per_head(B, H), _per_head(C, H)                                 # [N, H, Dn]
    state.mul_((dtf * A.float()).exp()[..., None, None])
    state.addcmul_((xf * dtf[..., None])[..., :, None], Bh[..., None, :])     # no [N, H, P, Dn] temporary
    # a dot product over Dn, not ``state @ C``: a batched matmul of [P, Dn] x [Dn, 1] pieces measured
    # ~1000x slower on CPU (12 ms vs 12 us per call at N=1, H=8, P=32, Dn=64)
    return torch.linalg.vecdot(state, Ch[..., None, :]) + D.float()[:, None] * xf


def ssd_recurrent_reference(x, dt, A, B, C, D, initial_state=None):
    """Token-by-token float64 form of the recurrence (the test reference; not registered):
    arguments as :func:`ssd_chunk_scan`; returns ``(y [L, H, P], state [H, P, Dn])`` float64."""
    H, P, G, Dn = _check(x, dt, A, B, C, D)
    state = torch.zeros(H, P, Dn, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    ys = []
    r = H // G
    for t in range(x.shape[0]):
        for h in range(H):
            g = h // r
            state[h] = torch.exp(dt[t, h].double() * A[h].double()) * state[h] \
                + dt[t, h].double() * torch.outer(x[t, h].double(), B[t, g].double())
        y = torch.stack([state[h] @ C[t, h // r].double() for h in range(H)])
        ys.append(y + D.double()[:, None] * x[t].double())
    y = torch.stack(ys) if ys else torch.zeros(0, H, P, dtype=torch.float64)
    return y, state


@register_kernel('mamba2_ssd_varlen', device_type='any')
def mamba2_ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, state_cache: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      has_history: torch.Tensor, chunk_size: int, slot_span=...) -> torch.Tensor:
    """SSD over a flat batch of sequences, each continuing its state slot.

    Single-token sequences run together through ``ssd_step``; longer ones one at a time through
    ``ssd_chunk_scan`` (both looked up in the registry for the device, so accelerated versions
    are used where registered), by :func:`~.state_varlen.ssm_varlen`.

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` float32; A, D: ``[H]``; B, C: ``[T, G, Dn]``.
        state_cache: ``[num_slots, H, P, Dn]`` float32 (may be a strided view); rows ``slots``
            are read, then overwritten with each sequence's state after its last row.
        cu_seqlens: int64 ``[N + 1]`` row offsets (every sequence has >= 1 row);
        slots: int64 ``[N]`` distinct slots; has_history: bool ``[N]`` (False: start from zeros).
        chunk_size: the SSD chunk size.
        slot_span: :func:`~lmdeploy.pytorch.kernels.slot_range` of ``slots`` when the caller has
            it (``StepContext.slot_span``), else computed here.

    Returns:
        ``y [T, H, P]`` float32 including ``D * x``.
    """
    step, scan = get_kernel('ssd_step', x.device), get_kernel('ssd_chunk_scan', x.device)
    return ssm_varlen(step, scan, x, dt, A, B, C, D, state_cache, cu_seqlens, slots, has_history, chunk_size,
                      slot_span)


@register_kernel('grouped_gated_rms_norm', device_type='any')
def grouped_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                           eps: float) -> torch.Tensor:
    """Mamba-2's output norm, gate first: ``h = x * silu(z)`` in float32, RMS-normalised over each
    run of ``group_size`` channels, then ``weight * h`` (``h`` rounded to ``x.dtype`` first).

    The gate is applied before the norm (Mamba-2's ``norm_before_gate=False``), unlike
    ``gated_rms_norm`` (Gated DeltaNet: ``w * rms(x) * silu(z)``).

    Args:
        x, z: ``[..., D]``, ``D`` a multiple of ``group_size``; weight: ``[D]``.

    Returns:
        ``[..., D]`` in the promoted dtype of ``weight`` and ``x`` (``x.dtype`` when they agree).

    Raises:
        ValueError: ``group_size`` does not divide ``D``.
    """
    D = x.shape[-1]
    if group_size <= 0 or D % group_size or z.shape != x.shape or weight.shape != (D,):
        raise ValueError(f'x and z must be [..., D] with group_size ({group_size}) dividing D and weight [D]; got '
                         f'x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}')
    h = x.float() * F.silu(z.float())
    g = h.view(*h.shape[:-1], D // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(h.shape).to(x.dtype)
