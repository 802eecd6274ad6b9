"""Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel.

Recurrence (Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", 2025),
per head, with state ``S [dk, dv]`` mapping keys to values and a log decay ``g_t [dk]`` (one
per key channel, where Gated DeltaNet has one per head)::

    S_t = diag(exp(g_t)) S_{t-1}                      # per-channel decay, g_t <= 0
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T    # delta rule
    o_t = S_t^T q_t

``q`` and ``k`` are optionally L2-normalised (eps 1e-6 inside the root) and ``q`` is scaled by
``dk ** -0.5``. Implementations:

- :func:`recurrent_kda` steps token by token (the reference, and decode);
- :func:`chunk_kda` is the chunkwise WY form: within a chunk with cumulative log decays
  ``G_i = sum_{j<=i} g_j`` (a vector per token), the written rows ``U`` solve one unit
  lower-triangular system whose coefficients use ``exp(G_i - G_j)`` channel by channel;
- ``kda_decode_step`` (:func:`kda_decode_step_torch`; on CPU :func:`kda_decode_step_cpu`, the
  native kernel of :mod:`.cpu_native`) is one token of every decode sequence, batched;
- :func:`kda_varlen` runs a step's flat batch against the state slots (decode sequences in
  one batched step through ``kda_decode_step``, longer ones through the chunked form).

On CUDA, with ``fla-core`` >= 0.6 installed, ``chunk_kda``, ``recurrent_kda`` and
``kda_decode_step`` are fla's Triton kernels (``fla.ops.kda``, imported only when chosen).

Invariants as in :mod:`.gated_delta_rule`: states are float32; the single-sequence forms never
modify their initial state; :func:`kda_varlen` rewrites exactly the slots it is given, and a
sequence without history starts from a zero state whatever its slot holds.
"""
from __future__ import annotations

import importlib.util

import torch

from . import get_kernel, once, register_kernel
from .gated_delta_rule import (decay_factor, delta_step_inputs, fla_one_sequence, prepare_delta_inputs,
                               run_chunked)
from .cpu_native import delta_step_native, native_available
from .state_varlen import delta_varlen

__all__ = ['recurrent_kda', 'chunk_kda', 'kda_decode_step_torch', 'kda_decode_step_cpu', 'kda_varlen']

_CHUNK = 32            # tokens per chunk: the intra-chunk decay is [C, C, dk] per head


@register_kernel('recurrent_kda', device_type='any')
def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA one token at a time.

    Args:
        q, k: ``[L, H, dk]``; v: ``[L, H, dv]``.
        g: ``[L, H, dk]`` log decay per key channel (``<= 0``).
        beta: ``[L, H]`` write strength.
        initial_state: ``[H, dk, dv]`` or None (zeros). Read only.
        use_qk_l2norm, scale: as in :func:`~.gated_delta_rule.recurrent_gated_delta_rule`.

    Returns:
        ``(o [L, H, dv] in q.dtype, final state [H, dk, dv] float32)``.

    Raises:
        ValueError: inconsistent shapes.
    """
    out_dtype = q.dtype
    q, k, v, g, beta, state = prepare_delta_inputs(q, k, v, g, beta, initial_state, use_qk_l2norm, scale, True)
    H, L, dk = q.shape
    if state is None:
        state = q.new_zeros(H, dk, v.shape[-1])
    o = torch.empty_like(v)
    for t in range(L):
        state = state * g[:, t].exp()[:, :, None]
        delta = beta[:, t, None] * (v[:, t] - torch.einsum('hk,hkv->hv', k[:, t], state))
        state = state + k[:, t, :, None] * delta[:, None, :]
        o[:, t] = torch.einsum('hk,hkv->hv', q[:, t], state)
    return o.transpose(0, 1).to(out_dtype), state


def _chunk_core(q, k, v, g, beta, state, C: int):
    """WY chunk form over ``B`` independent rows: float32 ``q, k, g [B, L, dk]``, ``v [B, L, dv]``,
    ``beta [B, L]``, ``state [B, dk, dv]`` or None → ``(o [B, L, dv], final state)``.

    Per chunk from state ``S0`` (``G_i`` cumulative log decay vectors, ``⊙`` per channel)::

        (I + A) U = diag(beta) V - diag(beta) (K ⊙ exp(G)) S0,  A_ij = beta_i k_i.(k_j ⊙ exp(G_i - G_j)), j < i
        O   = (Q ⊙ exp(G)) S0 + (q_i.(k_j ⊙ exp(G_i - G_j)), j <= i) U
        S_C = diag(exp(G_C)) S0 + sum_i (k_i ⊙ exp(G_C - G_i)) u_i^T

    Padding tokens get ``g = beta = 0`` (no decay, no write)."""
    B, L, dk = q.shape
    dv = v.shape[-1]
    pad = (-L) % C
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    N = (L + pad) // C
    q, k, g, v = q.view(B, N, C, dk), k.view(B, N, C, dk), g.view(B, N, C, dk), v.view(B, N, C, dv)
    beta = beta.view(B, N, C)
    G = g.cumsum(2)                                                    # [B, N, C, dk]
    ratio = G[:, :, :, None, :] - G[:, :, None, :, :]                  # [B, N, Ci, Cj, dk]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = decay_factor(ratio.masked_fill(~causal[:, :, None], float('-inf')))
    kk = torch.einsum('bnic,bnjc,bnijc->bnij', k, k, decay)
    system = (beta[..., None] * kk).tril(-1) + torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat((beta[..., None] * v, beta[..., None] * k * decay_factor(G)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_base, u_from_state = solved[..., :dv], solved[..., dv:]
    attn = torch.einsum('bnic,bnjc,bnijc->bnij', q, k, decay)          # zero above the diagonal
    q_decayed = q * decay_factor(G)
    G_end = G[:, :, -1]                                                # [B, N, dk]
    k_to_end = k * decay_factor(G_end[:, :, None] - G)
    o = torch.empty(B, N, C, dv, dtype=torch.float32, device=q.device)
    for n in range(N):
        if state is None:
            u = u_base[:, n]
            o[:, n] = attn[:, n] @ u
            state = k_to_end[:, n].transpose(-1, -2) @ u
            continue
        u = u_base[:, n] - u_from_state[:, n] @ state
        o[:, n] = q_decayed[:, n] @ state + attn[:, n] @ u
        state = state * decay_factor(G_end[:, n])[:, :, None] + k_to_end[:, n].transpose(-1, -2) @ u
    return o.view(B, N * C, dv)[:, :L], state


@register_kernel('chunk_kda', device_type='any')
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None = None, chunk_size: int = _CHUNK, use_qk_l2norm: bool = True,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA in chunkwise WY form; the contract of :func:`recurrent_kda`.

    Memory: ``H * L * chunk_size * dk`` float32 for the intra-chunk decays.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    return run_chunked(_chunk_core, q, k, v, g, beta, initial_state, chunk_size, use_qk_l2norm, scale,
                       per_channel_decay=True)


@register_kernel('kda_decode_step', device_type='any')
def kda_decode_step_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
    """One KDA token for each of ``N`` sequences (the recurrence of the module docstring).

    Args:
        q, k, g: ``[N, H, dk]`` (``g`` the log decay per key channel); v: ``[N, H, dv]``;
            beta: ``[N, H]``; any float dtype.
        state: float32 ``[N, H, dk, dv]`` (may be a view), updated IN PLACE.
        use_qk_l2norm, scale: as in :func:`recurrent_kda`.

    Returns:
        float32 ``o [N, H, dv]``.
    """
    kq, v, g, beta = delta_step_inputs(q, k, v, g, beta, use_qk_l2norm, scale)
    k, q = kq.unbind(2)
    state.mul_(g.exp()[..., None])
    delta = beta[..., None] * (v - torch.einsum('nhk,nhkv->nhv', k, state))
    state.add_(k[..., None] * delta[..., None, :])
    return torch.einsum('nhk,nhkv->nhv', q, state)


@register_kernel('kda_decode_step', device_type='cpu', priority=10, available=native_available)
def kda_decode_step_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, use_qk_l2norm: bool = True, scale: float | None = None) -> torch.Tensor:
    """:func:`kda_decode_step_torch` by the native kernel (:func:`~.cpu_native.delta_step_native`,
    one call, the state read twice and written once) where it applies (float32 state with unit
    stride along ``dv``, outside autograd), else the torch form. Equal to float32 rounding."""
    kq, v32, g32, beta32 = delta_step_inputs(q, k, v, g, beta, use_qk_l2norm, scale)
    o = delta_step_native(kq, v32, g32.exp(), beta32, state)
    if o is not None:
        return o
    return kda_decode_step_torch(q, k, v, g, beta, state, use_qk_l2norm, scale)


@register_kernel('kda_varlen', device_type='any')
def kda_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_cache: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, has_history: torch.Tensor,
               use_qk_l2norm: bool = True, scale: float | None = None, slot_span=...) -> torch.Tensor:
    """KDA over a flat batch of sequences, each continuing its state slot.

    Args:
        q, k, g: ``[T, H, dk]``; v: ``[T, H, dv]``; beta: ``[T, H]`` (all sequences' rows).
        state_cache: ``[num_slots, H, dk, dv]`` float32 (may be a strided view); rows ``slots``
            are read, then overwritten with the state after each sequence's last row.
        cu_seqlens: int64 ``[N + 1]`` row offsets; slots: int64 ``[N]``; has_history: bool ``[N]``.
        slot_span: :func:`~lmdeploy.pytorch.kernels.slot_range` of ``slots`` when the caller has
            it (``StepContext.slot_span``); ``...`` computes it.

    Single-row sequences share one ``kda_decode_step`` call, longer ones run ``chunk_kda`` one at
    a time (:func:`~.state_varlen.delta_varlen`; a pure decode step whose slots are one
    range with history updates that slice of a float32 cache in place).

    Returns:
        ``o [T, H, dv]`` in ``q.dtype``.
    """
    step, chunk = get_kernel('kda_decode_step', q.device), get_kernel('chunk_kda', q.device)
    return delta_varlen(step, chunk, q, k, v, g, beta, state_cache, cu_seqlens, slots, has_history, use_qk_l2norm,
                        scale, slot_span)


@once
def _fla_kda_installed() -> bool:
    """Whether ``fla-core`` with its KDA ops (``fla.ops.kda``, fla-core >= 0.6) is importable
    (checked at the first CUDA selection only: importing fla imports triton)."""
    if importlib.util.find_spec('fla') is None:
        return False
    try:
        return importlib.util.find_spec('fla.ops.kda') is not None
    except ImportError:        # fla present but its ops package does not import (no triton)
        return False


@register_kernel('chunk_kda', device_type='cuda', priority=10, available=_fla_kda_installed)
def chunk_kda_fla(q, k, v, g, beta, initial_state=None, chunk_size: int = _CHUNK, use_qk_l2norm: bool = True,
                  scale: float | None = None):
    """``fla-core``'s Triton KDA chunk kernel with the contract of :func:`chunk_kda` (``g`` the
    precomputed per-channel log decay; its gate fusion is not used). ``chunk_size`` is ignored:
    fla fixes its own. fla multiplies in TF32 inside its chunks."""
    from fla.ops.kda import chunk_kda as fla_chunk
    return fla_one_sequence(fla_chunk, q, k, v, g, beta, initial_state, use_qk_l2norm, scale)


@register_kernel('recurrent_kda', device_type='cuda', priority=10, available=_fla_kda_installed)
def recurrent_kda_fla(q, k, v, g, beta, initial_state=None, use_qk_l2norm: bool = True,
                      scale: float | None = None):
    """``fla-core``'s fused recurrent KDA kernel with the contract of :func:`recurrent_kda`."""
    from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    return fla_one_sequence(fla_recurrent, q, k, v, g, beta, initial_state, use_qk_l2norm, scale)


@register_kernel('kda_decode_step', device_type='cuda', priority=10, available=_fla_kda_installed)
def kda_decode_step_fla(q, k, v, g, beta, state, use_qk_l2norm: bool = True, scale: float | None = None):
    """:func:`kda_decode_step_torch` by ``fla-core``'s fused recurrent kernel: the ``N``
    sequences as a batch of one-token sequences, the state written back in place."""
    from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    o, final = fla_recurrent(q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None].to(q.dtype),
                             scale=scale, initial_state=state.float(), output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm)
    state.copy_(final)
    return o[:, 0].float()
