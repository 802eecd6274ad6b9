"""Triton paged decode attention: the CUDA implementation of ``paged_decode_attention``.

One program per (sequence, query head). It walks the sequence's block table one KV block at a
time with an online softmax (Milakov & Gimelshein, "Online normalizer calculation for softmax",
2018), so no ``[N, S]`` gather and no score matrix is materialised::

    program (n, h):  q = Q[n, h]                       kv head = h // (H / Hkv)
      for j in blocks of n:   s = K[table[n, j]] . q * scale      (positions >= kv_len: -inf)
                              m' = max(m, max s);  l = l e^(m - m') + sum e^(s - m')
                              acc = acc e^(m - m') + e^(s - m') V[table[n, j]]
      out[n, h] = acc / l

Registered for CUDA when triton imports; runs on CPU tensors under ``TRITON_INTERPRET=1``
(how the tests check it against the torch version). Importing this module never needs triton.
"""
from __future__ import annotations

import torch

from . import once, register_kernel, triton_available

__all__ = ['paged_decode_attention_triton']


@once
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _decode(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale,
                stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tn, stride_on, stride_oh, group, block_size, head_dim,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0)
        h = tl.program_id(1)
        kv_head = h // group
        kv_len = tl.load(lens_ptr + n)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_T)
        d_ok = d < head_dim
        q = tl.load(q_ptr + n * stride_qn + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        m = tl.full((), float('-inf'), tl.float32)
        denom = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        num_blocks = tl.cdiv(kv_len, block_size)
        # a while loop, not range(num_blocks): Triton 3.6's interpreter cannot loop to a loaded
        # value (a one-element array there; range() fails under NumPy 2). Compiled, both forms
        # are the same loop: Triton software-pipelines a loop without tl.dot only when it is
        # given num_stages, so this one never was.
        j = tl.full((), 0, tl.int32)
        while j < num_blocks:
            block = tl.load(table_ptr + n * stride_tn + j).to(tl.int64)
            pos = j * block_size + t
            t_ok = (t < block_size) & (pos < kv_len)
            tile = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                        mask=tile, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(t_ok, s, float('-inf'))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + block * stride_vb + t[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                        mask=tile, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            denom = denom * alpha + tl.sum(p, axis=0)
            m = m_new
            j += 1
        out = acc / denom
        tl.store(out_ptr + n * stride_on + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    return triton, _decode


@register_kernel('paged_decode_attention', device_type='cuda', priority=10, available=triton_available)
def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_table: torch.Tensor, kv_seqlens: torch.Tensor, scale: float,
                                  gather_index=None) -> torch.Tensor:
    """Contract of :func:`~lmdeploy.pytorch.kernels.attention.paged_decode_attention`
    (``gather_index`` is not needed and ignored). The last dim of ``q`` and of the caches must
    be contiguous; other strides are free (caches may be views into a byte buffer).

    Raises:
        ValueError: a non-contiguous last dim or heads not a multiple of KV heads.
    """
    N, H, D = q.shape
    Hkv = k_cache.shape[2]
    if H % Hkv or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError('paged_decode_attention_triton needs heads % kv_heads == 0 and contiguous head_dim; got '
                         f'q {tuple(q.shape)} strides {q.stride()}, k_cache strides {k_cache.stride()}')
    out = torch.empty_like(q)
    if N == 0:
        return out
    triton, kernel = _kernel()
    table = block_table.contiguous()
    block_size = k_cache.shape[1]
    kernel[(N, H)](q, k_cache, v_cache, table, kv_seqlens.contiguous(), out, float(scale),
                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
                   out.stride(0), out.stride(1), H // Hkv, block_size, D,
                   BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(D))
    return out
