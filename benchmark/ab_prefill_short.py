"""The first step of fresh prompts (their prefill and first token), before and after the short-prompt
prefill paths, alternating in one engine so that both see the same machine load.

``before`` runs every Gated DeltaNet prefill chunk by the unfused chunked form and the native MoE
expert layer (and the fused Qwen-MoE route) only up to 64 tokens; ``after`` is the engine as it
is (the Gated DeltaNet layer's native row-by-row step, the expert layer up to 128 tokens). The
two switch by module attributes the forward reads on every step, so one set of weights serves
both. Shapes: ``--shapes 1x32,4x32,1x1024`` (requests x prompt tokens, each request a fresh
random prompt, one new token).

With ``--threads 1`` the time is the step's CPU time on the calling thread (``time.thread_time``,
torch's one thread runs there), which other processes on a shared host disturb less than wall
time; with more threads it is wall time.

    python benchmark/ab_prefill_short.py --model MODEL_DIR --threads 1 --rounds 7 --out results/x.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import engine_generate, make_engine  # noqa: E402


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    """``'1x32,4x32'`` -> ``[(1, 32), (4, 32)]``; ValueError naming ``--shapes`` otherwise."""
    out = []
    for part in text.split(','):
        try:
            n, length = (int(v) for v in part.split('x'))
        except ValueError:
            raise ValueError(f'--shapes must be REQUESTSxTOKENS[,...], got {text!r}') from None
        if n < 1 or length < 1:
            raise ValueError(f'--shapes entries must be positive, got {part!r}')
        out.append((n, length))
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run the A/B; prints one line per shape and returns ``{shape: {variant: [ms, ...]}}``."""
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', required=True, help='a float32 Qwen3-Next-family model folder')
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--rounds', type=int, default=7, help='timed rounds per shape (after one warm-up round)')
    ap.add_argument('--shapes', default='1x32,4x32,1x1024')
    ap.add_argument('--out', default=None, help='JSON path for the per-round times (ms)')
    args = ap.parse_args(argv)
    shapes = _parse_shapes(args.shapes)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    import lmdeploy.pytorch.models.blocks.gated_delta_net as gdn
    import lmdeploy.pytorch.models.blocks.moe as moe_block
    from lmdeploy import GenerationConfig
    from lmdeploy.pytorch.kernels import cpu_native
    after = (gdn.GDN_VARLEN_TOKENS, cpu_native.NATIVE_EXPERT_TOKENS)

    def use(varlen_tokens: int, expert_tokens: int):
        gdn.GDN_VARLEN_TOKENS = varlen_tokens
        cpu_native.NATIVE_EXPERT_TOKENS = moe_block.FUSED_MOE_TOKENS = expert_tokens

    variants = {'before': lambda: use(0, 64), 'after': lambda: use(*after)}
    engine = make_engine(args.model, 16, max(length for _, length in shapes) + 8, 'float32')
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=gen).tolist()

    engine_generate(engine, [prompt(8)], 2)

    def first_step(n: int, length: int) -> float:
        for _ in range(n):
            engine.add_request(prompt(length), GenerationConfig(max_new_tokens=1, ignore_eos=True))
        start = clock()
        engine.step()
        took = clock() - start
        while engine.has_work:
            engine.step()
        return took * 1e3

    results = {}
    try:
        for n, length in shapes:
            times = {k: [] for k in variants}
            for r in range(args.rounds + 1):
                for name, switch in variants.items():
                    switch()
                    ms = first_step(n, length)
                    if r:
                        times[name].append(ms)
            results[f'{n}x{length}'] = times
            print(f'{n} x {length}: ' + '  '.join(f'{k} best {min(v):.1f} median {statistics.median(v):.1f} ms'
                                                  for k, v in times.items()), flush=True)
    finally:
        use(*after)
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(dict(threads=args.threads, rounds=args.rounds, ms=results), f, indent=1)
    return results


if __name__ == '__main__':
    main()
