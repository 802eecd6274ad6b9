"""The engine against llama.cpp in interleaved pairs: engine, then ``llama-batched-bench``, then
the engine again, ... so each engine run has a llama.cpp run of the same minute beside it.

``benchmark_throughput.py`` reports each system's median over its repeats; on a shared VM the
machine's speed drifts by tens of percent from one minute to the next, and three repeats of each
system do not sample the same minutes. Here every pair is one engine run (``--prompt-len``
tokens, ``--decode-tokens`` new, greedy, timed around the engine's steps) and one llama.cpp run
of the same shape (``-npl N -npp <prompt-len> -ntg <decode-tokens - 1>``, llama.cpp's own timer,
model loading excluded), and the figure is the median over the pairs of llama.cpp's seconds
over the engine's (above 1: the engine is faster). Nothing else runs in the process
(transformers is not loaded).

Each pair is also split in two, each part with its own ratio: the **prompt** (the engine's first
step, which runs the prompts' forward and samples the first token, against llama.cpp's ``t_pp``)
and the **decode** (the engine's later steps against ``t_tg``). With a 32-token prompt the first
step costs several decode steps, so the split says which part a whole-run ratio comes from.

For each engine run it also records every step's wall and process CPU time, and counts the
**stalls**: steps after the first two that took more than ``--stall-factor`` times the run's
median step. A stall whose wall time is well above its CPU time was spent waiting: with two
threads on two cores, the main thread waits at an OpenMP barrier while the other thread is off
its core (see ``benchmark/README.md``, "Issue 45, ninth session").

Usage::

    python3 benchmark/ab_llama_pairs.py --model MODEL_DIR --gguf MODEL.gguf \\
        --llama-batched-bench PATH --pairs 15 --batch 1

Results: a table on stdout and, with ``--out``, JSON (every pair's seconds and stalls).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import make_engine  # noqa: E402
from throughput_measure import LlamaCpp  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def engine_run(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One engine run: ``{'wall_s', 'steps': [[wall_s, cpu_s], ...]}`` (every ``Engine.step``;
    wall seconds over the whole run, requests added inside the timing)."""
    from lmdeploy import GenerationConfig
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    steps = []
    start = time.perf_counter()
    seqs = [engine.add_request(p, gen) for p in prompts]
    while not all(s.is_finished for s in seqs):
        c0, t0 = _cpu_s(), time.perf_counter()
        engine.step()
        steps.append([time.perf_counter() - t0, _cpu_s() - c0])
    return {'wall_s': time.perf_counter() - start, 'steps': steps}


def stalls(steps: list[list[float]], factor: float) -> list[list[float]]:
    """The ``[wall_s, cpu_s]`` of the steps after the first two (the prefill and the first
    decode step, slower by design) whose wall time exceeds ``factor`` times the median step's."""
    later = steps[2:]
    if not later:
        return []
    median = statistics.median(s[0] for s in later)
    return [s for s in later if s[0] > factor * median]


def run(model: str, llama: LlamaCpp, pairs: int, batch: int, prompt_len: int, decode_tokens: int,
        threads: int, stall_factor: float = 3.0, seed: int = 0) -> dict:
    """``pairs`` interleaved (engine, llama.cpp) runs after one untimed engine run of the same
    shape (the decode graph of this batch is recorded there).

    Returns:
        ``{'pairs': [{'engine_s', 'llama_s', 'ratio', 'engine_step_ms', 'engine_prompt_s',
        'llama_prompt_s', 'prompt_ratio', 'engine_decode_s', 'llama_decode_s', 'decode_ratio',
        'stalls'}], 'ratio' / 'prompt_ratio' / 'decode_ratio' / 'engine_s' / 'llama_s': {'min',
        'median', 'max'}}``; a ratio is llama.cpp seconds / engine seconds (``decode_ratio`` None
        where llama.cpp reported no ``t_tg``).

    Raises:
        SystemExit: llama.cpp is unavailable (its note), or a llama.cpp run failed.
    """
    if not llama.available:
        raise SystemExit(f'llama.cpp: {llama.note}')
    torch.set_num_threads(threads)
    engine = make_engine(model, batch, prompt_len + decode_tokens + 8)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size

    def prompts():
        return torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()

    engine_run(engine, prompts(), decode_tokens)          # warm-up: the first steps of this shape
    rows = []
    for _ in range(pairs):
        e = engine_run(engine, prompts(), decode_tokens)
        lc = llama.decode(batch, prompt_len, decode_tokens)
        if lc is None:
            raise SystemExit(f'llama.cpp: {llama.note}')
        later = [s[0] for s in e['steps'][2:]] or [s[0] for s in e['steps']]
        first_s, decode_s = e['steps'][0][0], sum(s[0] for s in e['steps'][1:])
        rows.append({'engine_s': e['wall_s'], 'llama_s': lc['wall_s'], 'ratio': lc['wall_s'] / e['wall_s'],
                     'engine_step_ms': statistics.median(later) * 1e3,
                     'engine_prompt_s': first_s, 'llama_prompt_s': lc['prefill_s'],
                     'prompt_ratio': lc['prefill_s'] / first_s,
                     'engine_decode_s': decode_s, 'llama_decode_s': lc['decode_s'],
                     'decode_ratio': None if not lc['decode_s'] or not decode_s else lc['decode_s'] / decode_s,
                     'stalls': stalls(e['steps'], stall_factor)})

    def spread(key):
        v = [r[key] for r in rows if r[key] is not None]
        return {'min': min(v), 'median': statistics.median(v), 'max': max(v)} if v else None
    return {'model': model, 'batch': batch, 'prompt_len': prompt_len, 'decode_tokens': decode_tokens,
            'threads': threads, 'stall_factor': stall_factor, 'pairs': rows, 'ratio': spread('ratio'),
            'engine_s': spread('engine_s'), 'llama_s': spread('llama_s'), 'prompt_ratio': spread('prompt_ratio'),
            'decode_ratio': spread('decode_ratio')}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', required=True, help='model directory (the weights the GGUF was made from)')
    p.add_argument('--gguf', required=True, help='the same weights as GGUF (benchmark/make_gguf.py)')
    p.add_argument('--llama-batched-bench', help='path of llama-batched-bench (default: on PATH)')
    p.add_argument('--pairs', type=int, default=15, help='interleaved (engine, llama.cpp) pairs (default 15)')
    p.add_argument('--batch', type=int, default=1, help='concurrent requests (default 1)')
    p.add_argument('--prompt-len', type=int, default=32, help='prompt tokens per request (default 32)')
    p.add_argument('--decode-tokens', type=int, default=32, help='new tokens per request (default 32)')
    p.add_argument('--threads', type=int, default=2, help='engine and llama.cpp threads (default 2)')
    p.add_argument('--stall-factor', type=float, default=3.0, help='a stall: a step over this many median '
                   'steps (default 3)')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    if args.pairs < 1 or args.batch < 1 or args.prompt_len < 1 or args.decode_tokens < 2:
        p.error('--pairs, --batch and --prompt-len must be >= 1, --decode-tokens >= 2')
    llama = LlamaCpp(args.llama_batched_bench, args.gguf, args.threads)
    res = run(args.model, llama, args.pairs, args.batch, args.prompt_len, args.decode_tokens, args.threads,
              args.stall_factor)
    for i, r in enumerate(res['pairs']):
        worst = max((s[0] for s in r['stalls']), default=0.0)
        print(f'pair {i + 1:2d}: engine {r["engine_s"] * 1e3:6.0f} ms (step {r["engine_step_ms"]:.1f} ms, '
              f'{len(r["stalls"])} stalls, worst {worst * 1e3:.0f} ms) | llama.cpp {r["llama_s"] * 1e3:6.0f} ms | '
              f'llama.cpp / engine {r["ratio"]:.2f} (prompt {r["engine_prompt_s"] * 1e3:.0f} / '
              f'{r["llama_prompt_s"] * 1e3:.0f} ms)')
    for key, what in (('ratio', 'whole run'), ('prompt_ratio', 'prompt'), ('decode_ratio', 'decode')):
        if (q := res[key]) is not None:
            print(f'batch {args.batch}, {what}: llama.cpp seconds / engine seconds over {args.pairs} pairs: median '
                  f'{q["median"]:.2f} (min {q["min"]:.2f}, max {q["max"]:.2f})')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(res, f, indent=1)
        print(f'wrote {args.out}')
    return res


if __name__ == '__main__':
    main()
