"""Interleaved A/B of CPU weights in 2 MiB huge pages (``lmdeploy.pytorch.host_memory``, the
default) against ordinary 4 KiB pages (``LMDEPLOY_HUGE_PAGES=0``).

Three measurements:

1. **Steps**: two engines on the same model in one process, one loaded each way, whose
   pure-decode ``Engine.step`` is timed alternately (``benchmark_throughput.engine_decode_step_ops``:
   the median of ``--steps`` steps), the order flipped every round so drift hits both alike;
   best and median over the rounds per batch size.
2. **GEMV bandwidth**: ``step_bytes.measure_gemv_bandwidths`` on a matrix in a huge-page arena
   and on an ordinary one, alternating, per round.
3. **Loading** (``--load-rounds``): fresh processes that load the model one way or the other,
   alternating; each prints its peak RSS (``VmHWM``: anonymous memory plus the checkpoint's
   mapped file pages), its anonymous RSS after loading, its ``AnonHugePages`` and the load time.

Each engine's weights are checked for huge pages (``AnonHugePages`` of the mappings holding its
parameters, over their bytes) and the two engines' greedy tokens compared.

Usage::

    python3 benchmark/ab_huge_pages.py --model /work/llama/model_99m --batches 1,4 --rounds 9 \\
        --load-rounds 3 --out benchmark/results/ab_huge_pages_99m.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import engine_decode_step_ops, engine_generate, make_engine  # noqa: E402
from step_bytes import measure_gemv_bandwidths  # noqa: E402

MODES = ('huge', 'plain')

_LOAD_CHILD = r'''
import os, resource, sys, time
from lmdeploy.pytorch.models.loader import load_model
t = time.perf_counter()
m = load_model(sys.argv[1], progress=False)
seconds = time.perf_counter() - t
status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)
rollup = dict(l.split(':', 1) for l in open('/proc/self/smaps_rollup') if ':' in l and not l[0].isdigit())
kb = lambda d, k: int(d[k].split()[0])
print(seconds, kb(status, 'VmHWM'), kb(status, 'RssAnon'), kb(rollup, 'AnonHugePages'))
'''


def _mappings() -> list[tuple[int, int, int]]:
    """``(start, end, AnonHugePages bytes)`` of every mapping of this process."""
    out, cur = [], None
    with open('/proc/self/smaps') as f:
        for line in f:
            head = line.split(None, 1)[0]
            if '-' in head and not head.endswith(':'):
                lo, _, hi = head.partition('-')
                cur = [int(lo, 16), int(hi, 16), 0]
                out.append(cur)
            elif head == 'AnonHugePages:' and cur is not None:
                cur[2] = int(line.split()[1]) * 1024
    return [tuple(m) for m in out]


def huge_fraction(model: torch.nn.Module) -> float:
    """``AnonHugePages`` of the mappings holding ``model``'s parameters over the parameters' bytes
    (about 1.0 when every weight is in huge pages; a mapping shared with other data counts whole)."""
    maps = _mappings()
    hit, nbytes = set(), 0
    for p in model.parameters():
        nbytes += p.numel() * p.element_size()
        hit.update(m for m in maps if m[0] <= p.data_ptr() < m[1])
    return sum(m[2] for m in hit) / max(nbytes, 1)


def load_engine(model: str, mode: str, max_batch: int, max_len: int):
    """An engine whose weights were loaded with huge pages (``'huge'``) or without (``'plain'``)."""
    old = os.environ.get('LMDEPLOY_HUGE_PAGES')
    os.environ['LMDEPLOY_HUGE_PAGES'] = '1' if mode == 'huge' else '0'
    try:
        return make_engine(model, max_batch, max_len)
    finally:
        if old is None:
            del os.environ['LMDEPLOY_HUGE_PAGES']
        else:
            os.environ['LMDEPLOY_HUGE_PAGES'] = old


def _stats(runs: list[float], best=min) -> dict:
    return {'runs': runs, 'best': best(runs), 'median': statistics.median(runs)}


def run_steps(model: str, batches: list[int], rounds: int, steps: int, threads: int) -> dict:
    """``{'huge_fraction': {mode: f}, 'greedy_equal': bool, 'steps_ms': {batch: {mode: stats}},
    'gemv_gb_s': {mode: {'native': stats, 'torch': stats}}}``, modes alternating in each round."""
    torch.set_num_threads(threads)
    engines = {m: load_engine(model, m, max(batches), 32 + steps + 8) for m in MODES}
    out = {'huge_fraction': {m: huge_fraction(e.executor.worker.model) for m, e in engines.items()}}
    rng = random.Random(0)
    probe = [[rng.randrange(5, 200) for _ in range(32)]]
    tokens = {m: engine_generate(e, probe, 8) for m, e in engines.items()}
    out['greedy_equal'] = tokens['huge'] == tokens['plain']
    steps_ms = {b: {m: [] for m in MODES} for b in batches}
    gemv = {m: {'native': [], 'torch': []} for m in MODES}
    for r in range(rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for b in batches:
            prompts = [[rng.randrange(5, 200) for _ in range(32)] for _ in range(b)]
            for m in order:
                steps_ms[b][m].append(engine_decode_step_ops(engines[m], prompts, steps)[2] * 1e3)
        for m in order:
            bw = measure_gemv_bandwidths(threads, megabytes=256, repeats=3, huge_pages=m == 'huge')
            gemv[m]['torch'].append(bw.torch / 1e9)
            gemv[m]['native'].append((bw.native or 0.0) / 1e9)
        print(f'round {r}: ' + ' | '.join(f'b{b} ' + ' '.join(f'{m} {steps_ms[b][m][-1]:.2f}' for m in MODES)
                                          for b in batches)
              + ' | gemv native ' + ' '.join(f'{m} {gemv[m]["native"][-1]:.1f}' for m in MODES), flush=True)
    out['steps_ms'] = {b: {m: _stats(v) for m, v in by.items()} for b, by in steps_ms.items()}
    out['gemv_gb_s'] = {m: {k: _stats(v, max) for k, v in by.items()} for m, by in gemv.items()}
    return out


def run_loads(model: str, rounds: int) -> dict:
    """``{mode: [{'seconds', 'peak_rss_mib', 'rss_anon_mib', 'anon_huge_mib'}]}``, one fresh process
    per load, modes alternating."""
    out = {m: [] for m in MODES}
    for r in range(rounds):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            env = {**os.environ, 'LMDEPLOY_HUGE_PAGES': '1' if m == 'huge' else '0'}
            words = subprocess.run([sys.executable, '-c', _LOAD_CHILD, model], env=env, check=True,
                                   capture_output=True, text=True).stdout.split()
            seconds, hwm, anon, huge = float(words[0]), *(int(w) / 1024 for w in words[1:])
            out[m].append({'seconds': seconds, 'peak_rss_mib': hwm, 'rss_anon_mib': anon, 'anon_huge_mib': huge})
            print(f'load {m}: {seconds:.2f} s, peak RSS {hwm:.0f} MiB, anon RSS {anon:.0f} MiB, '
                  f'AnonHugePages {huge:.0f} MiB', flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', required=True, help='model directory')
    p.add_argument('--batches', default='1,4', help='running sequences per step, comma-separated')
    p.add_argument('--rounds', type=int, default=9, help='alternations of the two engines (default 9)')
    p.add_argument('--steps', type=int, default=8, help='timed decode steps per measurement (median; default 8)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--load-rounds', type=int, default=0, help='fresh-process loads per mode (default 0: none)')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    started = time.time()
    res = {'args': vars(args), 'load_avg_start': os.getloadavg()}
    if args.load_rounds:
        res['loads'] = run_loads(args.model, args.load_rounds)
    if args.rounds:
        res.update(run_steps(args.model, [int(b) for b in args.batches.split(',')], args.rounds, args.steps,
                             args.threads))
        print('weights in huge pages:', {m: round(f, 3) for m, f in res['huge_fraction'].items()},
              '| greedy equal:', res['greedy_equal'])
        for b, by in res['steps_ms'].items():
            print(f'batch {b}: ' + ' | '.join(f'{m} best {s["best"]:.2f} ms median {s["median"]:.2f}'
                                              for m, s in by.items()))
        for m, by in res['gemv_gb_s'].items():
            print(f'gemv {m}: ' + ' | '.join(f'{k} best {s["best"]:.1f} GB/s median {s["median"]:.1f}'
                                             for k, s in by.items()))
    res['load_avg_end'] = os.getloadavg()
    res['seconds'] = time.time() - started
    if args.out:
        with open(args.out, 'w') as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == '__main__':
    main()
