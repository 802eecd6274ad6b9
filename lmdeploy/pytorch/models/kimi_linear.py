"""Kimi-Linear (``transformers`` model type ``kimi_linear``): KDA recurrent layers interleaved
with MLA full-attention layers, a DeepSeek-style MoE after each.

``config.layer_types`` picks each layer's token mixer, ``config.mlp_layer_types`` its MLP::

    layer i:  x + mixer(RMSNorm(x))  ->  h + mlp(RMSNorm(h))
      mixer = Kimi Delta Attention ('linear_attention': conv + recurrent states in a slot)
            | MLA                  ('full_attention':   one latent row per token in paged blocks)
      mlp   = sigmoid-routed experts * routed_scaling_factor + shared experts ('sparse'),
              or a dense SwiGLU ('dense')

MLA here has no rotary embedding at all (transformers' Kimi-Linear is NoPE): per token it caches
``[kv_a_layernorm(c_kv) (kv_lora_rank) | k_rope (qk_rope_head_dim)]``, one row shared by every
head; attention gathers a sequence's rows and, for a prefill chunk, up-projects them through
``kv_b_proj`` (non-absorbed); a decode token uses the absorbed form instead (the up-projections
folded into the query and the output; measured in benchmark/benchmark_mla.py). Weight names:
the published checkpoint's (``self_attn.q_conv1d`` ...,
``block_sparse_moe.experts.{e}.w1``) and transformers' in-memory ones
(``self_attn.conv1d`` stacked, ``self_attn.forget_gate.*``, ``mlp.experts.gate_up_proj``) both load.
"""
from __future__ import annotations

import re

import torch

from ..cache_specs import LayerCacheSpec
from .base import CausalLM
from .blocks.decoder import DecoderLayer, UniformStack
from .blocks.kda import KimiDeltaAttention, kda_mla_cache_specs, kda_split, load_kda_tensor
from .blocks.mla import LatentAttention, mla_split
from .blocks.moe import MIXTRAL_EXPERT_RENAMES, GroupLimitedMoE, check_group_limited, load_expert_tensor
from .config_audit import (CHECKED, COMMON_FIELDS, GROUP_LIMITED_MOE_FIELDS, INERT, KDA_FIELDS, MLA_FIELDS,
                           check_layer_types)
from .layers import SwiGLUMLP, apply_renames
from .parallel_plan import Block, ParallelPlan

__all__ = ['KimiLinearForCausalLM', 'KimiMLA', 'check_config']

LINEAR, FULL = 'linear_attention', 'full_attention'

# Kimi's MLA (blocks/mla.py): no rotary embedding, no output gate
KimiMLA = LatentAttention


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``mlp_layer_types``, ``hidden_act``,
            ``n_group`` / ``topk_group``). ``num_key_value_heads`` is not read: ``kv_b_proj``
            up-projects a key and a value for every query head.
    """
    check_layer_types(config, (LINEAR, FULL))
    mlp = check_layer_types(config, ('dense', 'sparse'), 'mlp_layer_types')
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    if 'sparse' in mlp:
        check_group_limited(config)


class KimiLinearDecoderLayer(DecoderLayer):
    """Pre-norm layer: KDA or MLA (``layer_types``), then MoE or dense MLP (``mlp_layer_types``);
    no positions anywhere (called with ``rotary=None``)."""

    def __init__(self, config, layer_idx: int):
        mixer = KimiDeltaAttention(config, layer_idx) if config.layer_types[layer_idx] == LINEAR \
            else KimiMLA(config, layer_idx)
        mlp = GroupLimitedMoE(config) if config.mlp_layer_types[layer_idx] == 'sparse' \
            else SwiGLUMLP(config.hidden_size, config.intermediate_size)
        super().__init__(config.hidden_size, config.rms_norm_eps, mixer, mlp)


class KimiLinearModel(UniformStack):
    """Embedding, decoder layers, final norm (no positional embedding anywhere)."""
    layer_class = KimiLinearDecoderLayer


_RENAMES = [
    (re.compile(r'\.self_attn\.forget_gate\.'), '.self_attn.'),            # transformers -> published
    *MIXTRAL_EXPERT_RENAMES,                                               # published -> transformers
]


class KimiLinearForCausalLM(CausalLM):
    """Kimi-Linear causal LM in the engine's layers, from a ``transformers``
    ``KimiLinearConfig``; a config it cannot run raises ``ValueError`` (:func:`check_config`)."""
    # KDA, KDA, MLA, KDA; a dense first MLP, then grouped sigmoid-routed MoE
    tiny_config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                       layer_types=['linear_attention', 'linear_attention', 'full_attention', 'linear_attention'],
                       mlp_layer_types=['dense', 'sparse', 'sparse', 'sparse'],
                       intermediate_size=128, moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                       n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=32,
                       q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=2,
                       linear_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=32768,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)


    model_class = KimiLinearModel
    # every config field transformers reads, and what the engine does with it (.config_audit);
    # Kimi's MLA has no rotary embedding, so no rope field is read
    config_fields = {
        **{k: v for k, v in COMMON_FIELDS.items() if k not in ('head_dim', 'rope_parameters', 'max_position_embeddings')},
        # MLA up-projects a K and V per query head whatever this says; transformers' repeat_kv only
        # runs when it equals num_attention_heads (the engine does not need that)
        'num_key_value_heads': INERT,
        'mlp_layer_types': CHECKED,               # 'dense' / 'sparse' per layer
        **KDA_FIELDS,
        **MLA_FIELDS,
        **GROUP_LIMITED_MOE_FIELDS,
    }
    rotary_class = None
    check_config = staticmethod(check_config)
    # KDA by head, MLA by query head with the latent replicated; MoE and dense MLPs replicated
    parallel_plan = ParallelPlan(layers=lambda config: config.layer_types,
                                 blocks={LINEAR: (Block(kda_split(a_log_dim=2), 'self_attn'),),
                                         FULL: (Block(mla_split(), 'self_attn'),)})

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a KDA :class:`StateSpec` (``q_conv``, ``k_conv``, ``v_conv``
        ``[H, d, kernel - 1]`` in ``dtype``, ``recurrent [H, d, d]`` float32, all split by head)
        or an MLA :class:`PagedSpec` (``latent [kv_lora_rank + qk_rope_head_dim]`` per token,
        the same on every rank: ``tp_split=None``).

        Raises:
            ValueError: see :func:`check_config`.
        """
        return kda_mla_cache_specs(config, dtype)

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return apply_renames(name, _RENAMES)

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """transformers' stacked q | k | v convs, and the experts."""
        return load_kda_tensor(loader, name, tensor) or load_expert_tensor(loader, name, tensor)
