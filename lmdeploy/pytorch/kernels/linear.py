"""Dense projections ``y = x W^T + b`` with the GEMM orientation chosen by shape.

On CPU, MKL's single-precision GEMM for ``x [M, K] @ W^T`` with ``W [N, K]`` row-major is slow
for a *skinny* ``x`` (8 <= M < 64 rows: a decode step of 8-63 sequences, or one MoE expert's
run of 8-63 routed rows, see :mod:`.moe`): it runs about as fast
as ``M = 64``. The same product computed the other way round, ``(W @ x^T)^T``, takes MKL's
matrix-times-few-columns path, which streams ``W`` once at memory speed. Measured on the 2-core
benchmark machine (fp32, one weight of 3088 x 1024): 1031 us vs 507 us at M = 16, 794 us vs
526 us at M = 8, equal at M = 64; at M <= 4 the direct form is the faster one (matrix-vector).

Both orientations compute the same dot products; only the summation order inside MKL differs,
so results agree to float32 rounding (relative ~1e-7), not bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ['linear', 'SKINNY_ROWS']

# rows for which (W x^T)^T is used on CPU (float32); outside it F.linear is as fast or faster
SKINNY_ROWS = range(8, 64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``(weight @ x^T)^T`` for skinny float32 ``x`` on CPU.

    Args:
        x: ``[..., K]``.
        weight: ``[N, K]``.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[..., N]`` contiguous, in ``x.dtype``.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows in SKINNY_ROWS and x.device.type == 'cpu' and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.dim() == 2):
        x2 = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])
        y = torch.mm(weight, x2.t()).t().contiguous()
        if bias is not None:
            y += bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
