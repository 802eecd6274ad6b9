"""The gated delta rule: the token mixer of Gated DeltaNet layers, for one sequence.

Recurrence (Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", 2024, eq. 10), per head, with state ``S`` of shape ``[dk, dv]`` mapping keys to values::

    S_t = exp(g_t) * S_{t-1}                          # gated decay, g_t <= 0
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T    # delta rule: write the prediction error
    o_t = S_t^T q_t

``q`` and ``k`` are optionally L2-normalised (Qwen3-Next does) and ``q`` is scaled by
``dk ** -0.5``. Two implementations compute the same function:

- :func:`recurrent_gated_delta_rule` steps token by token (decode, very short inputs);
- :func:`chunk_gated_delta_rule` is the chunkwise-parallel WY form (Yang et al.,
  "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", 2024, sec. 3):
  inside a chunk the updates are solved at once with a unit lower-triangular system, and only
  the state is carried sequentially from chunk to chunk.

:func:`gated_delta_rule_varlen` runs a whole step's flat batch against the state slots in one
call: every single-token sequence goes through one batched recurrent step (decode), longer
ones through the chunked form.

Invariants: the state is float32; the single-sequence functions never modify their initial
state in place (callers pass views of cache slots), :func:`gated_delta_rule_varlen` rewrites
the cache slots it is given and no others; running a sequence in pieces and carrying the
returned state equals one pass. On CUDA the ``fla-core`` kernels are registered with higher
priority when the package is installed.
"""
from __future__ import annotations

import importlib.util

import torch

from . import get_kernel, once, register_kernel
from .cpu_native import delta_step_native
from .state_varlen import delta_varlen

__all__ = ['chunk_gated_delta_rule', 'recurrent_gated_delta_rule', 'gated_delta_rule_varlen', 'l2norm']


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim (the ``fla`` convention, eps inside)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_delta_inputs(q, k, v, g, beta, initial_state, use_qk_l2norm: bool, scale: float | None,
                         per_channel_decay: bool = False):
    """Check the shapes of a delta-rule call and bring its inputs to the form the torch kernels
    compute in (shared by the gated delta rule and KDA, which differ only in ``g``).

    Args:
        q, k: ``[L, H, dk]``; v: ``[L, H, dv]``; beta: ``[L, H]``; any float dtype.
        g: log decays, ``[L, H]`` (one per head) or, with ``per_channel_decay``, ``[L, H, dk]``.
        initial_state: ``[H, dk, dv]`` or None.
        use_qk_l2norm: L2-normalise ``q`` and ``k``; scale: the query scale (None: ``dk ** -0.5``).

    Returns:
        float32 head-major ``q, k [H, L, dk]``, ``v [H, L, dv]``, ``g [H, L(, dk)]``,
        ``beta [H, L]``, and the float32 state (None when ``initial_state`` is None).

    Raises:
        ValueError: inconsistent shapes.
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f'q, k must be [L, H, dk] and v [L, H, dv] with equal L and H; got q {tuple(q.shape)}, '
                         f'k {tuple(k.shape)}, v {tuple(v.shape)}')
    L, H, dk = q.shape
    dv = v.shape[-1]
    g_shape = (L, H, dk) if per_channel_decay else (L, H)
    if g.shape != g_shape or beta.shape != (L, H):
        raise ValueError(f'g and beta must be {g_shape} and {(L, H)} ([L, H{", dk" * per_channel_decay}] and '
                         f'[L, H]); got {tuple(g.shape)}, {tuple(beta.shape)}')
    if initial_state is not None and initial_state.shape != (H, dk, dv):
        raise ValueError(f'initial_state must be [H, dk, dv] = {(H, dk, dv)}; got {tuple(initial_state.shape)}')
    q, k, v, g, beta = (x.transpose(0, 1).to(torch.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    state = None if initial_state is None else initial_state.to(torch.float32)
    return q, k, v, g, beta, state


def delta_step_inputs(q, k, v, g, beta, use_qk_l2norm: bool, scale: float | None):
    """The inputs of a delta-rule decode step (gated delta rule or KDA) in the step kernels' form.

    Args:
        q, k: ``[N, H, dk]``; v: ``[N, H, dv]``; g: ``[N, H]`` or ``[N, H, dk]``; beta: ``[N, H]``.

    Returns:
        float32 ``kq [N, H, 2, dk]`` (the key, then the query; L2-normalised with
        ``use_qk_l2norm``, the query scaled), and float32 ``v, g, beta``.
    """
    v, g, beta = (x if x.dtype == torch.float32 else x.float() for x in (v, g, beta))
    kq = torch.stack((k, q), dim=2)                                                 # [N, H, 2, dk]
    if kq.dtype != torch.float32:
        kq = kq.float()
    if use_qk_l2norm:
        kq = l2norm(kq)
    kq[:, :, 1].mul_(q.shape[-1] ** -0.5 if scale is None else scale)   # q rows; kq is a fresh tensor
    return kq, v, g, beta


def run_chunked(core, q, k, v, g, beta, initial_state, chunk_size: int, use_qk_l2norm: bool, scale: float | None,
                per_channel_decay: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through a chunked delta-rule algorithm ``core(q, k, v, g, beta, state or
    None, chunk_size)`` on :func:`prepare_delta_inputs`' head-major float32 inputs →
    ``(o [H, L, dv], state [H, dk, dv] or None)``.

    Returns:
        ``(o [L, H, dv] in q.dtype, final state [H, dk, dv] float32)`` (zeros for no tokens and
        no initial state).

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    if chunk_size <= 0:
        raise ValueError(f'chunk_size must be positive, got {chunk_size}')
    out_dtype = q.dtype
    q, k, v, g, beta, state = prepare_delta_inputs(q, k, v, g, beta, initial_state, use_qk_l2norm, scale,
                                                   per_channel_decay)
    o, state = core(q, k, v, g, beta, state, chunk_size)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], v.shape[2])
    return o.transpose(0, 1).to(out_dtype), state


# Decay factors below exp(-60) ~ 8.7e-27 are set to exactly 0. They are far below float32's
# resolution next to the O(1) terms they are summed with (the diagonal of every intra-chunk decay
# is 1), so the result does not change, but left alone their products with small values fall
# into float32's subnormal range (< 1.2e-38), where x86 CPUs run matmuls over 100x slower
# (microcode assists). A head decaying by about exp(-1) per token reaches them within one chunk.
_DECAY_FLOOR = -60.0
_CHUNK = 64   # tokens per chunk of the torch chunked form (default chunk_size)


def decay_factor(log_factor: torch.Tensor) -> torch.Tensor:
    """``exp(log_factor)`` with factors below ``exp(_DECAY_FLOOR)`` flushed to 0 (float32)."""
    return log_factor.masked_fill(log_factor < _DECAY_FLOOR, float('-inf')).exp()


@register_kernel('recurrent_gated_delta_rule', device_type='any')
def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               use_qk_l2norm: bool = True,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, one token at a time (reference and decode path).

    Args:
        q, k: ``[L, H, dk]`` queries and keys (any float dtype).
        v: ``[L, H, dv]`` values.
        g: ``[L, H]`` log decay per token (``<= 0``); the state is multiplied by ``exp(g)``.
        beta: ``[L, H]`` write strength in ``[0, 1]``.
        initial_state: ``[H, dk, dv]`` state after the sequence's earlier tokens, or ``None``
            for a zero state. Read only.
        use_qk_l2norm: L2-normalise ``q`` and ``k`` first (eps 1e-6 inside the root).
        scale: query scale; ``None`` means ``dk ** -0.5``.

    Returns:
        ``(o [L, H, dv] in q.dtype, final_state [H, dk, dv] float32)``.

    Raises:
        ValueError: inconsistent shapes.
    """
    out_dtype = q.dtype
    q, k, v, g, beta, state = prepare_delta_inputs(q, k, v, g, beta, initial_state, use_qk_l2norm, scale)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], v.shape[2])
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = torch.einsum('hk,hkv->hv', k[:, t], state)
        delta = beta[:, t, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, None] * delta[:, None, :]
        o[:, t] = torch.einsum('hk,hkv->hv', q[:, t], state)
    return o.transpose(0, 1).to(out_dtype), state


@register_kernel('chunk_gated_delta_rule', device_type='any')
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None, chunk_size: int = _CHUNK,
                           use_qk_l2norm: bool = True,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule in chunkwise-parallel (WY) form; same contract as the recurrent form.

    Within a chunk of ``C`` tokens starting from state ``S0``, let ``G_i = exp(sum_{j<=i} g_j)``.
    Unrolling the recurrence gives the written rows ``U`` (``beta``-scaled prediction errors)::

        (I + A) U = diag(beta) V - diag(beta * G) K S0,   A_ij = beta_i (G_i / G_j) k_i.k_j  (j < i)
        O   = diag(G) Q S0 + ((Q K^T) * (G_i / G_j), j <= i) U
        S_C = G_C S0 + sum_i (G_C / G_i) k_i u_i^T

    ``A`` does not depend on ``S0``, so every chunk's triangular solve runs in one batched call
    and only the cheap state hand-off is sequential. Padding tokens get ``g = beta = 0``: they
    neither decay nor write, so the final state is exact for any ``L``.

    Args:
        q, k, v, g, beta, initial_state, use_qk_l2norm, scale: as in
            :func:`recurrent_gated_delta_rule`.
        chunk_size: tokens per chunk (a positive int).

    Returns:
        ``(o [L, H, dv] in q.dtype, final_state [H, dk, dv] float32)``.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    return run_chunked(_chunk_core, q, k, v, g, beta, initial_state, chunk_size, use_qk_l2norm, scale)


def _chunk_core(q, k, v, g, beta, state, C: int):
    """The WY chunk algorithm of :func:`chunk_gated_delta_rule` over ``B`` independent rows
    (heads, or sequences x heads): prepared float32 ``q, k [B, L, dk]``, ``v [B, L, dv]``,
    ``g, beta [B, L]``, ``state [B, dk, dv]`` or None for zero states (the first chunk then
    skips every product with the state) → ``(o [B, L, dv], final state [B, dk, dv])``."""
    H, L, dk = q.shape   # H: the batch of independent rows
    dv = v.shape[-1]
    pad = (-L) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    N = (L + pad) // C
    q, k, v = q.view(H, N, C, dk), k.view(H, N, C, dk), v.view(H, N, C, dv)
    g, beta = g.view(H, N, C), beta.view(H, N, C)

    log_decay = g.cumsum(-1)                                   # log G_i within each chunk
    ratio = log_decay[..., :, None] - log_decay[..., None, :]  # log(G_i / G_j), row i, column j
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: for j > i the ratio is positive and could overflow.
    decay = decay_factor(ratio.masked_fill(~causal, float('-inf')))  # [H, N, C, C], zero above diagonal

    system = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(C, dtype=system.dtype, device=system.device)
    rhs = torch.cat((beta[..., None] * v, (beta * decay_factor(log_decay))[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_base, u_from_state = solved[..., :dv], solved[..., dv:]  # U = u_base - u_from_state @ S0

    attn = (q @ k.transpose(-1, -2)) * decay                   # intra-chunk scores, j <= i
    q_decayed = q * decay_factor(log_decay)[..., None]
    chunk_log_decay = log_decay[..., -1]                       # [H, N]
    k_to_end = k * decay_factor(chunk_log_decay[..., None] - log_decay)[..., None]

    o = torch.empty(H, N, C, dv, dtype=torch.float32, device=q.device)
    for n in range(N):
        if state is None:   # a zero state: S0 terms vanish (exactly: x @ 0 and 0 * d are +0)
            u = u_base[:, n]
            torch.bmm(attn[:, n], u, out=o[:, n])
            state = k_to_end[:, n].transpose(-1, -2) @ u
            continue
        u = u_base[:, n] - u_from_state[:, n] @ state
        o[:, n] = q_decayed[:, n] @ state + attn[:, n] @ u
        state = state * decay_factor(chunk_log_decay[:, n])[:, None, None] \
            + k_to_end[:, n].transpose(-1, -2) @ u
    return o.view(H, N * C, dv)[:, :L], state


def _recurrent_step_batched(q, k, v, g, beta, state, use_qk_l2norm, scale):
    """One token for each of ``N`` sequences: ``q, k [N, H, dk]``, ``v [N, H, dv]``, ``g, beta [N, H]``,
    ``state [N, H, dk, dv]`` float32 (may be a view of the cache), updated IN PLACE →
    ``o [N, H, dv]`` float32.

    The state is the large operand (``N * H * dk * dv``), so it is touched three times only:
    decay in place, one batched product that reads it for both ``k`` and ``q``, and the rank-1
    delta update in place (no outer product materialised). The output uses
    ``q^T S_new = q^T (g S) + (q . k) delta``, the same value as reading the updated state.
    """
    kq, v, g, beta = delta_step_inputs(q, k, v, g, beta, use_qk_l2norm, scale)
    o = delta_step_native(kq, v, g.exp(), beta, state)
    if o is not None:
        return o
    k, q = kq.unbind(2)
    state.mul_(g.exp()[..., None, None])
    if state.is_contiguous():
        kq_state = torch.matmul(kq, state)                                          # [N, H, 2, dv]
    else:
        # slots of the cache's row layout: [N, H] cannot merge into one batch dim (the slot
        # stride is a whole row), and a batched matmul would copy the state first; per head
        # the batch dim is the slot alone, read in place (H products, whatever N is)
        kq_state = torch.stack([torch.bmm(a, s) for a, s in zip(kq.unbind(1), state.unbind(1))], dim=1)
    k_state, q_state = kq_state.unbind(2)                                           # [N, H, dv] each
    delta = beta[..., None] * (v - k_state)
    state.addcmul_(k[..., None], delta[..., None, :])
    return q_state + (q * k).sum(-1, keepdim=True) * delta


def _chunk_group(q, k, v, g, beta, state_cache, slots, has_history, members: list[int], starts: list[int],
                 lengths: list[int], use_qk_l2norm: bool, scale: float | None, out: torch.Tensor) -> None:
    """Run sequences ``members`` (flat rows ``[starts[i], starts[i] + lengths[i])`` of ``q, k,
    v, g, beta``) through :func:`_chunk_core` as one batch of ``len(members) * H`` rows, each
    padded at its end to the same length with ``g = beta = 0`` tokens (no decay, no write, so
    the final state is the one after the sequence's last real token). Writes their outputs into
    ``out`` and their final states into ``state_cache``."""
    device, T, H, dk, dv = q.device, q.shape[0], q.shape[1], q.shape[2], v.shape[2]
    longest = max(lengths)
    # one chunk when all fit (the chunk size does not change the result): pad to 16, not 64
    chunk = _CHUNK if longest > _CHUNK else -(-longest // 16) * 16
    m, width = len(members), -(-longest // chunk) * chunk
    pos = torch.arange(width, device=device)
    valid = pos[None, :] < torch.tensor(lengths, device=device)[:, None]                 # [m, width]
    rows = torch.where(valid, torch.tensor(starts, device=device)[:, None] + pos[None, :], T)  # T: a zero row

    def batch(x):   # [T, H, ...] -> float32 [m * H, width, ...], padding rows zero
        padded = torch.cat((x, x.new_zeros((1,) + x.shape[1:])))[rows]                 # [m, width, H, ...]
        return padded.transpose(1, 2).reshape((m * H, width) + x.shape[2:]).to(torch.float32)

    qb, kb, vb, gb, bb = (batch(x) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        qb, kb = l2norm(qb), l2norm(kb)
    qb = qb * (dk ** -0.5 if scale is None else scale)
    idx = torch.tensor(members, device=device)
    group_slots = slots[idx]
    history = has_history[idx]
    initial = None          # all fresh prompts: no gather, and the first chunk skips the state terms
    if bool(history.any()):
        initial = state_cache.index_select(0, group_slots).to(torch.float32)
        initial.masked_fill_(~history[:, None, None, None], 0)
        initial = initial.reshape(m * H, dk, dv)
    o, state = _chunk_core(qb, kb, vb, gb, bb, initial, chunk)
    o = o.view(m, H, width, dv).transpose(1, 2)[valid]                                  # [sum(lengths), H, dv]
    out.index_copy_(0, rows[valid], o.to(out.dtype))
    state_cache.index_copy_(0, group_slots, state.view(m, H, dk, dv).to(state_cache.dtype))


@register_kernel('gated_delta_rule_varlen', device_type='any')
def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state_cache: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                            has_history: torch.Tensor, use_qk_l2norm: bool = True,
                            scale: float | None = None, slot_span=...) -> torch.Tensor:
    """Gated delta rule over a flat batch of sequences, each continuing its state slot.

    Sequences with one new token share one batched recurrent step; each longer sequence runs
    :func:`chunk_gated_delta_rule` (through the registry, so ``fla`` on CUDA), by
    :func:`~.state_varlen.delta_varlen`.

    Args:
        q, k: ``[T, H, dk]``; v: ``[T, H, dv]``; g, beta: ``[T, H]`` — as in
            :func:`recurrent_gated_delta_rule`, all sequences' rows concatenated.
        state_cache: ``[num_slots, H, dk, dv]`` float32; rows ``slots`` are read and then
            overwritten in place with the state after each sequence's last row.
        cu_seqlens: int64 ``[N + 1]`` row offsets (every sequence has >= 1 row).
        slots: int64 ``[N]`` distinct state slots.
        has_history: bool ``[N]``; False starts from a zero state whatever the slot holds.
        use_qk_l2norm, scale: as in :func:`recurrent_gated_delta_rule`.
        slot_span: :func:`~lmdeploy.pytorch.kernels.slot_range` of ``slots`` when the caller has
            it (``StepContext.slot_span``, shared by all layers of a step); ``...`` computes it.

    Returns:
        ``o [T, H, dv]`` in ``q.dtype``.
    """
    chunk_fn = get_kernel('chunk_gated_delta_rule', q.device)

    def batch_chunks(multi: list[int], bounds: list[int], out: torch.Tensor) -> list[int]:
        # the torch form: sequences with the same number of chunks run as one batch
        groups: dict[int, list[int]] = {}
        for i in multi:
            groups.setdefault(-(-(bounds[i + 1] - bounds[i]) // _CHUNK), []).append(i)
        left = []
        for members in groups.values():
            if len(members) == 1:
                left.extend(members)
                continue
            _chunk_group(q, k, v, g, beta, state_cache, slots, has_history, members, [bounds[i] for i in members],
                         [bounds[i + 1] - bounds[i] for i in members], use_qk_l2norm, scale, out)
        return left

    return delta_varlen(_recurrent_step_batched, chunk_fn, q, k, v, g, beta, state_cache, cu_seqlens, slots,
                        has_history, use_qk_l2norm, scale, slot_span,
                        batch_chunks if chunk_fn is chunk_gated_delta_rule else None)


def fla_one_sequence(fla_fn, q, k, v, g, beta, initial_state, use_qk_l2norm: bool, scale: float | None):
    """Call an ``fla-core`` chunk or fused recurrent kernel (gated delta rule or KDA: same
    calling convention) on one sequence: ``[L, H, ...]`` inputs as a batch of one, float32
    ``g`` and state, ``beta`` in ``q.dtype`` (fla's expectations), the final state asked for.

    Returns:
        ``(o [L, H, dv], final state [H, dk, dv] float32)``.
    """
    o, state = fla_fn(q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype), scale=scale,
                      initial_state=None if initial_state is None else initial_state[None].float(),
                      output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return o[0], state[0].float()


@once
def _fla_installed() -> bool:
    return importlib.util.find_spec('fla') is not None


@register_kernel('chunk_gated_delta_rule', device_type='cuda', priority=10, available=_fla_installed)
def chunk_gated_delta_rule_fla(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                               use_qk_l2norm: bool = True, scale: float | None = None):
    """``fla-core`` Triton chunk kernel with the contract of :func:`chunk_gated_delta_rule`.

    ``chunk_size`` is ignored: fla fixes its own (64).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    return fla_one_sequence(fla_chunk, q, k, v, g, beta, initial_state, use_qk_l2norm, scale)


@register_kernel('recurrent_gated_delta_rule', device_type='cuda', priority=10, available=_fla_installed)
def recurrent_gated_delta_rule_fla(q, k, v, g, beta, initial_state=None, use_qk_l2norm: bool = True,
                                   scale: float | None = None):
    """``fla-core`` fused recurrent kernel with the contract of :func:`recurrent_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    return fla_one_sequence(fla_recurrent, q, k, v, g, beta, initial_state, use_qk_l2norm, scale)
