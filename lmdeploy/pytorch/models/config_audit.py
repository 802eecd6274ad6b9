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
when it reads a field these tables do not list. Each model class declares its own table
(``config_fields``, built from :data:`COMMON_FIELDS` and friends) and its ``check_config``
beside its layers; :data:`FIELDS` reads them through the model registry.
"""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ['FIELDS', 'ROPE_FIELDS', 'COMMON_FIELDS', 'GATED_DELTANET_FIELDS', 'MOE_FIELDS', 'KDA_FIELDS', 'MLA_FIELDS',
           'GROUP_LIMITED_MOE_FIELDS', 'IMPLEMENTED', 'CHECKED', 'INERT', 'check_config',
           'check_layer_types']

IMPLEMENTED, CHECKED, INERT = 'implemented', 'checked', 'inert'

COMMON_FIELDS = {
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

GATED_DELTANET_FIELDS = {      # the Gated DeltaNet layers of Qwen3-Next and Qwen3.5
    'linear_conv_kernel_dim': IMPLEMENTED,
    'linear_key_head_dim': IMPLEMENTED,
    'linear_value_head_dim': IMPLEMENTED,
    'linear_num_key_heads': IMPLEMENTED,
    'linear_num_value_heads': CHECKED,        # a multiple of linear_num_key_heads
}
MOE_FIELDS = {
    'num_experts': IMPLEMENTED,
    'num_experts_per_tok': IMPLEMENTED,
    'moe_intermediate_size': IMPLEMENTED,
    'shared_expert_intermediate_size': IMPLEMENTED,
    'output_router_logits': INERT,            # the training loss only
    'router_aux_loss_coef': INERT,
}
KDA_FIELDS = {                 # the Kimi Delta Attention layers of Kimi-Linear, Ling 3, GLM-5.3-Flash
    'linear_conv_kernel_dim': IMPLEMENTED,
    'linear_head_dim': IMPLEMENTED,
    'linear_num_heads': IMPLEMENTED,
}
MLA_FIELDS = {                 # multi-head latent attention (blocks/mla.py)
    'kv_lora_rank': IMPLEMENTED,
    'q_lora_rank': IMPLEMENTED,               # None: one q_proj; else q_a_proj / norm / q_b_proj
    'qk_nope_head_dim': IMPLEMENTED,
    'qk_rope_head_dim': IMPLEMENTED,
    'v_head_dim': IMPLEMENTED,
}
GROUP_LIMITED_MOE_FIELDS = {   # the DeepSeek-V3-style MoE (blocks/moe.py GroupLimitedMoE)
    'moe_intermediate_size': IMPLEMENTED,
    'n_shared_experts': IMPLEMENTED,
    'num_local_experts': IMPLEMENTED,
    'num_experts_per_tok': IMPLEMENTED,
    'n_group': CHECKED,                       # divides num_local_experts into groups of >= 2
    'topk_group': CHECKED,                    # in [1, n_group]
    'norm_topk_prob': IMPLEMENTED,
    'routed_scaling_factor': IMPLEMENTED,
}


class _RegistryFields(Mapping):
    """``FIELDS[model_type]``: the ``config_fields`` table the model class declares beside its
    layers (the model file owns its config audit; this reads it through the registry)."""

    def __getitem__(self, model_type: str) -> dict[str, str]:
        from . import MODEL_REGISTRY, get_model_class
        if model_type not in MODEL_REGISTRY:
            raise KeyError(model_type)
        return get_model_class(model_type).config_fields

    def __iter__(self):
        from . import MODEL_REGISTRY
        return iter(MODEL_REGISTRY)

    def __len__(self) -> int:
        from . import MODEL_REGISTRY
        return len(MODEL_REGISTRY)


FIELDS: Mapping[str, dict[str, str]] = _RegistryFields()

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
    """Refuse a config whose computation the engine would not reproduce exactly: the
    quantization (:mod:`.quantization`), then the model class's own ``check_config`` (found
    through the registry; the model file knows its architecture), then the rope parameters of
    the text config (the class's ``rotary_class``, :mod:`.rope`).

    Args:
        config: a ``transformers`` config of a supported ``model_type``.

    Raises:
        ValueError: naming the field and its value: a ``quantization_config`` other than FP8
            block-wise, what the model's ``check_config`` refuses (e.g. ``hidden_act``,
            ``layer_types``), an unsupported ``model_type``, or a ``rope_parameters`` entry.
    """
    from . import get_model_class
    from .quantization import parse_quantization_config
    parse_quantization_config(config)     # FP8 block-wise only; other methods are refused by name
    cls = get_model_class(config.model_type)
    cls.check_config(config)
    if cls.rotary_class is not None:     # a family without rotary embeddings reads no rope field
        cls.rotary_class(config.get_text_config())  # raises for rope parameters it cannot reproduce


def check_layer_types(config, kinds: tuple[str, ...], field: str = 'layer_types') -> list[str]:
    """The per-layer kinds ``config.<field>`` lists, one of ``kinds`` for each of the
    ``num_hidden_layers`` layers (``layer_types``, ``mlp_layer_types``, ``indexer_types`` ...).

    Returns:
        The list, as given.

    Raises:
        ValueError: naming ``field``: a missing list, a wrong length, or a kind not in ``kinds``.
    """
    n = config.num_hidden_layers
    types = list(getattr(config, field, None) or [])
    if len(types) != n or any(t not in kinds for t in types):
        names = ', '.join(repr(k) for k in kinds[:-1]) + (' or ' if len(kinds) > 1 else '') + repr(kinds[-1])
        raise ValueError(f'{field} must list {names} for each of the {n} layers, got {types}')
    return types
