"""ParallelPlan: how a model's parameters split under tensor parallelism, declared as data.

Megatron-LM's column / row / vocabulary splits (Shoeybi et al., 2019). Each block kind in
``models/blocks/`` (and the few layers one family owns) declares its own split as a
:class:`BlockSplit`: the counts it splits (:class:`Axis`: query heads, KV heads, Mamba groups,
MLP rows ...), which of its checkpoint tensors take which rows or columns of those counts
(:class:`TensorSplit`, :class:`Piece`: fused projections are several pieces), which of its
output projections are row-parallel, which ranges its cached tensors hold and which config
fields its local (per-rank) config changes. A family's :class:`ParallelPlan` only *composes*
those: per layer, its kinds; per kind, which blocks sit under which name::

    ParallelPlan(
        layers=lambda config: [(kind, 'dense') for kind in config.layer_types],
        blocks={'full_attention': (Block(gqa_split(), 'self_attn'),),
                'linear_attention': (Block(mamba2_split(my_dims), 'mixer'),),
                'dense': (Block(mlp_split(), 'mlp'),),
                'moe': ()})                           # replicated: nothing splits

The generic layout (:class:`~lmdeploy.pytorch.distributed.sharding.TPLayout`) applies any
plan (checks the counts, computes the rank's ranges, slices tensors, swaps row-parallel
modules) and never asks for the model type. A family built from existing blocks therefore
writes no split code, only its composition. The vocabulary split of ``embed_tokens`` and
``lm_head`` is the layout's own (every plan has it).

A split factory is ``(text config, tp size) -> BlockSplit``; the ``*_split(...)`` functions of
the block modules return one, taking the config field names of the family (e.g. Nemotron-H's
``mamba_num_heads`` where Bamba says ``mamba_n_heads``)::

    rank r of N holds, of an Axis of n units:   [r*n/N, (r+1)*n/N)      when N divides n
                                                [r*n//N, r*n//N + 1)    when ``shared`` and n divides N
    a Piece(axis, unit, offset) of a tensor:    [offset + a0*unit, offset + a1*unit)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ['Axis', 'Piece', 'TensorSplit', 'BlockSplit', 'Block', 'ParallelPlan', 'rows', 'cols']


@dataclass(frozen=True)
class Axis:
    """A count split evenly over the ranks.

    Attributes:
        name: the key pieces and cache splits use (one meaning per plan: two blocks that
            declare the same name must declare the same axis).
        total: the full model's count (units: heads, groups, channels, rows).
        field: the config field (or expression) an error names.
        local_field: the config field set to the rank's count in the local config; None: the
            block reads the whole count and divides it itself (e.g. ``mamba_tp_size``).
        shared: fewer units than ranks are allowed when ``total`` divides the TP size: then
            ``size / total`` ranks share (each read) one unit, e.g. KV heads, Mamba-2 groups.
        refuse_shared: when not empty, sharing is refused with this message instead (a layer
            that cannot run a unit split over ranks; it names the config field).
        why: appended to the divisibility error (why a rank needs whole units).
    """
    name: str
    total: int
    field: str
    local_field: str | None = None
    shared: bool = False
    refuse_shared: str = ''
    why: str = ''

    def part(self, rank: int, size: int) -> tuple[int, int]:
        """Rank ``rank``'s units ``(first, stop)`` at TP ``size``.

        Raises:
            ValueError: ``size`` does not divide ``total`` (and ``total`` does not divide
                ``size`` for a shared axis, or sharing is refused); names :attr:`field`.
        """
        n = self.total
        if n % size == 0:
            per = n // size
            return rank * per, (rank + 1) * per
        if not self.shared or n <= 0 or n > size or size % n:
            extra = ' or divide it' if self.shared else ''
            why = f': {self.why}' if self.why else ''
            raise ValueError(f'{self.field} ({n}) must be divisible by tp ({size}){extra}{why}')
        if self.refuse_shared:
            raise ValueError(self.refuse_shared)
        first = rank * n // size
        return first, first + 1


@dataclass(frozen=True)
class Piece:
    """Rows (or columns) ``[offset + a0 * unit, offset + a1 * unit)`` of a tensor, where
    ``(a0, a1)`` is the rank's part of axis ``axis``: one contiguous block of a fused tensor."""
    axis: str
    unit: int = 1
    offset: int = 0


@dataclass(frozen=True)
class TensorSplit:
    """Which part of a block's checkpoint tensors a rank reads.

    Attributes:
        names: tensor names relative to the block (``'q_proj'`` matches ``q_proj.weight`` and
            ``q_proj.bias``; ``'o_proj.weight'`` only the weight).
        dim: the split dimension (0: output rows, column-parallel; 1: input columns, row-parallel).
        pieces: the rank's ranges, concatenated in this order.
    """
    names: tuple[str, ...]
    dim: int
    pieces: tuple[Piece, ...]

    def matches(self, relative: str) -> bool:
        """Whether block-relative tensor name ``relative`` is one of :attr:`names`."""
        return any(relative == n or relative.startswith(n + '.') for n in self.names)


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def rows(names: str | Sequence[str], *pieces: Piece) -> TensorSplit:
    """A column-parallel split: rows (dim 0) of ``names`` by ``pieces``."""
    return TensorSplit(_names(names), 0, pieces)


def cols(names: str | Sequence[str], *pieces: Piece) -> TensorSplit:
    """A row-parallel split: input columns (dim 1) of ``names`` by ``pieces``."""
    return TensorSplit(_names(names), 1, pieces)


@dataclass(frozen=True)
class BlockSplit:
    """One block's split, as data (see the module docstring).

    Attributes:
        axes: the counts it splits, checked in this order.
        tensors: its split tensors; a tensor no entry names is read whole by every rank.
        row_parallel: module paths (relative to the block's module) whose outputs are summed
            over the ranks (their inputs are split).
        caches: ``(CacheTensor.tp_split name, pieces)``: the ranges a cached tensor of that split
            holds on the rank, in its order.
        config: ``(field, value)`` set in the local config as is (e.g. ``head_dim``, a
            ``*_tp_size`` the block's dims divide by).
        collective: None, or ``(module, part, all_reduce) -> None``: hands the block's module
            (``part(axis) -> (first, stop)`` of the rank) a cross-rank operation besides the
            row-parallel sum, e.g. a Mamba-2 group norm whose group spans ranks.
    """
    axes: tuple[Axis, ...]
    tensors: tuple[TensorSplit, ...] = ()
    row_parallel: tuple[str, ...] = ()
    caches: tuple[tuple[str, tuple[Piece, ...]], ...] = ()
    config: tuple[tuple[str, Any], ...] = ()
    collective: Callable | None = None


@dataclass(frozen=True)
class Block:
    """Where a block sits in a layer.

    Attributes:
        split: ``(text config, tp size) -> BlockSplit`` (a block module's ``*_split(...)``).
        at: the checkpoint name prefix inside the layer (``'self_attn'``), or several spellings
            of it.
        module: the module path inside the layer when it differs from ``at`` (a checkpoint
            ``feed_forward`` the model builds as ``mlp``).
    """
    split: Callable[[Any, int], BlockSplit]
    at: str | tuple[str, ...]
    module: str | None = None

    @property
    def prefixes(self) -> tuple[str, ...]:
        """The checkpoint prefixes, each ending in ``'.'``."""
        return tuple(p + '.' for p in _names(self.at))

    @property
    def module_path(self) -> str:
        """The module path inside the layer."""
        return self.module or _names(self.at)[0]


def _no_layers(config) -> list:
    return []


@dataclass(frozen=True)
class ParallelPlan:
    """A model's tensor-parallel split: a composition of block splits (see the module docstring).

    Attributes:
        layers: ``text config -> [kinds of layer i]`` for the checkpoint's ``model.layers.{i}.*``
            (the model's ``model.layers[i]``); a layer's kinds are a string or a sequence of them.
        blocks: kind -> the blocks a layer of that kind holds (``()``: nothing splits, e.g. MoE
            experts and routers, replicated on every rank). Every kind ``layers`` names needs
            an entry.
        extra_layers: ``text config -> [(checkpoint prefix, kinds)]``: layers outside
            ``model.layers`` (an MTP head's; the j-th is the head's ``layers[j]``).
        renames: ``(prefix, replacement)`` pairs applied to checkpoint names before matching.
        rank0_only: name prefixes read by rank 0 only (its module is dropped on other ranks).
        skipped: name prefixes no rank reads.
        rank0_modules: attribute names of the model set to None on ranks other than 0.
    """
    layers: Callable[[Any], Sequence[str | Sequence[str]]] = _no_layers
    blocks: Mapping[str, tuple[Block, ...]] = field(default_factory=dict)
    extra_layers: Callable[[Any], Sequence[tuple[str, str | Sequence[str]]]] = _no_layers
    renames: tuple[tuple[str, str], ...] = ()
    rank0_only: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    rank0_modules: tuple[str, ...] = ()
