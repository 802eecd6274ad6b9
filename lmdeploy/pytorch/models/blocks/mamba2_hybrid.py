"""The tensor-parallel split shared by the attention + Mamba-2 hybrids (Bamba, Granite-4.0-H,
Falcon-H1): attention by head, Mamba-2 by head and group, an MLP by intermediate rows.

The three share the HF ``mamba_*`` config fields too: :func:`check_mamba_config` checks them,
:func:`mamba_dims` reads them.

A family subclasses :class:`Mamba2HybridTPSplit` and gives only its data: its name (for errors),
which layers hold attention / Mamba-2, its head size, its Mamba-2 dims and the config field of
its split MLP width; a family whose MLP is not the SwiGLU ``feed_forward`` overrides
:meth:`Mamba2HybridTPSplit.shard_mlp`.
"""
from __future__ import annotations

import copy
import re

from .mamba2 import Mamba2Dims, Mamba2Mixer, Mamba2TPSplit, check_time_step_limit

__all__ = ['Mamba2HybridTPSplit', 'check_mamba_config', 'mamba_dims']

_ATTN_ROWS = re.compile(r'^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$')
_MLP_ROWS = re.compile(r'^model\.layers\.(\d+)\.feed_forward\.(gate_proj|up_proj|down_proj)\.(weight|bias)$')
_MAMBA_ROWS = re.compile(r'^model\.layers\.(\d+)\.mamba\.(.+)$')


def check_mamba_config(config, inner: int, inner_name: str) -> None:
    """Refuse a Mamba-2 geometry the mixer does not reproduce.

    Args:
        config: the family's HF config (``mamba_n_heads``, ``mamba_d_head``, ``mamba_n_groups``,
            ``time_step_limit``).
        inner: the family's Mamba inner width (channels); ``inner_name`` names it in the error.

    Raises:
        ValueError: ``mamba_n_heads`` x ``mamba_d_head`` is not ``inner``, ``mamba_n_groups`` is
            not a positive divisor of ``mamba_n_heads``, ``time_step_limit`` other than ``(0, inf)``.
    """
    if config.mamba_n_heads * config.mamba_d_head != inner:
        raise ValueError(f'mamba_n_heads ({config.mamba_n_heads}) x mamba_d_head ({config.mamba_d_head}) must '
                         f'equal {inner_name} ({inner})')
    if config.mamba_n_groups <= 0 or config.mamba_n_heads % config.mamba_n_groups:
        raise ValueError(f'mamba_n_groups ({config.mamba_n_groups}) must divide mamba_n_heads '
                         f'({config.mamba_n_heads})')
    check_time_step_limit(config.time_step_limit)


def mamba_dims(config) -> Mamba2Dims:
    """The Mamba-2 mixer sizes of a hybrid's config (``mamba_*`` fields; ``in_proj`` bias
    ``mamba_proj_bias``, the norm's eps ``rms_norm_eps``; ``dt`` unclamped, which
    :func:`check_mamba_config` checks): this rank's heads and groups in a tensor-parallel local
    config (``mamba_tp_size``, set by :meth:`Mamba2HybridTPSplit.local_config`)."""
    full = Mamba2Dims(hidden_size=config.hidden_size, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
                      n_groups=config.mamba_n_groups, state_size=config.mamba_d_state,
                      conv_kernel=config.mamba_d_conv, chunk_size=config.mamba_chunk_size,
                      conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.mamba_proj_bias), dt_min=0.0,
                      dt_max=float('inf'), norm_eps=config.rms_norm_eps)
    size = getattr(config, 'mamba_tp_size', 1)
    return full if size == 1 else full.local(size)


class Mamba2HybridTPSplit:
    """How an attention + Mamba-2 hybrid splits over ``size`` tensor-parallel ranks (Megatron-style).

    Attention by head: ``q_proj`` rows of the rank's query heads, ``k_proj`` / ``v_proj`` rows of
    its KV heads, ``o_proj`` columns (row-parallel, all-reduce); its K/V cache holds its KV heads.
    Mamba-2 by head and group (:class:`~.mamba2.Mamba2TPSplit`; with fewer groups than ranks the
    group's ``B`` / ``C`` are copied to every rank of its heads and its norm is all-reduced). The
    MLP by intermediate rows (by default the SwiGLU ``feed_forward``: ``gate_proj`` / ``up_proj``
    rows, ``down_proj`` columns, all-reduce).

    Args:
        config: the family's HF config (``num_attention_heads``, ``num_key_value_heads``,
            ``mlp_field``, ``mamba_n_heads``, ``mamba_n_groups``).
        rank, size: this rank, the TP size.
        family: the family's name, for the ``cache_ranges`` error.
        divisible: the config fields ``size`` must divide, checked in this order.
        mlp_field: the config field of the split MLP width (intermediate units).
        head_dim: the attention head size (elements).
        dims: the full Mamba-2 dims, or None when no layer holds Mamba-2.
        attention_layers, mamba_layers: the layer indices that hold each mixer; None for every
            layer.

    Raises:
        ValueError: ``size`` does not divide a field of ``divisible``, or the Mamba-2 head or
            group count (see :class:`~.mamba2.Mamba2TPSplit`; names the field).
    """

    row_parallel = (('self_attn', 'o_proj'), ('feed_forward', 'down_proj'), ('mamba', 'out_proj'))

    def __init__(self, config, rank: int, size: int, *, family: str, divisible: tuple[str, ...], mlp_field: str,
                 head_dim: int, dims: Mamba2Dims | None, attention_layers: set[int] | None = None,
                 mamba_layers: set[int] | None = None):
        self.config, self.rank, self.size = config, rank, size
        self.family, self.mlp_field, self.head_dim = family, mlp_field, head_dim
        self.attention_layers, self.mamba_layers = attention_layers, mamba_layers
        for field in divisible:
            if getattr(config, field) % size:
                raise ValueError(f'{field} ({getattr(config, field)}) must be divisible by tp ({size})')

        def part(total: int) -> tuple[int, int]:
            return rank * total // size, (rank + 1) * total // size

        self.q_heads, self.kv_heads = part(config.num_attention_heads), part(config.num_key_value_heads)
        self.inter = part(getattr(config, mlp_field))
        self.mamba = Mamba2TPSplit(dims, rank, size, 'mamba_n_heads', 'mamba_n_groups') if dims is not None else None

    def local_config(self):
        """A copy of the config with this rank's head and intermediate counts."""
        c = copy.deepcopy(self.config)
        c.head_dim = self.head_dim
        c.num_attention_heads = self.q_heads[1] - self.q_heads[0]
        c.num_key_value_heads = self.kv_heads[1] - self.kv_heads[0]
        setattr(c, self.mlp_field, self.inter[1] - self.inter[0])
        c.mamba_tp_size = self.size      # the mamba_* fields stay whole; the family's mamba_dims divides them
        return c

    def attach_collectives(self, model, all_reduce) -> None:
        """Give each Mamba-2 mixer its cross-rank norm when its group spans ranks."""
        norm = self.mamba.norm(all_reduce) if self.mamba is not None else None
        for layer in model.model.layers:
            if isinstance(getattr(layer, 'mamba', None), Mamba2Mixer):
                layer.mamba.cross_rank_norm = norm

    def cache_ranges(self, split: str) -> tuple[tuple[int, int], ...]:
        """The rank's KV heads for ``'kv_heads'``; the Mamba-2 state splits otherwise.

        Raises:
            ValueError: ``split`` is neither.
        """
        ranges = (self.kv_heads,) if split == 'kv_heads' else \
            None if self.mamba is None else self.mamba.cache_ranges(split)
        if ranges is None:
            raise ValueError(f"CacheTensor.tp_split: {self.family} splits 'kv_heads' and the Mamba-2 states, "
                             f'not {split!r}')
        return ranges

    def shard_mlp(self, name: str):
        """``(dim, ranges)`` of MLP tensor ``name`` this rank reads; None when whole or not an MLP
        tensor (``feed_forward`` SwiGLU; a family with another MLP overrides this)."""
        m = _MLP_ROWS.match(name)
        if m is None:
            return None
        if m.group(2) == 'down_proj':
            return (1, (self.inter,)) if m.group(3) == 'weight' else None
        return 0, (self.inter,)

    def shard(self, name: str):
        """``(dim, ranges)`` of checkpoint tensor ``name`` this rank reads, or None (whole)."""
        m = _ATTN_ROWS.match(name)
        if m and (self.attention_layers is None or int(m.group(1)) in self.attention_layers):
            proj, kind, d = m.group(2), m.group(3), self.head_dim
            if proj == 'o_proj':
                return (1, ((self.q_heads[0] * d, self.q_heads[1] * d),)) if kind == 'weight' else None
            heads = self.q_heads if proj == 'q_proj' else self.kv_heads
            return 0, ((heads[0] * d, heads[1] * d),)
        sharded = self.shard_mlp(name)
        if sharded is not None:
            return sharded
        m = _MAMBA_ROWS.match(name)
        if m and (self.mamba_layers is None or int(m.group(1)) in self.mamba_layers):
            return self.mamba.shard(m.group(2))
        return None
