"""Qwen3.5 vision encoder and patch merger (weights ``model.visual.*`` of a Qwen3.5 checkpoint),
and the multimodal rotary positions of a prompt with images.

An image arrives preprocessed by the checkpoint's own ``transformers`` image processor:
``pixel_values`` float ``[P, C * tp * p * p]`` (P patches of ``tp`` frames of ``p x p`` pixels,
already in spatial-merge-block order: the ``m x m`` patches that merge into one token are
consecutive) and ``image_grid_thw`` int64 ``[1, 3]`` = ``(t, h, w)`` in patches::

    patches  --linear-->  + learned position table (bilinear-resampled to h x w)
             --> depth x [LayerNorm, bidirectional attention with 2-D rotary (row, col), LayerNorm, MLP]
             --> merger: LayerNorm per patch, concat m*m patches, Linear, GELU, Linear
             --> [t * h/m * w/m, out_hidden_size]: one row per <|image_pad|> token

Text positions (M-RoPE, :func:`mrope_positions`): text tokens get the same position on all three
axes; an image starting at text position ``p0`` gives its token ``k`` (row-major on the merged
``H x W`` grid) ``(p0, p0 + k // W, p0 + k % W)``, and the text after it resumes at
``p0 + max(H, W)``. So a token's position depends on every image before it: it is always
derived from the sequence's full list of images, never from one chunk.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .blocks.vision import PatchEmbed, VisionAttention, merge_block_order, merged_grid

__all__ = ['Qwen3_5VisionModel', 'mrope_positions']


def mrope_positions(start: int, length: int, images: Sequence, merge: int) -> torch.Tensor:
    """M-RoPE positions int64 ``[3, length]`` of tokens ``[start, start + length)`` of a sequence.

    Args:
        start, length: the token range (may run past the prompt into generated tokens).
        images: the sequence's :class:`~lmdeploy.pytorch.multimodal.MultimodalInput` list (all of
            them, any order); each needs ``data['image_grid_thw']`` and a span of exactly
            ``t * H * W`` tokens.
        merge: the vision tower's ``spatial_merge_size``.

    Positions as computed by ``transformers``' ``Qwen3_5Model.get_rope_index`` for images: every
    image shifts later text by ``max(H, W) - t * H * W`` (see the module docstring).
    """
    idx = torch.arange(start, start + length, dtype=torch.long)
    pos = idx.clone()[None].repeat(3, 1)
    shift = 0                                         # position minus token index, before the image
    for mm in sorted(images, key=lambda m: m.start):
        t, H, W = merged_grid(mm.data['image_grid_thw'], merge)
        n = mm.end - mm.start
        inside = (idx >= mm.start) & (idx < mm.end)
        after = idx >= mm.end
        p0 = mm.start + shift
        k = idx[inside] - mm.start
        pos[0, inside] = p0
        pos[1, inside] = p0 + (k % (H * W)) // W
        pos[2, inside] = p0 + k % W
        shift += max(H, W) - n
        pos[:, after] = idx[after] + shift
    return pos


def _act(name: str):
    if name in ('gelu_pytorch_tanh', 'gelu_tanh'):
        return lambda x: F.gelu(x, approximate='tanh')
    if name == 'gelu':
        return F.gelu
    if name == 'silu':
        return F.silu
    raise ValueError(f'vision_config.hidden_act {name!r} is not supported (gelu, gelu_pytorch_tanh, silu)')


class _VisionBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _act(cfg.hidden_act)

    def forward(self, x, cos, sin, cu):
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


class _Merger(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).reshape(-1, self.merged))))


class Qwen3_5VisionModel(nn.Module):
    """The Qwen3.5 vision tower (ViT with a learned, resampled position table and 2-D rotary
    attention, Qwen3-VL design) and its patch merger. Module names follow the checkpoint
    (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.*}``,
    ``merger.*``).

    Args:
        cfg: ``Qwen3_5VisionConfig``.

    Raises:
        ValueError: ``vision_config.hidden_act`` unsupported, ``rope_parameters.rope_type`` not
            ``axial``, or ``num_position_embeddings`` not a square.
    """

    def __init__(self, cfg):
        super().__init__()
        rope = dict(getattr(cfg, 'rope_parameters', None) or {})
        if rope.get('rope_type', 'axial') != 'axial':
            raise ValueError(f"vision_config.rope_parameters.rope_type must be 'axial', got {rope['rope_type']!r}")
        self.side = int(round(cfg.num_position_embeddings ** 0.5))
        if self.side * self.side != cfg.num_position_embeddings:
            raise ValueError(f'vision_config.num_position_embeddings must be a square, got '
                             f'{cfg.num_position_embeddings}')
        self.merge = cfg.spatial_merge_size
        head_dim = cfg.hidden_size // cfg.num_heads
        quarter = head_dim // 2
        # a plain float32 CPU attribute, not a buffer: real even when built on the meta device
        self.inv_freq = 1.0 / (float(rope.get('rope_theta', 10000.0)) **
                               (torch.arange(0, quarter, 2, dtype=torch.float, device='cpu') / quarter))
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(_VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` float ``[P, C * tp * p * p]`` of one or more images, ``grid_thw``
        int64 ``[N, 3]`` → merged embeddings ``[sum t*h*w / m^2, out_hidden_size]`` (images in order)."""
        dev = pixel_values.device
        x = self.patch_embed(pixel_values)
        table = self.pos_embed.weight.float().t().reshape(1, -1, self.side, self.side)
        pos, rc, cu = [], [], [0]
        for t, h, w in grid_thw.reshape(-1, 3).tolist():
            rows, cols = merge_block_order(h, w, self.merge)
            # the learned side x side table, resampled to the image's h x w (corners aligned)
            grid = F.interpolate(table, size=(h, w), mode='bilinear', align_corners=True)[0]
            pos.append(grid[:, rows.to(dev), cols.to(dev)].t().repeat(t, 1))
            rc.append(torch.stack([rows, cols], -1).repeat(t, 1))
            base = cu[-1]
            cu.extend(base + h * w * (i + 1) for i in range(t))
        x = x + torch.cat(pos).to(x.dtype)
        angles = torch.cat(rc).to(dev).float()[..., None] * self.inv_freq.to(dev)   # [P, 2, q/2]
        angles = angles.reshape(angles.shape[0], -1)                                # [row freqs | col freqs]
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos(), emb.sin()
        for blk in self.blocks:
            x = blk(x, cos, sin, cu)
        return self.merger(x)
