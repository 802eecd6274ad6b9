"""The decoder layer and decoder stack every family is wired from.

Almost every family's layer is the same pre-norm residual pair around a token mixer and an
MLP; what differs is which mixer and MLP a layer gets, how the mixer is called (with the step's
rotary tables or not), the attribute names the checkpoint uses, and a few scalars. Those are
arguments here, so a family file only chooses blocks::

    layer:  h = x + mixer(norm_1(x))        (x, h: [T, hidden])
            y = h + mlp(norm_2(h))

    stack:  x = embed(input_ids); rotary = rotary_table(positions)
            for each layer: x = layer(x, rotary, ctx)
            return final_norm(x)

The residual add and the second norm run as one call (:meth:`RMSNorm.forward_add`: one native
pass for float32 on CPU), which is also where a decode step's glue is cut for every family at
once. A family whose layer is not this shape (a second residual scale, post-mixer norms, a
parallel mixer) subclasses :class:`DecoderLayer` and overrides :meth:`DecoderLayer.forward`,
keeping the construction and the names.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ...model_inputs import StepContext
from ..layers import RMSNorm

__all__ = ['DecoderLayer', 'DecoderStack', 'MixerCall', 'mixer_ctx', 'mixer_rotary_ctx', 'mixer_cos_sin_ctx',
           'mixer_nope_ctx', 'mixer_table_ctx', 'RotaryTables', 'SharedMLPDecoderLayer', 'UniformStack']

#: how a layer calls its token mixer: ``call(mixer, normed [T, hidden], rotary, ctx) -> [T, hidden]``
MixerCall = Callable[[nn.Module, torch.Tensor, Any, StepContext], torch.Tensor]


def mixer_ctx(mixer: nn.Module, normed: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
    """A mixer without positions: recurrent and state-space layers, NoPE attention: ``mixer(x, ctx)``."""
    return mixer(normed, ctx)


def mixer_rotary_ctx(mixer: nn.Module, normed: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
    """A mixer that takes the step's rotary object as one argument: ``mixer(x, rotary, ctx)``."""
    return mixer(normed, rotary, ctx)


def mixer_cos_sin_ctx(mixer: nn.Module, normed: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
    """A mixer that takes the rotary ``(cos, sin)`` tables apart: ``mixer(x, cos, sin, ctx)``."""
    cos, sin = rotary
    return mixer(normed, cos, sin, ctx)


def _named(index: int, doc: str) -> property:
    """A read-only property for the module a layer registered under ``self._names[index]``
    (None when it has none). It reads the module registry, not ``getattr``: a checkpoint that
    calls its mixer ``mixer`` (Mamba, Nemotron-H) registers it under the property's own name."""
    return property(lambda self: self._modules.get(self._names[index]), doc=doc)


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: ``h = x + m·mixer(norm_1(x))``, ``y = h + m·mlp(norm_2(h))``,
    ``x, h, y: [T, hidden]`` in the model dtype, ``m`` the residual multiplier (1 for most
    families; Granite's ``residual_multiplier``).

    The modules are registered under the checkpoint's names, so weights load without renames.

    Args:
        hidden_size: model width (channels).
        eps: the norms' epsilon.
        mixer: the token mixer (attention, linear attention, state-space, short conv).
        mlp: the channel mixer, ``[T, hidden] -> [T, hidden]``; None for a layer without one
            (then ``y = h`` and no second norm is made).
        call: how the mixer is called (:func:`mixer_ctx`, :func:`mixer_rotary_ctx`,
            :func:`mixer_cos_sin_ctx`, or the family's own :data:`MixerCall`).
        names: attribute names of ``(mixer, mlp, norm_1, norm_2)``.
        zero_centered: the norms store ``w - 1`` (Qwen3-Next, Qwen3.5).
        residual_multiplier: ``m`` above.
        norm: the norm class, called as ``norm(hidden_size, eps)``; defaults to
            :class:`~..layers.RMSNorm` with ``zero_centered``.
    """

    def __init__(self, hidden_size: int, eps: float, mixer: nn.Module, mlp: nn.Module | None,
                 call: MixerCall = mixer_ctx,
                 names: tuple[str, str, str, str] = ('self_attn', 'mlp', 'input_layernorm', 'post_attention_layernorm'),
                 zero_centered: bool = False, residual_multiplier: float = 1.0,
                 norm: Callable[[int, float], nn.Module] | None = None):
        super().__init__()
        make_norm = norm or (lambda size, e: RMSNorm(size, e, zero_centered=zero_centered))
        self._names = names
        self._call = call
        self.residual_multiplier = residual_multiplier
        setattr(self, names[0], mixer)
        setattr(self, names[2], make_norm(hidden_size, eps))
        if mlp is not None:
            setattr(self, names[1], mlp)
            setattr(self, names[3], make_norm(hidden_size, eps))
        # the residual add and norm_2 as one call (RMSNorm.forward_add) or, for another norm
        # class, as two; decided here once rather than per call
        self._fused_add_norm = isinstance(self.norm_2, RMSNorm)

    mixer = _named(0, 'The token mixer (registered under ``names[0]``).')
    mlp_block = _named(1, 'The channel mixer (registered under ``names[1]``), or None.')
    norm_1 = _named(2, 'The norm before the mixer (``names[2]``).')
    norm_2 = _named(3, 'The norm before the MLP (``names[3]``), or None without an MLP.')

    def mix(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``mixer(norm_1(hidden))`` ``[T, hidden]`` through the layer's call convention."""
        return self._call(self.mixer, self.norm_1(hidden), rotary, ctx)

    def forward(self, hidden: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` → ``[T, hidden]``; ``rotary`` is whatever the stack's rotary table
        returned for the step (``(cos, sin)``, a per-kind dict, or None)."""
        mixed = self.mix(hidden, rotary, ctx)
        mlp = self.mlp_block
        m = self.residual_multiplier
        if mlp is None:
            return hidden + (mixed if m == 1.0 else mixed * m)
        if m == 1.0:
            hidden, normed = self.norm_2.forward_add(mixed, hidden) if self._fused_add_norm \
                else self._add_norm(mixed, hidden)
            return hidden + self.channel_mix(normed)
        hidden = hidden + mixed * m
        return hidden + self.channel_mix(self.norm_2(hidden)) * m

    def channel_mix(self, normed: torch.Tensor) -> torch.Tensor:
        """``mlp(norm_2(h))``: ``[T, hidden]`` → ``[T, hidden]``. A layer whose channel mixer is
        more than the one module (Granite's routed experts plus an always-on shared MLP) overrides
        this and keeps :meth:`forward`."""
        return self.mlp_block(normed)

    def _add_norm(self, mixed: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = hidden + mixed
        return total, self.norm_2(total)


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm, and the rotary table the layers share.

    ``forward(ctx)`` returns the final hidden states ``[T, hidden]`` of the step's ``T`` flat
    tokens (``ctx.input_ids`` ``[T]`` int64, or ``inputs_embeds [T, hidden]`` when a family
    merges image features first).

    Args:
        config: the text config (``vocab_size``, ``hidden_size``, ``rms_norm_eps``).
        layers: the decoder layers, each called as ``layer(hidden, rotary, ctx)``.
        rotary: the rotary module, called as ``rotary(positions [T], dtype)``, or None (NoPE,
            state-space-only stacks); what it returns is passed to every layer unchanged.
        rotary_dtype: the dtype of the rotary tables; default the hidden dtype.
        norm: the final norm module; default :class:`~..layers.RMSNorm` over ``hidden_size``.
        names: attribute names of ``(embedding, layers, final norm)``, as the checkpoint spells them.
    """

    def __init__(self, config, layers: Iterable[nn.Module], rotary: nn.Module | None = None,
                 rotary_dtype: torch.dtype | None = None, norm: nn.Module | None = None,
                 names: tuple[str, str, str] = ('embed_tokens', 'layers', 'norm')):
        super().__init__()
        self._names = names
        self.rotary_dtype = rotary_dtype
        setattr(self, names[0], nn.Embedding(config.vocab_size, config.hidden_size))
        setattr(self, names[1], nn.ModuleList(layers))
        setattr(self, names[2], norm if norm is not None else RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary = rotary

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` of ``input_ids [T]``."""
        return getattr(self, self._names[0])(input_ids)

    def rotary_tables(self, ctx: StepContext, dtype: torch.dtype):
        """The step's rotary object (None without a rotary module)."""
        if self.rotary is None:
            return None
        return self.rotary(ctx.positions, self.rotary_dtype or dtype)

    def forward(self, ctx: StepContext, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``; see the class docstring."""
        hidden = self.embed(ctx.input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary_tables(ctx, hidden.dtype)
        for layer in getattr(self, self._names[1]):
            hidden = layer(hidden, rotary, ctx)
        return getattr(self, self._names[2])(hidden)


# ---- general options added for the families whose layers pick per-kind tables or add a second MLP ----


def mixer_nope_ctx(mixer: nn.Module, normed: torch.Tensor, rotary, ctx: StepContext) -> torch.Tensor:
    """An attention mixer that takes a rotary argument, in a layer without positions (NoPE
    global layers beside rotary ones): ``mixer(x, None, ctx)``."""
    return mixer(normed, None, ctx)


def mixer_table_ctx(key) -> MixerCall:
    """The call of a layer whose stack hands a dict of rotary tables (:class:`RotaryTables`):
    ``mixer(x, rotary.get(key), ctx)``; a key without a table passes None (no positions)."""

    def call(mixer: nn.Module, normed: torch.Tensor, rotary: dict, ctx: StepContext) -> torch.Tensor:
        return mixer(normed, rotary.get(key), ctx)

    return call


class RotaryTables(nn.Module):
    """Several rotary modules keyed by what selects them (a layer type, a RoPE base), for a stack
    whose layers do not share one table; a :class:`DecoderStack`'s ``rotary``.

    ``forward(positions [T] int64, dtype)`` returns ``{key: (cos, sin)}``, each ``[T, rotary_dim]``
    in ``dtype``; the layers pick theirs with :func:`mixer_table_ctx`. The modules are kept in a
    plain dict (not submodules): rotary tables hold no parameters, so the state dict is unchanged.

    Args:
        rotaries: key → a module called as ``rotary(positions, dtype)``.
    """

    def __init__(self, rotaries: dict):
        super().__init__()
        self.rotaries = dict(rotaries)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """``{key: rotary(positions, dtype)}`` for every key."""
        return {key: rotary(positions, dtype) for key, rotary in self.rotaries.items()}


class SharedMLPDecoderLayer(DecoderLayer):
    """A :class:`DecoderLayer` whose channel mixer is two modules on the same normed input,
    summed: ``y = h + m·(mlp(norm_2(h)) + shared(norm_2(h)))`` (Granite-4.0-H and Granite-SWA:
    routed experts and an always-on shared MLP, each under its checkpoint name, either of them
    the ``shared`` one). Only :meth:`DecoderLayer.channel_mix` differs.

    Args:
        *args, **kwargs: as :class:`DecoderLayer` (``mlp`` is required).
        shared: ``(name, module)``: the second channel mixer ``[T, hidden] -> [T, hidden]`` and
            its attribute name; a None module registers the name as None and the layer is a
            plain :class:`DecoderLayer`.
    """

    def __init__(self, *args, shared: tuple[str, nn.Module | None], **kwargs):
        super().__init__(*args, **kwargs)
        self._shared_name = shared[0]
        setattr(self, shared[0], shared[1])

    def channel_mix(self, normed: torch.Tensor) -> torch.Tensor:
        """``mlp(n) + shared(n)`` ``[T, hidden]`` (``mlp(n)`` alone without a shared module)."""
        out = self.mlp_block(normed)
        shared = self._modules.get(self._shared_name)
        return out if shared is None else out + shared(normed)


class UniformStack(DecoderStack):
    """A :class:`DecoderStack` declared by two class attributes, for the common case where every
    layer is ``layer_class(config, layer_idx)`` and one rotary module (or none) serves them all:
    a family's ``model_class`` then names its blocks instead of repeating the constructor.

    Attributes:
        layer_class: called as ``layer_class(config, i)`` for ``i < num_hidden_layers``.
        rotary_class: called as ``rotary_class(config)``; None for no positions.
    """

    layer_class: ClassVar[Callable[[Any, int], nn.Module]]
    rotary_class: ClassVar[Callable[[Any], nn.Module] | None] = None

    def __init__(self, config):
        cls = type(self)        # read through the class: a plain function stays unbound
        super().__init__(config, (cls.layer_class(config, i) for i in range(config.num_hidden_layers)),
                         rotary=None if cls.rotary_class is None else cls.rotary_class(config))
