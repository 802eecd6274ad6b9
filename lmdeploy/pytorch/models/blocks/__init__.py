"""Layers more than one model family builds from. A family module (``models/<family>.py``)
imports blocks and the generic layers (:mod:`..layers`), never another family; the
``independence`` contract of ``.importlinter`` checks it.

=====================  ==================================================================
``attention``          paged GQA attention with q/k RMSNorm and rotary (Qwen3, gated: Qwen3-Next, Qwen3.5)
``gated_delta_net``    Gated DeltaNet, the hybrid decoder layer, the layer types, their checks and cache specs
``gqa``                packed q/k/v and o projections of grouped-query attention (the hybrids' attention
                       layers); the tensor-parallel split of every GQA block
``kda``                Kimi Delta Attention, its state spec and tensor-parallel split by head
``mla``                the tensor-parallel split of multi-head latent attention (Kimi-Linear, GLM DSA)
``lora``               the tensor-parallel split of LoRA adapters on a block's projections (Zamba2)
``spanning_norm``      q / k RMS norms over all heads summed over the ranks, and their split (OLMo Hybrid)
``mamba1``             the Mamba-1 mixer, its dims, state spec and tensor-parallel split
``mamba2``             the Mamba-2 mixer, its dims, state spec and tensor-parallel split
``mamba2_hybrid``      the attention + Mamba-2 hybrids' Mamba config checks and dims
``ssm_lm``             the pure state-space LMs' embedding, pre-norm mixer blocks, final norm, checkpoint renames
``short_conv``         LFM2's gated short convolution, its conv-only state spec and tensor-parallel split
                       (LFM2, LFM3)
``moe``                stacked SwiGLU experts, per-expert loading, Qwen-MoE and group-limited routers
``mtp``                the Qwen3-Next-style MTP head around one decoder layer of the family's kind
``vision``             patch embedding, merge-block order, attention inside an image, image-span checks
=====================  ==================================================================
"""
