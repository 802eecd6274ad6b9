"""Qwen3-Next / Qwen3.5-MoE multi-token prediction (MTP) head: one extra decoder layer that
drafts a token.

Published Qwen3-Next and Qwen3.5-MoE checkpoints ship ``mtp.*`` weights (``transformers`` ignores
them); the layer is the model's own full-attention decoder layer (Qwen3.5-MoE: its MoE layer
with the always-renormalising router), built from the text config. For
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

Tensor parallelism: every rank holds its shard of the head (attention split by head like the
target's attention layers, the rest replicated; :meth:`TPLayout.apply_mtp`) and its slice of
the MTP KV. Steps travel as :class:`MTPBatch` (plain integers); each rank runs them with its
own :class:`MTPDrafter` over its own last forward's hidden states and chain state, and every
rank returns the same draft ids (the logits are gathered over the ranks before the argmax).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from ..cache_specs import FullAttentionSpec
from ..model_inputs import StepBatch, StepContext
from ..models.layers import Linear, RMSNorm, WeightLoader
from ..models.qwen3_next import FULL, Qwen3NextDecoderLayer, _head_dim

__all__ = ['Qwen3NextMTP', 'MTPBatch', 'MTPDrafter', 'mtp_cache_spec', 'check_mtp_model', 'load_mtp',
           'MTP_PREFIX']

MTP_PREFIX = 'mtp.'
_PER_EXPERT = re.compile(r'^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$')


def mtp_config(config):
    """A copy of ``config`` whose layer ``num_hidden_layers`` (the MTP layer) is full attention."""
    cfg = copy.copy(config)
    cfg.layer_types = list(config.layer_types) + [FULL]
    return cfg


def mtp_cache_spec(config, dtype: torch.dtype) -> FullAttentionSpec:
    """The cache spec of the MTP layer (a full-attention layer of the target's geometry; a
    vision-language config is read through its text config)."""
    config = config.get_text_config()
    return FullAttentionSpec(config.num_key_value_heads, _head_dim(config), dtype)


class Qwen3NextMTP(nn.Module):
    """The ``mtp.*`` module of a Qwen3-Next checkpoint (parameter names without ``mtp.``).

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
        layer_cls = Qwen3NextDecoderLayer
        if config.model_type == 'qwen3_5_moe_text':
            from ..models.qwen3_5_moe import Qwen3_5MoeDecoderLayer as layer_cls
        self.layers = nn.ModuleList([layer_cls(mtp_config(config), self.layer_idx)])
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


MTP_MODEL_TYPES = ('qwen3_next', 'qwen3_5_moe', 'qwen3_5_moe_text')


def check_mtp_model(config) -> None:
    """Raise ValueError (naming ``speculative_config.method``) unless ``config`` is one of
    :data:`MTP_MODEL_TYPES`."""
    if getattr(config, 'model_type', None) not in MTP_MODEL_TYPES:
        raise ValueError(f'speculative_config.method=qwen3_next_mtp needs a qwen3_next model or a Qwen3.5-MoE one '
                         f'({", ".join(MTP_MODEL_TYPES[1:])}), got {getattr(config, "model_type", None)!r}')


def load_mtp(model_path: str, config, dtype: torch.dtype, device: torch.device | str,
             layout=None) -> Qwen3NextMTP:
    """Build the MTP head of the checkpoint in ``model_path`` and load its ``mtp.*`` tensors
    (reading only those).

    Args:
        model_path: the model directory.
        config: the full model's config.
        dtype, device: of the parameters.
        layout: a :class:`~lmdeploy.pytorch.distributed.sharding.TPLayout` to load that rank's
            shard (built from its local config, row-parallel modules swapped in, split tensors
            read as slices); None for the whole head.

    Raises:
        ValueError: the model is not one of :data:`MTP_MODEL_TYPES`, or the checkpoint has no (or incomplete)
            ``mtp.*`` weights.
    """
    from safetensors import safe_open

    from ..models.loader import weight_files
    check_mtp_model(config)
    with torch.device('meta'):
        mtp = Qwen3NextMTP(config) if layout is None else layout.apply_mtp(Qwen3NextMTP(layout.local_config()))
    mtp = mtp.to_empty(device=device).to(dtype)

    def tensors():
        for path in weight_files(model_path):
            with safe_open(path, framework='pt') as f:
                for name in f.keys():
                    if name.startswith(MTP_PREFIX):
                        yield name, f.get_tensor(name)

    from ..distributed.loading import shard_fp8
    fp8 = shard_fp8(model_path, config, dtype)     # FP8 checkpoint: the head is dequantized at load
    if layout is None:
        mtp.load_weights(tensors() if fp8 is None else fp8.stream(tensors(), complete=False))
    else:
        from ..distributed.loading import iter_shard_tensors
        mtp.load_weights(iter_shard_tensors(model_path, layout, prefix=MTP_PREFIX, fp8=fp8))
    return mtp.eval()


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

    def __init__(self, model, mtp: Qwen3NextMTP, step=None):
        self.model, self.mtp = model, mtp
        self._step = step or self.step
        self.prev: torch.Tensor | None = None      # [num drafting sequences, H]: the chain's last outputs

    def step(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """MTP hidden states ``[T, H]`` for ``ctx``'s positions, whose next tokens are ``ctx.input_ids``."""
        base = self.model.model
        embeds = base.embed_tokens(ctx.input_ids)
        cos, sin = base.rotary(ctx.positions, embeds.dtype)
        return self.mtp(hidden, embeds, cos, sin, ctx)

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
        return self.model.compute_logits(kept).argmax(-1).tolist()
