"""Load a model from a local Hugging Face directory: config via ``transformers.AutoConfig``,
weights via ``safetensors`` (:mod:`.checkpoint_files`: one file or a sharded index, with a
progress bar). Nothing is downloaded: a path that is not a model directory is a ``ValueError``.

One :func:`load_model` serves every TP size. What a rank holds is its *layout*: the
:class:`WholeModel` layout (tp=1) reads every tensor whole and swaps nothing; a tensor-parallel
rank's :class:`~lmdeploy.pytorch.distributed.sharding.TPLayout` builds the model from its local
config, swaps in the parallel modules and says which slice of each tensor the rank reads. The
loader asks only these questions of a layout (so this module imports nothing from
``distributed``)::

    layout.config / rank / size       the full config, this rank, the TP size
    layout.local_config()             the config with this rank's head and channel counts
    layout.apply(model)               swap in the parallel modules (meta device)
    layout.apply_mtp(head)            the same for a multi-token-prediction head
    layout.reads(name)                whether the rank reads checkpoint tensor ``name`` at all
    layout.shard(name)                which part: None (whole) or ``.dim`` / ``.ranges``

The walk, the same on every rank::

    config, local config ─▶ model (meta) ─▶ layout.apply ─▶ FP8 projections kept ─▶ weights read
                                                             (aligned splits only)     (iter_weights)
                        └─▶ MTP head (meta) ─▶ layout.apply_mtp ────────────────────▶ head's weights read
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from ..host_memory import materialize, report_huge_pages
from . import get_model_class, mtp_head_class
from .checkpoint_files import iter_safetensors, open_safetensors, read_part, weight_files
from .config_audit import check_config
from .quantization import SCALE_SUFFIX, Fp8Weights, keep_fp8_linears, parse_quantization_config

# weight_files / iter_safetensors are re-exported: callers read checkpoints through the loader
__all__ = ['load_config', 'load_model', 'load_mtp_head', 'LoadedModel', 'WholeModel', 'iter_weights', 'iter_safetensors',
           'resolve_dtype', 'weight_files']

logger = logging.getLogger('lmdeploy')

_DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}


def load_config(model_path: str):
    """The model's ``transformers`` config.

    Raises:
        ValueError: ``model_path`` is not a directory holding ``config.json``, or its
            ``config.json`` is not a JSON object ``transformers`` can read (the message names the
            file and the reason).
    """
    path = os.path.join(model_path, 'config.json')
    if not os.path.isdir(model_path) or not os.path.isfile(path):
        raise ValueError(f'model_path {model_path!r} is not a local Hugging Face model directory '
                         '(no config.json); nothing is downloaded')
    # parsed here first: transformers answers a broken file with an OSError (a traceback at the
    # command line) that does not say where in the file it broke
    try:
        with open(path, 'rb') as f:
            parsed = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f'model_path {model_path!r}: config.json cannot be read as JSON: {err}') from None
    if not isinstance(parsed, dict):
        raise ValueError(f'model_path {model_path!r}: config.json must hold a JSON object, '
                         f'got {type(parsed).__name__}')
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(model_path, local_files_only=True)
    except ValueError:      # transformers' own words (e.g. an unknown model_type) already say it
        raise
    except Exception as err:    # noqa: BLE001 - an OSError, or huggingface_hub's config validation error (an Exception)
        reason = ' '.join(str(err).split())     # the validation error spans lines
        raise ValueError(f'model_path {model_path!r}: config.json cannot be loaded: {reason}') from None


def resolve_dtype(dtype: str, config) -> torch.dtype:
    """``'auto'`` → the checkpoint's dtype (float32 if unset), else the named dtype."""
    if dtype != 'auto':
        return _DTYPES[dtype]
    value = getattr(config, 'dtype', None) or getattr(config, 'torch_dtype', None)
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value).replace('torch.', ''), torch.float32)


class WholeModel:
    """The trivial layout (tp=1): one rank, every tensor read whole, no module swapped.

    Args:
        config: the model's ``transformers`` config.
    """
    rank, size = 0, 1

    def __init__(self, config):
        self.config = config

    def local_config(self):
        """The config itself (the only rank holds every head)."""
        return self.config

    def apply(self, model: nn.Module) -> nn.Module:
        """Nothing to swap; returns ``model``."""
        return model

    def apply_mtp(self, head: nn.Module) -> nn.Module:
        """Nothing to swap; returns ``head``."""
        return head

    def reads(self, name: str) -> bool:
        """Every tensor."""
        return True

    def shard(self, name: str) -> None:
        """None: every tensor whole."""
        return None


@dataclass
class LoadedModel:
    """What :func:`load_model` built for one rank.

    Attributes:
        model: the (rank's shard of the) model, eval mode.
        config: the full ``transformers`` config.
        local_config: the rank's config (``config`` at tp=1); cache specs come from it.
        dtype: the compute dtype.
        layout: the layout it was loaded under.
        mtp: the rank's part of the model's MTP head (eval mode), or None when not asked for.
        fp8_kept: checkpoint names of the weights kept FP8 (empty: none, or not an FP8 checkpoint).
    """
    model: nn.Module
    config: object
    local_config: object
    dtype: torch.dtype
    layout: object
    mtp: nn.Module | None = None
    fp8_kept: frozenset[str] = frozenset()

    def cache_specs(self, full: bool = False) -> list:
        """The layer cache specs: this rank's heads, or with ``full`` every head (the
        single-process layout, the Store's); the MTP layer's last when the head is loaded."""
        config = self.config if full else self.local_config
        specs = list(type(self.model).cache_specs(config, self.dtype))
        if self.mtp is not None:
            specs.append(type(self.mtp).cache_spec(config, self.dtype))
        return specs


def iter_weights(model_path: str, layout, fp8: Fp8Weights | None = None,
                 select: Callable[[str], bool] | None = None, progress: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, the rank's part)`` for every checkpoint tensor ``layout`` reads (and
    ``select`` accepts, when given). A split tensor is read as its slices (``get_slice``), never
    whole; an FP8 checkpoint's quantized weights go through :meth:`Fp8Weights.read` (kept FP8
    with their scale rows, or dequantized), and its scales are not yielded on their own.

    Raises:
        ValueError: see :meth:`Fp8Weights.read`.
    """
    quantized = fp8.weight_names() if fp8 is not None else set()
    files = weight_files(model_path)
    for path in tqdm(files, desc='Loading weights', unit='file', disable=not progress or len(files) < 2):
        with open_safetensors(path) as f:
            for name in f.keys():
                if (fp8 is not None and name.endswith(SCALE_SUFFIX)) or (select is not None and not select(name)) \
                        or not layout.reads(name):
                    continue
                if name in quantized:
                    yield from fp8.read(f, name, layout.shard(name))
                    continue
                tensor = read_part(f, name, layout.shard(name))
                # an FP8 checkpoint's other tensors: as stored, an FP8 one without a scale refused
                yield name, tensor if fp8 is None else fp8.convert(name, tensor)


def load_mtp_head(model_path: str, layout=None, *, dtype: str = 'auto', device: str | torch.device = 'cpu'
                  ) -> nn.Module:
    """The model's MTP head alone (what :func:`load_model` with ``mtp=True`` builds beside the
    model), reading only the head's tensors.

    Args:
        model_path, layout, dtype, device: as :func:`load_model`.

    Raises:
        ValueError: as :func:`load_model` with ``mtp``.
    """
    layout = layout if layout is not None else WholeModel(load_config(model_path))
    config = layout.config
    torch_dtype = resolve_dtype(dtype, config)
    quant = parse_quantization_config(config)
    fp8 = None if quant is None else Fp8Weights.from_checkpoint(model_path, quant, torch_dtype)
    return _load_head(model_path, layout, _mtp_head(config, layout), fp8, torch_dtype, device)


def _mtp_head(config, layout):
    head_cls = mtp_head_class(config)
    if layout.size > 1 and not head_cls.supports_tp:
        raise ValueError(f'speculative_config.method=mtp: the {config.model_type} MTP head '
                         f'({head_cls.__name__}) is not split for tensor parallelism; use tp=1')
    return head_cls


def _load_head(model_path: str, layout, head_cls, fp8: Fp8Weights | None, dtype: torch.dtype, device) -> nn.Module:
    """Build the rank's part of the MTP head (local config, ``layout.apply_mtp``) and read its
    tensors; FP8 weights are dequantized (the head's projections never run the FP8 GEMM)."""
    config = layout.config
    with torch.device('meta'):
        head = layout.apply_mtp(head_cls(layout.local_config()))
    head, arena = materialize(head, device, dtype)
    if fp8 is not None:
        fp8 = Fp8Weights(fp8.quant, fp8.scales, dtype, shapes=fp8.shapes)
    head.load_weights(iter_weights(model_path, layout, fp8, select=lambda name: head_cls.wants(name, config)))
    report_huge_pages(arena, 'MTP head weights')
    return head.eval()


def load_model(model_path: str, layout=None, *, dtype: str = 'auto', device: str | torch.device = 'cpu',
               progress: bool = True, keep_fp8: bool | None = None, mtp: bool = False) -> LoadedModel:
    """Build the engine model for ``model_path`` under ``layout`` and load its weights.

    Args:
        model_path: the model directory.
        layout: what this rank holds: None or :class:`WholeModel` (tp=1), else a tensor-parallel
            rank's :class:`~lmdeploy.pytorch.distributed.sharding.TPLayout` (see the module
            docstring); its config is used as is.
        dtype: ``'auto'`` (the checkpoint's), ``'float32'``, ``'float16'`` or ``'bfloat16'``.
        device: where the parameters live. On the CPU they are placed in one 2 MiB-aligned
            arena advised for transparent huge pages before the weights are written
            (:func:`~lmdeploy.pytorch.host_memory.materialize`; ``LMDEPLOY_HUGE_PAGES=0`` turns
            it off), bit for bit the same values either way.
        progress: a progress bar over a sharded checkpoint's files.
        keep_fp8: FP8 checkpoint: keep plain and row-parallel projections FP8 (default: on
            CUDA); under TP only those whose split falls on scale-block boundaries
            (:func:`~.quantization.block_ranges`), the others are dequantized with one log line.
        mtp: also build and load the rank's part of the model's MTP head (its class's
            ``mtp_head``), through the same reader; the head is dequantized in an FP8 checkpoint.

    Returns:
        A :class:`LoadedModel`; the model (and head) are in eval mode on ``device``.

    Raises:
        ValueError: not a model directory, unsupported model type (lists supported ones), a
            config field the engine cannot reproduce exactly (names the field, see
            :mod:`.config_audit`), weights that do not fit the model; with ``mtp``, a model
            without an MTP head, one the layout's TP size cannot split (names
            ``speculative_config.method``) or a checkpoint without (all) its head tensors.
        TypeError: ``layout`` is a string (the dtype is keyword-only).
    """
    if isinstance(layout, str):
        raise TypeError(f'load_model: layout must be a layout object or None, got {layout!r} (pass dtype=...)')
    layout = layout if layout is not None else WholeModel(load_config(model_path))
    config = layout.config
    torch_dtype = resolve_dtype(dtype, config)
    cls = get_model_class(config.model_type)
    check_config(config)
    head_cls = _mtp_head(config, layout) if mtp else None     # refused before any weight is read
    local = layout.local_config()
    with torch.device('meta'):
        model = layout.apply(cls(local))
    # on the CPU the parameters are carved from one huge-page arena before anything is written
    model, arena = materialize(model, device, torch_dtype)
    files = weight_files(model_path)
    started = time.perf_counter()
    logger.info('loading weights: %s %s, %d file(s), %.1f MiB, to %s (rank %d/%d)', config.model_type, torch_dtype,
                len(files), sum(os.path.getsize(f) for f in files) / (1 << 20), device, layout.rank, layout.size)
    quant = parse_quantization_config(config)
    fp8 = None
    if quant is not None:
        fp8 = Fp8Weights.from_checkpoint(model_path, quant, torch_dtype)
        if keep_fp8 if keep_fp8 is not None else torch.device(device).type == 'cuda':
            names = {n for n in fp8.weight_names() if layout.reads(n)}
            fp8.keep, unfit = keep_fp8_linears(model, names, quant.block,
                                               fits=lambda n: fp8.splits_on_blocks(n, layout.shard(n)))
            if unfit:
                logger.info('FP8 under tp=%d: %d weight(s) dequantized, their split is not on %s blocks (e.g. %s)',
                            layout.size, len(unfit), list(quant.block), min(unfit))
        logger.info('FP8 checkpoint (block %s): %d quantized weights, %d kept FP8', list(quant.block),
                    len(fp8.scales), len(fp8.keep))
    model.load_weights(iter_weights(model_path, layout, fp8, progress=progress))
    report_huge_pages(arena, 'weights')
    head = None if head_cls is None else _load_head(model_path, layout, head_cls, fp8, torch_dtype, device)
    logger.info('weights loaded in %.1f s', time.perf_counter() - started)
    return LoadedModel(model.eval(), config, local, torch_dtype, layout, head,
                       fp8.keep if fp8 is not None else frozenset())
