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
  layer (sort, both projections, SwiGLU, weighted sum per token) in one call; ``FusedExperts``
  calls it before this registry's kernel (it takes the routing, not sorted rows).
- grouped (CUDA, when ``torch._grouped_mm`` exists and row strides are 16-byte multiples):
  each projection is ONE grouped matmul over all experts, whatever the batch hits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel
from .linear import linear

__all__ = ['swiglu_experts_loop', 'swiglu_experts_grouped', 'grouped_mm_usable']


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
