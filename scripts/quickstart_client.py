"""Drive a multi-turn agent conversation against a running lmdeploy api_server and print,
per turn, TTFT, prompt tokens, cached tokens and Store bytes written (from /metrics).

Each turn appends the model's reply and a new tool-result-like user message to the history,
as an agent loop does, so every turn's prompt extends the previous one. ``--save-conversation``
writes the history (with the next user message) to a JSON file; ``--resume`` sends that
history as one more turn, e.g. to a fresh server, and prints the tokens restored from the
Mooncake Store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

TOOL_OUTPUT = ('tool output: listed 12 files in src/, 3 tests failed in test_parser.py with '
               'AssertionError on line {n}; the build log shows warnings about unused imports. ')


def metric_total(base_url: str, name: str) -> int:
    """Sum of the counter ``lmdeploy_<name>`` over its labels, read from ``/metrics``."""
    with urllib.request.urlopen(f'{base_url}/metrics', timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        series = line.split('{')[0].split(' ')[0]
        if series in (f'lmdeploy_{name}', f'lmdeploy_{name}_total'):
            total += float(line.rsplit(' ', 1)[1])
    return int(total)


def store_bytes(base_url: str) -> int:
    """Bytes put into the Mooncake Store, all object kinds."""
    return metric_total(base_url, 'store_put_bytes')


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


def run_turn(client, model: str, messages: list[dict], max_tokens: int):
    """One streamed chat turn: ``(ttft seconds, reply text, usage)``."""
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={'include_usage': True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    ttft = ttft if ttft is not None else time.perf_counter() - start
    return ttft, ''.join(text), usage


def cached_tokens(usage) -> int:
    return (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0


def resume(client, model: str, args) -> int:
    """Send the saved conversation as one turn and print what the Store restored."""
    with open(args.resume) as f:
        messages = json.load(f)
    before = metric_total(args.base_url, 'store_hit_tokens')
    ttft, _, usage = run_turn(client, model, messages, args.max_tokens)
    hit = metric_total(args.base_url, 'store_hit_tokens') - before
    print(f'{"restore":>7} {"TTFT s":>8} {"prompt tokens":>14} {"cached tokens":>14} {"Store hit tokens":>17}')
    print(f'{"turn 6":>7} {ttft:>8.3f} {usage.prompt_tokens:>14} {cached_tokens(usage):>14} {hit:>17}', flush=True)
    print('Store hit tokens: prompt tokens this fresh server restored from the Mooncake Store (KV blocks and '
          'the recurrent-state checkpoint server 1 saved) instead of recomputing them')
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--base-url', required=True)
    ap.add_argument('--turns', type=int, default=5)
    ap.add_argument('--max-tokens', type=int, default=24)
    ap.add_argument('--server-pid', type=int, default=None)
    ap.add_argument('--save-conversation', default=None, metavar='PATH',
                    help='write the history plus the next user message to PATH (JSON)')
    ap.add_argument('--resume', default=None, metavar='PATH',
                    help='send the conversation saved in PATH as one turn and print Store hit tokens')
    args = ap.parse_args(argv)
    from openai import OpenAI
    wait_ready(args.base_url, args.server_pid)
    client = OpenAI(base_url=f'{args.base_url}/v1', api_key='none')
    model = client.models.list().data[0].id
    if args.resume:
        return resume(client, model, args)
    messages = [{'role': 'system', 'content': 'You are a coding agent. Use the tools, read their output, and '
                 'fix the failing tests step by step. ' * 6},
                {'role': 'user', 'content': 'The test suite is failing. Find out why and fix it.'}]
    print(f'{"turn":>4} {"TTFT s":>8} {"prompt tokens":>14} {"cached tokens":>14} {"Store bytes":>12}')
    before = store_bytes(args.base_url)
    for turn in range(1, args.turns + 1):
        ttft, text, usage = run_turn(client, model, messages, args.max_tokens)
        after = settled_store_bytes(args.base_url)
        print(f'{turn:>4} {ttft:>8.3f} {usage.prompt_tokens:>14} {cached_tokens(usage):>14} {after - before:>12}',
              flush=True)
        before = after
        messages.append({'role': 'assistant', 'content': text})
        messages.append({'role': 'user', 'content': TOOL_OUTPUT.format(n=40 + turn) * 3})
    print('cached tokens: prompt tokens restored from the checkpoint an earlier turn saved (a multiple of '
          '--prefill-save-alignment)\nStore bytes: written to the Mooncake Store by the turn: one state snapshot '
          'plus the KV blocks not stored before')
    if args.save_conversation:
        with open(args.save_conversation, 'w') as f:
            json.dump(messages, f)
    return 0


if __name__ == '__main__':
    sys.exit(main())
