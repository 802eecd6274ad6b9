"""Replay a request trace against a fleet three ways: one replica with N x the memory, N replicas
round-robin, N replicas behind the cache-aware router (``lmdeploy.serve.fleet.Fleet``).

Every configuration starts fresh (new replicas, a new empty ``file:`` Store shared by its
replicas, a router in front even of the single replica, so each pays the same hop) and replays
the same requests (format: ``benchmark/traces.py``; the committed agent-shaped traces or a
published trace in the same format) at ``--scale`` (a 512-token block becomes 512/scale tokens),
in trace order, ``--concurrency`` in flight. ``--sessions K`` keeps the first K sessions' requests
(all requests of a trace without sessions, cut by ``--limit``).

Prompts are text, not token ids (smg routes text; it refuses ``prompt`` as a token-id list): each
trace token id selects one of the tokenizer's single-token words (`` word``, a leading space
and letters, encoding to exactly that one token), so the prompt encodes to exactly one token
per trace token and two prompts share tokens exactly as far as their trace tokens agree (the
script checks this on the first prompts). A request is a greedy streamed ``/v1/completions``
(``ignore_eos``, ``max_tokens = max(1, round(output_length / scale))``, ``include_usage``):
TTFT is send -> first streamed choice.

Printed per configuration (and written as JSON with ``--json-out``):

- hit tokens: local (the replicas' ``lmdeploy_prefix_cache_hit_tokens_total``, device and host
  tier) and Store (``lmdeploy_store_hit_tokens_total``), summed over replicas, and the client's
  total ``cached_tokens``;
- TTFT p50 / p90 (ms);
- Store bytes written / read (``lmdeploy_store_put_bytes_total``, ``lmdeploy_store_get_bytes_total``);
- per-replica load: requests and prompt tokens each replica served;
- greedy equality: every fleet run's reply text to each request must equal the ``big`` run's reply
  to the same request (all requests are greedy); mismatches are counted and printed, and the
  script exits 1 on any (a request that failed in either run is not compared);
- errors (a request that failed); with ``--kill-replica-at F`` the cache-aware run SIGKILLs
  replica 0 once a fraction F of the requests has been sent (requests streaming from it at that
  moment fail, no router can resend a started stream; every later request must succeed). With
  ``--no-stream`` the requests are non-streaming, which the router resends to another replica, so
  the kill should cost no request; TTFT is then the whole request's latency.

Usage::

    python3 benchmark/benchmark_fleet.py --sessions 6 --replicas 3 --cache-bytes 4000000
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
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
from benchmark.trace_client import complete, pct, wait_store_idle  # noqa: E402
from benchmark.traces import TraceRequest, load_trace, prompt_tokens  # noqa: E402

DEFAULT_SERVER_ARGS = ('--enable-prefix-caching --prefill-save-last-only --block-size 16 --prefill-save-alignment 64 '
                       '--max-prefill-token-num 256')
CONFIGS = ('big', 'round_robin', 'cache_aware')
COUNTERS = {'local': 'lmdeploy_prefix_cache_hit_tokens_total', 'store': 'lmdeploy_store_hit_tokens_total',
            'put_bytes': 'lmdeploy_store_put_bytes_total', 'get_bytes': 'lmdeploy_store_get_bytes_total',
            'prompt_tokens': 'lmdeploy_prompt_tokens_total', 'requests': 'lmdeploy_requests_finished_total'}


def single_token_words(model: str) -> tuple[list[str], list[int]]:
    """The tokenizer's words that are one token with a leading space (`` word``: a space, then
    2+ ASCII letters) and encode back to exactly that token; returns ``(words, token ids)``."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    words, ids = [], []
    for i in range(len(tok)):
        text = tok.decode([i])
        if len(text) >= 3 and text[0] == ' ' and text[1:].isascii() and text[1:].isalpha():
            if tok.encode(text, add_special_tokens=False) == [i]:
                words.append(text)
                ids.append(i)
    return words, ids


def prompt_text(ids: Sequence[int], words: list[str]) -> str:
    """The text of trace tokens ``ids`` (each an index into ``words``)."""
    return ''.join(words[i] for i in ids)


def check_prompts(model: str, texts: list[str], expected: list[list[int]]) -> None:
    """Raise ``RuntimeError`` unless every text encodes to exactly its expected token ids."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    for text, want in zip(texts, expected):
        got = tok.encode(text, add_special_tokens=False)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise RuntimeError(f'a prompt does not encode to one token per word (first difference at {first}; '
                               f'{len(got)} tokens, {len(want)} expected)')


def select(rows: list[TraceRequest], sessions: int | None, limit: int | None) -> list[TraceRequest]:
    """The first ``sessions`` sessions' requests (in trace order), then at most ``limit``."""
    if sessions is not None and any(r.session for r in rows):
        keep: list[str] = []
        for r in rows:
            if r.session not in keep and len(keep) < sessions:
                keep.append(r.session)
        rows = [r for r in rows if r.session in keep]
    return rows[:limit] if limit else rows


def counters(url: str) -> dict[str, float]:
    """The :data:`COUNTERS` of one replica's ``/metrics`` (summed over labels); {} when it is down."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url + '/metrics', timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def replay(url: str, model: str, jobs: list[tuple[str, int, dict]], concurrency: int, timeout_s: float,
           on_sent=None, stream: bool = True) -> list[dict]:
    """Send ``jobs`` (prompt, max_tokens, headers) in order, ``concurrency`` in flight; ``on_sent(i)`` is
    called after job i is submitted."""
    results: list[dict | None] = [None] * len(jobs)
    slots = threading.Semaphore(concurrency)

    def one(i: int) -> None:
        try:
            results[i] = complete(url, *jobs[i][:2], timeout_s, model=model, headers=jobs[i][2], stream=stream)
        except Exception as err:  # noqa: BLE001 -- a client bug is reported per request, not lost in the pool
            results[i] = dict(error=f'{type(err).__name__}: {err}')
        finally:
            slots.release()
    with ThreadPoolExecutor(concurrency) as pool:
        for i in range(len(jobs)):
            slots.acquire()
            pool.submit(one, i)
            if on_sent is not None:
                on_sent(i)
    return results


def run_config(name: str, args: argparse.Namespace, model: str, jobs: list[tuple[str, int, dict]], work: Path) -> dict:
    """Start one configuration's fleet, replay ``jobs``, stop it; returns its report."""
    from lmdeploy.serve.fleet import Fleet, SharedStore
    replicas = 1 if name == 'big' else args.replicas
    cache_bytes = args.cache_bytes * (args.replicas if name == 'big' else 1)
    policy = 'round_robin' if name in ('big', 'round_robin') else args.policy
    store = SharedStore('file', work / f'{name}-store')
    fields = store.open()
    flags = [*shlex.split(args.server_args), '--cache-bytes', str(cache_bytes),
             '--store-backend', fields['store_backend'], '--store-secret-file', fields['store_secret_file']]
    from lmdeploy.pytorch.store.services import free_ports
    ports = free_ports('127.0.0.1', replicas + 1)
    fleet = Fleet(model, flags, replicas=replicas, port=ports[0], replica_ports=ports[1:], router=args.router,
                  policy=policy, router_args=shlex.split(args.router_args) if name == 'cache_aware' else [],
                  log_dir=str(work / f'{name}-logs'),
                  env={'OMP_NUM_THREADS': '1'})
    killed: list[float] = []

    def on_sent(i: int) -> None:
        if (name == 'cache_aware' and args.kill_replica_at is not None and not killed
                and i + 1 >= args.kill_replica_at * len(jobs)):
            fleet.replicas[0].proc.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())
    try:
        t0 = time.monotonic()
        fleet.start()
        print(f'[{name}] {replicas} replica(s), --cache-bytes {cache_bytes}, {args.router} {policy}: ready in '
              f'{time.monotonic() - t0:.0f} s', file=sys.stderr, flush=True)
        before = [counters(u) for u in fleet.replica_urls]
        start = time.monotonic()
        results = replay(fleet.url, args.model_name, jobs, args.concurrency, args.request_timeout_s, on_sent,
                         not args.no_stream)
        replay_s = time.monotonic() - start
        for u in fleet.replica_urls:
            wait_store_idle(u)
        after = [counters(u) for u in fleet.replica_urls]
    finally:
        fleet.stop()
        store.close()
    per = []
    for b, a in zip(before, after):
        per.append({k: (a[k] - b.get(k, 0.0)) if a else None for k in COUNTERS} if a else None)
    live = [p for p in per if p]
    done = [r for r in results if r and 'error' not in r]
    errors = [r['error'] for r in results if r and 'error' in r]
    ttft = [r['ttft_s'] for r in done]
    total = {k: sum(p[k] for p in live) for k in COUNTERS}
    return dict(config=name, replicas=replicas, cache_bytes=cache_bytes, policy=policy, requests=len(jobs),
                completed=len(done), errors=len(errors), first_errors=errors[:3], replay_s=replay_s,
                prompt_tokens=sum(r['prompt_tokens'] for r in done),
                cached_tokens=sum(r['cached_tokens'] for r in done),
                local_hit_tokens=total['local'], store_hit_tokens=total['store'],
                store_put_bytes=total['put_bytes'], store_get_bytes=total['get_bytes'],
                ttft_p50_ms=pct(ttft, 50) and pct(ttft, 50) * 1000, ttft_p90_ms=pct(ttft, 90) and pct(ttft, 90) * 1000,
                per_replica=[None if p is None else {'requests': p['requests'], 'prompt_tokens': p['prompt_tokens'],
                                                     'local_hit_tokens': p['local'], 'store_hit_tokens': p['store']}
                             for p in per],
                killed_replica=0 if killed else None, texts=[r.get('text') if r else None for r in results])


def greedy_mismatches(reports: list[dict]) -> dict[str, tuple[int, list[int]]]:
    """Per fleet run, ``(compared, mismatched request indices)``: requests whose greedy reply text
    differs from the ``big`` run's reply to the same request (a request that failed in either run is
    not compared); {} without a ``big`` run."""
    ref = next((r['texts'] for r in reports if r['config'] == 'big'), None)
    if ref is None:
        return {}
    out = {}
    for r in reports:
        if r['config'] != 'big':
            both = [i for i, (a, b) in enumerate(zip(ref, r['texts'])) if a is not None and b is not None]
            out[r['config']] = (len(both), [i for i in both if ref[i] != r['texts'][i]])
    return out


def print_table(reports: list[dict]) -> None:
    print(f'{"config":<12} {"repl":>4} {"done":>9} {"local hit":>10} {"Store hit":>10} {"cached":>9} '
          f'{"TTFT p50":>9} {"TTFT p90":>9} {"Store MB w":>10} {"Store MB r":>10}  '
          'per-replica requests / prompt tokens')
    for r in reports:
        load = ', '.join('dead' if p is None else f'{p["requests"]:.0f}/{p["prompt_tokens"]:.0f}'
                         for p in r['per_replica'])
        print(f'{r["config"]:<12} {r["replicas"]:>4} {r["completed"]:>4}/{r["requests"]:<4} '
              f'{r["local_hit_tokens"]:>10.0f} '
              f'{r["store_hit_tokens"]:>10.0f} {r["cached_tokens"]:>9} {r["ttft_p50_ms"] or 0:>7.1f}ms '
              f'{r["ttft_p90_ms"] or 0:>7.1f}ms {r["store_put_bytes"] / 1e6:>10.2f} '
              f'{r["store_get_bytes"] / 1e6:>10.2f}  {load}')
    print('local hit: tokens restored from a replica\'s own prefix cache; Store hit: from the shared file: Store; '
          'cached = local + Store as the client saw it (requests to a killed replica\'s counters are lost with it)')


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--trace', default=str(ROOT / 'benchmark' / 'traces' / 'claude_code.jsonl'))
    p.add_argument('--sessions', type=int, default=6, help='keep the first K sessions\' requests')
    p.add_argument('--limit', type=int, default=None, help='then at most this many requests')
    p.add_argument('--scale', type=int, default=64, help='a 512-token block becomes 512/scale tokens')
    p.add_argument('--replicas', type=int, default=3)
    p.add_argument('--cache-bytes', type=int, default=4_000_000, help='each replica\'s --cache-bytes (big: N x)')
    p.add_argument('--configs', default=','.join(CONFIGS), help='which of ' + ', '.join(CONFIGS))
    p.add_argument('--router', default='smg')
    p.add_argument('--router-args', default='', help='more router flags of the cache_aware run, one quoted string')
    p.add_argument('--policy', default='cache_aware', help='the router policy of the cache_aware run')
    p.add_argument('--session-header', default=None, metavar='NAME',
                   help='send each request\'s session id in this header (e.g. x-smg-routing-key)')
    p.add_argument('--concurrency', type=int, default=3)
    p.add_argument('--model-path', default=None, help='default: a tiny random-weight Qwen3-Next made on the fly')
    p.add_argument('--server-args', default=DEFAULT_SERVER_ARGS)
    p.add_argument('--kill-replica-at', type=float, default=None, metavar='F',
                   help='cache_aware run: SIGKILL replica 0 after this fraction of the requests was sent')
    p.add_argument('--no-stream', action='store_true',
                   help='send non-streaming requests (TTFT columns are then whole-request latency)')
    p.add_argument('--request-timeout-s', type=float, default=300)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json-out', default=None)
    args = p.parse_args(argv)
    bad = set(args.configs.split(',')) - set(CONFIGS)
    if bad:
        p.error(f'--configs: unknown {sorted(bad)}')
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix='fleet_bench_'))
    model = args.model_path
    if model is None:
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        model = make_tiny_model(str(work / 'tiny_qwen3_next'), arch='qwen3_next', seed=0)
    args.model_name = os.path.basename(os.path.normpath(model))
    rows = select(load_trace(args.trace), args.sessions, args.limit)
    words, word_ids = single_token_words(model)
    token_ids = [prompt_tokens(r, args.scale, len(words), args.seed) for r in rows]
    jobs = [(prompt_text(ids, words), max(1, round(r.output_length / args.scale)),
             {args.session_header: r.session} if args.session_header and r.session else {})
            for r, ids in zip(rows, token_ids)]
    check_prompts(model, [j[0] for j in jobs[:20]], [[word_ids[i] for i in ids] for ids in token_ids[:20]])
    print(f'{len(rows)} requests of {len({r.session for r in rows if r.session})} sessions from {args.trace} '
          f'at scale {args.scale} ({sum(map(len, token_ids))} prompt tokens); {len(words)} single-token words; '
          f'concurrency {args.concurrency}; '
          f'server flags: {args.server_args}; work folder {work}', flush=True)
    reports = [run_config(name, args, model, jobs, work) for name in args.configs.split(',')]
    print_table(reports)
    mismatches = greedy_mismatches(reports)
    for r in reports:
        if r['config'] in mismatches:
            compared, bad = mismatches[r['config']]
            r['greedy_compared'], r['greedy_mismatches'] = compared, bad
            print(f'greedy text vs big, {r["config"]}: {len(bad)} mismatches of {compared} compared'
                  + (f' (requests {bad[:10]})' if bad else ''))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(reports, indent=1))
    return reports


if __name__ == '__main__':
    reports = main()
    sys.exit(1 if any(r.get('greedy_mismatches') for r in reports) else 0)
