"""Every checkpoint config field that ``transformers`` reads for a supported architecture, and
what the engine does with it, so no field that changes the math is silently ignored.

Each field of :data:`FIELDS` is one of:

- ``implemented``: the engine computes what ``transformers`` computes, for any value;
- ``checked``: implemented for some values; any other value is refused by :func:`check_config`
  with a ``ValueError`` naming the field and the value;
- ``inert``: cannot change inference outputs (dropout, initialisation, training losses,
  the attention backend, cache bookkeeping).

:data:`ROPE_FIELDS` does the same for the keys of ``rope_parameters`` (frequencies come from
``transformers``' own functions, see :mod:`.rope`). The loader calls :func:`check_config`
before it builds a model, so a model that loads is a model that matches ``transformers``;
``tests/test_config_fidelity.py`` re-reads the ``transformers`` modeling source and fails
when it reads a field these tables do not list.
"""
from __future__ import annotations

__all__ = ['FIELDS', 'ROPE_FIELDS', 'check_config']

IMPLEMENTED, CHECKED, INERT = 'implemented', 'checked', 'inert'

_COMMON = {
    'vocab_size': IMPLEMENTED,
    'hidden_size': IMPLEMENTED,
    'intermediate_size': IMPLEMENTED,
    'num_hidden_layers': IMPLEMENTED,
    'num_attention_heads': IMPLEMENTED,
    'num_key_value_heads': IMPLEMENTED,
    'head_dim': IMPLEMENTED,
    'rms_norm_eps': IMPLEMENTED,
    'attention_bias': IMPLEMENTED,
    'tie_word_embeddings': IMPLEMENTED,       # read by PreTrainedModel, not the modeling file
    'dtype': IMPLEMENTED,                     # the 'auto' dtype of the loader
    'max_position_embeddings': IMPLEMENTED,   # an input of the rope scaling functions
    'rope_parameters': CHECKED,               # see ROPE_FIELDS and .rope
    'hidden_act': CHECKED,                    # 'silu' only
    'layer_types': CHECKED,
    'quantization_config': CHECKED,           # read by from_pretrained; FP8 block-wise only (.quantization)
    'attention_dropout': INERT,               # dropout is off at inference
    'pad_token_id': INERT,                    # padding_idx only masks the embedding's gradient
    '_attn_implementation': INERT,            # eager / sdpa compute the same attention
    'initializer_range': INERT,
    'use_cache': INERT,
}

FIELDS: dict[str, dict[str, str]] = {
    'qwen3': {
        **_COMMON,
        'sliding_window': CHECKED,            # read for 'sliding_attention' layers, which are refused
    },
    'qwen3_next': {
        **_COMMON,
        'linear_conv_kernel_dim': IMPLEMENTED,
        'linear_key_head_dim': IMPLEMENTED,
        'linear_value_head_dim': IMPLEMENTED,
        'linear_num_key_heads': IMPLEMENTED,
        'linear_num_value_heads': CHECKED,    # a multiple of linear_num_key_heads
        'decoder_sparse_step': IMPLEMENTED,
        'mlp_only_layers': IMPLEMENTED,
        'num_experts': IMPLEMENTED,
        'num_experts_per_tok': IMPLEMENTED,
        'moe_intermediate_size': IMPLEMENTED,
        'shared_expert_intermediate_size': IMPLEMENTED,
        'norm_topk_prob': IMPLEMENTED,
        'output_router_logits': INERT,        # the training loss only
        'router_aux_loss_coef': INERT,
    },
}
_QWEN3_5_TEXT = {
    **_COMMON,
    'linear_conv_kernel_dim': IMPLEMENTED,
    'linear_key_head_dim': IMPLEMENTED,
    'linear_value_head_dim': IMPLEMENTED,
    'linear_num_key_heads': IMPLEMENTED,
    'linear_num_value_heads': CHECKED,        # a multiple of linear_num_key_heads
}
FIELDS['qwen3_5_text'] = _QWEN3_5_TEXT
# the vision-language config: the text stack of text_config; the vision tower is not implemented
# yet, so its fields cannot change what the engine computes (images are refused)
FIELDS['qwen3_5'] = {
    **_QWEN3_5_TEXT,
    'text_config': IMPLEMENTED,
    'vision_config': INERT,
    'image_token_id': INERT,
    'video_token_id': INERT,
    'vision_start_token_id': INERT,
    'vision_end_token_id': INERT,
    # vision_config fields the modeling file reads (the vision tower, not run by this engine)
    **{f: INERT for f in ('depth', 'num_heads', 'in_channels', 'patch_size', 'spatial_merge_size',
                          'temporal_patch_size', 'out_hidden_size', 'num_position_embeddings',
                          'deepstack_visual_indexes', 'text_config')},
}
_MOE = {
    'num_experts': IMPLEMENTED,
    'num_experts_per_tok': IMPLEMENTED,
    'moe_intermediate_size': IMPLEMENTED,
    'shared_expert_intermediate_size': IMPLEMENTED,
    'output_router_logits': INERT,            # the training loss only
    'router_aux_loss_coef': INERT,
}
# Qwen3.5-MoE: the Qwen3.5 text stack with a MoE block in every layer (the router always
# renormalises its top-k; the config has no norm_topk_prob / decoder_sparse_step / mlp_only_layers)
FIELDS['qwen3_5_moe_text'] = {**_QWEN3_5_TEXT, **_MOE}
FIELDS['qwen3_5_moe'] = {**FIELDS['qwen3_5'], **_MOE}
# Kimi-Linear: KDA + MLA (no rotary embedding, so no rope field is read) + a grouped sigmoid-routed MoE
FIELDS['kimi_linear'] = {
    **{k: v for k, v in _COMMON.items() if k not in ('head_dim', 'rope_parameters', 'max_position_embeddings')},
    # MLA up-projects a K and V per query head whatever this says; transformers' repeat_kv only
    # runs when it equals num_attention_heads (the engine does not need that)
    'num_key_value_heads': INERT,
    'mlp_layer_types': CHECKED,               # 'dense' / 'sparse' per layer
    'linear_conv_kernel_dim': IMPLEMENTED,
    'linear_head_dim': IMPLEMENTED,
    'linear_num_heads': IMPLEMENTED,
    'kv_lora_rank': IMPLEMENTED,
    'q_lora_rank': IMPLEMENTED,               # None: one q_proj; else q_a_proj / norm / q_b_proj
    'qk_nope_head_dim': IMPLEMENTED,
    'qk_rope_head_dim': IMPLEMENTED,
    'v_head_dim': IMPLEMENTED,
    'moe_intermediate_size': IMPLEMENTED,
    'n_shared_experts': IMPLEMENTED,
    'num_local_experts': IMPLEMENTED,
    'num_experts_per_tok': IMPLEMENTED,
    'n_group': CHECKED,                       # divides num_local_experts into groups of >= 2
    'topk_group': CHECKED,                    # in [1, n_group]
    'norm_topk_prob': IMPLEMENTED,
    'routed_scaling_factor': IMPLEMENTED,
}

# keys of transformers' RopeParameters; 'implemented' ones are read by transformers' own functions
ROPE_FIELDS: dict[str, str] = {
    'rope_type': CHECKED,                     # not 'dynamic' / 'longrope' / unknown
    'type': CHECKED,                          # legacy spelling; transformers renames it rope_type
    'rope_theta': IMPLEMENTED,
    'partial_rotary_factor': CHECKED,         # Qwen3 rotates whole heads; Qwen3-Next a leading part
    'factor': IMPLEMENTED,
    'original_max_position_embeddings': IMPLEMENTED,
    'attention_factor': IMPLEMENTED,
    'beta_fast': IMPLEMENTED,
    'beta_slow': IMPLEMENTED,
    'mscale': IMPLEMENTED,
    'mscale_all_dim': IMPLEMENTED,
    'truncate': IMPLEMENTED,
    'low_freq_factor': IMPLEMENTED,
    'high_freq_factor': IMPLEMENTED,
    'short_factor': CHECKED,                  # only 'longrope' reads it, and that type is refused
    'long_factor': CHECKED,
    'mrope_section': CHECKED,                 # Qwen3.5's interleaved M-RoPE: 3 pair counts; others never read it
    'mrope_interleaved': INERT,               # transformers' Qwen3.5 always interleaves, whatever this says
}


def check_config(config) -> None:
    """Refuse a config whose computation the engine would not reproduce exactly.

    Args:
        config: a ``transformers`` config of a supported ``model_type``.

    Raises:
        ValueError: naming the field and its value: a ``quantization_config`` other than FP8
            block-wise (see :mod:`.quantization`),
            ``hidden_act`` other than ``'silu'``, ``layer_types`` other than the architecture's
            (Qwen3: all ``'full_attention'``; Qwen3-Next: ``'linear_attention'`` /
            ``'full_attention'``), ``linear_num_value_heads`` not a multiple of
            ``linear_num_key_heads``, or a ``rope_parameters`` entry (see :mod:`.rope`).
    """
    from .quantization import parse_quantization_config
    parse_quantization_config(config)     # FP8 block-wise only; other methods are refused by name
    if config.model_type == 'qwen3':
        if config.hidden_act != 'silu':
            raise ValueError(f"hidden_act must be 'silu', got {config.hidden_act!r}")
        types = list(getattr(config, 'layer_types', None) or ['full_attention'] * config.num_hidden_layers)
        bad = sorted({t for t in types if t != 'full_attention'})
        if bad or len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types must be 'full_attention' for all {config.num_hidden_layers} layers, "
                             f'got {bad or types} (use_sliding_window={getattr(config, "use_sliding_window", None)}, '
                             f'sliding_window={getattr(config, "sliding_window", None)}, max_window_layers='
                             f'{getattr(config, "max_window_layers", None)}); sliding-window attention is not '
                             'supported')
    elif config.model_type == 'qwen3_next':
        from .qwen3_next import check_config as check_qwen3_next
        check_qwen3_next(config)
    elif config.model_type in ('qwen3_5', 'qwen3_5_text', 'qwen3_5_moe', 'qwen3_5_moe_text'):
        from .qwen3_5 import check_config as check_qwen3_5
        config = config.get_text_config()
        check_qwen3_5(config)
    else:
        from . import MODEL_REGISTRY, get_model_class
        own = getattr(get_model_class(config.model_type), 'audit_config', None) \
            if config.model_type in MODEL_REGISTRY else None
        if own is not None:   # a family that checks its own fields (rope included, if it has any)
            own(config)
            return
    from .rope import RotaryEmbedding
    RotaryEmbedding(config)  # raises for rope parameters it cannot reproduce
