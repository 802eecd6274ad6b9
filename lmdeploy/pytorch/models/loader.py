"""Load a model from a local Hugging Face directory: config via ``transformers.AutoConfig``,
weights via ``safetensors`` (:mod:`.checkpoint_files`: one file or a sharded index, with a
progress bar). Nothing is downloaded: a path that is not a model directory is a ``ValueError``.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from . import get_model_class
from .checkpoint_files import iter_safetensors, weight_files
from .config_audit import check_config
from .quantization import Fp8Weights, keep_fp8_linears, parse_quantization_config

# weight_files / iter_safetensors are re-exported: callers read checkpoints through the loader
__all__ = ['load_config', 'load_model', 'iter_safetensors', 'resolve_dtype', 'weight_files']

logger = logging.getLogger('lmdeploy')

_DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}


def load_config(model_path: str):
    """The model's ``transformers`` config.

    Raises:
        ValueError: ``model_path`` is not a directory holding ``config.json``.
    """
    if not os.path.isdir(model_path) or not os.path.isfile(os.path.join(model_path, 'config.json')):
        raise ValueError(f'model_path {model_path!r} is not a local Hugging Face model directory '
                         '(no config.json); nothing is downloaded')
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def resolve_dtype(dtype: str, config) -> torch.dtype:
    """``'auto'`` → the checkpoint's dtype (float32 if unset), else the named dtype."""
    if dtype != 'auto':
        return _DTYPES[dtype]
    value = getattr(config, 'dtype', None) or getattr(config, 'torch_dtype', None)
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value).replace('torch.', ''), torch.float32)


def load_model(model_path: str, dtype: str = 'auto', device: str | torch.device = 'cpu', progress: bool = True,
               keep_fp8: bool | None = None):
    """Build the engine model for ``model_path`` and load its weights.

    An FP8 checkpoint (:mod:`.quantization`) is dequantized into ``dtype`` at load, except the
    plain projections when ``keep_fp8`` (default: on CUDA), which keep FP8 weights and run the
    block-scaled FP8 GEMM.

    Returns:
        ``(model, config, torch_dtype)``; the model is in eval mode on ``device``.

    Raises:
        ValueError: not a model directory, unsupported model type (lists supported ones), a
            config field the engine cannot reproduce exactly (names the field, see
            :mod:`.config_audit`), or weights that do not fit the model.
    """
    config = load_config(model_path)
    torch_dtype = resolve_dtype(dtype, config)
    cls = get_model_class(config.model_type)
    check_config(config)
    with torch.device('meta'):
        model = cls(config)
    model = model.to_empty(device=device).to(torch_dtype)
    files = weight_files(model_path)
    started = time.perf_counter()
    logger.info('loading weights: %s %s, %d file(s), %.1f MiB, to %s', config.model_type, torch_dtype, len(files),
                sum(os.path.getsize(f) for f in files) / (1 << 20), device)
    weights = iter_safetensors(model_path, progress)
    quant = parse_quantization_config(config)
    if quant is not None:
        fp8 = Fp8Weights.from_checkpoint(model_path, quant, torch_dtype)
        if keep_fp8 if keep_fp8 is not None else torch.device(device).type == 'cuda':
            fp8.keep = keep_fp8_linears(model, fp8.weight_names(), quant.block)
        logger.info('FP8 checkpoint (block %s): %d quantized weights, %d kept FP8', list(quant.block),
                    len(fp8.scales), len(fp8.keep))
        weights = fp8.stream(weights)
    model.load_weights(weights)
    logger.info('weights loaded in %.1f s', time.perf_counter() - started)
    return model.eval(), config, torch_dtype

