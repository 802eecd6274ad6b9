"""The engine's whole decode step with this checkout's native library against one built from an
earlier ``cpu_native.c``, in alternating processes, decode graphs on, as the engine serves.

A kernel-level A/B (``ab_native_product.py``) times one product in a loop; this times what a user
gets: each measurement is a fresh process (``--child``) that loads the model into an engine, puts
the given library in place of the one the engine builds (before the engine starts, so its decode
graphs record and replay that library's kernels), runs ``--requests`` greedy requests of
``--batch`` sequences (``--prompt-len`` random tokens, ``--decode-tokens`` new, at least 6) and
reports the median ``Engine.step`` time of each request's decode steps (its first four steps left
out: the prompt, the eager first decode step and the decode graph's two recordings), the
generated tokens and the library file that ran. The parent runs ``--pairs`` pairs,
old and new, which one goes first alternating, so the machine's drift between minutes hits both
alike, and prints each pair's ratio old / new (above 1: this checkout is faster) and their
median. The two libraries must generate the same tokens (``tokens_equal``): a change of speed
only.

Usage::

    cc -O3 -march=native -fopenmp -shared -fPIC -std=gnu11 -Wno-psabi -I OLD/csrc OLD/csrc/cpu_native.c \\
        -o old.so -lm
    python3 benchmark/ab_native_library.py --old-library old.so --model MODEL_DIR --pairs 6 --batch 1

The old library must be a private file of this user's in a folder nobody else can write (it is
loaded into the child process). Needs the native library here (the child exits with a message
otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(model: str, library: str | None, batch: int, requests: int = 4, prompt_len: int = 32,
            decode_tokens: int = 48, threads: int = 2, seed: int = 0) -> dict:
    """One side of a pair, in this process: ``{'step_ms': median over the requests of each
    request's median decode step after its first four (milliseconds), 'tokens': every request's
    generated ids, 'library': the path of the native library that ran}``.
    ``library``: a native library file to run instead of the one the engine builds (None: the
    engine's own). Call it before anything in this process has started an engine.

    Raises:
        SystemExit: the native library is not built here.
        ValueError: ``decode_tokens`` < 6 (no step left to time).
    """
    if decode_tokens < 6:
        raise ValueError(f'decode_tokens must be >= 6 (the first four steps are not timed), got {decode_tokens}')
    import torch
    from lmdeploy import GenerationConfig
    from lmdeploy.pytorch.kernels import cpu_native, native_build
    sys.path.insert(0, HERE)
    from benchmark_throughput import make_engine
    torch.set_num_threads(threads)
    if cpu_native.native_library() is None:
        raise SystemExit('the native CPU kernels are not built here (no compiler, or LMDEPLOY_CPU_KERNELS=0)')
    if library:
        cpu_native._LIB = native_build.load_private(library, cpu_native._ARGTYPES, missing_ok=True)
        cpu_native._BCAST_MAX = cpu_native._LIB.lm_bcast_rows_max() if hasattr(cpu_native._LIB,
                                                                               'lm_bcast_rows_max') else 0
    engine = make_engine(model, batch, prompt_len + decode_tokens + 8)
    gen = torch.Generator().manual_seed(seed)
    with open(os.path.join(model, 'config.json')) as fh:
        config = json.load(fh)
    vocab = config.get('vocab_size') or config.get('text_config', {}).get('vocab_size') or 100
    medians, tokens = [], []
    for _ in range(requests):
        prompts = torch.randint(3, min(vocab, 1000), (batch, prompt_len), generator=gen).tolist()
        seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=decode_tokens, ignore_eos=True))
                for p in prompts]
        times = []
        while not all(s.is_finished for s in seqs):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times[4:]) * 1e3)
        tokens.append([[int(t) for t in s.token_ids[prompt_len:]] for s in seqs])
    return {'step_ms': statistics.median(medians), 'tokens': tokens, 'library': cpu_native.native_library()._name}


def _child(args, library: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), '--child', '--model', args.model, '--batch', str(args.batch),
           '--requests', str(args.requests), '--prompt-len', str(args.prompt_len), '--decode-tokens',
           str(args.decode_tokens), '--threads', str(args.threads), '--old-library', library or '']
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f'a measurement failed:\n{done.stderr[-2000:]}')
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', required=True, help='model directory')
    p.add_argument('--old-library', required=True, help='a native library built from an earlier cpu_native.c')
    p.add_argument('--pairs', type=int, default=6, help='old / new process pairs (default 6)')
    p.add_argument('--batch', type=int, default=1, help='sequences per step (default 1)')
    p.add_argument('--requests', type=int, default=4, help='requests per process (default 4)')
    p.add_argument('--prompt-len', type=int, default=32, help='prompt tokens per sequence (default 32)')
    p.add_argument('--decode-tokens', type=int, default=48, help='new tokens per sequence, >= 6 (default 48)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    if args.decode_tokens < 6:
        p.error('--decode-tokens must be >= 6 (the first four steps of a request are not timed)')
    sys.path.insert(0, HERE)
    from benchmark_throughput import write_ab_results
    if args.child:
        res = measure(args.model, args.old_library or None, args.batch, args.requests, args.prompt_len,
                      args.decode_tokens, args.threads)
        print(json.dumps(res))
        return res
    pairs = []
    for i in range(args.pairs):
        order = ('old', 'new') if i % 2 == 0 else ('new', 'old')
        got = {side: _child(args, args.old_library if side == 'old' else None) for side in order}
        pair = {'old_ms': got['old']['step_ms'], 'new_ms': got['new']['step_ms'],
                'ratio': got['old']['step_ms'] / got['new']['step_ms'],
                'old_library': got['old']['library'], 'new_library': got['new']['library'],
                'tokens_equal': got['old']['tokens'] == got['new']['tokens']}
        pairs.append(pair)
        print(f'pair {i + 1}: old {pair["old_ms"]:.2f} ms, new {pair["new_ms"]:.2f} ms, old / new {pair["ratio"]:.3f}, '
              f'tokens equal: {pair["tokens_equal"]}', flush=True)
    res = {'pairs': pairs, 'old_ms': statistics.median(q['old_ms'] for q in pairs),
           'new_ms': statistics.median(q['new_ms'] for q in pairs),
           'ratio': statistics.median(q['ratio'] for q in pairs),
           'tokens_equal': all(q['tokens_equal'] for q in pairs)}
    print(f'batch {args.batch}, {args.pairs} pairs: median step old {res["old_ms"]:.2f} ms, new {res["new_ms"]:.2f} ms; '
          f'median ratio old / new {res["ratio"]:.3f}; tokens equal in every pair: {res["tokens_equal"]}')
    write_ab_results(args, res)
    return res


if __name__ == '__main__':
    main()
