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
from .tiny_args import ARCHS, DEFAULT_ARCH, DTYPE_NAMES, MTP_ARCHS, NEXTN_ARCHS, VL_ARCHS, add_arguments, check_args
from .tiny_published_names import PUBLISHED_NAMES, glm5_next_published_names
from .tiny_tokenizer import train_tokenizer, write_json, write_tokenizer

# Qwen3.5's image tokens (ids 3, 4, 5 in the VL tokenizers; the other archs' tokenizers do not have them)
IMAGE_TOKENS = ('<|vision_start|>', '<|vision_end|>', '<|image_pad|>')
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
MATRIX_STD = 0.1
NORM_JITTER_STD = 0.05

def _family(arch: str):
    """The engine's model class of `arch` (its model type): it declares the tiny checkpoint
    (``tiny_config`` and the other ``tiny_*`` capabilities of
    :class:`lmdeploy.pytorch.models.base.CausalLM`). Raises ValueError naming `arch`."""
    from lmdeploy.pytorch.models import get_model_class

    if arch not in ARCHS:
        raise ValueError(f'arch must be one of {ARCHS}, got {arch!r}')
    cls = get_model_class(arch)
    if not cls.tiny_config:
        raise ValueError(f'arch: {cls.__name__} declares no tiny_config')
    return cls


def build_config(arch: str, vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides):
    """Build the transformers config of the tiny `arch` model.

    The fields are the family's ``tiny_config`` updated by `overrides`, built with
    ``transformers.CONFIG_MAPPING[arch]`` (its ``text_config`` class for a vision-language
    family, whose wrapper fields come from ``tiny_multimodal_config``). ``rope_theta`` (with
    ``partial_rotary_factor`` / ``mrope_section`` where given) is folded into
    ``rope_parameters``; with ``full_attention_interval``, ``layer_types`` is derived from
    ``num_hidden_layers`` unless given. Raises ValueError naming the field for an unknown arch or
    an override that is not a field of the config class.
    """
    from transformers import CONFIG_MAPPING

    family = _family(arch)
    named = CONFIG_MAPPING[arch]
    multimodal = 'text_config' in getattr(named, 'sub_configs', {})
    cls = named.sub_configs['text_config'] if multimodal else named
    defaults = family.tiny_config
    fields = dict(defaults)
    known = set(cls().to_dict()) | set(fields)
    for key in overrides:
        if key not in known:
            raise ValueError(f'{key}: not a {cls.__name__} field')
    fields.update(overrides)
    interval = fields.pop('full_attention_interval', None)
    if 'rope_theta' in defaults:
        rope = dict(rope_type='default', rope_theta=fields.pop('rope_theta'))
        if 'mrope_section' in fields:
            rope.update(mrope_section=fields.pop('mrope_section'), mrope_interleaved=True)
        if 'partial_rotary_factor' in fields:
            rope['partial_rotary_factor'] = fields.pop('partial_rotary_factor')
        fields.setdefault('rope_parameters', rope)
    if interval is not None and 'layer_types' not in overrides:
        n = fields['num_hidden_layers']
        fields['layer_types'] = ['full_attention' if (i + 1) % interval == 0 else 'linear_attention'
                                 for i in range(n)]
    config = cls(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
                 **fields)
    if not multimodal:
        return config
    wrapper = family.tiny_multimodal_config(config)
    if wrapper is None:
        raise ValueError(f'arch: {family.__name__} declares no tiny_multimodal_config for {named.__name__}')
    return named(text_config=config.to_dict(), **wrapper)


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
        # a norm module ('Norm' in its class name), not an embedding that norms its output (Inkling's)
        for mod_name, mod in model.named_modules()
        if 'Norm' in type(mod).__name__ and not isinstance(mod, torch.nn.Embedding)
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


def _checkpoint_state_dict(model: torch.nn.Module, dtype: torch.dtype,
                           experts: tuple[str, ...] = ('mlp.experts.',)) -> dict:
    """Return the state dict in the published layout: fused MoE experts split per expert.

    transformers keeps experts as `gate_up_proj` [E, 2*I, H] (gate rows first) and `down_proj`
    [E, H, I]; checkpoints store `experts.{e}.{gate,up,down}_proj.weight` as nn.Linear weights.
    `experts`: the state-dict prefixes of the fused experts (the family's ``tiny_expert_prefixes``).
    """
    out = {}
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


def _mtp_state_dict(config, layer_cls: type, seed: int, dtype: torch.dtype) -> dict:
    """Seeded `mtp.*` tensors of a Qwen3-Next / Qwen3.5-MoE checkpoint (text `config`) in the
    published layout; `layer_cls` is the model's ``transformers`` decoder layer class."""
    import copy

    from torch import nn
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    layer_config = copy.deepcopy(config)
    layer_config.layer_types = list(config.layer_types) + ['full_attention']
    H, eps = config.hidden_size, config.rms_norm_eps
    mtp = nn.Module()
    mtp.pre_fc_norm_embedding = Qwen3NextRMSNorm(H, eps=eps)
    mtp.pre_fc_norm_hidden = Qwen3NextRMSNorm(H, eps=eps)
    mtp.fc = nn.Linear(2 * H, H, bias=False)
    torch_state = torch.random.get_rng_state()
    try:
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


def make_tiny_model(out_dir: str, arch: str = DEFAULT_ARCH, seed: int = 0, **overrides) -> str:
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
    family = _family(arch)
    extra_special = IMAGE_TOKENS if family.supports_images else ()
    tok = train_tokenizer(extra_special)
    eos_id, pad_id = tok.token_to_id('<|im_end|>'), tok.token_to_id('<|endoftext|>')
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    config = build_config(arch, vocab_size, eos_id, pad_id, **overrides)
    config.dtype = dtype_name

    model_cls = _transformers_class(arch, config)
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
    if family.tiny_top_level_rope_theta:
        config_dict['rope_theta'] = config.rope_parameters['rope_theta']
    for field, published in family.tiny_published_fields.items():
        config_dict[published] = config_dict.pop(field)
    family.tiny_config_json(config_dict)
    config_dict['architectures'] = [model_cls.__name__]
    if (not family.tiny_keeps_infinite_time_step_limit
            and tuple(config_dict.get('time_step_limit') or ()) == (0.0, math.inf)):
        del config_dict['time_step_limit']      # the default; JSON has no infinity
    if with_mtp:
        # the key the published configs use: Qwen3-Next's top level, Qwen3.5's text config
        config_dict.get('text_config', config_dict)[family.tiny_mtp_layers_key] = 1
    tensors = _checkpoint_state_dict(model, DTYPES[dtype_name], family.tiny_expert_prefixes)
    if with_mtp:
        layer_cls = next(type(m) for m in model.modules() if type(m).__name__.endswith('DecoderLayer'))
        tensors.update(_mtp_state_dict(config.get_text_config(), layer_cls, seed, DTYPES[dtype_name]))
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


def _transformers_class(arch: str, config) -> type:
    """The ``transformers`` model class that builds the tiny `arch` checkpoint: the auto
    image-text-to-text class of a vision-language config, else the auto causal-LM class."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if 'text_config' in config.sub_configs
             else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return getattr(transformers, names[arch])


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
