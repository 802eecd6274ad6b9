"""Qwen3-Next (``transformers`` model type ``qwen3_next``): a hybrid decoder.

``config.layer_types`` picks each layer's token mixer; every layer then has an MLP::

    layer i:  x + mixer(RMSNorm(x))  ->  h + mlp(RMSNorm(h))
      mixer = Gated DeltaNet   ('linear_attention': state in a slot, LinearAttentionSpec)
            | gated attention  ('full_attention':   K/V in paged blocks, FullAttentionSpec)
      mlp   = sparse MoE + sigmoid-gated shared expert, or a dense SwiGLU for
              ``mlp_only_layers`` / layers off the ``decoder_sparse_step`` grid

All RMSNorms store ``w - 1`` (zero-centred) except the gated norm inside Gated DeltaNet.
Invariant of the linear-attention layers: a sequence with ``history_len == 0`` starts from a
zero state whatever its slot holds; after a forward the slot holds the state after exactly
``kv_seqlen`` tokens. Weight names follow the Hugging Face checkpoint (packed projections —
attention ``qkv_proj``, MLP ``gate_up_proj``, Gated DeltaNet ``in_proj`` — are filled from the
separate tensors); experts may arrive one tensor per expert (published checkpoints) or fused
(``transformers`` in-memory layout).
"""
from __future__ import annotations

import torch

from ..cache_specs import LayerCacheSpec
from .base import TINY_ATTENTION, CausalLM
from .blocks.gated_delta_net import (DENSE, FULL, HYBRID_BLOCKS, MOE, TINY_GATED_DELTANET, HybridDecoderLayer,
                                     check_hybrid_config, hybrid_cache_specs, hybrid_layer_kinds)
from .blocks.decoder import DecoderStack
from .blocks.mtp import MTP_PREFIX
from .blocks.moe import SparseMoeBlock, load_expert_tensor
from .config_audit import COMMON_FIELDS, GATED_DELTANET_FIELDS, IMPLEMENTED, INERT
from .layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from .parallel_plan import ParallelPlan

__all__ = ['Qwen3NextForCausalLM', 'Qwen3NextDecoderLayer', 'check_config', 'has_dense_mlp']

#: the config checks of a Gated DeltaNet + full-attention stack (ValueError naming the field)
check_config = check_hybrid_config


def has_dense_mlp(config) -> bool:
    """Some layer of a Qwen3-Next config has a dense MLP (no experts, ``mlp_only_layers``, or
    layers off ``decoder_sparse_step``)."""
    if config.num_experts == 0:
        return True
    return any(i in (config.mlp_only_layers or []) or (i + 1) % config.decoder_sparse_step
               for i in range(config.num_hidden_layers))


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    """Gated DeltaNet or gated attention (``layer_types``), then the sparse MoE, or a dense SwiGLU
    for ``mlp_only_layers`` / layers off the ``decoder_sparse_step`` grid."""

    def __init__(self, config, layer_idx: int):
        sparse = (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        mlp = SparseMoeBlock(config) if sparse else SwiGLUMLP(config.hidden_size, config.intermediate_size)
        super().__init__(config, layer_idx, mlp)


class Qwen3NextModel(DecoderStack):
    """Embedding, decoder layers, final zero-centred norm; rotary on a leading fraction of each head."""

    def __init__(self, config):
        super().__init__(config, (Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers)),
                         rotary=RotaryEmbedding(config),
                         norm=RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True))


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next causal LM in the engine's layers. Weights: drops ``mtp.*`` (the
    multi-token-prediction head, loaded by speculative decoding); experts may come fused
    (``mlp.experts.gate_up_proj`` / ``down_proj``) or per expert
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``); ``lm_head`` is tied to the embedding when
    ``tie_word_embeddings`` and the checkpoint has none.

    Args:
        config: a ``transformers`` ``Qwen3NextConfig``.

    Raises:
        ValueError: see :func:`check_config`.
    """

    # three Gated DeltaNet layers and an attention layer, MoE everywhere; a quarter of each head rotated
    tiny_config = dict(**TINY_ATTENTION, **TINY_GATED_DELTANET, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=128,
                       partial_rotary_factor=0.25, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    tiny_top_level_rope_theta = True
    tiny_mtp_layers_key = 'num_nextn_predict_layers'

    @staticmethod
    def tiny_config_json(config_dict: dict) -> None:
        """The published configs also mirror ``rope_parameters['partial_rotary_factor']`` at the top level."""
        config_dict['partial_rotary_factor'] = config_dict['rope_parameters']['partial_rotary_factor']
    model_class = Qwen3NextModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **GATED_DELTANET_FIELDS,
        'decoder_sparse_step': IMPLEMENTED,
        'mlp_only_layers': IMPLEMENTED,
        'num_experts': IMPLEMENTED,
        'num_experts_per_tok': IMPLEMENTED,
        'moe_intermediate_size': IMPLEMENTED,
        'shared_expert_intermediate_size': IMPLEMENTED,
        'norm_topk_prob': IMPLEMENTED,
        'output_router_logits': INERT,        # the training loss only
        'router_aux_loss_coef': INERT,
    }
    check_config = staticmethod(check_config)
    # gated q_proj, Gated DeltaNet by key head, dense MLPs split, MoE blocks replicated
    # (the MTP head's layer splits as the target's attention and MLP layers)
    parallel_plan = ParallelPlan(
        layers=lambda config: hybrid_layer_kinds(config, has_dense_mlp(config)), blocks=HYBRID_BLOCKS,
        extra_layers=lambda config: [(f'{MTP_PREFIX}layers.0.', (FULL, DENSE if has_dense_mlp(config) else MOE))])

    mtp_head = 'qwen3_next_mtp:Qwen3NextMTP'      # the checkpoint's mtp.* head (speculative decoding)

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: :class:`LinearAttentionSpec` for Gated DeltaNet, :class:`FullAttentionSpec` otherwise."""
        return hybrid_cache_specs(config, dtype)

    def rename_weight(self, name: str) -> str | None:
        """Drops ``mtp.*``."""
        return None if name.startswith('mtp.') else name

    load_tensor = staticmethod(load_expert_tensor)
