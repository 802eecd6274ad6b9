"""The safetensors files of a local checkpoint directory and the tensors in them (one
``model.safetensors`` or the shards a ``model.safetensors.index.json`` names). The loader, the
FP8 scale reader and the tensor-parallel shard reader all read weights through here.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

__all__ = ['weight_files', 'iter_safetensors']


def weight_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint (from the shard index if there is one).

    Raises:
        ValueError: no safetensors weights in ``model_path``.
    """
    index = os.path.join(model_path, 'model.safetensors.index.json')
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)['weight_map'].values()))
        return [os.path.join(model_path, n) for n in names]
    single = os.path.join(model_path, 'model.safetensors')
    if os.path.isfile(single):
        return [single]
    raise ValueError(f'no safetensors weights in {model_path!r}')


def iter_safetensors(model_path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint."""
    files = weight_files(model_path)
    for path in tqdm(files, desc='Loading weights', unit='file', disable=not progress or len(files) < 2):
        with safe_open(path, framework='pt') as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
