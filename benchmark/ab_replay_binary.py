"""Interleaved A/B of the decode graph's native sums and products in one engine: replays that run
same-shape float32 adds and products as one native call each (``native``: the engine's rule,
:data:`~lmdeploy.pytorch.engine.decode_graph._NATIVE_BINARY`) against replays that run them as
torch ops (``torch``). The rule is read when a graph is recorded, so each mode clears the graphs
and records its own before it is timed; both modes share the weights and the minutes.

Per round, batch and mode: ``B`` fresh prompts of ``--prompt-len`` tokens, their prefill, the
graph's eager and recorded steps, then ``--steps`` replayed decode steps, timed one by one (the
median counts; the engine's replay counter must have grown by every timed step).

Usage::

    python3 benchmark/ab_replay_binary.py --model MODEL_DIR --batches 1,4 --rounds 9 --out results/x.json

Results: per batch and mode each round's median step (ms), the median of those, and the ratio
torch / native (above 1: the native calls are faster); the greedy tokens of one generation per
mode are compared (equal or not, printed).
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import ab_arguments, engine_generate, make_engine, write_ab_results  # noqa: E402

#: eager, recorded and the first replayed steps of a new graph before any step is timed
_WARM_STEPS = 4


def run(model: str, batches: list[int], rounds: int, steps: int, prompt_len: int, threads: int) -> dict:
    """``{'decode_b<N>': {'native' | 'torch': {'runs_ms', 'median_ms'}, 'ratio': torch median /
    native median}, 'greedy_equal': bool}``; the engine's rule is restored afterwards.

    Raises:
        SystemExit: the engine keeps no decode graphs here (no native library).
    """
    from lmdeploy import GenerationConfig
    from lmdeploy.pytorch.engine import decode_graph
    torch.set_num_threads(threads)
    engine = make_engine(model, max(batches, default=1), prompt_len + _WARM_STEPS + steps + 2)
    graphs = engine.executor.worker.decode_graphs
    if graphs is None:
        raise SystemExit('no decode graphs here (they need the native CPU kernels)')
    saved = decode_graph._NATIVE_BINARY
    modes = {'native': saved, 'torch': {}}
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)]

    def decode_ms(batch: int) -> float:
        gen = GenerationConfig(max_new_tokens=_WARM_STEPS + steps + 1, ignore_eos=True)
        seqs = [engine.add_request(prompt(), gen) for _ in range(batch)]
        while not all(s.num_generated for s in seqs):    # prefill: every prompt has its first token
            engine.step()
        for _ in range(_WARM_STEPS):
            engine.step()
        replays, times = graphs.replays, []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        if graphs.replays - replays != steps:
            raise RuntimeError(f'{graphs.replays - replays} of {steps} timed steps were replays')
        while engine.has_work:
            engine.step()
        return statistics.median(times) * 1e3

    out: dict = {}
    runs = {f'decode_b{b}': {m: [] for m in modes} for b in batches}
    try:
        check = [prompt() for _ in range(2)]
        greedy = {}
        for mode, rule in modes.items():
            decode_graph._NATIVE_BINARY = rule
            graphs.clear()
            greedy[mode] = engine_generate(engine, check, _WARM_STEPS + 8)
        out['greedy_equal'] = greedy['native'] == greedy['torch']
        for r in range(rounds + 1):              # round 0 warms both modes up, untimed
            for mode, rule in (modes.items() if r % 2 else reversed(modes.items())):
                decode_graph._NATIVE_BINARY = rule
                for b in batches:
                    graphs.clear()
                    ms = decode_ms(b)
                    if r:
                        runs[f'decode_b{b}'][mode].append(ms)
    finally:
        decode_graph._NATIVE_BINARY = saved
        graphs.clear()
    for key, by_mode in runs.items():
        out[key] = {m: {'runs_ms': v, 'median_ms': statistics.median(v)} for m, v in by_mode.items()}
        out[key]['ratio'] = out[key]['torch']['median_ms'] / out[key]['native']['median_ms']
    return out


def main(argv=None) -> dict:
    p = ab_arguments(__doc__, '1,4')
    p.add_argument('--steps', type=int, default=24, help='timed replayed steps per round and mode (default 24)')
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(',') if b]
    res = run(args.model, batches, args.rounds, args.steps, args.prompt_len, args.threads)
    print(f'greedy tokens equal between the modes: {res["greedy_equal"]}')
    for key, r in res.items():
        if key != 'greedy_equal':
            print(f'{key:12s}: native median {r["native"]["median_ms"]:.2f} ms | torch median '
                  f'{r["torch"]["median_ms"]:.2f} ms | torch / native {r["ratio"]:.3f}')
    write_ab_results(args, res)
    return res


if __name__ == '__main__':
    main()
