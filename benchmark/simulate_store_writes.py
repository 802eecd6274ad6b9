"""Simulate Mooncake Store write volume of the two checkpoint save policies
(docs/en/advance/prefix_caching.md "Save policies", docs/en/advance/store.md "The byte formula").

Owns the byte accounting of Store puts per conversation; it runs no model. For every turn
of a scenario it plans the prefill with :func:`plan_prefill` under the default policy and
under ``prefill_save_last_only`` and charges, as docs/en/advance/store.md "The byte formula" states,

    bytes(turn) = len(save_points) * S + (KV blocks newly covered) * K_blk

where the newly covered blocks are the blocks of ``[0, max save point)`` not stored by an
earlier save. A conversation is append-only (turn t+1's input = turn t's input + reply +
new user text), so turn t+1 starts from a cache hit ``c`` = the deepest earlier save point
that a restore can use (``c + r·B <= floor_B(n - 1)``), and Store blocks always form one
prefix ``[0, stored_blocks)``::

    turn 1   |== 8192 ==|== 16384 ==|== 24576 ==|== 32768 ==|64|     default: S at every |
    turn 2   |<------------- hit c = 32768 -------------->|=36864=|64|  + blocks 32768..36864

Sizes: explicit (``--state-bytes``/``--kv-block-bytes``), a ratio S/K_blk (sizes in
relative units), a preset, or an HF ``config.json`` of a hybrid (``qwen3_next``) model:
per linear-attention layer the state is ``conv_dim·(kernel-1)·dtype_bytes`` conv state plus
``v_heads·k_head_dim·v_head_dim·4`` fp32 recurrent state (``conv_dim = 2·k_heads·k_head_dim
+ v_heads·v_head_dim``, heads divided by tp); ``K_blk = full_layers·2·B·kv_heads_per_rank·
head_dim·dtype_bytes``. All sizes are per rank; every rank puts its own objects, so totals
over ranks are ``tp`` times larger and the reduction is unchanged.

Reductions ``1 - bytes_last_only / bytes_default`` are printed *truncated* to 0.01%: the seed
table lists 32K+64 as 63.64% while the exact value is 63.6458%.

Usage: ``python benchmark/simulate_store_writes.py --preset seed-table``
(``--preset tiny|qwen3-next-80b [--tp N]``, ``--config config.json``, ``--scale 1/16
--block-size 16``, ``--turns 32832,36928``, ``--json``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill  # noqa: E402

KTOK = 1024
DEFAULT_CHUNK, DEFAULT_BLOCK, DEFAULT_ALIGNMENT = 8192, 64, 1024
SEED_STATE_TO_BLOCK_RATIO = Fraction('717.5')
DTYPE_BYTES = {'float32': 4, 'float': 4, 'fp32': 4, 'float16': 2, 'half': 2, 'fp16': 2, 'bfloat16': 2,
               'bf16': 2, 'float8_e4m3fn': 1, 'float8_e5m2': 1, 'fp8': 1, 'int8': 1}

TINY_CONFIG = dict(model_type='qwen3_next', num_hidden_layers=4, full_attention_interval=4,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, num_key_value_heads=2,
                   head_dim=16, dtype='float32')
QWEN3_NEXT_80B_CONFIG = dict(model_type='qwen3_next', num_hidden_layers=48, full_attention_interval=4,
                             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_key_value_heads=2,
                             head_dim=256, dtype='bfloat16')


@dataclass(frozen=True)
class Scenario:
    """An append-only conversation: ``input_lengths[t]`` tokens are the input of turn t."""

    name: str
    input_lengths: tuple[int, ...]
    output_tokens: int = 16

    def scaled(self, factor: Fraction) -> 'Scenario':
        """The scenario with every token count multiplied by ``factor`` (exactly).

        Raises:
            ValueError (``scale``): a scaled input length is not a positive integer.
        """
        def one(x: int) -> int:
            y = Fraction(x) * factor
            if y.denominator != 1 or y < 1:
                raise ValueError(f'scale {factor} makes {x} tokens of {self.name!r} non-integral')
            return int(y)
        # the reply length is informational (already inside the next input): round it leniently
        return Scenario(self.name, tuple(one(n) for n in self.input_lengths),
                        max(1, math.floor(self.output_tokens * factor)))


def seed_scenarios() -> list[Scenario]:
    """The six seed-table scenarios (K = 1024 tokens)."""
    singles = [Scenario(f'{k}K+64', (k * KTOK + 64, ), 16) for k in (8, 16, 32, 64)]
    multi = [Scenario(f'32K+64 x5 turns, +{g}K/turn', tuple(32 * KTOK + 64 + t * g * KTOK for t in range(5)), 512)
             for g in (4, 16)]
    return singles + multi


@dataclass(frozen=True)
class TurnResult:
    """Store writes of one turn under one policy. Bytes are per rank."""

    num_tokens: int
    cached_tokens: int
    chunk_ends: list[int]
    save_points: list[int]
    new_kv_blocks: int
    state_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.kv_bytes


@dataclass(frozen=True)
class PolicyResult:
    """All turns of a scenario under one policy."""

    turns: list[TurnResult]

    @property
    def total_bytes(self) -> int:
        return sum(t.total_bytes for t in self.turns)

    @property
    def num_saves(self) -> int:
        return sum(len(t.save_points) for t in self.turns)


@dataclass(frozen=True)
class SimulationResult:
    """Both policies on one scenario; ``reduction`` = 1 - last_only bytes / default bytes (exact)."""

    scenario: Scenario
    default: PolicyResult
    last_only: PolicyResult

    @property
    def reduction(self) -> Fraction:
        if self.default.total_bytes == 0:
            return Fraction(0)
        return 1 - Fraction(self.last_only.total_bytes, self.default.total_bytes)


def _simulate_policy(lengths: Sequence[int], last_only: bool, state_bytes: int, kv_block_bytes: int,
                     chunk_size: int, block_size: int, alignment: int, token_lookahead: int,
                     recompute_blocks: int) -> PolicyResult:
    saved: list[int] = []       # boundaries with a Store state object, earlier turns and saves
    stored_blocks = 0           # Store KV objects form the prefix [0, stored_blocks) blocks
    turns = []
    for n in lengths:
        usable = [b for b in saved if b + recompute_blocks * block_size <= (n - 1) // block_size * block_size]
        cached = max(usable, default=0)
        plan = plan_prefill(n, cached, chunk_size, block_size, alignment, last_only, token_lookahead,
                            recompute_blocks)
        deepest = max(plan.save_points, default=0)
        new_blocks = max(0, deepest // block_size - stored_blocks)
        stored_blocks += new_blocks
        saved.extend(plan.save_points)
        turns.append(TurnResult(n, cached, plan.chunk_ends, plan.save_points, new_blocks,
                                len(plan.save_points) * state_bytes, new_blocks * kv_block_bytes))
    return PolicyResult(turns)


def simulate(scenario: Scenario | Sequence[int], state_bytes: int, kv_block_bytes: int, *, chunk_size: int,
             block_size: int, alignment: int, token_lookahead: int = 0,
             recompute_blocks: int = 0) -> SimulationResult:
    """Store bytes and save points of every turn of ``scenario`` under both policies.

    Args:
        scenario: a :class:`Scenario` or the input lengths (tokens) of its turns, non-decreasing.
        state_bytes: S, bytes of one state snapshot (or relative units).
        kv_block_bytes: K_blk, bytes of one KV block over all full-attention layers.
        chunk_size, block_size, alignment, token_lookahead, recompute_blocks: P, B, A, ℓ, r.

    Raises:
        ValueError: a size is negative, turns shrink, or a planning argument is invalid.
    """
    if not isinstance(scenario, Scenario):
        scenario = Scenario('custom', tuple(int(n) for n in scenario))
    lengths = scenario.input_lengths
    if not lengths or any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f'scenario input_lengths must be non-empty and non-decreasing, got {lengths}')
    if state_bytes < 0:
        raise ValueError(f'state_bytes must be >= 0, got {state_bytes}')
    if kv_block_bytes < 0:
        raise ValueError(f'kv_block_bytes must be >= 0, got {kv_block_bytes}')
    args = (state_bytes, kv_block_bytes, chunk_size, block_size, alignment, token_lookahead, recompute_blocks)
    return SimulationResult(scenario, _simulate_policy(lengths, False, *args), _simulate_policy(lengths, True, *args))


@dataclass(frozen=True)
class StoreSizes:
    """Per-rank Store object sizes in bytes; ``tp`` ranks each put their own."""

    state_bytes: int
    kv_block_bytes: int
    tp: int = 1


def _dtype_bytes(name: str, field: str) -> int:
    key = str(name).removeprefix('torch.')
    if key not in DTYPE_BYTES:
        raise ValueError(f'{field}: unknown dtype {name!r}')
    return DTYPE_BYTES[key]


def sizes_from_config(config: dict, *, tp: int = 1, block_size: int = DEFAULT_BLOCK, kv_dtype: str | None = None,
                      state_dtype: str | None = None) -> StoreSizes:
    """Per-rank state snapshot bytes S and KV block bytes K_blk of a hybrid HF config.

    Layer kinds come from ``layer_types`` (``linear_attention``/``full_attention``) or else
    ``full_attention_interval`` (layer i is full when ``(i + 1) % interval == 0``). Conv state
    uses ``state_dtype`` (default: the model dtype); the recurrent state is fp32.

    Raises:
        ValueError: ``tp`` does not divide the head counts, a field is missing, or a dtype is unknown.
    """
    if tp < 1:
        raise ValueError(f'tp must be >= 1, got {tp}')
    try:
        layers = config.get('layer_types') or [
            'full_attention' if (i + 1) % config['full_attention_interval'] == 0 else 'linear_attention'
            for i in range(config['num_hidden_layers'])]
        model_dtype = config.get('dtype') or config.get('torch_dtype') or 'bfloat16'
        k_heads, v_heads = config['linear_num_key_heads'], config['linear_num_value_heads']
        k_dim, v_dim = config['linear_key_head_dim'], config['linear_value_head_dim']
        kernel = config['linear_conv_kernel_dim']
        kv_heads = config['num_key_value_heads']
        head_dim = config.get('head_dim') or config['hidden_size'] // config['num_attention_heads']
    except KeyError as err:
        raise ValueError(f'config is missing field {err.args[0]!r}') from None
    if k_heads % tp or v_heads % tp:
        raise ValueError(f'tp={tp} must divide linear_num_key_heads={k_heads} and linear_num_value_heads={v_heads}')
    if kv_heads > tp and kv_heads % tp:
        raise ValueError(f'tp={tp} must divide num_key_value_heads={kv_heads}')
    state_b = _dtype_bytes(state_dtype or model_dtype, 'state_dtype')
    kv_b = _dtype_bytes(kv_dtype or model_dtype, 'kv_dtype')
    k_heads, v_heads = k_heads // tp, v_heads // tp
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    per_layer_state = conv_dim * (kernel - 1) * state_b + v_heads * k_dim * v_dim * 4
    num_linear = sum(t == 'linear_attention' for t in layers)
    num_full = sum(t == 'full_attention' for t in layers)
    kv_block = num_full * 2 * block_size * max(1, kv_heads // tp) * head_dim * kv_b
    return StoreSizes(num_linear * per_layer_state, kv_block, tp)


def truncate_percent(x: Fraction) -> str:
    """``x`` as a percentage truncated toward zero to two decimals, e.g. ``'63.64%'``."""
    hundredths = math.floor(abs(x) * 10000)
    sign = '-' if x < 0 else ''
    return f'{sign}{hundredths // 100}.{hundredths % 100:02d}%'


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--preset', choices=['seed-table', 'tiny', 'qwen3-next-80b'])
    p.add_argument('--config', type=Path, help='HF config.json of a hybrid model')
    p.add_argument('--state-bytes', type=int)
    p.add_argument('--kv-block-bytes', type=int)
    p.add_argument('--state-to-block-ratio', type=Fraction, help='S / K_blk; sizes in relative units')
    p.add_argument('--tp', type=int, default=1)
    p.add_argument('--kv-dtype')
    p.add_argument('--state-dtype')
    p.add_argument('--chunk-size', type=int, help='P (default 8192 * scale)')
    p.add_argument('--block-size', type=int, help='B (default 64 * scale)')
    p.add_argument('--alignment', type=int, help='A (default 1024 * scale)')
    p.add_argument('--token-lookahead', type=int, default=0)
    p.add_argument('--recompute-blocks', type=int, default=0)
    p.add_argument('--scale', type=Fraction, default=Fraction(1), help='multiply scenario token counts, e.g. 1/16')
    p.add_argument('--turns', help='custom scenario: comma-separated input lengths of each turn')
    p.add_argument('--json', action='store_true', help='print per-turn results as JSON')
    return p.parse_args(argv)


def _scaled_default(value: int | None, default: int, scale: Fraction, name: str) -> int:
    if value is not None:
        return value
    scaled = default * scale
    if scaled.denominator != 1 or scaled < 1:
        raise ValueError(f'{name}: {default} * scale {scale} is not an integer; pass --{name} explicitly')
    return int(scaled)


def _resolve_sizes(args: argparse.Namespace, block_size: int) -> tuple[StoreSizes, str]:
    sources = [args.preset is not None, args.config is not None, args.state_to_block_ratio is not None,
               args.state_bytes is not None or args.kv_block_bytes is not None]
    if sum(sources) != 1:
        raise ValueError('sizes: give exactly one of --preset, --config, --state-to-block-ratio, '
                         '--state-bytes/--kv-block-bytes')
    ratio = args.state_to_block_ratio
    if args.preset == 'seed-table':
        ratio = SEED_STATE_TO_BLOCK_RATIO
    if ratio is not None:
        return StoreSizes(ratio.numerator, ratio.denominator), 'units'
    if args.state_bytes is not None or args.kv_block_bytes is not None:
        if args.state_bytes is None or args.kv_block_bytes is None:
            raise ValueError('state_bytes: --state-bytes and --kv-block-bytes go together')
        return StoreSizes(args.state_bytes, args.kv_block_bytes), 'bytes'
    if args.preset == 'tiny':
        config = TINY_CONFIG
    elif args.preset == 'qwen3-next-80b':
        config = QWEN3_NEXT_80B_CONFIG
    else:
        config = json.loads(args.config.read_text())
    return sizes_from_config(config, tp=args.tp, block_size=block_size, kv_dtype=args.kv_dtype,
                             state_dtype=args.state_dtype), 'bytes'


def main(argv: Sequence[str] | None = None) -> list[SimulationResult]:
    """CLI entry: print the per-scenario table (or JSON) and return the results."""
    args = _parse_args(argv)
    chunk = _scaled_default(args.chunk_size, DEFAULT_CHUNK, args.scale, 'chunk-size')
    block = _scaled_default(args.block_size, DEFAULT_BLOCK, args.scale, 'block-size')
    align = _scaled_default(args.alignment, DEFAULT_ALIGNMENT, args.scale, 'alignment')
    sizes, unit = _resolve_sizes(args, block)
    if args.turns:
        scenarios = [Scenario('custom', tuple(int(x) for x in args.turns.split(',')))]
    else:
        scenarios = [s.scaled(args.scale) for s in seed_scenarios()]
    results = [simulate(s, sizes.state_bytes, sizes.kv_block_bytes, chunk_size=chunk, block_size=block,
                        alignment=align, token_lookahead=args.token_lookahead,
                        recompute_blocks=args.recompute_blocks) for s in scenarios]
    if args.json:
        print(json.dumps([dict(scenario=asdict(r.scenario), default=asdict(r.default),
                               last_only=asdict(r.last_only), reduction=float(r.reduction)) for r in results],
                         indent=1))
        return results
    print(f'S = {sizes.state_bytes} {unit}, K_blk = {sizes.kv_block_bytes} {unit} per rank (tp={sizes.tp}); '
          f'S/K_blk = {float(Fraction(sizes.state_bytes, max(1, sizes.kv_block_bytes))):g}; '
          f'P={chunk} B={block} A={align} lookahead={args.token_lookahead} recompute={args.recompute_blocks}')
    print(f'{"scenario":<30} {"saves":>5} {"saves":>5} {"default " + unit:>18} {"last-only " + unit:>18} '
          f'{"reduction":>9}')
    print(f'{"":<30} {"def":>5} {"last":>5}')
    for r in results:
        print(f'{r.scenario.name:<30} {r.default.num_saves:>5} {r.last_only.num_saves:>5} '
              f'{r.default.total_bytes:>18} {r.last_only.total_bytes:>18} {truncate_percent(r.reduction):>9}')
    print('reduction = 1 - last-only / default over the whole scenario (truncated to 0.01%, not rounded)')
    return results


if __name__ == '__main__':
    try:
        main()
    except ValueError as err:
        sys.exit(f'error: {err}')
