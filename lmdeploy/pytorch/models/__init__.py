"""Model registry: ``transformers`` model type → the engine's model class."""
from __future__ import annotations

import importlib

__all__ = ['MODEL_REGISTRY', 'get_model_class', 'supported_model_types', 'mtp_head_class', 'mtp_model_types']

# model_type -> "module:Class", imported lazily so one model's import cost is not everyone's.
MODEL_REGISTRY = {
    'bailing_hybrid': 'bailing_hybrid:BailingHybridForCausalLM',
    'bamba': 'bamba:BambaForCausalLM',
    'falcon_h1': 'falcon_h1:FalconH1ForCausalLM',
    'falcon_mamba': 'mamba_lm:FalconMambaForCausalLM',
    'glm5_next': 'glm5_next:Glm5NextForConditionalGeneration',
    'glm5_next_text': 'glm5_next:Glm5NextForCausalLM',
    'granitemoehybrid': 'granitemoehybrid:GraniteMoeHybridForCausalLM',
    'granitemoe_swa': 'granitemoe_swa:GraniteMoeSWAForCausalLM',
    'inkling_mm_model': 'inkling:InklingForConditionalGeneration',
    'inkling_text': 'inkling:InklingForCausalLM',
    'jamba': 'jamba:JambaForCausalLM',
    'kimi_linear': 'kimi_linear:KimiLinearForCausalLM',
    'lara_mini': 'lara_mini:LaraMiniForCausalLM',
    'lfm2': 'lfm2:Lfm2ForCausalLM',
    'lfm2_moe': 'lfm2:Lfm2MoeForCausalLM',
    'lfm3': 'lfm3:Lfm3ForCausalLM',
    'mamba': 'mamba_lm:MambaForCausalLM',
    'mamba2': 'mamba2_lm:Mamba2ForCausalLM',
    'minimax': 'minimax:MiniMaxForCausalLM',
    'nemotron_h': 'nemotron_h:NemotronHForCausalLM',
    'olmo_hybrid': 'olmo_hybrid:OlmoHybridForCausalLM',
    'qwen3': 'qwen3:Qwen3ForCausalLM',
    'qwen3_next': 'qwen3_next:Qwen3NextForCausalLM',
    'qwen3_5': 'qwen3_5:Qwen3_5ForConditionalGeneration',
    'qwen3_5_text': 'qwen3_5:Qwen3_5ForCausalLM',
    'qwen3_5_moe': 'qwen3_5_moe:Qwen3_5MoeForConditionalGeneration',
    'qwen3_5_moe_text': 'qwen3_5_moe:Qwen3_5MoeForCausalLM',
    'zamba2': 'zamba2:Zamba2ForCausalLM',
}


def supported_model_types() -> list[str]:
    """The ``model_type`` values the engine can serve."""
    return sorted(MODEL_REGISTRY)


def get_model_class(model_type: str):
    """The engine class for ``model_type``.

    Raises:
        ValueError: the type is not supported; the message lists the supported ones.
    """
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f'unsupported model type {model_type!r}; supported: {", ".join(supported_model_types())}')
    module, cls = MODEL_REGISTRY[model_type].split(':')
    return getattr(importlib.import_module(f'{__name__}.{module}'), cls)


def mtp_model_types() -> list[str]:
    """The model types whose engine class has an MTP head."""
    return [t for t in sorted(MODEL_REGISTRY) if get_model_class(t).mtp_head]


def mtp_head_class(config):
    """The multi-token-prediction head class of ``config``'s model (its class's ``mtp_head``,
    a :class:`~.base.MTPHead`).

    Raises:
        ValueError: the model has none (names ``speculative_config.method`` and lists the model
            types that do).
    """
    model_type = getattr(config, 'model_type', None)
    head = get_model_class(model_type).mtp_head if model_type in MODEL_REGISTRY else None
    if not head:
        raise ValueError(f'speculative_config.method=mtp needs a model with an '
                         f'MTP head ({", ".join(mtp_model_types())}), got {model_type!r}')
    module, name = head.split(':')
    return getattr(importlib.import_module(f'{__name__}.{module}'), name)
