"""Rotary position embedding as the checkpoint's ``rope_parameters`` define it.

The inverse frequencies and the cos/sin scale come from ``transformers``' own functions: the
architecture's ``compute_default_rope_parameters`` for ``rope_type='default'`` and
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for every other type, so a scaled
context (YaRN, linear, Llama-3, proportional) rotates exactly as the reference does. What stays
here is the table lookup ``cos/sin(position * inv_freq) * attention_scaling``::

    inv_freq [R/2], attention_scaling  <- transformers(config)      (once, at construction)
    positions [T] -> emb [T, R] = cat(p * inv_freq, p * inv_freq)
    cos, sin [T, R] = cos(emb) * scaling, sin(emb) * scaling         (float32, then the model dtype)

``R`` (the rotary width) is ``2 * len(inv_freq)``: the leading ``R`` channels of each head are
rotated (Qwen3-Next's partial rotary), the rest pass through.

Refused with a ``ValueError`` naming the field (an engine that loads a model matches it):

- ``rope_type`` ``'dynamic'`` and ``'longrope'``: ``transformers`` recomputes their frequencies
  from the longest position of each forward call and keeps them across calls, so the rotation
  of a cached key depends on how the prompt was chunked and which requests ran before; an
  engine with chunked prefill and a prefix cache cannot reproduce that.
- a ``rope_type`` ``transformers`` does not define, and per-layer-type (nested) parameters
  unless the family builds one table per layer type (``RotaryEmbedding(config, layer_type)``);
- a rotary width other than ``head_dim`` for an architecture that rotates whole heads (Qwen3's
  ``transformers`` code cannot run one either).
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

__all__ = ['RotaryEmbedding', 'rope_init_function', 'SEQUENCE_DEPENDENT_ROPE_TYPES']

# rope types whose frequencies transformers recomputes per forward call from the current length
SEQUENCE_DEPENDENT_ROPE_TYPES = ('dynamic', 'longrope')

# model_type -> (transformers modeling module, rotary class, rotates only a leading fraction of each head)
_ARCH = {
    'qwen3': ('transformers.models.qwen3.modeling_qwen3', 'Qwen3RotaryEmbedding', False),
    'granitemoehybrid': ('transformers.models.granitemoehybrid.modeling_granitemoehybrid',
                         'GraniteMoeHybridRotaryEmbedding', False),
    'granitemoe_swa': ('transformers.models.granitemoe_swa.modeling_granitemoe_swa', 'GraniteMoeSWARotaryEmbedding',
                       False),
    'lara_mini': ('transformers.models.lara_mini.modeling_lara_mini', 'LaraMiniRotaryEmbedding', False),
    'lfm3': ('transformers.models.lfm3.modeling_lfm3', 'Lfm3RotaryEmbedding', False),
    'lfm2': ('transformers.models.lfm2.modeling_lfm2', 'Lfm2RotaryEmbedding', False),
    'lfm2_moe': ('transformers.models.lfm2_moe.modeling_lfm2_moe', 'Lfm2MoeRotaryEmbedding', False),
    'falcon_h1': ('transformers.models.falcon_h1.modeling_falcon_h1', 'FalconH1RotaryEmbedding', False),
    'olmo_hybrid': ('transformers.models.olmo_hybrid.modeling_olmo_hybrid', 'OlmoHybridRotaryEmbedding', False),
    'zamba2': ('transformers.models.zamba2.modeling_zamba2', 'Zamba2RotaryEmbedding', False),
    'bamba': ('transformers.models.bamba.modeling_bamba', 'BambaRotaryEmbedding', True),
    'minimax': ('transformers.models.minimax.modeling_minimax', 'MiniMaxRotaryEmbedding', False),
    'bailing_hybrid': ('transformers.models.bailing_hybrid.modeling_bailing_hybrid', 'BailingHybridRotaryEmbedding',
                       False),
    'qwen3_next': ('transformers.models.qwen3_next.modeling_qwen3_next', 'Qwen3NextRotaryEmbedding', True),
    'qwen3_5_text': ('transformers.models.qwen3_5.modeling_qwen3_5', 'Qwen3_5TextRotaryEmbedding', True),
    'qwen3_5_moe_text': ('transformers.models.qwen3_5_moe.modeling_qwen3_5_moe', 'Qwen3_5MoeTextRotaryEmbedding', True),
}


def _rope_parameters(config, layer_type: str | None = None) -> dict:
    """The flat ``rope_parameters`` dict of ``config`` (``transformers`` moves a ``rope_scaling``
    of config.json there when it loads the config).

    Raises:
        ValueError: parameters nested per layer type (``layer_type`` None), no entry for
            ``layer_type``, or no ``rope_type``.
    """
    params = getattr(config, 'rope_parameters', None)
    if layer_type is not None:
        entry = params.get(layer_type) if isinstance(params, dict) else None
        if not isinstance(entry, dict) or 'rope_type' not in entry:
            raise ValueError(f'rope_parameters must hold a dict with a rope_type for each attention layer type, '
                             f'got {entry!r} for {layer_type!r}')
        return entry
    if not isinstance(params, dict) or 'rope_type' not in params:
        raise ValueError(f'rope_parameters must be one flat dict with a rope_type, got {params!r} '
                         '(per-layer-type rope parameters are not supported)')
    return params


def rope_init_function(config, layer_type: str | None = None):
    """The ``transformers`` function computing ``(inv_freq [R/2] float32, attention_scaling)`` for
    ``config`` (for ``layer_type``'s entry of parameters nested per layer type, when given), and
    whether the architecture rotates only the leading channels of each head.

    Returns:
        ``(fn, partial)``: ``fn(config) -> (inv_freq, attention_scaling)``.

    Raises:
        ValueError: an architecture without a rope table here, or ``rope_parameters.rope_type``
            that is sequence-dependent (``dynamic``, ``longrope``) or unknown to ``transformers``.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if config.model_type not in _ARCH:
        raise ValueError(f'no rotary embedding for model_type {config.model_type!r}')
    module, cls, partial = _ARCH[config.model_type]
    rope_type = _rope_parameters(config, layer_type)['rope_type']
    if rope_type in SEQUENCE_DEPENDENT_ROPE_TYPES:
        raise ValueError(f'rope_parameters.rope_type={rope_type!r} is not supported: transformers recomputes its '
                         'frequencies from the length of each forward call, which chunked prefill and the prefix '
                         'cache cannot reproduce')
    if rope_type == 'default':
        return getattr(importlib.import_module(module), cls).compute_default_rope_parameters, partial
    if rope_type not in ROPE_INIT_FUNCTIONS:
        known = ', '.join(['default', *sorted(set(ROPE_INIT_FUNCTIONS) - set(SEQUENCE_DEPENDENT_ROPE_TYPES))])
        raise ValueError(f'rope_parameters.rope_type={rope_type!r} is not supported; supported: {known}')
    return ROPE_INIT_FUNCTIONS[rope_type], partial


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., "RoFormer", 2021), half-rotation layout, with the
    frequencies and scale of the checkpoint's ``rope_parameters`` (see the module docstring).

    Args:
        config: the model's ``transformers`` config (``model_type``, ``rope_parameters``,
            ``head_dim``/``hidden_size``/``num_attention_heads``, ``max_position_embeddings``).
        layer_type: the key of ``rope_parameters`` nested per layer type (LFM3's
            ``'sliding_attention'`` / ``'full_attention'``) whose table this is; None: flat parameters.

    Attributes:
        inv_freq: ``[R/2]`` float32 on the CPU, as ``transformers`` computed it.
        inv_freq_twice: ``[R]`` float32 on the CPU, ``inv_freq`` twice (the angles' factors).
        rotary_dim: ``R``, rotated channels per head (even, ``<= head_dim``).
        attention_scaling: factor on cos and sin (1.0 except for YaRN-like types).

    Raises:
        ValueError: see :func:`rope_init_function`; or ``R != head_dim`` for an architecture that
            rotates whole heads (field ``rope_parameters.partial_rotary_factor``).
    """

    def __init__(self, config, layer_type: str | None = None):
        super().__init__()
        fn, partial = rope_init_function(config, layer_type)
        with torch.device('cpu'):  # real values even when the model is built on the meta device
            inv_freq, scaling = fn(config) if layer_type is None else fn(config, layer_type=layer_type)
        # a plain float32 attribute, not a buffer: neither ``to_empty`` nor a dtype cast touches it
        self.inv_freq = inv_freq.detach().to('cpu', torch.float32)
        # [R]: inv_freq twice, so the angles come out as cat((freqs, freqs)) without a cat op a step
        # (each element is the same one product); an attribute, so a decode graph holds it
        self.inv_freq_twice = torch.cat((self.inv_freq, self.inv_freq))
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.attention_scaling = float(scaling)
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        if self.rotary_dim > head_dim or (not partial and self.rotary_dim != head_dim):
            factor = _rope_parameters(config, layer_type).get('partial_rotary_factor')
            raise ValueError(f'rope_parameters.partial_rotary_factor={factor!r} gives {self.rotary_dim} '
                             f'rotary channels, but {config.model_type} rotates all {head_dim} channels of a head')

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` (int64 token positions) → ``(cos, sin)`` each ``[T, rotary_dim]`` in ``dtype``."""
        twice = self._on_device.get(positions.device)
        if twice is None:
            twice = self._on_device[positions.device] = self.inv_freq_twice.to(positions.device)
        emb = positions.float()[:, None] * twice[None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:   # x * 1.0 is x: two ops fewer a step for most rope types
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
