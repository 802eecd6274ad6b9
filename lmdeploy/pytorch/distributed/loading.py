"""Load one rank's shard of a model straight from safetensors.

Each tensor the layout splits is read with ``safe_open(...).get_slice(name)[a:b]`` (or
``[:, a:b]``), which reads only the requested rows/columns from the memory-mapped file: the
full tensor is never materialised on any rank. Replicated tensors are read whole.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

import torch
from safetensors import safe_open

from ..models import get_model_class
from ..models.config_audit import check_config
from ..models.loader import load_config, resolve_dtype, weight_files
from ..models.quantization import SCALE_SUFFIX, Fp8Weights, parse_quantization_config
from .sharding import TPLayout

__all__ = ['iter_shard_tensors', 'load_model_shard']

logger = logging.getLogger('lmdeploy')


def iter_shard_tensors(model_path: str, layout: TPLayout, prefix: str | None = None,
                       fp8: Fp8Weights | None = None, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, this rank's part)`` for every checkpoint tensor the rank reads
    (:meth:`TPLayout.reads`), or only for those whose name starts with ``prefix`` (the others
    are not read at all), or only for those ``keep(name)`` accepts. With ``fp8`` (an FP8
    checkpoint) a quantized weight is read whole, dequantized
    (:meth:`~lmdeploy.pytorch.models.quantization.Fp8Weights.convert`) and then sliced, and the
    scales are not yielded."""
    quantized = fp8.weight_names() if fp8 is not None else set()
    for path in weight_files(model_path):
        with safe_open(path, framework='pt') as f:
            for name in f.keys():
                if (prefix is not None and not name.startswith(prefix)) or (keep is not None and not keep(name)) \
                        or not layout.reads(name):
                    continue
                shard = layout.shard(name)
                if fp8 is not None and (name in quantized or name.endswith(SCALE_SUFFIX)):
                    tensor = fp8.convert(name, f.get_tensor(name))
                    if tensor is not None:
                        yield name, tensor if shard is None else _slice(tensor, shard)
                    continue
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                view = f.get_slice(name)
                pieces = [view[(slice(None),) * shard.dim + (slice(a, b),)] for a, b in shard.ranges]
                yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


def _slice(tensor: torch.Tensor, shard) -> torch.Tensor:
    pieces = [tensor.narrow(shard.dim, a, b - a) for a, b in shard.ranges]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)).contiguous()


def shard_fp8(model_path: str, config, torch_dtype: torch.dtype) -> Fp8Weights | None:
    """The FP8 weights of an FP8 checkpoint (dequantized on every rank), else None."""
    quant = parse_quantization_config(config)
    return None if quant is None else Fp8Weights.from_checkpoint(model_path, quant, torch_dtype)


def load_model_shard(model_path: str, dtype: str, device: torch.device, rank: int, size: int):
    """Build rank ``rank``'s shard of the model and load its weights.

    Returns:
        ``(model, full config, local config, torch dtype)``; the model is in eval mode on
        ``device``. Cache specs come from the local config (this rank's heads).

    Raises:
        ValueError: as :func:`lmdeploy.pytorch.models.loader.load_model`, or a head/channel
            count ``size`` does not divide (names the config field).
    """
    config = load_config(model_path)
    torch_dtype = resolve_dtype(dtype, config)
    cls = get_model_class(config.model_type)
    check_config(config)
    layout = TPLayout(config, rank, size)
    local = layout.local_config()
    with torch.device('meta'):
        model = layout.apply(cls(local))
    model = model.to_empty(device=device).to(torch_dtype)
    started = time.perf_counter()
    model.load_weights(iter_shard_tensors(model_path, layout, fp8=shard_fp8(model_path, config, torch_dtype)))
    logger.info('rank %d/%d: weight shard loaded in %.1f s', rank, size, time.perf_counter() - started)
    return model.eval(), config, local, torch_dtype
