"""GLM-5.3-Flash NextN multi-token-prediction head: the checkpoint's extra layer
``model.layers.{num_hidden_layers}.*`` (``transformers`` ignores it on load, so it has no
reference there; the layout is the published GLM / DeepSeek-V3 NextN convention).

For position ``t`` the head reads the target's final hidden state ``h_t`` (after the stream
mean and the final norm) and the token at ``t + 1`` and predicts the token at ``t + 2``::

    x_t = eh_proj( concat( enorm(embed(token[t + 1])), hnorm(h_t) ) )     2H → H, no bias
    s_t = x_t copied into hc_mult streams                                 [T, N, H]
    s_t = block(s_t)                      one mHC decoder block: DSA attention + MLP
    y_t = shared_head.norm( mean over the streams of s_t )
    draft logits = shared_head.head(y_t)  (the target's lm_head when the checkpoint has none)

Decisions (the published layer fixes the tensors, not the streams or the block kind):

* **The block is a DSA ('indexed_attention') block with its own indexer** (``indexer_types``
  ``'full'``), whatever the target's last layer is, and its MLP is the kind of the target's
  last layer (``mlp_layer_types[-1]``, MoE in the published config). A KDA block would need a
  recurrent state per sequence that the drafter would have to snapshot and roll back at every
  rejected draft; a DSA block keeps only paged per-token rows (latent + indexer keys), which
  the engine already writes, checkpoints with the prefix cache and puts to the Store like any
  other layer, and the DeepSeek-V3.2 family's NextN layer is this attention kind.
* **Streams are formed as the target forms them from its embedding** (the eh_proj output
  copied into ``hc_mult`` streams) and the block mixes them with its own ``attn_hc`` /
  ``ffn_hc``; they are reduced the way the target reduces its last layer's streams (mean, then
  the head's norm). The target hands over one normed ``[T, H]`` state per token, not its
  streams, so this is the only input that needs no state beyond what the engine keeps.

The layer's cache is the DSA :class:`~lmdeploy.pytorch.cache_specs.PagedSpec` (``latent``,
``index_keys``) at layer index ``num_hidden_layers``: its rows sit in every KV block and count
in ``K_blk``. Its rows at position ``t`` need token ``t + 1``: lookahead ℓ = 1, no recompute
blocks, as Qwen3-Next's MTP. Tensor parallelism: the block's DSA attention splits by query
head like the target's (``q_b_proj`` / ``kv_b_proj`` rows, ``o_proj`` columns: the NextN
layer of :class:`.glm5_next.Glm5NextForCausalLM`'s ``parallel_plan``), the rest of the head is
replicated, and its cached rows (latent, indexer keys) are the same on every rank.
"""
from __future__ import annotations

import copy
import re
from typing import Iterable

import torch
from torch import nn

from ..cache_specs import CacheTensor, LayerCacheSpec, PagedSpec
from ..model_inputs import StepContext
from .base import MTPHead
from .blocks.moe import load_expert_tensor
from .layers import Linear, RMSNorm, WeightLoader

__all__ = ['Glm5NextMTP', 'nextn_config']

_INDEXED = 'indexed_attention'


def nextn_config(config):
    """A copy of text ``config`` whose layer ``num_hidden_layers`` is the NextN block (a DSA
    layer with its own indexer; the MLP kind of the last layer)."""
    cfg = copy.copy(config.get_text_config())
    cfg.layer_types = list(cfg.layer_types) + [_INDEXED]
    cfg.indexer_types = list(cfg.indexer_types) + ['full']
    cfg.mlp_layer_types = list(cfg.mlp_layer_types) + [cfg.mlp_layer_types[-1]]
    return cfg


def _layer_prefix(config) -> re.Pattern:
    n = config.get_text_config().num_hidden_layers
    return re.compile(rf'^model\.(?:language_model\.)?layers\.{n}\.')


class Glm5NextMTP(MTPHead):
    """The NextN layer of a GLM-5.3-Flash checkpoint (see the module docstring).

    Args:
        config: the target's config (``Glm5NextConfig`` or its text config).

    Parameters: ``enorm``, ``hnorm`` (RMSNorm ``[H]``), ``eh_proj`` (``[H, 2H]``),
    ``layers.0`` (a :class:`.glm5_next.Glm5NextDecoderLayer`), ``shared_head.norm`` and,
    when the checkpoint has it, ``shared_head.head`` (``[vocab, H]``).
    """

    supports_tp = True      # built from the rank's local config; the plan's extra layer n splits its DSA rows

    def __init__(self, config):
        super().__init__()
        from .glm5_next import Glm5NextDecoderLayer
        text = config.get_text_config()
        H, eps = text.hidden_size, text.rms_norm_eps
        self.layer_idx = text.num_hidden_layers
        self.hc_mult = text.hc_mult
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([Glm5NextDecoderLayer(nextn_config(text), self.layer_idx)])
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)
        self.shared_head.head = None      # set by load_weights when the checkpoint has its own
        self._vocab = text.vocab_size

    @staticmethod
    def cache_spec(config, dtype: torch.dtype) -> LayerCacheSpec:
        """The NextN block's cache: the DSA :class:`PagedSpec` of ``latent [kv_lora_rank]`` and
        ``index_keys [2 * index_head_dim]`` in ``dtype``."""
        text = config.get_text_config()
        return PagedSpec((CacheTensor('latent', (text.kv_lora_rank,), dtype, None),
                          CacheTensor('index_keys', (2 * text.index_head_dim,), dtype, None)))

    @staticmethod
    def wants(name: str, config) -> bool:
        """Whether checkpoint tensor ``name`` is the NextN layer's (``model.layers.{n}.*`` or
        ``model.language_model.layers.{n}.*``, ``n = num_hidden_layers``)."""
        return _layer_prefix(config).match(name) is not None

    def draft(self, target, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """One drafter step: ``hidden [T, H]`` at ``ctx.positions`` whose next tokens are
        ``ctx.input_ids`` (embedded with ``target``'s table) → ``[T, H]`` (DSA is NoPE: no
        rotary)."""
        return self(hidden, target.model.embed_tokens(ctx.input_ids), ctx)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``hidden, next_embeds [T, H]`` → normed NextN hidden states ``[T, H]``; writes the
        block's latent and indexer keys at ``ctx.positions``."""
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        x = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            x, _ = layer(x, ctx, None)
        return self.shared_head.norm(x.mean(dim=1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, H]`` → ``[N, vocab]`` float32 logits of ``shared_head.head``; None when the
        checkpoint has no head of its own (the target's ``lm_head`` is used)."""
        return None if self.shared_head.head is None else self.shared_head.head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy the NextN layer's tensors in (other names are ignored); published names
        (``hc_attn_fn`` ...) and per-expert tensors are mapped as the target's loader does.
        ``embed_tokens`` inside the layer (a copy of the target's) is skipped.

        Returns:
            The number of tensors read.

        Raises:
            KeyError: a tensor has no parameter here.
            ValueError: a shape mismatch, missing parameters, or no NextN tensors at all.
        """
        pattern = re.compile(rf'^model\.(?:language_model\.)?layers\.{self.layer_idx}\.')
        tensors = {}
        for name, tensor in weights:
            m = pattern.match(name)
            if m:
                tensors[name[m.end():]] = tensor
        if not tensors:
            raise ValueError(f'speculative_config.method=mtp needs the checkpoint\'s NextN layer '
                             f'(model.layers.{self.layer_idx}.*); this checkpoint has none')
        head = tensors.pop('shared_head.head.weight', None)
        if head is not None:
            ref = self.eh_proj.weight
            self.shared_head.head = Linear(head.shape[1], head.shape[0], bias=False).to(ref.device, ref.dtype)
        loader = WeightLoader(self)
        for name, tensor in tensors.items():
            if name.startswith('embed_tokens.'):
                continue
            if name not in ('enorm.weight', 'hnorm.weight', 'eh_proj.weight', 'shared_head.norm.weight'):
                name = 'layers.0.' + re.sub(r'\.hc_(attn|ffn)_(fn|base|scale)$', r'.\1_hc.\2', '.' + name)[1:]
            if not load_expert_tensor(loader, name, tensor):
                loader.load(name, tensor)
        if head is not None:
            loader.load('shared_head.head.weight', head)
        loader.finish()
        return len(tensors) + (head is not None)
