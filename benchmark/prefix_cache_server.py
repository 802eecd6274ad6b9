"""The prefix-cache benchmark's api_server client (:class:`Server`: one subprocess on 127.0.0.1,
its metrics, the Store ledger, streamed completions with TTFT) and its seeded prompts
(:class:`PromptMaker`). ``benchmark/benchmark_prefix_cache.py`` runs the plan and re-exports
every name here.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class BenchmarkError(RuntimeError):
    """A consistency, cache-hit or byte check failed, or a server misbehaved."""


@dataclass
class TurnResult:
    """One request: TTFT (seconds), prompt/cached tokens and the reply text."""
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    text: str


# server ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Server:
    """One api_server subprocess on 127.0.0.1, in its own process group (so the embedded
    Mooncake children end with it); its output goes to ``log_path``."""

    def __init__(self, model: str, flags: list[str], log_path: Path, threads: int | None = None,
                 timeout_s: float = 300):
        self.port = _free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        cmd = [sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'serve', 'api_server', model, '--server-name',
               '127.0.0.1', '--server-port', str(self.port), '--model-name', 'bench', '--log-level', 'WARNING',
               *flags]
        env = dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1',
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')])))
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.log_path = log_path
        self._log = open(log_path, 'w')
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchmarkError(f'api_server exited with {self.proc.returncode}; log: {log_path}\n'
                                     + log_path.read_text(errors='replace')[-3000:])
            try:
                with urllib.request.urlopen(self.url + '/health', timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BenchmarkError(f'api_server not healthy after {timeout_s} s; log: {log_path}')
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (graceful: flushes the Store, stops its services), SIGKILL of the group after 30 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def store_counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(put bytes, put objects)`` by kind from ``/metrics`` (after in-flight saves finish)."""
        from prometheus_client.parser import text_string_to_metric_families
        deadline = time.monotonic() + 120
        while self.get_json('/debug/ledger').get('store_inflight', 0):
            if time.monotonic() > deadline:
                raise BenchmarkError('Store saves still in flight after 120 s')
            time.sleep(0.02)
        with urllib.request.urlopen(self.url + '/metrics', timeout=60) as r:
            text = r.read().decode()
        out = {'lmdeploy_store_put_bytes': {'state': 0, 'kv': 0}, 'lmdeploy_store_put_objects': {'state': 0, 'kv': 0}}
        for fam in text_string_to_metric_families(text):
            if fam.name in out:
                for s in fam.samples:
                    if s.name.endswith('_total'):
                        out[fam.name][s.labels['kind']] = int(s.value)
        return out['lmdeploy_store_put_bytes'], out['lmdeploy_store_put_objects']

    def complete(self, ids: list[int], max_tokens: int) -> TurnResult:
        """Greedy streamed completion of token ids; TTFT = send → first streamed choice."""
        body = json.dumps({'model': 'bench', 'prompt': ids, 'max_tokens': max_tokens, 'ignore_eos': True,
                           'temperature': 0, 'stream': True, 'stream_options': {'include_usage': True}}).encode()
        req = urllib.request.Request(self.url + '/v1/completions', data=body,
                                     headers={'Content-Type': 'application/json'})
        text, first, usage = '', None, None
        start = time.perf_counter()
        try:
            resp = urllib.request.urlopen(req, timeout=3600)
        except urllib.error.HTTPError as err:
            raise BenchmarkError(f'POST /v1/completions ({len(ids)} tokens): {err.code} {err.read()[:500]!r}')
        with resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith('data:') or line == 'data: [DONE]':
                    continue
                event = json.loads(line[5:])
                if 'error' in event:
                    raise BenchmarkError(f'server error: {event["error"]}')
                if event.get('choices'):
                    first = first or time.perf_counter()
                    text += event['choices'][0].get('text', '')
                usage = event.get('usage') or usage
        end = time.perf_counter()
        if usage is None or first is None:
            raise BenchmarkError('stream ended without a choice or without usage')
        return TurnResult(usage['prompt_tokens'], usage['prompt_tokens_details']['cached_tokens'], first - start,
                          end - start, text)


# prompts --------------------------------------------------------------------------------------
class PromptMaker:
    """Seeded random plain-token prompts and multi-turn continuations for one tokenizer."""

    def __init__(self, model: str, seed: int):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model)
        self.special = set(self.tok.all_special_ids)
        self.vocab = self.tok.vocab_size
        self.seed = seed

    def random_ids(self, n: int, *key) -> list[int]:
        rng = random.Random('-'.join(map(str, (self.seed, *key))))
        out = []
        while len(out) < n:
            t = rng.randrange(self.vocab)
            if t not in self.special:
                out.append(t)
        return out

    def next_turn(self, prev: list[int], reply: str, n: int, *key) -> list[int]:
        """``prev`` + the reply's tokens + random user tokens, exactly ``n`` tokens."""
        reply_ids = self.tok.encode(reply, add_special_tokens=False)[:max(0, n - len(prev))]
        ids = prev + reply_ids
        return ids + self.random_ids(n - len(ids), *key)
