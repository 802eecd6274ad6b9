"""Mamba-1 language models: ``mamba`` (the state-spaces ``mamba-*`` checkpoints) and
``falcon_mamba`` (Falcon-Mamba-7B). Every layer is a Mamba-1 mixer; there is no attention and no
MLP::

    h = embed(ids)                          (float32 residual stream when residual_in_fp32)
    layer i:  h = h + Mamba1Mixer(RMSNorm(h))
    logits = lm_head(RMSNorm(h))

The mixer is the shared :class:`~.blocks.mamba1.Mamba1Mixer` (conv + selective scan); FalconMamba's
differs only by RMS-normalising ``dt_low``, ``B`` and ``C`` (no weight, ``mixer_rms_eps``)
before ``dt_proj`` and the scan. Config fields: ``hidden_size``, ``expand``
(``intermediate_size = expand * hidden_size``), ``state_size``, ``time_step_rank``,
``conv_kernel``, ``use_bias``, ``use_conv_bias``, ``layer_norm_epsilon``, ``residual_in_fp32``.

Nothing is cached per token: each layer declares a state spec only, so a KV block holds zero
bytes (``K_blk = 0``), and a prefix is reused from a state checkpoint at an aligned boundary
alone; the Store holds state objects only (as for ``mamba2``).

Weight names: ``backbone.embeddings`` (or the original ``backbone.embedding``),
``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``,
``lm_head`` (absent when tied). FalconMamba's ``{b,c,dt}_layernorm.weight``, when a checkpoint
holds them, are dropped as ``transformers`` does (its norms have no weight).
"""
from __future__ import annotations

import re

import torch

from ..cache_specs import LayerCacheSpec
from .base import CausalLM
from .blocks.mamba1 import Mamba1Dims, Mamba1Mixer, mamba1_split, mamba1_state_spec
from .blocks.ssm_lm import SSMBackbone, rename_ssm_prefix, ssm_parallel_plan
from .config_audit import CHECKED, IMPLEMENTED, INERT

__all__ = ['MambaForCausalLM', 'FalconMambaForCausalLM', 'check_config']


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``hidden_act`` (``'silu'`` only: the conv activation; the
            gate is always SiLU), ``time_step_rank`` not positive.
    """
    if config.hidden_act not in ('silu', 'swish'):
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    if int(config.time_step_rank) <= 0:
        raise ValueError(f'time_step_rank must be positive, got {config.time_step_rank!r}')


def mamba_dims(config) -> Mamba1Dims:
    """The mixer sizes of a Mamba / FalconMamba config; this rank's channels in a
    tensor-parallel local config (``mamba_tp_size``, set by :func:`~.blocks.mamba1.mamba1_split`)."""
    eps = config.mixer_rms_eps if getattr(config, 'model_type', None) == 'falcon_mamba' else None
    full = Mamba1Dims(hidden_size=config.hidden_size, d_inner=int(config.intermediate_size),
                      state_size=config.state_size, dt_rank=int(config.time_step_rank),
                      conv_kernel=config.conv_kernel, conv_bias=bool(config.use_conv_bias),
                      proj_bias=bool(config.use_bias), bcdt_norm_eps=eps)
    size = getattr(config, 'mamba_tp_size', 1)
    return full if size == 1 else full.local(size)


class MambaBackbone(SSMBackbone):
    """Embedding, Mamba-1 blocks (:class:`~.blocks.ssm_lm.SSMBlock` around a ``Mamba1Mixer``), final norm."""

    def __init__(self, config):
        super().__init__(config, lambda config, layer_idx: Mamba1Mixer(mamba_dims(config), layer_idx))


_WEIGHTLESS = re.compile(r'\.mixer\.(b|c|dt)_layernorm\.weight$')


def _rename(name: str) -> str | None:
    if _WEIGHTLESS.search(name):
        return None
    return rename_ssm_prefix(name)


_MAMBA_FIELDS = {
    'vocab_size': IMPLEMENTED,
    'hidden_size': IMPLEMENTED,
    'num_hidden_layers': IMPLEMENTED,
    'layer_types': IMPLEMENTED,               # every layer 'linear_attention' (a fixed property)
    'intermediate_size': IMPLEMENTED,         # expand x hidden_size (derived by the config)
    'expand': IMPLEMENTED,
    'state_size': IMPLEMENTED,
    'conv_kernel': IMPLEMENTED,
    'time_step_rank': CHECKED,                # positive ('auto' is resolved by the config)
    'use_bias': IMPLEMENTED,
    'use_conv_bias': IMPLEMENTED,
    'layer_norm_epsilon': IMPLEMENTED,
    'residual_in_fp32': IMPLEMENTED,          # the residual stream is kept in float32
    'hidden_act': CHECKED,                    # 'silu' only
    'time_step_scale': INERT,                 # dt_proj / dt bias initialisation only
    'time_step_min': INERT,
    'time_step_max': INERT,
    'time_step_floor': INERT,
    'time_step_init_scheme': INERT,
    'rescale_prenorm_residual': INERT,        # initialisation only
    'initializer_range': INERT,
    'use_mambapy': INERT,                     # alternative training-time scans of the same recurrence
    'use_associative_scan': INERT,
    'output_hidden_states': INERT,            # what the forward returns, not what it computes
    'return_dict': INERT,
    'tie_word_embeddings': IMPLEMENTED,
    'dtype': IMPLEMENTED,
    'quantization_config': CHECKED,           # FP8 block-wise only (.quantization)
    'pad_token_id': INERT,
    'use_cache': INERT,
}


class MambaForCausalLM(CausalLM):
    """A Mamba(-1) causal LM in the engine's layers; ``config`` a ``transformers`` ``MambaConfig``
    (or ``FalconMambaConfig``: the subclass), refused (ValueError) as :func:`check_config` says."""
    # three Mamba-1 layers, nothing else; dt rank 4 ('auto': 64 / 16)
    tiny_config = dict(hidden_size=64, num_hidden_layers=3, state_size=16, expand=2, conv_kernel=4, use_conv_bias=True,
                       use_bias=False, layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=False)


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = dict(_MAMBA_FIELDS)
    rotary_class = None       # no positions at all
    check_config = staticmethod(check_config)
    # every mixer by channel (x_proj and out_proj row-parallel)
    parallel_plan = ssm_parallel_plan(mamba1_split(mamba_dims, 'intermediate_size'))

    model_class = MambaBackbone

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer the Mamba-1 state (:func:`~.blocks.mamba1.mamba1_state_spec`: conv
        ``[intermediate_size, conv_kernel - 1]`` in ``dtype``, SSM ``[intermediate_size,
        state_size]`` float32); nothing paged, so KV blocks are zero bytes.

        Raises:
            ValueError: see :func:`check_config`.
        """
        return [mamba1_state_spec(mamba_dims(config), dtype)] * config.num_hidden_layers

    def rename_weight(self, name: str) -> str | None:
        """Names of the module docstring → ours; FalconMamba's weightless norms' weights → None."""
        return _rename(name)


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba: :class:`MambaForCausalLM` with ``dt_low``, ``B`` and ``C`` RMS-normalised
    (no weight, ``mixer_rms_eps``) in every mixer.

    Args:
        config: a ``transformers`` ``FalconMambaConfig``.
    """

    config_fields = dict(_MAMBA_FIELDS, mixer_rms_eps=IMPLEMENTED)
