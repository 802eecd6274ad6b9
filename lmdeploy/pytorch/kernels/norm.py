"""RMS norms (Zhang & Sennrich, 2019): plain, zero-centred, and gated (Gated DeltaNet's output norm).

Two ops, each with a torch implementation for any device and a native one for CPU:

- ``rms_norm(x, weight, eps, zero_centered)``: ``h = x / sqrt(mean(x^2) + eps)`` in float32,
  then ``h * (1 + w)`` when ``zero_centered`` (Qwen3-Next stores ``w - 1``), else ``w * h``;
- ``gated_rms_norm(x, z, weight, eps)``: ``w * rms(x) * silu(z)``.

The CPU implementations run :func:`~.cpu_native.rms_norm_native` (one pass, float32) when it
applies and the torch form otherwise (other dtypes, autograd, no native library), so a model
asks the registry once and never looks at the device or the library.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register_kernel
from .cpu_native import native_available, rms_norm_native

__all__ = ['rms_norm_torch', 'rms_norm_cpu', 'gated_rms_norm_torch', 'gated_rms_norm_cpu']


@register_kernel('rms_norm', device_type='any')
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMS norm over the last dim of ``x [..., D]`` with ``weight [D]``, computed in float32;
    returns ``x``'s shape and dtype."""
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.float()   # (a no-op cast is still a dispatched op)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        w = weight if weight.dtype == torch.float32 else weight.float()
        h = h * (1.0 + w)
        return h if dtype == torch.float32 else h.to(dtype)
    return weight * (h if dtype == torch.float32 else h.to(dtype))


@register_kernel('rms_norm', device_type='cpu', priority=5, available=native_available)
def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """:func:`rms_norm_torch` on CPU: one native pass for float32, else the torch form."""
    if x.dtype == torch.float32:
        out = rms_norm_native(x, weight, eps, zero_centered)
        if out is not None:
            return out
    return rms_norm_torch(x, weight, eps, zero_centered)


@register_kernel('gated_rms_norm', device_type='any')
def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms(x) * silu(z)`` over the last dim of ``x, z [..., D]``; ``x``'s dtype."""
    if x.dtype == torch.float32 and z.dtype == torch.float32 and weight.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)
    dtype = x.dtype
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * h * F.silu(z.float())).to(dtype)


@register_kernel('gated_rms_norm', device_type='cpu', priority=5, available=native_available)
def gated_rms_norm_cpu(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm_torch` on CPU: one native pass for float32, else the torch form."""
    if x.dtype == torch.float32 and z.dtype == torch.float32 and weight.dtype == torch.float32:
        out = rms_norm_native(x, weight, eps, False, gate=z)
        if out is not None:
            return out
    return gated_rms_norm_torch(x, z, weight, eps)
