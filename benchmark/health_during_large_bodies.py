"""``/health`` latency while the server receives and processes large request bodies.

Starts ``lmdeploy serve api_server`` on a tiny Qwen3 checkpoint (made with the project's maker)
on 127.0.0.1, polls ``/health`` from a separate process (so the client's GIL does not count),
and meanwhile sends ``--concurrency`` bodies of ``--mb`` MB at once, of each kind:

* ``ids``: ``/v1/completions`` with a token-id prompt (JSON decoding, validation);
* ``text``: ``/v1/completions`` with a text prompt (tokenization of ~2 M tokens, the length
  check, freeing the encoding).

Both are refused with 400 (longer than the session), after the work above. Prints, per kind,
the polls overlapping the bodies (from the first send to the last answer + 0.2 s) with their
p50 / p99 / max latency in ms, and writes them as JSON with ``--out``::

    python benchmark/health_during_large_bodies.py --mb 4 --concurrency 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_POLLER = """
import sys, time, urllib.request
url, stop_after = sys.argv[1], float(sys.argv[2])
end = time.monotonic() + stop_after
while time.monotonic() < end:
    start = time.time()
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
    print(start, time.time() - start, flush=True)
    time.sleep(0.01)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def body_of(kind: str, model: str, mb: float) -> bytes:
    """A ``/v1/completions`` body of about ``mb`` MB whose prompt is token ids or text."""
    size = int(mb * 1_000_000)
    if kind == 'ids':
        ids = [(i * 7919) % 1000 + 3 for i in range(size // 4)]       # ~4 bytes per id in JSON
        prompt = ids
    else:
        words = ['alpha', 'beta', 'gamma', 'delta', 'kappa', 'omega', 'sigma', 'theta']
        prompt = ' '.join(words[(i * 7) % len(words)] for i in range(size // 6))
    return json.dumps({'model': model, 'prompt': prompt, 'max_tokens': 1}).encode()


def post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={'Content-Type': 'application/json'})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def measure(base: str, model: str, kind: str, mb: float, concurrency: int, rounds: int) -> dict:
    """Polls of /health overlapping ``rounds`` bursts of ``concurrency`` bodies of one kind."""
    body = body_of(kind, model, mb)
    windows, codes = [], []
    poller = subprocess.Popen([sys.executable, '-c', _POLLER, base + '/health', '1000'], stdout=subprocess.PIPE)
    time.sleep(1.0)
    for _ in range(rounds):
        threads = [threading.Thread(target=lambda: codes.append(post(base + '/v1/completions', body)))
                   for _ in range(concurrency)]
        start = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        windows.append((start, time.time() + 0.2))
        time.sleep(0.5)
    poller.terminate()
    out = poller.communicate(timeout=30)[0].decode()
    polls = [tuple(map(float, line.split())) for line in out.splitlines() if len(line.split()) == 2]
    inside = [d for t, d in polls if any(t + d >= a and t <= b for a, b in windows)]
    return {'kind': kind, 'body_bytes': len(body), 'concurrency': concurrency, 'rounds': rounds,
            'status_codes': sorted(set(codes)), 'busy_s': round(sum(b - a for a, b in windows), 2),
            'polls': len(inside), 'p50_ms': round(percentile(inside, 0.5) * 1000, 1),
            'p99_ms': round(percentile(inside, 0.99) * 1000, 1), 'max_ms': round(max(inside) * 1000, 1),
            'sorted_ms': [round(d * 1000, 1) for d in sorted(inside)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--mb', type=float, default=4.0, help='body size in MB (default 4)')
    p.add_argument('--concurrency', type=int, default=2, help='bodies sent at once (default 2)')
    p.add_argument('--rounds', type=int, default=3, help='bursts per kind (default 3)')
    p.add_argument('--kinds', default='ids,text', help='comma-separated: ids, text')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args()
    sys.path.insert(0, REPO)
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    tmp = tempfile.mkdtemp(prefix='health_bench_')
    model_path = make_tiny_model(os.path.join(tmp, 'tiny_qwen3'), arch='qwen3', seed=0)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get('PYTHONPATH')])))
    server = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'serve', 'api_server', model_path,
                               '--server-name', '127.0.0.1', '--server-port', str(port), '--log-level', 'WARNING',
                               '--device-type', 'cpu', '--num-gpu-blocks', '64'], cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL)
    base = f'http://127.0.0.1:{port}'
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(base + '/v1/models', timeout=2) as resp:
                    model = json.loads(resp.read())['data'][0]['id']
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError('the server did not start')
                time.sleep(0.3)
        results = [measure(base, model, kind, args.mb, args.concurrency, args.rounds)
                   for kind in args.kinds.split(',')]
    finally:
        server.terminate()
        server.wait(timeout=30)
    for r in results:
        print(f"{r['kind']:>4}: {r['concurrency']} x {r['body_bytes']:,} bytes x {r['rounds']} rounds, "
              f"answers {r['status_codes']}: {r['polls']} /health polls, p50 {r['p50_ms']} ms, "
              f"p99 {r['p99_ms']} ms, max {r['max_ms']} ms")
    if args.out:
        with open(args.out, 'w') as f:       # one line per kind
            f.write('{"load_avg": %s, "results": [\n%s\n]}\n' % (
                json.dumps(os.getloadavg()), ',\n'.join(json.dumps(r) for r in results)))


if __name__ == '__main__':
    main()
