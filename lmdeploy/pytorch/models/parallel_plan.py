"""ParallelPlan: how a model's parameters split under tensor parallelism, declared by the model.

Each model class carries a ``parallel_plan`` class attribute beside its layers (None: the
model runs at tp=1 only). The generic layout (:class:`~lmdeploy.pytorch.distributed.sharding.TPLayout`)
applies it — Megatron-LM's column / row / vocabulary splits (Shoeybi et al., 2019) — and
never asks for the model type::

    what the plan says              what the layout splits
    (always)                        embed_tokens / lm_head by vocabulary rows; attention q/k/v
                                    by head (column), o_proj by its input columns (row)
    gated_q                         q_proj rows also hold each head's output gate
    gated_delta_net                 Gated DeltaNet heads by key head: in_proj_qkvz / in_proj_ba
                                    grouped per key head (Qwen3-Next) or in_proj_qkv | z | b | a
                                    flat per kind (Qwen3.5), conv channels, dt_bias, A_log, out_proj
    dense_mlp(config)               whether dense MLPs exist (then split by intermediate rows);
                                    MoE blocks are replicated
    renames                         checkpoint name prefixes read as others (Qwen3.5's
                                    model.language_model.* as model.*)
    rank0_only, skipped             tensors only rank 0 reads (a vision tower), or none reads
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ['ParallelPlan']


def _always(config) -> bool:
    return True


@dataclass(frozen=True)
class ParallelPlan:
    """A model's tensor-parallel split (see the module docstring).

    Attributes:
        gated_q: ``q_proj`` emits ``2 * head_dim`` rows per head (query and output gate).
        gated_delta_net: the model has Gated DeltaNet layers (split by key head).
        dense_mlp: ``text config -> bool``: the model has dense MLP layers.
        renames: ``(prefix, replacement)`` pairs applied to checkpoint names before matching.
        rank0_only: name prefixes read by rank 0 only (its module is dropped on other ranks).
        skipped: name prefixes no rank reads.
        rank0_modules: attribute names of the model set to None on ranks other than 0.
        custom: ``(config, rank, size) -> split`` for layers of other kinds: an object with
            ``local_config()``, ``shard(name) -> (dim, ranges) | None``, ``cache_ranges(split)``
            and ``row_parallel`` (``(owner, name)`` output projections), and optionally
            ``attach_collectives(model, all_reduce)`` (hands the in-place sum over ranks to
            layers that need it, e.g. a Mamba-2 norm whose group spans ranks); the flags above
            are then unused (only the vocabulary split stays generic).
    """
    gated_q: bool = False
    gated_delta_net: bool = False
    dense_mlp: Callable = _always
    renames: tuple[tuple[str, str], ...] = ()
    rank0_only: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    rank0_modules: tuple[str, ...] = ()
    custom: Callable | None = None
