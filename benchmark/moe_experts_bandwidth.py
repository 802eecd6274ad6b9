"""Bytes read against time of the native MoE expert kernel
(:func:`~lmdeploy.pytorch.kernels.cpu_native.swiglu_experts_native`) by token count: the 99m
preset's experts (hidden 1024, expert intermediate 512, 16 experts, top-2, 8 layers, float32,
random weights) for 1-64 tokens with random routing, the token counts interleaved within each
round so machine load hits them alike. The bytes are those of the experts hit (gate/up and down
of each, once): if the kernel read an expert's weights once per token or per row block, the rate
would fall with the rows per expert while the bytes stay the same.

Usage::

    python3 benchmark/moe_experts_bandwidth.py --rounds 5 --out result.json

Prints per token count the best and median time of the 8 layers (milliseconds), the bytes and
the rate (GB/s of the best), and the rows each expert got.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def run(tokens: list[int], rounds: int, threads: int, hidden: int = 1024, inter: int = 512, experts: int = 16,
        topk: int = 2, layers: int = 8) -> dict:
    """``{tokens: {'best_ms', 'median_ms', 'bytes', 'gb_s', 'rows_per_expert'}}``.

    Raises:
        SystemExit: the native library is not built here.
    """
    from lmdeploy.pytorch.kernels import cpu_native
    if cpu_native.native_library() is None:
        raise SystemExit('the native CPU kernels are not built here (no compiler, or LMDEPLOY_CPU_KERNELS=0)')
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02 for _ in range(layers)]
    down = [torch.randn(experts, hidden, inter, generator=gen) * 0.02 for _ in range(layers)]
    cases = {}
    for t in tokens:
        index = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(t)])
        cases[t] = (torch.randn(t, hidden, generator=gen), index, torch.rand(t, topk, generator=gen))
    runs = {t: [] for t in tokens}
    with torch.inference_mode():
        for _ in range(rounds):
            for t, (x, index, weights) in cases.items():
                start = time.perf_counter()
                for layer in range(layers):
                    cpu_native.swiglu_experts_native(x, index, weights, gate_up[layer], down[layer])
                runs[t].append(time.perf_counter() - start)
    out = {}
    for t, (_, index, _) in cases.items():
        counts = torch.bincount(index.reshape(-1), minlength=experts)
        nbytes = int((counts > 0).sum()) * 3 * inter * hidden * 4 * layers
        best = min(runs[t])
        out[t] = {'best_ms': best * 1e3, 'median_ms': sorted(runs[t])[len(runs[t]) // 2] * 1e3, 'bytes': nbytes,
                  'gb_s': nbytes / best / 1e9, 'rows_per_expert': counts.tolist()}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--tokens', default='1,2,4,8,16,32,64', help='token counts, comma-separated')
    p.add_argument('--rounds', type=int, default=5, help='alternations of the token counts (default 5)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    res = run([int(t) for t in args.tokens.split(',')], args.rounds, args.threads)
    for t, r in res.items():
        print(f'{t:3d} tokens: best {r["best_ms"]:6.1f} ms (median {r["median_ms"]:6.1f}), {r["bytes"] / 1e6:4.0f} MB, '
              f'{r["gb_s"]:5.1f} GB/s, rows per expert {r["rows_per_expert"]}')
    if args.out:
        with open(args.out, 'w') as fh:
            json.dump({'args': vars(args), 'results': res}, fh, indent=1)
    return res


if __name__ == '__main__':
    main()
