"""The packed grouped-query projections the hybrids' attention layers share (Bamba, Falcon-H1,
Granite-4.0-H, Granite-MoE-SWA, MiniMax-01): ``q_proj`` / ``k_proj`` / ``v_proj`` packed into one matmul,
and ``o_proj``. A family subclasses :class:`GQAProjections` and keeps its own scale, RoPE and kernel,
or takes :class:`RotaryGQA`: RoPE when given tables, a softmax scale, the paged attention. A float32
decode step goes through :func:`~.attention.fused_attention_decode` (the qkv product, one prologue
call for the rotary and the K/V store, the paged decode attention), as do Jamba's, LFM2's and
Nemotron-H's attention layers.

:func:`gqa_split` is the tensor-parallel split of every grouped-query attention block (these
and Qwen's, Nemotron-H's, Jamba's, LFM2's): query heads and KV heads by head (column-parallel
``q_proj`` / ``k_proj`` / ``v_proj`` rows, row-parallel ``o_proj`` columns); the K/V cache
(``tp_split='kv_heads'``) holds the rank's KV heads."""
from __future__ import annotations

import torch
from torch import nn

from ...model_inputs import StepContext
from ..layers import Linear, PackedLinear, apply_rotary, attention
from ..parallel_plan import Axis, BlockSplit, Piece, cols, rows
from .attention import attention_head_dim, fused_attention_decode

__all__ = ['GQAProjections', 'RotaryGQA', 'gqa_split']


def gqa_split(*, gated: bool = False, shared_kv: bool = True, o: str = 'o_proj', sinks: bool = False,
              head_gate: tuple[str, ...] = ()):
    """The tensor-parallel split of grouped-query attention, as a split factory.

    Args:
        gated: ``q_proj`` emits ``2 * head_dim`` rows per head (query and output gate).
        shared_kv: fewer KV heads than ranks are allowed when they divide the TP size
            (``size / kv`` ranks hold a copy of one); False: the TP size must divide them.
        o: the output projection's name (``o_proj``; LFM2's ``out_proj``).
        sinks: a ``sinks`` tensor of one entry per query head (split with them).
        head_gate: the names (spellings) of an output gate's projection with one row per query
            head (LFM3's ``gate_proj`` / ``g_proj``): its rows of the rank's query heads.

    Returns:
        ``(config, size) -> BlockSplit``: axes ``q_heads`` (``num_attention_heads``) and
        ``kv_heads`` (``num_key_value_heads``), both set to the rank's count in the local config
        with ``head_dim`` explicit (:func:`attention_head_dim`, elements); ``q_proj`` rows (its
        biases too), ``k_proj`` / ``v_proj`` rows, ``o`` weight columns (its bias whole); the
        cache split ``kv_heads``.
    """

    def split(config, size: int) -> BlockSplit:
        d = attention_head_dim(config)
        axes = (Axis('q_heads', config.num_attention_heads, 'num_attention_heads', 'num_attention_heads'),
                Axis('kv_heads', config.num_key_value_heads, 'num_key_value_heads', 'num_key_value_heads',
                     shared=shared_kv))
        tensors = (rows('q_proj', Piece('q_heads', 2 * d if gated else d)),
                   rows(('k_proj', 'v_proj'), Piece('kv_heads', d)),
                   cols(f'{o}.weight', Piece('q_heads', d)))
        if sinks:
            tensors += (rows('sinks', Piece('q_heads')),)
        if head_gate:
            tensors += (rows(head_gate, Piece('q_heads')),)
        return BlockSplit(axes, tensors, row_parallel=(o,), caches=(('kv_heads', (Piece('kv_heads'),)),),
                          config=(('head_dim', d),))

    return split


class GQAProjections(nn.Module):
    """``qkv_proj`` (packed ``q_proj``, ``k_proj``, ``v_proj``) and ``o_proj``, biases when
    ``attention_bias``.

    Args:
        config: the HF config (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` or none, ``attention_bias``; absent: no biases).
        layer_idx: index into ``StepContext.kv_caches``.
        bias: the projections' biases; None: ``config.attention_bias`` (a family whose reference
            ignores that field passes False).
    """

    def __init__(self, config, layer_idx: int, bias: bool | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention_head_dim(config)
        if bias is None:
            bias = getattr(config, 'attention_bias', False)      # MiniMax has no such field: no biases
        kv = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {'q_proj': self.num_heads * self.head_dim, 'k_proj': kv,
                                                          'v_proj': kv}, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, hidden]`` → ``q [T, num_heads, head_dim]``, ``k`` and ``v [T, num_kv_heads,
        head_dim]`` (before any RoPE)."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        return (q.reshape(T, self.num_heads, self.head_dim), k.reshape(T, self.num_kv_heads, self.head_dim),
                v.reshape(T, self.num_kv_heads, self.head_dim))


class RotaryGQA(GQAProjections):
    """Grouped-query attention over the paged KV cache: :class:`GQAProjections`, RoPE on the
    leading ``rotary_dim`` channels of q and k when the forward gets tables, the paged attention
    with softmax scale ``scale`` (:meth:`attend`: a variant with another kernel overrides it).

    Attributes:
        plain_attend: :meth:`attend` is the plain causal paged attention, so a float32 decode
            step may run :func:`~.attention.fused_attention_decode` in its place. A subclass
            that overrides :meth:`attend` must set it in its own body (False for another
            kernel, True for a wrapper that still computes the plain attention); defining one
            without it raises TypeError, so no variant keeps or loses the fused path by accident.

    Args:
        config: as :class:`GQAProjections` (this rank's head counts under TP).
        layer_idx: index into ``StepContext.kv_caches``.
        scale: the softmax scale; None: ``head_dim ** -0.5``.
        bias: as :class:`GQAProjections`.
    """

    plain_attend: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if 'attend' in cls.__dict__ and 'plain_attend' not in cls.__dict__:
            raise TypeError(f'{cls.__qualname__} overrides attend: set plain_attend in its body (True only when '
                            'attend still computes the plain paged attention the fused decode step replaces)')

    def __init__(self, config, layer_idx: int, scale: float | None = None, bias: bool | None = None):
        super().__init__(config, layer_idx, bias)
        self.scale = self.head_dim ** -0.5 if scale is None else float(scale)

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)`` ``[T, rotary_dim]`` or
        None (no positions); writes this layer's K/V into the cache. A float32 decode step of the
        plain paged attention runs fused (:func:`~.attention.fused_attention_decode`); a variant
        whose :attr:`plain_attend` is False always runs the unfused path."""
        if self.plain_attend:
            fused = fused_attention_decode(self, hidden, ctx, rotary)
            if fused is not None:
                return self.o_proj(fused)
        q, k, v = self.project(hidden)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return self.o_proj(self.attend(q, k, v, ctx).reshape(hidden.shape[0], -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``q [T, heads, head_dim]``, ``k, v [T, kv_heads, head_dim]`` → ``[T, heads, head_dim]``:
        writes k / v into this layer's cache and attends causally over every earlier position."""
        return attention(q, k, v, ctx, self.layer_idx, self.scale)
