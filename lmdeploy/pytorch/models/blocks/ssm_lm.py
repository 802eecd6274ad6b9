"""The body shared by the pure state-space language models (Mamba-1, Mamba-2): an embedding, a
stack of pre-norm residual mixer blocks and a final norm (a :class:`~.decoder.DecoderStack` of
MLP-less :class:`~.decoder.DecoderLayer` s), and the checkpoint prefix renames of
the published ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` weights. A family gives only its
mixer (:class:`SSMBackbone`'s ``make_mixer``) and its mixer's split (:func:`ssm_parallel_plan`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..layers import RMSNorm
from ..parallel_plan import Block, ParallelPlan
from .decoder import DecoderLayer, DecoderStack

__all__ = ['SSM_RENAMES', 'ResidualRMSNorm', 'SSMBackbone', 'SSMBlock', 'rename_ssm_prefix', 'ssm_parallel_plan']

# checkpoint prefix -> the engine's (``backbone.embeddings`` in the published Mamba weights)
SSM_RENAMES = (('backbone.', 'model.'), ('model.embeddings.', 'model.embed_tokens.'),
               ('model.embedding.', 'model.embed_tokens.'))


def rename_ssm_prefix(name: str) -> str:
    """Checkpoint tensor ``name`` under the engine's prefixes (:data:`SSM_RENAMES`, applied in order)."""
    for prefix, repl in SSM_RENAMES:
        if name.startswith(prefix):
            name = repl + name[len(prefix):]
    return name


def ssm_parallel_plan(mixer_split) -> ParallelPlan:
    """The tensor-parallel plan of a pure state-space LM: every layer's ``mixer`` split by
    ``mixer_split`` (a block's split factory), norms replicated, the vocabulary split generic;
    checkpoint names under :data:`SSM_RENAMES`."""
    return ParallelPlan(layers=lambda config: ['mixer'] * config.num_hidden_layers,
                        blocks={'mixer': (Block(mixer_split, 'mixer'),)}, renames=SSM_RENAMES)


class ResidualRMSNorm(RMSNorm):
    """:class:`~..layers.RMSNorm` of a residual stream that may be wider than the model dtype:
    the input is cast to the weight's dtype first (a float32 ``residual_in_fp32`` stream is
    normed as the model-dtype tensor, as the published Mamba blocks do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` any float dtype → ``[..., dim]`` in the weight's dtype."""
        return super().forward(x.to(self.weight.dtype))


class SSMBlock(DecoderLayer):
    """``h + mixer(norm(h))``, a :class:`DecoderLayer` without an MLP; the residual ``h`` stays
    float32 when the stack keeps it so (``residual_in_fp32``).

    Args:
        config: the HF config (``hidden_size``, ``layer_norm_epsilon``).
        mixer: the layer's mixer, ``(hidden [T, hidden], ctx) -> [T, hidden]`` in the model dtype.
    """

    def __init__(self, config, mixer: nn.Module):
        super().__init__(config.hidden_size, config.layer_norm_epsilon, mixer, None,
                         names=('mixer', 'mlp', 'norm', 'post_norm'), norm=ResidualRMSNorm)


class SSMBackbone(DecoderStack):
    """Embedding, mixer blocks, final norm (``norm_f``), no positions; named ``model`` so the
    generic vocabulary split finds ``model.embed_tokens``. With ``residual_in_fp32`` the residual
    stream between the blocks is float32 and the final norm returns the model dtype.

    Args:
        config: the HF config (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``layer_norm_epsilon``, ``residual_in_fp32``).
        make_mixer: ``(config, layer_idx) -> mixer`` of each layer.
    """

    def __init__(self, config, make_mixer: Callable[[object, int], nn.Module]):
        super().__init__(config, (SSMBlock(config, make_mixer(config, i)) for i in range(config.num_hidden_layers)),
                         norm=ResidualRMSNorm(config.hidden_size, config.layer_norm_epsilon),
                         names=('embed_tokens', 'layers', 'norm_f'))
        self.residual_in_fp32 = bool(config.residual_in_fp32)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]``, float32 with ``residual_in_fp32``."""
        hidden = super().embed(input_ids)
        return hidden.float() if self.residual_in_fp32 else hidden
