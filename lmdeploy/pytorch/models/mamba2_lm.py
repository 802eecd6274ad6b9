"""Mamba-2 language models (``transformers`` model type ``mamba2``, e.g. Mamba-Codestral-7B and
the state-spaces ``mamba2-*`` checkpoints): every layer is a Mamba-2 mixer, there is no
attention and no MLP::

    h = embed(ids)                          (float32 residual stream when residual_in_fp32)
    layer i:  h = h + Mamba2Mixer(RMSNorm(h))
    logits = lm_head(RMSNorm(h))

The mixer is the shared :class:`~.mamba2.Mamba2Mixer` (conv + SSD scan, grouped gated RMS
norm); its config fields are ``num_heads``, ``head_dim``, ``n_groups``, ``state_size``,
``conv_kernel``, ``chunk_size``, ``use_bias``, ``use_conv_bias`` and ``layer_norm_epsilon``.

Nothing is cached per token: each layer declares a state spec only, so a KV block holds zero
bytes (``K_blk = 0``). The block table and the prefix-cache trie still count tokens in blocks
of ``block_size`` (the trie's identity unit), so a prefix is reused exactly as in the hybrids:
a state checkpoint at an aligned boundary, with nothing else to restore; the Store holds state
objects only.

Weight names: ``backbone.embeddings`` (or the original ``backbone.embedding``),
``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``,
``lm_head`` (absent when tied).
"""
from __future__ import annotations

import torch

from ..cache_specs import LayerCacheSpec
from .base import CausalLM
from .blocks.mamba2 import Mamba2Dims, Mamba2Mixer, check_time_step_limit, mamba2_split, mamba2_state_spec
from .blocks.ssm_lm import SSMBackbone, rename_ssm_prefix, ssm_parallel_plan
from .config_audit import CHECKED, IMPLEMENTED, INERT

__all__ = ['Mamba2ForCausalLM', 'check_config']


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``hidden_act`` (``'silu'`` only), ``num_heads`` x
            ``head_dim`` other than ``expand`` x ``hidden_size``, ``n_groups`` not dividing
            ``num_heads``, ``time_step_limit`` other than ``(0, inf)``.
    """
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    inner = round(config.expand * config.hidden_size)
    if config.num_heads * config.head_dim != inner:
        raise ValueError(f'num_heads ({config.num_heads}) x head_dim ({config.head_dim}) must equal expand x '
                         f'hidden_size ({inner})')
    if config.n_groups <= 0 or config.num_heads % config.n_groups:
        raise ValueError(f'n_groups ({config.n_groups}) must divide num_heads ({config.num_heads})')
    check_time_step_limit(config.time_step_limit)


def mamba_dims(config) -> Mamba2Dims:
    """The mixer sizes of a Mamba-2 config; this rank's heads and groups in a tensor-parallel
    local config (``mamba_tp_size``, set by :func:`~.blocks.mamba2.mamba2_split`)."""
    full = Mamba2Dims(hidden_size=config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
                      n_groups=config.n_groups, state_size=config.state_size, conv_kernel=config.conv_kernel,
                      chunk_size=config.chunk_size, conv_bias=bool(config.use_conv_bias),
                      proj_bias=bool(config.use_bias), dt_min=0.0, dt_max=float('inf'),
                      norm_eps=config.layer_norm_epsilon)
    size = getattr(config, 'mamba_tp_size', 1)
    return full if size == 1 else full.local(size)


class Mamba2Backbone(SSMBackbone):
    """Embedding, Mamba-2 blocks (:class:`~.blocks.ssm_lm.SSMBlock` around a ``Mamba2Mixer``), final norm."""

    def __init__(self, config):
        super().__init__(config, lambda config, layer_idx: Mamba2Mixer(mamba_dims(config), layer_idx))


class Mamba2ForCausalLM(CausalLM):
    """A Mamba-2 causal LM in the engine's layers; ``config`` a ``transformers``
    ``Mamba2Config``, refused (ValueError) as :func:`check_config` says."""
    # three Mamba-2 layers, nothing else; SSD chunks of 24, 2 B/C groups
    tiny_config = dict(hidden_size=64, num_hidden_layers=3, num_heads=4, head_dim=32, expand=2, n_groups=2,
                       state_size=16, conv_kernel=4, chunk_size=24, use_conv_bias=True, use_bias=False,
                       layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=False)


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        'vocab_size': IMPLEMENTED,
        'hidden_size': IMPLEMENTED,
        'num_hidden_layers': IMPLEMENTED,
        'layer_types': IMPLEMENTED,               # every layer 'linear_attention' (a fixed property)
        'num_heads': IMPLEMENTED,
        'head_dim': CHECKED,                      # num_heads x head_dim = expand x hidden_size
        'expand': IMPLEMENTED,
        'n_groups': CHECKED,                      # divides num_heads
        'state_size': IMPLEMENTED,
        'conv_kernel': IMPLEMENTED,
        'chunk_size': IMPLEMENTED,                # the SSD chunk: changes rounding only
        'use_bias': IMPLEMENTED,
        'use_conv_bias': IMPLEMENTED,
        'layer_norm_epsilon': IMPLEMENTED,
        'residual_in_fp32': IMPLEMENTED,          # the residual stream is kept in float32
        'hidden_act': CHECKED,                    # 'silu' only
        'time_step_limit': CHECKED,               # (0, inf) only: see mamba2.check_time_step_limit
        'time_step_rank': INERT,                  # unused by the layer (no dt projection of its own)
        'time_step_min': INERT,                   # dt_bias initialisation only
        'time_step_max': INERT,
        'time_step_floor': INERT,
        'rescale_prenorm_residual': INERT,        # initialisation only
        'initializer_range': INERT,
        'tie_word_embeddings': IMPLEMENTED,
        'dtype': IMPLEMENTED,
        'quantization_config': CHECKED,           # FP8 block-wise only (.quantization)
        'pad_token_id': INERT,
        'use_cache': INERT,
    }
    rotary_class = None       # no positions at all
    check_config = staticmethod(check_config)
    # every mixer by head and group
    parallel_plan = ssm_parallel_plan(mamba2_split(mamba_dims, 'num_heads', 'n_groups'))

    model_class = Mamba2Backbone

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer the Mamba-2 state (:func:`~.mamba2.mamba2_state_spec`: conv
        ``[conv_dim, conv_kernel - 1]`` in ``dtype``, SSM ``[num_heads, head_dim, state_size]``
        float32); nothing paged, so KV blocks are zero bytes.

        Raises:
            ValueError: see :func:`check_config`.
        """
        return [mamba2_state_spec(mamba_dims(config), dtype)] * config.num_hidden_layers

    def rename_weight(self, name: str) -> str | None:
        """Names of the module docstring → ours."""
        return rename_ssm_prefix(name)
