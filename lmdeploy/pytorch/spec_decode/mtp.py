"""Multi-token prediction (MTP) drafting: the checkpoint's own extra layer drafts a token.

A model family that ships such a layer names its head class as the model class's
``mtp_head`` (``'module:Class'`` under :mod:`lmdeploy.pytorch.models`, in its model file); this
module builds, loads and runs any family's head through that class's small interface
(:class:`~lmdeploy.pytorch.models.base.MTPHead`, which declares every member), with no
per-family branches:

=====================================  =================================================
``Head(config)``                       the head of the (possibly vision-language) config
``Head.cache_spec(config, dtype)``     its layer's cache spec (layer ``num_hidden_layers``)
``Head.wants(name, config)``           whether a checkpoint tensor is the head's
``head.load_weights(weights)``         copy those tensors in (ValueError: none / missing)
``head.draft(target, hidden, ctx)``    ``[T, H]`` → ``[T, H]`` for a step (own KV written)
``head.compute_logits(hidden)``        its own vocabulary head's logits; None: the target's
``Head.supports_tp``                   whether :class:`TPLayout` may shard it
=====================================  =================================================

Heads today: Qwen3-Next / Qwen3.5-MoE (``mtp.*``,
:class:`~lmdeploy.pytorch.models.qwen3_next_mtp.Qwen3NextMTP` /
:class:`~lmdeploy.pytorch.models.qwen3_5_moe.Qwen3_5MoeMTP`) and GLM-5.3-Flash's NextN layer
(``model.layers.{num_hidden_layers}.*``, :class:`~lmdeploy.pytorch.models.glm5_next_mtp.Glm5NextMTP`).

For position ``t`` a head reads the target model's final hidden state at ``t`` and the token
at ``t + 1`` (the *shifted* input) and predicts the token at ``t + 2``. The layer caches its
rows like any paged layer: its cache spec is appended to the model's cache specs (index
``num_hidden_layers``), so its rows sit in every KV block, are checkpointed with the prefix
cache and put to the Store with the other layers (``K_blk`` includes them). Its rows at
position ``t`` need token ``t + 1``: the chunk that ends at a boundary ``b`` reads token ``b``
(lookahead ℓ = 1), which is why the MTP strategy restores only at ``b <= n - 1``.

Loading: the one model loader builds the head beside the model
(:func:`~lmdeploy.pytorch.models.loader.load_model` with ``mtp=True``), under the same layout
and through the same tensor reader on every TP size; :func:`~lmdeploy.pytorch.models.loader.load_mtp_head` is that step alone.

Tensor parallelism (heads with ``supports_tp``): every rank holds its shard of the head
(attention split by head like the target's attention layers, the rest replicated;
:meth:`TPLayout.apply_mtp`) and its slice of the MTP KV. Steps travel as :class:`MTPBatch`
(plain integers); each rank runs them with its own :class:`MTPDrafter` over its own last
forward's hidden states and chain state, and every rank returns the same draft ids (the logits
are gathered over the ranks before the argmax).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model_inputs import StepBatch, StepContext
from ..models import mtp_head_class, mtp_model_types  # noqa: F401  (re-exported)
from ..models.qwen3_next_mtp import MTP_PREFIX, Qwen3NextMTP, mtp_config  # noqa: F401  (re-exported)

__all__ = ['Qwen3NextMTP', 'MTPBatch', 'MTPDrafter', 'mtp_cache_spec',
           'mtp_head_class', 'mtp_model_types', 'MTP_PREFIX']


def mtp_cache_spec(config, dtype: torch.dtype):
    """The cache spec of ``config``'s MTP layer (a text config is accepted too)."""
    return mtp_head_class(config).cache_spec(config, dtype)


@dataclass
class MTPBatch:
    """One MTP step's inputs as plain integers (what rank 0 broadcasts to every TP rank).

    Attributes:
        chained: False: the first step, whose input hidden states are rows of the target's last
            forward; True: a chained step, whose inputs are rows of the previous step's kept
            outputs (:attr:`MTPDrafter.prev`).
        hidden_rows: ``T`` rows of the input hidden states, one per position.
        batch: the step's flat batch (:class:`~lmdeploy.pytorch.model_inputs.StepBatch`): for
            each position the token after it, its position, and per sequence the usual lengths
            and block table (no state slots: the MTP layer is a full-attention layer).
        draft_rows: rows of the step's ``T`` outputs to draft from (argmax of their logits).
            The first step keeps these outputs as ``prev``; a chained step writes them back into
            ``prev`` at ``hidden_rows`` (it drafts from all its rows).
    """
    chained: bool
    hidden_rows: list[int]
    batch: StepBatch
    draft_rows: list[int]


class MTPDrafter:
    """Runs MTP steps from :class:`MTPBatch` es and keeps the chain's hidden states.

    Args:
        model: the target model (its ``embed_tokens``, ``rotary`` and ``compute_logits``).
        mtp: the MTP head (whole, or this rank's shard).
        step: ``(hidden [T, H], ctx) -> [T, H]`` override of :meth:`step` (tests wrap it).
    """

    def __init__(self, model, mtp: nn.Module, step=None):
        self.model, self.mtp = model, mtp
        self._step = step or self.step
        self.prev: torch.Tensor | None = None      # [num drafting sequences, H]: the chain's last outputs

    def step(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """MTP hidden states ``[T, H]`` for ``ctx``'s positions, whose next tokens are ``ctx.input_ids``."""
        return self.mtp.draft(self.model, hidden, ctx)

    @torch.inference_mode()
    def run(self, batch: MTPBatch, last_hidden: torch.Tensor, kv_caches, block_size: int) -> list[int]:
        """Run one step (writing the MTP layer's KV at ``batch.positions``).

        Args:
            batch: the step.
            last_hidden: ``[T_fwd, H]`` the target's last forward hidden states (first step).
            kv_caches, block_size: the cache engine's KV caches and block size.

        Returns:
            ``len(batch.draft_rows)`` draft token ids (greedy), identical on every TP rank.
        """
        dev = last_hidden.device
        source = self.prev if batch.chained else last_hidden
        hidden = source[torch.tensor(batch.hidden_rows, device=dev)]
        ctx = batch.batch.context(dev, kv_caches, [], block_size)
        out = self._step(hidden, ctx)
        if not batch.draft_rows:
            if not batch.chained:
                self.prev = None
            return []
        kept = out[torch.tensor(batch.draft_rows, device=dev)]
        if batch.chained:
            prev = self.prev.clone()
            prev[torch.tensor(batch.hidden_rows, device=dev)] = kept
            self.prev = prev
        else:
            self.prev = kept
        logits = self.mtp.compute_logits(kept)      # None: the head shares the target's lm_head
        return (self.model.compute_logits(kept) if logits is None else logits).argmax(-1).tolist()
