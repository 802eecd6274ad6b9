"""MiniMax-01 (``transformers`` model type ``minimax``): lightning-attention layers (linear
attention with a fixed per-head exponential decay) interleaved with softmax attention layers, a
softmax-routed MoE after each.

``config.layer_types`` picks each layer's token mixer (by default every other layer, from layer
1, is lightning attention)::

    layer i:  h = norm_1(x);  h = a_attn * h + b_attn * mixer(h)
              g = norm_2(h);  out = a_mlp * g + b_mlp * moe(g)
      mixer = lightning attention ('linear_attention': one float32 state [H, d, d] per sequence,
                                   in a state slot; see blocks/lightning.py)
            | grouped-query attention with RoPE on whole heads ('full_attention': K and V per
                                   token, in paged blocks)
      moe   = softmax over all experts in float32, top k renormalised to sum 1 (computed as a
              softmax over the k largest logits: the same weights), SwiGLU experts

The residual branches take the *normalised* input (the ``a`` factors multiply ``norm(x)``, not
``x``), with ``a`` / ``b`` = ``linear_attn_alpha_factor`` / ``_beta_factor`` or
``full_attn_alpha_factor`` / ``_beta_factor`` by layer kind and ``mlp_alpha_factor`` /
``mlp_beta_factor``. Tensor parallelism splits both mixers by head (``lightning_split``, ``gqa_split``).

Weight names: the published checkpoint's (``block_sparse_moe.gate``,
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down)) and transformers'
in-memory ones (``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``, and the decay
tables it saves as buffers, which are skipped) both load.
"""
from __future__ import annotations

import re

import torch

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.decoder import DecoderLayer, UniformStack, mixer_ctx, mixer_rotary_ctx
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import RotaryGQA, gqa_split
from .blocks.lightning import LightningAttention, lightning_split, lightning_state_spec
from .blocks.moe import MIXTRAL_EXPERT_RENAMES, GraniteMoE, load_expert_tensor
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT, MOE_FIELDS, check_layer_types
from .layers import RotaryEmbedding, apply_renames
from .parallel_plan import Block, ParallelPlan

__all__ = ['MiniMaxForCausalLM', 'check_config']

LINEAR, FULL = 'linear_attention', 'full_attention'


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``hidden_act``, ``sliding_window``,
            ``num_experts_per_tok``).
    """
    check_layer_types(config, (LINEAR, FULL))
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    if config.sliding_window is not None:
        raise ValueError(f'sliding_window must be None (every attention layer sees the whole sequence), '
                         f'got {config.sliding_window!r}')
    if not 1 <= config.num_experts_per_tok <= config.num_local_experts:
        raise ValueError(f'num_experts_per_tok ({config.num_experts_per_tok}) must be in [1, num_local_experts '
                         f'({config.num_local_experts})]')


#: grouped-query attention over the paged KV cache, RoPE on whole heads, scale ``head_dim ** -0.5``; no biases
MiniMaxAttention = RotaryGQA


class MiniMaxDecoderLayer(DecoderLayer):
    """One layer (module docstring): lightning or softmax attention, then the MoE, each branch
    mixed with its normalised input by the config's alpha / beta factors."""

    def __init__(self, config, layer_idx: int):
        if config.layer_types[layer_idx] == LINEAR:
            mixer, call = LightningAttention(config, layer_idx), mixer_ctx
            alpha_beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
        else:
            mixer, call = MiniMaxAttention(config, layer_idx), mixer_rotary_ctx
            alpha_beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
        super().__init__(config.hidden_size, config.rms_norm_eps, mixer, GraniteMoE(config), call=call)
        self.attn_alpha, self.attn_beta = alpha_beta
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)`` ``[T, head_dim]``. The
        residuals take the normalised input, scaled by alpha (module docstring)."""
        normed = self.norm_1(hidden)
        mixed = self._call(self.mixer, normed, rotary, ctx)
        hidden = self.norm_2(normed * self.attn_alpha + mixed * self.attn_beta)
        return hidden * self.mlp_alpha + self.mlp_block(hidden) * self.mlp_beta


class MiniMaxModel(UniformStack):
    """Embedding, decoder layers, final norm; the rotary table of the softmax-attention layers."""
    layer_class = MiniMaxDecoderLayer
    rotary_class = RotaryEmbedding


_RENAMES = [
    *MIXTRAL_EXPERT_RENAMES,                                               # published -> transformers
    (re.compile(r'\.mlp\.gate\.weight$'), '.mlp.router.weight'),           # transformers -> ours
]

_DECAY_TABLES = re.compile(r'\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$')


class MiniMaxForCausalLM(CausalLM):
    """MiniMax-01 causal LM in the engine's layers, from a ``transformers``
    ``MiniMaxConfig``; a config it cannot run raises ``ValueError`` (:func:`check_config`)."""
    # lightning, softmax, lightning, lightning; residual factors off 1 so their placement is tested
    tiny_config = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                       layer_types=['linear_attention', 'full_attention', 'linear_attention', 'linear_attention'],
                       intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                       full_attn_alpha_factor=1.2, full_attn_beta_factor=0.9, linear_attn_alpha_factor=0.8,
                       linear_attn_beta_factor=1.1, mlp_alpha_factor=1.3, mlp_beta_factor=0.7,
                       max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False,
                       rms_norm_eps=1e-5)

    model_class = MiniMaxModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **{k: v for k, v in MOE_FIELDS.items() if k != 'shared_expert_intermediate_size'},
        'num_local_experts': IMPLEMENTED,
        'num_experts_per_tok': CHECKED,           # in [1, num_local_experts]
        'router_jitter_noise': INERT,             # training only
        'sliding_window': CHECKED,                # None only
        'block_size': INERT,                      # transformers' prefill chunk: the same values up to rounding
        'full_attn_alpha_factor': IMPLEMENTED,
        'full_attn_beta_factor': IMPLEMENTED,
        'linear_attn_alpha_factor': IMPLEMENTED,
        'linear_attn_beta_factor': IMPLEMENTED,
        'mlp_alpha_factor': IMPLEMENTED,
        'mlp_beta_factor': IMPLEMENTED,
    }
    check_config = staticmethod(check_config)
    # both mixers by head (KV heads: the TP size must divide them), the lightning norm summed over
    # the ranks; MoE replicated
    parallel_plan = ParallelPlan(layers=lambda config: config.layer_types,
                                 blocks={LINEAR: (Block(lightning_split, 'self_attn'),),
                                         FULL: (Block(gqa_split(shared_kv=False), 'self_attn'),)})

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a lightning :class:`StateSpec` (``recurrent [H, d, d]`` float32) or a
        :class:`FullAttentionSpec` (KV heads x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        state = lightning_state_spec(config)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [state if t == LINEAR else full for t in config.layer_types]

    def rename_weight(self, name: str) -> str | None:
        """Published or transformers names (see the module docstring) → ours; None for the decay
        tables transformers saves with its lightning layers (``slope_rate``, ``query_decay``,
        ``key_decay``, ``diagonal_decay``: functions of the config, recomputed here)."""
        if _DECAY_TABLES.search(name):
            return None
        return apply_renames(name, _RENAMES)

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """The experts, one tensor per expert."""
        return load_expert_tensor(loader, name, tensor)
