"""Qwen3-Next multi-token prediction (MTP) head: one extra decoder layer that drafts a token.

Published Qwen3-Next checkpoints ship ``mtp.*`` weights (``transformers`` ignores them). For
position ``t`` the head reads the target model's final hidden state at ``t`` and the token at
``t + 1`` (the *shifted* input) and predicts the token at ``t + 2``::

    x_t  = fc( concat( pre_fc_norm_embedding(embed(token[t + 1])), pre_fc_norm_hidden(h_t) ) )
    y_t  = norm( layers.0(x_t) )          full attention (own paged KV) + the model's MoE
    draft logits = lm_head(y_t)           embedding and lm_head shared with the target model

``fc`` is bias-free, ``2 * hidden → hidden``; all norms are Qwen3-Next's zero-centred RMSNorm.
The layer caches K/V like any full-attention layer: :func:`mtp_cache_spec` is appended to the
model's cache specs (index ``num_hidden_layers``), so its rows sit in every KV block, are
checkpointed with the prefix cache and put to the Store with the other layers (``K_blk``
includes them). The MTP KV at position ``t`` needs token ``t + 1``: the chunk that ends at a
boundary ``b`` reads token ``b`` (lookahead ℓ = 1), which is why the MTP strategy restores only
at ``b <= n - 1``.
"""
from __future__ import annotations

import copy
import re
from typing import Iterable

import torch
from torch import nn

from ..cache_specs import FullAttentionSpec
from ..model_inputs import StepContext
from ..models.layers import Linear, RMSNorm, WeightLoader
from ..models.qwen3_next import FULL, Qwen3NextDecoderLayer, _head_dim

__all__ = ['Qwen3NextMTP', 'mtp_cache_spec', 'load_mtp', 'MTP_PREFIX']

MTP_PREFIX = 'mtp.'
_PER_EXPERT = re.compile(r'^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$')


def mtp_config(config):
    """A copy of ``config`` whose layer ``num_hidden_layers`` (the MTP layer) is full attention."""
    cfg = copy.copy(config)
    cfg.layer_types = list(config.layer_types) + [FULL]
    return cfg


def mtp_cache_spec(config, dtype: torch.dtype) -> FullAttentionSpec:
    """The cache spec of the MTP layer (a full-attention layer of the target's geometry)."""
    return FullAttentionSpec(config.num_key_value_heads, _head_dim(config), dtype)


class Qwen3NextMTP(nn.Module):
    """The ``mtp.*`` module of a Qwen3-Next checkpoint (parameter names without ``mtp.``).

    Args:
        config: the target's ``Qwen3NextConfig``; the MTP layer gets layer index
            ``num_hidden_layers`` (its KV cache in ``StepContext.kv_caches``).
    """

    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = config.num_hidden_layers
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, zero_centered=True)
        self.fc = Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(mtp_config(config), self.layer_idx)])
        self.norm = RMSNorm(H, eps, zero_centered=True)

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
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the checkpoint's ``mtp.*`` tensors in (other names are ignored).

        Experts may come per expert (published checkpoints) or fused.

        Returns:
            The number of ``mtp.*`` tensors loaded.

        Raises:
            KeyError: an ``mtp.*`` tensor has no parameter here.
            ValueError: a shape mismatch, or MTP parameters the checkpoint lacks (a checkpoint
                without ``mtp.*`` weights cannot run the ``qwen3_next_mtp`` method).
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
            raise ValueError('speculative_config.method=qwen3_next_mtp needs the checkpoint\'s mtp.* weights; '
                             'this checkpoint has none')
        loader.finish()
        return count


def load_mtp(model_path: str, config, dtype: torch.dtype, device: torch.device | str) -> Qwen3NextMTP:
    """Build the MTP head of the checkpoint in ``model_path`` and load its ``mtp.*`` tensors
    (reading only those).

    Raises:
        ValueError: the model is not Qwen3-Next, or the checkpoint has no (or incomplete)
            ``mtp.*`` weights.
    """
    from safetensors import safe_open

    from ..models.loader import weight_files
    if getattr(config, 'model_type', None) != 'qwen3_next':
        raise ValueError(f'speculative_config.method=qwen3_next_mtp needs a qwen3_next model, got '
                         f'{getattr(config, "model_type", None)!r}')
    with torch.device('meta'):
        mtp = Qwen3NextMTP(config)
    mtp = mtp.to_empty(device=device).to(dtype)

    def tensors():
        for path in weight_files(model_path):
            with safe_open(path, framework='pt') as f:
                for name in f.keys():
                    if name.startswith(MTP_PREFIX):
                        yield name, f.get_tensor(name)

    mtp.load_weights(tensors())
    return mtp.eval()
