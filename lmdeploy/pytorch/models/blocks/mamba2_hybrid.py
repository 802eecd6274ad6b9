"""What the attention + Mamba-2 hybrids (Bamba, Granite-4.0-H, Falcon-H1) share: the HF
``mamba_*`` config fields (:func:`check_mamba_config` checks them, :func:`mamba_dims` reads them,
:data:`MAMBA_FIELDS` audits them)
and the blocks their tensor-parallel plans compose (:data:`ATTENTION_BLOCK`,
:data:`MAMBA_BLOCK`, :data:`FEED_FORWARD_BLOCK`).
"""
from __future__ import annotations

from ..config_audit import CHECKED, IMPLEMENTED
from ..layers import mlp_split
from ..parallel_plan import Block
from .gqa import gqa_split
from .mamba2 import Mamba2Dims, check_time_step_limit, mamba2_split

__all__ = ['ATTENTION_BLOCK', 'FEED_FORWARD_BLOCK', 'MAMBA_BLOCK', 'MAMBA_FIELDS', 'check_mamba_config', 'mamba_dims']

#: the config fields :func:`mamba_dims` and :func:`check_mamba_config` read, and what the engine
#: does with each (for a family's ``config_fields``, :mod:`..config_audit`)
MAMBA_FIELDS = {
    'mamba_n_heads': IMPLEMENTED,
    'mamba_n_groups': CHECKED,                # divides mamba_n_heads
    'mamba_d_state': IMPLEMENTED,
    'mamba_d_head': CHECKED,                  # mamba_n_heads x mamba_d_head = the Mamba inner width
    'mamba_d_conv': IMPLEMENTED,
    'mamba_expand': IMPLEMENTED,              # the inner width is mamba_expand x hidden_size
    'mamba_chunk_size': IMPLEMENTED,          # the SSD chunk: changes rounding only
    'mamba_conv_bias': IMPLEMENTED,
    'mamba_proj_bias': IMPLEMENTED,
    'time_step_limit': CHECKED,               # (0, inf) only: see mamba2.check_time_step_limit
}


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
    config (``mamba_tp_size``, set by :func:`~.mamba2.mamba2_split`)."""
    full = Mamba2Dims(hidden_size=config.hidden_size, num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
                      n_groups=config.mamba_n_groups, state_size=config.mamba_d_state,
                      conv_kernel=config.mamba_d_conv, chunk_size=config.mamba_chunk_size,
                      conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.mamba_proj_bias), dt_min=0.0,
                      dt_max=float('inf'), norm_eps=config.rms_norm_eps)
    size = getattr(config, 'mamba_tp_size', 1)
    return full if size == 1 else full.local(size)


#: the blocks of the attention + Mamba-2 hybrids' tensor-parallel plans: attention by head (KV
#: heads divided by the TP size), Mamba-2 by head and group (``mamba_n_heads``,
#: ``mamba_n_groups``; the local config sets ``mamba_tp_size``, :func:`mamba_dims` divides),
#: the SwiGLU ``feed_forward`` MLP by intermediate rows
ATTENTION_BLOCK = Block(gqa_split(shared_kv=False), 'self_attn')
MAMBA_BLOCK = Block(mamba2_split(mamba_dims, 'mamba_n_heads', 'mamba_n_groups'), 'mamba')
FEED_FORWARD_BLOCK = Block(mlp_split(), 'feed_forward')
