"""Decode steps of DeepSeek Sparse Attention (DSA, DeepSeek-V3.2, 2025) as GLM-5.3-Flash's
``glm5_next`` layers run it, with shapes that do not depend on the sequences' lengths.

A decode step (one query per sequence, at position ``kv_seqlen - 1``) takes its lengths and block
tables as tensors (``StepContext.kv_seqlens_t``, ``StepContext.block_table``), never as Python
ints, so a CPU decode graph can record and replay it and a CUDA graph can capture it::

    dsa_select   indexer queries, head weights, cached [k | g] rows -> the best pools [N, K] (-1 = none)
    dsa_attend   absorbed queries [H, N, R], cached latent rows, pools -> attended latent [H, N, R]

Each op is registered for the CPU (the native kernels ``lm_dsa_select`` / ``lm_dsa_attend`` of
:mod:`.cpu_native` when they apply: float32, the library built; else the torch form) and for any
other device (the torch form: a fixed-shape gather over the block table's full width with
masking, called with ``check=False``: its range checks read the tensors on the host, so they run
for CPU tensors only and a CUDA graph can capture the rest). The gather is dense over each
session (memory and time grow with batch x block-table width), not sparse.

Selection rule (the same as :func:`~lmdeploy.pytorch.models.glm5_next_layers.top_pools` in the
per-sequence path): the ``min(K, kv_seqlen // P)`` complete pools with the highest scores, best
first, equal scores going to the lower pool index, NaN before any number; unused entries ``-1``.
The native kernel and the torch form sum in different orders, so where two pools' scores differ
by float32 rounding only they may keep different pools; exact ties (e.g. pools every head's
ReLU zeroes) are broken alike.
"""
from __future__ import annotations

import torch

from ..model_inputs import kv_gather_index
from . import register_kernel
from .cpu_native import CALLS, is_plain, native_library
from .fused_decode import _check_paged_lengths

__all__ = ['dsa_select_native', 'dsa_select_torch', 'dsa_attend_native', 'dsa_attend_torch']


def _check_args(block_table: torch.Tensor, kv_seqlens: torch.Tensor, N: int, pool: int) -> None:
    """Raises ValueError: ``pool < 1``, or ``block_table`` / ``kv_seqlens`` not int64 ``[N, W]`` / ``[N]``."""
    if pool < 1:
        raise ValueError(f'pool must be >= 1, got {pool}')
    if not (block_table.dim() == 2 and block_table.shape[0] == N and kv_seqlens.shape == (N,)
            and block_table.dtype == kv_seqlens.dtype == torch.int64):
        raise ValueError(f'block_table must be int64 [N, W] and kv_seqlens int64 [N] with N = {N}; got '
                         f'{block_table.dtype} {tuple(block_table.shape)}, '
                         f'{kv_seqlens.dtype} {tuple(kv_seqlens.shape)}')


def _select_shapes(q, w, keys, ape, block_table, kv_seqlens, k: int) -> tuple[int, int, int, int]:
    """``(N, heads, D, P)`` of checked :func:`dsa_select_torch` arguments.

    Raises:
        ValueError: inconsistent shapes, ``D == 0`` or ``k < 0``.
    """
    if q.dim() != 3 or keys.dim() != 3 or ape.dim() != 2:
        raise ValueError(f'expected q [N, heads, D], keys [num_blocks, block_size, 2D], ape [P, D]; got '
                         f'{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(ape.shape)}')
    N, Hi, D = q.shape
    P = ape.shape[0]
    if w.shape != (N, Hi) or keys.shape[2] != 2 * D or ape.shape[1] != D or k < 0:
        raise ValueError(f'expected w [N, heads], keys [.., .., 2D], ape [P, D], k >= 0; got {tuple(w.shape)}, '
                         f'{tuple(keys.shape)}, {tuple(ape.shape)}, k={k}')
    if D == 0:
        raise ValueError(f'q must have a channel width D >= 1, got q {tuple(q.shape)}')
    _check_args(block_table, kv_seqlens, N, P)
    return N, Hi, D, P


def _gather_rows(cache: torch.Tensor, block_table: torch.Tensor, kv_seqlens: torch.Tensor) -> torch.Tensor:
    """``rows [N, S, C]``: every position of the block table's full width (``S = W * block_size``,
    :func:`~lmdeploy.pytorch.model_inputs.kv_gather_index`); positions ``>= kv_seqlen`` read the
    sequence's position 0 (always written, so finite)."""
    blocks, offsets, _ = kv_gather_index(block_table, kv_seqlens, cache.shape[1])
    return cache[blocks, offsets]


def dsa_select_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, ape: torch.Tensor,
                     block_table: torch.Tensor, kv_seqlens: torch.Tensor, k: int, scale: float, *,
                     check: bool = True) -> torch.Tensor:
    """The DSA lightning indexer's pool selection for ``N`` decode queries (one per sequence, at
    position ``kv_seqlens[n] - 1``), in torch over the block table's full width.

    Sequence ``n``'s ``M = kv_seqlens[n] // P`` complete pools get
    ``key_m = sum_j softmax_j(g_j + ape_j) * k_j`` (per channel) and
    ``score_m = sum_h w[n, h] relu(q[n, h] . key_m * scale)`` (float32); the ``min(k, M)`` best
    are kept by the rule in the module docstring.

    Args:
        q: ``[N, heads, D]`` indexer queries (``wq_b(q_resid)``).
        w: ``[N, heads]`` head weights (``weights_proj(h) / sqrt(heads)``).
        keys: ``[num_blocks, block_size, 2D]`` the cached ``[k | g]`` rows.
        ape: ``[P, D]`` the pool's position logits (``P = index_kpool``).
        block_table: int64 ``[N, W]``; kv_seqlens: int64 ``[N]``, each in ``[1, W * block_size]``.
        k: pools to keep (``index_topk // P``).
        scale: ``D ** -0.5``.
        check: run the length and block id checks (CPU tensors only; they read the tensors on
            the host). The registration for other devices passes ``False``.

    Returns:
        int64 ``[N, k]``: pool indices, best first, ``-1`` past the ``min(k, M)`` kept.

    Raises:
        ValueError: inconsistent shapes, ``D == 0``, a length or a reached block id out of range
            (the length and block checks read the tensors: run on CPU only, when ``check``; a
            CUDA capture forbids host reads, and other accelerators would synchronise).
    """
    N, Hi, D, P = _select_shapes(q, w, keys, ape, block_table, kv_seqlens, k)
    if check and kv_seqlens.device.type == 'cpu':
        _check_paged_lengths(block_table, kv_seqlens, keys.shape[1], keys.shape[0])
    rows = _gather_rows(keys, block_table, kv_seqlens)
    Mmax = rows.shape[1] // P
    out = torch.full((N, k), -1, dtype=torch.int64, device=q.device)
    kept = min(k, Mmax)
    if not (N and kept):
        return out
    k_rows, g_rows = rows[:, :Mmax * P].to(q.dtype).view(N, Mmax, P, 2 * D).split([D, D], dim=-1)
    prob = torch.softmax(g_rows.float() + ape.float(), dim=2).to(k_rows.dtype)
    pool_keys = (prob * k_rows).sum(dim=2)                                              # [N, Mmax, D]
    scores = torch.relu(torch.matmul(q.float(), pool_keys.float().transpose(1, 2)) * scale)   # [N, heads, Mmax]
    index = torch.matmul(w.float().unsqueeze(1), scores).squeeze(1)                    # [N, Mmax]
    complete = torch.arange(Mmax, device=q.device)[None, :] < (kv_seqlens // P)[:, None]
    index = index.masked_fill(~complete, float('-inf'))
    # -inf for the incomplete pools: a stable descending sort puts them after every kept one
    chosen = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :kept]
    out[:, :kept] = torch.where(complete.gather(1, chosen), chosen, -1)
    return out


def dsa_select_native(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, ape: torch.Tensor,
                      block_table: torch.Tensor, kv_seqlens: torch.Tensor, k: int,
                      scale: float) -> torch.Tensor | None:
    """:func:`dsa_select_torch` in one native call (``lm_dsa_select``: OpenMP over sequences x
    pools for the scores, then over sequences for the selection), or ``None`` when it does not
    apply (not float32 on CPU, ``keys`` without unit stride along its rows, or no library).

    Same arguments, result and errors as :func:`dsa_select_torch`; the scores sum in another
    order (float32 rounding).
    """
    N, Hi, D, P = _select_shapes(q, w, keys, ape, block_table, kv_seqlens, k)
    if not (all(is_plain(t) for t in (q, w, keys, ape)) and keys.stride(2) == 1
            and block_table.device.type == kv_seqlens.device.type == 'cpu'):
        return None
    lib = native_library()
    if lib is None:
        return None
    q, w, ape, block_table, kv_seqlens = (t.contiguous() for t in (q, w, ape, block_table, kv_seqlens))
    nb, bs = keys.shape[:2]
    W = block_table.shape[1]
    scores = torch.empty(N, W * bs // P, dtype=torch.float32)
    out = torch.empty(N, k, dtype=torch.int64)
    CALLS['dsa_select'] += bool(N)
    status = N and lib.lm_dsa_select(q.data_ptr(), w.data_ptr(), keys.data_ptr(), keys.stride(0), keys.stride(1),
                                     ape.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                                     kv_seqlens.data_ptr(), N, Hi, D, P, k, bs, W, nb, scale, scores.data_ptr(),
                                     out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise ValueError(f'kv_seqlens must be in [1, {W * bs}]; got {kv_seqlens.tolist()}')
    if status == -2:
        raise ValueError(f'block_table holds a block id outside [0, {nb}) within kv_seqlens')
    return out


def _attend_shapes(q_c, cache, block_table, kv_seqlens, pools, pool: int) -> tuple[int, int, int, int]:
    """``(H, N, R, K)`` of checked :func:`dsa_attend_torch` arguments.

    Raises:
        ValueError: inconsistent shapes or dtypes, or ``R == 0``.
    """
    if q_c.dim() != 3 or cache.dim() != 3 or pools.dim() != 2:
        raise ValueError(f'expected q_c [H, N, R], cache [num_blocks, block_size, R], pools [N, K]; got '
                         f'{tuple(q_c.shape)}, {tuple(cache.shape)}, {tuple(pools.shape)}')
    H, N, R = q_c.shape
    if cache.shape[2] != R or pools.shape[0] != N or pools.dtype != torch.int64:
        raise ValueError(f'expected cache [.., .., R={R}] and int64 pools [N={N}, K]; got {tuple(cache.shape)}, '
                         f'{pools.dtype} {tuple(pools.shape)}')
    if R == 0:
        raise ValueError(f'q_c must have a latent width R >= 1, got q_c {tuple(q_c.shape)}')
    _check_args(block_table, kv_seqlens, N, pool)
    return H, N, R, pools.shape[1]


def dsa_attend_torch(q_c: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, kv_seqlens: torch.Tensor,
                     pools: torch.Tensor, pool: int, tail: bool, scale: float, *,
                     check: bool = True) -> torch.Tensor:
    """NoPE MLA decode attention in latent space (the absorbed form: the key up-projection folded
    into ``q_c``, the value up-projection the caller's) over a DSA selection, in torch over the
    block table's full width.

    Sequence ``n`` attends the tokens of its selected pools (``pools[n]``, ``P = pool`` tokens
    each; ``-1`` entries select nothing, a pool given twice counts once) and, when ``tail`` and ``P > 1``, the tokens after its
    last complete pool (``kv_seqlens[n] // P * P .. kv_seqlens[n] - 1``):
    ``out[h, n] = sum_t softmax_t(q_c[h, n] . latent_t * scale) latent_t`` (softmax in float32).

    Args:
        q_c: ``[H, N, R]`` absorbed queries.
        cache: ``[num_blocks, block_size, R]`` the latent rows.
        block_table: int64 ``[N, W]``; kv_seqlens: int64 ``[N]``, each in ``[1, W * block_size]``.
        pools: int64 ``[N, K]`` (:func:`dsa_select_torch`'s result, or a shared layer's), each
            in ``[-1, kv_seqlens[n] // P)``.
        pool: ``P`` (``index_kpool``).
        tail: ``index_kpool_always_select_tail``.
        scale: the softmax scale.
        check: run the range checks (CPU tensors only; they read the tensors on the host). The
            registration for other devices passes ``False``.

    Returns:
        ``[H, N, R]`` in ``q_c``'s dtype (zeros for a sequence that selects no token, as the
        per-sequence path's masked attention gives).

    Raises:
        ValueError: inconsistent shapes, ``R == 0``, a length, a reached block id or a pool id out
            of range (the range checks read the tensors: run on CPU only, when ``check``).
    """
    H, N, R, K = _attend_shapes(q_c, cache, block_table, kv_seqlens, pools, pool)
    P = pool
    if check and kv_seqlens.device.type == 'cpu':
        _check_paged_lengths(block_table, kv_seqlens, cache.shape[1], cache.shape[0])
        if pools.numel() and ((pools < -1).any() or (pools >= (kv_seqlens // P)[:, None]).any()):
            raise ValueError(f'pools must be in [-1, kv_seqlens // {P}); got {pools.tolist()}')
    rows = _gather_rows(cache, block_table, kv_seqlens).to(q_c.dtype)
    S = rows.shape[1]
    pos = torch.arange(S, device=q_c.device)[None, :]
    Mmax = S // P
    full = (kv_seqlens // P)[:, None]
    picked = torch.zeros(N, Mmax + 1, dtype=torch.bool, device=q_c.device)
    picked.scatter_(1, torch.where(pools < 0, Mmax, pools), True)          # -1 -> the dummy column Mmax
    visible = torch.zeros(N, S, dtype=torch.bool, device=q_c.device)
    visible[:, :Mmax * P] = picked[:, :Mmax].repeat_interleave(P, dim=1)
    if tail and P > 1:
        visible |= (pos >= full * P) & (pos < kv_seqlens[:, None])
    scores = torch.einsum('hnr,nsr->nhs', q_c, rows).float() * scale
    hidden = ~visible[:, None, :]
    probs = scores.masked_fill(hidden, float('-inf')).softmax(-1).masked_fill(hidden, 0.0)   # no key seen: 0
    return torch.einsum('nhs,nsr->hnr', probs.to(rows.dtype), rows)


def dsa_attend_native(q_c: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, kv_seqlens: torch.Tensor,
                      pools: torch.Tensor, pool: int, tail: bool, scale: float) -> torch.Tensor | None:
    """:func:`dsa_attend_torch` in one native call (``lm_dsa_attend``: OpenMP over sequences x
    groups of up to 8 heads, each group reading a selected row once, online softmax, the tokens in
    position order), or ``None`` when it does not apply (not float32 on CPU, ``cache`` without
    unit stride along its rows, or no library). Same arguments, result and errors as
    :func:`dsa_attend_torch` (to float32 rounding)."""
    H, N, R, K = _attend_shapes(q_c, cache, block_table, kv_seqlens, pools, pool)
    if not (is_plain(q_c) and is_plain(cache) and cache.stride(2) == 1
            and all(t.device.type == 'cpu' for t in (block_table, kv_seqlens, pools))):
        return None
    lib = native_library()
    if lib is None:
        return None
    q_c, block_table, kv_seqlens, pools = (t.contiguous() for t in (q_c, block_table, kv_seqlens, pools))
    nb, bs = cache.shape[:2]
    W = block_table.shape[1]
    out = torch.empty(H, N, R, dtype=torch.float32)
    CALLS['dsa_attend'] += bool(N and H)
    status = N and H and lib.lm_dsa_attend(q_c.data_ptr(), cache.data_ptr(), cache.stride(0), cache.stride(1),
                                           block_table.data_ptr(), block_table.stride(0), kv_seqlens.data_ptr(),
                                           pools.data_ptr(), K, pool, int(tail), N, H, R, bs, W, nb, scale,
                                           out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise ValueError(f'kv_seqlens must be in [1, {W * bs}]; got {kv_seqlens.tolist()}')
    if status == -2:
        raise ValueError(f'block_table holds a block id outside [0, {nb}) within kv_seqlens')
    if status == -3:
        raise ValueError(f'pools must be in [-1, kv_seqlens // {pool}); got {pools.tolist()}')
    return out


@register_kernel('dsa_select', device_type='cpu')
def dsa_select_cpu(*args) -> torch.Tensor:
    """:func:`dsa_select_native` when it applies, else :func:`dsa_select_torch`."""
    out = dsa_select_native(*args)
    return dsa_select_torch(*args) if out is None else out


@register_kernel('dsa_attend', device_type='cpu')
def dsa_attend_cpu(*args) -> torch.Tensor:
    """:func:`dsa_attend_native` when it applies, else :func:`dsa_attend_torch`."""
    out = dsa_attend_native(*args)
    return dsa_attend_torch(*args) if out is None else out


@register_kernel('dsa_select')
def dsa_select_device(*args) -> torch.Tensor:
    """:func:`dsa_select_torch` on a device other than the CPU: no range check (no host read)."""
    return dsa_select_torch(*args, check=False)


@register_kernel('dsa_attend')
def dsa_attend_device(*args) -> torch.Tensor:
    """:func:`dsa_attend_torch` on a device other than the CPU: no range check (no host read)."""
    return dsa_attend_torch(*args, check=False)
