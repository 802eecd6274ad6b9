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
             the Gated DeltaNet input projections), MoE experts and MTP heads are dequantized
             at load

Under tensor parallelism (any TP size, the same loader) a rank's projection keeps FP8 when its
split falls on scale-block boundaries: every range it reads starts on a block and all but the
last span whole blocks (the last may end in a ragged block), so its rows (column split) or columns (row split)
of the FP8 tensor come with whole rows / columns of the scale grid (:func:`block_ranges`)::

    o_proj.weight [H, 512], block 128, tp=2, row split (columns)
      rank 0: columns [0, 256)   scale columns [0, 2)   kept FP8
      rank 1: columns [256, 512) scale columns [2, 4)   kept FP8
    the same at tp=4 with [H, 256]: 64 columns per rank, half a block -> dequantized

A split off the blocks is dequantized (the whole tensor is read, dequantized, then sliced) and
the loader logs one line naming how many weights and the first one; the engine still serves.

Refused by name (a ValueError naming the method and what is supported): every other
``quant_method`` (AWQ, GPTQ, compressed-tensors, bitsandbytes, ...), FP8 with another ``fmt``
or a static activation scheme, a scale whose shape does not fit its weight, an FP8 tensor
without its scale, a scale without its weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..kernels.fp8 import FP8_DTYPE, check_fp8_scale, dequantize_fp8_blocks

__all__ = ['Fp8Config', 'Fp8Weights', 'parse_quantization_config', 'keep_fp8_linears', 'block_ranges', 'SUPPORTED']

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
    """Turns a checkpoint's quantized weights into what one rank's model loads.

    Args:
        quant: the checked config.
        scales: every ``<module>.weight_scale_inv`` tensor of the checkpoint, by name.
        dtype: the compute dtype the weights are dequantized into.
        keep: weight names passed through still FP8 (plain projections, see the module
            docstring); their scales (or this rank's rows of them) are passed through too.
        shapes: the full shape of each quantized weight, by name (for the checks and the
            block alignment of a rank's split, :func:`block_ranges`).
    """

    def __init__(self, quant: Fp8Config, scales: dict[str, torch.Tensor], dtype: torch.dtype,
                 keep: frozenset[str] = frozenset(), shapes: dict[str, tuple[int, ...]] | None = None):
        self.quant, self.scales, self.dtype, self.keep = quant, scales, dtype, keep
        self.shapes = shapes or {}

    @classmethod
    def from_checkpoint(cls, model_path: str, quant: Fp8Config, dtype: torch.dtype,
                        keep: frozenset[str] = frozenset()) -> 'Fp8Weights':
        """Read the scales (small) and the quantized weights' shapes (file headers only) of the
        checkpoint in ``model_path``.

        Raises:
            ValueError: a scale whose weight the checkpoint lacks (names the scale).
        """
        from .checkpoint_files import open_safetensors, weight_files
        scales, shapes = {}, {}
        for path in weight_files(model_path):
            with open_safetensors(path) as f:
                for name in f.keys():
                    if name.endswith(SCALE_SUFFIX):
                        scales[name] = f.get_tensor(name)
                    elif name.endswith('.weight'):
                        shapes[name] = tuple(f.get_slice(name).get_shape())
        for name in sorted(scales):
            if _weight_of(name) not in shapes:
                raise ValueError(f'{name}: an FP8 scale without its weight in the checkpoint')
        return cls(quant, scales, dtype, keep, {w: shapes[w] for w in map(_weight_of, scales)})

    def weight_names(self) -> set[str]:
        """Names of the quantized weights."""
        return {_weight_of(n) for n in self.scales}

    def splits_on_blocks(self, name: str, shard) -> bool:
        """Whether a rank's ``shard`` of quantized weight ``name`` (None: whole) is made of
        whole scale blocks, so that it can keep FP8 with the matching rows of its scale."""
        return shard is None or block_ranges(shard, self.shapes[name], self.quant.block) is not None

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor to load for checkpoint tensor ``name`` read whole: a quantized weight
        dequantized (or kept FP8 when in ``keep``), a scale dropped (None) unless its weight is
        kept, any other tensor as stored.

        Raises:
            ValueError: naming the tensor: a scale shape that does not fit the weight, an FP8
                tensor without a scale, a scale without a weight tensor of type float8_e4m3fn.
        """
        if name.endswith(SCALE_SUFFIX):
            return tensor if _weight_of(name) in self.keep else None
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

    def read(self, f, name: str, shard) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield what a rank loads for quantized weight ``name`` of the open safetensors file
        ``f`` under its ``shard`` (None: whole): the weight kept FP8 followed by its scale
        (rows), or the weight dequantized.

        A split on scale-block boundaries reads only the rank's rows of the FP8 tensor and
        their scale blocks (the dequantized part is bit-identical to the same part of the whole
        tensor dequantized: dequantization is one product per element with its block's scale).
        Any other split reads the tensor whole, dequantizes it and slices it.

        Raises:
            ValueError: as :meth:`convert`.
        """
        from .checkpoint_files import read_part, slice_part
        scale_name = name[:-len('.weight')] + SCALE_SUFFIX
        scale = self.scales[scale_name]
        ranges = None if shard is None else block_ranges(shard, self.shapes[name], self.quant.block)
        if shard is None or ranges is None:
            tensor = self.convert(name, f.get_tensor(name))
            yield name, tensor if shard is None else slice_part(tensor, shard)
            if shard is None and name in self.keep:
                yield scale_name, scale
            return
        check_fp8_scale(scale_name, self.shapes[name], scale.shape, self.quant.block)
        tensor = read_part(f, name, shard)
        if tensor.dtype != FP8_DTYPE:
            raise ValueError(f'{scale_name}: a scale for {name}, which is {tensor.dtype}, not float8_e4m3fn')
        part = slice_part(scale, type(shard)(shard.dim, ranges))
        if name in self.keep:
            yield name, tensor
            yield scale_name, part
        else:
            yield name, dequantize_fp8_blocks(tensor, part, self.quant.block, self.dtype)


def _weight_of(scale_name: str) -> str:
    return scale_name[:-len(SCALE_SUFFIX)] + '.weight'


def block_ranges(shard, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[tuple[int, int], ...] | None:
    """The scale ranges that go with a rank's ``shard`` of an FP8 weight of ``shape``
    ``[..., N, K]`` quantized in ``block = (bn, bk)`` blocks, or None when the shard does not
    fall on block boundaries.

    ``shard.ranges`` along ``shard.dim`` are concatenated into the rank's local tensor, which is
    again cut in blocks of ``b``; the shard fits when every local block starts on a checkpoint
    block boundary and all its rows come from that one checkpoint block (so its scale is that
    block's; a local block may end anywhere inside it: a ragged last block, or, when the whole
    dimension is shorter than a block, several ranges that all lie in block 0). The scale ranges
    are the checkpoint blocks of the local blocks, in order. A leading (expert) dimension has no
    block. O(ranges + local blocks).

    Example: ``N = 384`` rows split over 3 ranks (128 rows each) → rank 1's scale rows
    ``((1, 2),)``; over 2 ranks (192 rows each) → None.
    """
    dim = shard.dim % len(shape)
    lead = len(shape) - 2
    if dim < lead:
        return shard.ranges
    size, b = shape[dim], block[dim - lead]
    out = []
    ranges = []
    for lo, hi in shard.ranges:        # adjacent ranges read as one (e.g. q | k | v of one rank at tp=1)
        if ranges and ranges[-1][1] == lo:
            lo = ranges.pop()[0]
        ranges.append((lo, hi))
    blocks, pos = [], 0                 # the checkpoint block of each local block; local rows so far
    for lo, hi in ranges:
        if hi > size:
            return None
        while lo < hi:
            end = min(hi, lo + b - pos % b)     # this range's rows up to the next local block boundary
            g = lo // b
            if (end - 1) // b != g:
                return None                 # the piece spans two checkpoint blocks
            if pos % b == 0:
                if lo % b:
                    return None             # a local block starts inside a checkpoint block
                blocks.append(g)
            elif blocks[-1] != g:
                return None                 # one local block mixes two checkpoint blocks
            pos += end - lo
            lo = end
    for g in blocks:
        if out and out[-1][1] == g:
            out[-1] = (out[-1][0], g + 1)
        else:
            out.append((g, g + 1))
    return tuple(out)


def keep_fp8_linears(model: torch.nn.Module, weights: set[str], block: tuple[int, int],
                     fits=lambda name: True) -> tuple[frozenset[str], frozenset[str]]:
    """Switch each projection of ``model`` that multiplies one quantized checkpoint weight of
    ``weights`` with a plain or row-parallel :class:`~.layers.Linear` (not a packed one) to FP8
    storage (:meth:`~.layers.Linear.to_fp8`), when ``fits(name)``: under tensor parallelism,
    when the rank's split falls on scale-block boundaries (:meth:`Fp8Weights.splits_on_blocks`).
    Checkpoint names under ``model.language_model.`` (Qwen3.5) are matched as ``model.``. Only
    decoder-layer projections switch (``lm_head`` and the vision tower keep the compute dtype:
    their weight dtype is read as the model's).

    Returns:
        ``(kept, unfit)``: the checkpoint names switched, and those that could have been but
        whose split does not fit the blocks (they are dequantized).
    """
    from .layers import Linear, PackedLinear
    plain = {f'{path}.weight': module for path, module in model.named_modules()
             if isinstance(module, Linear) and not isinstance(module, PackedLinear)
             and path.startswith('model.layers.')}
    kept, unfit = set(), set()
    for name in weights:
        module = plain.get(name) or plain.get(name.replace('model.language_model.', 'model.', 1))
        if module is None:
            continue
        if not fits(name):
            unfit.add(name)
            continue
        module.to_fp8(block)
        kept.add(name)
    return frozenset(kept), frozenset(unfit)
