"""Quantized checkpoints: which ``quantization_config`` the engine loads, and how.

Supported: **FP8 block quantization** (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size:
[bn, bk]``, dynamic activations), the format of the official Qwen3-Next / Qwen3.5 / Qwen3.6 FP8
releases. Each quantized ``<module>.weight`` (``float8_e4m3fn [..., N, K]``) comes with
``<module>.weight_scale_inv`` (float32 ``[..., ceil(N/bn), ceil(K/bk)]``); modules in
``modules_to_not_convert`` are stored unquantized and load as any float tensor.

How the weights are used (:class:`Fp8Weights`)::

    CPU      every quantized weight is dequantized block-wise into the compute dtype at load
             (:func:`~lmdeploy.pytorch.kernels.fp8.dequantize_fp8_blocks`, ragged last blocks
             included): what transformers computes when it loads the checkpoint with
             dequantize=True on a machine without FP8 support
    CUDA     the weight of each plain projection (one checkpoint tensor -> one Linear) stays
             FP8 with its scales and runs the block-scaled FP8 GEMM ``fp8_block_linear``
             (Triton; torch fallback that dequantizes); packed projections (q|k|v, gate|up,
             the Gated DeltaNet input projections) and MoE experts are dequantized at load

Refused by name (a ValueError naming the method and what is supported): every other
``quant_method`` (AWQ, GPTQ, compressed-tensors, bitsandbytes, ...), FP8 with another ``fmt``
or a static activation scheme, a scale whose shape does not fit its weight, an FP8 tensor
without its scale, a scale without its weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ..kernels.fp8 import FP8_DTYPE, check_fp8_scale, dequantize_fp8_blocks

__all__ = ['Fp8Config', 'Fp8Weights', 'parse_quantization_config', 'keep_fp8_linears', 'SUPPORTED']

SUPPORTED = "quant_method 'fp8' (fmt 'e4m3', block-wise weight_block_size, dynamic activations)"
SCALE_SUFFIX = '.weight_scale_inv'


@dataclass(frozen=True)
class Fp8Config:
    """A checked FP8 ``quantization_config``.

    Attributes:
        block: ``(bn, bk)`` rows x columns of a scale block.
        modules_to_not_convert: module names the checkpoint keeps unquantized.
    """
    block: tuple[int, int]
    modules_to_not_convert: tuple[str, ...] = ()


def _as_dict(quant) -> dict:
    if isinstance(quant, dict):
        return quant
    if hasattr(quant, 'to_dict'):
        return quant.to_dict()
    return dict(vars(quant))


def parse_quantization_config(config) -> Fp8Config | None:
    """The checked quantization of ``config`` (None when it has no ``quantization_config``).

    Raises:
        ValueError: naming ``quantization_config.<field>`` and the value, and saying what is
            supported (:data:`SUPPORTED`).
    """
    quant = getattr(config, 'quantization_config', None)
    if quant is None and hasattr(config, 'get_text_config'):
        quant = getattr(config.get_text_config(), 'quantization_config', None)
    if not quant:
        return None
    q = _as_dict(quant)
    method = q.get('quant_method')
    if method != 'fp8':
        raise ValueError(f'quantization_config.quant_method={method!r} is not supported; supported: {SUPPORTED}')
    fmt = q.get('fmt', 'e4m3')
    if fmt != 'e4m3':
        raise ValueError(f'quantization_config.fmt={fmt!r} is not supported; supported: {SUPPORTED}')
    act = q.get('activation_scheme', 'dynamic')
    if act != 'dynamic':
        raise ValueError(f'quantization_config.activation_scheme={act!r} is not supported; supported: {SUPPORTED}')
    block = q.get('weight_block_size')
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f'quantization_config.weight_block_size={block!r} is not supported: block-wise FP8 needs '
                         f'two positive ints, e.g. [128, 128]; supported: {SUPPORTED}')
    return Fp8Config(tuple(block), tuple(q.get('modules_to_not_convert') or ()))


class Fp8Weights:
    """Turns a checkpoint's tensors into what the model loads.

    Args:
        quant: the checked config.
        scales: every ``<module>.weight_scale_inv`` tensor of the checkpoint, by name.
        dtype: the compute dtype the weights are dequantized into.
        keep: weight names passed through still FP8 (CUDA: plain projections, see the module
            docstring); their scales are passed through too.
    """

    def __init__(self, quant: Fp8Config, scales: dict[str, torch.Tensor], dtype: torch.dtype,
                 keep: frozenset[str] = frozenset()):
        self.quant, self.scales, self.dtype, self.keep = quant, scales, dtype, keep

    @classmethod
    def from_checkpoint(cls, model_path: str, quant: Fp8Config, dtype: torch.dtype,
                        keep: frozenset[str] = frozenset()) -> 'Fp8Weights':
        """Read the scales (small) of the checkpoint in ``model_path``."""
        from safetensors import safe_open

        from .checkpoint_files import weight_files
        scales = {}
        for path in weight_files(model_path):
            with safe_open(path, framework='pt') as f:
                for name in f.keys():
                    if name.endswith(SCALE_SUFFIX):
                        scales[name] = f.get_tensor(name)
        return cls(quant, scales, dtype, keep)

    def weight_names(self) -> set[str]:
        """Names of the quantized weights."""
        return {n[:-len(SCALE_SUFFIX)] + '.weight' for n in self.scales}

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor to load for checkpoint tensor ``name``: a quantized weight dequantized
        (or kept FP8 when in ``keep``), a scale dropped (None) unless its weight is kept, any
        other tensor as stored.

        Raises:
            ValueError: naming the tensor: a scale shape that does not fit the weight, an FP8
                tensor without a scale, a scale without a weight tensor of type float8_e4m3fn.
        """
        if name.endswith(SCALE_SUFFIX):
            return tensor if name[:-len(SCALE_SUFFIX)] + '.weight' in self.keep else None
        scale_name = name[:-len('.weight')] + SCALE_SUFFIX if name.endswith('.weight') else None
        scale = self.scales.get(scale_name) if scale_name else None
        if scale is None:
            if tensor.dtype == FP8_DTYPE:
                raise ValueError(f'{name}: an FP8 (float8_e4m3fn) tensor without {name}_scale_inv / '
                                 f'weight_scale_inv in the checkpoint')
            return tensor
        if tensor.dtype != FP8_DTYPE:
            raise ValueError(f'{scale_name}: a scale for {name}, which is {tensor.dtype}, not float8_e4m3fn')
        check_fp8_scale(scale_name, tensor.shape, scale.shape, self.quant.block)
        if name in self.keep:
            return tensor
        return dequantize_fp8_blocks(tensor, scale, self.quant.block, self.dtype)

    def stream(self, weights: Iterable[tuple[str, torch.Tensor]], complete: bool = True
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`convert` over ``(name, tensor)`` pairs, dropping what it drops.

        Args:
            weights: checkpoint tensors.
            complete: ``weights`` is the whole checkpoint (then a scale whose weight never came
                is an error); False for a part (one rank's shard, the ``mtp.*`` head).

        Raises:
            ValueError: see :meth:`convert`; also a scale whose weight the checkpoint lacks.
        """
        seen = set()
        for name, tensor in weights:
            seen.add(name)
            out = self.convert(name, tensor)
            if out is not None:
                yield name, out
        missing = sorted(n for n in self.scales if n[:-len(SCALE_SUFFIX)] + '.weight' not in seen)
        if complete and missing:
            raise ValueError(f'{missing[0]}: an FP8 scale without its weight in the checkpoint')


def keep_fp8_linears(model: torch.nn.Module, weights: set[str], block: tuple[int, int]) -> frozenset[str]:
    """Switch each plain :class:`~.layers.Linear` of ``model`` whose weight is one quantized
    checkpoint tensor of ``weights`` to FP8 storage (:meth:`~.layers.Linear.to_fp8`); returns
    those checkpoint names. Checkpoint names under ``model.language_model.`` (Qwen3.5) are
    matched as ``model.``. Only decoder-layer projections switch (``lm_head`` and the vision
    tower keep the compute dtype: their weight dtype is read as the model's)."""
    from .layers import Linear
    plain = {f'{path}.weight': module for path, module in model.named_modules()
             if type(module) is Linear and path.startswith('model.layers.')}
    kept = set()
    for name in weights:
        module = plain.get(name) or plain.get(name.replace('model.language_model.', 'model.', 1))
        if module is not None:
            module.to_fp8(block)
            kept.add(name)
    return frozenset(kept)
