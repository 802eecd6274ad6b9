"""FP8 block-quantized weights: dequantization and the block-scaled GEMM ``fp8_block_linear``.

A quantized weight ``W [..., N, K]`` is stored as e4m3 values ``q`` (``torch.float8_e4m3fn``) and
float32 inverse scales ``s [..., ceil(N / bn), ceil(K / bk)]``, one per ``bn x bk`` block (128 x
128 in the official checkpoints; the last row / column block is ragged when N or K is not a
multiple)::

    W[..., n, k] = float32(q[..., n, k]) * s[..., n // bn, k // bk]     (then rounded to the compute dtype)

:func:`dequantize_fp8_blocks` computes exactly that (the float32 product, one rounding), the
math of transformers' ``Fp8Dequantize`` when it loads an FP8 checkpoint with ``dequantize=True``
(on a machine without FP8 support) and of its ``_dequantize_fp8_weight`` (which also handles
ragged blocks).

``fp8_block_linear(x, q, s, block, bias) = x @ W^T + bias`` with ``W`` as above, in ``x.dtype``:

- torch (any device): dequantizes ``W`` into ``x.dtype`` and calls ``F.linear``;
- Triton (CUDA): one program per ``[BM, BN]`` output tile walks K in ``BK`` steps, loads the
  e4m3 tile (as bytes, bit-cast), multiplies each row by its block's scale, rounds it to
  ``x.dtype`` and accumulates ``x_tile @ W_tile^T`` in float32 (float32 operands are multiplied
  at full precision, as ``F.linear`` does, not in Triton's default TF32); ``BN`` and ``BK``
  divide the block, so a tile never straddles two scale blocks along K and reads one scale per
  row. The weight stays FP8 in memory (one byte per element); only a tile is ever dequantized.
  Runs on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it against the torch
  version).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import register_kernel, static_loop_end, triton_available

__all__ = ['dequantize_fp8_blocks', 'check_fp8_scale', 'fp8_block_linear_torch', 'fp8_block_linear_triton',
           'FP8_DTYPE']

FP8_DTYPE = torch.float8_e4m3fn


def check_fp8_scale(name: str, weight_shape, scale_shape, block: tuple[int, int]) -> None:
    """Raise ValueError naming ``name`` (the scale tensor) unless ``scale_shape`` is
    ``[..., ceil(N / bn), ceil(K / bk)]`` for ``weight_shape [..., N, K]``."""
    *lead, n, k = weight_shape
    want = (*lead, -(-n // block[0]), -(-k // block[1]))
    if tuple(scale_shape) != want:
        raise ValueError(f'{name}: FP8 scale shape {tuple(scale_shape)} does not fit weight shape '
                         f'{tuple(weight_shape)} with weight_block_size {list(block)} (expected {want})')


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """``q`` float8_e4m3fn ``[..., N, K]``, ``scale_inv`` float32 ``[..., ceil(N/bn), ceil(K/bk)]``
    → ``[..., N, K]`` in ``dtype`` (float32 product, rounded once).

    Raises:
        ValueError: ``scale_inv`` does not fit ``q`` (see :func:`check_fp8_scale`).
    """
    check_fp8_scale('weight_scale_inv', q.shape, scale_inv.shape, block)
    n, k = q.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


@register_kernel('fp8_block_linear', device_type='any')
def fp8_block_linear_torch(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` → ``[..., N]`` in ``x.dtype``, ``W`` dequantized from
    ``q [N, K]`` / ``scale_inv`` into ``x.dtype`` first."""
    return F.linear(x, dequantize_fp8_blocks(q, scale_inv, block, x.dtype), bias)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemm(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 BLOCK_N_Q: tl.constexpr, BLOCK_K_Q: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STATIC_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        # STATIC_K: the loop end under the interpreter, -1 compiled (kernels.static_loop_end); not
        # assigned to a name first: the interpreter would turn it back into a one-element array
        for k0 in range(0, STATIC_K if STATIC_K >= 0 else K, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            wb = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                         other=0)
            w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            s = tl.load(s_ptr + (rn // BLOCK_N_Q) * stride_sn + k0 // BLOCK_K_Q, mask=rn < N, other=0.0)
            w = (w * s[:, None]).to(x.dtype)
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return fp8_gemm


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision of the Triton GEMM for operands of ``dtype``: ``'ieee'``
    (full precision, as ``F.linear``) for float32, whose Triton default is TF32 (a 10-bit
    mantissa); ``'tf32'`` (the default, which 16-bit operands ignore) otherwise."""
    return 'ieee' if dtype == torch.float32 else 'tf32'


def _pick_tile(block: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides ``block`` (at least 16, Triton's minimum)."""
    t = want
    while t > 16 and block % t:
        t //= 2
    if block % t:
        raise ValueError(f'weight_block_size {block} needs a power-of-two divisor >= 16 for the Triton FP8 GEMM')
    return t


@register_kernel('fp8_block_linear', device_type='cuda', priority=10, available=triton_available)
def fp8_block_linear_triton(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp8_block_linear_torch` as one Triton kernel (see the module docstring); ``q`` 2-D.

    Raises:
        ValueError: ``scale_inv`` does not fit ``q``, or a block size without a power-of-two
            divisor >= 16.
    """
    check_fp8_scale('weight_scale_inv', q.shape, scale_inv.shape, block)
    N, K = q.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    w = q.contiguous().view(torch.uint8)
    s = scale_inv.float().contiguous()
    BM = 16 if M <= 16 else 64
    BN, BK = _pick_tile(block[0], 64), _pick_tile(block[1], 64)
    grid = ((M + BM - 1) // BM, (N + BN - 1) // BN)
    kernel = _kernel()
    kernel[grid](x2, w, s, bias if bias is not None else s, y, M, N, K, x2.stride(0), w.stride(0), s.stride(0),
                 y.stride(0), BLOCK_N_Q=block[0], BLOCK_K_Q=block[1], HAS_BIAS=bias is not None,
                 BM=BM, BN=BN, BK=BK, STATIC_K=static_loop_end(kernel, K),
                 DOT_PRECISION=dot_precision(x2.dtype))
    return y.view(*lead, N)
