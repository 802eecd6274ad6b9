"""End-to-end benchmark of the two checkpoint save policies through the api_server (issue 8).

It owns the measurement protocol; the byte accounting it checks against is the simulator's
(:mod:`simulate_store_writes`; docs/en/advance/store.md, "The byte formula"). For every seed
scenario, scaled by ``--scale``, it launches ``lmdeploy serve api_server`` (which starts its
own embedded Mooncake master and segment for Store ON) in four configurations::

    Store OFF / ON  x  default / last-only          (prefix caching always on)

``--launches`` times each (the configuration order rotates per launch), runs warm-up requests,
then ``--samples`` samples of every scenario. A request is ``POST /v1/completions`` with the
prompt as token ids, greedy, ``stream`` with ``include_usage``: TTFT is the time from sending
to the first streamed choice, ``usage.prompt_tokens_details.cached_tokens`` the prefix hit.
Store put bytes are the per-sample delta of ``lmdeploy_store_put_bytes_total{kind=state|kv}``
from ``/metrics``, read once ``/debug/ledger`` reports no in-flight Store save.

Invariants checked on every request (any failure aborts with an error):
- every configuration's greedy reply to the same prompt is the same text (caching never changes the output);
- cached tokens equal the simulator's hit for that turn: 0 for single turns (every sample
  draws a fresh seeded random prompt, so nothing carries over between samples) and the
  previous turn's last save point for turns t >= 2 (so > 0 whenever one exists);
- each Store ON sample's put bytes equal ``simulate()`` exactly, per kind; Store OFF puts 0.

Prompt ids are a function of (``--seed``, launch, scenario, sample, turn), identical across
configurations, so TTFT samples pair up: the reported difference is last-only − default with
Store ON, with a 95% confidence interval from the t-distribution over the pairs.
A multi-turn sample is one new conversation: turn t+1 = turn t's prompt + its reply
(re-tokenized text) + fresh random user tokens up to the scenario's length.

Usage (CPU, tiny model made on the fly)::

    python3 benchmark/benchmark_prefix_cache.py --scale 1/16 --block-size 16
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmark'))
from prefix_cache_server import BenchmarkError, PromptMaker, Server, TurnResult  # noqa
from simulate_store_writes import Scenario, seed_scenarios, simulate, sizes_from_config, truncate_percent  # noqa

SCENARIO_KEYS = ('8k', '16k', '32k', '64k', 'mt4k', 'mt16k')   # seed_scenarios() order
CONFIGS = (('off-default', False, False), ('off-last', False, True), ('on-default', True, False),
           ('on-last', True, True))   # (name, Store ON, last-only)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


@dataclass(frozen=True)
class Geometry:
    """Token geometry of the run: B (block), A (alignment), P (chunk), all in tokens."""
    block_size: int
    alignment: int
    chunk_size: int

    @classmethod
    def from_scale(cls, scale: Fraction, block_size: int | None = None, alignment: int | None = None,
                   chunk_size: int | None = None) -> 'Geometry':
        """Seed geometry (64, 1024, 8192) times ``scale``; B is at least 16 unless given.

        Raises:
            ValueError: a scaled value is not a positive integer, or A is not a multiple of B.
        """
        def scaled(x: int, name: str) -> int:
            y = x * scale
            if y.denominator != 1 or y < 1:
                raise ValueError(f'{name}: {x} * scale {scale} is not a positive integer; pass --{name}')
            return int(y)
        alignment = alignment or scaled(1024, 'alignment')
        chunk_size = chunk_size or scaled(8192, 'chunk-size')
        if block_size is None:      # blocks under 16 tokens only slow the run down
            block_size = max(16, scaled(64, 'block-size')) if 64 * scale >= 16 else 16
        if alignment % block_size:
            raise ValueError(f'alignment ({alignment}) must be a multiple of block-size ({block_size})')
        return cls(block_size, alignment, chunk_size)


@dataclass
class SampleResult:
    """One sample (a conversation) of one scenario in one configuration and launch."""
    config: str
    launch: int
    sample: int
    turns: list[TurnResult]
    put_bytes: dict[str, int]
    put_objects: dict[str, int]

    @property
    def ttft_s(self) -> float:
        """Mean TTFT over the turns (seconds)."""
        return statistics.fmean(t.ttft_s for t in self.turns)


# statistics -----------------------------------------------------------------------------------
def t_quantile_975(df: int) -> float:
    """Two-sided 95% t critical value (scipy if installed, else a table rounded to the next lower df)."""
    try:
        from scipy.stats import t
        return float(t.ppf(0.975, df))
    except ImportError:
        return _T975[max(k for k in _T975 if k <= df)]


def paired_ci(diffs: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)`` of the 95% t-interval of paired differences (nan bounds for n < 2)."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan, math.nan
    half = t_quantile_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


# the run --------------------------------------------------------------------------------------
def server_flags(geo: Geometry, store: bool, last_only: bool, session_len: int, segment: int, buffer: int,
                 extra: list[str]) -> list[str]:
    """The api_server flags of one configuration (every flag explicit, so logs are self-describing)."""
    flags = ['--enable-prefix-caching', '--block-size', str(geo.block_size), '--prefill-save-alignment',
             str(geo.alignment), '--max-prefill-token-num', str(geo.chunk_size), '--session-len', str(session_len)]
    flags.append('--prefill-save-last-only' if last_only else '--no-prefill-save-last-only')
    if store:
        flags += ['--mooncake-master', 'local', '--mooncake-embedded-segment-size', str(segment),
                  '--mooncake-local-buffer-size', str(buffer)]
    return flags + extra


@dataclass
class Plan:
    """What to run: scenarios (scaled, turns cut), geometry, sizes and repetitions."""
    scenarios: list[Scenario]
    geometry: Geometry
    state_bytes: int
    kv_block_bytes: int
    launches: int
    samples: int
    warmup: int
    predictions: dict = field(default_factory=dict)

    def __post_init__(self):
        g = self.geometry
        self.predictions = {s.name: simulate(s, self.state_bytes, self.kv_block_bytes, chunk_size=g.chunk_size,
                                             block_size=g.block_size, alignment=g.alignment) for s in self.scenarios}

    def expected(self, scenario: Scenario, last_only: bool):
        r = self.predictions[scenario.name]
        return r.last_only if last_only else r.default


def run_sample(server: Server, plan: Plan, prompts: PromptMaker, cfg: tuple, launch: int, si: int,
               sample: int, replies: dict) -> SampleResult:
    """One conversation of scenario ``si``; checks replies, cached tokens and Store bytes."""
    name, store, last_only = cfg
    scenario = plan.scenarios[si]
    expected = plan.expected(scenario, last_only)
    bytes0, objs0 = server.store_counters()
    turns, ids = [], []
    for t, n in enumerate(scenario.input_lengths):
        key = (launch, si, sample, t)
        ids = prompts.random_ids(n, *key) if t == 0 else prompts.next_turn(ids, turns[-1].text, n, *key)
        res = server.complete(ids, scenario.output_tokens)
        want = expected.turns[t].cached_tokens
        # a later turn always reuses its conversation's prefix (the simulator's hit is > 0 for them)
        if res.prompt_tokens != n or res.cached_tokens != want or (t > 0 and res.cached_tokens == 0):
            raise BenchmarkError(f'{name} {scenario.name} sample {sample} turn {t + 1}: {res.prompt_tokens} prompt / '
                                 f'{res.cached_tokens} cached tokens; expected {n} / {want}')
        first = replies.setdefault(key, (name, res.text))
        if first[1] != res.text:
            raise BenchmarkError(f'greedy replies differ for launch {launch} {scenario.name} sample {sample} turn '
                                 f'{t + 1}: {first[0]} {first[1]!r} vs {name} {res.text!r}')
        turns.append(res)
    bytes1, objs1 = server.store_counters()
    put = {k: bytes1[k] - bytes0[k] for k in bytes1}
    objs = {k: objs1[k] - objs0[k] for k in objs1}
    want = ({'state': sum(t.state_bytes for t in expected.turns), 'kv': sum(t.kv_bytes for t in expected.turns)}
            if store else {'state': 0, 'kv': 0})
    if put != want:
        raise BenchmarkError(f'{name} {scenario.name} sample {sample}: Store put {put} bytes ({objs} objects), '
                             f'simulator predicts {want} (S={plan.state_bytes}, K_blk={plan.kv_block_bytes})')
    return SampleResult(name, launch, sample, turns, put, objs)


def run(plan: Plan, model: str, log_dir: Path, extra_flags: list[str], seed: int,
        threads: int | None = None) -> dict[str, list[SampleResult]]:
    """All launches x configurations; returns samples per scenario name."""
    from tqdm import tqdm
    prompts = PromptMaker(model, seed)
    g = plan.geometry
    warmup_len = g.chunk_size + g.alignment + 1     # two chunks, one save, a partial block
    session_len = max([s.input_lengths[-1] + s.output_tokens for s in plan.scenarios] + [warmup_len + 4]) \
        + g.block_size
    per_launch = sum(plan.expected(s, False).total_bytes for s in plan.scenarios) * plan.samples
    segment = max(512 << 20, 2 * per_launch + (64 << 20))
    buffer = max(64 << 20, 4 * (plan.state_bytes + g.chunk_size // g.block_size * plan.kv_block_bytes))
    results: dict[str, list[SampleResult]] = {s.name: [] for s in plan.scenarios}
    replies: dict = {}
    turns = sum(len(s.input_lengths) for s in plan.scenarios) * plan.samples
    bar = tqdm(total=plan.launches * len(CONFIGS) * (plan.warmup + turns), unit='req')
    for launch in range(plan.launches):
        order = CONFIGS[launch % 4:] + CONFIGS[:launch % 4]     # rotate: no configuration always runs first
        for cfg in order:
            bar.set_description(f'launch {launch + 1}/{plan.launches} {cfg[0]}')
            flags = server_flags(g, cfg[1], cfg[2], session_len, segment, buffer, extra_flags)
            server = Server(model, flags, log_dir / f'server_{launch}_{cfg[0]}.log', threads)
            try:
                for w in range(plan.warmup):    # exercises every code path: chunks, saves, decode
                    server.complete(prompts.random_ids(warmup_len, 'warmup', launch, w), 4)
                    bar.update()
                for si, scenario in enumerate(plan.scenarios):
                    for sample in range(plan.samples):
                        results[scenario.name].append(run_sample(server, plan, prompts, cfg, launch, si, sample,
                                                                 replies))
                        bar.update(len(scenario.input_lengths))
            finally:
                server.stop()
    bar.close()
    return results


def _ms(seconds: float) -> float | None:
    """Seconds → milliseconds rounded to 0.01 ms; None for nan (strict JSON has no NaN)."""
    return None if math.isnan(seconds) else round(1e3 * seconds, 2)


def summarize(plan: Plan, results: dict[str, list[SampleResult]]) -> list[dict]:
    """Per scenario: Store bytes per policy, measured vs simulated reduction, TTFTs and the paired CI."""
    rows = []
    for s in plan.scenarios:
        by = {c[0]: {(r.launch, r.sample): r for r in results[s.name] if r.config == c[0]} for c in CONFIGS}
        b_def, b_last = (sum(next(iter(by[c].values())).put_bytes.values()) for c in ('on-default', 'on-last'))
        measured = 0.0 if b_def == 0 else 1 - Fraction(b_last, b_def)
        diffs = [by['on-last'][k].ttft_s - by['on-default'][k].ttft_s for k in sorted(by['on-default'])]
        mean, low, high = paired_ci(diffs)
        rows.append(dict(scenario=s.name, input_lengths=list(s.input_lengths), output_tokens=s.output_tokens,
                         store_bytes_default=b_def, store_bytes_last_only=b_last,
                         save_points_default=[t.save_points for t in plan.expected(s, False).turns],
                         save_points_last_only=[t.save_points for t in plan.expected(s, True).turns],
                         reduction_measured=truncate_percent(Fraction(measured)),
                         reduction_simulated=truncate_percent(plan.predictions[s.name].reduction),
                         ttft_ms={c: _ms(statistics.fmean(r.ttft_s for r in by[c].values())) for c in by},
                         ttft_diff_ms=_ms(mean), ttft_diff_ci95_ms=[_ms(low), _ms(high)], pairs=len(diffs),
                         diff_inside_noise=not (low > 0 or high < 0)))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f'{"scenario":<28}{"Store B default":>16}{"Store B last":>14}{"reduction":>10}{"simulated":>10}'
          f'{"TTFT ON def":>12}{"Δ last−def [95% CI] ms":>30}{"TTFT OFF def":>13}{"OFF last":>10}')
    for r in rows:
        lo, hi = (math.nan if x is None else x for x in r['ttft_diff_ci95_ms'])
        t = r['ttft_ms']
        ci = f'{r["ttft_diff_ms"]:+.1f} [{lo:+.1f}, {hi:+.1f}]'
        print(f'{r["scenario"]:<28}{r["store_bytes_default"]:>16}{r["store_bytes_last_only"]:>14}'
              f'{r["reduction_measured"]:>10}{r["reduction_simulated"]:>10}{t["on-default"]:>10.1f}ms'
              f'{ci:>30}{t["off-default"]:>11.1f}ms{t["off-last"]:>8.1f}ms')


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Store bytes per scenario and policy (left), TTFT difference with 95% CI (right)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    names = [r['scenario'] for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    a.bar([i - 0.2 for i in x], [r['store_bytes_default'] / 2**20 for r in rows], 0.4, label='default')
    a.bar([i + 0.2 for i in x], [r['store_bytes_last_only'] / 2**20 for r in rows], 0.4, label='last-only')
    for i, r in zip(x, rows):
        a.annotate(f'−{r["reduction_measured"]}', (i + 0.2, r['store_bytes_last_only'] / 2**20), ha='center',
                   va='bottom', fontsize=8)
    a.set_ylabel('Store put MiB per sample')
    a.set_title('Store writes (measured = simulated)')
    a.legend()
    means = [r['ttft_diff_ms'] for r in rows]
    errs = [[0 if r['pairs'] < 2 else m - r['ttft_diff_ci95_ms'][0] for m, r in zip(means, rows)],
            [0 if r['pairs'] < 2 else r['ttft_diff_ci95_ms'][1] - m for m, r in zip(means, rows)]]
    b.errorbar(list(x), means, yerr=errs, fmt='o', capsize=5)
    b.axhline(0, color='grey', lw=0.8)
    b.set_ylabel('TTFT last-only − default, Store ON (ms)')
    b.set_title('Paired TTFT difference, 95% CI')
    for ax in (a, b):
        ax.set_xticks(list(x), names, rotation=20, ha='right', fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def select_scenarios(keys: list[str], scale: Fraction, max_turns: int | None) -> list[Scenario]:
    """Seed scenarios named by ``keys`` (see ``SCENARIO_KEYS``), scaled, turns cut to ``max_turns``.

    Raises:
        ValueError (``scenarios``): an unknown key.
    """
    bad = [k for k in keys if k not in SCENARIO_KEYS]
    if bad:
        raise ValueError(f'scenarios: unknown {bad}; choose from {SCENARIO_KEYS}')
    out = []
    for key, s in zip(SCENARIO_KEYS, seed_scenarios()):
        if key in keys:
            s = s.scaled(scale)
            lengths = s.input_lengths[:max_turns]
            name = s.name.replace(f'x{len(s.input_lengths)} turns', f'x{len(lengths)} turns')
            out.append(Scenario(name, lengths, s.output_tokens))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', help='model directory (default: a tiny qwen3_next made in a temp dir)')
    p.add_argument('--scale', type=Fraction, default=Fraction(1), help='token-count scale, e.g. 1/16')
    p.add_argument('--block-size', type=int, help='B (default max(16, 64*scale))')
    p.add_argument('--alignment', type=int, help='A (default 1024*scale)')
    p.add_argument('--chunk-size', type=int, help='P (default 8192*scale)')
    p.add_argument('--scenarios', nargs='+', default=list(SCENARIO_KEYS), help=f'subset of {SCENARIO_KEYS}')
    p.add_argument('--max-turns', type=int, help='cut multi-turn scenarios to this many turns')
    p.add_argument('--launches', type=int, default=2, help='server launches per configuration')
    p.add_argument('--samples', type=int, default=2, help='samples per scenario per launch')
    p.add_argument('--warmup', type=int, default=2, help='warm-up requests per launch')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--torch-threads', type=int, help='OMP_NUM_THREADS of the server (default: torch decides)')
    p.add_argument('--server-arg', action='append', default=[], help='extra api_server flag (repeatable), '
                   'e.g. --server-arg=--dtype=bfloat16')
    p.add_argument('--out-dir', type=Path, default=ROOT / 'benchmark' / 'results')
    p.add_argument('--tag', help='output file stem (default: prefix_cache_scale<scale>)')
    return p.parse_args(argv)


def main(argv=None) -> int:
    """CLI entry; returns the exit code (1 on a failed check)."""
    args = parse_args(argv)
    if args.launches < 1 or args.samples < 1:
        raise ValueError('launches and samples must be >= 1')
    geo = Geometry.from_scale(args.scale, args.block_size, args.alignment, args.chunk_size)
    tmp = Path(tempfile.mkdtemp(prefix='bench_prefix_cache_'))
    model = args.model
    if model is None:
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        model = make_tiny_model(str(tmp / 'tiny_qwen3_next'), arch='qwen3_next')
    config = json.loads((Path(model) / 'config.json').read_text())
    dtype = next((a.split('=', 1)[1] for a in args.server_arg if a.startswith('--dtype=')), None)
    sizes = sizes_from_config(config, block_size=geo.block_size, kv_dtype=dtype, state_dtype=dtype)
    plan = Plan(select_scenarios(args.scenarios, args.scale, args.max_turns), geo, sizes.state_bytes,
                sizes.kv_block_bytes, args.launches, args.samples, args.warmup)
    print(f'model {model}; scale {args.scale}: block B={geo.block_size} alignment A={geo.alignment} '
          f'chunk P={geo.chunk_size}; S={plan.state_bytes} B, K_blk={plan.kv_block_bytes} B; {args.launches} '
          f'launches x {args.samples} samples x {len(CONFIGS)} configs; logs in {tmp}')
    t0, load0 = time.time(), os.getloadavg()
    try:
        results = run(plan, model, tmp, args.server_arg, args.seed, args.torch_threads)
    except BenchmarkError as err:
        print(f'error: {err}\n(server logs kept in {tmp})', file=sys.stderr)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(plan, results)
    print_table(rows)
    print('Δ = paired TTFT difference (mean over turns per sample), Store ON; reductions truncated to 0.01%')
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.tag or f'prefix_cache_scale{str(args.scale).replace("/", "-")}'
    meta = dict(command=' '.join(['python3', *sys.argv]), scale=str(args.scale), geometry=asdict(geo),
                model=config.get('model_type'),
                state_bytes=plan.state_bytes, kv_block_bytes=plan.kv_block_bytes, launches=args.launches,
                samples=args.samples, warmup=args.warmup, seed=args.seed, torch_threads=args.torch_threads,
                scenarios=args.scenarios, max_turns=args.max_turns, wall_s=round(time.time() - t0, 1),
                cpus=os.cpu_count(), loadavg_start=load0, loadavg_end=os.getloadavg())
    raw = {name: [dict(config=r.config, launch=r.launch, sample=r.sample, put_bytes=r.put_bytes,
                       put_objects=r.put_objects, ttft_s=[round(t.ttft_s, 5) for t in r.turns],
                       cached_tokens=[t.cached_tokens for t in r.turns]) for r in rs] for name, rs in results.items()}
    (args.out_dir / f'{stem}.json').write_text(json.dumps(dict(meta=meta, rows=rows, samples=raw), indent=1))
    plot(rows, args.out_dir / f'{stem}.png', f'{config.get("model_type")} scale {args.scale}, B={geo.block_size} '
         f'A={geo.alignment} P={geo.chunk_size}, {args.launches}x{args.samples} pairs')
    print(f'wrote {args.out_dir / stem}.json / .png in {time.time() - t0:.0f} s')
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main())
    except ValueError as err:
        sys.exit(f'error: {err}')
