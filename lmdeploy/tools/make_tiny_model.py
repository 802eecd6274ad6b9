"""Make a tiny, seeded, random Hugging Face checkpoint for tests, docs and the quick start.

This module owns the on-disk layout of the tiny models every CPU test loads:

    OUT_DIR/
      config.json             Qwen3Config / Qwen3NextConfig fields (+ legacy top-level rope keys)
      generation_config.json  eos = <|im_end|>, pad = <|endoftext|>, greedy by default
      model.safetensors       one file, keys in the published checkpoint layout
      tokenizer.json          byte-level BPE trained here on an embedded corpus
      tokenizer_config.json   PreTrainedTokenizerFast + ChatML chat_template
      preprocessor_config.json  (qwen3_5, qwen3_5_moe) transformers' Qwen2-VL image processor, tiny sizes

Invariants:
- Same (arch, seed, overrides, dtype) -> byte-identical files. The tokenizer does not depend on
  the seed; each weight tensor draws from its own generator seeded by (seed, parameter name), so a
  layer's weights do not change when another layer is added.
- Special token ids: <|endoftext|> = 0 (pad), <|im_start|> = 1, <|im_end|> = 2 (eos).
- config.vocab_size = tokenizer size rounded up to a multiple of 8 (the tail rows are unused).
- MoE experts are stored one tensor per expert (`mlp.experts.{e}.gate_proj.weight` ...), as in the
  published Qwen3-Next checkpoints, not in transformers' fused in-memory layout.
- Weights are far from HF's near-zero init so greedy decoding is not decided by ties.
- Qwen3-Next and Qwen3.5-MoE checkpoints also hold a multi-token-prediction head under `mtp.*`
  (as published: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, one full-attention decoder
  layer `layers.0` with the model's MoE, `norm`; config `num_nextn_predict_layers: 1`).
  transformers ignores `mtp.*` on load; the engine's `mtp` speculative decoding reads it.
- GLM-5.3-Flash (`glm5_next`) with `mtp=True` (opt-in; off by default) also holds the NextN layer
  `model.language_model.layers.{num_hidden_layers}.*` (`enorm`, `hnorm`, `eh_proj`, one DSA
  decoder block with its own indexer and the last layer's MLP kind, `shared_head.norm`,
  `shared_head.head`; config `num_nextn_predict_layers: 1`), in the published names.
- `fp8=True` stores the matrices as FP8 block-quantized (see :mod:`.fp8_checkpoint`).
"""

import argparse
import hashlib
import math
import os

import torch

# the arguments and architecture names live in a module without torch, so that `lmdeploy --help`
# does not pay torch's import
from .tiny_args import ARCHS, DTYPE_NAMES, MTP_ARCHS, NEXTN_ARCHS, VL_ARCHS, add_arguments, check_args
from .tiny_published_names import PUBLISHED_NAMES, glm5_next_published_names
from .tiny_tokenizer import train_tokenizer, write_json, write_tokenizer

# Qwen3.5's image tokens (ids 3, 4, 5 in the VL tokenizers; the other archs' tokenizers do not have them)
IMAGE_TOKENS = ('<|vision_start|>', '<|vision_end|>', '<|image_pad|>')
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
MATRIX_STD = 0.1
NORM_JITTER_STD = 0.05

def _arch_defaults(arch: str) -> dict:
    if arch == 'nemotron_h':    # Mamba-2, MoE, attention, Mamba-2, MLP (pattern 'ME*M-'); SSD chunks of 48
        return dict(hidden_size=64, layers_block_type=['linear_attention', 'moe', 'full_attention',
                                                       'linear_attention', 'mlp'],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
                    chunk_size=48, use_conv_bias=True, mamba_hidden_act='silu', mlp_hidden_act='relu2',
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    moe_shared_expert_intermediate_size=64, n_group=2, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=2.5, layer_norm_epsilon=1e-5, max_position_embeddings=32768,
                    tie_word_embeddings=False)
    if arch == 'granitemoehybrid':   # Mamba-2, attention, Mamba-2, Mamba-2; MoE + shared MLP; NoPE
        # µP multipliers off 1 (and a softmax scale off head_dim ** -0.5) so each is exercised; an SSD
        # chunk of 24 so 32-token prefill chunks end off its boundaries; 2 B/C groups so TP2 splits them
        return dict(hidden_size=64, num_hidden_layers=4, layer_types=['mamba', 'attention', 'mamba', 'mamba'],
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=64,
                    num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=24, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=3.0,
                    position_embedding_type=None, max_position_embeddings=32768, tie_word_embeddings=False,
                    rms_norm_eps=1e-6)
    if arch == 'granitemoe_swa':   # global, sliding, sliding, global; MoE + shared MLP; per-layer RoPE bases
        # a 24-token window (off the 16-token blocks and the 32-token prefill chunks, so chunk ends fall inside
        # windows), a NoPE layer and two RoPE bases, µP multipliers off 1, attention sinks
        full, swa = 'full_attention', 'sliding_attention'
        return dict(hidden_size=64, num_hidden_layers=4, layer_types=[full, swa, swa, full], sliding_window=24,
                    layer_rope_theta=[10000.0, 0, 10000.0, 500000.0], num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=32, shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=3.0,
                    rope_parameters=dict(rope_type='default', rope_theta=10000.0), max_position_embeddings=32768,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch in ('lfm2', 'lfm2_moe'):   # short conv, short conv, attention, short conv (LFM2-MoE: attention second)
        conv, full = 'conv', 'full_attention'
        common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      conv_L_cache=3, conv_bias=False, max_position_embeddings=32768, tie_word_embeddings=False,
                      norm_eps=1e-5, rope_parameters=dict(rope_type='default', rope_theta=10000.0))
        if arch == 'lfm2':      # block_ff_dim 192 auto-adjusted to 2/3, rounded up to 32: a 128-wide MLP
            return dict(common, layer_types=[conv, conv, full, conv], intermediate_size=192,
                        block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=32)
        # one dense layer, then sigmoid-routed MoE with a nonzero expert bias and a scaling off 1
        return dict(common, layer_types=[conv, full, conv, conv], intermediate_size=128, num_dense_layers=1,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, use_expert_bias=True,
                    routed_scaling_factor=1.5, norm_topk_prob=True)
    if arch == 'bamba':   # Mamba-2, attention, Mamba-2, Mamba-2; SwiGLU MLPs; half-head RoPE
        # an SSD chunk of 24 so 32-token prefill chunks end off its boundaries; 2 B/C groups so TP2 splits them
        return dict(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=24,
                    max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == 'falcon_h1':   # three layers, each Mamba-2 and attention side by side; SwiGLU MLPs
        # every µP multiplier off 1 so each is exercised; mamba_d_ssm (64) off mamba_expand x hidden (128);
        # an SSD chunk of 24 so 32-token prefill chunks end off its boundaries; 2 B/C groups so TP2 splits them
        return dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=24, mamba_rms_norm=True,
                    mamba_norm_before_gate=False, embedding_multiplier=2.5, lm_head_multiplier=0.6,
                    mlp_multipliers=[0.8, 1.3], key_multiplier=0.7, attention_in_multiplier=1.2,
                    attention_out_multiplier=0.9, ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.7], ssm_in_multiplier=1.15,
                    ssm_out_multiplier=0.85, rope_parameters=dict(rope_type='default', rope_theta=10000.0),
                    max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == 'mamba2':   # three Mamba-2 layers, nothing else; SSD chunks of 24, 2 B/C groups
        return dict(hidden_size=64, num_hidden_layers=3, num_heads=4, head_dim=32, expand=2, n_groups=2,
                    state_size=16, conv_kernel=4, chunk_size=24, use_conv_bias=True, use_bias=False,
                    layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=False)
    if arch in ('mamba', 'falcon_mamba'):   # three Mamba-1 layers, nothing else; dt rank 4 ('auto': 64 / 16)
        return dict(hidden_size=64, num_hidden_layers=3, state_size=16, expand=2, conv_kernel=4, use_conv_bias=True,
                    use_bias=False, layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=False)
    if arch == 'jamba':   # Mamba-1, attention, Mamba-1, Mamba-1; MoE in layers 1 and 3, dense MLPs in 0 and 2
        return dict(hidden_size=64, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1,
                    expert_layer_period=2, expert_layer_offset=1, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
                    mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=32768,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == 'kimi_linear':   # KDA, KDA, MLA, KDA; a dense first MLP, then grouped sigmoid-routed MoE
        lin, full = 'linear_attention', 'full_attention'
        return dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                    layer_types=[lin, lin, full, lin], mlp_layer_types=['dense', 'sparse', 'sparse', 'sparse'],
                    intermediate_size=128, moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=32,
                    q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=2,
                    linear_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=32768,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == 'glm5_next':     # KDA, DSA (own indexer), DSA (shared selection), KDA; 8 index heads
        lin, idx = 'linear_attention', 'indexed_attention'
        return dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=4,
                    layer_types=[lin, idx, idx, lin], indexer_types=['full', 'full', 'shared', 'full'],
                    mlp_layer_types=['dense', 'sparse', 'sparse', 'sparse'], intermediate_size=128,
                    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
                    qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=64, index_head_dim=16,
                    index_n_heads=8, index_kpool=8, linear_num_heads=2, linear_head_dim=16,
                    linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=1.0,
                    max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  rope_theta=10000.0)
    if arch == 'qwen3':
        return dict(common, num_hidden_layers=2, intermediate_size=128)
    gdn = dict(num_hidden_layers=4, full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    # Qwen3.5: 6 rotary pairs per head (16 * 0.75 / 2) so each M-RoPE axis owns two of them
    mrope = dict(partial_rotary_factor=0.75, mrope_section=[2, 2, 2])
    if arch == 'qwen3_5':
        return dict(common, **gdn, **mrope, intermediate_size=128)
    if arch in ('qwen3_5_moe', 'qwen3_5_moe_text'):
        return dict(common, **gdn, **mrope, **moe)
    return dict(common, **gdn, **moe, intermediate_size=128, partial_rotary_factor=0.25, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True)


def build_config(arch: str, vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides):
    """Build the transformers config of the tiny `arch` model.

    `overrides` replace defaults; for 'qwen3_next', `layer_types` is derived from
    `num_hidden_layers` and `full_attention_interval` unless given. Raises ValueError naming the
    field for an unknown arch or an override that is not a field of the config class.
    """
    from transformers import KimiLinearConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3NextConfig

    if arch not in ARCHS:
        raise ValueError(f'arch must be one of {ARCHS}, got {arch!r}')
    if arch == 'glm5_next':
        return _glm5_next_config(vocab_size, eos_token_id, pad_token_id, **overrides)
    if arch in ('kimi_linear', 'nemotron_h', 'granitemoehybrid', 'granitemoe_swa', 'lfm2', 'lfm2_moe', 'bamba',
                'mamba2', 'falcon_h1', 'mamba', 'falcon_mamba', 'jamba'):
        from transformers import CONFIG_MAPPING
        named = KimiLinearConfig if arch == 'kimi_linear' else CONFIG_MAPPING[arch]
        fields = dict(_arch_defaults(arch))
        known = set(named().to_dict()) | set(fields)
        for key in overrides:
            if key not in known:
                raise ValueError(f'{key}: not a {named.__name__} field')
        fields.update(overrides)
        return named(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                     bos_token_id=None, **fields)
    cls = {'qwen3': Qwen3Config, 'qwen3_next': Qwen3NextConfig, 'qwen3_5': Qwen3_5TextConfig,
           'qwen3_5_moe': Qwen3_5MoeTextConfig, 'qwen3_5_moe_text': Qwen3_5MoeTextConfig}[arch]
    fields = dict(_arch_defaults(arch))
    known = set(cls().to_dict()) | set(fields)
    for key in overrides:
        if key not in known:
            raise ValueError(f'{key}: not a {cls.__name__} field')
    fields.update(overrides)
    interval = fields.pop('full_attention_interval', None)
    rope = dict(rope_type='default', rope_theta=fields.pop('rope_theta'))
    if 'mrope_section' in fields:
        rope.update(mrope_section=fields.pop('mrope_section'), mrope_interleaved=True)
    if arch != 'qwen3':
        rope['partial_rotary_factor'] = fields.pop('partial_rotary_factor')
        if 'layer_types' not in overrides:
            n = fields['num_hidden_layers']
            fields['layer_types'] = [
                'full_attention' if (i + 1) % interval == 0 else 'linear_attention' for i in range(n)
            ]
    fields.setdefault('rope_parameters', rope)
    config = cls(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
                 **fields)
    if arch not in VL_ARCHS:
        return config
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=config.hidden_size,
                  num_position_embeddings=16, hidden_act='gelu_pytorch_tanh')
    start, end, pad = (3, 4, 5)     # IMAGE_TOKENS' ids in the qwen3_5 tokenizer
    vl_cls = Qwen3_5Config if arch == 'qwen3_5' else Qwen3_5MoeConfig
    return vl_cls(text_config=config.to_dict(), vision_config=vision, image_token_id=pad,
                         video_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
                         tie_word_embeddings=config.tie_word_embeddings)


def _glm5_next_config(vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides):
    """The tiny ``Glm5NextConfig``: the text config of :func:`_arch_defaults` and a one-block
    vision tower."""
    from transformers import Glm5NextConfig, Glm5NextTextConfig
    fields = dict(_arch_defaults('glm5_next'))
    known = set(Glm5NextTextConfig().to_dict()) | set(fields)
    for key in overrides:
        if key not in known:
            raise ValueError(f'{key}: not a Glm5NextTextConfig field')
    fields.update(overrides)
    text = Glm5NextTextConfig(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              bos_token_id=None, **fields)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, image_size=32, out_hidden_size=text.hidden_size,
                  projection_intermediate_size=64)
    start, end, pad = (3, 4, 5)     # IMAGE_TOKENS' ids; videos start and end at the unused last id
    return Glm5NextConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False,
                          image_token_id=pad, video_token_id=pad, image_start_token_id=start,
                          image_end_token_id=end, video_start_token_id=vocab_size - 1,
                          video_end_token_id=vocab_size - 1)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f'{seed}/{name}'.encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], 'little') & ((1 << 63) - 1))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter of `model` (in place) from per-name seeded generators.

    Matrices: N(0, MATRIX_STD). Norm weights: their HF init value (1 for `x*w` norms, 0 for
    Qwen3-Next's zero-centred `x*(1+w)` RMSNorm) plus N(0, NORM_JITTER_STD). Gated DeltaNet:
    A = exp(A_log) ~ U(1, 16) and dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (the
    ranges of the Mamba / Mamba-2 reference initialisation), so the per-token state decay
    exp(-A * dt) stays close to 1 and tokens far back in a long prefix still change the output
    (Mamba-1's `dt_proj.bias` likewise).
    """
    norm_params = {
        f'{mod_name}.{p_name}'
        for mod_name, mod in model.named_modules() if 'Norm' in type(mod).__name__
        for p_name, _ in mod.named_parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = _generator(seed, name)
            shape = param.shape
            leaf = name.rsplit('.', 1)[-1]
            if name in norm_params:
                neutral = param.flatten()[0].item()
                if neutral not in (0.0, 1.0) or not torch.all(param == neutral):
                    raise RuntimeError(f'unexpected init of norm weight {name}')
                value = neutral + NORM_JITTER_STD * torch.randn(shape, generator=gen)
            elif leaf == 'A_log':
                value = torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
            elif leaf == 'dt_bias' or name.endswith('dt_proj.bias'):     # Mamba-1's dt bias is dt_proj's
                dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=gen))
                value = dt + torch.log(-torch.expm1(-dt))
            elif leaf == 'sinks':       # attention-sink logits of the order of the scores, so they change the output
                value = 2.0 * torch.randn(shape, generator=gen)
            else:
                value = MATRIX_STD * torch.randn(shape, generator=gen)
            param.copy_(value)


def _checkpoint_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Return the state dict in the published layout: fused MoE experts split per expert.

    transformers keeps experts as `gate_up_proj` [E, 2*I, H] (gate rows first) and `down_proj`
    [E, H, I]; checkpoints store `experts.{e}.{gate,up,down}_proj.weight` as nn.Linear weights.
    """
    out = {}
    # Jamba's experts sit under `feed_forward` (published per expert too)
    experts = ('mlp.experts.', 'feed_forward.experts.') if model.config.model_type == 'jamba' else ('mlp.experts.',)
    for name, tensor in model.state_dict().items():
        if name.endswith(tuple(e + 'gate_up_proj' for e in experts)):
            prefix = name[:-len('gate_up_proj')]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f'{prefix}{e}.gate_proj.weight'] = gate[e]
                out[f'{prefix}{e}.up_proj.weight'] = up[e]
        elif name.endswith(tuple(e + 'down_proj' for e in experts)):
            prefix = name[:-len('down_proj')]
            for e in range(tensor.shape[0]):
                out[f'{prefix}{e}.down_proj.weight'] = tensor[e]
        else:
            out[name] = tensor
    rename = PUBLISHED_NAMES.get(getattr(model.config, 'model_type', None))
    if rename is not None:
        out = rename(out)
    if getattr(model.config, 'tie_word_embeddings', False):
        out.pop('lm_head.weight', None)  # tied: the embedding is stored once, as published checkpoints do
    return {k: v.to(dtype).contiguous() for k, v in sorted(out.items())}


def _mtp_state_dict(config, seed: int, dtype: torch.dtype) -> dict:
    """Seeded `mtp.*` tensors of a Qwen3-Next / Qwen3.5-MoE checkpoint (text `config`) in the
    published layout."""
    import copy

    from torch import nn
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    layer_config = copy.deepcopy(config)
    layer_config.layer_types = list(config.layer_types) + ['full_attention']
    H, eps = config.hidden_size, config.rms_norm_eps
    mtp = nn.Module()
    mtp.pre_fc_norm_embedding = Qwen3NextRMSNorm(H, eps=eps)
    mtp.pre_fc_norm_hidden = Qwen3NextRMSNorm(H, eps=eps)
    mtp.fc = nn.Linear(2 * H, H, bias=False)
    torch_state = torch.random.get_rng_state()
    try:
        layer_cls = Qwen3NextDecoderLayer if config.model_type == 'qwen3_next' else Qwen3_5MoeDecoderLayer
        mtp.layers = nn.ModuleList([layer_cls(layer_config, config.num_hidden_layers)])
    finally:
        torch.random.set_rng_state(torch_state)
    mtp.norm = Qwen3NextRMSNorm(H, eps=eps)
    holder = nn.Module()
    holder.mtp = mtp.to(torch.float32)
    holder.config = config
    _randomize(holder, seed)
    return _checkpoint_state_dict(holder, dtype)


def _nextn_state_dict(config, seed: int, dtype: torch.dtype, prefix: str) -> dict:
    """Seeded NextN-layer tensors of a GLM-5.3-Flash checkpoint (text `config`) under
    `prefix` + `layers.{num_hidden_layers}.`, in the published names."""
    import copy

    from torch import nn
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer, Glm5NextTextRMSNorm

    n, H, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
    layer_config = copy.deepcopy(config)
    layer_config.layer_types = list(config.layer_types) + ['indexed_attention']
    layer_config.indexer_types = list(config.indexer_types) + ['full']
    layer_config.mlp_layer_types = list(config.mlp_layer_types) + [config.mlp_layer_types[-1]]
    nextn = nn.Module()
    torch_state = torch.random.get_rng_state()
    try:
        block = Glm5NextTextDecoderLayer(layer_config, n)
    finally:
        torch.random.set_rng_state(torch_state)
    for name, child in block.named_children():
        nextn.add_module(name, child)
    nextn.enorm = Glm5NextTextRMSNorm(H, eps=eps)
    nextn.hnorm = Glm5NextTextRMSNorm(H, eps=eps)
    nextn.eh_proj = nn.Linear(2 * H, H, bias=False)
    nextn.shared_head = nn.Module()
    nextn.shared_head.norm = Glm5NextTextRMSNorm(H, eps=eps)
    nextn.shared_head.head = nn.Linear(H, config.vocab_size, bias=False)
    holder = nn.Module()
    holder.nextn = nextn.to(torch.float32)
    holder.config = config
    _randomize(holder, seed)
    tensors = glm5_next_published_names(_checkpoint_state_dict(holder, dtype))
    for name, buf in block.named_buffers():
        if name.endswith('e_score_correction_bias'):
            bias = 0.1 * torch.randn(buf.shape, generator=_generator(seed, f'nextn.{name}'))
            tensors[f'nextn.{name}'] = bias.to(dtype)
    return {f'{prefix}layers.{n}.' + k[len('nextn.'):]: v for k, v in tensors.items()}


def make_tiny_model(out_dir: str, arch: str = 'qwen3_next', seed: int = 0, **overrides) -> str:
    """Write a seeded random tiny checkpoint of `arch` (one of `ARCHS`) into `out_dir`.

    `overrides` update config fields (e.g. num_hidden_layers=2); the special key `dtype`
    ('float32' default | 'bfloat16' | 'float16') sets the stored weight dtype, `mtp`
    (default True; `MTP_ARCHS` only) writes the `mtp.*` multi-token-prediction head, and `fp8`
    (default False) stores the matrices FP8 block-quantized (:mod:`.fp8_checkpoint`). Creates `out_dir`
    if needed and overwrites the five files listed in the module docstring. Returns `out_dir`
    as an absolute path. Raises ValueError naming `arch`, `dtype` or an unknown config field.
    Takes ~0.1 s once transformers is imported (the import itself takes a few seconds).
    """
    from safetensors.torch import save_file
    import transformers

    dtype_name = overrides.pop('dtype', 'float32')
    mtp_flag = overrides.pop('mtp', None)
    with_mtp = (True if mtp_flag is None else bool(mtp_flag)) and arch in MTP_ARCHS
    with_nextn = bool(mtp_flag) and arch in NEXTN_ARCHS
    fp8 = bool(overrides.pop('fp8', False))
    if dtype_name not in DTYPES:
        raise ValueError(f'dtype must be one of {tuple(DTYPES)}, got {dtype_name!r}')
    if arch not in ARCHS:
        raise ValueError(f'arch must be one of {ARCHS}, got {arch!r}')
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f'seed must be a non-negative int, got {seed!r}')
    extra_special = IMAGE_TOKENS if arch in VL_ARCHS or arch == 'glm5_next' else ()
    tok = train_tokenizer(extra_special)
    eos_id, pad_id = tok.token_to_id('<|im_end|>'), tok.token_to_id('<|endoftext|>')
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    config = build_config(arch, vocab_size, eos_id, pad_id, **overrides)
    config.dtype = dtype_name

    model_cls = getattr(transformers, {'qwen3': 'Qwen3ForCausalLM', 'qwen3_next': 'Qwen3NextForCausalLM',
                                       'qwen3_5': 'Qwen3_5ForConditionalGeneration',
                                       'qwen3_5_moe': 'Qwen3_5MoeForConditionalGeneration',
                                       'qwen3_5_moe_text': 'Qwen3_5MoeForCausalLM',
                                       'kimi_linear': 'KimiLinearForCausalLM',
                                       'glm5_next': 'Glm5NextForConditionalGeneration',
                                       'nemotron_h': 'NemotronHForCausalLM',
                                       'granitemoehybrid': 'GraniteMoeHybridForCausalLM',
                                       'granitemoe_swa': 'GraniteMoeSWAForCausalLM',
                                       'lfm2': 'Lfm2ForCausalLM', 'lfm2_moe': 'Lfm2MoeForCausalLM',
                                       'bamba': 'BambaForCausalLM',
                                       'mamba2': 'Mamba2ForCausalLM',
                                       'falcon_h1': 'FalconH1ForCausalLM', 'mamba': 'MambaForCausalLM',
                                       'falcon_mamba': 'FalconMambaForCausalLM',
                                       'jamba': 'JambaForCausalLM'}[arch])
    torch_state = torch.random.get_rng_state()
    try:
        model = model_cls(config).to(torch.float32)
    finally:
        # HF init draws from the global RNG; leave the caller's RNG as we found it.
        torch.random.set_rng_state(torch_state)
    _randomize(model, seed)
    for name, buf in model.named_buffers():
        if name.endswith(('e_score_correction_bias', 'expert_bias')):   # nonzero, so choosing by it is tested
            buf.copy_(0.1 * torch.randn(buf.shape, generator=_generator(seed, name)))

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # The diff against PretrainedConfig keeps every model field but drops generic noise (id2label ...).
    config_dict = config.to_diff_dict()
    # Legacy top-level mirrors of rope_parameters, as in the published config.json files.
    # (published Qwen3.5 configs keep rope parameters inside text_config only)
    if arch not in VL_ARCHS and arch not in ('kimi_linear', 'glm5_next', 'nemotron_h', 'mamba2', 'mamba',
                                                         'falcon_mamba', 'jamba'):
        config_dict['rope_theta'] = config.rope_parameters['rope_theta']
    if arch == 'lfm2':   # the published spellings; transformers reads them as intermediate_size / tie_word_embeddings
        config_dict['block_ff_dim'] = config_dict.pop('intermediate_size')
        config_dict['tie_embedding'] = config_dict.pop('tie_word_embeddings')
    if arch == 'qwen3_next':
        config_dict['partial_rotary_factor'] = config.rope_parameters['partial_rotary_factor']
    config_dict['architectures'] = [model_cls.__name__]
    if arch == 'granitemoehybrid':   # the published spelling; transformers renames them on load
        config_dict['layer_types'] = [{'linear_attention': 'mamba', 'full_attention': 'attention'}.get(t, t)
                                      for t in config_dict['layer_types']]
    if arch in ('granitemoehybrid', 'bamba', 'mamba2', 'falcon_h1') and tuple(config_dict.get('time_step_limit') or ()) == (0.0, math.inf):
        del config_dict['time_step_limit']      # the default; JSON has no infinity
    if with_mtp:
        # the key the published configs use: Qwen3-Next's top level, Qwen3.5's text config
        key = 'num_nextn_predict_layers' if arch == 'qwen3_next' else 'mtp_num_hidden_layers'
        config_dict.get('text_config', config_dict)[key] = 1
    tensors = _checkpoint_state_dict(model, DTYPES[dtype_name])
    if with_mtp:
        tensors.update(_mtp_state_dict(config.get_text_config(), seed, DTYPES[dtype_name]))
    if with_nextn:
        config_dict['text_config']['num_nextn_predict_layers'] = 1
        tensors.update(_nextn_state_dict(config.get_text_config(), seed, DTYPES[dtype_name], 'model.language_model.'))
    if fp8:
        from .fp8_checkpoint import quantize_state_dict
        tensors, config_dict['quantization_config'] = quantize_state_dict(tensors)
    write_json(os.path.join(out_dir, 'config.json'), config_dict)
    write_json(os.path.join(out_dir, 'generation_config.json'),
                dict(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False))
    save_file(dict(sorted(tensors.items())), os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
    write_tokenizer(tok, out_dir, extra_special)
    if arch in VL_ARCHS:
        write_json(os.path.join(out_dir, 'preprocessor_config.json'), _image_processor_config(config.vision_config))
    return out_dir


def _image_processor_config(vision) -> dict:
    """``preprocessor_config.json`` of transformers' Qwen2-VL image processor (the one Qwen3.5
    checkpoints ship) for the tiny vision tower: images resized to multiples of
    ``patch_size * merge_size`` = 16 pixels, between 16x16 and 64x64 pixels in area."""
    factor = vision.patch_size * vision.spatial_merge_size
    return {'image_processor_type': 'Qwen2VLImageProcessor', 'do_convert_rgb': True, 'do_resize': True,
            'do_rescale': True, 'rescale_factor': 1 / 255, 'do_normalize': True,
            'image_mean': [0.5, 0.5, 0.5], 'image_std': [0.5, 0.5, 0.5], 'resample': 3,
            'patch_size': vision.patch_size, 'merge_size': vision.spatial_merge_size,
            'temporal_patch_size': vision.temporal_patch_size,
            'size': {'shortest_edge': factor * factor, 'longest_edge': 4 * factor * 4 * factor}}


def write_from_args(args: argparse.Namespace) -> str:
    """Write the checkpoint that parsed `args` (:func:`~.tiny_args.add_arguments`) describe; prints
    and returns its directory.

    Raises:
        ValueError: see :func:`~.tiny_args.check_args`.
    """
    check_args(args)
    mtp = getattr(args, 'mtp', None)
    path = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, dtype=args.dtype,
                           mtp=(args.arch not in NEXTN_ARCHS) if mtp is None else mtp, fp8=getattr(args, 'fp8', False))
    print(path)
    return path


if __name__ == '__main__':
    _parser = argparse.ArgumentParser(description='Write a tiny random Hugging Face checkpoint.')
    add_arguments(_parser)
    try:
        write_from_args(_parser.parse_args())
    except ValueError as err:
        _parser.error(str(err))
