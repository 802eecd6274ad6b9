"""GLM-5.3-Flash (``transformers`` model types ``glm5_next`` / ``glm5_next_text``): Kimi Delta
Attention layers with, at ``'indexed_attention'`` layers, DSA attention (NoPE MLA restricted
to a lightning indexer's selection), all wrapped in mHC residual streams, and a sigmoid-routed
MoE with clamped SwiGLU experts.

::

    x = embed(ids) copied into hc_mult streams               [T, N, D]
    layer i:  (post, comb, h) = attn_hc(x); x = post * mixer(RMSNorm(h)) + comb^T x
              (post, comb, h) = ffn_hc(x);  x = post * mlp(RMSNorm(h))   + comb^T x
      mixer = KDA with the safe gate ('linear_attention', :class:`.blocks.kda.KimiDeltaAttention`)
            | DSA ('indexed_attention', :class:`.glm5_next_layers.DSAAttention`); an
              indexer_types 'shared' layer reuses the previous 'full' layer's selection
      mlp   = GroupLimitedMoE router + clamped experts + clamped shared experts ('sparse') | clamped SwiGLU
    out = RMSNorm(mean over the streams)

Caches: a KDA layer keeps Kimi's four-tensor state; a DSA layer a :class:`PagedSpec` of the
latent and, when it runs its own indexer, the indexer's per-token keys (``index_keys``), both
replicated under tensor parallelism. Weights: transformers' names (``model.language_model.*``
for the vision-language class, ``model.*`` for the text one) or the published ones; the vision
tower (``model.visual.*``, :mod:`.glm5_next_vision`) is read by the vision-language class; the
NextN layer (``model.layers.{num_hidden_layers}.*``) is not read here: it is the MTP head
(:mod:`.glm5_next_mtp`, ``mtp_head``) that speculative decoding loads, where its block kind
(DSA with its own indexer) and its mHC streams (the eh_proj output copied into ``hc_mult``
streams, reduced by the mean) are explained.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from ..cache_specs import CacheTensor, LayerCacheSpec, PagedSpec
from ..model_inputs import StepContext
from .base import CausalLM
from .blocks.decoder import DecoderLayer
from .blocks.kda import KimiDeltaAttention, kda_split, kda_state_spec, load_kda_tensor
from .blocks.mla import mla_split
from .blocks.moe import LimitedGroupMoE, LimitedSwiGLUMLP, check_group_limited, clamped_swiglu, load_expert_tensor
from .blocks.vision import check_image_spans
from .config_audit import (CHECKED, COMMON_FIELDS, GROUP_LIMITED_MOE_FIELDS, IMPLEMENTED, INERT, KDA_FIELDS,
                           MLA_FIELDS, check_layer_types)
from .glm5_next_layers import DSAAttention, HyperConnection
from .layers import RMSNorm
from .parallel_plan import Block, ParallelPlan

__all__ = ['Glm5NextForCausalLM', 'Glm5NextForConditionalGeneration', 'check_config']

LINEAR, INDEXED = 'linear_attention', 'indexed_attention'


def check_config(config) -> None:
    """Refuse text configs this implementation does not reproduce exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``mlp_layer_types``, ``indexer_types``,
            ``hidden_act``, ``qk_rope_head_dim``, ``q_lora_rank``, ``index_topk``,
            ``n_group`` / ``topk_group``).
    """
    config = config.get_text_config()
    n = config.num_hidden_layers
    types = check_layer_types(config, (LINEAR, INDEXED))
    mlp = check_layer_types(config, ('dense', 'sparse'), 'mlp_layer_types')
    idx = check_layer_types(config, ('full', 'shared'), 'indexer_types')
    for i in range(n):      # transformers hands a selection only from a 'full' DSA layer to the next layer
        if types[i] == INDEXED and idx[i] == 'shared' and not (i and types[i - 1] == INDEXED and idx[i - 1] == 'full'):
            raise ValueError(f"indexer_types: layer {i} is 'shared' but layer {i - 1} is not a 'full' DSA layer")
    if config.hidden_act != 'silu':
        raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
    if config.qk_rope_head_dim:
        raise ValueError(f'qk_rope_head_dim must be 0 (NoPE DSA), got {config.qk_rope_head_dim}')
    if not config.q_lora_rank:
        raise ValueError(f'q_lora_rank is required by the DSA indexer, got {config.q_lora_rank}')
    if config.index_kpool < 1 or config.index_topk % config.index_kpool:
        raise ValueError(f'index_topk ({config.index_topk}) must be a multiple of index_kpool ({config.index_kpool})')
    if 'sparse' in mlp:
        check_group_limited(config)


class Glm5NextDecoderLayer(DecoderLayer):
    """mHC around a pre-norm token mixer (KDA or DSA) and a pre-norm MLP (MoE or dense), both
    SwiGLUs clamped at ``swiglu_limit``: the :class:`~.blocks.decoder.DecoderLayer` modules and
    names, with streams in and out instead of one residual (called as ``layer(x, ctx, masks)``)."""

    def __init__(self, config, layer_idx: int):
        is_linear = config.layer_types[layer_idx] == LINEAR
        mixer = KimiDeltaAttention(config, layer_idx, gate_lower_bound=config.linear_lower_bound) \
            if is_linear else DSAAttention(config, layer_idx)
        limit = config.swiglu_limit
        mlp = LimitedGroupMoE(config, clamped_swiglu, limit, limit) if config.mlp_layer_types[layer_idx] == 'sparse' \
            else LimitedSwiGLUMLP(config.hidden_size, config.intermediate_size, limit, clamped_swiglu)
        super().__init__(config.hidden_size, config.rms_norm_eps, mixer, mlp)
        self.is_linear = is_linear
        nxt = config.indexer_types[min(layer_idx + 1, config.num_hidden_layers - 1)]
        self.hands_on = (not self.is_linear and self.mixer.indexer is not None and nxt == 'shared')
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, x: torch.Tensor, ctx: StepContext, masks):
        """``x [T, N, D]`` streams → (streams ``[T, N, D]``, the DSA selection for the next
        layer or None)."""
        post, comb, h = self.attn_hc(x)
        h = self.norm_1(h)
        if self.is_linear:
            h, out_masks = self.mixer(h, ctx), None
        else:
            h, out_masks = self.mixer(h, ctx, masks)
        x = HyperConnection.merge(post, comb, h, x)
        post, comb, h = self.ffn_hc(x)
        x = HyperConnection.merge(post, comb, self.mlp_block(self.norm_2(h)), x)
        return x, (out_masks if self.hands_on else None)


class Glm5NextModel(nn.Module):
    """Embedding copied into ``hc_mult`` streams, decoder layers, stream mean, final norm."""

    def __init__(self, config):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ctx: StepContext, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's flat tokens."""
        h = self.embed_tokens(ctx.input_ids) if inputs_embeds is None else inputs_embeds
        x = h.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        masks = None
        for layer in self.layers:
            x, masks = layer(x, ctx, masks)
        return self.norm(x.mean(dim=1))


def _cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
    config = config.get_text_config()
    kda = kda_state_spec(config, dtype)
    latent = CacheTensor('latent', (config.kv_lora_rank,), dtype, None)
    keys = CacheTensor('index_keys', (2 * config.index_head_dim,), dtype, None)
    full, shared = PagedSpec((latent, keys)), PagedSpec((latent,))
    return [kda if t == LINEAR else (full if i == 'full' else shared)
            for t, i in zip(config.layer_types, config.indexer_types)]


def _holds_image_data(seqs) -> bool:
    """Whether any of the step's sequences still holds an image's data (the tower may run)."""
    return any(s is not None and any(m.data is not None for m in s.multimodal) for s in seqs)


class Glm5NextForCausalLM(CausalLM):
    """GLM-5.3-Flash text model in the engine's layers.

    Args:
        config: a ``transformers`` ``Glm5NextTextConfig`` (or a ``Glm5NextConfig``: its text config).

    Raises:
        ValueError: see :func:`check_config`.
    """
    # KDA, DSA (own indexer), DSA (shared selection), KDA; 8 index heads
    tiny_config = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=4,
                       layer_types=['linear_attention', 'indexed_attention', 'indexed_attention', 'linear_attention'],
                       indexer_types=['full', 'full', 'shared', 'full'],
                       mlp_layer_types=['dense', 'sparse', 'sparse', 'sparse'], intermediate_size=128,
                       moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                       n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
                       qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=64, index_head_dim=16,
                       index_n_heads=8, index_kpool=8, linear_num_heads=2, linear_head_dim=16,
                       linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=1.0,
                       max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)


    model_class = Glm5NextModel
    weight_prefix = 'model.'         # where the text stack's tensors are in the checkpoint
    # the NextN layer model.layers.{num_hidden_layers}.* (speculative decoding; not read by load_weights)
    mtp_head = 'glm5_next_mtp:Glm5NextMTP'

    # every text config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **{k: v for k, v in COMMON_FIELDS.items() if k not in ('rope_parameters', 'max_position_embeddings')},
        'head_dim': INERT,                        # forced to qk_rope_head_dim (0) by the config
        'num_key_value_heads': INERT,             # equal to num_attention_heads (transformers checks)
        'mlp_layer_types': CHECKED,
        'indexer_types': CHECKED,                 # 'full' / 'shared' (after a 'full' DSA layer)
        **KDA_FIELDS,
        'linear_lower_bound': IMPLEMENTED,        # None: softplus decay; else the safe gate
        **MLA_FIELDS,
        'q_lora_rank': CHECKED,                   # required
        'qk_rope_head_dim': CHECKED,              # 0 only
        'index_topk': CHECKED,                    # a multiple of index_kpool
        'index_head_dim': IMPLEMENTED,
        'index_n_heads': IMPLEMENTED,
        'index_kpool': CHECKED,
        'index_kpool_always_select_tail': IMPLEMENTED,
        'hc_mult': IMPLEMENTED,
        'hc_eps': IMPLEMENTED,
        'hc_sinkhorn_iters': IMPLEMENTED,
        'swiglu_limit': IMPLEMENTED,
        **GROUP_LIMITED_MOE_FIELDS,
        'router_aux_loss_coef': INERT,            # a training loss
        'output_router_logits': INERT,
    }
    rotary_class = None       # NoPE: no rope field is read
    check_config = staticmethod(check_config)
    # KDA by head; DSA by query head with its latent producers and the whole indexer replicated,
    # so the cached latent and index keys are the same on every rank (stored once); mHC, MoE and
    # dense MLPs replicated. The NextN layer (model.layers.{num_hidden_layers}.*, read by the MTP
    # head only) splits its DSA block the same way; the rest of it is whole.
    parallel_plan = ParallelPlan(layers=lambda config: config.layer_types,
                                 blocks={LINEAR: (Block(kda_split(a_log_dim=0), 'self_attn'),),
                                         INDEXED: (Block(mla_split(), 'self_attn'),)},
                                 extra_layers=lambda config: [(f'model.layers.{config.num_hidden_layers}.', INDEXED)])

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: a KDA :class:`StateSpec` (``q_conv``, ``k_conv``, ``v_conv``
        ``[H, d, kernel - 1]`` in ``dtype``, ``recurrent [H, d, d]`` float32, split by head) or
        a DSA :class:`PagedSpec`: ``latent [kv_lora_rank]`` and, for an ``indexer_types``
        ``'full'`` layer, ``index_keys [2 * index_head_dim]`` per token, both in ``dtype`` and
        the same on every rank (``tp_split=None``).

        Raises:
            ValueError: see :func:`check_config`.
        """
        return _cache_specs(config, dtype)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config.get_text_config(), 'tie_word_embeddings', False))

    def rename_weight(self, name: str) -> str | None:
        """transformers' or the published names (see the module docstring) → ours; drops the
        vision tower, ``mtp.*`` and the NextN layer."""
        if name.startswith('model.visual.') or name.startswith('mtp.'):
            return None
        if self.weight_prefix != 'model.' and name.startswith(self.weight_prefix):
            name = 'model.' + name[len(self.weight_prefix):]
        m = re.match(r'^model\.layers\.(\d+)\.', name)
        if m and int(m.group(1)) >= self.config.get_text_config().num_hidden_layers:
            return None                           # the NextN (MTP) layer
        name = re.sub(r'\.hc_(attn|ffn)_(fn|base|scale)$', r'.\1_hc.\2', name)     # published -> ours
        return name.replace('.self_attn.forget_gate.', '.self_attn.')

    def load_tensor(self, loader, name: str, tensor: torch.Tensor) -> bool:
        """The stacked KDA convs, ``A_log`` and the experts."""
        return load_kda_tensor(loader, name, tensor) or load_expert_tensor(loader, name, tensor)


class Glm5NextForConditionalGeneration(Glm5NextForCausalLM):
    """GLM-5.3-Flash with its ``Glm5NextConfig`` (``text_config`` + ``vision_config``; text
    weights under ``model.language_model.*`` or ``model.*``, the vision tower under
    ``model.visual.*``). A flat config (the text fields at the top level, as in the text-only
    published checkpoints) builds no vision tower and refuses images.

    Images (:mod:`.glm5_next_vision`): a request's ``multimodal`` entries carry
    ``data = {'pixel_values', 'image_grid_thw'}`` and a span of ``t * (h / m) * (w / m)``
    image tokens (``config.image_token_id``); the tower runs once per image (kept in
    ``seq.encoder_cache`` until its span is computed) and its rows replace those tokens'
    embeddings. The engine keeps spans whole across chunk ends and checkpoints and puts each
    image's content hash in the block hashes.
    """
    @staticmethod
    def tiny_multimodal_config(text_config) -> dict:
        """A one-block vision tower on 32-pixel images; image tokens ``<|vision_start|>``,
        ``<|vision_end|>``, ``<|image_pad|>`` = ids 3, 4, 5 of the tiny tokenizer, videos start and
        end at the unused last id."""
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, image_size=32, out_hidden_size=text_config.hidden_size,
                      projection_intermediate_size=64)
        last = text_config.vocab_size - 1
        return dict(vision_config=vision, tie_word_embeddings=False, image_token_id=5, video_token_id=5,
                    image_start_token_id=3, image_end_token_id=4, video_start_token_id=last, video_end_token_id=last)


    supports_images = True
    weight_prefix = 'model.language_model.'
    config_fields = {
        **Glm5NextForCausalLM.config_fields,
        'text_config': IMPLEMENTED,
        'vision_config': IMPLEMENTED,
        'image_token_id': IMPLEMENTED,
        'video_token_id': INERT,                  # videos are refused
        'image_start_token_id': INERT,
        'image_end_token_id': INERT,
        'video_start_token_id': INERT,
        'video_end_token_id': INERT,
        # vision_config fields the tower reads (.glm5_next_vision); rope_parameters: 'axial' only
        **{f: IMPLEMENTED for f in ('depth', 'in_channels', 'num_heads', 'out_hidden_size', 'patch_size',
                                    'projection_intermediate_size', 'spatial_merge_size', 'temporal_patch_size')},
        'rope_parameters': CHECKED,
    }
    # the vision tower runs on rank 0 only (its output is broadcast with the step)
    parallel_plan = replace(Glm5NextForCausalLM.parallel_plan, renames=(('model.language_model.', 'model.'),),
                            rank0_only=('model.visual.',), rank0_modules=('visual',))

    def __init__(self, config):
        super().__init__(config)
        from .glm5_next_vision import Glm5NextVisionModel
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        # a flat (text-only) checkpoint keeps the text fields at the top level of config.json
        # (transformers copies them into text_config) and ships no vision tower
        self.supports_images = 'num_hidden_layers' not in config.to_dict()
        self.visual = Glm5NextVisionModel(config.vision_config) if self.supports_images else None

    def rename_weight(self, name: str) -> str | None:
        if name.startswith('model.visual.'):
            return name[len('model.'):]
        return super().rename_weight(name)

    def check_multimodal(self, token_ids: list[int], multimodal) -> None:
        """Reject images the forward could not place.

        Raises:
            ValueError: a modality other than ``'image'``, data without ``pixel_values`` /
                ``image_grid_thw``, a span length other than the image's token count, or a span
                not made only of ``config.image_token_id``.
        """
        check_image_spans(token_ids, multimodal, self.image_token_id, self.merge)

    def image_inputs(self, seqs, history_lens: list[int], q_seqlens: list[int], q_start_loc: list[int]):
        """None when no chunk has an image, else :class:`.glm5_next_vision.ImageRows`: the flat
        rows of this forward that are image tokens and the tower's output for them (runs the
        tower: rank 0).

        Args:
            seqs: per chunk, its :class:`~lmdeploy.pytorch.paging.sequence.Sequence`.
            history_lens, q_seqlens, q_start_loc: per chunk, as in :class:`StepContext`.
        """
        from .glm5_next_vision import ImageRows
        if not _holds_image_data(seqs):
            return None
        rows, embeds = [], []
        dev, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        for i, seq in enumerate(seqs):
            start, n, row0 = history_lens[i], q_seqlens[i], q_start_loc[i]
            for j, mm in enumerate(seq.multimodal):
                a, b = max(mm.start, start), min(mm.end, start + n)
                if mm.data is None or a >= b:
                    continue
                if j not in seq.encoder_cache:
                    px = mm.data['pixel_values'].to(dev, self.visual.patch_embed.proj.weight.dtype)
                    seq.encoder_cache[j] = self.visual(px, torch.as_tensor(mm.data['image_grid_thw']).reshape(-1, 3))
                rows.append(torch.arange(row0 + a - start, row0 + b - start, dtype=torch.long))
                embeds.append(seq.encoder_cache[j][a - mm.start:b - mm.start])
                if start + n >= mm.end:
                    seq.encoder_cache.pop(j, None)     # the span is computed: never needed again
        hidden = self.config.get_text_config().hidden_size
        return ImageRows(torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
                         torch.cat(embeds).to(dtype) if embeds else torch.zeros(0, hidden, dtype=dtype, device=dev))

    def forward_images(self, ctx: StepContext, images) -> torch.Tensor:
        """The text stack over ``ctx`` with the image rows' embeddings replaced
        (:meth:`image_inputs`' output, any device): ``[T, hidden_size]``. Needs no tower, so
        every tensor-parallel rank runs it with rank 0's ``images``."""
        embeds = self.model.embed_tokens(ctx.input_ids)
        if images.rows.numel():
            embeds[images.rows.to(embeds.device)] = images.embeds.to(embeds.device, embeds.dtype)
        return self.model(ctx, inputs_embeds=embeds)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Flat batch → final hidden states ``[T, hidden_size]`` (images as in the class docstring)."""
        if not _holds_image_data(ctx.sequences):     # before reading the lengths: a decode graph replays it
            return self.model(ctx)
        images = self.image_inputs(ctx.sequences, ctx.history_lens, ctx.q_seqlens, ctx.q_start_loc)
        return self.model(ctx) if images is None else self.forward_images(ctx, images)
