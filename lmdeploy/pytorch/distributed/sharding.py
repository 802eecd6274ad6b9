"""How a model is split over the tensor-parallel ranks (Megatron-LM's scheme: Shoeybi et al.,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019).

What splits how is the model's own declaration: its class's ``parallel_plan``
(:class:`~lmdeploy.pytorch.models.parallel_plan.ParallelPlan`), a composition of the block
splits its layers hold. This module only applies a plan, for any model, and never branches on
the model type:

- it checks every count the plan's blocks split (a TP size a count does not allow is a
  ``ValueError`` naming the config field) and computes this rank's part of each;
- :meth:`TPLayout.local_config`: a copy of the config with this rank's counts, so every layer,
  packed projection and cache spec comes out with this rank's sizes without the models knowing
  about parallelism;
- :meth:`TPLayout.shard`: which rows or columns of each checkpoint tensor the rank reads::

      checkpoint name            model.layers.{i}.{block prefix}.{tensor}
      plan                       layer i's kinds -> blocks -> the block's TensorSplit of {tensor}
      rank r reads               the TensorSplit's pieces of r's axis parts (none: the whole tensor)

- :meth:`TPLayout.apply`: the vocabulary-parallel embedding and ``lm_head`` (rows
  ``[r*V/N, (r+1)*V/N)``, ``V`` padded up), :class:`RowParallelLinear` for the blocks'
  row-parallel projections, the blocks' collectives, rank-0-only modules dropped elsewhere;
- :meth:`TPLayout.cache_ranges`: the ranges a cached tensor of a ``tp_split`` holds.

A tensor no block names (norms, MoE experts and routers, a replicated latent) is read whole by
every rank. MoE layers are **replicated**: every rank runs the whole block on the full hidden
state, so no expert routing crosses ranks; this costs expert memory on every rank.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.linear import linear
from ..models import MODEL_REGISTRY, get_model_class
from ..models.layers import Linear
from .comm import all_gather_last, all_reduce

__all__ = ['TPLayout', 'Shard', 'RowParallelLinear', 'VocabParallelEmbedding', 'VocabParallelHead']


@dataclass(frozen=True)
class Shard:
    """The part of one checkpoint tensor a rank reads: ``ranges`` along ``dim``, concatenated."""
    dim: int
    ranges: tuple[tuple[int, int], ...]


class RowParallelLinear(Linear):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input channels are split over ranks, each
    rank holds ``W[:, its columns]`` (FP8 with its scale columns when the loader keeps it FP8)
    and the full bias (added once, after the sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in / N]`` → ``[T, out]`` (identical on every rank)."""
        y = all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, stop)`` of the vocabulary; ids outside give zeros, the sum over
    ranks is the full lookup.

    Args:
        start, stop: this rank's vocabulary rows.
        dim: embedding width.
    """

    def __init__(self, start: int, stop: int, dim: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.weight = nn.Parameter(torch.empty(stop - start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` → ``[T, dim]``."""
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(out)


class VocabParallelHead(nn.Module):
    """``lm_head`` over vocabulary rows ``[start, stop)``; the ranks' logits are gathered into
    the full ``[N, vocab]`` on every rank (each rank pads its part to ``width`` columns).

    Args:
        start, stop: this rank's vocabulary rows.
        width: padded columns per rank (``ceil(vocab / N)``).
        dim: hidden width.
        vocab: the full vocabulary size.
    """

    def __init__(self, start: int, stop: int, width: int, dim: int, vocab: int):
        super().__init__()
        self.start, self.stop, self.width, self.vocab = start, stop, width, vocab
        self.weight = nn.Parameter(torch.empty(stop - start, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, dim]`` → ``[N, vocab]`` in the weight dtype."""
        local = linear(hidden, self.weight)
        if local.shape[-1] < self.width:
            local = F.pad(local, (0, self.width - local.shape[-1]))
        return all_gather_last(local)[..., :self.vocab]


def _text_config(config):
    """The config of the text stack: ``text_config`` of a vision-language config, else ``config``."""
    return getattr(config, 'text_config', None) or config


def _kinds(kinds) -> tuple[str, ...]:
    return (kinds,) if isinstance(kinds, str) else tuple(kinds)


_LAYER = re.compile(r'^(.*?\.)?layers\.(\d+)\.')


class TPLayout:
    """Rank ``rank``'s share of a model with config ``config`` under TP ``size``: the model
    class's ``parallel_plan`` (found through the model registry) applied.

    Args:
        config: the full model's ``transformers`` config (a vision-language config's counts
            are read from, and changed in, its ``text_config``).
        rank: this rank.
        size: the TP size.

    Attributes:
        vocab: this rank's vocabulary rows ``(first, stop)``; ``vocab_width`` the padded rows per rank.
        axes: every count the plan's blocks split, by name (:class:`~..models.parallel_plan.Axis`).

    Raises:
        ValueError: a count the TP size does not allow (names the field); a model whose class
            declares no parallel plan (names ``tp``, the model type and the model types that split).
    """

    def __init__(self, config, rank: int, size: int):
        self.config, self.rank, self.size = config, rank, size
        self.model_type = config.model_type
        try:
            cls = get_model_class(self.model_type)
        except ValueError:      # not a registered model type
            cls = None
        self.plan = None if cls is None else cls.parallel_plan
        if self.plan is None:
            split = [t for t in MODEL_REGISTRY if get_model_class(t).parallel_plan is not None]
            raise ValueError(f'tp ({size}): tensor parallelism supports model_type '
                             f'{", ".join(split)}, not {self.model_type!r}; use tp=1')
        cls.check_config(config)             # a plan reads only fields the model's checks accept
        text = self.text = _text_config(config)
        vocab = text.vocab_size
        self.vocab_width = -(-vocab // size)
        self.vocab = (min(vocab, rank * self.vocab_width), min(vocab, (rank + 1) * self.vocab_width))
        # checkpoint layer prefix -> (module holder, index, its blocks with their splits)
        self._layers: dict[str, tuple[str, int, tuple]] = {}
        self._splits = {}         # one BlockSplit per Block (every layer of a kind shares it)
        for i, kinds in enumerate(self.plan.layers(text)):
            self._layers[f'model.layers.{i}.'] = ('model', i, self._blocks(kinds))
        for j, (prefix, kinds) in enumerate(self.plan.extra_layers(text)):
            self._layers[prefix] = ('mtp', j, self._blocks(kinds))
        self.axes, self._parts, caches = {}, {}, {}
        for split in self._splits.values():
            for axis in split.axes:
                if self.axes.setdefault(axis.name, axis) != axis:
                    raise ValueError(f'parallel plan of {self.model_type!r}: two blocks declare axis '
                                     f'{axis.name!r} differently')
                if axis.name not in self._parts:
                    self._parts[axis.name] = axis.part(rank, size)
            for name, pieces in split.caches:
                if caches.setdefault(name, pieces) != pieces:
                    raise ValueError(f'parallel plan of {self.model_type!r}: two blocks declare cache split '
                                     f'{name!r} differently')
        self._caches = caches

    def _blocks(self, kinds) -> tuple:
        """``(block, its split)`` of every block a layer of ``kinds`` holds."""
        out = []
        for kind in _kinds(kinds):
            if kind not in self.plan.blocks:
                raise ValueError(f'parallel plan of {self.model_type!r}: no blocks for layer kind {kind!r}')
            for block in self.plan.blocks[kind]:
                if block not in self._splits:
                    self._splits[block] = block.split(self.text, self.size)
                out.append((block, self._splits[block]))
        return tuple(out)

    def part(self, axis: str) -> tuple[int, int]:
        """This rank's units ``(first, stop)`` of the plan's axis ``axis`` (e.g. ``'kv_heads'``).

        Raises:
            KeyError: the plan splits no such axis.
        """
        return self._parts[axis]

    def _ranges(self, pieces) -> tuple[tuple[int, int], ...]:
        out = []
        for p in pieces:
            a0, a1 = self._parts[p.axis]
            out.append((p.offset + a0 * p.unit, p.offset + a1 * p.unit))
        return tuple(out)

    def local_config(self):
        """A copy of the config with this rank's counts (the text config's, for a
        vision-language config): each axis's ``local_field`` and each block's ``config`` fields."""
        c = copy.deepcopy(self.config)
        t = _text_config(c)
        for split in self._splits.values():
            for name, value in split.config:
                setattr(t, name, value)
        for name, axis in self.axes.items():
            if axis.local_field is not None:
                a0, a1 = self._parts[name]
                setattr(t, axis.local_field, a1 - a0)
        return c

    def reads(self, name: str) -> bool:
        """Whether this rank reads checkpoint tensor ``name`` at all (the plan's ``skipped``
        prefixes: never; its ``rank0_only`` ones, e.g. a vision tower: rank 0 only)."""
        if name.startswith(self.plan.skipped):
            return False
        if name.startswith(self.plan.rank0_only):
            return self.rank == 0
        return True

    def cache_ranges(self, split: str) -> tuple[tuple[int, int], ...]:
        """This rank's ranges of a cached tensor's split axis (``CacheTensor.tp_split``), in the
        order the rank's tensor holds them (e.g. ``'kv_heads'``: one range of KV heads; Gated
        DeltaNet's ``'conv_channels'``: its q | k | v pieces).

        Raises:
            ValueError: a split name no block of the plan declares.
        """
        if split not in self._caches:
            raise ValueError(f'CacheTensor.tp_split: {self.model_type} splits '
                             f'{", ".join(map(repr, self._caches)) or "no cached tensor"}, not {split!r}')
        return self._ranges(self._caches[split])

    def apply(self, model: nn.Module) -> nn.Module:
        """Swap in the parallel modules (on the model's current device, e.g. meta); returns ``model``."""
        c = self.text
        model.model.embed_tokens = VocabParallelEmbedding(*self.vocab, c.hidden_size)
        model.lm_head = VocabParallelHead(*self.vocab, self.vocab_width, c.hidden_size, c.vocab_size)
        self._apply_layers(model.model.layers, 'model')
        if self.rank != 0:
            for name in self.plan.rank0_modules:     # e.g. a vision tower: its output is broadcast
                setattr(model, name, None)
        return model

    def apply_mtp(self, mtp: nn.Module) -> nn.Module:
        """Swap the row-parallel modules of an MTP head built from :meth:`local_config` (the
        blocks of the plan's ``extra_layers``, its ``layers[j]``). Returns ``mtp``."""
        self._apply_layers(mtp.layers, 'mtp')
        return mtp

    def _apply_layers(self, layers, holder: str) -> None:
        """Replace each block's row-parallel projections with :class:`RowParallelLinear` of the
        same shape and hand the blocks their collectives."""
        for owner, index, blocks in self._layers.values():
            if owner != holder or index >= len(layers):
                continue
            swapped = set()
            for block, split in blocks:
                parent = _module(layers[index], block.module_path)
                if parent is None:
                    continue
                for path in split.row_parallel:
                    if (block.module_path, path) in swapped:
                        continue
                    swapped.add((block.module_path, path))
                    *up, name = path.split('.')
                    holder_module = _module(parent, '.'.join(up)) if up else parent
                    old = getattr(holder_module, name, None) if holder_module is not None else None
                    if isinstance(old, nn.Linear):
                        setattr(holder_module, name, RowParallelLinear(old.in_features, old.out_features,
                                                                       bias=old.bias is not None))
                if split.collective is not None:
                    split.collective(parent, self.part, all_reduce)

    def shard(self, name: str) -> Shard | None:
        """Which part of checkpoint tensor ``name`` this rank reads; None = the whole tensor."""
        for prefix, replacement in self.plan.renames:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
        if name in ('model.embed_tokens.weight', 'lm_head.weight'):
            return Shard(0, (self.vocab,))
        m = _LAYER.match(name)
        layer = self._layers.get(m.group(0)) if m else None
        if layer is None:
            return None
        rest = name[m.end():]
        for block, split in layer[2]:
            for prefix in block.prefixes:
                if rest.startswith(prefix):
                    relative = rest[len(prefix):]
                    for tensor in split.tensors:
                        if tensor.matches(relative):
                            return Shard(tensor.dim, self._ranges(tensor.pieces))
        return None


def _module(root: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` of ``root`` (``''``: root), or None when absent."""
    for part in path.split('.') if path else ():
        root = getattr(root, part, None)
        if root is None:
            return None
    return root
