"""Interleaved A/B of CPU decode graphs in one process: the same engine's pure-decode
``Engine.step`` with its decode graphs (``lmdeploy/pytorch/engine/decode_graph.py``) and with
them switched off (as ``eager_mode=True``), alternating step by step so that machine load hits
both alike. Prints per batch size and mode the median and best step time (wall and process CPU
time) over every timed step of every round, and the graph cache's counters and bytes.

Usage::

    python3 benchmark/ab_decode_graph.py --preset 99m --batches 1,4,16 --rounds 3 --steps 12 --threads 2

The model is ``benchmark_throughput.py``'s ``--preset`` (Qwen3-Next proportions, random weights)
or ``--model DIR``; float32 on the CPU.
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
from benchmark_throughput import make_engine, prepare_model  # noqa: E402


def alternating_steps(engine, prompts: list[list[int]], warm: int, timed: int) -> dict[str, tuple[list, list]]:
    """Wall and process CPU seconds of ``2 * timed`` pure-decode ``Engine.step`` calls with
    ``len(prompts)`` running sequences, after their prefill and ``warm`` untimed decode steps
    with graphs on: step by step, graphs on and off in turn (the same sequences; both modes give
    the same tokens), so that load from other processes hits both alike. CPU time (every thread
    of this process) is less disturbed than wall time by other processes taking the cores,
    though not by their use of memory bandwidth. Returns ``{mode: (wall, cpu)}``."""
    from lmdeploy import GenerationConfig
    worker = engine.executor.worker
    graphs = worker.decode_graphs
    seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=warm + 2 * timed + 2, ignore_eos=True))
            for p in prompts]
    while any(s.num_generated == 0 for s in seqs):
        engine.step()
    for _ in range(warm):
        engine.step()
    out = {'graph': ([], []), 'eager': ([], [])}
    for i in range(2 * timed):
        mode = 'graph' if i % 2 == 0 else 'eager'
        worker.decode_graphs = graphs if mode == 'graph' else None
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        out[mode][0].append(time.perf_counter() - t)
        out[mode][1].append(time.process_time() - c)
    worker.decode_graphs = graphs
    while not all(s.is_finished for s in seqs):
        engine.step()
    return out


def _summary(values: list[float]) -> dict:
    ms = sorted(v * 1e3 for v in values)
    return {'best_ms': round(ms[0], 3), 'median_ms': round(ms[len(ms) // 2], 3), 'n': len(ms)}


def run(model: str, batches: list[int], rounds: int, warm: int, timed: int, threads: int) -> dict:
    """``{batch: {mode: {'wall': {'best_ms', 'median_ms', 'n'}, 'cpu': ...}}, 'counters': ...,
    'graph_bytes': ...}`` for the modes ``graph`` and ``eager`` over every timed step of every
    round (milliseconds; ``cpu``: process CPU time)."""
    torch.set_num_threads(threads)
    engine = make_engine(model, max(batches), 32 + warm + 2 * timed + 8)
    graphs = engine.executor.worker.decode_graphs
    if graphs is None:
        raise SystemExit('this engine has no decode graphs (not a CPU tp=1 engine?)')
    rng = random.Random(0)
    out = {}
    for batch in batches:
        prompts = [[rng.randrange(5, 200) for _ in range(32)] for _ in range(batch)]
        steps = {'graph': ([], []), 'eager': ([], [])}
        for _ in range(rounds):
            for mode, (wall, cpu) in alternating_steps(engine, prompts, warm, timed).items():
                steps[mode][0].extend(wall)
                steps[mode][1].extend(cpu)
        out[batch] = {m: {'wall': _summary(w), 'cpu': _summary(c)} for m, (w, c) in steps.items()}
        g, e = out[batch]['graph'], out[batch]['eager']
        print(f'batch {batch:3d}: median wall graph {g["wall"]["median_ms"]:.2f} eager {e["wall"]["median_ms"]:.2f} '
              f'ms ({e["wall"]["median_ms"] / g["wall"]["median_ms"]:.3f}x), cpu graph {g["cpu"]["median_ms"]:.2f} '
              f'eager {e["cpu"]["median_ms"]:.2f} ms ({e["cpu"]["median_ms"] / g["cpu"]["median_ms"]:.3f}x); best wall '
              f'{g["wall"]["best_ms"]:.2f} / {e["wall"]["best_ms"]:.2f} ms', flush=True)
    out['counters'] = graphs.counters()
    out['graph_bytes'] = {str(k[0]): g.held_bytes() for k, g in graphs.graphs.items() if g.state == 'ready'}
    print('graph cache:', out['counters'], 'bytes held per ready graph by batch:', out['graph_bytes'])
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--preset', default='99m', help="benchmark_throughput.py preset (default 99m)")
    p.add_argument('--model', default=None, help='a model directory instead of the preset')
    p.add_argument('--batches', default='1,4,16', help='running sequences per step, comma-separated')
    p.add_argument('--rounds', type=int, default=3, help='rounds of requests per batch size (default 3)')
    p.add_argument('--warm', type=int, default=3, help='untimed decode steps first (a key\'s first step runs '
                   'eagerly, its 2nd and 3rd are recorded; default 3)')
    p.add_argument('--steps', type=int, default=12, help='timed decode steps per mode per round (default 12)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--save-model', default=None, help='write the preset model here (reused when present)')
    p.add_argument('--json', default=None, help='write the results here')
    args = p.parse_args(argv)
    if args.model is None and args.save_model and os.path.exists(os.path.join(args.save_model, 'config.json')):
        args.model = args.save_model
    model = prepare_model(argparse.Namespace(model=args.model, arch=None, width_scale=1, preset=args.preset,
                                             save_model=args.save_model))
    out = run(model, [int(b) for b in args.batches.split(',')], args.rounds, args.warm, args.steps, args.threads)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'preset': args.preset if args.model is None else args.model, 'threads': args.threads,
                       'rounds': args.rounds, 'steps': args.steps, 'results': out}, f, indent=1)
    return out


if __name__ == '__main__':
    main()
