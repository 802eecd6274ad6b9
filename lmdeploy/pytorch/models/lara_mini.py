"""Lara-4-Mini (``transformers`` model type ``lara_mini``): Gated DeltaNet layers mixed with
sliding-window and global attention layers, every layer followed by a sparse MoE with an
ungated shared expert.

``config.layer_types`` picks each layer's token mixer (the released pattern repeats
linear, sliding, linear, full, sliding)::

    h = embed(ids)
    layer i:  h = h + mixer(RMSNorm(h))
              h = h + moe(RMSNorm(h))
      mixer = Gated DeltaNet   ('linear_attention':  Qwen3.5's flat q|k|v, z, b, a projections;
                                                      conv + float32 delta-rule state in a slot)
            | SWA              ('sliding_attention': q/k RMSNorm, RoPE, the last sliding_window
                                                      positions, the query's own included)
            | global attention ('full_attention':    q/k RMSNorm, no positional encoding, every
                                                      earlier position)
      moe   = top-k of softmax(router(h)) in float32 (renormalised when norm_topk_prob) over the
              experts, plus the shared expert added in full (no sigmoid gate, unlike Qwen3-Next)
    logits = lm_head(RMSNorm(h))

Every RMSNorm stores its weight as is (``x̂ * w``, not Qwen3-Next's ``x̂ * (1 + w)``).
Caches: the linear layers a :class:`LinearAttentionSpec` state slot, the sliding layers a
:class:`SlidingWindowSpec`, the global ones a :class:`FullAttentionSpec` (so a prefix keeps
every block: the global layers read all of them).

Weight names: the published checkpoints' (``translated/Lara-4-Mini*``: the four Gated DeltaNet
input projections fused into one ``linear_attn.in_proj`` with rows ``[q|k|v|z|b|a]``, the gated
norm named ``linear_attn.out_norm``) and ``transformers``' in-memory ones (``in_proj_qkv`` /
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``norm``); fused experts
(``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj``) or one tensor per expert.
"""
from __future__ import annotations

import torch
from torch import nn

from ..cache_specs import LayerCacheSpec
from .base import CausalLM
from .blocks.decoder import DecoderLayer, UniformStack, mixer_ctx, mixer_nope_ctx, mixer_rotary_ctx
from .blocks.gated_delta_net import MOE, FlatGatedDeltaNet, gdn_split, gdn_state_spec, hybrid_layer_kinds
from .blocks.gqa import gqa_split
from .blocks.moe import FusedExperts, load_expert_tensor
from .blocks.window_attention import FULL, SLIDING, WindowAttention, layer_windows, window_cache_specs
from .config_audit import CHECKED, COMMON_FIELDS, GATED_DELTANET_FIELDS, IMPLEMENTED, MOE_FIELDS
from .layers import Linear, RotaryEmbedding, SwiGLUMLP
from .parallel_plan import Block, ParallelPlan

__all__ = ['LaraMiniForCausalLM', 'check_config']

LINEAR = 'linear_attention'


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types`` / ``sliding_window``
            (:func:`~.blocks.window_attention.layer_windows`),
            ``linear_num_value_heads`` (a multiple of ``linear_num_key_heads``), ``hidden_act``
            (``'silu'`` only), ``num_experts`` (>= 1), ``num_experts_per_tok``
            (``1..num_experts``); rope fields: see :mod:`.rope`.
    """
    layer_windows(config, LINEAR)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f'linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of '
                         f'linear_num_key_heads ({config.linear_num_key_heads})')
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    E, k = config.num_experts, config.num_experts_per_tok
    if not isinstance(E, int) or E < 1:
        raise ValueError(f'num_experts must be >= 1, got {E!r}')
    if not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f'num_experts_per_tok ({k}) must be in [1, num_experts = {E}]')


#: Gated DeltaNet with Qwen3.5's flat projections packed as ``in_proj`` rows ``[q | k | v | z | b | a]``:
#: exactly the published fused ``linear_attn.in_proj.weight``, which loads whole
LaraGatedDeltaNet = FlatGatedDeltaNet


class LaraMoE(nn.Module):
    """Top-k softmax-routed experts (router in float32, renormalised when ``norm_topk_prob``) plus
    the shared expert added in full.

    Args:
        config: reads ``hidden_size``, ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``.
    """

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        # the reference routes in float32 whatever the model dtype
        probs = torch.softmax(torch.nn.functional.linear(x.float(), self.gate.weight.float()), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, index, weights.to(x.dtype)) + self.shared_expert(x)


class LaraDecoderLayer(DecoderLayer):
    """Pre-norm layer: the mixer ``layer_types[layer_idx]`` picks (Gated DeltaNet, or
    :class:`~.blocks.window_attention.WindowAttention` with rotary on the sliding layers and no
    positions on the global ones), then the MoE, each with a residual."""

    def __init__(self, config, layer_idx: int):
        kind = config.layer_types[layer_idx]
        if kind == LINEAR:
            mixer, call, name = LaraGatedDeltaNet(config, layer_idx), mixer_ctx, 'linear_attn'
        else:
            window = layer_windows(config, LINEAR)[layer_idx]
            mixer, name = WindowAttention(config, layer_idx, window), 'self_attn'
            call = mixer_rotary_ctx if kind == SLIDING else mixer_nope_ctx
        super().__init__(config.hidden_size, config.rms_norm_eps, mixer, LaraMoE(config), call=call,
                         names=(name, 'mlp', 'input_layernorm', 'post_attention_layernorm'))


class LaraMiniModel(UniformStack):
    """Embedding, decoder layers, final norm; one rotary table (for the sliding layers)."""
    layer_class = LaraDecoderLayer
    rotary_class = RotaryEmbedding


_ATTENTION = Block(gqa_split(), 'self_attn')     # the sliding and the global layers alike


class LaraMiniForCausalLM(CausalLM):
    """``lara_mini`` causal LM in the engine's layers, from a ``transformers``
    ``LaraMiniConfig``; a config it cannot run raises ``ValueError`` (:func:`check_config`)."""
    # the released period-5 pattern (linear, sliding, linear, full, sliding): a 40-token window, off
    # the 16-token blocks and the 32-token prefill chunks, so chunk and block ends fall inside windows;
    # two value heads per key head; MoE with a shared expert
    tiny_config = dict(hidden_size=64, num_hidden_layers=5,
                       layer_types=[LINEAR, SLIDING, LINEAR, FULL, SLIDING], sliding_window=40,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, norm_topk_prob=True, rope_theta=10000.0,
                       max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    # the published experts are fused, as transformers holds them
    tiny_expert_prefixes = ()

    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **GATED_DELTANET_FIELDS,
        'sliding_window': IMPLEMENTED,            # the window of 'sliding_attention' layers
        **MOE_FIELDS,
        'num_experts': CHECKED,                   # >= 1
        'num_experts_per_tok': CHECKED,           # in [1, num_experts]
        'norm_topk_prob': IMPLEMENTED,
    }
    check_config = staticmethod(check_config)
    # attention by head, Gated DeltaNet by key head (the published fused in_proj or transformers' flat
    # in_proj_qkv | z | b | a); the MoE (router, experts, shared expert) replicated
    parallel_plan = ParallelPlan(
        layers=lambda config: hybrid_layer_kinds(config, dense=False),
        blocks={LINEAR: (Block(gdn_split, 'linear_attn'),), SLIDING: (_ATTENTION,), FULL: (_ATTENTION,), MOE: ()})

    model_class = LaraMiniModel

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a :class:`LinearAttentionSpec` (conv ``[conv_dim, kernel-1]`` in ``dtype``,
        float32 recurrent ``[Hv, dk, dv]``), a :class:`SlidingWindowSpec` with ``sliding_window``
        or a :class:`FullAttentionSpec` (KV heads x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        return window_cache_specs(config, dtype, gdn_state_spec(config, dtype), LINEAR)

    def rename_weight(self, name: str) -> str:
        """The published gated-norm name ``linear_attn.out_norm`` → ``linear_attn.norm``."""
        return name.replace('.linear_attn.out_norm.', '.linear_attn.norm.')

    load_tensor = staticmethod(load_expert_tensor)
