"""OLMo Hybrid (``transformers`` model type ``olmo_hybrid``, Ai2's Olmo-Hybrid): Gated DeltaNet
layers mixed with full-attention layers, every layer then a SwiGLU MLP.

``config.layer_types`` picks each layer; the two kinds normalise differently::

    linear_attention (pre-norm):  h = x + GDN(RMSNorm(x));    h = h + mlp(RMSNorm(h))
    full_attention  (post-norm):  h = x + RMSNorm(attn(x));   h = h + RMSNorm(mlp(h))
      GDN  = Gated DeltaNet (Yang et al., 2024): separate q / k / v / g / a / b projections,
             a depthwise causal conv (SiLU) over [q | k | v], beta = sigmoid(b), doubled when
             linear_allow_neg_eigval (the recurrence may then have negative eigenvalues), the
             output gated by RMSNorm(o) * silu(g) with eps 1e-5 whatever rms_norm_eps says
      attn = GQA with one RMSNorm over all query heads' channels and one over all key heads'
             channels (not per head); rotary only when rope_parameters has a rope_theta (the
             published checkpoints have none: NoPE)
    logits = lm_head(RMSNorm(h))

Every layer is a :class:`~.blocks.decoder.DecoderLayer` under the checkpoint's names (the
attention kind's :class:`OlmoHybridPostNormLayer` only moves its two norms after the mixer and
the MLP), the body a :class:`~.blocks.decoder.DecoderStack`.

Caches: conv state ``[2·Hk·dk + Hv·dv, kernel-1]`` and float32 recurrent state ``[Hv, dk, dv]``
per Gated DeltaNet layer (one slot per sequence), K/V per token in paged blocks per attention
layer. A sequence with ``history_len == 0`` starts from a zero state whatever its slot holds.

Weight names: transformers' (``linear_attn.{q,k,v,g,a,b}_proj`` fill one packed ``in_proj``;
``linear_attn.o_norm`` / ``o_proj`` are the block's ``norm`` / ``out_proj``) and the published
layout transformers converts on load (its conversion mapping): ``attention_layer_norm`` /
``feedforward_layer_norm`` for ``input_layernorm`` / ``post_attention_layernorm``, and the conv
filters as three tensors ``linear_attn.{q,k,v}_conv1d.weight`` stacked into ``conv1d``.

Tensor parallelism (:attr:`OlmoHybridForCausalLM.parallel_plan`): Gated DeltaNet by key head
(:func:`~.blocks.gated_delta_net.gdn_split`, its six projections and three conv filters),
attention by head with the KV heads divided by the TP size and the whole-width q / k norms
summing their squares over the ranks (:func:`~.blocks.spanning_norm.spanning_qk_norm_split`: one
all-reduce of ``[T]`` floats for q and one for k per attention layer), the MLP by rows.
"""
from __future__ import annotations

import re

import torch

from ..cache_specs import LayerCacheSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.decoder import DecoderLayer, DecoderStack, mixer_rotary_ctx
from .blocks.gated_delta_net import (FULL, LINEAR, GatedDeltaNet, GatedRMSNorm, check_hybrid_config, gdn_split,
                                     hybrid_cache_specs)
from .blocks.gqa import GQAProjections, gqa_split
from .blocks.spanning_norm import spanning_qk_norm_split
from .config_audit import CHECKED, COMMON_FIELDS, GATED_DELTANET_FIELDS, IMPLEMENTED, INERT
from .layers import PackedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_renames, apply_rotary, attention, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['OlmoHybridForCausalLM', 'check_config', 'uses_rope']

#: the gated output norm's eps: transformers (after FLA's fused gated norm) fixes it, whatever
#: ``rms_norm_eps`` says
GATED_NORM_EPS = 1e-5


def uses_rope(config) -> bool:
    """Whether the attention layers rotate q and k: ``rope_parameters`` with a ``rope_theta``
    (transformers builds no rotary table otherwise; the published checkpoints are NoPE)."""
    rope = getattr(config, 'rope_parameters', None)
    return rope is not None and rope.get('rope_theta') is not None


def check_config(config) -> None:
    """Refuse an OLMo Hybrid config this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types`` (``linear_attention`` / ``full_attention``
            per layer), ``linear_num_value_heads`` (a multiple of ``linear_num_key_heads``),
            ``hidden_act`` (``silu``: the conv and the MLP), ``num_key_value_heads`` (divides
            ``num_attention_heads``); the rope parameters (:mod:`.rope`) when ``rope_theta`` is set.
    """
    check_hybrid_config(config)
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f'num_key_value_heads ({config.num_key_value_heads}) must divide num_attention_heads '
                         f'({config.num_attention_heads})')
    if uses_rope(config):
        RotaryEmbedding(config)          # raises for rope parameters it cannot reproduce


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """:class:`~.blocks.gated_delta_net.GatedDeltaNet` with OLMo Hybrid's projections: ``q_proj``
    ``[Hk·dk]``, ``k_proj`` ``[Hk·dk]``, ``v_proj`` ``[Hv·dv]`` (already the conv's channel order),
    the output gate ``g_proj`` ``[Hv·dv]``, ``b_proj`` and ``a_proj`` ``[Hv]``, all packed into one
    matmul; beta doubled when ``linear_allow_neg_eigval``; the gated norm's eps fixed at 1e-5.

    Args:
        config: a ``transformers`` ``OlmoHybridConfig``.
        layer_idx: index into ``StepContext.state_caches``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.in_proj = PackedLinear(config.hidden_size, {
            'q_proj': self.key_dim, 'k_proj': self.key_dim, 'v_proj': self.value_dim, 'g_proj': self.value_dim,
            'b_proj': self.num_v_heads, 'a_proj': self.num_v_heads})
        self.norm = GatedRMSNorm(self.head_v_dim, GATED_NORM_EPS)
        self.beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0

    def _split_projections(self, hidden: torch.Tensor):
        """``[T, hidden]`` → mixed q|k|v ``[T, conv_dim]``, z (the gate) ``[T, Hv, dv]``, b, a ``[T, Hv]``."""
        q, k, v, g, b, a = self.in_proj.forward_split(hidden)
        return torch.cat((q, k, v), dim=-1), g.reshape(hidden.shape[0], self.num_v_heads, self.head_v_dim), b, a


class OlmoHybridAttention(GQAProjections):
    """GQA over the paged KV cache with OLMo's whole-width q / k norms: ``q_norm`` over the
    ``num_heads·head_dim`` query channels and ``k_norm`` over the ``num_kv_heads·head_dim`` key
    channels, before splitting into heads; rotary when the model has a table (``rotary`` not
    None), rotated in float32 as transformers' table is; scale ``head_dim ** -0.5``."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary``: ``(cos, sin)`` float32 or None (NoPE);
        writes this layer's K/V."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        q = self.q_norm(q).reshape(T, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(T, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            q = apply_rotary(q.float(), *rotary).to(hidden.dtype)
            k = apply_rotary(k.float(), *rotary).to(hidden.dtype)
        out = attention(q, k, v.reshape(T, self.num_kv_heads, self.head_dim), ctx, self.layer_idx, self.scale)
        return self.o_proj(out.reshape(T, -1))


class OlmoHybridPostNormLayer(DecoderLayer):
    """OLMo's attention layer: post-norm, ``h = x + norm_1(attn(x))``, ``y = h + norm_2(mlp(h))``
    (``x, h, y: [T, hidden]``; ``norm_1`` / ``norm_2`` the checkpoint's
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``); built as a
    :class:`~.blocks.decoder.DecoderLayer`, only the order of norm and residual differs."""

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary``: ``(cos, sin)`` float32 or None (NoPE)."""
        hidden = hidden + self.norm_1(self._call(self.mixer, hidden, rotary, ctx))
        return hidden + self.norm_2(self.mlp_block(hidden))


def decoder_layer(config, layer_idx: int) -> DecoderLayer:
    """Layer ``layer_idx``: a pre-norm :class:`~.blocks.decoder.DecoderLayer` around
    :class:`OlmoHybridGatedDeltaNet` (``linear_attn``, ``input_layernorm``,
    ``post_attention_layernorm``) or an :class:`OlmoHybridPostNormLayer` around
    :class:`OlmoHybridAttention` (``self_attn``, ``post_attention_layernorm``,
    ``post_feedforward_layernorm``); a SwiGLU ``mlp`` in both. Called as
    ``layer(hidden [T, hidden], rotary, ctx)``."""
    mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
    if config.layer_types[layer_idx] == LINEAR:
        return DecoderLayer(config.hidden_size, config.rms_norm_eps, OlmoHybridGatedDeltaNet(config, layer_idx), mlp,
                            names=('linear_attn', 'mlp', 'input_layernorm', 'post_attention_layernorm'))
    return OlmoHybridPostNormLayer(config.hidden_size, config.rms_norm_eps, OlmoHybridAttention(config, layer_idx), mlp,
                                   call=mixer_rotary_ctx,
                                   names=('self_attn', 'mlp', 'post_attention_layernorm', 'post_feedforward_layernorm'))


class OlmoHybridModel(DecoderStack):
    """Embedding, decoder layers (:func:`decoder_layer`), final RMSNorm; a float32 rotary table
    only when :func:`uses_rope`."""

    def __init__(self, config):
        super().__init__(config, (decoder_layer(config, i) for i in range(config.num_hidden_layers)),
                         rotary=RotaryEmbedding(config) if uses_rope(config) else None, rotary_dtype=torch.float32)


_RENAMES = (   # published / transformers names -> ours
    (re.compile(r'\.attention_layer_norm\.'), '.input_layernorm.'),
    (re.compile(r'\.feedforward_layer_norm\.'), '.post_attention_layernorm.'),
    (re.compile(r'\.linear_attn\.o_norm\.'), '.linear_attn.norm.'),
    (re.compile(r'\.linear_attn\.o_proj\.'), '.linear_attn.out_proj.'),
)
_SPLIT_CONV = re.compile(r'^(.*\.linear_attn\.)([qkv])_conv1d\.weight$')


class OlmoHybridForCausalLM(CausalLM):
    """OLMo Hybrid causal LM in the engine's layers (any TP size that divides its heads, see
    :attr:`parallel_plan`).

    Args:
        config: a ``transformers`` ``OlmoHybridConfig``.

    Raises:
        ValueError: see :func:`check_config`.
    """

    # three Gated DeltaNet layers (2 key heads serving 4 value heads, beta in [0, 2]) and a NoPE
    # GQA layer, as published
    tiny_config = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=32768, tie_word_embeddings=False,
                       rms_norm_eps=1e-6, rope_parameters=dict(rope_type='default', rope_theta=None),
                       layer_types=[LINEAR, LINEAR, LINEAR, FULL], linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       linear_allow_neg_eigval=True)

    model_class = OlmoHybridModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **GATED_DELTANET_FIELDS,
        'num_key_value_heads': CHECKED,           # divides num_attention_heads
        'rope_parameters': CHECKED,               # None / no rope_theta: NoPE; else see .rope
        'linear_allow_neg_eigval': IMPLEMENTED,   # beta doubled
        'linear_a_log_min': INERT,                # initialisation ranges only
        'linear_a_log_max': INERT,
        'linear_dt_min': INERT,
        'linear_dt_max': INERT,
        'linear_dt_init_floor': INERT,
    }
    check_config = staticmethod(check_config)
    # Gated DeltaNet by key head (beta_scale is a constant of the layer, nothing to split); the
    # attention by head, its q / k norms over all heads summed over the ranks, so the TP size must
    # divide num_key_value_heads (a copied KV head would count twice in the key norm); the MLP by rows
    parallel_plan = ParallelPlan(
        layers=lambda config: [(kind, 'mlp') for kind in config.layer_types],
        blocks={LINEAR: (Block(gdn_split, 'linear_attn'),),
                FULL: (Block(spanning_qk_norm_split(gqa_split(shared_kv=False)), 'self_attn'),),
                'mlp': (Block(mlp_split(), 'mlp'),)})
    rotary_class = None       # check_config builds the rotary table itself, only when rope_theta is set

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: :class:`LinearAttentionSpec` (conv ``[2·Hk·dk + Hv·dv, kernel-1]`` in
        ``dtype``, float32 recurrent ``[Hv, dk, dv]``) for Gated DeltaNet, :class:`FullAttentionSpec`
        (KV heads × ``hidden_size / num_attention_heads`` per token) for attention."""
        return hybrid_cache_specs(config, dtype)

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return apply_renames(name, _RENAMES)

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """The published per-kind conv filters ``linear_attn.{q,k,v}_conv1d.weight`` → their rows
        of ``conv1d.weight`` (q ``[0, Hk·dk)``, k the next ``Hk·dk``, v the rest; under TP this rank's
        heads of each, as its local config counts them)."""
        m = _SPLIT_CONV.match(name)
        if m is None:
            return False
        key_dim = self.config.linear_num_key_heads * self.config.linear_key_head_dim
        start = {'q': 0, 'k': key_dim, 'v': 2 * key_dim}[m.group(2)]
        param = f'{m.group(1)}conv1d.weight'
        loader.copy_part(param, loader.params[param][start:start + tensor.shape[0]], m.group(2), 3, name, tensor)
        return True
