"""Qwen3.5-MoE (``transformers`` model types ``qwen3_5_moe`` and ``qwen3_5_moe_text``): the
Qwen3.5 hybrid stack of :mod:`.qwen3_5` with Qwen3-Next's sparse MoE block in every layer.

What differs from :mod:`.qwen3_5` (everything else is the same layer, imported from there)::

    MLP     every layer: top-k softmax router that always renormalises its k weights, fused
            SwiGLU experts, plus a shared SwiGLU expert scaled by sigmoid(shared_expert_gate(x))
            (:class:`.blocks.moe.SparseMoeBlock` with ``norm_topk_prob=True``; the config has
            no ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers`` or dense
            ``intermediate_size``)
    experts checkpoint tensors either per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``)
            or fused (``mlp.experts.gate_up_proj [E, 2I, H]`` gate rows first,
            ``mlp.experts.down_proj [E, H, I]``, the layout transformers' conversion mapping
            merges the per-expert tensors into); both load

``Qwen3_5MoeForCausalLM`` serves ``qwen3_5_moe_text`` checkpoints, ``Qwen3_5MoeForConditionalGeneration``
the vision-language ``qwen3_5_moe`` ones (images exactly as :class:`.qwen3_5.Qwen3_5ForConditionalGeneration`).
The multi-token-prediction head (``mtp.*``) is :class:`Qwen3_5MoeMTP`: the Qwen3-Next-style head
(:class:`~.blocks.mtp.DecoderLayerMTP`) built with :class:`Qwen3_5MoeDecoderLayer`.
"""
from __future__ import annotations

from dataclasses import replace

from .base import TINY_ATTENTION
from .blocks.moe import SparseMoeBlock, load_expert_tensor
from .blocks.gated_delta_net import FULL, HYBRID_BLOCKS, MOE, TINY_GATED_DELTANET, hybrid_layer_kinds
from .blocks.mtp import MTP_PREFIX, DecoderLayerMTP
from .config_audit import MOE_FIELDS
from .parallel_plan import ParallelPlan
from .qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextModel

__all__ = ['Qwen3_5MoeForCausalLM', 'Qwen3_5MoeForConditionalGeneration', 'Qwen3_5MoeDecoderLayer']


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    """Pre-norm layer: Gated DeltaNet or gated attention (by ``layer_types``), then the sparse
    MoE block (renormalised top-k, sigmoid-gated shared expert)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, SparseMoeBlock(config, norm_topk_prob=True))


class Qwen3_5MoeMTP(DecoderLayerMTP):
    """The ``mtp.*`` head of a Qwen3.5-MoE checkpoint: one full-attention
    :class:`Qwen3_5MoeDecoderLayer` (its MoE with the always-renormalising router)."""
    layer_class = Qwen3_5MoeDecoderLayer


class Qwen3_5MoeTextModel(Qwen3_5TextModel):
    """:class:`.qwen3_5.Qwen3_5TextModel` with :class:`Qwen3_5MoeDecoderLayer` layers."""
    layer_cls = Qwen3_5MoeDecoderLayer


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Text-only Qwen3.5-MoE (config ``Qwen3_5MoeTextConfig``); weights as
    :meth:`.qwen3_5.Qwen3_5ForCausalLM.load_weights`, experts per expert or fused.

    Raises:
        ValueError: see :func:`.qwen3_5.check_config`.
    """

    # Qwen3.5's layers with MoE MLPs
    tiny_config = dict(**TINY_ATTENTION, **TINY_GATED_DELTANET, partial_rotary_factor=0.75, mrope_section=[2, 2, 2],
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64)
    tiny_mtp_layers_key = 'mtp_num_hidden_layers'
    tiny_top_level_rope_theta = True    # the text-only checkpoints; the vision-language ones do not
    model_class = Qwen3_5MoeTextModel
    load_tensor = staticmethod(load_expert_tensor)
    mtp_head = 'qwen3_5_moe:Qwen3_5MoeMTP'      # the checkpoint's mtp.* head (speculative decoding)
    # the router always renormalises its top-k: no norm_topk_prob / decoder_sparse_step / mlp_only_layers
    config_fields = {**Qwen3_5ForCausalLM.config_fields, **MOE_FIELDS}
    # MoE in every layer (replicated, no dense MLP to split); its mtp.* head is read
    parallel_plan = ParallelPlan(layers=lambda config: hybrid_layer_kinds(config, dense=False), blocks=HYBRID_BLOCKS,
                                 extra_layers=lambda config: [(f'{MTP_PREFIX}layers.0.', (FULL, MOE))],
                                 renames=(('model.language_model.', 'model.'),))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """Vision-language Qwen3.5-MoE (config ``Qwen3_5MoeConfig``: ``text_config`` +
    ``vision_config``); images, M-RoPE positions and weight names as
    :class:`.qwen3_5.Qwen3_5ForConditionalGeneration`, experts per expert or fused.

    Raises:
        ValueError: see :func:`.qwen3_5.check_config` (on ``text_config``).
    """

    tiny_config = Qwen3_5MoeForCausalLM.tiny_config
    tiny_mtp_layers_key = Qwen3_5MoeForCausalLM.tiny_mtp_layers_key
    tiny_top_level_rope_theta = False
    model_class = Qwen3_5MoeTextModel
    load_tensor = staticmethod(load_expert_tensor)
    mtp_head = 'qwen3_5_moe:Qwen3_5MoeMTP'      # the checkpoint's mtp.* head (speculative decoding)
    config_fields = {**Qwen3_5ForConditionalGeneration.config_fields, **MOE_FIELDS}
    # the text model's plan; the vision tower runs on rank 0 only
    parallel_plan = replace(Qwen3_5MoeForCausalLM.parallel_plan, rank0_only=('model.visual.',),
                            rank0_modules=('visual',))
