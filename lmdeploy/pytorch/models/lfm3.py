"""Liquid LFM3 (``transformers`` model type ``lfm3``): LFM2's gated short-convolution layers
mixed with sliding-window and global attention layers, each layer followed by a SwiGLU MLP,
with "sandwich" norms on the mixer and MLP outputs.

``config.layer_types`` picks each layer's token mixer (the released pattern: global at
``i % 4 == 2``, sliding at ``i % 4 == 0`` past layer 0, short conv elsewhere)::

    h = embed(ids)
    layer i:  h = h + post_operator_norm(mixer(operator_norm(h)))
              h = h + post_ffn_norm(w2(silu(w1 x) * w3 x)),   x = ffn_norm(h)
      mixer = short conv  ('conv': B, C, x = in_proj(h); C * conv(B * x), see .blocks.short_conv)
            | attention   ('sliding_attention' / 'full_attention': q/k RMSNorm per head, RoPE with
                           the layer type's own rope_parameters entry, K/V in paged blocks; a
                           sliding layer sees the last sliding_window positions, the query's own
                           included; each head's output times sigmoid(g_proj(h)) when
                           use_attention_gate)
    logits = lm_head(embedding_norm(h))

The post norms are identities without ``use_sandwich_norm``. ``rope_parameters`` is nested per
attention layer type (released: ``default`` base 10^4 for sliding layers, ``proportional`` base
10^6 rotating half of each head for global ones); each type gets its own table
(:class:`~lmdeploy.pytorch.models.rope.RotaryEmbedding` with ``layer_type``).

Caches: a short-conv layer a conv-only state slot, a sliding layer a :class:`SlidingWindowSpec`,
a global layer a :class:`FullAttentionSpec` (so a prefix keeps every block). Tensor parallelism:
the class's ``parallel_plan``, composed of the attention, short-conv and MLP block splits.

Weight names: the published checkpoints' (``LiquidAI/LFM3-*``: ``self_attn.gate_proj`` for the
output gate, ``feed_forward.w1`` / ``w3`` / ``w2``) and ``transformers``' (``self_attn.g_proj``).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..cache_specs import LayerCacheSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.decoder import DecoderLayer, DecoderStack, RotaryTables, mixer_ctx, mixer_table_ctx
from .blocks.gqa import gqa_split
from .blocks.short_conv import ShortConv, short_conv_split, short_conv_state_spec
from .blocks.window_attention import FULL, SLIDING, WindowAttention, layer_windows, window_cache_specs
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_renames, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['Lfm3ForCausalLM', 'check_config']

CONV = 'conv'


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``conv_L_cache`` (at least 2: a width-1 conv keeps no
            state), ``layer_types`` / ``sliding_window`` (:func:`~.blocks.window_attention.layer_windows`),
            ``num_key_value_heads`` (must divide ``num_attention_heads``); ``rope_parameters`` (each
            attention layer type needs its entry; rope types as :mod:`.rope` accepts them).
    """
    layer_windows(config, CONV)
    types = set(config.layer_types)
    if config.conv_L_cache < 2:
        raise ValueError(f'conv_L_cache must be at least 2, got {config.conv_L_cache}')
    if types - {CONV}:
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f'num_key_value_heads ({config.num_key_value_heads}) must divide num_attention_heads '
                             f'({config.num_attention_heads})')
        for layer_type in sorted(types - {CONV}):
            RotaryEmbedding(config, layer_type)         # raises for parameters it cannot reproduce


class Lfm3DecoderLayer(DecoderLayer):
    """Short conv or attention (:class:`~.blocks.window_attention.WindowAttention` with its layer
    type's rotary table and, with ``use_attention_gate``, a sigmoid gate per head), then the
    SwiGLU MLP; each output normed (sandwich) before its residual."""

    def __init__(self, config, layer_idx: int, window: int | None):
        kind = config.layer_types[layer_idx]
        if kind == CONV:
            # a rank's channels under tensor parallelism (short_conv_split's local config), else all of them
            channels = getattr(config, 'conv_channels', config.hidden_size)
            mixer = ShortConv(config.hidden_size, channels, config.conv_L_cache, bool(config.conv_bias), layer_idx)
            call, name = mixer_ctx, 'conv'
        else:
            mixer = WindowAttention(config, layer_idx, window, head_gate=bool(config.use_attention_gate))
            call, name = mixer_table_ctx(kind), 'self_attn'
        super().__init__(config.hidden_size, config.norm_eps, mixer, SwiGLUMLP(config.hidden_size,
                                                                              config.intermediate_size),
                         call=call, names=(name, 'mlp', 'operator_norm', 'ffn_norm'))
        sandwich = config.use_sandwich_norm
        self.post_operator_norm = RMSNorm(config.hidden_size, config.norm_eps) if sandwich else nn.Identity()
        self.post_ffn_norm = RMSNorm(config.hidden_size, config.norm_eps) if sandwich else nn.Identity()

    def forward(self, hidden: torch.Tensor, rotary: dict, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary``: layer type → the step's ``(cos, sin)``."""
        hidden = hidden + self.post_operator_norm(self.mix(hidden, rotary, ctx))
        return hidden + self.post_ffn_norm(self.mlp_block(self.norm_2(hidden)))


class Lfm3Model(DecoderStack):
    """Embedding, decoder layers, the final norm (``embedding_norm``); one rotary table per
    attention layer type present."""

    def __init__(self, config):
        layers = (Lfm3DecoderLayer(config, i, w) for i, w in enumerate(layer_windows(config, CONV)))
        rotary = RotaryTables({t: RotaryEmbedding(config, t) for t in sorted(set(config.layer_types) - {CONV})})
        super().__init__(config, layers, rotary=rotary, norm=RMSNorm(config.hidden_size, config.norm_eps),
                         names=('embed_tokens', 'layers', 'embedding_norm'))


_RENAMES = [   # published -> the engine's module names
    (re.compile(r'\.self_attn\.gate_proj\.'), '.self_attn.g_proj.'),
    (re.compile(r'\.feed_forward\.w1\.'), '.mlp.gate_proj.'),
    (re.compile(r'\.feed_forward\.w3\.'), '.mlp.up_proj.'),
    (re.compile(r'\.feed_forward\.w2\.'), '.mlp.down_proj.'),
]


_ATTENTION = Block(gqa_split(shared_kv=False, head_gate=('gate_proj', 'g_proj')), 'self_attn')


class Lfm3ForCausalLM(CausalLM):
    """``lfm3`` causal LM in the engine's layers, from a ``transformers``
    ``Lfm3Config``; a config it cannot run raises ``ValueError`` (:func:`check_config`)."""
    # conv, sliding, global, conv, sliding: a 40-token window, off the 16-token blocks and the 32-token
    # prefill chunks, so chunk and block ends fall inside windows; the released nested rope parameters
    # (default for sliding, proportional half-head for global), output gates and sandwich norms on
    tiny_config = dict(hidden_size=64, num_hidden_layers=5, layer_types=[CONV, SLIDING, FULL, CONV, SLIDING],
                       sliding_window=40, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=96, conv_L_cache=3, conv_bias=False, use_sandwich_norm=True,
                       use_attention_gate=True, norm_eps=1e-5, max_position_embeddings=32768,
                       tie_word_embeddings=False)

    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        'norm_eps': IMPLEMENTED,                  # every RMSNorm's eps (rms_norm_eps is its alias)
        'conv_bias': IMPLEMENTED,                 # in_proj, conv and out_proj of the short conv
        'conv_L_cache': CHECKED,                  # the conv width, at least 2
        'sliding_window': IMPLEMENTED,            # the window of 'sliding_attention' layers
        'use_sandwich_norm': IMPLEMENTED,         # post_operator_norm / post_ffn_norm
        'use_attention_gate': IMPLEMENTED,        # g_proj
        '_rope_type_labels': INERT,               # a class constant: the layer types rope_parameters may key
    }
    rotary_class = None  # one table per attention layer type, built (and so checked) by check_config
    check_config = staticmethod(check_config)
    # attention by head (the output gate's rows with its query heads; the TP size must divide the KV
    # heads), short conv by channel, the MLP by intermediate rows (w1 / w3 rows, w2 columns)
    parallel_plan = ParallelPlan(
        layers=lambda config: [(kind, 'dense') for kind in config.layer_types],
        blocks={CONV: (Block(short_conv_split, 'conv'),), SLIDING: (_ATTENTION,), FULL: (_ATTENTION,),
                'dense': (Block(mlp_split(up=('w1', 'w3'), down='w2', down_module='down_proj'), ('feed_forward', 'mlp'),
                              module='mlp'),)})

    model_class = Lfm3Model

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: the short conv's state (``[hidden_size, conv_L_cache - 1]`` in ``dtype``, no
        recurrent tensor), a :class:`SlidingWindowSpec` with ``sliding_window`` or a
        :class:`FullAttentionSpec` (KV heads x head_dim per token).

        Raises:
            ValueError: see :func:`check_config`.
        """
        conv = short_conv_state_spec(getattr(config, 'conv_channels', config.hidden_size), config.conv_L_cache, dtype)
        return window_cache_specs(config, dtype, conv, CONV)

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        return apply_renames(name, _RENAMES)
