"""SwiGLU experts over rows already sorted by expert (the MoE "grouped GEMM").

The caller sorts the ``T * k`` (token, expert) pairs by expert, so expert ``e`` owns one
contiguous run of rows::

    rows      | e0 e0 e0 | e2 | e3 e3 | ...        counts = [3, 0, 1, 2, ...]
    y[run_e]  = down_e( silu(gate_e(x[run_e])) * up_e(x[run_e]) )

Implementations with one contract:

- torch (any device): one pair of matmuls per expert that has rows (and a handful of ops per
  call around them), each through :func:`~lmdeploy.pytorch.kernels.linear.linear`, which for
  float32 on CPU computes skinny runs (8-47 rows; 16-32 for the narrower down projection) as ``(W x^T)^T`` (an expert layer with 16-row
  runs: 10.5 -> 8.2 ms on the benchmark machine). On CPU this is the fast one:
  ``torch._grouped_mm`` exists on CPU but measured 3-5x slower than the loop here.
- native (CPU, float32 decode steps): :func:`~.cpu_native.swiglu_experts_native` runs a whole
  layer (sort, both projections, SwiGLU, weighted sum per token) in one call; it takes the
  routing, not sorted rows, so it is an implementation of ``moe_experts`` below.
- grouped (CUDA, when ``torch._grouped_mm`` exists and row strides are 16-byte multiples):
  each projection is ONE grouped matmul over all experts, whatever the batch hits.

``moe_experts`` is the layer-level op a model calls (``x``, the routing, the stacked weights):
the torch implementation sorts the ``T * k`` pairs by expert, runs ``swiglu_experts`` and sums
back per token (:func:`moe_experts_sorted`); the CPU one runs the native layer when it applies,
else one token's ``k`` experts directly (:func:`moe_experts_one_token`, a batch-1 decode step:
no sort or scatter, the same products, weights and summation order), else the sorted form.

``relu2_experts`` is the same layer-level op for non-gated ``down(relu(up x)^2)`` experts
(Nemotron-H / Nemotron-3): the torch implementation loops over the experts the batch hit
(:func:`relu2_experts_loop`, reading the counts into Python), the CPU one runs
:func:`~.cpu_native.relu2_experts_native` when it applies (no value read into Python, so a decode
graph can replay it), else the loop.

``limited_swiglu_experts`` is that op for SwiGLU experts whose activation is clipped or clamped
at a limit (Ling 3, GLM-5.3-Flash): the same loop (:func:`limited_swiglu_experts_loop`), and on
CPU :func:`~.cpu_native.limited_swiglu_experts_native`, one call.

On CUDA both run the gathered form (:func:`relu2_experts_gathered`,
:func:`limited_swiglu_experts_gathered`; any device can call them) for decode-sized batches
(:func:`gathered_applies`): each (token, slot) pair's expert weights indexed on the device, two
batched products and the activation, summed in slot order, with no value of the routing read on
the host, so a CUDA graph captures the layer; larger batches run the loop.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import get_kernel, register_kernel
from .cpu_native import limited_swiglu_experts_native, relu2_experts_native, swiglu_experts_native
from .linear import linear

__all__ = ['swiglu_experts_loop', 'swiglu_experts_grouped', 'grouped_mm_usable', 'moe_experts_sorted',
           'moe_experts_one_token', 'moe_experts_cpu', 'relu2_experts_loop', 'relu2_experts_cpu', 'clipped_swiglu',
           'clamped_swiglu', 'LIMITED_SWIGLU', 'limited_swiglu_experts_loop', 'limited_swiglu_experts_cpu',
           'GATHER_PAIRS_PER_EXPERT', 'GATHER_CHUNK_BYTES', 'gathered_applies', 'relu2_experts_gathered',
           'limited_swiglu_experts_gathered', 'relu2_experts_cuda', 'limited_swiglu_experts_cuda']


def _check(x, gate_up, down, counts):
    E, two_i, H = gate_up.shape
    if x.dim() != 2 or x.shape[1] != H or down.shape != (E, H, two_i // 2) or counts.shape != (E,):
        raise ValueError(f'expected x [S, H], gate_up [E, 2I, H], down [E, H, I], counts [E]; got '
                         f'{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}, {tuple(counts.shape)}')


@register_kernel('swiglu_experts', device_type='any')
def swiglu_experts_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert's run of rows, one matmul pair per expert with rows.

    Args:
        x: ``[S, H]`` rows sorted by expert.
        gate_up: ``[E, 2I, H]`` gate rows first, then up rows (the ``transformers`` layout).
        down: ``[E, H, I]``.
        counts: int64 ``[E]`` rows per expert (sums to ``S``).

    Returns:
        ``[S, H]`` in ``x.dtype``.

    Raises:
        ValueError: inconsistent shapes.
    """
    _check(x, gate_up, down, counts)
    rows = counts.tolist()
    # Few torch ops per expert (what costs on CPU at decode sizes): views of the hit experts'
    # weights only, one matmul per projection per hit expert (through `linear`, which picks the
    # faster GEMM orientation for the run's row count), and the SwiGLU activation once over all
    # rows. (No ``out=``: it would break autograd.)
    hit = [e for e, n in enumerate(rows) if n]
    if not hit:
        return torch.empty_like(x)
    x_runs = x.split(rows)
    gate, up = torch.cat([linear(x_runs[e], gate_up[e]) for e in hit]).chunk(2, dim=-1)
    act_runs = (F.silu(gate) * up).split(rows)
    return torch.cat([linear(act_runs[e], down[e]) for e in hit])


def grouped_mm_usable(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """``torch._grouped_mm`` exists and every row stride is a multiple of 16 bytes (its requirement)."""
    inner = gate_up.shape[1] // 2
    return hasattr(torch, '_grouped_mm') and (x.element_size() * x.shape[1]) % 16 == 0 and \
        (x.element_size() * inner) % 16 == 0


@register_kernel('swiglu_experts', device_type='cuda', priority=10, available=lambda: hasattr(torch, '_grouped_mm'))
def swiglu_experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                           counts: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`swiglu_experts_loop`, each projection one ``torch._grouped_mm``
    (falls back to the loop when :func:`grouped_mm_usable` is False)."""
    _check(x, gate_up, down, counts)
    if not grouped_mm_usable(x, gate_up):
        return swiglu_experts_loop(x, gate_up, down, counts)
    offsets = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)


@register_kernel('moe_experts', device_type='any')
def moe_experts_sorted(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    """A MoE layer's experts for any ``T``: the pairs sorted by expert, one ``swiglu_experts`` call.

    Args:
        x: ``[T, H]``.
        index: int64 ``[T, k]`` chosen experts; weights: ``[T, k]`` their routing weights.
        gate_up: ``[E, 2I, H]`` (gate rows first); down: ``[E, H, I]``.

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_j weights[t, j] * expert_{index[t, j]}(x[t])``.
    """
    k = index.shape[1]
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    # rows per expert without torch.bincount: on CUDA it reads the largest index back to the host
    # (a synchronisation, which a CUDA graph capture refuses); the counts are the same integers
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))
    y = get_kernel('swiglu_experts', x.device)(x[order // k], gate_up, down, counts)
    y = y * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(y)
    unsorted[order] = y                       # back to (token, k) order: each token's k rows adjacent
    return unsorted.view(x.shape[0], k, -1).sum(1).to(x.dtype)


def moe_experts_one_token(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    """:func:`moe_experts_sorted` for ``x [1, H]``: each chosen expert in turn, weighted, summed in
    one reduction as the sorted form does (bit for bit the same result)."""
    outs = []
    for e, w in zip(index[0].tolist(), weights[0].unbind()):
        gate, up = linear(x, gate_up[e]).chunk(2, dim=-1)
        outs.append(linear(F.silu(gate) * up, down[e]) * w)
    return (outs[0] if len(outs) == 1 else torch.stack(outs, dim=1).sum(1)).to(x.dtype)


@register_kernel('moe_experts', device_type='cpu', priority=5)
def moe_experts_cpu(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """:func:`moe_experts_sorted` on CPU: the native layer (float32, up to
    :data:`~.cpu_native.NATIVE_EXPERT_TOKENS` tokens, outside autograd; equal to float32
    rounding), else :func:`moe_experts_one_token` for one token, else the sorted form."""
    out = swiglu_experts_native(x, index, weights, gate_up, down)
    if out is not None:
        return out
    if x.shape[0] == 1:
        return moe_experts_one_token(x, index, weights, gate_up, down)
    return moe_experts_sorted(x, index, weights, gate_up, down)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _experts_in_slot_order(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int,
                           expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The loop both expert layers below share: the ``T * k`` (token, expert) pairs sorted by
    expert (stable), ``expert(e, rows)`` once per expert with rows, each output weighted in float32
    and summed over the token's ``k`` choices strictly in slot order; float32 ``[T, D]``."""
    T, k = index.shape
    flat = index.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x.index_select(0, token)
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            sl = slice(start, start + n)
            out[sl] = expert(e, rows[sl])
            start += n
    # back to (token, choice) order and summed over the k choices: index_add_ measured ~150x
    # slower on CPU for these few rows (1.8 ms vs 12 us per call)
    pairs = torch.empty(T * k, x.shape[1], dtype=torch.float32, device=x.device)
    pairs[order] = out.float() * weights.flatten().index_select(0, order)[:, None]
    return _sum_slots(pairs.view(T, k, x.shape[1]))


def _sum_slots(pairs: torch.Tensor) -> torch.Tensor:
    """float32 ``[T, k, D]`` weighted expert outputs → ``[T, D]`` summed strictly in slot order
    (``sum(1)`` reorders from 5 choices on, by width and torch version), the order the native
    layers promise, so they and every torch form here agree bit for bit on the sum."""
    total = pairs[:, 0].clone()
    for j in range(1, pairs.shape[1]):
        total += pairs[:, j]
    return total


@register_kernel('relu2_experts', device_type='any')
def relu2_experts_loop(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    """A MoE layer of non-gated relu^2 experts: the ``T * k`` (token, expert) pairs sorted by
    expert, one :func:`~.linear.linear` pair per expert with rows, weighted and summed over each
    token's ``k`` choices in float32 (in slot order).

    Args:
        x: ``[T, D]`` (``D`` the hidden or latent width).
        index: int64 ``[T, k]`` chosen experts; weights: float32 ``[T, k]`` their routing weights.
        up: ``[E, I, D]``; down: ``[E, D, I]`` (no biases).

    Returns:
        ``[T, D]`` in ``x.dtype``: ``sum_j weights[t, j] * down_e(relu(up_e(x[t]))^2)``,
        ``e = index[t, j]``.
    """
    return _experts_in_slot_order(x, index, weights, up.shape[0],
                                  lambda e, rows: linear(_relu2(linear(rows, up[e])), down[e])).to(x.dtype)


@register_kernel('relu2_experts', device_type='cpu', priority=5)
def relu2_experts_cpu(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """:func:`relu2_experts_loop` on CPU: the native layer (float32, up to
    :data:`~.cpu_native.NATIVE_EXPERT_TOKENS` tokens, outside autograd; bit for bit the loop's
    result while no expert has more than 24 rows, else equal to float32 rounding), else the loop."""
    out = relu2_experts_native(x, index, weights, up, down)
    return out if out is not None else relu2_experts_loop(x, index, weights, up, down)


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``min(silu(gate), limit) * clamp(up, -limit, limit)``; ``limit = 0``: plain ``silu(gate) * up``
    (Ling 3 clips after the activation)."""
    if not limit:
        return F.silu(gate) * up
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (GLM-5.3-Flash clamps the inputs)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


#: the limited SwiGLUs by the name ``limited_swiglu_experts`` takes
LIMITED_SWIGLU = {'clipped': clipped_swiglu, 'clamped': clamped_swiglu}


@register_kernel('limited_swiglu_experts', device_type='any')
def limited_swiglu_experts_loop(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                                down: torch.Tensor, act: str, limit: float) -> torch.Tensor:
    """A MoE layer of limited-SwiGLU experts (Ling 3's clipped, GLM-5.3-Flash's clamped): the
    ``T * k`` (token, expert) pairs sorted by expert, per expert with rows one
    :func:`~.linear.linear` into gate and up, ``LIMITED_SWIGLU[act](gate, up, limit)``, one
    ``linear`` down, weighted and summed over each token's ``k`` choices in float32 in slot order.

    Args:
        x: ``[T, H]``.
        index: int64 ``[T, k]`` chosen experts; weights: ``[T, k]`` their routing weights.
        gate_up: ``[E, 2I, H]`` gate rows first, then up rows; down: ``[E, H, I]`` (no biases).
        act: ``'clipped'`` or ``'clamped'`` (:data:`LIMITED_SWIGLU`); limit: its limit.

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: an unknown ``act``.
    """
    if act not in LIMITED_SWIGLU:
        raise ValueError(f'act must be one of {sorted(LIMITED_SWIGLU)}, got {act!r}')
    fn = LIMITED_SWIGLU[act]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = linear(rows, gate_up[e]).chunk(2, dim=-1)
        return linear(fn(gate, up, limit), down[e])

    return _experts_in_slot_order(x, index, weights, gate_up.shape[0], expert).to(x.dtype)


@register_kernel('limited_swiglu_experts', device_type='cpu', priority=5)
def limited_swiglu_experts_cpu(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                               down: torch.Tensor, act: str, limit: float) -> torch.Tensor:
    """:func:`limited_swiglu_experts_loop` on CPU: the native layer (float32, up to
    :data:`~.cpu_native.NATIVE_EXPERT_TOKENS` tokens, outside autograd; the loop's sum order, its
    ``silu`` the C library's ``expf``, so equal to float32 rounding), else the loop."""
    out = limited_swiglu_experts_native(x, index, weights, gate_up, down, act, limit)
    return out if out is not None else limited_swiglu_experts_loop(x, index, weights, gate_up, down, act, limit)


# ---- the expert layers without a host read of the routing (CUDA; any device when called) ----

#: the gathered form runs while a layer's ``T * k`` (token, expert) pairs are at most this many
#: times its experts ``E`` (every decode bucket up to ``2E / k`` tokens); it copies each pair's
#: expert weights, so its traffic grows with the pairs where the loop's stays at the experts hit:
#: beyond this (prefill, the largest buckets) the CUDA layers run the loop, and a decode graph
#: of such a bucket is refused (runs eagerly). A choice by arithmetic, not yet timed on a GPU.
GATHER_PAIRS_PER_EXPERT = 2
#: bytes of gathered expert weights held at once: more pairs run in chunks of this size
GATHER_CHUNK_BYTES = 256 << 20


def gathered_applies(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the CUDA expert layers take the gathered form for ``tokens`` tokens of ``top_k``
    choices among ``num_experts`` experts (:data:`GATHER_PAIRS_PER_EXPERT`); shapes only."""
    return tokens * top_k <= GATHER_PAIRS_PER_EXPERT * num_experts


def _experts_gathered(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, inner: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_j weights[t, j] * w2[e] act(w1[e] x[t])``, ``e = index[t, j]``, with no value read on
    the host: per (token, slot) pair its expert's weights indexed on the device (``[S, F, D]``,
    ``S = T * k``, in chunks of at most :data:`GATHER_CHUNK_BYTES`), two batched products, the
    activation between them; weighted in float32 and summed in slot order (:func:`_sum_slots`).
    ``inner`` is the width ``act`` returns (``w2``'s last dimension). No pair (``T == 0`` or
    ``k == 0``): float32 zeros ``[T, D]`` (the empty sum; for ``T == 0`` the loop's result)."""
    if x.dim() != 2 or index.dim() != 2 or index.shape[0] != x.shape[0]:
        raise ValueError(f'expected x [T, D] and index [T, k]; got x {tuple(x.shape)}, index {tuple(index.shape)}')
    if weights.shape != index.shape:
        raise ValueError(f'weights must be [T, k] = {tuple(index.shape)}, got {tuple(weights.shape)}')
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f'index must be int64 or int32, got {index.dtype}')
    T, k = index.shape
    E, D = w1.shape[0], x.shape[1]
    if w1.dim() != 3 or w1.shape[2] != D or w2.shape != (E, D, inner):
        raise ValueError(f'expected the expert weights [E, F, {D}] and [E, {D}, {inner}]; got '
                         f'{tuple(w1.shape)}, {tuple(w2.shape)}')
    if T * k == 0:
        return torch.zeros(T, D, dtype=torch.float32, device=x.device)
    flat = index.reshape(-1)
    rows = x[:, None].expand(T, k, D).reshape(T * k, 1, D)          # pair (t, j) is row t * k + j
    per_pair = (w1[0].numel() + w2[0].numel()) * w1.element_size()
    chunk = max(1, GATHER_CHUNK_BYTES // max(1, per_pair))
    outs = []
    for s in range(0, T * k, chunk):          # shapes only: the same chunks for every step of a bucket
        e = flat[s:s + chunk]
        h = torch.bmm(rows[s:s + chunk], w1.index_select(0, e).transpose(1, 2))     # [c, 1, F]
        outs.append(torch.bmm(act(h), w2.index_select(0, e).transpose(1, 2))[:, 0])    # [c, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return _sum_slots((out.float() * weights.reshape(-1, 1)).view(T, k, D))


def relu2_experts_gathered(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
                           down: torch.Tensor) -> torch.Tensor:
    """:func:`relu2_experts_loop` with no value of the routing read on the host (a CUDA graph can
    capture it), on any device: each (token, slot) pair's expert weights gathered on the device,
    batched products (:func:`_experts_gathered`). Equal to the loop to float32 rounding (other
    products, the same slot-order sum); memory ``S * I * D`` per chunk of pairs.

    Args:
        x: ``[T, D]``.
        index: int64 or int32 ``[T, k]`` chosen experts, each in ``[0, E)`` (not checked: that
            would read it on the host); weights: ``[T, k]`` their routing weights.
        up: ``[E, I, D]``; down: ``[E, D, I]``.

    Returns:
        ``[T, D]`` in ``x.dtype``.

    Raises:
        ValueError: inconsistent shapes or an index dtype other than int64 / int32.
    """
    return _experts_gathered(x, index, weights, up, down, up.shape[1], _relu2).to(x.dtype)


def limited_swiglu_experts_gathered(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                                    gate_up: torch.Tensor, down: torch.Tensor, act: str,
                                    limit: float) -> torch.Tensor:
    """:func:`limited_swiglu_experts_loop` with no value of the routing read on the host, on any
    device (as :func:`relu2_experts_gathered`); equal to the loop to float32 rounding.

    Args:
        x: ``[T, H]``.
        index: int64 or int32 ``[T, k]`` chosen experts, each in ``[0, E)`` (not checked);
            weights: ``[T, k]``.
        gate_up: ``[E, 2I, H]`` gate rows first, then up rows; down: ``[E, H, I]``.
        act: ``'clipped'`` or ``'clamped'`` (:data:`LIMITED_SWIGLU`); limit: its limit.

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: an unknown ``act``, an odd ``gate_up.shape[1]``, inconsistent shapes or an
            index dtype other than int64 / int32.
    """
    if act not in LIMITED_SWIGLU:
        raise ValueError(f'act must be one of {sorted(LIMITED_SWIGLU)}, got {act!r}')
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f'gate_up must be [E, 2I, H] (an even number of rows), got {tuple(gate_up.shape)}')
    fn = LIMITED_SWIGLU[act]
    return _experts_gathered(x, index, weights, gate_up, down, gate_up.shape[1] // 2,
                             lambda h: fn(*h.chunk(2, dim=-1), limit)).to(x.dtype)


@register_kernel('relu2_experts', device_type='cuda', priority=5)
def relu2_experts_cuda(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    """:func:`relu2_experts_loop` on CUDA: :func:`relu2_experts_gathered` while
    :func:`gathered_applies` (decode steps: nothing read on the host, so a CUDA graph captures
    the layer), else the loop (it reads the rows per expert on the host)."""
    if gathered_applies(*index.shape, up.shape[0]):
        return relu2_experts_gathered(x, index, weights, up, down)
    return relu2_experts_loop(x, index, weights, up, down)


@register_kernel('limited_swiglu_experts', device_type='cuda', priority=5)
def limited_swiglu_experts_cuda(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                                down: torch.Tensor, act: str, limit: float) -> torch.Tensor:
    """:func:`limited_swiglu_experts_loop` on CUDA: :func:`limited_swiglu_experts_gathered` while
    :func:`gathered_applies`, else the loop (as :func:`relu2_experts_cuda`)."""
    if gathered_applies(*index.shape, gate_up.shape[0]):
        return limited_swiglu_experts_gathered(x, index, weights, gate_up, down, act, limit)
    return limited_swiglu_experts_loop(x, index, weights, gate_up, down, act, limit)
