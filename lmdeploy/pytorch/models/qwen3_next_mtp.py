"""Qwen3-Next / Qwen3.5-MoE multi-token prediction (MTP) head: one extra decoder layer that
drafts a token (the ``mtp.*`` tensors of the checkpoint; ``transformers`` ignores them).

For position ``t`` the head reads the target model's final hidden state at ``t`` and the token
at ``t + 1`` (the *shifted* input) and predicts the token at ``t + 2``::

    x_t  = fc( concat( pre_fc_norm_embedding(embed(token[t + 1])), pre_fc_norm_hidden(h_t) ) )
    y_t  = norm( layers.0(x_t) )          full attention (own paged KV) + the model's MLP / MoE
    draft logits = lm_head(y_t)           embedding and lm_head shared with the target model

``fc`` is bias-free, ``2 * hidden → hidden``; all norms are Qwen3-Next's zero-centred RMSNorm.
The layer is the model's own full-attention decoder layer (the head is
:class:`~.blocks.mtp.DecoderLayerMTP` with Qwen3-Next's layer; Qwen3.5-MoE's head, with its MoE
layer, is in :mod:`.qwen3_5_moe`). The model classes name it as their ``mtp_head``
(:mod:`lmdeploy.pytorch.spec_decode.mtp` builds, loads and runs any family's head through that
attribute).
"""
from __future__ import annotations

from .blocks.mtp import MTP_PREFIX, DecoderLayerMTP, mtp_config
from .qwen3_next import Qwen3NextDecoderLayer

__all__ = ['Qwen3NextMTP', 'MTP_PREFIX', 'mtp_config']


class Qwen3NextMTP(DecoderLayerMTP):
    """Qwen3-Next's ``mtp.*`` head: one full-attention :class:`.qwen3_next.Qwen3NextDecoderLayer`."""
    layer_class = Qwen3NextDecoderLayer
