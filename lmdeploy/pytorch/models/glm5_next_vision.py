"""The GLM-5.3-Flash vision tower (``vision_config`` of ``glm5_next``) and how its output
enters the text stack.

::

    patches [P, C * tp * p * p] -> patch_embed (Conv3d as one matmul)
      -> depth x [x + attn(RMSNorm(x)); x + clamped-SwiGLU MLP(RMSNorm(x))]
         attn: qkv (bias), per-head RMSNorm on q and k, 2-D axial rotary (row | col
               frequencies over the whole head), non-causal within each image frame
      -> RMSNorm -> each m x m block of patches (block-major order) through the Conv2d
         ``downsample`` (kernel = stride = m) -> merger: proj, LayerNorm, GELU, clamped SwiGLU
      -> one ``[out_hidden_size]`` embedding per image token

The text stack is NoPE, so images only replace the embeddings of their image tokens (in order);
no position depends on an image. Module names follow the checkpoint (``model.visual.*``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .blocks.moe import clamped_swiglu
from .blocks.vision import PatchEmbed, VisionAttention, merge_block_order
from .layers import RMSNorm

__all__ = ['Glm5NextVisionModel', 'ImageRows']


@dataclass
class ImageRows:
    """A forward's image inputs: flat ``rows`` int64 ``[R]`` that are image tokens, in order,
    and ``embeds [R, hidden_size]`` (the vision tower's output for them)."""
    rows: torch.Tensor
    embeds: torch.Tensor

    def cpu(self) -> 'ImageRows':
        """A copy on the CPU (to broadcast to other tensor-parallel ranks)."""
        return ImageRows(self.rows.cpu(), self.embeds.cpu())


class _ClampedMLP(nn.Module):
    def __init__(self, dim: int, inner: int, limit: float, bias: bool):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class _Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads, bias=cfg.attention_bias, qk_norm_eps=cfg.rms_norm_eps)
        self.mlp = _ClampedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, cfg.attention_bias)

    def forward(self, x, cos, sin, cu):
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, inner, limit = cfg.out_hidden_size, cfg.projection_intermediate_size, cfg.swiglu_limit
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.limit = limit
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Glm5NextVisionModel(nn.Module):
    """The vision tower (module docstring).

    Args:
        cfg: ``Glm5NextVisionConfig``.

    Raises:
        ValueError: ``vision_config.hidden_act`` other than ``'silu'`` or
            ``rope_parameters.rope_type`` other than ``'axial'``.
    """

    def __init__(self, cfg):
        super().__init__()
        if cfg.hidden_act != 'silu':
            raise ValueError(f"vision_config.hidden_act must be 'silu', got {cfg.hidden_act!r}")
        rope = dict(getattr(cfg, 'rope_parameters', None) or {})
        if rope.get('rope_type', 'axial') != 'axial':
            raise ValueError(f"vision_config.rope_parameters.rope_type must be 'axial', got {rope['rope_type']!r}")
        self.merge, self.out_dim = cfg.spatial_merge_size, cfg.out_hidden_size
        half = (cfg.hidden_size // cfg.num_heads) // 2
        # a plain CPU attribute, not a buffer: real even when the model is built on the meta device
        self.inv_freq = 1.0 / (float(rope.get('rope_theta', 10000.0)) **
                               (torch.arange(0, half, 2, dtype=torch.float, device='cpu') / half))
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=self.merge, stride=self.merge)
        self.merger = _Merger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` float ``[P, C * tp * p * p]`` (patches in the processor's
        block-major order), ``grid_thw`` int64 ``[N, 3]`` → ``[sum t*h*w / m^2, out_hidden_size]``."""
        dev = pixel_values.device
        x = self.patch_embed(pixel_values)
        rc, cu = [], [0]
        for t, h, w in grid_thw.reshape(-1, 3).tolist():
            rows, cols = merge_block_order(h, w, self.merge)
            rc.append(torch.stack([rows, cols], -1).repeat(t, 1))
            cu.extend(cu[-1] + h * w * (i + 1) for i in range(t))
        angles = torch.cat(rc).to(dev).float()[..., None] * self.inv_freq.to(dev)   # [P, 2, half / 2]
        angles = angles.reshape(angles.shape[0], -1)
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos(), emb.sin()
        for blk in self.blocks:
            x = blk(x, cos, sin, cu)
        x = self.post_layernorm(x)
        m = self.merge
        x = self.downsample(x.view(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2)).view(-1, self.out_dim)
        return self.merger(x)
