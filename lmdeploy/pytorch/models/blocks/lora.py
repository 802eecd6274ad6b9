"""LoRA-style adapters added to a block's column-parallel projections (Hu et al., "LoRA",
2021; Zamba2's per-use adapters on its shared attention and MLP), and how they split under
tensor parallelism.

An adapter adds ``B (A x)`` to a projection ``W x``: ``A`` ``[rank, d_in]`` (down), ``B``
``[d_out, rank]`` (up), ``rank`` small. When ``W``'s output rows are split over the ranks
(column-parallel: query heads, MLP rows), a rank needs the same rows of ``B A x``::

    rank r:  y_r = W[rows_r] x + B[rows_r] (A x)

``A x`` is the whole ``rank``-vector every one of those rows reads, so ``A`` is **replicated**
(each rank computes ``A x`` itself: ``rank · d_in`` weights, no communication), and ``B`` is
split by **exactly the rows of the projection it adds to** (:func:`lora_split` copies that
projection's pieces, fused halves included). Splitting ``A`` by its ``rank`` dimension instead
would leave every rank a partial sum of ``B A x`` and cost one more all-reduce per adapter.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from ..parallel_plan import BlockSplit, rows

__all__ = ['lora_split']


def lora_split(split, adapters: Callable[[object], Mapping[str, Sequence[str]]]):
    """Extend split factory ``split`` with the up (``B``) matrices of adapters on its
    column-parallel projections, as a split factory.

    Args:
        split: ``(config, size) -> BlockSplit`` of the adapted block.
        adapters: ``config -> {projection: [names of the B tensors added to it]}``, names
            relative to the block (e.g. ``{'q_proj': ['linear_q_adapter_list.0.1', ...]}``); a
            projection is named as in the block's split (``'q_proj'``, ``'gate_up_proj'``).
            The down (``A``) tensors are named nowhere: every rank reads them whole.

    Returns:
        ``(config, size) -> BlockSplit``: ``split``'s, plus each ``B`` read by the rows (pieces)
        of its projection.

    Raises:
        ValueError (from the returned factory): a projection the block does not split by rows.
    """

    def extended(config, size: int) -> BlockSplit:
        inner = split(config, size)
        extra = []
        for projection, ups in adapters(config).items():
            target = next((t for t in inner.tensors if t.dim == 0 and t.matches(projection)), None)
            if target is None:
                raise ValueError(f'lora_split: {projection!r} is not a column-parallel projection of the block')
            if ups:
                extra.append(rows(tuple(ups), *target.pieces))
        return dataclasses.replace(inner, tensors=inner.tensors + tuple(extra))

    return extended
