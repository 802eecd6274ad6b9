"""What the vision towers share: the patch embedding (:class:`PatchEmbed`), the order of patches
in merge blocks, bidirectional attention inside each image with 2-D rotary positions
(:class:`VisionAttention`; Qwen3.5's tower, and GLM-5.3-Flash's with per-head q/k RMSNorm), and
the check that a prompt's image spans fit a Qwen2-VL-style tower
(:func:`check_image_spans`: ``t * (h / m) * (w / m)`` image tokens per image).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import RMSNorm

__all__ = ['PatchEmbed', 'VisionAttention', 'check_image_spans', 'merge_block_order', 'merged_grid', 'rotate_half']


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2r]`` → ``[..., 2r]``: ``(a, b)`` halves → ``(-b, a)`` (the rotary pair swap)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def merge_block_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) int64 ``[h * w]`` of each patch of an ``h x w`` grid in spatial-merge-block
    order: the ``m x m`` patches that merge into one token are consecutive, blocks row-major."""
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


class PatchEmbed(nn.Module):
    """A patch (``C x tp x p x p`` values, as the image processor flattens it) → ``[hidden]``:
    the checkpoint's Conv3d (``proj``, with bias) whose kernel = stride = the patch, i.e. one
    matmul per patch.

    Args:
        cfg: the vision config (``in_channels``, ``hidden_size``, ``temporal_patch_size``,
            ``patch_size``).
    """

    def __init__(self, cfg):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[P, C * tp * p * p]`` (any float dtype) → ``[P, hidden]`` in the weight's dtype."""
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention inside each image: fused ``qkv``, rotary on the whole
    head (in float32), ``proj``; with ``qk_norm_eps`` an RMSNorm on each head of q and k first.

    Args:
        dim: the tower's hidden size.
        num_heads: attention heads (``head_dim = dim // num_heads``).
        bias: whether ``qkv`` and ``proj`` have biases.
        qk_norm_eps: None for no q/k norm, else the RMSNorms' epsilon (``q_norm``, ``k_norm``).
    """

    def __init__(self, dim: int, num_heads: int, bias: bool = True, qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """``x [P, dim]``, ``cos/sin [P, head_dim]``, ``cu`` image boundaries (patch offsets,
        ``cu[0] = 0``, ``cu[-1] = P``) → ``[P, dim]``."""
        P = x.shape[0]
        q, k, v = self.qkv(x).view(P, 3, self.num_heads, self.head_dim).unbind(1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(v.dtype)
        out = torch.empty_like(v)
        for a, b in zip(cu[:-1], cu[1:]):
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1)).transpose(0, 1)
        return self.proj(out.reshape(P, -1))


def merged_grid(grid_thw, merge: int) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches → ``(t, h // merge, w // merge)`` tokens on each axis."""
    t, h, w = (int(x) for x in torch.as_tensor(grid_thw).reshape(-1)[:3].tolist())
    return t, h // merge, w // merge


def check_image_spans(token_ids: Sequence[int], multimodal, image_token_id: int, merge: int) -> None:
    """Reject image inputs a Qwen2-VL-style vision tower could not place in the prompt.

    Args:
        token_ids: the prompt's token ids.
        multimodal: its inputs (``modality``, ``data``, ``start``, ``end``); those whose ``data``
            is ``None`` are skipped.
        image_token_id: the token that fills an image's span.
        merge: the tower's spatial merge size ``m``.

    Raises:
        ValueError: a modality other than ``'image'``, data without ``pixel_values`` /
            ``image_grid_thw``, a span whose length is not the image's merged token count
            ``t * (h / m) * (w / m)``, or a span not made only of ``image_token_id``.
    """
    for j, mm in enumerate(multimodal):
        if mm.data is None:
            continue
        if mm.modality != 'image':
            raise ValueError(f'multimodal[{j}].modality: only images are supported, got {mm.modality!r}')
        if 'pixel_values' not in mm.data or 'image_grid_thw' not in mm.data:
            raise ValueError(f'multimodal[{j}].data needs pixel_values and image_grid_thw')
        t, H, W = merged_grid(mm.data['image_grid_thw'], merge)
        if mm.end - mm.start != t * H * W:
            raise ValueError(f'multimodal[{j}]: span of {mm.end - mm.start} tokens, the image has {t * H * W}')
        if any(tok != image_token_id for tok in token_ids[mm.start:mm.end]):
            raise ValueError(f'multimodal[{j}]: span [{mm.start}, {mm.end}) must hold only the image token '
                             f'{image_token_id}')
