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

from ..cache_specs import FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec
from ..kernels import get_kernel
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.gated_delta_net import attention_head_dim
from .blocks.gqa import gqa_split
from .blocks.short_conv import ShortConv, short_conv_split, short_conv_state_spec
from .config_audit import CHECKED, COMMON_FIELDS, IMPLEMENTED, INERT
from .layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary, mlp_split
from .parallel_plan import Block, ParallelPlan

__all__ = ['Lfm3ForCausalLM', 'check_config', 'layer_windows']

CONV, SLIDING, FULL = 'conv', 'sliding_attention', 'full_attention'


def layer_windows(config) -> list[int | None]:
    """Each attention layer's window in tokens (``sliding_window`` for ``'sliding_attention'``,
    None for ``'full_attention'``); 0 for a short-conv layer.

    Raises:
        ValueError: ``layer_types`` does not list one of the three kinds per layer, or
            ``sliding_window`` is not an int >= 1 while some layer slides.
    """
    types = list(getattr(config, 'layer_types', None) or [])
    if len(types) != config.num_hidden_layers or any(t not in (CONV, SLIDING, FULL) for t in types):
        raise ValueError(f'layer_types must list {CONV!r}, {SLIDING!r} or {FULL!r} for each of the '
                         f'{config.num_hidden_layers} layers, got {types}')
    window = getattr(config, 'sliding_window', None)
    if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f'sliding_window must be an int >= 1 for the sliding_attention layers, got {window!r}')
    return [0 if t == CONV else window if t == SLIDING else None for t in types]


def check_config(config) -> None:
    """Refuse configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field: ``layer_types`` / ``sliding_window`` (:func:`layer_windows`),
            ``conv_L_cache`` (at least 2: a width-1 conv keeps no state), ``num_key_value_heads``
            (must divide ``num_attention_heads``); ``rope_parameters`` (each attention layer type
            needs its entry; rope types as :mod:`.rope` accepts them).
    """
    layer_windows(config)
    types = set(config.layer_types)
    if config.conv_L_cache < 2:
        raise ValueError(f'conv_L_cache must be at least 2, got {config.conv_L_cache}')
    if types - {CONV}:
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f'num_key_value_heads ({config.num_key_value_heads}) must divide num_attention_heads '
                             f'({config.num_attention_heads})')
        for layer_type in sorted(types - {CONV}):
            RotaryEmbedding(config, layer_type)         # raises for parameters it cannot reproduce


class Lfm3Attention(nn.Module):
    """GQA with per-head q/k RMSNorm and RoPE over the paged KV cache, a sliding window when
    ``window`` is set, and a sigmoid gate per head (``g_proj``: ``hidden -> num_heads``) when
    ``use_attention_gate``.

    Args:
        config: the HF ``Lfm3Config``.
        layer_idx: index into ``StepContext.kv_caches``.
        window: keys per query (itself included), None for a global layer.
    """

    def __init__(self, config, layer_idx: int, window: int | None):
        super().__init__()
        self.layer_idx, self.window = layer_idx, window
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention_head_dim(config)
        bias, kv = config.attention_bias, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {'q_proj': self.num_heads * self.head_dim, 'k_proj': kv,
                                                          'v_proj': kv}, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.g_proj = Linear(config.hidden_size, self.num_heads, bias=False) if config.use_attention_gate else None
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is this layer type's ``(cos, sin)``;
        writes this layer's K/V into the cache."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = get_kernel('paged_window_attention', q.device)(q, k, v, k_cache, v_cache, ctx, self.scale, self.window,
                                                              None)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden))[..., None]
        return self.o_proj(out.reshape(T, -1))


class Lfm3DecoderLayer(nn.Module):
    """Short conv or attention, then the SwiGLU MLP; each output normed (sandwich) before its residual."""

    def __init__(self, config, layer_idx: int, window: int | None):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == CONV:
            # a rank's channels under tensor parallelism (short_conv_split's local config), else all of them
            channels = getattr(config, 'conv_channels', config.hidden_size)
            self.conv = ShortConv(config.hidden_size, channels, config.conv_L_cache, bool(config.conv_bias), layer_idx)
        else:
            self.self_attn = Lfm3Attention(config, layer_idx, window)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        sandwich = config.use_sandwich_norm
        self.post_operator_norm = RMSNorm(config.hidden_size, config.norm_eps) if sandwich else nn.Identity()
        self.post_ffn_norm = RMSNorm(config.hidden_size, config.norm_eps) if sandwich else nn.Identity()

    def forward(self, hidden: torch.Tensor, rotary: dict, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary``: layer type → the step's ``(cos, sin)``."""
        normed = self.operator_norm(hidden)
        if self.layer_type == CONV:
            mixed = self.conv(normed, ctx)
        else:
            mixed = self.self_attn(normed, rotary[self.layer_type], ctx)
        hidden = hidden + self.post_operator_norm(mixed)
        return hidden + self.post_ffn_norm(self.mlp(self.ffn_norm(hidden)))


class Lfm3Model(nn.Module):
    """Embedding, decoder layers, the final norm (``embedding_norm``); one rotary table per
    attention layer type present."""

    def __init__(self, config):
        super().__init__()
        windows = layer_windows(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Lfm3DecoderLayer(config, i, w) for i, w in enumerate(windows))
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)
        # plain attributes (not submodules): the tables hold no parameters
        self.rotaries = {t: RotaryEmbedding(config, t) for t in sorted(set(config.layer_types) - {CONV})}

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat tokens."""
        hidden = self.embed_tokens(ctx.input_ids)
        tables = {t: r(ctx.positions, hidden.dtype) for t, r in self.rotaries.items()}
        for layer in self.layers:
            hidden = layer(hidden, tables, ctx)
        return self.embedding_norm(hidden)


_RENAMES = [   # published -> the engine's module names
    (re.compile(r'\.self_attn\.gate_proj\.'), '.self_attn.g_proj.'),
    (re.compile(r'\.feed_forward\.w1\.'), '.mlp.gate_proj.'),
    (re.compile(r'\.feed_forward\.w3\.'), '.mlp.up_proj.'),
    (re.compile(r'\.feed_forward\.w2\.'), '.mlp.down_proj.'),
]


_ATTENTION = Block(gqa_split(shared_kv=False, head_gate=('gate_proj', 'g_proj')), 'self_attn')


class Lfm3ForCausalLM(CausalLM):
    """``lfm3`` causal LM in the engine's layers.

    Args:
        config: a ``transformers`` ``Lfm3Config``.

    Raises:
        ValueError: see :func:`check_config`.
    """
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
        heads, dim = config.num_key_value_heads, attention_head_dim(config)
        return [conv if w == 0 else FullAttentionSpec(heads, dim, dtype) if w is None
                else SlidingWindowSpec(heads, dim, dtype, w) for w in layer_windows(config)]

    def rename_weight(self, name: str) -> str:
        """Published or transformers names (see the module docstring) → ours."""
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        return name
