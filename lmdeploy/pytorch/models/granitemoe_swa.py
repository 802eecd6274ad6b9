"""IBM Granite MoE with sliding-window attention (``transformers`` model type ``granitemoe_swa``):
every layer is attention (no recurrent state), each either global or sliding-window, with a
learnable per-head attention sink, then a softmax-routed MoE and an optional shared MLP::

    h = embed(ids) * embedding_multiplier
    layer i:  h = h + residual_multiplier * attn_i(RMSNorm(h))
              h = h + residual_multiplier * (moe(RMSNorm(h)) [+ shared_mlp(RMSNorm(h))])
      attn_i = GQA over paged K/V, softmax scale attention_multiplier, one sink logit per head,
               keys: every earlier position ('full_attention') or the last sliding_window
               positions, the query's own included ('sliding_attention');
               RoPE with base layer_rope_theta[i] (0: no positions, "NoPE")
      moe    = top-k of the router logits, softmax over those k (GraniteMoE)
    logits = lm_head(RMSNorm(h)) / logits_scaling

Sliding-window layers declare a :class:`~lmdeploy.pytorch.cache_specs.SlidingWindowSpec` (the
same K / V per token as a global layer, with its window); the attention reads only the window's
blocks (:mod:`~lmdeploy.pytorch.kernels.window_attention`). Weight names: ``transformers``'
(``block_sparse_moe.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj``, ``router.weight``,
``self_attn.sinks``); Granite-4.0-H's published spelling of the experts
(``input_linear`` / ``output_linear``, ``router.layer``) loads too.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..cache_specs import LayerCacheSpec
from ..kernels import get_kernel
from ..model_inputs import StepContext
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .base import CausalLM
from .blocks.decoder import DecoderStack, RotaryTables, SharedMLPDecoderLayer, mixer_table_ctx
from .blocks.gqa import RotaryGQA, gqa_split
from .blocks.moe import GRANITE_MOE_RENAMES, GRANITE_SHARED_MLP_SPLIT, GraniteMoE
from .blocks.window_attention import layer_windows, window_cache_specs
from .layers import RotaryEmbedding, SwiGLUMLP, apply_renames
from .parallel_plan import Block, ParallelPlan

__all__ = ['GraniteMoeSWAForCausalLM', 'GraniteSWAAttention', 'check_config']

def _thetas(config) -> list[float]:
    thetas = getattr(config, 'layer_rope_theta', None)
    if thetas is None:
        return [float(config.rope_parameters['rope_theta'])] * config.num_hidden_layers
    if len(thetas) != config.num_hidden_layers or any(not isinstance(t, (int, float)) or t < 0 for t in thetas):
        raise ValueError(f'layer_rope_theta must be one base >= 0 (0: no RoPE) per each of the '
                         f'{config.num_hidden_layers} layers, got {thetas}')
    return [float(t) for t in thetas]


def _rotary(config, theta: float) -> RotaryEmbedding:
    c = copy.deepcopy(config)
    c.rope_parameters = {**config.rope_parameters, 'rope_theta': theta}
    return RotaryEmbedding(c)


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types`` / ``sliding_window``
            (:func:`~.blocks.window_attention.layer_windows`),
            ``layer_rope_theta`` (one base >= 0 per layer; the ``rope_parameters`` of :mod:`.rope`
            for the nonzero ones), ``hidden_act`` (``'silu'`` only), ``num_local_experts`` (>= 1),
            ``num_experts_per_tok`` (``1..num_local_experts``), ``shared_intermediate_size`` (>= 0).
    """
    layer_windows(config)
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    for theta in sorted({t for t in _thetas(config) if t}):
        _rotary(config, theta)          # raises for rope parameters it cannot reproduce
    E, k = config.num_local_experts, config.num_experts_per_tok
    if not isinstance(E, int) or E < 1:
        raise ValueError(f'num_local_experts must be >= 1, got {E!r}')
    if not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f'num_experts_per_tok ({k}) must be in [1, num_local_experts = {E}]')
    if config.shared_intermediate_size < 0:
        raise ValueError(f'shared_intermediate_size must be >= 0, got {config.shared_intermediate_size}')


class GraniteSWAAttention(RotaryGQA):
    """:class:`~.blocks.gqa.RotaryGQA` (RoPE or none) with softmax scale ``attention_multiplier``,
    one learnable sink logit per query head, and a sliding window when ``window`` is set.

    Args:
        config: HF ``GraniteMoeSWAConfig`` (this rank's head counts under TP).
        layer_idx: index into ``StepContext.kv_caches``.
        window: keys per query (itself included), None for a global layer.
    """

    def __init__(self, config, layer_idx: int, window: int | None):
        super().__init__(config, layer_idx, scale=config.attention_multiplier)
        self.window = window
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    plain_attend = False        # the window and the sinks: the fused decode step computes neither

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """As :meth:`RotaryGQA.attend`, over the window's keys with the sinks."""
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        return get_kernel('paged_window_attention', q.device)(q, k, v, k_cache, v_cache, ctx, self.scale, self.window,
                                                              self.sinks)


class GraniteSWADecoderLayer(SharedMLPDecoderLayer):
    """Pre-norm layer with µP residual scaling: attention (its RoPE base's table, or none), then
    MoE (+ shared MLP when sized)."""

    def __init__(self, config, layer_idx: int, window: int | None, theta: float):
        shared = SwiGLUMLP(config.hidden_size, config.shared_intermediate_size) \
            if config.shared_intermediate_size > 0 else None
        super().__init__(config.hidden_size, config.rms_norm_eps, GraniteSWAAttention(config, layer_idx, window),
                         GraniteMoE(config), call=mixer_table_ctx(theta),
                         names=('self_attn', 'block_sparse_moe', 'input_layernorm', 'post_attention_layernorm'),
                         residual_multiplier=float(config.residual_multiplier), shared=('shared_mlp', shared))


class GraniteMoeSWAModel(DecoderStack):
    """Scaled embedding, decoder layers, final norm; one rotary table per nonzero RoPE base."""

    def __init__(self, config):
        thetas = _thetas(config)
        super().__init__(config, (GraniteSWADecoderLayer(config, i, w, t)
                                  for i, (w, t) in enumerate(zip(layer_windows(config), thetas))),
                         rotary=RotaryTables({t: _rotary(config, t) for t in sorted(set(thetas)) if t}))
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` times ``embedding_multiplier``."""
        return super().embed(input_ids) * self.embedding_multiplier


class GraniteMoeSWAForCausalLM(CausalLM):
    """``granitemoe_swa`` causal LM in the engine's layers, from a ``transformers``
    ``GraniteMoeSWAConfig``; a config it cannot run raises ``ValueError`` (:func:`check_config`)."""
    # global, sliding, sliding, global; MoE + shared MLP; per-layer RoPE bases. A 24-token window (off the
    # 16-token blocks and the 32-token prefill chunks, so chunk ends fall inside windows), a NoPE layer and
    # two RoPE bases, µP multipliers off 1, attention sinks
    tiny_config = dict(hidden_size=64, num_hidden_layers=4,
                       layer_types=['full_attention', 'sliding_attention', 'sliding_attention', 'full_attention'],
                       sliding_window=24, layer_rope_theta=[10000.0, 0, 10000.0, 500000.0], num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=64, num_local_experts=4,
                       num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                       attention_multiplier=0.1, logits_scaling=3.0,
                       rope_parameters=dict(rope_type='default', rope_theta=10000.0), max_position_embeddings=32768,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)
    tiny_top_level_rope_theta = True


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'sliding_window': IMPLEMENTED,            # the window of 'sliding_attention' layers
        'layer_rope_theta': CHECKED,              # per-layer RoPE base, 0: none; one base >= 0 per layer
        'embedding_multiplier': IMPLEMENTED,
        'residual_multiplier': IMPLEMENTED,
        'attention_multiplier': IMPLEMENTED,      # the softmax scale
        'logits_scaling': IMPLEMENTED,            # logits are divided by it
        'num_local_experts': CHECKED,             # >= 1
        'num_experts_per_tok': CHECKED,           # in [1, num_local_experts]
        'shared_intermediate_size': IMPLEMENTED,  # 0: no shared MLP
        'output_router_logits': INERT,            # the training loss only
        'router_aux_loss_coef': INERT,
    }
    rotary_class = None  # the model builds one rotary table per RoPE base itself (checked by check_config)
    check_config = staticmethod(check_config)
    # attention by head (sinks with their query heads), shared MLP by rows, experts replicated
    parallel_plan = ParallelPlan(layers=lambda config: [('attention', 'mlp')] * config.num_hidden_layers,
                                 blocks={'attention': (Block(gqa_split(shared_kv=False, sinks=True), 'self_attn'),),
                                         'mlp': (Block(GRANITE_SHARED_MLP_SPLIT, 'shared_mlp'),)})

    model_class = GraniteMoeSWAModel

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a :class:`FullAttentionSpec` (global) or a :class:`SlidingWindowSpec` with
        the config's ``sliding_window`` (KV heads x head_dim per token, both).

        Raises:
            ValueError: see :func:`check_config`.
        """
        return window_cache_specs(config, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, vocab_size]`` float32 logits (divided by ``logits_scaling``)."""
        return self.lm_head(hidden).float() / float(self.config.logits_scaling)

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return apply_renames(name, GRANITE_MOE_RENAMES)
