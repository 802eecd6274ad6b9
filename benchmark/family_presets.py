"""Store-byte presets of the model families added after the first hybrids, and the per-family
table of the Store-byte reduction of ``prefill_save_last_only`` (last-only against the default
save policy) over the seed scenarios (``simulate_store_writes.py --families``).

Owns the cache-shaping config fields of one published model per family (copied from its model
card or ``config.json``, written beside the preset with the model's name; fields recalled rather
than read are marked so) and, where no published config is known here, says so and takes
``transformers``' default config of the family (named ``<family>-default``). The sizes themselves
always come from the engine's own cache specs (:func:`benchmark.store_presets.sizes_from_config`),
so a preset is only a config dict. Every preset is stored in bfloat16 (a deployment choice, not a
copied field); float32 recurrent states stay float32 as the engine keeps them.

How a family's reduction follows from its sizes: last-only saves one state per turn instead of
one per chunk (default: every 8K-token chunk end), and both put the same KV blocks, so the
reduction grows with ``S / ((A / B) · K_blk)``, the state's weight against the KV written between
two checkpoints. A family with no per-token cache (Mamba, Mamba-2) puts states only, and the
reduction is ``1 - saves_last / saves_default`` (16K+64: 1 - 1/2); a family with no state
(attention only) puts the same blocks under both policies, 0%.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.store_presets import (GRANITE_4_0_H_SMALL_CONFIG, KIMI_LINEAR_48B_CONFIG,  # noqa: E402
                                     LFM2_1_2B_CONFIG, NEMOTRON_3_NANO_30B_CONFIG, QWEN3_NEXT_80B_CONFIG, StoreSizes,
                                     glm_5_3_flash_sizes, sizes_from_config)
from benchmark.store_sim import (DEFAULT_ALIGNMENT, DEFAULT_BLOCK, DEFAULT_CHUNK, seed_scenarios,  # noqa: E402
                                 simulate)

# state-spaces/mamba-2.8b-hf config.json (recalled): d_model 2560, 64 Mamba-1 layers, d_state 16,
# expand 2 (d_inner 5120), conv 4; no attention, so K_blk = 0.
# S: 64 x (conv [5120, 3] bf16 + SSM [5120, 16] float32).
MAMBA_2_8B_CONFIG = dict(model_type='mamba', hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2,
                         intermediate_size=5120, conv_kernel=4, dtype='bfloat16')

# tiiuae/falcon-mamba-7b config.json (recalled): hidden 4096, 64 Mamba-1 layers, state 16, expand 2
# (intermediate 8192), conv 4; no attention.
FALCON_MAMBA_7B_CONFIG = dict(model_type='falcon_mamba', hidden_size=4096, num_hidden_layers=64, state_size=16,
                              expand=2, intermediate_size=8192, conv_kernel=4, dtype='bfloat16')

# state-spaces/mamba2-2.7b config.json (recalled; mamba_ssm's Mamba2 layer defaults): d_model 2560,
# 64 Mamba-2 layers, d_state 128, head dim 64 (80 heads = 2 x 2560 / 64), one B/C group, conv 4.
MAMBA2_2_7B_CONFIG = dict(model_type='mamba2', hidden_size=2560, num_hidden_layers=64, state_size=128, head_dim=64,
                          num_heads=80, n_groups=1, expand=2, conv_kernel=4, dtype='bfloat16')

# ibm-fms/Bamba-9B: the model card's 32 layers (29 Mamba-2 + 3 attention), hidden 4096, 32 query /
# 8 KV heads, Mamba-2 head dim 64, conv 4; recalled from its config.json (not seen here): attention
# at layers 9, 18, 27, d_state 128, one B/C group, 128 Mamba heads (= 2 x 4096 / 64).
BAMBA_9B_CONFIG = dict(model_type='bamba', num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=8, attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64,
                       mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, intermediate_size=14336,
                       dtype='bfloat16')

# ai21labs/Jamba-v0.1 config.json (recalled; transformers' JambaConfig defaults are this model's):
# 32 layers, attention every 8th from layer 4 (4 attention layers, 32 query / 8 KV heads of 128),
# 28 Mamba-1 layers (d_state 16, conv 4, expand 2: d_inner 8192), MoE (16 experts, top 2) every other layer.
JAMBA_V0_1_CONFIG = dict(model_type='jamba', num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                         expert_layer_offset=1, num_experts=16, num_experts_per_tok=2, mamba_d_state=16,
                         mamba_d_conv=4, mamba_expand=2, intermediate_size=14336, dtype='bfloat16')

# MiniMaxAI/MiniMax-Text-01 model card: 80 layers, a softmax attention layer after every 7 lightning
# layers (layers 7, 15, ..., 79), 64 heads of 128, hidden 6144, 32 experts of 9216, top 2; recalled
# from its config.json: 8 KV heads. S: 70 lightning layers x float32 [64, 128, 128] (no conv state).
MINIMAX_TEXT_01_CONFIG = dict(model_type='minimax', num_hidden_layers=80, hidden_size=6144, num_attention_heads=64,
                              num_key_value_heads=8, head_dim=128,
                              layer_types=['full_attention' if i % 8 == 7 else 'linear_attention' for i in range(80)],
                              num_local_experts=32, num_experts_per_tok=2, intermediate_size=9216, dtype='bfloat16')


def _default(model_type: str) -> dict:
    """transformers' default config of ``model_type`` (no field set but the dtype)."""
    return dict(model_type=model_type, dtype='bfloat16')


@dataclass(frozen=True)
class FamilyPreset:
    """One family's row of the table: the engine ``model_type``, the ``--preset`` name and where
    its config comes from (``config`` is None for ``glm-5.3-flash``, sized by its own module)."""

    family: str
    preset: str
    source: str
    config: dict | None


# one row per family, in the order of the README's supported-models table; the model a default
# config resembles is the one its transformers docstring names
FAMILY_PRESETS = (
    FamilyPreset('qwen3_next', 'qwen3-next-80b', 'Qwen3-Next-80B-A3B config.json', QWEN3_NEXT_80B_CONFIG),
    FamilyPreset('kimi_linear', 'kimi-linear-48b', 'Kimi-Linear-48B-A3B config.json', KIMI_LINEAR_48B_CONFIG),
    FamilyPreset('glm5_next', 'glm-5.3-flash', 'GLM-5.3-Flash config.json, TP8 FP8 KV + MTP', None),
    FamilyPreset('nemotron_h', 'nemotron-3-nano-30b', 'NVIDIA-Nemotron-3-Nano-30B-A3B config.json',
                 NEMOTRON_3_NANO_30B_CONFIG),
    FamilyPreset('granitemoehybrid', 'granite-4.0-h-small', 'granite-4.0-h-small config.json (partly recalled)',
                 GRANITE_4_0_H_SMALL_CONFIG),
    FamilyPreset('lfm2', 'lfm2-1.2b', 'LFM2-1.2B config.json (recalled)', LFM2_1_2B_CONFIG),
    FamilyPreset('lara_mini', 'lara-mini-default', "transformers' default (~ Lara-4-Mini-Base)", _default('lara_mini')),
    FamilyPreset('lfm3', 'lfm3-default', "transformers' default (~ LFM3-1.7B)", _default('lfm3')),
    FamilyPreset('inkling_text', 'inkling-default', "transformers' default (~ Inkling)", _default('inkling_text')),
    FamilyPreset('bamba', 'bamba-9b', 'Bamba-9B model card (+ recalled config.json)', BAMBA_9B_CONFIG),
    FamilyPreset('falcon_h1', 'falcon-h1-default', "transformers' default (~ Falcon-H1-1.5B-Deep-Instruct)",
                 _default('falcon_h1')),
    FamilyPreset('mamba2', 'mamba2-2.7b', 'mamba2-2.7b config.json (recalled)', MAMBA2_2_7B_CONFIG),
    FamilyPreset('jamba', 'jamba-v0.1', 'Jamba-v0.1 config.json (recalled)', JAMBA_V0_1_CONFIG),
    FamilyPreset('bailing_hybrid', 'bailing-hybrid-default', "transformers' default (~ Ling-3.0-Flash)",
                 _default('bailing_hybrid')),
    FamilyPreset('minimax', 'minimax-text-01', 'MiniMax-Text-01 model card (+ recalled KV heads)',
                 MINIMAX_TEXT_01_CONFIG),
    FamilyPreset('olmo_hybrid', 'olmo-hybrid-default', "transformers' default (~ Olmo-Hybrid-7B)",
                 _default('olmo_hybrid')),
    FamilyPreset('zamba2', 'zamba2-default', "transformers' default (~ Zamba2-2.7B)", _default('zamba2')),
    FamilyPreset('mamba', 'mamba-2.8b', 'mamba-2.8b-hf config.json (recalled)', MAMBA_2_8B_CONFIG),
    FamilyPreset('falcon_mamba', 'falcon-mamba-7b', 'falcon-mamba-7b config.json (recalled)', FALCON_MAMBA_7B_CONFIG),
    FamilyPreset('granitemoe_swa', 'granitemoe-swa-default', "transformers' default (~ granite-swash-3b-a600m)",
                 _default('granitemoe_swa')),
)
# families with no row: lfm2_moe (no published layer layout known here, and transformers' default
# Lfm2MoeConfig lists no layer_types, which the engine refuses), qwen3 (no state: attention only)
PRESET_CONFIGS = {p.preset: p.config for p in FAMILY_PRESETS if p.config is not None}


def family_sizes(preset: FamilyPreset, block_size: int = DEFAULT_BLOCK) -> StoreSizes:
    """``(S, K_blk)`` of ``preset`` at TP 1 (glm-5.3-flash: its seed deployment), bytes."""
    if preset.config is None:
        args = argparse.Namespace(tp=None, kv_dtype=None, state_dtype=None, mtp=None)
        return glm_5_3_flash_sizes(args, block_size)
    return sizes_from_config(preset.config, block_size=block_size)


def family_table() -> list[tuple[FamilyPreset, StoreSizes, list[Fraction]]]:
    """Per family: its preset, its charged sizes and the reductions ``1 - last_only / default``
    of the six seed scenarios (in :func:`seed_scenarios` order) at the seed geometry (P = 8192,
    B = 64, A = 1024)."""
    rows = []
    for preset in FAMILY_PRESETS:
        sizes = family_sizes(preset)
        reductions = [simulate(s, *sizes.charged, chunk_size=DEFAULT_CHUNK, block_size=DEFAULT_BLOCK,
                               alignment=DEFAULT_ALIGNMENT, **sizes.windows).reduction
                      for s in seed_scenarios()]
        rows.append((preset, sizes, reductions))
    return rows


def format_family_table(rows, percent) -> list[str]:
    """The markdown lines of :func:`family_table`'s ``rows`` (``percent`` formats a reduction)."""
    head = ['family', '`--preset`', 'config from', 'S (bytes)', 'K_blk (bytes)']
    head += [s.name for s in seed_scenarios()]
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for preset, sizes, reductions in rows:
        s, k = sizes.charged
        # a window group of its own: K_glob per KV object, then K_win per window object (its W)
        kv = f'{k:,}' if not sizes.window_rows else f'{k:,} + {sizes.window_block_bytes:,} (W={sizes.window_rows})'
        cells = [f'`{preset.family}`', f'`{preset.preset}`', preset.source, f'{s:,}', kv]
        lines.append('| ' + ' | '.join(cells + [percent(r) for r in reductions]) + ' |')
    return lines
