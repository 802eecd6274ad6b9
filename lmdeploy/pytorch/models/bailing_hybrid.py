"""Ling 3 (``transformers`` model type ``bailing_hybrid``): KDA recurrent layers interleaved with
gated MLA full-attention layers, a DeepSeek-style MoE (SwiGLU clipped per layer) after each.

``config.layer_types`` picks each layer's token mixer (by default the last layer of every
``layer_group_size`` is MLA), ``config.mlp_layer_types`` its MLP (dense for the first
``first_k_dense_replace``)::

    layer i:  x + mixer(RMSNorm(x))  ->  h + mlp(RMSNorm(h))
      mixer = Kimi Delta Attention ('linear_attention': full-rank f_proj / g_proj gates,
                                    conv + recurrent states in a slot)
            | MLA                  ('full_attention': interleaved rotary on the rope part, a
                                    sigmoid output gate per head; one latent row per token)
      mlp   = sigmoid-routed experts * routed_scaling_factor + shared experts ('sparse'),
              or a dense SwiGLU ('dense'); routed / shared SwiGLUs clip at the layer's
              expert_swiglu_limit_list / share_expert_swiglu_limit_list entry (0: no clip):
              min(silu(gate), L) * clamp(up, -L, L)

The checkpoint's NextN multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``,
``num_nextn_predict_layers`` of them) are not loaded: speculative decoding with ``mtp`` is
refused for this family (``speculative_config.method`` names the families that have one).
Tensor parallelism splits KDA and MLA by head (``kda_split``, ``mla_split``).

Weight names: the published checkpoint's (``model.word_embeddings``, ``layers.{i}.attention.*``
with ``dense`` for the output projection, ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, ``f_proj``
/ ``dt_bias`` / ``A_log`` directly under ``attention``, ``mlp.gate.expert_bias``, one tensor per
expert) and transformers' in-memory ones (``self_attn.conv1d`` stacked, ``self_attn.forget_gate.*``,
``mlp.experts.gate_up_proj``) both load.
"""
from __future__ import annotations

import re

import torch

from ..cache_specs import LayerCacheSpec
from .base import CausalLM
from .blocks.decoder import DecoderLayer, UniformStack, mixer_ctx
from .blocks.kda import KimiDeltaAttention, kda_mla_cache_specs, kda_split, load_kda_tensor
from .blocks.mla import LatentAttention, mla_split
from .blocks.moe import LimitedGroupMoE, LimitedSwiGLUMLP, check_group_limited, clipped_swiglu, load_expert_tensor
from .config_audit import (CHECKED, COMMON_FIELDS, GROUP_LIMITED_MOE_FIELDS, IMPLEMENTED, INERT, MLA_FIELDS,
                           check_layer_types)
from .layers import RotaryEmbedding, apply_renames
from .parallel_plan import Block, ParallelPlan

__all__ = ['BailingHybridForCausalLM', 'check_config']

LINEAR, FULL = 'linear_attention', 'full_attention'


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``mlp_layer_types``, ``hidden_act``,
            ``n_group`` / ``topk_group``, ``expert_swiglu_limit_list`` /
            ``share_expert_swiglu_limit_list``).
    """
    n = config.num_hidden_layers
    check_layer_types(config, (LINEAR, FULL))
    mlp = check_layer_types(config, ('dense', 'sparse'), 'mlp_layer_types')
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    for field, limits in (('expert_swiglu_limit_list', config.swiglu_limits),
                          ('share_expert_swiglu_limit_list', config.swiglu_limits_shared)):
        if len(limits) != n or any(limit < 0 for limit in limits):
            raise ValueError(f'{field} must hold one limit >= 0 per layer ({n}), got {list(limits)}')
    if 'sparse' in mlp:
        check_group_limited(config)


def _mla_call(mixer: LatentAttention, normed: torch.Tensor, rotary, ctx) -> torch.Tensor:
    """Gated MLA takes the step's ``(cos, sin)`` after the context."""
    return mixer(normed, ctx, rotary)


class BailingHybridDecoderLayer(DecoderLayer):
    """Pre-norm layer: KDA or gated MLA (``layer_types``), then MoE or dense MLP (``mlp_layer_types``);
    routed / shared SwiGLUs clip at the layer's limits (:func:`~.blocks.moe.clipped_swiglu`, 0: no clip)."""

    def __init__(self, config, layer_idx: int):
        if config.layer_types[layer_idx] == LINEAR:
            mixer = KimiDeltaAttention(config, layer_idx, config.kda_lower_bound if config.kda_safe_gate else None,
                                       low_rank_gates=False)
            call = mixer_ctx
        else:
            from transformers.modeling_rope_utils import yarn_apply_mscale
            qk = config.qk_nope_head_dim + config.qk_rope_head_dim
            scale = yarn_apply_mscale(config.rope_parameters, qk ** -0.5)     # YaRN's mscale_all_dim, if any
            mixer, call = LatentAttention(config, layer_idx, rotary=True, output_gate=True, scale=scale), _mla_call
        if config.mlp_layer_types[layer_idx] == 'sparse':
            routed = config.swiglu_limits[layer_idx]     # 0: the unclipped fused experts
            mlp = LimitedGroupMoE(config, clipped_swiglu, routed or None, config.swiglu_limits_shared[layer_idx])
        else:   # transformers' dense MLP has no layer index, so it never clips
            mlp = LimitedSwiGLUMLP(config.hidden_size, config.intermediate_size, 0, clipped_swiglu)
        super().__init__(config.hidden_size, config.rms_norm_eps, mixer, mlp, call=call)


class BailingHybridModel(UniformStack):
    """Embedding, decoder layers, final norm; the rotary table of the MLA layers (transformers'
    config sets ``head_dim = qk_rope_head_dim``: the table covers the rope part)."""
    layer_class = BailingHybridDecoderLayer
    rotary_class = RotaryEmbedding


_RENAMES = [
    (re.compile(r'^model\.word_embeddings\.'), 'model.embed_tokens.'),      # published -> ours
    (re.compile(r'\.attention\.'), '.self_attn.'),
    (re.compile(r'\.self_attn\.dense\.'), '.self_attn.o_proj.'),
    (re.compile(r'\.mlp\.gate\.expert_bias$'), '.mlp.gate.e_score_correction_bias'),
    (re.compile(r'\.self_attn\.forget_gate\.'), '.self_attn.'),             # transformers -> ours
]
_LAYER = re.compile(r'^model\.layers\.(\d+)\.')


def _our_name(name: str) -> str:
    """A published or transformers checkpoint name in ours (before the stacked conv is split)."""
    return apply_renames(name, _RENAMES)


class BailingHybridForCausalLM(CausalLM):
    """Ling 3 causal LM in the engine's layers (no MTP head), from a ``transformers``
    ``BailingHybridConfig``; a config it cannot run raises ``ValueError`` (:func:`check_config`)."""
    # KDA, MLA, KDA, MLA; two dense MLPs, then grouped sigmoid-routed MoE; clipping on layer 2's
    # routed experts and layer 3's shared experts; YaRN-free default rope
    tiny_config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                       layer_group_size=2, first_k_dense_replace=1, head_dim=16, intermediate_size=128,
                       moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                       n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=None,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, short_conv_kernel_size=4,
                       expert_swiglu_limit_list=[0, 0, 0.05, 0], share_expert_swiglu_limit_list=[0, 0, 0, 0.05],
                       num_mtp_layers=0, max_position_embeddings=32768, rope_theta=10000.0,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)

    tiny_top_level_rope_theta = True

    @staticmethod
    def tiny_config_json(config_dict: dict) -> None:
        """The published spelling: ``head_dim`` is the KDA head size (transformers derives
        ``linear_head_dim`` from it and then sets ``head_dim = qk_rope_head_dim``); the derived
        ``linear_*`` and ``qk_head_dim`` fields are not written."""
        config_dict['head_dim'] = config_dict.pop('linear_head_dim')
        for derived in ('linear_num_heads', 'linear_conv_kernel_dim', 'qk_head_dim'):
            config_dict.pop(derived)

    model_class = BailingHybridModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        # MLA up-projects a K and V per query head whatever this says
        'num_key_value_heads': INERT,
        'mlp_layer_types': CHECKED,               # 'dense' / 'sparse' per layer
        'linear_conv_kernel_dim': IMPLEMENTED,    # short_conv_kernel_size
        'linear_head_dim': IMPLEMENTED,           # the config's head_dim before it becomes qk_rope_head_dim
        'linear_num_heads': IMPLEMENTED,          # num_attention_heads
        'kda_safe_gate': IMPLEMENTED,
        'kda_lower_bound': IMPLEMENTED,
        **MLA_FIELDS,
        **GROUP_LIMITED_MOE_FIELDS,
        'swiglu_limits': CHECKED,                 # expert_swiglu_limit_list: >= 0 per layer
        'swiglu_limits_shared': CHECKED,          # share_expert_swiglu_limit_list
        'limit_after_act': IMPLEMENTED,           # a constant True property: clip after silu
        'num_mtp_layers': INERT,                  # the NextN layers past num_hidden_layers are not loaded
    }
    check_config = staticmethod(check_config)
    # KDA by head (full-rank gates, A_log [H]), MLA by query head with its output gate and the
    # latent replicated; MoE and dense MLPs replicated. The published checkpoint spells the
    # mixer ``attention`` and its output projection ``dense``; the NextN layers past
    # num_hidden_layers have no kinds, so nothing of theirs splits (they are not loaded)
    parallel_plan = ParallelPlan(
        layers=lambda config: config.layer_types,
        blocks={LINEAR: (Block(kda_split(a_log_dim=0, full_rank_gates=True, o=('o_proj', 'dense')),
                               ('self_attn', 'attention')),),
                FULL: (Block(mla_split(output_gate=True, o=('o_proj', 'dense')), ('self_attn', 'attention')),)},
        renames=(('model.word_embeddings.', 'model.embed_tokens.'),))

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a KDA :class:`StateSpec` (``q_conv``, ``k_conv``, ``v_conv``
        ``[H, d, kernel - 1]`` in ``dtype``, ``recurrent [H, d, d]`` float32) or an MLA
        :class:`PagedSpec` (``latent [kv_lora_rank + qk_rope_head_dim]`` per token, the rope
        part stored rotated).

        Raises:
            ValueError: see :func:`check_config`.
        """
        return kda_mla_cache_specs(config, dtype)

    def rename_weight(self, name: str) -> str | None:
        """Published or transformers names (see the module docstring) → ours; None for the
        NextN MTP layers past ``num_hidden_layers``."""
        name = _our_name(name)
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return name

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """transformers' stacked q | k | v convs, ``A_log [H]`` (ours ``[1, 1, H, 1]``), the experts."""
        return load_kda_tensor(loader, name, tensor) or load_expert_tensor(loader, name, tensor)
