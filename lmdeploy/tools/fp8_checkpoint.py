"""Write a checkpoint's matrices FP8 block-quantized, in the layout of the official FP8 releases
(Qwen3-Next-80B-A3B-*-FP8, Qwen3.6-*-FP8): for each quantized ``<module>.weight [..., N, K]``

    <module>.weight            float8_e4m3fn [..., N, K]
    <module>.weight_scale_inv  float32 [..., ceil(N / 128), ceil(K / 128)]

    w ≈ weight.float() * weight_scale_inv[..., n // 128, k // 128]

Each 128 x 128 block (the last row / column block ragged when N or K is not a multiple of 128)
is scaled so its largest magnitude maps to e4m3's largest finite value, 448: ``scale = 448 /
amax``, ``weight = clamp(w * scale)`` rounded to e4m3, ``weight_scale_inv = 1 / scale``
(an all-zero block keeps scale 1). The scheme is the one transformers' ``Fp8Quantize`` applies
to full blocks; ragged blocks are scaled the same way over the elements they hold.

Not quantized (kept in the stored dtype and listed in ``modules_to_not_convert``, as the official
configs do): embeddings, norms, the Gated DeltaNet conv and per-head parameters, ``lm_head``,
the MoE router ``mlp.gate`` and ``shared_expert_gate``, and the vision tower.
"""
from __future__ import annotations

import re

import torch

__all__ = ['quantize_fp8_blocks', 'quantize_state_dict', 'BLOCK', 'FP8_MAX']

BLOCK = (128, 128)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)      # 448
# module paths (as transformers matches them: a prefix up to a module boundary, or a suffix)
NOT_CONVERTED = ['lm_head', 'mlp.gate', 'shared_expert_gate', 'model.visual']
_QUANTIZED = re.compile(r'\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkvz|in_proj_ba|'
                        r'in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj|fc)\.weight$')


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (any float dtype) → ``(float8_e4m3fn [..., N, K], float32 inverse scales
    [..., ceil(N / bn), ceil(K / bk)])`` as in the module docstring."""
    bn, bk = block
    *lead, n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, rows * bn, cols * bk, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    blocks = padded.reshape(*lead, rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(-3, -1))                             # [..., rows, cols]
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
    q = (blocks * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, rows * bn, cols * bk)[..., :n, :k].contiguous()
    return q, (1.0 / scale).to(torch.float32).contiguous()


def quantize_state_dict(tensors: dict[str, torch.Tensor], block: tuple[int, int] = BLOCK
                        ) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize the projection matrices of a checkpoint state dict (published names).

    Returns:
        ``(tensors, quantization_config)``: the new state dict (``*.weight_scale_inv`` added) and
        the ``config.json`` entry ``{'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme':
        'dynamic', 'weight_block_size': [bn, bk], 'modules_to_not_convert': [...]}``.
    """
    out = {}
    for name, t in tensors.items():
        module = name[:-len('.weight')]
        skip = any(module.startswith(p) or module.endswith(p) for p in NOT_CONVERTED)
        if _QUANTIZED.search(name) and t.dim() >= 2 and not skip:
            out[name], out[f'{module}.weight_scale_inv'] = quantize_fp8_blocks(t, block)
        else:
            out[name] = t
    config = dict(quant_method='fp8', fmt='e4m3', activation_scheme='dynamic', weight_block_size=list(block),
                  modules_to_not_convert=list(NOT_CONVERTED))
    return out, config
