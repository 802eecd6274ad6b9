"""Store object sizes for the write simulator: the published models' cache-shaping config
fields (the ``--preset`` sizes of ``benchmark/simulate_store_writes.py``, which re-exports every
name here), the dtype table, and :func:`sizes_from_config`, which sizes S and K_blk from the
engine model's own cache specs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.store_sim import DEFAULT_BLOCK  # noqa: E402
from lmdeploy.pytorch.cache_specs import (kv_bytes_per_block, kv_window, paged_groups,  # noqa: E402
                                          state_bytes_per_slot)

SEED_STATE_TO_BLOCK_RATIO = Fraction('717.5')
DTYPE_BYTES = {'float32': 4, 'float': 4, 'fp32': 4, 'float16': 2, 'half': 2, 'fp16': 2, 'bfloat16': 2,
               'bf16': 2, 'float8_e4m3fn': 1, 'float8_e5m2': 1, 'fp8': 1, 'int8': 1}
_TORCH_DTYPE = {4: 'float32', 2: 'bfloat16', 1: 'int8'}     # any dtype of that width sizes alike

TINY_CONFIG = dict(model_type='qwen3_next', num_hidden_layers=4, full_attention_interval=4,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, num_key_value_heads=2,
                   head_dim=16, dtype='float32')
QWEN3_NEXT_80B_CONFIG = dict(model_type='qwen3_next', num_hidden_layers=48, full_attention_interval=4,
                             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_key_value_heads=2,
                             head_dim=256, dtype='bfloat16')

# the published Kimi-Linear-48B-A3B config.json's cache-shaping fields: 20 KDA layers (32 heads of
# 128, short convs of 4) and 7 MLA layers (latent 512 + rope 64 per token, one row for all heads)
KIMI_LINEAR_48B_CONFIG = dict(model_type='kimi_linear', num_hidden_layers=27, hidden_size=2304,
                              num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                              linear_attn_config=dict(
                                  full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                                  kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                                  num_heads=32, head_dim=128, short_conv_kernel_size=4),
                              dtype='bfloat16')

# NVIDIA-Nemotron-3-Nano-30B-A3B (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json, as reproduced
# in public test fixtures of several repositories): 52 blocks 'MEMEM*EMEMEM*...' = 23 Mamba-2 (64 heads
# of 64, 8 groups, state 128, conv 4), 23 MoE (128 experts, top 6), 6 GQA attention (32 heads, 2 KV
# heads of 128, no RoPE); only the Mamba-2 and attention blocks cache anything
NEMOTRON_3_NANO_30B_CONFIG = dict(model_type='nemotron_h', hidden_size=2688, vocab_size=131072,
                                  hybrid_override_pattern='MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME',
                                  num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                                  mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                                  conv_kernel=4, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6,
                                  moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
                                  intermediate_size=1856, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                                  dtype='bfloat16')

# ibm-granite/granite-4.0-h-small's cache-shaping fields: hidden 4096, 40 layers, 32 query / 8 KV
# heads, mamba_d_state 128, mamba_d_conv 4, mamba_expand 2, bf16 as quoted from its published
# config.json (huggingface.co/ibm-granite/granite-4.0-h-small/blob/main/config.json) in public
# notes; the 4 attention layers at 5, 15, 25, 35 (the family's 40-layer layout, as in
# granite-4.0-h-tiny's config), 128 Mamba heads of 64 and one B/C group are the family's values,
# not seen in that file here. S: 36 x (conv (8192 + 2 x 128) x 3 bf16 + SSM 128 x 64 x 128 float32).
GRANITE_4_0_H_SMALL_CONFIG = dict(model_type='granitemoehybrid', num_hidden_layers=40, hidden_size=4096,
                                  num_attention_heads=32, num_key_value_heads=8,
                                  layer_types=['attention' if i in (5, 15, 25, 35) else 'mamba' for i in range(40)],
                                  mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                                  mamba_d_conv=4, mamba_expand=2, num_local_experts=72, num_experts_per_tok=10,
                                  intermediate_size=768, shared_intermediate_size=1536, vocab_size=100352,
                                  dtype='bfloat16')

# LiquidAI/LFM2-1.2B's cache-shaping fields as recalled from its published config.json (not seen in
# that file here): hidden 2048, 16 layers of which 6 attend (2, 5, 8, 10, 12, 14; 32 query / 8 KV heads
# of 64), the other 10 short convs of width 3 (conv_L_cache), bf16. S: 10 x 2048 x 2 bf16 conv states
# and nothing else (no recurrent tensor), smaller than one KV block.
LFM2_1_2B_CONFIG = dict(model_type='lfm2', num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                        num_key_value_heads=8, conv_L_cache=3, block_ff_dim=12288, vocab_size=65536,
                        layer_types=['full_attention' if i in (2, 5, 8, 10, 12, 14) else 'conv' for i in range(16)],
                        dtype='bfloat16')


@dataclass(frozen=True)
class StoreSizes:
    """Per-rank state and KV block sizes in bytes, and what one Store object of each holds.

    A tensor-parallel engine writes its objects in the full-head layout (every rank's slice
    assembled, docs/en/advance/parallelism.md), so the Store is charged ``store_state_bytes`` /
    ``store_kv_block_bytes``: the sums over ranks of the heads each owns (a KV head replicated
    on several ranks counts once), equal to the ``tp = 1`` sizes.
    """

    state_bytes: int
    kv_block_bytes: int
    tp: int = 1
    store_state_bytes: int | None = None      # None: state_bytes * tp
    store_kv_block_bytes: int | None = None   # None: kv_block_bytes * tp
    window: int | None = None     # tokens, when every paged layer slides: a save puts its window's blocks only
    # a window group with a pool of its own (a mixed model, with state or without, tp = 1): K_win per window
    # object and that group's window; kv_block_bytes is then K_glob (the global layers' row)
    window_block_bytes: int = 0
    window_rows: int | None = None

    @property
    def windows(self) -> dict:
        """The window arguments of :func:`~benchmark.store_sim.simulate` for these sizes."""
        return dict(window=self.window, window_block_bytes=self.window_block_bytes, window_rows=self.window_rows)

    @property
    def charged(self) -> tuple[int, int]:
        """``(S, K_blk)`` the Store is charged per object."""
        return (self.state_bytes * self.tp if self.store_state_bytes is None else self.store_state_bytes,
                self.kv_block_bytes * self.tp if self.store_kv_block_bytes is None else self.store_kv_block_bytes)


def _dtype_bytes(name: str, field: str) -> int:
    key = str(name).removeprefix('torch.')
    if key not in DTYPE_BYTES:
        raise ValueError(f'{field}: unknown dtype {name!r}')
    return DTYPE_BYTES[key]


def _engine_config(config: dict):
    """The ``transformers`` config object of a ``config.json`` dict (its ``model_type``), as the
    engine loads it: a field the dict leaves out takes transformers' default."""
    from transformers import AutoConfig
    fields = dict(config)
    model_type = fields.pop('model_type', None)
    if model_type is None:
        raise ValueError("config is missing field 'model_type'")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as err:
        raise ValueError(f'config: model_type {model_type!r}: {err}') from None


def _with_dtypes(specs: list, model_dtype, kv_dtype, state_dtype) -> list:
    """``specs`` with every paged tensor stored in ``kv_dtype`` and every state tensor kept in
    the model dtype stored in ``state_dtype`` (float32 recurrent states stay float32)."""
    from dataclasses import replace

    from lmdeploy.pytorch.cache_specs import PagedSpec, StateSpec
    out = []
    for spec in specs:
        if spec.paged:
            out.append(PagedSpec(tuple(replace(t, dtype=kv_dtype) for t in spec.tensors())))
        else:
            out.append(StateSpec(tuple(replace(t, dtype=state_dtype) if t.dtype == model_dtype else t
                                       for t in spec.tensors())))
    return out


def sizes_from_config(config: dict, *, tp: int = 1, block_size: int = DEFAULT_BLOCK, kv_dtype: str | None = None,
                      state_dtype: str | None = None, mtp: bool = False) -> StoreSizes:
    """Per-rank state snapshot bytes S and KV block bytes K_blk of a hybrid HF config, from the
    engine model's own cache specs (the model registry's ``cache_specs`` of this rank's local
    config, :class:`~lmdeploy.pytorch.distributed.sharding.TPLayout`): the same specs and row
    layout the engine's cache and Store payloads use, so no layer geometry is re-derived here.

    With ``mtp`` (the engine runs ``mtp`` speculative decoding) K_blk also holds the
    K/V rows of the ``num_nextn_predict_layers`` MTP layers (default 1); S is unchanged. Paged
    tensors use ``kv_dtype`` and state tensors ``state_dtype`` (default: the model dtype, else
    bfloat16); a float32 recurrent state stays float32.

    A model of global and sliding-window layers (at tp = 1, without ``mtp``) keeps its window
    layers in a pool of their own, with or without recurrent state (S = 0 without): K_blk is then
    K_glob, the global layers' row of a block, and ``window_block_bytes`` K_win, the sliding
    layers' row, put as window objects (``window_rows``: that group's window).

    Raises:
        ValueError: no or an unknown ``model_type``, ``tp`` does not divide a head count (names
            the field), or a dtype is unknown.
    """
    if tp < 1:
        raise ValueError(f'tp must be >= 1, got {tp}')
    import torch

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from lmdeploy.pytorch.models import get_model_class
    from lmdeploy.pytorch.spec_decode.mtp import mtp_cache_spec
    cfg = _engine_config(config)
    text = cfg.get_text_config()
    name = str(getattr(text, 'dtype', None) or config.get('dtype') or config.get('torch_dtype') or 'bfloat16')
    model_t = getattr(torch, _TORCH_DTYPE[_dtype_bytes(name, 'dtype')])
    state_t = getattr(torch, _TORCH_DTYPE[_dtype_bytes(state_dtype or name, 'state_dtype')])
    kv_t = getattr(torch, _TORCH_DTYPE[_dtype_bytes(kv_dtype or name, 'kv_dtype')])
    cls = get_model_class(cfg.model_type)

    def specs(local) -> list:
        out = list(cls.cache_specs(local, model_t))
        if mtp:
            out += [mtp_cache_spec(local.get_text_config(), model_t)] * int(
                getattr(text, 'num_nextn_predict_layers', None) or 1)
        return _with_dtypes(out, model_t, kv_t, state_t)
    try:
        rank = specs(TPLayout(cfg, 0, tp).local_config() if tp > 1 else cfg)
    except ValueError as err:
        raise ValueError(f'tp={tp}: {err}') from None
    whole = specs(cfg)
    charged = (state_bytes_per_slot(whole), kv_bytes_per_block(whole, block_size)) if tp > 1 else (None, None)
    # (read before _with_dtypes, which keeps only the tensors of each paged spec)
    plain = list(cls.cache_specs(cfg, model_t)) + ([mtp_cache_spec(text, model_t)] if mtp else [])
    window = kv_window(plain)
    groups = paged_groups(plain)
    if len(groups) > 1 and tp == 1 and not mtp:
        # the engine's Store layout for a mixed model, with state or without (single process, no
        # drafts): its window layers keep a pool of their own, their rows are window objects
        glob, win = ([rank[i] for i in g.entries] for g in groups)
        return StoreSizes(state_bytes_per_slot(rank), kv_bytes_per_block(glob, block_size), tp,
                          window_block_bytes=kv_bytes_per_block(win, block_size), window_rows=groups[1].window)
    return StoreSizes(state_bytes_per_slot(rank), kv_bytes_per_block(rank, block_size), tp, *charged,
                      window=window or None)


def glm_5_3_flash_sizes(args: argparse.Namespace, block_size: int) -> StoreSizes:
    """The GLM-5.3-Flash preset (benchmark/glm5_next_sizes.py): the seed deployment's TP, KV
    dtype and MTP unless given."""
    import torch

    from benchmark.glm5_next_sizes import GLM_5_3_FLASH_CONFIG, GLM_5_3_FLASH_DEPLOYMENT, glm5_next_sizes
    deploy = GLM_5_3_FLASH_DEPLOYMENT
    tp = args.tp or deploy['tp']
    kv = getattr(torch, _TORCH_DTYPE[_dtype_bytes(args.kv_dtype or deploy['kv_dtype'], 'kv_dtype')])
    state = getattr(torch, _TORCH_DTYPE[_dtype_bytes(args.state_dtype or 'bfloat16', 'state_dtype')])
    mtp = deploy['mtp'] if args.mtp is None else args.mtp
    s, k, s_all, k_all = glm5_next_sizes(GLM_5_3_FLASH_CONFIG, tp=tp, block_size=block_size, kv_dtype=kv,
                                         state_dtype=state, mtp=mtp)
    return StoreSizes(s, k, tp, s_all, k_all)
