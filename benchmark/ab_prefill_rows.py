"""Interleaved A/B of the few-row product's row window on the prefill of one short prompt, in one
process: the same engine prefills a fresh ``--prompt-len``-token prompt (32: the batch-1 decode
row of ``benchmark_throughput.py``) with the native product for 1-24 rows
(:data:`~lmdeploy.pytorch.kernels.cpu_native.FEW_ROWS`) and for 1-64 rows
(:data:`~lmdeploy.pytorch.kernels.cpu_native.MKL_SLOW_ROWS`), alternating, so machine load hits
both modes alike. Every prompt is new random tokens (no prefix-cache hit). Prints the best and
median prefill time (milliseconds) of each mode over the rounds and which rule this host uses.

Usage::

    python3 benchmark/ab_prefill_rows.py --model MODEL_DIR --rounds 15 --out result.json

float32 on the CPU; needs the native library (exits with a message otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import make_engine  # noqa: E402


def prefill_seconds(engine, prompt: list[int]) -> float:
    """Wall seconds of the engine step that prefills ``prompt`` (one new token asked for); the
    request is run to its end afterwards."""
    from lmdeploy import GenerationConfig
    seq = engine.add_request(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t
    while not seq.is_finished:
        engine.step()
    return seconds


def run(model: str, prompt_len: int, rounds: int, threads: int) -> dict:
    """``{mode: {'best_ms', 'median_ms', 'runs_ms'}}`` for the modes ``rows_1_24`` and
    ``rows_1_64``, alternating within each round; the engine's rule is restored afterwards."""
    from lmdeploy.pytorch.kernels import cpu_native
    from lmdeploy.pytorch.kernels import linear as linear_mod
    if cpu_native.native_library() is None:
        raise SystemExit('the native CPU kernels are not built here (no compiler, or LMDEPLOY_CPU_KERNELS=0)')
    torch.set_num_threads(threads)
    engine = make_engine(model, 1, prompt_len + 8)
    rng = random.Random(0)
    ways = {'rows_1_24': cpu_native.FEW_ROWS, 'rows_1_64': cpu_native.MKL_SLOW_ROWS}
    runs = {m: [] for m in ways}
    saved = linear_mod.NATIVE_ROWS
    try:
        prefill_seconds(engine, [rng.randrange(5, 200) for _ in range(prompt_len)])    # warm-up
        for _ in range(rounds):
            for mode, rows in ways.items():
                linear_mod.NATIVE_ROWS = rows
                prompt = [rng.randrange(5, 200) for _ in range(prompt_len)]
                runs[mode].append(prefill_seconds(engine, prompt) * 1e3)
    finally:
        linear_mod.NATIVE_ROWS = saved
    return {m: {'best_ms': min(r), 'median_ms': sorted(r)[len(r) // 2], 'runs_ms': r} for m, r in runs.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', required=True, help='model directory')
    p.add_argument('--prompt-len', type=int, default=32, help='prompt tokens (default 32)')
    p.add_argument('--rounds', type=int, default=15, help='alternations of the modes (default 15)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    from lmdeploy.pytorch.kernels import cpu_native
    res = run(args.model, args.prompt_len, args.rounds, args.threads)
    rule = cpu_native.host_native_rows()
    print(f'host: {cpu_native.cpu_vendor() or "?"}, rule rows {rule.start}-{rule.stop - 1}')
    for mode, r in res.items():
        print(f'{mode}: best {r["best_ms"]:.1f} ms, median {r["median_ms"]:.1f} ms')
    if args.out:
        with open(args.out, 'w') as fh:
            json.dump({'args': vars(args), 'host_rows': [rule.start, rule.stop - 1], 'results': res}, fh, indent=1)
    return res


if __name__ == '__main__':
    main()
