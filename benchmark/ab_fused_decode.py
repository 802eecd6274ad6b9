"""Interleaved A/B of fused CPU decode ops in one process: the same engine's pure-decode step
with the ops registered (fused) and with them taken out of the kernel registry (the blocks then
run their unfused paths, as before the ops existed), alternating, so machine load hits both
alike. Prints, per mode, the torch ops and native calls of one step and the best and median
step time over the rounds (each round's time is the median of its timed steps; on a loaded
machine read the best, or time with ``--clock cpu``: the process's CPU seconds, which other
processes' load adds to only through shared caches and memory bandwidth; with ``--threads 1``
that is the step's compute time).

Usage::

    python3 benchmark/ab_fused_decode.py --arch kimi_linear --batches 1,16 --rounds 9

The model is ``benchmark_throughput.py``'s ``--arch`` model (random weights, the family's
``tiny_config`` widths times ``--width-scale``); float32 on the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import engine_decode_step_ops, make_engine, prepare_model  # noqa: E402

# the fused decode ops of the MLA step, the DeepSeek-V3 router and the attention prologue
DEFAULT_OPS = ('mla_decode', 'group_limited_route', 'qk_norm_rope_store')


@contextlib.contextmanager
def unfused(ops: tuple[str, ...]):
    """The kernel registry without ``ops`` (and no cached choices) inside the block; restored after."""
    from lmdeploy.pytorch import kernels
    chosen, registry = dict(kernels._CHOSEN), dict(kernels._REGISTRY)
    kernels._CHOSEN.clear()
    for op in ops:
        kernels._REGISTRY.pop(op, None)
    try:
        yield
    finally:
        kernels._REGISTRY.update(registry)
        kernels._CHOSEN.clear()
        kernels._CHOSEN.update(chosen)


def run(arch: str, width_scale: int, batches: list[int], rounds: int, steps: int, ops: tuple[str, ...],
        threads: int, clock: str = 'wall') -> dict:
    """``{batch: {mode: {'ops', 'native', 'best_ms', 'median_ms' (over the rounds), 'runs_ms'}}}``
    for the modes ``fused`` and ``unfused``, alternating within each round (milliseconds)."""
    torch.set_num_threads(threads)
    model = prepare_model(argparse.Namespace(model=None, arch=arch, width_scale=width_scale, preset=None,
                                             save_model=None))
    engine = make_engine(model, max(batches), 32 + steps + 8)
    # eager forwards: a decode graph recorded in one mode would replay its kernels in the other
    engine.executor.worker.decode_graphs = None
    rng = random.Random(0)
    out = {}
    for batch in batches:
        prompts = [[rng.randrange(5, 200) for _ in range(32)] for _ in range(batch)]
        runs = {'fused': [], 'unfused': []}
        counts = {}
        for _ in range(rounds):
            for mode in ('fused', 'unfused'):
                with unfused(ops) if mode == 'unfused' else contextlib.nullcontext():
                    n, native, seconds = engine_decode_step_ops(
                        engine, prompts, steps, time.process_time if clock == 'cpu' else time.perf_counter)
                counts[mode] = (n, native)
                runs[mode].append(seconds * 1e3)
        out[batch] = {m: {'ops': counts[m][0], 'native': counts[m][1], 'runs_ms': runs[m], 'best_ms': min(runs[m]),
                          'median_ms': sorted(runs[m])[len(runs[m]) // 2]} for m in runs}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--arch', required=True, help='a registered family (make-tiny-model --arch)')
    p.add_argument('--width-scale', type=int, default=4, help='multiplier of the tiny_config widths (default 4)')
    p.add_argument('--batches', default='1,16', help='running sequences per step, comma-separated (default 1,16)')
    p.add_argument('--rounds', type=int, default=9, help='alternations of the two modes (default 9)')
    p.add_argument('--steps', type=int, default=8, help='timed decode steps per measurement (median; default 8)')
    p.add_argument('--ops', default=','.join(DEFAULT_OPS), help='registry ops taken out in the unfused mode')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--clock', choices=('wall', 'cpu'), default='wall',
                   help="step time: wall clock, or this process's CPU seconds (default wall)")
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    res = run(args.arch, args.width_scale, [int(b) for b in args.batches.split(',')], args.rounds, args.steps,
              tuple(o for o in args.ops.split(',') if o), args.threads, args.clock)
    for batch, modes in res.items():
        f, u = modes['fused'], modes['unfused']
        print(f'batch {batch:3d}: fused best {f["best_ms"]:.2f} ms (median {f["median_ms"]:.2f}), {f["ops"]} ops '
              f'({f["native"]} native) | unfused best {u["best_ms"]:.2f} ms (median {u["median_ms"]:.2f}), '
              f'{u["ops"]} ops ({u["native"]} native) | unfused / fused, best {u["best_ms"] / f["best_ms"]:.2f}x')
    if args.out:
        with open(args.out, 'w') as fh:
            json.dump({'args': vars(args), 'results': res}, fh, indent=1)
    return res


if __name__ == '__main__':
    main()
