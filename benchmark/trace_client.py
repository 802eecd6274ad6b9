"""The HTTP client the trace replays share (``benchmark_trace.py --mode server`` against one
server, ``benchmark_fleet.py`` against a fleet's router): one greedy completion with its TTFT
and cache hit, the wait for a server's Store saves to drain, and a nearest-rank percentile.
Standard library only (the replays run outside the engine's process)."""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request

__all__ = ['complete', 'wait_store_idle', 'pct']


def complete(url: str, prompt: str | list[int], max_tokens: int, timeout_s: float, *, model: str = 'bench',
             headers: dict | None = None, stream: bool = True) -> dict:
    """One greedy ``POST /v1/completions`` (``ignore_eos``: exactly ``max_tokens`` tokens).

    Args:
        url: the server's base URL; prompt: text or token ids; max_tokens: tokens to generate;
        timeout_s: the socket timeout in seconds; model: the request's ``model``;
        headers: added to the request's; stream: streamed with ``include_usage`` (TTFT is send to
            the first streamed choice), or not (the router can resend a non-streaming request to
            another replica when its replica dies; TTFT is then the whole request's latency).

    Returns:
        ``prompt_tokens``, ``cached_tokens`` (``usage.prompt_tokens_details``), ``ttft_s``,
        ``latency_s`` (seconds) and the reply ``text``; or ``{'error': reason}`` (an HTTP error,
        an error event, a broken connection, or a stream without a choice or usage).
    """
    body = json.dumps({'model': model, 'prompt': prompt, 'max_tokens': max_tokens, 'temperature': 0,
                       'ignore_eos': True, 'stream': stream,
                       **({'stream_options': {'include_usage': True}} if stream else {})}).encode()
    req = urllib.request.Request(url + '/v1/completions', data=body,
                                 headers={'Content-Type': 'application/json', **(headers or {})})
    start, first, usage, text = time.perf_counter(), None, None, []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            if not stream:
                out = json.loads(resp.read())
                first, usage = time.perf_counter(), out.get('usage')
                text.append(out['choices'][0].get('text') or '')
            for raw in resp if stream else ():
                line = raw.decode().strip()
                if not line.startswith('data:') or line == 'data: [DONE]':
                    continue
                event = json.loads(line[5:])
                if 'error' in event:
                    return dict(error=str(event['error'])[:300])
                if event.get('choices'):
                    first = first or time.perf_counter()
                    text.append(event['choices'][0].get('text') or '')
                usage = event.get('usage') or usage
    except urllib.error.HTTPError as err:
        return dict(error=f'{err.code} {err.read()[:300]!r}')
    except (OSError, ValueError) as err:
        return dict(error=f'{type(err).__name__}: {err}')
    if usage is None or first is None:
        return dict(error='stream ended without a choice or without usage')
    details = usage.get('prompt_tokens_details') or {}
    return dict(prompt_tokens=usage['prompt_tokens'], cached_tokens=details.get('cached_tokens', 0),
                ttft_s=first - start, latency_s=time.perf_counter() - start, text=''.join(text))


def wait_store_idle(url: str, timeout_s: float = 120) -> None:
    """Wait until the server's ``/debug/ledger`` reports no in-flight Store save (so the put
    counters are final), at most ``timeout_s`` seconds; returns at once when it cannot be read."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + '/debug/ledger', timeout=10) as r:
                if not json.loads(r.read()).get('store_inflight', 0):
                    return
        except (OSError, ValueError):
            return
        time.sleep(0.05)


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in (0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]
