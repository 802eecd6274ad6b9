"""Replay a request trace (format: ``benchmark/traces.py``) against the prefix cache, two ways.

``--mode sim`` (default; no model, no server): for every save policy (``--policies``), budget
fraction of the working set (``--budgets``), host-tier fraction (``--host-fractions``) and
eviction (``--evictions``) it calls ``benchmark.trace_sim.simulate_trace``, the cache-only
simulator driving the engine's own Scheduler / PrefixCache code, and prints one table:

- hit tokens (scaled tokens when ``--scale`` > 1) and where they came from;
- % ideal: of the same policy's hit with an unlimited cache (``budget_bytes=None``);
- x LRU: over ``lru`` eviction at the same policy, budget and host tier;
- % opt: of the offline optimum (``optimal`` eviction) at the same policy, budget and host tier;
- checkpoints saved / evicted, KV blocks evicted;
- prefill seconds saved = hit tokens x scale / ``--prefill-tok-per-s`` (an assumption, printed).

A budget fraction f is ``f x peak_bytes`` of the unlimited run (its device working set); a host
fraction h gives a host tier of ``h x`` that. State and KV block bytes come from ``--model``
(``store_presets.sizes_from_config`` of the published Qwen3-Next-80B config, per rank at TP1;
GLM-5.3-Flash as ``simulate_store_writes.py --preset glm-5.3-flash``: TP8, FP8 KV, MTP on, per
rank), or ``--state-bytes`` / ``--kv-block-bytes``.

``--mode server``: starts ``lmdeploy serve api_server`` on 127.0.0.1 (a tiny random-weight
Qwen3-Next made on the fly unless ``--model-path``; engine flags from ``--server-args``), and
replays the trace at ``--scale`` (512 tokens -> 512/scale) with ``--concurrency`` requests in
flight, in trace order (``--honor-timestamps`` waits for each arrival time). A request is
``POST /v1/completions`` with the prompt as token ids (``traces.prompt_tokens``), greedy,
``max_tokens = max(1, round(output_length / scale))``, streamed with ``include_usage``: TTFT is
send -> first streamed choice, the hit is ``usage.prompt_tokens_details.cached_tokens``. It
reports the hit against the simulator's unlimited-cache hit at the server's geometry (block
size, alignment, chunk, save policy read from the flags), or, without the simulator, the
block-level ideal (an upper bound: any shared 512-token block counts, aligned or not); TTFT
p50/p90; and the ``/metrics`` deltas of the ``lmdeploy_store_*``, ``lmdeploy_prefix_cache_*``,
``lmdeploy_checkpoints_*`` and ``lmdeploy_state_miss_tokens`` series. The run is bounded
(``--timeout-s`` in all; no new request after it) and stops its server.

Usage::

    python3 benchmark/benchmark_trace.py --trace benchmark/traces/claude_code.jsonl --model qwen3-next-80b
    python3 benchmark/benchmark_trace.py --mode server --trace T.jsonl --limit 300
"""
from __future__ import annotations

import argparse
import importlib
import json
import shlex
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmark.trace_client import complete  # noqa: E402
from benchmark.trace_client import pct as _pct  # noqa: E402
from benchmark.trace_client import wait_store_idle as _wait_store_idle  # noqa: E402
from benchmark.traces import BLOCK_TOKENS, TraceRequest, load_trace, prompt_tokens, working_set  # noqa: E402

SIM_MODULE = 'benchmark.trace_sim'
DEFAULT_SERVER_ARGS = ('--enable-prefix-caching --prefill-save-last-only --block-size 16 --prefill-save-alignment 64 '
                       '--max-prefill-token-num 256 --num-gpu-blocks 1024')
METRIC_PREFIXES = ('lmdeploy_store_', 'lmdeploy_prefix_cache_', 'lmdeploy_checkpoints_', 'lmdeploy_state_miss_tokens')
ENGINE_DEFAULTS = {'--block-size': 64, '--prefill-save-alignment': 1024, '--max-prefill-token-num': 8192}


def load_simulator():
    """The ``benchmark.trace_sim`` module.

    Raises:
        SystemExit: the module is not in this checkout (a clear message; other import errors propagate).
    """
    try:
        return importlib.import_module(SIM_MODULE)
    except ModuleNotFoundError as err:
        if err.name not in (SIM_MODULE, 'benchmark'):
            raise
        raise SystemExit('error: --mode sim needs benchmark/trace_sim.py (simulate_trace, the cache-only '
                         'simulator), which is not in this checkout') from None


def model_sizes(model: str, block_size: int) -> tuple[int, int]:
    """``(state bytes S, KV bytes of one block K_blk)`` per rank of a preset (module docstring).

    Raises:
        ValueError: an unknown preset name.
    """
    from benchmark.store_presets import QWEN3_NEXT_80B_CONFIG, glm_5_3_flash_sizes, sizes_from_config
    if model == 'qwen3-next-80b':
        sizes = sizes_from_config(QWEN3_NEXT_80B_CONFIG, block_size=block_size)
    elif model == 'glm-5.3-flash':
        seed_deployment = argparse.Namespace(tp=None, kv_dtype=None, state_dtype=None, mtp=None)
        sizes = glm_5_3_flash_sizes(seed_deployment, block_size)
    else:
        raise ValueError(f"--model must be 'qwen3-next-80b' or 'glm-5.3-flash', got {model!r}")
    return sizes.state_bytes, sizes.kv_block_bytes


def _floats(text: str, name: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(',') if x.strip()]
    except ValueError:
        raise ValueError(f'--{name}: expected comma-separated numbers, got {text!r}') from None
    if not out or any(not 0 < x for x in out):
        raise ValueError(f'--{name}: every value must be > 0, got {text!r}')
    return out


# sim mode --------------------------------------------------------------------------------------
def run_sim(args: argparse.Namespace, rows: list[TraceRequest]) -> list[dict]:
    """Every (policy, budget, host, eviction) combination through ``simulate_trace``; one dict
    per combination (the table's columns, plus the raw counters)."""
    sim = load_simulator()
    policies = [p.strip() for p in args.policies.split(',') if p.strip()]
    evictions = [e.strip() for e in args.evictions.split(',') if e.strip()]
    budgets, hosts = _floats(args.budgets, 'budgets'), [0.0] + (_floats(args.host_fractions, 'host-fractions')
                                                                 if args.host_fractions else [])
    if (args.state_bytes is None) != (args.kv_block_bytes is None):
        raise ValueError('--state-bytes and --kv-block-bytes go together')
    if args.state_bytes is not None:
        state_bytes, kv_bytes, source = args.state_bytes, args.kv_block_bytes, 'given'
    else:
        (state_bytes, kv_bytes), source = model_sizes(args.model, args.block_size), args.model
    common = dict(state_bytes=state_bytes, kv_block_bytes=kv_bytes, block_size=args.block_size,
                  alignment=args.alignment, chunk=args.chunk, concurrency=args.concurrency, scale=args.scale)
    print(f'{len(rows)} requests; S = {state_bytes} B, K_blk = {kv_bytes} B per rank ({source}); B={args.block_size}'
          f' A={args.alignment} P={args.chunk} concurrency={args.concurrency} scale={args.scale}')
    print(f'assumption: prefill {args.prefill_tok_per_s:g} tok/s (--prefill-tok-per-s), so seconds saved = '
          f'hit tokens x {args.scale} / {args.prefill_tok_per_s:g}')
    out: list[dict] = []
    for policy in policies:
        ideal = sim.simulate_trace(rows, save_policy=policy, budget_bytes=None, **common)
        peak = ideal.peak_bytes
        print(f'policy {policy}: unlimited cache hits {ideal.hit_tokens} of {ideal.prompt_tokens} tokens, '
              f'working set {peak} B')
        print(SIM_HEADER)
        for f in budgets:
            for h in hosts:
                first, by_eviction = len(out), {}
                for ev in evictions:
                    extra = {}
                    if ev == 'legacy':      # the old fixed split, at the unlimited run's checkpoint share
                        extra['checkpoint_share'] = getattr(ideal, 'peak_checkpoint_bytes', 0) / max(peak, 1)
                    r = sim.simulate_trace(rows, save_policy=policy, eviction=ev, budget_bytes=int(f * peak),
                                           host_bytes=int(h * peak), **common, **extra)
                    by_eviction[ev] = r
                for ev, r in by_eviction.items():
                    lru, opt = by_eviction.get('lru'), by_eviction.get('optimal')
                    out.append(dict(
                        policy=policy, budget=f, budget_bytes=int(f * peak), host=h, host_bytes=int(h * peak),
                        eviction=ev, prompt_tokens=r.prompt_tokens, hit_tokens=r.hit_tokens,
                        hit_tokens_by_tier=dict(r.hit_tokens_by_tier), ideal_hit_tokens=ideal.hit_tokens,
                        pct_ideal=_ratio(r.hit_tokens, ideal.hit_tokens, 100),
                        x_lru=_ratio(r.hit_tokens, lru.hit_tokens if lru else None),
                        pct_optimal=_ratio(r.hit_tokens, opt.hit_tokens if opt else None, 100),
                        checkpoints_saved=dict(r.checkpoints_saved), evictions=dict(r.evictions),
                        peak_bytes=r.peak_bytes, prefill_s_saved=r.hit_tokens * args.scale / args.prefill_tok_per_s))
                print('\n'.join(sim_rows_text(out[first:])), flush=True)
    print(SIM_FOOTER)
    return out


def _ratio(a: int, b: int | None, times: float = 1.0) -> float | None:
    return None if not b else a / b * times


SIM_HEADER = (f'{"policy":<10}{"budget":>7}{"host":>6} {"eviction":<9}{"hit tokens":>13}{"% ideal":>9}{"x LRU":>7}'
              f'{"% opt":>8}{"ckpt saved":>11}{"ckpt evict":>11}{"kv evict":>10}{"prefill s saved":>16}')
SIM_FOOTER = ('budget, host: fractions of the unlimited run\'s peak bytes; % ideal: of the unlimited cache, same '
              'policy; x LRU / % opt: against lru / optimal eviction at the same policy, budget and host')


def sim_rows_text(results: list[dict]) -> list[str]:
    """Table lines (under :data:`SIM_HEADER`) of sim-mode results."""
    def num(x, fmt):
        return '-' if x is None else format(x, fmt)
    return [f'{r["policy"]:<10}{r["budget"]:>7g}{r["host"]:>6g} {r["eviction"]:<9}{r["hit_tokens"]:>13}'
            f'{num(r["pct_ideal"], ".1f"):>9}{num(r["x_lru"], ".2f"):>7}{num(r["pct_optimal"], ".1f"):>8}'
            f'{sum(r["checkpoints_saved"].values()):>11}{r["evictions"].get("checkpoint", 0):>11}'
            f'{r["evictions"].get("kv", 0):>10}{r["prefill_s_saved"]:>16.1f}' for r in results]


def print_sim_table(results: list[dict]) -> None:
    """The whole sim-mode table (one line per combination)."""
    print('\n'.join([SIM_HEADER, *sim_rows_text(results), SIM_FOOTER]))


# server mode -----------------------------------------------------------------------------------
def server_geometry(flags: Sequence[str]) -> dict:
    """Block size, alignment, chunk (tokens) and save policy an api_server runs with ``flags``
    (the engine's defaults where a flag is absent; ``--flag=value`` and ``--flag value`` both read)."""
    values, last_only = dict(ENGINE_DEFAULTS), False
    for i, flag in enumerate(flags):
        name, _, inline = flag.partition('=')
        if name in values:
            try:
                values[name] = int(inline or flags[i + 1])
            except (IndexError, ValueError):
                raise ValueError(f'--server-args: {name} needs an integer value') from None
        elif name == '--prefill-save-last-only':
            last_only = True
        elif name == '--no-prefill-save-last-only':
            last_only = False
    return dict(block_size=values['--block-size'], alignment=values['--prefill-save-alignment'],
                chunk=values['--max-prefill-token-num'], save_policy='last_only' if last_only else 'default')


def token_range(model: str) -> tuple[int, int]:
    """``[lo, hi)`` of plain token ids: above the special tokens at the bottom of the vocabulary,
    below those at the top and below the tokenizer's size."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    vocab = min(len(tok), json.loads((Path(model) / 'config.json').read_text()).get('vocab_size', len(tok)))
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    low = [i for i in special if i < vocab // 2]
    high = [i for i in special if i >= vocab // 2]
    return (max(low) + 1 if low else 0), (min(high) if high else vocab)


def block_level_ideal(rows: Sequence[TraceRequest], scale: int) -> int:
    """Scaled tokens an infinite cache of whole 512-token blocks would hit (aligned or not): per
    request ``min(j x 512/scale, prompt - 1)``, j its longest hash-id prefix seen before."""
    per, root, hit = BLOCK_TOKENS // scale, {}, 0
    for r in rows:
        node, j = root, 0
        for h in r.hash_ids:
            if h not in node:
                break
            node, j = node[h], j + 1
        hit += min(j * per, max(1, r.input_length // scale) - 1)
        node = root
        for h in r.hash_ids:
            node = node.setdefault(h, {})
    return hit


def scrape(url: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of the ``/metrics`` counter samples (``*_total``) named by
    :data:`METRIC_PREFIXES`."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + '/metrics', timeout=60) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(METRIC_PREFIXES) and s.name.endswith('_total'):
                labels = ','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))
                out[s.name + (f'{{{labels}}}' if labels else '')] = s.value
    return out


def replay(url: str, jobs: list[tuple[list[int], int, float]], concurrency: int, honor_timestamps: bool,
           deadline: float, request_timeout_s: float) -> list[dict | None]:
    """Send ``jobs`` (token ids, max_tokens, arrival ms) in order, ``concurrency`` in flight; a
    job not started by ``deadline`` (monotonic seconds) is skipped and stays None."""
    results: list[dict | None] = [None] * len(jobs)
    slots = threading.Semaphore(concurrency)
    t0 = time.monotonic()

    def one(i: int) -> None:
        try:
            ids, max_tokens, _ = jobs[i]
            results[i] = complete(url, ids, max_tokens, request_timeout_s)
        except Exception as err:  # noqa: BLE001 -- a client bug is reported per request, not lost in the pool
            results[i] = dict(error=f'{type(err).__name__}: {err}')
        finally:
            slots.release()
    with ThreadPoolExecutor(concurrency) as pool:
        for i, (_, _, ts_ms) in enumerate(jobs):
            if honor_timestamps:
                time.sleep(max(0.0, min(t0 + ts_ms / 1000, deadline) - time.monotonic()))
            acquired = False
            while not acquired and time.monotonic() <= deadline:
                acquired = slots.acquire(timeout=0.5)
            if not acquired or time.monotonic() > deadline:
                if acquired:
                    slots.release()
                print(f'deadline reached: {len(jobs) - i} requests not sent', file=sys.stderr)
                break
            pool.submit(one, i)
    return results



def run_server(args: argparse.Namespace, rows: list[TraceRequest]) -> dict:
    """Start the server, replay ``rows``, stop it; returns the report (also printed)."""
    from benchmark.prefix_cache_server import Server
    flags = shlex.split(args.server_args)
    geo = server_geometry(flags)
    tmp = Path(tempfile.mkdtemp(prefix='trace_replay_'))
    model = args.model_path
    if model is None:
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        model = make_tiny_model(str(tmp / 'tiny_qwen3_next'), arch='qwen3_next', seed=0)
    lo, hi = token_range(model)
    jobs = [(prompt_tokens(r, args.scale, hi, args.seed, lo), max(1, round(r.output_length / args.scale)),
             r.timestamp_ms) for r in rows]
    ideal, ideal_kind = None, 'block-level (any shared 512-token block; an upper bound)'
    try:
        sim = importlib.import_module(SIM_MODULE)
    except ModuleNotFoundError:
        sim = None
    if sim is not None:
        # bytes do not matter to an unlimited cache: only its hits are used
        ideal = sim.simulate_trace(rows, state_bytes=1, kv_block_bytes=1, budget_bytes=None,
                                   concurrency=args.concurrency, scale=args.scale, **geo).hit_tokens
        ideal_kind = f'trace_sim unlimited cache ({geo["save_policy"]})'
    if ideal is None:
        ideal = block_level_ideal(rows, args.scale)
    print(f'{len(rows)} requests at scale {args.scale}, concurrency {args.concurrency}; token ids [{lo}, {hi}); '
          f'server flags: {" ".join(flags)}; logs in {tmp}')
    t0 = time.monotonic()
    server = Server(model, flags, tmp / 'server.log', timeout_s=args.startup_timeout_s)
    try:
        before = scrape(server.url)
        start = time.monotonic()
        results = replay(server.url, jobs, args.concurrency, args.honor_timestamps, t0 + args.timeout_s,
                         args.request_timeout_s)
        replay_s = time.monotonic() - start
        _wait_store_idle(server.url)
        after = scrape(server.url)
    finally:
        server.stop()
    done = [r for r in results if r and 'error' not in r]
    errors = [r['error'] for r in results if r and 'error' in r]
    ttft = [r['ttft_s'] for r in done]
    hit = sum(r['cached_tokens'] for r in done)
    deltas = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    report = dict(requests=len(rows), completed=len(done), errors=len(errors), first_errors=errors[:3],
                  not_sent=sum(r is None for r in results), prompt_tokens=sum(r['prompt_tokens'] for r in done),
                  hit_tokens=hit, ideal_hit_tokens=ideal, ideal_kind=ideal_kind,
                  pct_ideal=_ratio(hit, ideal, 100), ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90),
                  replay_s=replay_s, scale=args.scale, concurrency=args.concurrency, server_args=flags,
                  geometry=geo, metrics_delta=deltas,
                  per_request_cached_tokens=[r.get('cached_tokens') if r else None for r in results])
    print(f'completed {len(done)}/{len(rows)} in {replay_s:.1f} s ({len(errors)} errors, '
          f'{report["not_sent"]} not sent)' + (f'; first error: {errors[0]}' if errors else ''))
    print(f'prompt tokens {report["prompt_tokens"]}; hit tokens {hit}; ideal {ideal} [{ideal_kind}]'
          + (f' -> {report["pct_ideal"]:.1f}% of ideal' if report['pct_ideal'] is not None else ''))
    if ttft:
        print(f'TTFT p50 {report["ttft_p50_s"] * 1000:.1f} ms, p90 {report["ttft_p90_s"] * 1000:.1f} ms')
    for k, v in deltas.items():
        print(f'  {k:<60} {v:+.0f}')
    if not errors:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


# CLI -------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--trace', required=True, type=Path, help='JSONL trace (benchmark/traces.py format)')
    p.add_argument('--mode', choices=('sim', 'server'), default='sim')
    p.add_argument('--limit', type=int, help='replay only the first N requests')
    p.add_argument('--scale', type=int, help='512 tokens -> 512/scale (default: 1 sim, 32 server)')
    p.add_argument('--concurrency', type=int, default=4, help='requests in flight')
    p.add_argument('--json', type=Path, help='write every result here')
    sim = p.add_argument_group('sim mode')
    sim.add_argument('--policies', default='default,last_only')
    sim.add_argument('--evictions', default='legacy,lru,reuse,optimal')
    sim.add_argument('--budgets', default='1,0.5,0.125', help='fractions of the unlimited run\'s peak bytes')
    sim.add_argument('--host-fractions', default='', help='host tier sizes as fractions of it (0 is always run)')
    sim.add_argument('--model', default='qwen3-next-80b', help='qwen3-next-80b | glm-5.3-flash (S and K_blk)')
    sim.add_argument('--state-bytes', type=int, help='S per rank (with --kv-block-bytes: instead of --model)')
    sim.add_argument('--kv-block-bytes', type=int, help='K_blk per rank')
    sim.add_argument('--block-size', type=int, default=64)
    sim.add_argument('--alignment', type=int, default=1024)
    sim.add_argument('--chunk', type=int, default=8192)
    sim.add_argument('--prefill-tok-per-s', type=float, default=10_000.0,
                     help='assumed prefill throughput (default: an 80B-class hybrid model on one H200)')
    srv = p.add_argument_group('server mode')
    srv.add_argument('--server-args', default=DEFAULT_SERVER_ARGS,
                     help=f'api_server flags (default: {DEFAULT_SERVER_ARGS!r})')
    srv.add_argument('--model-path', help='model directory (default: a tiny Qwen3-Next made on the fly)')
    srv.add_argument('--honor-timestamps', action='store_true', help='send each request at its arrival time')
    srv.add_argument('--seed', type=int, default=0, help='seed of the block token ids')
    srv.add_argument('--timeout-s', type=float, default=1800, help='no request is sent after this many seconds')
    srv.add_argument('--request-timeout-s', type=float, default=600)
    srv.add_argument('--startup-timeout-s', type=float, default=300)
    args = p.parse_args(argv)
    if args.scale is None:
        args.scale = 1 if args.mode == 'sim' else 32
    if args.limit is not None and args.limit < 1:
        p.error('--limit must be >= 1')
    if args.concurrency < 1:
        p.error('--concurrency must be >= 1')
    return args


def main(argv: Sequence[str] | None = None) -> list[dict] | dict:
    """CLI entry; returns the sim rows or the server report."""
    args = parse_args(argv)
    rows = load_trace(args.trace)[:args.limit]
    ws = working_set(rows)
    print(f'trace {args.trace}: {ws["requests"]} requests, {ws["prompt_tokens"]} prompt tokens, '
          f'{ws["distinct_blocks"]} distinct blocks; block-level ideal hit {ws["ideal_block_hit_tokens"]} '
          f'({ws["ideal_hit_fraction"]:.1%})')
    if args.mode == 'sim':
        result = run_sim(args, rows)      # prints the table as it goes
    else:
        result = run_server(args, rows)
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, working_set=ws,
                                             results=result), indent=1))
    return result


if __name__ == '__main__':
    try:
        main()
    except ValueError as err:
        sys.exit(f'error: {err}')
