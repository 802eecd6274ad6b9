"""Prefill/decode disaggregation against colocated serving: TTFT and decode tokens/s.

Two deployments of the same model, each with its own fresh ``file:`` Store in a temporary
directory:

- ``colocated``: one server (``--role both``, prefix caching and the Store on);
- ``pd``: a ``--role prefill`` and a ``--role decode`` server sharing one ``file:`` Store, behind
  ``vllm-router --vllm-pd-disaggregation`` (the router sends each request to the prefill server,
  then to the decode server with the ``kv_transfer_params`` the prefill server answered).

Both get the same requests: greedy streamed ``/v1/completions`` (``ignore_eos``,
``max_tokens = --new-tokens``, ``include_usage``) of ``--requests`` distinct prompts of about
``--prompt-words`` words, first one at a time, then ``--concurrency`` in flight (other distinct
prompts, so no phase hits a prefix an earlier phase stored). Measured per request, on the client:

- TTFT: send -> first streamed choice with text (seconds; reported p50 / p90 in ms);
- decode tokens/s: (completion tokens - 1) / (last chunk - first chunk), the generation rate
  after the first token (reported as the median over requests), and for the concurrent phase
  also the aggregate rate: sum of (completion tokens - 1) over the phase's wall time.

The greedy completions of the two deployments must be equal for every prompt (the script exits
1 otherwise), and the decode server's ``lmdeploy_store_handoff_hit_tokens_total`` shows how many
prompt tokens it restored from hand-offs during each PD phase (n - 1 per request when every
hand-off was found). Printed: a table per phase with PD / colocated ratios (``--json-out`` writes it as
JSON). Every process started is stopped on exit.

Without ``--model`` a tiny seeded Qwen3-Next checkpoint is made (``--layers`` layers).

Usage::

    python3 benchmark/benchmark_pd.py --requests 8 --concurrency 4 --new-tokens 32
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests'))
from server_utils import ApiServer, free_port, http_json  # noqa: E402

SERVER_ARGS = ('--block-size', '16', '--prefill-save-alignment', '64', '--max-prefill-token-num', '256',
               '--session-len', '4096')
WORDS = ('river mill town ledger salt wool copper glass paper tea ship harbour master spring '
         'library keeper lantern bridge market road field orchard stone tower bell').split()


def prompts(n: int, words: int, tag: str) -> list[str]:
    """``n`` distinct prompts of ``words`` words each; ``tag`` keeps phases apart (no shared prefix)."""
    out = []
    for i in range(n):
        body = ' '.join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(words))
        out.append(f'{tag} {i}: {body}')
    return out


def stream(url: str, model: str, prompt: str, new_tokens: int, timeout_s: float) -> dict:
    """One greedy streamed completion. Returns text, tokens, ttft_s, decode_s (first -> last chunk)."""
    body = json.dumps({'model': model, 'prompt': prompt, 'max_tokens': new_tokens, 'temperature': 0,
                       'ignore_eos': True, 'stream': True, 'stream_options': {'include_usage': True}}).encode()
    req = urllib.request.Request(url + '/v1/completions', data=body, headers={'Content-Type': 'application/json'})
    t0 = time.perf_counter()
    first = last = None
    text, tokens, chunks, prompt_tokens = [], None, 0, None
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith('data:') or line == 'data: [DONE]':
                continue
            event = json.loads(line[5:])
            if event.get('usage'):
                tokens = event['usage']['completion_tokens']
                prompt_tokens = event['usage']['prompt_tokens']
            for choice in event.get('choices') or ():
                if choice.get('text'):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                    text.append(choice['text'])
    if first is None:
        raise RuntimeError(f'no token streamed from {url}')
    return dict(text=''.join(text), tokens=tokens if tokens is not None else chunks, ttft_s=first - t0,
                decode_s=last - first, prompt_tokens=prompt_tokens)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values``."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))]


def run_phase(url: str, model: str, texts: list[str], concurrency: int, args: argparse.Namespace) -> dict:
    """Send ``texts`` with ``concurrency`` in flight; returns per-request results and the summary."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream(url, model, p, args.new_tokens, args.timeout), texts))
    wall = time.perf_counter() - t0
    rates = [(r['tokens'] - 1) / r['decode_s'] for r in results if r['tokens'] > 1 and r['decode_s'] > 0]
    ttft = [r['ttft_s'] for r in results]
    return dict(texts=[r['text'] for r in results], prompt_tokens=sum(r['prompt_tokens'] or 0 for r in results),
                summary=dict(ttft_p50_ms=1e3 * pct(ttft, 50), ttft_p90_ms=1e3 * pct(ttft, 90),
                             decode_tok_s=statistics.median(rates) if rates else float('nan'),
                             aggregate_decode_tok_s=sum(r['tokens'] - 1 for r in results) / wall,
                             wall_s=wall))


def counter(url: str, name: str) -> float:
    """``lmdeploy_<name>_total`` of a server's ``/metrics`` (summed over labels)."""
    with urllib.request.urlopen(url + '/metrics', timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    full = f'lmdeploy_{name}_total'
    return sum(float(ln.split()[-1]) for ln in lines if ln.split('{')[0].split(' ')[0] == full)


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if http_json(url + '/health', timeout=5)[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError('vllm-router did not start')
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--model', help='model directory (default: a tiny Qwen3-Next made here)')
    ap.add_argument('--layers', type=int, default=4, help='layers of the tiny model')
    ap.add_argument('--requests', type=int, default=8, help='prompts per phase')
    ap.add_argument('--prompt-words', type=int, default=300, help='words per prompt (about as many tokens)')
    ap.add_argument('--new-tokens', type=int, default=32)
    ap.add_argument('--concurrency', type=int, default=4)
    ap.add_argument('--timeout', type=float, default=600, help='seconds per request')
    ap.add_argument('--server-args', default=' '.join(SERVER_ARGS), help='flags of every server')
    ap.add_argument('--router', default=shutil.which('vllm-router') or 'vllm-router')
    ap.add_argument('--json-out')
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix='benchmark_pd_'))
    servers, router = [], None
    try:
        model = args.model
        if model is None:
            from lmdeploy.tools.make_tiny_model import make_tiny_model
            model = make_tiny_model(str(work / 'model'), arch='qwen3_next', seed=0, num_hidden_layers=args.layers)
        flags = args.server_args.split() + ['--enable-prefix-caching']
        both = ApiServer(model, *flags, '--store-backend', f'file:{work / "store_colocated"}')
        pd_store = ('--store-backend', f'file:{work / "store_pd"}')
        prefill = ApiServer(model, *flags, *pd_store, '--role', 'prefill')
        decode = ApiServer(model, *flags, *pd_store, '--role', 'decode')
        servers = [both, prefill, decode]
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        port = free_port()
        router = subprocess.Popen([args.router, '--vllm-pd-disaggregation', '--prefill', prefill.base_url,
                                   '--decode', decode.base_url, '--host', '127.0.0.1', '--port', str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pd_url = f'http://127.0.0.1:{port}'
        wait_up(pd_url, router)
        served = both.get('/v1/models')[1]['data'][0]['id']

        phases = [('sequential', 1), (f'concurrency {args.concurrency}', args.concurrency)]
        report, mismatches = {}, 0
        for p, (name, conc) in enumerate(phases):
            texts = prompts(args.requests, args.prompt_words, f'phase{p}')
            stream(both.base_url, served, 'warm up ' + texts[0][:40], 2, args.timeout)   # first-request costs
            stream(pd_url, served, 'warm up ' + texts[0][:40], 2, args.timeout)
            colo = run_phase(both.base_url, served, texts, conc, args)
            restored = counter(decode.base_url, 'store_handoff_hit_tokens')
            pd = run_phase(pd_url, served, texts, conc, args)
            restored = counter(decode.base_url, 'store_handoff_hit_tokens') - restored
            bad = [i for i, (a, b) in enumerate(zip(colo['texts'], pd['texts'])) if a != b]
            mismatches += len(bad)
            report[name] = dict(colocated=colo['summary'], pd=pd['summary'], outputs_equal=not bad,
                                mismatched=bad, handoff_restored_tokens=restored,
                                handoff_expected_tokens=pd['prompt_tokens'] - len(texts))

        first = next(iter(report.values()))
        print(f'model {model}  requests {args.requests}/phase  '
              f'{first["handoff_expected_tokens"] / args.requests + 1:.0f} prompt tokens/request (mean)  '
              f'{args.new_tokens} new tokens')
        for name, r in report.items():
            print(f'\n{name}  (greedy outputs equal: {r["outputs_equal"]}; decode server restored '
                  f'{r["handoff_restored_tokens"]:.0f} of {r["handoff_expected_tokens"]} hand-off tokens (n - 1 each))')
            print(f'{"":24}{"colocated":>12}{"PD":>12}{"PD/colo":>10}')
            for key, label in (('ttft_p50_ms', 'TTFT p50 (ms)'), ('ttft_p90_ms', 'TTFT p90 (ms)'),
                               ('decode_tok_s', 'decode tok/s (median)'),
                               ('aggregate_decode_tok_s', 'decode tok/s (aggr.)'), ('wall_s', 'wall (s)')):
                a, b = r['colocated'][key], r['pd'][key]
                print(f'{label:24}{a:12.1f}{b:12.1f}{b / a:10.2f}')
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=2))
        if mismatches:
            print(f'\n{mismatches} greedy outputs differ between PD and colocated', file=sys.stderr)
            return 1
        return 0
    finally:
        if router is not None:
            router.kill()
            router.wait()
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
