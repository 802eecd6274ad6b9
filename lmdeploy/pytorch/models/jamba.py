"""AI21 Jamba (``transformers`` model type ``jamba``: Jamba-v0.1, Jamba-1.5 / 1.6 Mini and
Large): Mamba-1 layers with an attention layer every ``attn_layer_period`` layers, and a
softmax-routed MoE in place of the MLP every ``expert_layer_period`` layers::

    h = embed(ids)
    layer i:  h = h + mixer(RMSNorm(h))
              h = h + ffn(RMSNorm(h))
      mixer = attention if i % attn_layer_period == attn_layer_offset
                        (GQA, K/V in paged blocks, no positional encoding at all)
            | Mamba-1   (conv + SSM states in a slot, :class:`~.blocks.mamba1.Mamba1Mixer` with weighted
                        RMS norms of dt_low, B and C, eps = rms_norm_eps)
      ffn   = MoE  if num_experts > 1 and i % expert_layer_period == expert_layer_offset
                        (softmax over all experts in float32, the top k kept un-renormalised,
                        SwiGLU experts of intermediate_size)
            | SwiGLU MLP of intermediate_size
    logits = lm_head(RMSNorm(h))

Weight names: the published checkpoints' (``model.layers.{i}.mamba.*``, ``.self_attn.*``,
``.feed_forward.router.weight``, ``.feed_forward.experts.{e}.{gate,up,down}_proj.weight``,
``.feed_forward.{gate,up,down}_proj.weight``, ``input_layernorm``, ``pre_ff_layernorm``,
``model.final_layernorm``); ``transformers``' fused in-memory experts
(``feed_forward.experts.gate_up_proj`` / ``down_proj``) load too.
"""
from __future__ import annotations

import torch

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.decoder import DecoderLayer, DecoderStack
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import RotaryGQA, gqa_split
from .blocks.mamba1 import Mamba1Dims, Mamba1Mixer, mamba1_split, mamba1_state_spec
from .blocks.moe import GraniteMoE, load_expert_tensor
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import SwiGLUMLP, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['JambaForCausalLM', 'check_config', 'layer_kinds']

MAMBA, ATTENTION = 'mamba', 'attention'


def layer_kinds(config) -> list[str]:
    """Each layer's mixer, ``'mamba'`` or ``'attention'`` (``attn_layer_period`` / ``_offset``)."""
    return [ATTENTION if i % config.attn_layer_period == config.attn_layer_offset else MAMBA
            for i in range(config.num_hidden_layers)]


def expert_layers(config) -> list[bool]:
    """Whether each layer's feed-forward is the MoE (``expert_layer_period`` / ``_offset``,
    ``num_experts > 1``)."""
    return [config.num_experts > 1 and i % config.expert_layer_period == config.expert_layer_offset
            for i in range(config.num_hidden_layers)]


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``hidden_act`` (``'silu'`` only), ``num_experts_per_tok``
            (``1..num_experts`` when there are experts), ``mamba_dt_rank`` not positive,
            ``attn_layer_offset`` / ``expert_layer_offset`` not below their period.
    """
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    E, k = config.num_experts, config.num_experts_per_tok
    if E > 1 and not 1 <= k <= E:
        raise ValueError(f'num_experts_per_tok ({k}) must be in [1, num_experts = {E}]')
    if int(config.mamba_dt_rank) <= 0:
        raise ValueError(f'mamba_dt_rank must be positive, got {config.mamba_dt_rank!r}')
    for name in ('attn_layer', 'expert_layer'):
        period, offset = getattr(config, f'{name}_period'), getattr(config, f'{name}_offset')
        if period <= 0 or not 0 <= offset < period:
            raise ValueError(f'{name}_offset ({offset}) must be in [0, {name}_period = {period})')


def mamba_dims(config) -> Mamba1Dims:
    """The Mamba-1 mixer sizes of a Jamba config (``mamba_*`` fields; the dt / B / C norms have
    weights and ``rms_norm_eps``); this rank's channels in a tensor-parallel local config
    (``mamba_tp_size``, set by :func:`~.blocks.mamba1.mamba1_split`)."""
    full = Mamba1Dims(hidden_size=config.hidden_size, d_inner=config.mamba_expand * config.hidden_size,
                      state_size=config.mamba_d_state, dt_rank=int(config.mamba_dt_rank),
                      conv_kernel=config.mamba_d_conv, conv_bias=bool(config.mamba_conv_bias),
                      proj_bias=bool(config.mamba_proj_bias), bcdt_norm_eps=config.rms_norm_eps,
                      bcdt_norm_weight=True)
    size = getattr(config, 'mamba_tp_size', 1)
    return full if size == 1 else full.local(size)


class JambaAttention(RotaryGQA):
    """Grouped-query attention over the paged KV cache, no positional encoding, no biases (Jamba's
    config has no ``attention_bias``), softmax scale ``head_dim ** -0.5``."""

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; writes this layer's K/V into the cache."""
        return super().forward(hidden, None, ctx)


class JambaMoE(GraniteMoE):
    """Jamba's experts: :class:`~.blocks.moe.GraniteMoE`'s router and SwiGLU experts
    (``num_local_experts``, transformers' alias of ``num_experts``), routed differently: a softmax
    over all router logits in float32, the top ``k`` probabilities kept as the weights (not
    renormalised)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``."""
        weights, index = torch.softmax(self.router(x).float(), dim=-1).topk(self.top_k, dim=-1)
        return self.experts(x, index, weights.to(x.dtype))


#: each layer kind's token mixer: (attribute name, factory (config, layer_idx) -> module); both
#: are called ``mixer(x, ctx)`` (no positions anywhere)
MIXERS = {MAMBA: ('mamba', lambda config, i: Mamba1Mixer(mamba_dims(config), i)),
          ATTENTION: ('self_attn', JambaAttention)}


class JambaDecoderLayer(DecoderLayer):
    """Pre-norm layer: Mamba-1 or attention (:data:`MIXERS`), then the MoE or a SwiGLU MLP (the
    checkpoint's ``feed_forward``, the engine's ``mlp``)."""

    def __init__(self, config, layer_idx: int, kind: str, moe: bool):
        name, make = MIXERS[kind]
        # dense MLPs are split under tensor parallelism, the experts are not (see parallel_plan)
        dense = getattr(config, 'dense_intermediate_size', config.intermediate_size)
        super().__init__(config.hidden_size, config.rms_norm_eps, make(config, layer_idx),
                         JambaMoE(config) if moe else SwiGLUMLP(config.hidden_size, dense),
                         names=(name, 'mlp', 'input_layernorm', 'pre_ff_layernorm'))


class JambaModel(DecoderStack):
    """Embedding, decoder layers, final norm (``final_layernorm``); no positions."""

    def __init__(self, config):
        super().__init__(config, (JambaDecoderLayer(config, i, kind, moe) for i, (kind, moe) in
                                  enumerate(zip(layer_kinds(config), expert_layers(config)))),
                         names=('embed_tokens', 'layers', 'final_layernorm'))


def _rename(name: str) -> str:
    # the engine's feed-forward is ``mlp`` (so the per-expert loader of .blocks.moe applies)
    return name.replace('.feed_forward.', '.mlp.')


class JambaForCausalLM(CausalLM):
    """Jamba causal LM in the engine's layers; ``config`` a ``transformers``
    ``JambaConfig``, refused (ValueError) as :func:`check_config` says."""
    # Mamba-1, attention, Mamba-1, Mamba-1; MoE in layers 1 and 3, dense MLPs in 0 and 2
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1,
                       expert_layer_period=2, expert_layer_offset=1, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
                       mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=32768,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)
    # the experts sit under feed_forward (published one tensor per expert too)
    tiny_expert_prefixes = ('mlp.experts.', 'feed_forward.experts.')


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'max_position_embeddings': INERT,         # no positional encoding at all
        'rope_parameters': INERT,
        'rms_norm_eps': IMPLEMENTED,              # also the eps of the dt / B / C norms
        'layers_block_type': IMPLEMENTED,         # derived from attn_layer_period / _offset
        'layers_num_experts': IMPLEMENTED,        # derived from expert_layer_period / _offset
        'attn_layer_period': CHECKED,             # the offset must be below the period
        'attn_layer_offset': CHECKED,
        'expert_layer_period': CHECKED,
        'expert_layer_offset': CHECKED,
        'num_experts': IMPLEMENTED,               # 1: every layer has a dense MLP
        'num_local_experts': IMPLEMENTED,         # transformers' alias of num_experts
        'num_experts_per_tok': CHECKED,           # in [1, num_experts]
        'mamba_d_state': IMPLEMENTED,
        'mamba_d_conv': IMPLEMENTED,
        'mamba_expand': IMPLEMENTED,
        'mamba_dt_rank': CHECKED,                 # positive ('auto' is resolved by the config)
        'mamba_conv_bias': IMPLEMENTED,
        'mamba_proj_bias': IMPLEMENTED,
        'use_mamba_kernels': INERT,               # deprecated; which implementation runs, not what it computes
        'use_mambapy': INERT,                     # alternative training-time scans of the same recurrence
        'use_associative_scan': INERT,
        'output_router_logits': INERT,            # the training loss only
        'router_aux_loss_coef': INERT,
    }
    rotary_class = None       # no positions at all
    check_config = staticmethod(check_config)
    # attention by head, Mamba-1 by channel (x_proj and out_proj row-parallel), dense MLPs by intermediate
    # rows (checkpoint feed_forward, module mlp); the experts and their router replicated
    parallel_plan = ParallelPlan(
        layers=lambda config: [(kind, 'moe' if moe else 'dense')
                               for kind, moe in zip(layer_kinds(config), expert_layers(config))],
        blocks={ATTENTION: (Block(gqa_split(shared_kv=False), 'self_attn'),),
                MAMBA: (Block(mamba1_split(mamba_dims, 'mamba_expand * hidden_size'), 'mamba'),),
                'dense': (Block(mlp_split(local_field='dense_intermediate_size'), 'feed_forward', module='mlp'),),
                'moe': ()})

    model_class = JambaModel

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: the Mamba-1 state (:func:`~.blocks.mamba1.mamba1_state_spec`: conv
        ``[mamba_expand * hidden_size, mamba_d_conv - 1]`` in ``dtype``, SSM ``[mamba_expand *
        hidden_size, mamba_d_state]`` float32) or a :class:`FullAttentionSpec` (KV heads x
        head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        mamba = mamba1_state_spec(mamba_dims(config), dtype)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [mamba if kind == MAMBA else full for kind in layer_kinds(config)]

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return _rename(name)

    load_tensor = staticmethod(load_expert_tensor)      # experts per expert or fused
