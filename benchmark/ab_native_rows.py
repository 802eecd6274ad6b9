"""Interleaved A/B of the dense-product kernel choice in one process: the same engine's
pure-decode step with 1-24 float32 rows on the native few-row product (the engine's rule), and
with 1-3 rows on MKL as before (:data:`~lmdeploy.pytorch.kernels.cpu_native.NATIVE_ROWS` set to
4-24), and optionally with a native library built from an earlier ``cpu_native.c`` (same entry
points) under the earlier rule, alternating, so machine load hits every mode alike. Prints, per
mode, the torch ops and native calls of one step and the best and median step time over the
rounds (each round's time is the median of its timed steps; on a loaded machine read the best).

Usage::

    python3 benchmark/ab_native_rows.py --model MODEL_DIR --batches 1,4,16 --rounds 9
    # an earlier kernel: build it with the engine's flags, then pass it
    cc -O3 -march=native -fopenmp -shared -fPIC -std=gnu11 -I OLD/csrc OLD/csrc/cpu_native.c -o old.so -lm
    python3 benchmark/ab_native_rows.py --model MODEL_DIR --old-library old.so

``--arch`` instead of ``--model`` makes ``benchmark_throughput.py``'s random model of that family
(its ``tiny_config`` widths times ``--width-scale``). float32 on the CPU; needs the native
library (exits with a message otherwise). The old library must be a private file of this user's
in a folder nobody else can write (it is loaded into this process).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import engine_decode_step_ops, make_engine, prepare_model  # noqa: E402


def modes(old_library: str | None) -> dict:
    """``{mode: (library, native rows, broadcast-form row bound)}``: ``native_1_24`` (the engine's
    rule), ``mkl_1_3`` (1-3 rows on MKL), and ``old_4_24`` (the earlier library and rule) when
    ``old_library`` is given (bound 0 for a library without the broadcast-form product).

    Raises:
        SystemExit: the native library is not built here.
    """
    from lmdeploy.pytorch.kernels import cpu_native, native_build
    lib = cpu_native.native_library()
    if lib is None:
        raise SystemExit('the native CPU kernels are not built here (no compiler, or LMDEPLOY_CPU_KERNELS=0)')
    bound = cpu_native._BCAST_MAX
    out = {'native_1_24': (lib, range(1, 25), bound), 'mkl_1_3': (lib, range(4, 25), bound)}
    if old_library:
        old = native_build.load_private(old_library, cpu_native._ARGTYPES, missing_ok=True)
        # a library from before the broadcast-form product leaves 25-64 rows to MKL
        out['old_4_24'] = (old, range(4, 25), old.lm_bcast_rows_max() if hasattr(old, 'lm_bcast_rows_max') else 0)
    return out


def run(model: str, batches: list[int], rounds: int, steps: int, threads: int,
        old_library: str | None = None) -> dict:
    """``{batch: {mode: {'ops', 'native', 'best_ms', 'median_ms' (over the rounds), 'runs_ms'}}}``
    for :func:`modes`, alternating within each round (milliseconds); the engine's own library and
    rule are restored afterwards."""
    from lmdeploy.pytorch.kernels import cpu_native
    from lmdeploy.pytorch.kernels import linear as linear_mod
    torch.set_num_threads(threads)
    ways = modes(old_library)
    engine = make_engine(model, max(batches), 32 + steps + 8)
    # eager forwards: a decode graph recorded in one mode would replay its kernels in the other
    engine.executor.worker.decode_graphs = None
    rng = random.Random(0)
    out = {}
    saved = cpu_native._LIB, linear_mod.NATIVE_ROWS, cpu_native._BCAST_MAX
    try:
        for batch in batches:
            prompts = [[rng.randrange(5, 200) for _ in range(32)] for _ in range(batch)]
            runs = {m: [] for m in ways}
            counts = {}
            for _ in range(rounds):
                for mode, (lib, rows, bound) in ways.items():
                    cpu_native._LIB, linear_mod.NATIVE_ROWS, cpu_native._BCAST_MAX = lib, rows, bound
                    n, native, seconds = engine_decode_step_ops(engine, prompts, steps)
                    counts[mode] = (n, native)
                    runs[mode].append(seconds * 1e3)
            out[batch] = {m: {'ops': counts[m][0], 'native': counts[m][1], 'runs_ms': runs[m],
                              'best_ms': min(runs[m]), 'median_ms': sorted(runs[m])[len(runs[m]) // 2]} for m in runs}
    finally:
        cpu_native._LIB, linear_mod.NATIVE_ROWS, cpu_native._BCAST_MAX = saved
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', help='model directory')
    p.add_argument('--arch', help='instead of --model: a random model of this registered family')
    p.add_argument('--width-scale', type=int, default=4, help='--arch: multiplier of the tiny_config widths')
    p.add_argument('--batches', default='1,4,16', help='running sequences per step, comma-separated')
    p.add_argument('--rounds', type=int, default=9, help='alternations of the modes (default 9)')
    p.add_argument('--steps', type=int, default=8, help='timed decode steps per measurement (median; default 8)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--old-library', help='a native library built from an earlier cpu_native.c')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.arch):
        p.error('give one of --model and --arch')
    model = prepare_model(argparse.Namespace(model=args.model, arch=args.arch, width_scale=args.width_scale,
                                             preset=None, save_model=None))
    res = run(model, [int(b) for b in args.batches.split(',')], args.rounds, args.steps, args.threads,
              args.old_library)
    for batch, by_mode in res.items():
        ref = by_mode['native_1_24']['best_ms']
        print(f'batch {batch:3d}: ' + ' | '.join(
            f'{m} best {r["best_ms"]:.2f} ms (median {r["median_ms"]:.2f}, x{r["best_ms"] / ref:.2f}), {r["ops"]} ops '
            f'({r["native"]} native)' for m, r in by_mode.items()))
    if args.out:
        with open(args.out, 'w') as fh:
            json.dump({'args': vars(args), 'results': res}, fh, indent=1)
    return res


if __name__ == '__main__':
    main()
