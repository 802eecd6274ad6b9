"""Interleaved A/B of the broadcast-form product for 25-64 float32 rows in one engine: the
engine's rule (``bcast``: :func:`~lmdeploy.pytorch.kernels.cpu_native.matmul_bcast` for 25-64
rows, a library built without AVX-512) against MKL for those rows as before (``mkl``), switched
by the row bound :func:`~lmdeploy.pytorch.kernels.cpu_native.bcast_rows` derives the window from
on every call, so one set of weights serves both and both see the same machine load.

Two measurements per round and mode:

- ``first step``: a fresh prompt of ``--prompt-len`` tokens (default 32), its prefill and first
  token, one request (the 32-row dense products of a batch-1 run's first step);
- ``decode b<N>``: the median of 8 pure-decode steps with ``N`` running sequences (``--batches``,
  default 32,48), eager (a decode graph recorded in one mode would replay its kernels in the
  other).

Usage::

    python3 benchmark/ab_bcast_rows.py --model MODEL_DIR --rounds 9 --out results/x.json

Results: best and median milliseconds per mode and the ratio mkl / bcast of the medians (above
1: the broadcast form is faster); greedy tokens of one short generation are compared between
the modes (equal or not, printed).
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import (ab_arguments, engine_decode_step_ops, engine_generate,  # noqa: E402
                                  make_engine, write_ab_results)


def run(model: str, batches: list[int], rounds: int, prompt_len: int, threads: int) -> dict:
    """``{'first_step' | 'decode_b<N>': {'bcast' | 'mkl': {'runs_ms', 'best_ms', 'median_ms'},
    'ratio': mkl median / bcast median}, 'greedy_equal': bool}``; the engine's rule is restored
    afterwards.

    Raises:
        SystemExit: the broadcast form is not built here (no native library, or an AVX-512 build).
    """
    from lmdeploy import GenerationConfig
    from lmdeploy.pytorch.kernels import cpu_native
    if not cpu_native.bcast_rows():
        raise SystemExit('the broadcast-form product is not built here (no native library, or AVX-512)')
    torch.set_num_threads(threads)
    saved = cpu_native._BCAST_MAX
    modes = {'bcast': saved, 'mkl': 0}      # the row bound: 0 leaves 25-64 rows to MKL
    engine = make_engine(model, max(batches, default=1), prompt_len + 32)
    engine.executor.worker.decode_graphs = None
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)]

    def first_step() -> float:
        engine.add_request(prompt(), GenerationConfig(max_new_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        while engine.has_work:
            engine.step()
        return took * 1e3

    out: dict = {}
    try:
        check = [prompt() for _ in range(2)]
        greedy = {}
        for mode, bound in modes.items():
            cpu_native._BCAST_MAX = bound
            greedy[mode] = engine_generate(engine, check, 8)
        out['greedy_equal'] = greedy['bcast'] == greedy['mkl']
        runs: dict = {'first_step': {m: [] for m in modes}}
        runs.update({f'decode_b{b}': {m: [] for m in modes} for b in batches})
        for r in range(rounds + 1):              # round 0 warms both modes up, untimed
            for mode, bound in modes.items():
                cpu_native._BCAST_MAX = bound
                ms = first_step()
                if r:
                    runs['first_step'][mode].append(ms)
                for b in batches:
                    _, _, seconds = engine_decode_step_ops(engine, [prompt() for _ in range(b)], 8)
                    if r:
                        runs[f'decode_b{b}'][mode].append(seconds * 1e3)
    finally:
        cpu_native._BCAST_MAX = saved
    for key, by_mode in runs.items():
        out[key] = {m: {'runs_ms': v, 'best_ms': min(v), 'median_ms': statistics.median(v)} for m, v in by_mode.items()}
        out[key]['ratio'] = out[key]['mkl']['median_ms'] / out[key]['bcast']['median_ms']
    return out


def main(argv=None) -> dict:
    args = ab_arguments(__doc__, '32,48').parse_args(argv)
    batches = [int(b) for b in args.batches.split(',') if b]
    res = run(args.model, batches, args.rounds, args.prompt_len, args.threads)
    print(f'greedy tokens equal between the modes: {res["greedy_equal"]}')
    for key, r in res.items():
        if key == 'greedy_equal':
            continue
        print(f'{key:12s}: bcast best {r["bcast"]["best_ms"]:.1f} median {r["bcast"]["median_ms"]:.1f} ms | '
              f'mkl best {r["mkl"]["best_ms"]:.1f} median {r["mkl"]["median_ms"]:.1f} ms | '
              f'mkl / bcast {r["ratio"]:.2f}')
    write_ab_results(args, res)
    return res


if __name__ == '__main__':
    main()
