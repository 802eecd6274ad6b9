"""Sliding-window and global attention layers side by side (Lara-4-Mini, LFM3): each attention
layer's window from ``layer_types`` / ``sliding_window``, the cache spec it declares, and the
q/k-norm attention that reads only its window's keys::

    layer_types  'sliding_attention'  window = sliding_window   SlidingWindowSpec
                 'full_attention'     window = None             FullAttentionSpec (every block kept)
                 the family's other kind (Gated DeltaNet, short conv): 0, its own spec

A window of ``w`` keys includes the query's own position (``transformers``' convention). The
attention runs through the registry's ``paged_window_attention``
(:mod:`~lmdeploy.pytorch.kernels.window_attention`), which reads only the window's blocks.
"""
from __future__ import annotations

import torch

from ...cache_specs import FullAttentionSpec, LayerCacheSpec, SlidingWindowSpec
from ...kernels import get_kernel
from ...model_inputs import StepContext
from ..config_audit import check_layer_types
from ..layers import Linear, apply_rotary
from .attention import QKNormAttention, attention_head_dim

__all__ = ['SLIDING', 'FULL', 'WindowAttention', 'layer_windows', 'window_cache_specs']

SLIDING, FULL = 'sliding_attention', 'full_attention'


def layer_windows(config, other: str | None = None) -> list[int | None]:
    """Each layer's window in tokens: ``sliding_window`` for ``'sliding_attention'``, None for
    ``'full_attention'``, 0 for the family's non-attention kind ``other``.

    Args:
        config: reads ``layer_types``, ``num_hidden_layers``, ``sliding_window``.
        other: the one non-attention layer kind the family has (e.g. ``'linear_attention'``,
            ``'conv'``), or None.

    Raises:
        ValueError: ``layer_types`` does not list one of the kinds per layer, or
            ``sliding_window`` is not an int >= 1 while some layer slides.
    """
    types = check_layer_types(config, ((other,) if other else ()) + (SLIDING, FULL))
    window = getattr(config, 'sliding_window', None)
    if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f'sliding_window must be an int >= 1 for the sliding_attention layers, got {window!r}')
    return [0 if t == other else window if t == SLIDING else None for t in types]


def window_cache_specs(config, dtype: torch.dtype, other_spec: LayerCacheSpec | None = None,
                       other: str | None = None) -> list[LayerCacheSpec]:
    """Per layer (:func:`layer_windows`): ``other_spec`` for a layer of kind ``other``, a
    :class:`SlidingWindowSpec` with its window, or a :class:`FullAttentionSpec` (KV heads x
    ``head_dim`` per token, ``dtype``).

    Raises:
        ValueError: see :func:`layer_windows`.
    """
    heads, dim = config.num_key_value_heads, attention_head_dim(config)
    return [other_spec if w == 0 else FullAttentionSpec(heads, dim, dtype) if w is None
            else SlidingWindowSpec(heads, dim, dtype, w) for w in layer_windows(config, other)]


class WindowAttention(QKNormAttention):
    """Qwen3's attention (q/k RMSNorm per head, GQA, scale ``head_dim ** -0.5``) over the paged KV
    cache with a sliding window when ``window`` is set, rotary only when the forward gets tables,
    and optionally a sigmoid gate per head (``g_proj: hidden -> num_heads``, LFM3's output gate).

    Args:
        config: the HF config (this rank's head counts under TP; ``rms_norm_eps`` for the q/k norms).
        layer_idx: index into ``StepContext.kv_caches``.
        window: keys per query (itself included), None for a global layer.
        head_gate: build ``g_proj`` and gate each head's output with ``sigmoid(g_proj(h))``.
    """

    def __init__(self, config, layer_idx: int, window: int | None, head_gate: bool = False):
        super().__init__(config, layer_idx)
        self.window = window
        self.g_proj = Linear(config.hidden_size, self.num_heads, bias=False) if head_gate else None

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is ``(cos, sin)`` ``[T, rotary_dim]`` or
        None (no positions); writes this layer's K/V into the cache."""
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = get_kernel('paged_window_attention', q.device)(q, k, v, k_cache, v_cache, ctx, self.scale, self.window,
                                                              None)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(hidden))[..., None]
        return self.o_proj(out.reshape(T, -1))
