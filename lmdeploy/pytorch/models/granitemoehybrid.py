"""IBM Granite-4.0-H (``transformers`` model type ``granitemoehybrid``): Mamba-2 layers and a few
attention layers, each followed by a softmax-routed MoE plus an always-on shared MLP.

``config.layer_types`` picks each layer's token mixer (``'mamba'`` / ``'attention'`` in the
published configs, which ``transformers`` renames ``'linear_attention'`` / ``'full_attention'``)::

    h = embed(ids) * embedding_multiplier
    layer i:  h = h + residual_multiplier * mixer(RMSNorm(h))
              h = h + residual_multiplier * (moe(RMSNorm(h)) + shared_mlp(RMSNorm(h)))
      mixer = Mamba-2 ('mamba':     conv + SSM states in a slot, Mamba2Mixer)
            | GQA     ('attention': K/V in paged blocks; softmax scale attention_multiplier,
                                    RoPE only when position_embedding_type == 'rope')
      moe   = top-k of the router logits, softmax over those k (num_local_experts = 0: none,
              the shared MLP alone is the layer's MLP)
    logits = lm_head(RMSNorm(h)) / logits_scaling

The four multipliers are Granite's µP scalings (Yang et al., "Tensor Programs V", 2022). Weight
names: the published checkpoint's (``block_sparse_moe.input_linear`` ``[E, 2I, H]``,
``output_linear`` ``[E, H, I]``, ``router.layer``; ``shared_mlp.input_linear`` /
``output_linear``) and ``transformers``' in-memory ones (``block_sparse_moe.experts.gate_up_proj``
/ ``down_proj``, ``router.weight``) both load.
"""
from __future__ import annotations

import torch

from ..cache_specs import FullAttentionSpec, LayerCacheSpec
from .base import CausalLM
from .blocks.decoder import DecoderStack, SharedMLPDecoderLayer, mixer_ctx, mixer_rotary_ctx
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import RotaryGQA
from .blocks.mamba2 import Mamba2Mixer, mamba2_state_spec
from .blocks.mamba2_hybrid import ATTENTION_BLOCK, MAMBA_BLOCK, MAMBA_FIELDS, check_mamba_config, mamba_dims
from .blocks.moe import GRANITE_MOE_RENAMES, GRANITE_SHARED_MLP_SPLIT, GraniteMoE
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import RotaryEmbedding, SwiGLUMLP, apply_renames
from .parallel_plan import Block, ParallelPlan

__all__ = ['GraniteMoeHybridForCausalLM', 'GraniteAttention', 'GraniteMoE', 'check_config']

MAMBA, ATTENTION = 'mamba', 'attention'
# transformers renames the published layer types on load; both spellings mean the same
_LAYER_TYPES = {'mamba': MAMBA, 'linear_attention': MAMBA, 'attention': ATTENTION, 'full_attention': ATTENTION}


def layer_kinds(config) -> list[str]:
    """Each layer's mixer, ``'mamba'`` or ``'attention'`` (either spelling of ``layer_types``).

    Raises:
        ValueError: ``layer_types`` is not one known type per layer.
    """
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != config.num_hidden_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list 'mamba' or 'attention' for each of the {config.num_hidden_layers} "
                         f'layers, got {types}')
    return [_LAYER_TYPES[t] for t in types]


def _rope(config) -> bool:
    return getattr(config, 'position_embedding_type', None) == 'rope'


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types``, ``hidden_act`` (``'silu'`` only),
            ``position_embedding_type`` (``None`` or ``'rope'``; with RoPE the ``rope_parameters``
            of :mod:`.rope`), ``num_experts_per_tok`` (``1..num_local_experts`` when there are
            experts), or the Mamba-2 geometry (``mamba_n_heads`` x ``mamba_d_head`` must be
            ``mamba_expand`` x ``hidden_size``, ``mamba_n_groups`` must divide ``mamba_n_heads``),
            ``time_step_limit`` other than ``(0, inf)``.
    """
    kinds = layer_kinds(config)
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    pe = getattr(config, 'position_embedding_type', None)
    if pe not in (None, 'rope'):
        raise ValueError(f"position_embedding_type must be None or 'rope', got {pe!r}")
    if pe == 'rope' and ATTENTION in kinds:
        RotaryEmbedding(config)            # raises for rope parameters it cannot reproduce
    E, k = config.num_local_experts, config.num_experts_per_tok
    if E < 0 or (E > 0 and not 1 <= k <= E):
        raise ValueError(f'num_experts_per_tok ({k}) must be in [1, num_local_experts = {E}]')
    if MAMBA in kinds:
        inner = round(config.mamba_expand * config.hidden_size)
        check_mamba_config(config, inner, 'mamba_expand x hidden_size')


class GraniteAttention(RotaryGQA):
    """Grouped-query attention over the paged KV cache with softmax scale
    ``attention_multiplier`` (not ``head_dim ** -0.5``) and RoPE only when the config asks.

    Args:
        config: HF ``GraniteMoeHybridConfig``.
        layer_idx: index into ``StepContext.kv_caches``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, scale=config.attention_multiplier)


#: each layer kind's token mixer: (attribute name, factory (config, layer_idx) -> module, call)
MIXERS = {MAMBA: ('mamba', lambda config, i: Mamba2Mixer(mamba_dims(config), i), mixer_ctx),
          ATTENTION: ('self_attn', GraniteAttention, mixer_rotary_ctx)}


class GraniteDecoderLayer(SharedMLPDecoderLayer):
    """Pre-norm layer with µP residual scaling (``residual_multiplier``): Mamba-2 or attention
    (:data:`MIXERS`), then the routed experts (``block_sparse_moe``, none when
    ``num_local_experts`` is 0) plus the always-on ``shared_mlp``."""

    def __init__(self, config, layer_idx: int, kind: str):
        name, make, call = MIXERS[kind]
        super().__init__(config.hidden_size, config.rms_norm_eps, make(config, layer_idx),
                         SwiGLUMLP(config.hidden_size, config.shared_intermediate_size), call=call,
                         names=(name, 'shared_mlp', 'input_layernorm', 'post_attention_layernorm'),
                         residual_multiplier=float(config.residual_multiplier),
                         shared=('block_sparse_moe', GraniteMoE(config) if config.num_local_experts > 0 else None))


class GraniteMoeHybridModel(DecoderStack):
    """Embedding (times ``embedding_multiplier``), decoder layers, final norm; the rotary table
    only with RoPE."""

    def __init__(self, config):
        kinds = layer_kinds(config)
        super().__init__(config, (GraniteDecoderLayer(config, i, kind) for i, kind in enumerate(kinds)),
                         rotary=RotaryEmbedding(config) if _rope(config) and ATTENTION in kinds else None)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` times ``embedding_multiplier``."""
        return super().embed(input_ids) * self.embedding_multiplier


class GraniteMoeHybridForCausalLM(CausalLM):
    """Granite-4.0-H causal LM in the engine's layers; ``config`` a ``transformers``
    ``GraniteMoeHybridConfig``, refused (ValueError) as :func:`check_config` says."""
    # Mamba-2, attention, Mamba-2, Mamba-2; MoE + shared MLP; NoPE. µP multipliers off 1 (and a softmax
    # scale off head_dim ** -0.5) so each is exercised; an SSD chunk of 24 so 32-token prefill chunks end
    # off its boundaries; 2 B/C groups so TP2 splits them
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, layer_types=['mamba', 'attention', 'mamba', 'mamba'],
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=64,
                       num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                       mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=24, embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=3.0,
                       position_embedding_type=None, max_position_embeddings=32768, tie_word_embeddings=False,
                       rms_norm_eps=1e-6)
    tiny_top_level_rope_theta = True

    @staticmethod
    def tiny_config_json(config_dict: dict) -> None:
        """The published layer-type names; ``transformers`` renames them on load."""
        config_dict['layer_types'] = [{'linear_attention': 'mamba', 'full_attention': 'attention'}.get(t, t)
                                      for t in config_dict['layer_types']]


    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **MAMBA_FIELDS,
        'rope_parameters': CHECKED,               # read only with position_embedding_type='rope'
        'position_embedding_type': CHECKED,       # None (no positions) or 'rope'
        'embedding_multiplier': IMPLEMENTED,
        'residual_multiplier': IMPLEMENTED,
        'attention_multiplier': IMPLEMENTED,      # the softmax scale
        'logits_scaling': IMPLEMENTED,            # logits are divided by it
        'num_local_experts': IMPLEMENTED,         # 0: no routed experts, the shared MLP alone
        'num_experts_per_tok': CHECKED,           # in [1, num_local_experts]
        'shared_intermediate_size': IMPLEMENTED,
        'layers_block_type': CHECKED,             # transformers' alias of layer_types
        'output_router_logits': INERT,            # the training loss only
        'router_aux_loss_coef': INERT,
    }
    rotary_class = None       # check_config builds the rotary table itself, only with RoPE
    check_config = staticmethod(check_config)
    # attention by head, Mamba-2 by head and group (the published mamba_n_groups = 1: the group's B / C
    # copied to every rank of its heads, its norm all-reduced), the shared MLP by intermediate rows
    # (input_linear's gate and up rows, output_linear's columns); the experts and router replicated
    parallel_plan = ParallelPlan(layers=lambda config: [(kind, 'mlp') for kind in layer_kinds(config)],
                                 blocks={ATTENTION: (ATTENTION_BLOCK,), MAMBA: (MAMBA_BLOCK,),
                                         'mlp': (Block(GRANITE_SHARED_MLP_SPLIT, 'shared_mlp'),)})

    model_class = GraniteMoeHybridModel

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: the Mamba-2 state (:func:`~.blocks.mamba2.mamba2_state_spec`: conv
        ``[conv_dim, d_conv - 1]`` in ``dtype``, SSM ``[heads, d_head, d_state]`` float32) or a
        :class:`FullAttentionSpec` (KV heads x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        mamba = mamba2_state_spec(mamba_dims(config), dtype)
        full = FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)
        return [mamba if kind == MAMBA else full for kind in layer_kinds(config)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, vocab_size]`` float32 logits (divided by ``logits_scaling``)."""
        return self.lm_head(hidden).float() / float(self.config.logits_scaling)

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return apply_renames(name, GRANITE_MOE_RENAMES)
