"""Drive a multi-turn agent conversation against a running lmdeploy api_server and print,
per turn, TTFT, prompt tokens, cached tokens and Store bytes written (from /metrics).

Each turn appends the model's reply and a new tool-result-like user message to the history,
as an agent loop does, so every turn's prompt extends the previous one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

TOOL_OUTPUT = ('tool output: listed 12 files in src/, 3 tests failed in test_parser.py with '
               'AssertionError on line {n}; the build log shows warnings about unused imports. ')


def store_bytes(base_url: str) -> int:
    """Sum of the ``lmdeploy_store_put_bytes`` counter over its ``kind`` labels (bytes)."""
    with urllib.request.urlopen(f'{base_url}/metrics', timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith('lmdeploy_store_put_bytes') and not line.startswith('#'):
            name = line.split('{')[0].split(' ')[0]
            if name.endswith('_total') or name == 'lmdeploy_store_put_bytes':
                total += float(line.rsplit(' ', 1)[1])
    return int(total)


def settled_store_bytes(base_url: str, timeout: float = 5.0) -> int:
    """Store bytes once the server's background puts have settled (two equal reads 0.2 s apart)."""
    value, deadline = store_bytes(base_url), time.time() + timeout
    while time.time() < deadline:
        time.sleep(0.2)
        again = store_bytes(base_url)
        if again == value:
            return value
        value = again
    return value


def wait_ready(base_url: str, pid: int | None, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                sys.exit('the server exited before it was ready')
        try:
            with urllib.request.urlopen(f'{base_url}/health', timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f'the server did not become ready within {timeout:.0f} s')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--base-url', required=True)
    ap.add_argument('--turns', type=int, default=5)
    ap.add_argument('--max-tokens', type=int, default=24)
    ap.add_argument('--server-pid', type=int, default=None)
    args = ap.parse_args(argv)
    from openai import OpenAI
    wait_ready(args.base_url, args.server_pid)
    client = OpenAI(base_url=f'{args.base_url}/v1', api_key='none')
    model = client.models.list().data[0].id
    messages = [{'role': 'system', 'content': 'You are a coding agent. Use the tools, read their output, and '
                 'fix the failing tests step by step. ' * 6},
                {'role': 'user', 'content': 'The test suite is failing. Find out why and fix it.'}]
    print(f'{"turn":>4} {"TTFT s":>8} {"prompt tokens":>14} {"cached tokens":>14} {"Store bytes":>12}')
    before = store_bytes(args.base_url)
    for turn in range(1, args.turns + 1):
        start = time.perf_counter()
        ttft, text, usage = None, [], None
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                temperature=0, stream=True,
                                                stream_options={'include_usage': True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        ttft = ttft if ttft is not None else time.perf_counter() - start
        after = settled_store_bytes(args.base_url)
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        print(f'{turn:>4} {ttft:>8.3f} {usage.prompt_tokens:>14} {cached:>14} {after - before:>12}', flush=True)
        before = after
        messages.append({'role': 'assistant', 'content': ''.join(text)})
        messages.append({'role': 'user', 'content': TOOL_OUTPUT.format(n=40 + turn) * 3})
    print('cached tokens: prompt tokens restored from the checkpoint an earlier turn saved (a multiple of '
          '--prefill-save-alignment)\nStore bytes: written to the Mooncake Store by the turn: one state snapshot '
          'plus the KV blocks not stored before')
    return 0


if __name__ == '__main__':
    sys.exit(main())
