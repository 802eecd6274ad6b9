"""The multi-token-prediction (MTP) head of Qwen3-Next-style checkpoints (the ``mtp.*``
tensors; ``transformers`` ignores them): one extra decoder layer of the family's own kind that
drafts a token.

For position ``t`` the head reads the target model's final hidden state at ``t`` and the token
at ``t + 1`` (the *shifted* input) and predicts the token at ``t + 2``::

    x_t  = fc( concat( pre_fc_norm_embedding(embed(token[t + 1])), pre_fc_norm_hidden(h_t) ) )
    y_t  = norm( layers.0(x_t) )          full attention (own paged KV) + the family's MLP / MoE
    draft logits = lm_head(y_t)           embedding and lm_head shared with the target model

``fc`` is bias-free, ``2 * hidden → hidden``; all norms are zero-centred RMSNorms. A family
derives a head with its layer (:attr:`DecoderLayerMTP.layer_class`) and names it as its model
class's ``mtp_head``.
"""
from __future__ import annotations

import copy
import re
from typing import ClassVar, Iterable

import torch
from torch import nn

from ...cache_specs import FullAttentionSpec
from ...model_inputs import StepContext
from ..base import MTPHead
from ..layers import Linear, RMSNorm, WeightLoader
from .gated_delta_net import FULL, attention_head_dim

__all__ = ['DecoderLayerMTP', 'MTP_PREFIX', 'mtp_config']

MTP_PREFIX = 'mtp.'
_PER_EXPERT = re.compile(r'^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$')


def mtp_config(config):
    """A copy of ``config`` whose layer ``num_hidden_layers`` (the MTP layer) is full attention."""
    cfg = copy.copy(config)
    cfg.layer_types = list(config.layer_types) + [FULL]
    return cfg


class DecoderLayerMTP(MTPHead):
    """The ``mtp.*`` module of a Qwen3-Next-style checkpoint (parameter names without ``mtp.``)
    around one decoder layer of the family's :attr:`layer_class`.

    Args:
        config: the target's text config (``Qwen3NextConfig`` / ``Qwen3_5MoeTextConfig``); the
            MTP layer gets layer index ``num_hidden_layers`` (its KV cache in ``StepContext.kv_caches``).
    """

    def __init__(self, config):
        super().__init__()
        config = config.get_text_config()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = config.num_hidden_layers
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, zero_centered=True)
        self.fc = Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([self.layer_class(mtp_config(config), self.layer_idx)])
        self.norm = RMSNorm(H, eps, zero_centered=True)

    #: the family's full-attention decoder layer, ``(config, layer_idx)`` → module
    layer_class: ClassVar[type[nn.Module]]
    supports_tp = True      # TPLayout.apply_mtp and the loader (TPLayout.shard) split it like the target's layers

    @staticmethod
    def cache_spec(config, dtype: torch.dtype) -> FullAttentionSpec:
        """The cache spec of the MTP layer (a full-attention layer of the target's geometry; a
        vision-language config is read through its text config)."""
        config = config.get_text_config()
        return FullAttentionSpec(config.num_key_value_heads, attention_head_dim(config), dtype)

    @staticmethod
    def wants(name: str, config) -> bool:
        """Whether checkpoint tensor ``name`` belongs to the head (``mtp.*``)."""
        return name.startswith(MTP_PREFIX)

    def draft(self, target, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """One step for the drafter: ``hidden [T, H]`` at ``ctx.positions``, whose next tokens
        are ``ctx.input_ids`` (embedded and rotated with ``target``'s tables) → ``[T, H]``."""
        base = target.model
        embeds = base.embed_tokens(ctx.input_ids)
        cos, sin = base.rotary(ctx.positions, embeds.dtype)
        return self(hidden, embeds, cos, sin, ctx)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """One MTP step.

        Args:
            hidden: ``[T, H]`` the target's final (normed) hidden states at positions
                ``ctx.positions`` (or the previous MTP step's output when chaining drafts).
            next_embeds: ``[T, H]`` embeddings of the token after each position.
            cos, sin: rotary tables of ``ctx.positions``.
            ctx: the positions, block tables and KV caches; writes the MTP layer's K/V.

        Returns:
            ``[T, H]`` normed MTP hidden states (``lm_head`` gives the draft logits).
        """
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        for layer in self.layers:
            x = layer(x, (cos, sin), ctx)
        return self.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the checkpoint's ``mtp.*`` tensors in (other names are ignored).

        Experts may come per expert (published checkpoints) or fused.

        Returns:
            The number of ``mtp.*`` tensors loaded.

        Raises:
            KeyError: an ``mtp.*`` tensor has no parameter here.
            ValueError: a shape mismatch, or MTP parameters the checkpoint lacks (a checkpoint
                without ``mtp.*`` weights cannot run the ``mtp`` method).
        """
        loader = WeightLoader(self)
        experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        count = 0
        for name, tensor in weights:
            if not name.startswith(MTP_PREFIX):
                continue
            count += 1
            name = name[len(MTP_PREFIX):]
            match = _PER_EXPERT.match(name)
            if match:
                experts.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = tensor
            else:
                loader.load(name, tensor)
        for prefix, parts in experts.items():
            num = 1 + max(e for e, _ in parts)
            try:
                gate_up = torch.stack([torch.cat((parts[(e, 'gate_proj')], parts[(e, 'up_proj')])) for e in range(num)])
                down = torch.stack([parts[(e, 'down_proj')] for e in range(num)])
            except KeyError as err:
                raise ValueError(f'mtp.{prefix}: expert tensor {err} is missing') from None
            loader.load(f'{prefix}.gate_up_proj', gate_up)
            loader.load(f'{prefix}.down_proj', down)
        if count == 0:
            raise ValueError('speculative_config.method=mtp needs the checkpoint\'s mtp.* weights; '
                             'this checkpoint has none')
        loader.finish()
        return count
