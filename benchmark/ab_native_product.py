"""The native few-row product (``lm_matmul_rows``) of this checkout against a library built from
an earlier ``cpu_native.c``, interleaved in one process, per row count and weight shape; and the
two checked bit for bit equal on every shape timed.

Each measurement is one pass over as many ``[N, K]`` float32 weights as fill ``--megabytes``
(so they stream from memory, as a decode step's do), ``--rounds`` times per library, the two
alternating (and which goes first alternating), so the machine's drift hits both alike. It
prints the weight bytes read per second (median over the rounds) and the ratio new / old.

Usage::

    cc -O3 -march=native -fopenmp -shared -fPIC -std=gnu11 -Wno-psabi -I OLD/csrc OLD/csrc/cpu_native.c \\
        -o old.so -lm
    python3 benchmark/ab_native_product.py --old-library old.so --rows 1,2,3,4,8,16,24 \\
        --shapes 3088x1024,1024x512 --threads 2

The old library must be a private file of this user's in a folder nobody else can write (it is
loaded into this process). Needs the native library here (exits with a message otherwise).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _product(lib, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    M, K = x.shape
    N = w.shape[0]
    lib.lm_matmul_rows(x.data_ptr(), M, K, K, w.data_ptr(), N, K, y.data_ptr(), N, threads)


def run(old_library: str, rows: list[int], shapes: list[tuple[int, int]], rounds: int = 11, threads: int = 2,
        megabytes: int = 96, seed: int = 0) -> list[dict]:
    """``[{'N', 'K', 'rows', 'old_gbs', 'new_gbs', 'ratio', 'equal'}]``: GB/s of weights read
    (medians over ``rounds``), ``ratio`` = new / old, ``equal``: the two libraries' outputs are
    bit for bit the same on this shape.

    Raises:
        SystemExit: the native library is not built here.
    """
    from lmdeploy.pytorch.kernels import cpu_native, native_build
    new = cpu_native.native_library()
    if new is None:
        raise SystemExit('the native CPU kernels are not built here (no compiler, or LMDEPLOY_CPU_KERNELS=0)')
    old = native_build.load_private(old_library, cpu_native._ARGTYPES, missing_ok=True)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for N, K in shapes:
        count = max(2, megabytes * 2**20 // (N * K * 4))
        weights = [torch.randn(N, K, generator=gen) for _ in range(count)]
        for M in rows:
            x = torch.randn(M, K, generator=gen)
            y_old, y_new = torch.empty(M, N), torch.empty(M, N)
            _product(old, x, weights[0], y_old, threads)
            _product(new, x, weights[0], y_new, threads)
            seconds = {'old': [], 'new': []}
            for r in range(rounds):
                for name in (('old', 'new') if r % 2 == 0 else ('new', 'old')):
                    lib, y = (old, y_old) if name == 'old' else (new, y_new)
                    start = time.perf_counter()
                    for w in weights:
                        _product(lib, x, w, y, threads)
                    seconds[name].append(time.perf_counter() - start)
            read = N * K * 4 * count
            old_s, new_s = statistics.median(seconds['old']), statistics.median(seconds['new'])
            out.append({'N': N, 'K': K, 'rows': M, 'old_gbs': read / old_s / 1e9, 'new_gbs': read / new_s / 1e9,
                        'ratio': old_s / new_s, 'equal': bool(torch.equal(y_old, y_new))})
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--old-library', required=True, help='a native library built from an earlier cpu_native.c')
    p.add_argument('--rows', default='1,2,3,4,8,16,24', help='input rows, comma-separated')
    p.add_argument('--shapes', default='3088x1024,1024x512', help='weight shapes NxK, comma-separated')
    p.add_argument('--rounds', type=int, default=11, help='passes per library and shape (default 11)')
    p.add_argument('--threads', type=int, default=2, help='threads of the product (default 2)')
    p.add_argument('--megabytes', type=int, default=96, help='weight bytes per pass (default 96 MB)')
    p.add_argument('--out', help='write the results as JSON here')
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(',') if r]
        shapes = [tuple(int(v) for v in s.lower().split('x')) for s in args.shapes.split(',') if s]
    except ValueError:
        p.error('--rows: integers; --shapes: NxK pairs, e.g. 3088x1024')
    if not rows or min(rows) < 1 or any(len(s) != 2 or min(s) < 1 for s in shapes) or args.rounds < 1:
        p.error('--rows and the shapes must be positive, --rounds >= 1')
    torch.set_num_threads(args.threads)
    res = run(args.old_library, rows, shapes, args.rounds, args.threads, args.megabytes)
    for r in res:
        print(f'[{r["N"]}, {r["K"]}] x {r["rows"]:2d} rows: old {r["old_gbs"]:5.1f} GB/s, new {r["new_gbs"]:5.1f} GB/s, '
              f'new / old {r["ratio"]:.2f}, bit for bit equal: {r["equal"]}')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(res, f, indent=1)
        print(f'wrote {args.out}')
    return res


if __name__ == '__main__':
    main()
