"""The contract between the engine and a model class: :class:`CausalLM`.

Every class of :data:`~lmdeploy.pytorch.models.MODEL_REGISTRY` derives from :class:`CausalLM`,
which owns the shell every family used to copy (build the decoder stack and ``lm_head`` from
the text config, ``forward``, ``compute_logits``, the weight-loading loop) and declares each
optional capability with its default. The engine, the loader, tensor parallelism and
speculative decoding read these declarations; none of them probes a model with ``getattr``.
::

    capability          declared as                       default (the family has none)
    config audit        config_fields, check_config       {} / accepts every config
    rope fields         rotary_class                      RotaryEmbedding (None: reads no rope field)
    caches              layer_cache_specs(config, dtype)  (required; cache_specs checks the config first)
    tensor parallelism  parallel_plan                     None: tp=1 only
    MTP head            mtp_head ('module:Class')         None: no speculative MTP
    turn-end checkpoints decode_state_equals_prefill      True
    images              supports_images, image_inputs,    False / None / refuses images
                        forward_images, check_multimodal

A family writes its decoder stack (``model_class``), its ``check_config`` and ``layer_cache_specs``,
and overrides only what differs (``rename_weight`` / ``load_tensor`` for checkpoint layouts,
``compute_logits`` for a logit scale, the image methods for a vision tower).
"""
from __future__ import annotations

from typing import ClassVar, Iterable

import torch
from torch import nn

from ..cache_specs import LayerCacheSpec
from ..model_inputs import StepContext
from .layers import Linear, WeightLoader, load_weights
from .parallel_plan import ParallelPlan
from .rope import RotaryEmbedding

__all__ = ['CausalLM', 'MTPHead', 'TINY_ATTENTION']

#: the attention shape most families' ``tiny_config`` starts from: 4 query heads, 2 KV heads of 16
#: channels, a 64-wide model, untied embeddings
TINY_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      rope_theta=10000.0)


class CausalLM(nn.Module):
    """A causal LM the engine can serve: ``model`` (the decoder stack, ``ctx`` → hidden
    ``[T, hidden_size]``) and ``lm_head`` (``hidden_size`` → ``vocab_size``, no bias).

    Args:
        config: the model's ``transformers`` config (a vision-language one carries a
            ``text_config``; the stack and ``lm_head`` are built from ``config.get_text_config()``).

    Raises:
        ValueError: what the class's :meth:`check_config` refuses (names the field).
    """

    #: the decoder stack, built from the text config
    model_class: ClassVar[type[nn.Module]]
    #: every config field ``transformers`` reads for this class, and what the engine does with
    #: it (``'implemented'`` / ``'checked'`` / ``'inert'``, see :mod:`.config_audit`)
    config_fields: ClassVar[dict[str, str]] = {}
    #: the rotary embedding the config audit builds from the text config to refuse rope
    #: parameters it cannot reproduce; None for a family that reads no rope field (or checks
    #: its own in :meth:`check_config`)
    rotary_class: ClassVar[type[RotaryEmbedding] | None] = RotaryEmbedding
    #: how tensor parallelism splits the layers; None: the family runs with tp=1 only
    parallel_plan: ClassVar[ParallelPlan | None] = None
    #: ``'module:Class'`` (under ``lmdeploy.pytorch.models``) of the checkpoint's multi-token
    #: prediction head that speculative decoding loads; None: the family has none
    mtp_head: ClassVar[str | None] = None
    #: whether the state after decode steps equals the state a prefill of the same tokens
    #: computes; False where the reference treats generated tokens differently from prompt
    #: tokens (Zamba2's dt clamp), and the engine then keeps no turn-end checkpoints
    #: (``decode_save_last`` is ignored), whose restore would differ from recomputing them
    decode_state_equals_prefill: ClassVar[bool] = True
    #: whether requests may carry pixels (an instance may turn it off, e.g. a checkpoint
    #: without a vision tower)
    supports_images: bool = False
    #: the text-config fields of the family's tiny seeded random checkpoint
    #: (:mod:`lmdeploy.tools.make_tiny_model`: a few layers of width 64, every layer kind and
    #: feature of the family exercised), passed to the ``transformers`` config class with the
    #: vocabulary and special token ids. Given here, ``rope_theta`` (with
    #: ``partial_rotary_factor`` / ``mrope_section`` where given) is folded into
    #: ``rope_parameters``, and ``full_attention_interval`` (not a config field) derives
    #: ``layer_types`` from ``num_hidden_layers``. Empty: the family has no tiny model
    #: (``make_tiny_model`` raises ``ValueError``).
    tiny_config: ClassVar[dict] = {}
    #: published-checkpoint spellings the tiny ``config.json`` uses where ``transformers``
    #: writes another: ``{transformers field: published field}`` (``transformers`` reads both)
    tiny_published_fields: ClassVar[dict[str, str]] = {}
    #: whether the tiny ``config.json`` also mirrors ``rope_parameters['rope_theta']`` as a
    #: top-level ``rope_theta``, as the family's published configs do
    tiny_top_level_rope_theta: ClassVar[bool] = False
    #: the config key (in the text config) the published multi-token-prediction checkpoints
    #: count their MTP layers under; None: the family publishes no ``mtp.*`` head
    tiny_mtp_layers_key: ClassVar[str | None] = None
    #: state-dict prefixes of ``transformers``' fused MoE experts (``gate_up_proj`` /
    #: ``down_proj``) that the tiny checkpoint stores one tensor per expert, as published
    tiny_expert_prefixes: ClassVar[tuple[str, ...]] = ('mlp.experts.',)
    #: whether the tiny ``config.json`` keeps a default ``time_step_limit`` of ``(0, inf)``
    #: (written as the non-standard JSON ``Infinity`` that Python's ``json`` reads); the others
    #: drop it
    tiny_keeps_infinite_time_step_limit: ClassVar[bool] = False

    @staticmethod
    def tiny_multimodal_config(text_config) -> dict | None:
        """The vision-language wrapper's fields for the tiny checkpoint around ``text_config``
        (a built ``transformers`` text config): ``vision_config`` (a dict) and the image token
        ids; None (the base): a text-only family."""
        return None

    @staticmethod
    def tiny_config_json(config_dict: dict) -> None:
        """Rewrite the tiny ``config.json`` dict in place into the family's published
        spelling where :attr:`tiny_published_fields` cannot say it; the base changes nothing."""

    @staticmethod
    def check_config(config) -> None:
        """Refuse a config this class cannot run exactly (``ValueError`` naming the field);
        the base accepts every config."""

    @classmethod
    def cache_specs(cls, config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """What each layer caches (one :class:`LayerCacheSpec` per layer, cached tensors in
        ``dtype`` unless a spec says otherwise), for ``config`` or a rank's local config.

        Raises:
            ValueError: what :meth:`check_config` refuses (names the field).
        """
        cls.check_config(config)
        return cls.layer_cache_specs(config, dtype)

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """:meth:`cache_specs` of a config :meth:`check_config` accepted (the family's own)."""
        raise NotImplementedError

    def __init__(self, config):
        super().__init__()
        self.check_config(config)
        self.config = config
        text = config.get_text_config()
        self.model = self.model_class(text)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Flat batch → final hidden states ``[T, hidden_size]``."""
        return self.model(ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()

    # --- weights -------------------------------------------------------------------------

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether ``lm_head`` takes the embedding when the checkpoint has no ``lm_head.weight``."""
        return bool(getattr(self.config, 'tie_word_embeddings', False))

    def rename_weight(self, name: str) -> str | None:
        """A checkpoint tensor name → this module's parameter name; None drops the tensor."""
        return name

    def load_tensor(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
        """Copy a (renamed) tensor whose layout is the family's own (e.g. one expert of fused
        experts) and return True; False leaves it to the generic loader."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters (through :meth:`rename_weight` and
        :meth:`load_tensor`; packed projections are filled from their separate tensors).

        Raises:
            KeyError: a tensor has no matching parameter.
            ValueError: a shape mismatch, or parameters (or parts of them) left unfilled.
        """
        load_weights(self, weights, self.tie_word_embeddings, rename=self.rename_weight, special=self.load_tensor)

    # --- images (a family with a vision tower overrides these) ---------------------------

    def check_multimodal(self, token_ids: list[int], multimodal) -> None:
        """Refuse multimodal inputs the forward could not place.

        Raises:
            ValueError: any input with data, for a class without images.
        """
        if any(m.data is not None for m in multimodal):
            raise ValueError(f'model_type {self.config.model_type!r} does not accept images in this engine')

    def image_inputs(self, seqs, history_lens: list[int], q_seqlens: list[int], q_start_loc: list[int]):
        """What a forward over these chunks needs from their images (runs the vision tower, on
        rank 0), or None when no chunk has one; always None for a class without images.

        Args:
            seqs: per chunk, its :class:`~lmdeploy.pytorch.paging.sequence.Sequence`.
            history_lens, q_seqlens, q_start_loc: per chunk, as in :class:`StepContext`.
        """
        return None

    def forward_images(self, ctx: StepContext, images) -> torch.Tensor:
        """The forward with :meth:`image_inputs`' output (on any device): ``[T, hidden_size]``."""
        raise NotImplementedError(f'{type(self).__name__} has no vision tower')


class MTPHead(nn.Module):
    """The contract of a multi-token-prediction head (a class named by :attr:`CausalLM.mtp_head`),
    which :mod:`lmdeploy.pytorch.spec_decode.mtp` builds, loads and runs.

    Args (of a subclass):
        config: the target's config (a vision-language one is read through its text config).
    """

    #: whether tensor parallelism may shard the head like the target's layers
    supports_tp: ClassVar[bool] = False

    @staticmethod
    def cache_spec(config, dtype: torch.dtype) -> LayerCacheSpec:
        """The cache of the head's one layer."""
        raise NotImplementedError

    @staticmethod
    def wants(name: str, config) -> bool:
        """Whether checkpoint tensor ``name`` belongs to the head."""
        raise NotImplementedError

    def draft(self, target: CausalLM, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """One drafter step: the target's final hidden states ``[T, H]`` at ``ctx.positions``,
        whose next tokens are ``ctx.input_ids`` → the head's hidden states ``[T, H]``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, H]`` → ``[N, vocab]`` float32 logits of the head's own output layer; None (the
        default) when it has none and the target's ``lm_head`` is used."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the head's tensors in (others are ignored); returns how many were copied."""
        raise NotImplementedError
