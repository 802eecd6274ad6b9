"""Dense projections ``y = x W^T + b`` with the GEMM orientation chosen by shape.

On CPU, MKL's single-precision GEMM for ``x [M, K] @ W^T`` with ``W [N, K]`` row-major is slow
for a *skinny* ``x`` (a decode step of 8-47 sequences, or one MoE expert's run of that many
routed rows, see :mod:`.moe`): it runs about as fast as ``M = 64``. The same product computed
the other way round, ``(W @ x^T)^T``, takes MKL's matrix-times-few-columns path, which streams
``W`` once at memory speed. Which is faster depends on M and on the inner size K; measured on
the 2-core benchmark machine (fp32, weights streamed from memory, not cache; direct vs
transposed, us):

    K = 1024, N = 3088:  M = 16: 1487 vs 896   M = 48: 1742 vs 1371   M = 56: 1774 vs 1850
    K = 1024, N = 1024:  M = 8: 281 vs 283     M = 46: 506 vs 454     M = 50: 528 vs 636
    K = 2048, N = 1024:  M = 8: 693 vs 610     M = 16: 849 vs 588     M = 50: 1079 vs 1343
    K = 512,  N = 1024:  M = 8: 151 vs 196     M = 16: 220 vs 201     M = 32: 267 vs 233
                         M = 40: 245 vs 314    M = 56: 299 vs 423

so the transposed form is used for ``8 <= M < 48`` when ``K >= 1024`` and for ``16 <= M <= 32``
below (:func:`transposed_rows`); at M <= 4 the direct form is the faster one (matrix-vector).

Both orientations compute the same dot products; only the summation order inside MKL differs,
so results agree to float32 rounding (relative ~1e-7), not bit for bit.

bfloat16 on CPU: the direct product of a few rows reads bf16 weights at only ~14 GB/s; the
transposed form is faster from 2 to 64 rows and ``torch.mv`` for one row (same machine, weights
streamed from memory, direct / transposed / mv, us)::

    K = 1024, N = 1024:  M = 1: 141 / 142 / 106   M = 4: 148 / 109   M = 16: 144 / 111   M = 64: 201 / 154
    K = 512,  N = 1024:  M = 1: 96 / 97 / 72      M = 8: 97 / 70     M = 64: 134 / 81
    K = 1024, N = 3088:  M = 1: 375 / 348 / 284   M = 16: 385 / 285  M = 64: 678 / 355

(:data:`BF16_TRANSPOSED_ROWS`); longer inputs (prefill) keep the direct form (AMX tiles).

float32 inputs of 25-64 rows go to the native broadcast-form product where the library is built
without AVX-512 (:func:`~.cpu_native.bcast_rows`; on the 2-core AMD EPYC AVX2 host 1.14-1.63x
the MKL forms above at 25-64 rows, where products such as a 32-token prompt's are bound by the
multiply-add units, not by memory); with AVX-512 they keep the MKL forms above.

float32 inputs of 1-24 rows on CPU (:data:`~.cpu_native.NATIVE_ROWS`) go to the native few-row
product of :mod:`.cpu_native` whenever it is built, which reads each weight once for all rows
(on a 2-core Intel host the whole dense projection set of a batch-16 step: 12.6 -> 11.7 ms; at 4
rows 10.6 -> 7.5 ms; at 1-3 rows it matched MKL there, 6.5-7.5 ms against 6.5-6.9; on the 2-core
AMD EPYC benchmark host MKL reads 17-18 GB/s for one row and 7-9 GB/s for two or three, the native
product 26-35 GB/s: half the time of a batch-1 decode product). The rule is fixed per row count,
not timed per process (two processes must round alike); the two MKL forms above remain for the
other row counts and whenever the native library is absent.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_native import NATIVE_ROWS, bcast_rows, matmul_bcast, matmul_rows

__all__ = ['linear', 'transposed_rows', 'SKINNY_ROWS', 'BF16_TRANSPOSED_ROWS']

# rows for which (W x^T)^T is used on CPU (float32) when K >= 1024; outside it F.linear is as
# fast or faster. Narrower inputs (K < 1024) gain only in SKINNY_ROWS_NARROW.
SKINNY_ROWS = range(8, 48)
SKINNY_ROWS_NARROW = range(16, 33)
# bfloat16 on CPU: rows computed as (W x^T)^T; one row is a matrix-vector product (torch.mv)
BF16_TRANSPOSED_ROWS = range(2, 65)


def transposed_rows(in_features: int) -> range:
    """Row counts M for which :func:`linear` computes ``(W x^T)^T`` on CPU in float32, for a
    weight with ``in_features`` (K) columns (see the module docstring for the measurements)."""
    return SKINNY_ROWS if in_features >= 1024 else SKINNY_ROWS_NARROW


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed by the native few-row product for 1-24 float32 rows
    on CPU (:func:`~.cpu_native.matmul_rows`, when built), by the native broadcast-form product
    for 25-64 float32 rows on a CPU without AVX-512 (:func:`~.cpu_native.matmul_bcast`), else as
    ``(weight @ x^T)^T`` for skinny float32 or bfloat16 ``x`` on CPU (one bfloat16 row:
    ``torch.mv``).

    Args:
        x: ``[..., K]``.
        weight: ``[N, K]``.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[..., N]`` contiguous, in ``x.dtype``.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != 'cpu' or weight.dim() != 2 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    x2d = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])
    y = None
    if x.dtype == torch.float32:
        if rows in NATIVE_ROWS:
            y = matmul_rows(x2d, weight)
        elif rows in bcast_rows():
            y = matmul_bcast(x2d, weight)
    if y is None:
        if x.dtype == torch.bfloat16 and rows == 1:
            y = torch.mv(weight, x.reshape(-1))[None]
        elif (x.dtype == torch.float32 and rows in transposed_rows(x.shape[-1])
              or x.dtype == torch.bfloat16 and rows in BF16_TRANSPOSED_ROWS):
            y = torch.mm(weight, x2d.t()).t().contiguous()
        else:
            return F.linear(x, weight, bias)
    if bias is not None:
        y += bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])   # (no extra view op per call)
