"""The body shared by the pure state-space language models (Mamba-1, Mamba-2): an embedding, a
stack of pre-norm residual mixer blocks and a final norm, and the checkpoint prefix renames of
the published ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` weights. A family gives only its
mixer (:class:`SSMBackbone`'s ``make_mixer``) and its mixer's split (:func:`ssm_parallel_plan`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...model_inputs import StepContext
from ..layers import RMSNorm
from ..parallel_plan import Block, ParallelPlan

__all__ = ['SSM_RENAMES', 'SSMBackbone', 'SSMBlock', 'rename_ssm_prefix', 'ssm_parallel_plan']

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


class SSMBlock(nn.Module):
    """``h + mixer(norm(h))``; the residual ``h`` stays float32 when ``residual_in_fp32``.

    Args:
        config: the HF config (``hidden_size``, ``layer_norm_epsilon``).
        mixer: the layer's mixer, ``(hidden [T, hidden], ctx) -> [T, hidden]`` in the model dtype.
    """

    def __init__(self, config, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = mixer

    def forward(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[T, hidden]`` (float32 or the model dtype) → ``[T, hidden]``, same dtype."""
        return hidden + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), ctx)


class SSMBackbone(nn.Module):
    """Embedding, mixer blocks, final norm (named ``model`` so the generic vocabulary split finds
    ``model.embed_tokens``).

    Args:
        config: the HF config (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``layer_norm_epsilon``, ``residual_in_fp32``).
        make_mixer: ``(config, layer_idx) -> mixer`` of each layer.
    """

    def __init__(self, config, make_mixer: Callable[[object, int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SSMBlock(config, make_mixer(config, i)) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.residual_in_fp32 = bool(config.residual_in_fp32)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (model dtype) of the step's flat tokens."""
        hidden = self.embed_tokens(ctx.input_ids)
        dtype = hidden.dtype
        if self.residual_in_fp32:
            hidden = hidden.float()
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        return self.norm_f(hidden.to(dtype))
