"""Qwen3.5 (``transformers`` model types ``qwen3_5`` and ``qwen3_5_text``): Qwen3-Next's hybrid
text stack with dense MLPs, unpacked Gated DeltaNet projections and multimodal rotary positions.

What differs from :mod:`.qwen3_next` (everything else is the same layer, imported from there)::

    Gated DeltaNet   checkpoint in_proj_qkv | in_proj_z | in_proj_b | in_proj_a (flat, not grouped
                     per key head), packed here into one matmul; conv over q|k|v as stored
    MLP              a dense SwiGLU in every layer (no experts)
    rotary           M-RoPE: each token has a (temporal, height, width) position; the rotary
                     channel pairs are assigned to the three axes interleaved
                     (pair j uses axis j mod 3 while that axis has pairs left in mrope_section)

For text tokens the three positions are equal, so M-RoPE is plain partial RoPE. An image's
tokens get ``(p0, p0 + row, p0 + col)`` on its merged patch grid and the text after it resumes at
``p0 + max(rows, cols)`` (:meth:`Qwen3_5TextModel.forward` takes such positions).
``Qwen3_5ForCausalLM`` serves the text-only checkpoints; ``Qwen3_5ForConditionalGeneration``
the vision-language ones (``text_config`` + ``vision_config``; weights under
``model.language_model.*``, ``model.visual.*``, ``lm_head.*``), with the vision tower of
:mod:`.qwen3_5_vision`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache_specs import LayerCacheSpec
from ..model_inputs import StepContext
from .base import TINY_ATTENTION, CausalLM
from .blocks.gated_delta_net import (HYBRID_BLOCKS, TINY_GATED_DELTANET, FlatGatedDeltaNet, HybridDecoderLayer,
                                     check_hybrid_config, hybrid_cache_specs, hybrid_layer_kinds)
from .blocks.vision import check_image_spans
from .config_audit import COMMON_FIELDS, GATED_DELTANET_FIELDS, IMPLEMENTED, INERT
from .layers import RMSNorm, SwiGLUMLP
from .parallel_plan import ParallelPlan
from .qwen3_5_vision import Qwen3_5VisionModel, mrope_positions
from .rope import RotaryEmbedding

__all__ = ['Qwen3_5ForCausalLM', 'Qwen3_5ForConditionalGeneration', 'MRotaryEmbedding', 'ImageInputs', 'check_config']


def check_config(config) -> None:
    """Reject a Qwen3.5 text config this implementation cannot run exactly.

    Raises:
        ValueError: naming the field (``layer_types``, ``linear_num_value_heads``, ``hidden_act``,
            ``rope_parameters.mrope_section``; rope fields: see :mod:`.rope`).
    """
    check_hybrid_config(config)
    rope = MRotaryEmbedding(config)
    sections = rope.mrope_section
    if len(sections) != 3 or any(not isinstance(s, int) or s < 0 for s in sections):
        raise ValueError(f'rope_parameters.mrope_section must be 3 non-negative pair counts '
                         f'(temporal, height, width), got {sections}')


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding with interleaved sections (Qwen3-VL / Qwen3.5 M-RoPE).

    Frequencies come from :class:`.rope.RotaryEmbedding` (``transformers``' functions). For rotary
    pair ``j`` (of ``R/2``), the angle is ``position[axis(j)] * inv_freq[j]`` with ``axis(j) = 1``
    if ``j % 3 == 1 and j < 3 * sections[1]``, ``2`` if ``j % 3 == 2 and j < 3 * sections[2]``,
    else ``0`` (temporal); the layout is then the usual half-rotation ``cat(angles, angles)``.

    Attributes:
        mrope_section: pairs per axis, ``rope_parameters['mrope_section']`` (default [11, 11, 10]).
        axis_of_pair: int64 ``[R/2]``, which position axis each pair reads.
    """

    def __init__(self, config):
        super().__init__(config)
        self.mrope_section = list(config.rope_parameters.get('mrope_section', [11, 11, 10]))
        self.num_pairs = self.inv_freq.numel()
        axis = torch.zeros(self.num_pairs, dtype=torch.long, device='cpu')   # real even under a meta device
        for a in (1, 2):
            if a < len(self.mrope_section):
                axis[a:3 * int(self.mrope_section[a]):3] = a
        self.axis_of_pair = axis

    def forward_mrope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 ``[3, T]`` (temporal, height, width) → ``(cos, sin)`` each ``[T, R]``."""
        inv_freq = self.inv_freq.to(positions.device)
        axis = self.axis_of_pair.to(positions.device)
        pos = positions.float().index_select(0, axis)            # [R/2, T]: each pair's axis
        freqs = pos.t() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


#: Qwen3.5's Gated DeltaNet: flat ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` packed into one matmul
Qwen3_5GatedDeltaNet = FlatGatedDeltaNet


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    """Gated DeltaNet (Qwen3.5's projections) or gated attention (``layer_types``), then ``mlp``
    (default: a dense SwiGLU)."""

    def __init__(self, config, layer_idx: int, mlp: nn.Module | None = None):
        mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size) if mlp is None else mlp
        super().__init__(config, layer_idx, mlp, Qwen3_5GatedDeltaNet)


class Qwen3_5TextModel(nn.Module):
    """Embedding, decoder layers, final zero-centred norm, M-RoPE.

    ``forward`` reads ``ctx.input_ids`` unless ``inputs_embeds [T, hidden]`` is given (image rows
    already replaced), and ``mrope_positions [3, T]`` when given (else every axis = ``ctx.positions``).
    """

    layer_cls = Qwen3_5DecoderLayer     # Qwen3.5-MoE swaps in its MoE layer

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)
        self.rotary = MRotaryEmbedding(config)

    def forward(self, ctx: StepContext, inputs_embeds: torch.Tensor | None = None,
                mrope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``."""
        hidden = self.embed_tokens(ctx.input_ids) if inputs_embeds is None else inputs_embeds
        if mrope_positions is None:
            cos, sin = self.rotary(ctx.positions, hidden.dtype)     # equal axes: plain partial RoPE
        else:
            cos, sin = self.rotary.forward_mrope(mrope_positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, (cos, sin), ctx)
        return self.norm(hidden)


@dataclass
class ImageInputs:
    """A forward's image inputs (:meth:`Qwen3_5ForConditionalGeneration.image_inputs`).

    Attributes:
        positions: int64 ``[3, T]`` M-RoPE (temporal, height, width) position of every flat row.
        rows: int64 ``[R]`` flat rows that are image tokens, in order.
        embeds: ``[R, hidden_size]`` in the model dtype, the vision tower's output for those rows.
    """
    positions: torch.Tensor
    rows: torch.Tensor
    embeds: torch.Tensor

    def cpu(self) -> 'ImageInputs':
        """A copy on the CPU (to broadcast to other tensor-parallel ranks)."""
        return ImageInputs(self.positions.cpu(), self.rows.cpu(), self.embeds.cpu())


class Qwen3_5ForCausalLM(CausalLM):
    """Text-only Qwen3.5 (``Qwen3_5ForCausalLM``, config ``Qwen3_5TextConfig``). Weights: drops
    ``mtp.*`` and ``model.visual.*`` (as ``transformers`` does for this class), and reads
    ``model.language_model.*`` as ``model.*``.

    Raises:
        ValueError: see :func:`check_config`.
    """

    # three Gated DeltaNet layers and an attention layer; 6 rotary pairs per head (16 * 0.75 / 2) so each
    # M-RoPE axis owns two of them
    tiny_config = dict(**TINY_ATTENTION, **TINY_GATED_DELTANET, partial_rotary_factor=0.75, mrope_section=[2, 2, 2],
                       intermediate_size=128)
    model_class = Qwen3_5TextModel
    # every config field transformers reads, and what the engine does with it (.config_audit)
    config_fields = {
        **COMMON_FIELDS,
        **GATED_DELTANET_FIELDS,
    }
    check_config = staticmethod(check_config)
    # as Qwen3-Next (flat Gated DeltaNet projections); checkpoint names under
    # model.language_model.* read as model.*; the dense model's mtp.* head is not run (unread)
    parallel_plan = ParallelPlan(layers=lambda config: hybrid_layer_kinds(config, dense=True), blocks=HYBRID_BLOCKS,
                                 renames=(('model.language_model.', 'model.'),), skipped=('mtp.',))

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """Per layer: :class:`LinearAttentionSpec` for Gated DeltaNet, :class:`FullAttentionSpec` otherwise."""
        return hybrid_cache_specs(config, dtype)

    def rename_weight(self, name: str) -> str | None:
        if name.startswith(('mtp.', 'model.visual.')):
            return None
        return name.replace('model.language_model.', 'model.', 1)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """Vision-language Qwen3.5 (config ``Qwen3_5Config`` with ``text_config`` + ``vision_config``;
    weights ``model.language_model.*``, ``model.visual.*``, ``lm_head.*``).

    A forward whose batch holds sequences with images (``ctx.sequences[i].multimodal``) embeds
    the chunk's tokens, replaces the rows of ``<|image_pad|>`` tokens with the vision tower's
    output for the matching image tokens, and rotates with M-RoPE positions derived from each
    sequence's full image list (:func:`.qwen3_5_vision.mrope_positions`), so a chunk or a suffix
    after a prefix-cache restore gets the same positions as a cold full prefill. The encoder runs
    once per image per request: its output is kept in ``seq.encoder_cache`` until the sequence's
    computed tokens pass the image's span (with the span rule an image sits in one chunk, so the
    entry normally lives for one forward).

    Raises:
        ValueError: see :func:`check_config` (on ``text_config``) and
            :class:`.qwen3_5_vision.Qwen3_5VisionModel`.
    """

    @staticmethod
    def tiny_multimodal_config(text_config) -> dict:
        """A two-block vision tower with 8-pixel patches; image tokens ``<|vision_start|>``,
        ``<|vision_end|>``, ``<|image_pad|>`` = ids 3, 4, 5 of the tiny tokenizer."""
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text_config.hidden_size,
                      num_position_embeddings=16, hidden_act='gelu_pytorch_tanh')
        return dict(vision_config=vision, image_token_id=5, video_token_id=5, vision_start_token_id=3,
                    vision_end_token_id=4, tie_word_embeddings=text_config.tie_word_embeddings)
    supports_images = True
    # the text stack of text_config, plus the vision-language config's own fields
    config_fields = {
        **Qwen3_5ForCausalLM.config_fields,
        'text_config': IMPLEMENTED,
        'vision_config': IMPLEMENTED,
        'image_token_id': IMPLEMENTED,
        'video_token_id': INERT,
        'vision_start_token_id': INERT,
        'vision_end_token_id': INERT,
        # vision_config fields the vision tower reads (Qwen3_5VisionModel runs them)
        **{f: IMPLEMENTED for f in ('depth', 'num_heads', 'in_channels', 'patch_size', 'spatial_merge_size',
                              'temporal_patch_size', 'out_hidden_size', 'num_position_embeddings',
                              'deepstack_visual_indexes', 'text_config')},
    }

    # the vision tower runs on rank 0 only (its output is broadcast with the step)
    parallel_plan = ParallelPlan(layers=lambda config: hybrid_layer_kinds(config, dense=True), blocks=HYBRID_BLOCKS,
                                 renames=(('model.language_model.', 'model.'),), skipped=('mtp.',),
                                 rank0_only=('model.visual.',), rank0_modules=('visual',))

    @staticmethod
    def check_config(config) -> None:
        """:func:`check_config` of the ``text_config``."""
        check_config(config.get_text_config())

    def __init__(self, config):
        super().__init__(config)
        self.visual = Qwen3_5VisionModel(config.vision_config)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    @staticmethod
    def layer_cache_specs(config, dtype: torch.dtype) -> list[LayerCacheSpec]:
        """The text stack's cache specs."""
        return hybrid_cache_specs(config.get_text_config(), dtype)

    def rename_weight(self, name: str) -> str | None:
        """``model.language_model.*`` as ``model.*``, ``model.visual.*`` as ``visual.*``; drops ``mtp.*``."""
        if name.startswith('mtp.'):
            return None
        if name.startswith('model.visual.'):
            return name[len('model.'):]
        return name.replace('model.language_model.', 'model.', 1)

    def check_multimodal(self, token_ids: list[int], multimodal) -> None:
        """Reject images the forward could not place.

        Raises:
            ValueError: an input without ``data['pixel_values']`` / ``data['image_grid_thw']``,
                a modality other than ``'image'``, a span whose tokens are not all the image
                token (``config.image_token_id``), or a span length other than the image's
                merged token count ``t * (h / m) * (w / m)``.
        """
        check_image_spans(token_ids, multimodal, self.image_token_id, self.merge)

    def _image_embeds(self, seq, j: int, mm) -> torch.Tensor:
        cache = seq.encoder_cache
        if j not in cache:
            dev = self.lm_head.weight.device
            px = mm.data['pixel_values'].to(dev, self.visual.patch_embed.proj.weight.dtype)
            grid = torch.as_tensor(mm.data['image_grid_thw']).reshape(-1, 3)
            cache[j] = self.visual(px, grid)
        return cache[j]

    def image_inputs(self, seqs, history_lens: list[int], q_seqlens: list[int], q_start_loc: list[int]
                     ) -> ImageInputs | None:
        """What a forward over these chunks needs from the images: ``None`` when no sequence
        has an image (plain positions then), else the M-RoPE positions of every flat row and the
        vision tower's output for the rows that are image tokens. Runs the vision tower (needs
        :attr:`visual`: under tensor parallelism, rank 0) and keeps / drops ``seq.encoder_cache``
        entries as described in the class docstring.

        Args:
            seqs: per chunk, its :class:`~lmdeploy.pytorch.paging.sequence.Sequence`.
            history_lens, q_seqlens, q_start_loc: per chunk, as in :class:`StepContext`.
        """
        if not any(s is not None and any(m.data is not None for m in s.multimodal) for s in seqs):
            return None
        positions, rows, embeds = [], [], []
        for i, seq in enumerate(seqs):
            start, n, row0 = history_lens[i], q_seqlens[i], q_start_loc[i]
            images = [m for m in seq.multimodal if m.data is not None]
            positions.append(mrope_positions(start, n, images, self.merge))
            for j, mm in enumerate(seq.multimodal):
                a, b = max(mm.start, start), min(mm.end, start + n)
                if mm.data is None or a >= b:
                    continue
                emb = self._image_embeds(seq, j, mm)
                rows.append(torch.arange(row0 + a - start, row0 + b - start, dtype=torch.long))
                embeds.append(emb[a - mm.start:b - mm.start])
                if start + n >= mm.end:
                    seq.encoder_cache.pop(j, None)     # the span is computed: never needed again
        hidden = self.config.get_text_config().hidden_size
        dtype = self.lm_head.weight.dtype
        return ImageInputs(
            positions=torch.cat(positions, dim=1),
            rows=torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
            embeds=(torch.cat(embeds).to(dtype) if embeds
                    else torch.zeros(0, hidden, dtype=dtype, device=self.lm_head.weight.device)))

    def forward_images(self, ctx: StepContext, images: ImageInputs) -> torch.Tensor:
        """The text stack over ``ctx`` with image rows replaced and M-RoPE positions
        (:meth:`image_inputs`' output, on any device): ``[T, hidden_size]``. Needs no vision
        tower, so every tensor-parallel rank runs it with rank 0's ``images``."""
        embeds = self.model.embed_tokens(ctx.input_ids)
        if images.rows.numel():
            embeds[images.rows.to(embeds.device)] = images.embeds.to(embeds.device, embeds.dtype)
        return self.model(ctx, inputs_embeds=embeds, mrope_positions=images.positions.to(ctx.device))

    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Flat batch → final hidden states ``[T, hidden_size]`` (images as in the class docstring)."""
        images = self.image_inputs(ctx.sequences, ctx.history_lens, ctx.q_seqlens, ctx.q_start_loc)
        if images is None:
            return self.model(ctx)
        return self.forward_images(ctx, images)
