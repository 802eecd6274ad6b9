"""The safetensors files of a local checkpoint directory and the tensors in them (one
``model.safetensors`` or the shards a ``model.safetensors.index.json`` names). The loader, the
FP8 scale reader and the tensor-parallel shard reader all read weights through here.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

__all__ = ['weight_files', 'open_safetensors', 'iter_safetensors', 'read_part', 'slice_part']


def weight_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint (from the shard index if there is one).

    Raises:
        ValueError: no safetensors weights in ``model_path``, or a shard index that cannot be read.
    """
    index = os.path.join(model_path, 'model.safetensors.index.json')
    if os.path.isfile(index):
        try:
            with open(index, 'rb') as f:
                weight_map = json.loads(f.read())['weight_map']
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f'model_path {model_path!r}: model.safetensors.index.json has no readable '
                             f'"weight_map" object of file names: {type(err).__name__}: {err}') from None
        return [os.path.join(model_path, n) for n in names]
    single = os.path.join(model_path, 'model.safetensors')
    if os.path.isfile(single):
        return [single]
    raise ValueError(f'no safetensors weights in {model_path!r}')


@contextlib.contextmanager
def open_safetensors(path: str):
    """``safe_open(path, framework='pt')`` as a context manager.

    Raises:
        ValueError: the file cannot be opened or its header is not a safetensors header (a
            truncated or interrupted copy: safetensors checks the header and that the file holds
            every byte it lists); the message names the file and the library's reason.
    """
    try:
        handle = safe_open(path, framework='pt')
    except Exception as err:    # noqa: BLE001 - SafetensorError derives from Exception only
        raise ValueError(f'weight file {path!r} cannot be read as safetensors: {type(err).__name__}: {err}') from None
    with handle as f:
        yield f


def iter_safetensors(model_path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint.

    Raises:
        ValueError: see :func:`weight_files` and :func:`open_safetensors`.
    """
    files = weight_files(model_path)
    for path in tqdm(files, desc='Loading weights', unit='file', disable=not progress or len(files) < 2):
        with open_safetensors(path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_part(f, name: str, shard) -> torch.Tensor:
    """Read tensor ``name`` of the open safetensors file ``f``: whole when ``shard`` is None,
    else only its ``shard.ranges`` along ``shard.dim`` (``get_slice``: the rest of the tensor is
    never read), concatenated."""
    if shard is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    pieces = [view[(slice(None),) * shard.dim + (slice(a, b),)] for a, b in shard.ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


def slice_part(tensor: torch.Tensor, shard) -> torch.Tensor:
    """The ``shard.ranges`` along ``shard.dim`` of an in-memory ``tensor``, concatenated (contiguous)."""
    pieces = [tensor.narrow(shard.dim, a, b - a) for a, b in shard.ranges]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)).contiguous()
