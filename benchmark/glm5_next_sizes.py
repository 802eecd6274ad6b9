"""Store sizes S and K_blk of GLM-5.3-Flash (``glm5_next``) from its config, for
``simulate_store_writes.py --preset glm-5.3-flash``.

The engine has no ``glm5_next`` model file on this branch, so the layer cache specs are built
here from the config with the engine's own spec types (:mod:`lmdeploy.pytorch.cache_specs`),
in the layout the Kimi-Linear model uses for the same two pieces, and sized by the same
:func:`~lmdeploy.pytorch.cache_specs.state_bytes_per_slot` /
:func:`~lmdeploy.pytorch.cache_specs.kv_bytes_per_block` the simulator's other presets use:

- a KDA layer (``layer_types[i] == 'linear_attention'``): one state per sequence, ``q_conv``,
  ``k_conv``, ``v_conv`` ``[H, d, kernel - 1]`` in the state dtype and ``recurrent [H, d, d]``
  float32, H = ``linear_num_heads / tp`` on each rank (split by head);
- a DSA layer (``'indexed_attention'``, or ``'full_attention'``): paged, per token the MLA latent
  ``kv_lora_rank + qk_rope_head_dim`` (``qk_rope_head_dim`` is 0: NoPE) and, where the layer runs
  its own indexer (``indexer_types[i] == 'full'``; a ``'shared'`` layer reuses the previous
  top-k and caches no indexer keys), the indexer's per-token row: the key (``index_head_dim``)
  and the k-pool compression gate scores (``index_head_dim``), which transformers caches per
  token beside a padding-validity flag (a paged engine knows its lengths and stores no flag).
  Both are the same on every rank (one latent head; the indexer is single-head): replicated,
  stored and charged once;
- with ``mtp``, each of the ``num_nextn_predict_layers`` NextN layers (default 1) adds one more
  DSA layer's paged row (latent and indexer keys); S is unchanged.

Paged tensors are stored in ``kv_dtype`` (the preset: FP8, one byte), states in the model dtype
(bfloat16) except the float32 recurrent state.
"""
from __future__ import annotations

import torch

from lmdeploy.pytorch.cache_specs import (CacheTensor, LayerCacheSpec, PagedSpec, StateSpec, kv_bytes_per_block,
                                          state_bytes_per_slot)

__all__ = ['GLM_5_3_FLASH_CONFIG', 'GLM_5_3_FLASH_DEPLOYMENT', 'glm5_next_specs', 'glm5_next_sizes']

# The cache-shaping fields of the published GLM-5.3-Flash text config (zai-org/GLM-5.3-Flash;
# transformers' Glm5NextTextConfig defaults are that checkpoint's): 45 layers, every fourth
# (3, 7, ..., 43) DSA, the other 34 KDA with 64 heads of 128 and short convs of 4; NoPE MLA with a
# 512 latent; indexer head dim 128; one NextN MTP layer. indexer_types is not set: transformers'
# default schedule runs the indexer in every DSA layer.
GLM_5_3_FLASH_CONFIG = dict(model_type='glm5_next', num_hidden_layers=45, linear_num_heads=64, linear_head_dim=128,
                            linear_conv_kernel_dim=4, kv_lora_rank=512, qk_rope_head_dim=0, index_head_dim=128,
                            num_nextn_predict_layers=1, dtype='bfloat16')
# the seed's deployment: TP8, FP8 weights and an FP8 KV cache (assumed: the paged latent and
# indexer keys in float8_e4m3fn), MTP on
GLM_5_3_FLASH_DEPLOYMENT = dict(tp=8, kv_dtype='float8_e4m3fn', mtp=True)

_LINEAR = 'linear_attention'
_DSA = ('indexed_attention', 'full_attention', 'deepseek_sparse_attention')


def _field(config: dict, name: str):
    if name not in config:
        raise ValueError(f'config is missing field {name!r}')
    return config[name]


def _layer_types(config: dict) -> list[str]:
    n = int(_field(config, 'num_hidden_layers'))
    types = config.get('layer_types') or [_LINEAR if i % 4 != 3 else 'indexed_attention' for i in range(n)]
    if len(types) != n or any(t != _LINEAR and t not in _DSA for t in types):
        raise ValueError(f'layer_types: expected {n} entries of {_LINEAR!r} or {_DSA}; got {types}')
    return list(types)


def _indexer_types(config: dict, n: int) -> list[str]:
    types = config.get('indexer_types') or ['full'] * n
    if len(types) != n or any(t not in ('full', 'shared') for t in types):
        raise ValueError(f"indexer_types: expected {n} entries of 'full' or 'shared'; got {types}")
    return list(types)


def glm5_next_specs(config: dict, *, tp: int = 1, state_dtype: torch.dtype = torch.bfloat16,
                    kv_dtype: torch.dtype = torch.bfloat16, mtp: bool = False,
                    whole: bool = False) -> list[LayerCacheSpec]:
    """Per-layer cache specs of one rank (``whole``: the whole model, every head, each
    replicated tensor once) of a ``glm5_next`` text config dict.

    Raises:
        ValueError: a missing field, bad ``layer_types`` / ``indexer_types``, or ``tp`` not
            dividing ``linear_num_heads`` (each names the field).
    """
    heads = int(_field(config, 'linear_num_heads'))
    if tp < 1 or heads % tp:
        raise ValueError(f'linear_num_heads: {heads} heads do not split over tp={tp}')
    H = heads if whole else heads // tp
    d, K = int(_field(config, 'linear_head_dim')), int(_field(config, 'linear_conv_kernel_dim'))
    latent = int(_field(config, 'kv_lora_rank')) + int(config.get('qk_rope_head_dim', 0))
    index_dim = int(_field(config, 'index_head_dim'))
    convs = tuple(CacheTensor(name, (H, d, K - 1), state_dtype, 'v_heads') for name in ('q_conv', 'k_conv', 'v_conv'))
    kda = StateSpec(convs + (CacheTensor('recurrent', (H, d, d), torch.float32, 'v_heads'),))

    def dsa(with_indexer: bool) -> PagedSpec:
        tensors = (CacheTensor('latent', (latent,), kv_dtype, None),)
        if with_indexer:
            tensors += (CacheTensor('indexer', (2 * index_dim,), kv_dtype, None),)
        return PagedSpec(tensors)

    layer_types = _layer_types(config)
    indexer = _indexer_types(config, len(layer_types))
    specs = [kda if t == _LINEAR else dsa(indexer[i] == 'full') for i, t in enumerate(layer_types)]
    if mtp:
        specs += [dsa(True)] * int(config.get('num_nextn_predict_layers') or 1)
    return specs


def glm5_next_sizes(config: dict, *, tp: int, block_size: int, kv_dtype: torch.dtype, state_dtype: torch.dtype,
                    mtp: bool) -> tuple[int, int, int, int]:
    """``(S, K_blk)`` of one rank, then charged over all ranks (each head once, the replicated
    latent and indexer keys once), in bytes."""
    def sizes(whole: bool) -> tuple[int, int]:
        specs = glm5_next_specs(config, tp=tp, state_dtype=state_dtype, kv_dtype=kv_dtype, mtp=mtp, whole=whole)
        return state_bytes_per_slot(specs), kv_bytes_per_block(specs, block_size)
    return sizes(False) + sizes(True)
