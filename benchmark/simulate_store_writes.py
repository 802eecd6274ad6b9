"""Simulate Mooncake Store write volume and prefill recompute of the checkpoint save policies
(docs/en/advance/prefix_caching.md "Save policies", docs/en/advance/store.md "The byte formula").

Owns the byte accounting of Store puts per conversation; it runs no model. For every request
of a scenario it plans the prefill with :func:`plan_prefill` under each policy and charges

    bytes(request) = (state snapshots saved) * S + (KV blocks newly covered) * K_blk

where the newly covered blocks are the blocks below a saved boundary that no earlier save put
(the Store keys blocks by their prefix, so a block is put once however many requests share
it). A request starts from a cache hit ``c`` = the deepest earlier checkpoint whose tokens it
shares and that a restore can use (reusable for this input, and its ``r`` blocks past ``c``
cached); it then recomputes ``n - c`` prompt tokens, the figure that drives TTFT::

    turn 1   |== 8192 ==|== 16384 ==|== 24576 ==|== 32768 ==|64|     default: S at every |
    turn 2   |<------------- hit c = 32768 -------------->|=36864=|64|  + blocks 32768..36864

Policies (engine config fields): ``default``; ``last-only`` (``prefill_save_last_only``: one
save per turn, at b* = ``last_reusable(n)``); ``+turn-end`` (``decode_save_last``: when a
request finishes, one more checkpoint at ``te = floor_B(n + output - 1)``, the last block
boundary of its computed tokens, if a forward ended there (a prompt forward also ends at
``floor_B(n)``, so one does unless it is a save point or falls inside an image); restores then
accept any block boundary, not only multiples of A); ``+junction`` (``save_junction``: a request whose cached
full blocks reach ``m`` tokens, deeper than its hit ``c``, also saves at the largest reusable
boundary ``j`` with ``c < j <= m``, splitting the chunk that contains ``j``)::

    append-only, last-only + turn-end        branching, last-only + junction
    turn t   |====== b*|==|te  reply..|       sibling 1 |==== shared ====|== own ==b*|
    turn t+1 |<-- hit te -->|== new ==|       sibling 2 |==== shared ==j|   (save at j)
                                              sibling 3 |<--- hit j -->|== own ==|

Scenarios: :class:`Scenario` (an append-only conversation: turn t+1's input = turn t's input
+ its reply + new user text) and :class:`Branching` (N siblings that share a prefix and then
diverge, sent one after another; each finds every earlier sibling's blocks and checkpoints).
Either may start with a shared head of ``head_tokens`` (``--head-tokens``: a chat's system prompt
and tool definitions): under every policy the plan also ends a forward and saves at the head's
last reusable boundary (when above the hit), as the engine does for chat requests, and that save
is charged like any other (one S, plus the blocks below it not yet put). Without a head the
printed tables are the ones below.

A mixed global + sliding-window model with state (``lara_mini``, ``lfm3``, ``inkling_text``, at
``tp`` 1) is charged as the engine's Store writes it: K_blk is its global layers' row, and each save
point also puts the sliding layers' rows (K_win, window objects) of only the blocks its window
reads, read from the model's specs by ``sizes_from_config`` (:class:`StoreSizes` ``windows``).

Sizes: explicit (``--state-bytes``/``--kv-block-bytes``), a ratio S/K_blk (sizes in
relative units), a preset, or an HF ``config.json`` of a hybrid (``qwen3_next``) model, sized
with the engine's own layer cache specs (``lmdeploy.pytorch.cache_specs``, the one definition of
S and K_blk that the engine and its Store tier use): per linear-attention layer the state is
``conv_dim·(kernel-1)·dtype_bytes`` conv state plus ``v_heads·k_head_dim·v_head_dim·4`` fp32
recurrent state (``conv_dim = 2·k_heads·k_head_dim + v_heads·v_head_dim``, heads divided by
tp); ``K_blk = full_layers·2·B·kv_heads_per_rank·head_dim·dtype_bytes`` per rank. With
``--tp N`` the bytes charged are the sums over ranks (each rank's owned heads; a replicated KV
head once), as a tensor-parallel engine's ``store_put_bytes`` counts them: its objects hold
every head (docs/en/advance/parallelism.md). The reduction does not depend on tp.

Reductions ``1 - bytes_last_only / bytes_default`` are printed *truncated* to 0.01%: the seed
table lists 32K+64 as 63.64% while the exact value is 63.6458%.

Usage: ``python benchmark/simulate_store_writes.py --preset seed-table``
(``--preset tiny|qwen3-next-80b|kimi-linear-48b|nemotron-3-nano-30b|granite-4.0-h-small|lfm2-1.2b|glm-5.3-flash [--tp N]``;
glm-5.3-flash: sizes from :mod:`benchmark.glm5_next_sizes`, the seed deployment TP8 / FP8 KV / MTP unless ``--tp``,
``--kv-dtype``, ``--no-mtp``; ``--config config.json``, ``--scale 1/16 --block-size 16``,
``--turns 32832,36928``, ``--json``; one markdown row per model family, with the later families'
presets of :mod:`benchmark.family_presets` (``--preset bamba-9b`` ...): ``--families``; per-turn tables of more policies:
``--policies default,last-only,last-only+turn-end`` or ``--decode-save-last`` /
``--save-junction``; the branching scenario: ``--preset branching`` or ``--scenario branching``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from fractions import Fraction
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the simulator's model and the preset sizes live in two modules; their public names stay importable from here
from benchmark.store_presets import (DTYPE_BYTES, GRANITE_4_0_H_SMALL_CONFIG, KIMI_LINEAR_48B_CONFIG,  # noqa: E402,F401
                                     LFM2_1_2B_CONFIG, NEMOTRON_3_NANO_30B_CONFIG, QWEN3_NEXT_80B_CONFIG,
                                     SEED_STATE_TO_BLOCK_RATIO, TINY_CONFIG, StoreSizes, glm_5_3_flash_sizes, sizes_from_config)
from benchmark.family_presets import PRESET_CONFIGS, family_table, format_family_table  # noqa: E402
from benchmark.store_sim import (DEFAULT, DEFAULT_ALIGNMENT, DEFAULT_BLOCK, DEFAULT_CHUNK, JUNCTION,  # noqa: E402,F401
                                 KTOK, LAST_ONLY, TURN_END, Branching, Policy, PolicyResult, Request, Scenario,
                                 SimulationResult, TurnResult,
                                 branching_scenario, seed_scenarios, simulate, simulate_policies)


def truncate_percent(x: Fraction) -> str:
    """``x`` as a percentage truncated toward zero to two decimals, e.g. ``'63.64%'``."""
    hundredths = math.floor(abs(x) * 10000)
    sign = '-' if x < 0 else ''
    return f'{sign}{hundredths // 100}.{hundredths % 100:02d}%'


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--preset', choices=list(dict.fromkeys([
        'seed-table', 'tiny', 'qwen3-next-80b', 'kimi-linear-48b', 'nemotron-3-nano-30b', 'granite-4.0-h-small',
        'lfm2-1.2b', 'glm-5.3-flash', 'branching', *PRESET_CONFIGS])),
                   help='sizes (branching: the seed sizes, the branching scenario and the junction policy; '
                   'glm-5.3-flash: the seed deployment, TP8, FP8 KV, MTP on, unless --tp/--kv-dtype/--no-mtp)')
    p.add_argument('--families', action='store_true', help='print one markdown row per model family: its preset, '
                   'S, K_blk and the reduction of each seed scenario (seed geometry, TP 1; glm-5.3-flash: its '
                   'deployment); other arguments are ignored')
    p.add_argument('--config', type=Path, help='HF config.json of a hybrid model')
    p.add_argument('--state-bytes', type=int)
    p.add_argument('--kv-block-bytes', type=int)
    p.add_argument('--state-to-block-ratio', type=Fraction, help='S / K_blk; sizes in relative units')
    p.add_argument('--tp', type=int, help='tensor-parallel ranks (default 1; glm-5.3-flash: 8)')
    p.add_argument('--kv-dtype')
    p.add_argument('--state-dtype')
    p.add_argument('--chunk-size', type=int, help='P (default 8192 * scale)')
    p.add_argument('--block-size', type=int, help='B (default 64 * scale)')
    p.add_argument('--alignment', type=int, help='A (default 1024 * scale)')
    p.add_argument('--token-lookahead', type=int, default=0)
    p.add_argument('--recompute-blocks', type=int, default=0)
    p.add_argument('--mtp', action=argparse.BooleanOptionalAction,
                   help='the engine runs mtp speculative decoding: K_blk '
                   'includes the MTP layer\'s KV (--config/--preset sizes; on by default for glm-5.3-flash); pair '
                   'with --token-lookahead 1')
    p.add_argument('--scale', type=Fraction, default=Fraction(1), help='multiply scenario token counts, e.g. 1/16')
    p.add_argument('--turns', help='custom scenario: comma-separated input lengths of each turn')
    p.add_argument('--scenario', choices=['seed', 'branching'], help='seed: the six seed scenarios (default)')
    p.add_argument('--shared-tokens', type=int, help='branching: tokens all siblings share (default 20K+320)')
    p.add_argument('--suffix-tokens', type=int, help='branching: tokens of each sibling\'s own suffix (default 2K)')
    p.add_argument('--siblings', type=int, help='branching: number of siblings (default 4)')
    p.add_argument('--head-tokens', type=int, help='tokens of the shared head (system prompt + tools) every request '
                   'of the scenario starts with; the engine also saves at its last reusable boundary (default: none)')
    p.add_argument('--policies', help='comma-separated, e.g. default,last-only,last-only+turn-end,last-only+junction; '
                   'prints a per-turn table per scenario')
    p.add_argument('--decode-save-last', action='store_true', help='add the policy last-only+turn-end')
    p.add_argument('--save-junction', action='store_true', help='add the policy last-only+junction')
    p.add_argument('--json', action='store_true', help='print per-turn results as JSON')
    p.add_argument('--follow-ups', action='store_true', help='also print, for one turn (the first of --turns, '
                   'default 16K+64 * scale), its Store bytes and what a fresh engine restores for a continue, '
                   'a regenerate and an edit of it under last-only, +turn-end-replacing and +turn-end')
    p.add_argument('--reply', type=int, help='--follow-ups: reply tokens of the turn (default 512 * scale)')
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
    if args.preset in ('seed-table', 'branching'):
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
    elif args.preset == 'kimi-linear-48b':
        config = KIMI_LINEAR_48B_CONFIG
    elif args.preset == 'glm-5.3-flash':
        return glm_5_3_flash_sizes(args, block_size), 'bytes'
    elif args.preset == 'nemotron-3-nano-30b':
        config = NEMOTRON_3_NANO_30B_CONFIG
    elif args.preset == 'granite-4.0-h-small':
        config = GRANITE_4_0_H_SMALL_CONFIG
    elif args.preset == 'lfm2-1.2b':
        config = LFM2_1_2B_CONFIG
    elif args.preset in PRESET_CONFIGS:      # the later families' presets (benchmark/family_presets.py)
        config = PRESET_CONFIGS[args.preset]
    else:
        config = json.loads(args.config.read_text())
    return sizes_from_config(config, tp=args.tp or 1, block_size=block_size, kv_dtype=args.kv_dtype,
                             state_dtype=args.state_dtype, mtp=bool(args.mtp)), 'bytes'


def _policies(args: argparse.Namespace) -> list[Policy]:
    names = args.policies.split(',') if args.policies else ['default', 'last-only']
    if args.preset == 'branching' and not args.policies:
        names.append(JUNCTION.name)
    names += [TURN_END.name] * args.decode_save_last + [JUNCTION.name] * args.save_junction
    policies = []
    for name in names:
        policy = Policy.parse(name)
        if policy not in policies:
            policies.append(policy)
    return policies


def _scenarios(args: argparse.Namespace) -> list[Scenario | Branching]:
    scenarios = _base_scenarios(args)
    if args.head_tokens is None:
        return scenarios
    return [replace(s, name=f'{s.name} head {args.head_tokens}', head_tokens=args.head_tokens) for s in scenarios]


def _base_scenarios(args: argparse.Namespace) -> list[Scenario | Branching]:
    if args.turns:
        return [Scenario('custom', tuple(int(x) for x in args.turns.split(',')))]
    if args.scenario == 'branching' or (args.preset == 'branching' and args.scenario is None):
        base = branching_scenario().scaled(args.scale)
        custom = dict(shared_tokens=args.shared_tokens, suffix_tokens=args.suffix_tokens, siblings=args.siblings)
        custom = {k: v for k, v in custom.items() if v is not None}
        if custom:
            base = replace(base, **custom)
            base = replace(base, name=f'{base.siblings} siblings {base.shared_tokens}+{base.suffix_tokens}')
        return [base]
    return [s.scaled(args.scale) for s in seed_scenarios()]


def extra_recomputed(scenario: Scenario, result: PolicyResult) -> list[int]:
    """Turns 2.. of an append-only conversation: tokens recomputed beyond the turn's new user
    tokens ``n_t - n_{t-1} - output_tokens`` (the earlier input and reply are not new)."""
    lengths = scenario.input_lengths
    return [t.recomputed_tokens - (n - m - scenario.output_tokens)
            for t, m, n in zip(result.turns[1:], lengths, lengths[1:])]


def _print_turns(scenario: Scenario | Branching, results: dict[str, PolicyResult], unit: str, block: int) -> None:
    names = list(results)
    label = 'sibling' if isinstance(scenario, Branching) else 'turn'
    print(f'\n{scenario.name} ({unit}); per {label}: cached tokens c, recomputed n - c, saves, Store {unit}')
    print((f'{label:>7} {"n":>7} | ' + ' | '.join(f'{name:^33}' for name in names)).rstrip())
    print(f'{"":>7} {"":>7} | ' + ' | '.join(f'{"c":>7} {"n-c":>6} {"saves":>5} {unit:>12}' for _ in names))
    for i, n in enumerate(scenario.input_lengths):
        cells = [results[name].turns[i] for name in names]
        print(f'{i + 1:>7} {n:>7} | ' + ' | '.join(
            f'{t.cached_tokens:>7} {t.recomputed_tokens:>6} {t.num_saves:>5} {t.total_bytes:>12}' for t in cells))
    print(f'{"total":>7} {sum(scenario.input_lengths):>7} | ' + ' | '.join(
        f'{"":>7} {sum(t.recomputed_tokens for t in r.turns):>6} {r.num_saves:>5} {r.total_bytes:>12}'
        for r in results.values()))
    default = results.get(DEFAULT.name)
    for name, r in results.items():
        policy = Policy.parse(name)
        vs = (f'{r.total_bytes} vs default {default.total_bytes} {unit} '
              f'({"fewer" if r.total_bytes < default.total_bytes else "not fewer"})') if default else ''
        if policy.decode_save_last and isinstance(scenario, Scenario) and len(r.turns) > 1:
            extra = extra_recomputed(scenario, r)
            print(f'check {name}: later turns recompute new tokens + {extra} (B = {block}: '
                  f'{"at most one block" if max(extra) <= block else "more than one block"}); bytes {vs}')
        if policy.save_junction and isinstance(scenario, Branching) and default:
            base = results.get(Policy(policy.last_only, policy.decode_save_last).name)
            hits, dhits = [t.cached_tokens for t in r.turns[1:]], [t.cached_tokens for t in default.turns[1:]]
            extra = [a.num_saves - b.num_saves for a, b in zip(r.turns, base.turns)] if base else []
            print(f'check {name}: sibling hits {hits} vs default {dhits} '
                  f'({"all >= default" if all(a >= b for a, b in zip(hits, dhits)) else "some below default"}); '
                  f'extra saves per sibling {extra}; bytes {vs}')


def main(argv: Sequence[str] | None = None) -> list[SimulationResult]:
    """CLI entry: print the per-scenario table (or JSON) and return the results.

    With policies beyond default and last-only, or the branching scenario, also prints per
    turn (sibling) the cached and recomputed tokens, saves and Store bytes of each policy, and
    checks the turn-end and junction goals (see :func:`extra_recomputed`).
    """
    args = _parse_args(argv)
    if args.families:
        print('\n'.join(format_family_table(family_table(), truncate_percent)))
        return []
    chunk = _scaled_default(args.chunk_size, DEFAULT_CHUNK, args.scale, 'chunk-size')
    block = _scaled_default(args.block_size, DEFAULT_BLOCK, args.scale, 'block-size')
    align = _scaled_default(args.alignment, DEFAULT_ALIGNMENT, args.scale, 'alignment')
    sizes, unit = _resolve_sizes(args, block)
    scenarios = _scenarios(args)
    geometry = dict(chunk_size=chunk, block_size=block, alignment=align, token_lookahead=args.token_lookahead,
                    recompute_blocks=args.recompute_blocks)
    # (a model whose paged layers all slide puts only its windows' blocks)
    results = [simulate(s, *sizes.charged, **geometry, **sizes.windows) for s in scenarios]
    policies = _policies(args)
    detailed = policies != [DEFAULT, LAST_ONLY] or isinstance(scenarios[0], Branching)
    per_policy = [simulate_policies(s, *sizes.charged, policies=policies, **geometry, **sizes.windows)
                  for s in scenarios] if detailed else []
    if args.json:
        out = []
        for i, r in enumerate(results):
            row = dict(scenario=asdict(r.scenario), default=asdict(r.default), last_only=asdict(r.last_only),
                       reduction=float(r.reduction))
            if detailed:
                row['policies'] = {name: asdict(p) for name, p in per_policy[i].items()}
            out.append(row)
        print(json.dumps(out, indent=1))
        return results
    print(f'S = {sizes.state_bytes} {unit}, K_blk = {sizes.kv_block_bytes} {unit} per rank (tp={sizes.tp}; '
          f'charged over ranks: S = {sizes.charged[0]}, K_blk = {sizes.charged[1]}); '
          f'S/K_blk = {float(Fraction(sizes.state_bytes, max(1, sizes.kv_block_bytes))):g}; '
          f'P={chunk} B={block} A={align} lookahead={args.token_lookahead} recompute={args.recompute_blocks}')
    if sizes.window_rows:
        print(f'window objects: K_win = {sizes.window_block_bytes} {unit} per block of each save point\'s '
              f'{sizes.window_rows}-token window (K_blk above: the global layers\' row)')
    print(f'{"scenario":<30} {"saves":>5} {"saves":>5} {"default " + unit:>18} {"last-only " + unit:>18} '
          f'{"reduction":>9}')
    print(f'{"":<30} {"def":>5} {"last":>5}')
    for r in results:
        print(f'{r.scenario.name:<30} {r.default.num_saves:>5} {r.last_only.num_saves:>5} '
              f'{r.default.total_bytes:>18} {r.last_only.total_bytes:>18} {truncate_percent(r.reduction):>9}')
    print('reduction = 1 - last-only / default over the whole scenario (truncated to 0.01%, not rounded)')
    for s, res in zip(scenarios, per_policy):
        if isinstance(s, Branching) or len(s.input_lengths) > 1 or args.turns:
            _print_turns(s, res, unit, block)
    if args.follow_ups:
        from benchmark.store_follow_ups import follow_ups, print_follow_ups
        n = int(args.turns.split(',')[0]) if args.turns else _scaled_default(None, 16 * KTOK + 64, args.scale, 'turns')
        reply = args.reply or _scaled_default(None, 512, args.scale, 'reply')
        print(f'\none turn of {n} tokens and a {reply}-token reply; Store hits of a fresh engine (tokens):')
        print_follow_ups(follow_ups(n, reply, *sizes.charged, **geometry), unit)
    return results

if __name__ == '__main__':
    try:
        main()
    except ValueError as err:
        sys.exit(f'error: {err}')