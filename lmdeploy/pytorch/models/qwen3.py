"""Qwen3 (``transformers`` model type ``qwen3``): a full-attention decoder.

Per layer: RMSNorm → attention (per-head RMSNorm on q and k, rotary embedding, GQA over the
paged KV cache) → residual → RMSNorm → SwiGLU MLP → residual. Weight names follow the
Hugging Face checkpoint, except that q/k/v and gate/up run as packed projections
(``qkv_proj``, ``gate_up_proj``) which the weight loader fills from the separate tensors.
"""
from __future__ import annotations

import torch

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from .config_audit import CHECKED, COMMON_FIELDS
from .base import TINY_ATTENTION, CausalLM
from .blocks.attention import QKNormAttention
from .blocks.decoder import DecoderLayer, DecoderStack, mixer_cos_sin_ctx
from .blocks.gqa import gqa_split
from .layers import RotaryEmbedding, SwiGLUMLP, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['Qwen3ForCausalLM']


class Qwen3DecoderLayer(DecoderLayer):
    """Pre-norm decoder layer: q/k-norm attention and SwiGLU MLP, each with a residual; called as
    ``layer(hidden [T, hidden], (cos, sin), ctx)``."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config.hidden_size, config.rms_norm_eps, QKNormAttention(config, layer_idx),
                         SwiGLUMLP(config.hidden_size, config.intermediate_size), call=mixer_cos_sin_ctx)


class Qwen3Model(DecoderStack):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config):
        super().__init__(config, (Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)),
                         rotary=RotaryEmbedding(config))


def check_config(config) -> None:
    """Reject a Qwen3 config this implementation cannot run exactly.

    Raises:
        ValueError: ``hidden_act`` other than ``'silu'``, or ``layer_types`` other than
            ``'full_attention'`` for every layer (sliding-window attention is not supported).
    """
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    types = list(getattr(config, 'layer_types', None) or ['full_attention'] * config.num_hidden_layers)
    bad = sorted({t for t in types if t != 'full_attention'})
    if bad or len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must be 'full_attention' for all {config.num_hidden_layers} layers, "
                         f'got {bad or types} (use_sliding_window={getattr(config, "use_sliding_window", None)}, '
                         f'sliding_window={getattr(config, "sliding_window", None)}, max_window_layers='
                         f'{getattr(config, "max_window_layers", None)}); sliding-window attention is not '
                         'supported')


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 causal LM in the engine's layers; weights: ``q/k/v_proj`` and ``gate/up_proj`` load
    into their packed rows, ``lm_head`` is tied when the config says so.

    Args:
        config: a ``transformers`` ``Qwen3Config``.

    Raises:
        ValueError: see :func:`check_config`.
    """

    # two attention layers (:mod:`lmdeploy.tools.make_tiny_model`)
    tiny_config = dict(**TINY_ATTENTION, num_hidden_layers=2, intermediate_size=128)
    tiny_top_level_rope_theta = True
    model_class = Qwen3Model
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'sliding_window': CHECKED,            # read for 'sliding_attention' layers, which are refused
    }
    check_config = staticmethod(check_config)
    # attention by head, the dense MLP by rows (the vocabulary split is every plan's)
    parallel_plan = ParallelPlan(layers=lambda config: [('attention', 'mlp')] * config.num_hidden_layers,
                                 blocks={'attention': (Block(gqa_split(), 'self_attn'),),
                                         'mlp': (Block(mlp_split(), 'mlp'),)})

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """One :class:`FullAttentionSpec` per layer."""
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        return [FullAttentionSpec(config.num_key_value_heads, head_dim, dtype)] * config.num_hidden_layers
