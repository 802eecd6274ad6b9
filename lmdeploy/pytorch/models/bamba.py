"""IBM Bamba (``transformers`` model type ``bamba``): Mamba-2 layers and a few attention layers,
each followed by a SwiGLU MLP.

``config.attn_layer_indices`` lists the attention layers; every other layer is Mamba-2
(``transformers`` exposes the pattern as ``layers_block_type`` / ``layer_types``:
``'full_attention'`` / ``'linear_attention'``)::

    h = embed(ids)
    layer i:  h = h + mixer(RMSNorm(h))
              h = h + mlp(RMSNorm(h))                  mlp = down(silu(gate(h)) * up(h))
      mixer = Mamba-2 ('linear_attention': conv + SSM states in a slot, Mamba2Mixer)
            | GQA     ('full_attention':   K/V in paged blocks; RoPE on the leading half of
                                           each head, softmax scale head_dim ** -0.5)
    logits = lm_head(RMSNorm(h))

``transformers`` fixes ``partial_rotary_factor = 0.5`` in the config itself, so the rotary
table (from its own ``BambaRotaryEmbedding.compute_default_rope_parameters``, :mod:`.rope`)
covers half of each head. Weight names are the published checkpoint's, which are also
``transformers``' (``model.layers.{i}.mamba.*``, ``self_attn.{q,k,v,o}_proj``,
``feed_forward.{gate,up,down}_proj``, ``input_layernorm``, ``pre_ff_layernorm``,
``model.final_layernorm``).
"""
from __future__ import annotations


import torch

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from .base import CausalLM
from .blocks.decoder import DecoderLayer, DecoderStack, mixer_ctx, mixer_rotary_ctx
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import RotaryGQA
from .blocks.mamba2 import Mamba2Mixer, mamba2_state_spec
from .blocks.mamba2_hybrid import (ATTENTION_BLOCK, FEED_FORWARD_BLOCK, MAMBA_BLOCK, MAMBA_FIELDS, check_mamba_config,
                                   mamba_dims)
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import RotaryEmbedding, SwiGLUMLP
from .parallel_plan import ParallelPlan

__all__ = ['BambaForCausalLM', 'check_config', 'layer_kinds']

MAMBA, ATTENTION = 'linear_attention', 'full_attention'


def layer_kinds(config) -> list[str]:
    """Each layer's mixer, ``'linear_attention'`` (Mamba-2) or ``'full_attention'``, from
    ``attn_layer_indices`` as ``transformers`` reads it.

    Raises:
        ValueError: an ``attn_layer_indices`` entry outside ``[0, num_hidden_layers)``
            (``transformers`` would silently drop it; the checkpoint was not made for this depth).
    """
    n = config.num_hidden_layers
    indices = list(getattr(config, 'attn_layer_indices', None) or [])
    if any(not isinstance(i, int) or not 0 <= i < n for i in indices):
        raise ValueError(f'attn_layer_indices must be layer indices in [0, {n}), got {indices}')
    return [ATTENTION if i in indices else MAMBA for i in range(n)]


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``attn_layer_indices`` (out of range), ``hidden_act``
            (``'silu'`` only: the MLP and the Mamba-2 conv both use it), the Mamba-2 geometry
            (``mamba_n_heads`` x ``mamba_d_head`` must be ``mamba_expand`` x ``hidden_size``,
            ``mamba_n_groups`` must divide ``mamba_n_heads``), ``time_step_limit`` other than
            ``(0, inf)``; the rope parameters are checked by :mod:`.rope`.
    """
    kinds = layer_kinds(config)
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    if MAMBA in kinds:
        inner = round(config.mamba_expand * config.hidden_size)
        check_mamba_config(config, inner, 'mamba_expand x hidden_size')


class BambaAttention(RotaryGQA):
    """Grouped-query attention over the paged KV cache, partial RoPE, scale ``head_dim ** -0.5``
    (:class:`RotaryGQA` as it is).

    Args:
        config: HF ``BambaConfig``.
        layer_idx: index into ``StepContext.kv_caches``.
    """


#: each layer kind's token mixer: (attribute name, factory (config, layer_idx) -> module, call)
MIXERS = {MAMBA: ('mamba', lambda config, i: Mamba2Mixer(mamba_dims(config), i), mixer_ctx),
          ATTENTION: ('self_attn', BambaAttention, mixer_rotary_ctx)}


class BambaDecoderLayer(DecoderLayer):
    """Pre-norm layer: Mamba-2 or attention (:data:`MIXERS`), then the SwiGLU ``feed_forward``
    (biases when ``mlp_bias``)."""

    def __init__(self, config, layer_idx: int, kind: str):
        name, make, call = MIXERS[kind]
        super().__init__(config.hidden_size, config.rms_norm_eps, make(config, layer_idx),
                         SwiGLUMLP(config.hidden_size, config.intermediate_size, bias=bool(config.mlp_bias)),
                         call=call, names=(name, 'feed_forward', 'input_layernorm', 'pre_ff_layernorm'))


class BambaModel(DecoderStack):
    """Embedding, decoder layers, final norm (``final_layernorm``); the rotary table when there are
    attention layers."""

    def __init__(self, config):
        kinds = layer_kinds(config)
        super().__init__(config, (BambaDecoderLayer(config, i, kind) for i, kind in enumerate(kinds)),
                         rotary=RotaryEmbedding(config) if ATTENTION in kinds else None,
                         names=('embed_tokens', 'layers', 'final_layernorm'))


class BambaForCausalLM(CausalLM):
    """Bamba causal LM in the engine's layers; ``config`` a ``transformers``
    ``BambaConfig``, refused (ValueError) as :func:`check_config` says."""
    # Mamba-2, attention, Mamba-2, Mamba-2; SwiGLU MLPs; half-head RoPE. An SSD chunk of 24 so 32-token
    # prefill chunks end off its boundaries; 2 B/C groups so TP2 splits them
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                       mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=24,
                       max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    tiny_top_level_rope_theta = True


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **MAMBA_FIELDS,
        'layers_block_type': IMPLEMENTED,         # derived from attn_layer_indices
        'attn_layer_indices': CHECKED,            # indices in [0, num_hidden_layers)
        'mlp_bias': IMPLEMENTED,
        'num_logits_to_keep': INERT,              # which positions generate() computes logits for
        'z_loss_coefficient': INERT,              # the training loss only
    }
    check_config = staticmethod(check_config)
    # attention and MLP by head / rows, Mamba-2 by head and group (the published mamba_n_groups = 1:
    # the group's B / C copied to every rank of its heads, its norm all-reduced)
    parallel_plan = ParallelPlan(layers=lambda config: [(kind, 'mlp') for kind in layer_kinds(config)],
                                 blocks={ATTENTION: (ATTENTION_BLOCK,), MAMBA: (MAMBA_BLOCK,),
                                         'mlp': (FEED_FORWARD_BLOCK,)})

    model_class = BambaModel

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: the Mamba-2 state (:func:`~.mamba2.mamba2_state_spec`: conv
        ``[conv_dim, mamba_d_conv - 1]`` in ``dtype``, SSM ``[heads, d_head, d_state]`` float32)
        or a :class:`FullAttentionSpec` (KV heads x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        mamba = mamba2_state_spec(mamba_dims(config), dtype)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [mamba if kind == MAMBA else full for kind in layer_kinds(config)]
