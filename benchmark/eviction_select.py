"""Cost of choosing an eviction victim: the policy's heap (``select``) against a scan (``victim``).

For N published checkpoints (random sizes, reasons and hits) it times, per policy, one victim
chosen by :meth:`EvictionPolicy.select` (a lazily invalidated min-heap) and by
:meth:`EvictionPolicy.victim` (a scan of every unpinned checkpoint), each victim released and a
new checkpoint published in its place (the steady state of a full cache), and checks both pick
the same checkpoint. Prints microseconds per victim.

Usage::

    python3 benchmark/eviction_select.py --sizes 1000,10000,100000
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lmdeploy.pytorch.prefix_cache.eviction import CheckpointStats, make_policy  # noqa: E402

REASONS = ('prefill', 'prefill_last', 'shared_head', 'restored')


def _new(rng: random.Random, slot: int) -> CheckpointStats:
    return CheckpointStats(slot, 1024, rng.randint(1, 64) * 64, rng.randint(1, 400), rng.choice(REASONS),
                           rng.random() < 0.5, reached=rng.randint(0, 3), key=slot)


def measure(name: str, n: int, victims: int, scan: bool, seed: int = 0) -> tuple[float, list[int]]:
    """Microseconds per victim over ``victims`` evictions from a cache of ``n`` checkpoints, and
    the slots chosen."""
    rng = random.Random(seed)
    pol, live, clock = make_policy(name), {}, 0
    for slot in range(n):
        clock += 1
        s = _new(rng, slot)
        live[slot] = s
        pol.published(s)
        pol.rescore(s, clock)
        if rng.random() < 0.3:
            s.hits += 1
            pol.hit(s)
            pol.rescore(s, clock)
    chosen, start = [], time.perf_counter()
    for i in range(victims):
        clock += 1
        v = pol.victim(live.values(), clock) if scan else pol.select(live, lambda slot: False, clock)
        chosen.append(v.slot)
        del live[v.slot]
        pol.released(v, True)
        s = _new(rng, n + i)
        live[s.slot] = s
        pol.published(s)
        pol.rescore(s, clock)
    return (time.perf_counter() - start) / victims * 1e6, chosen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--sizes', default='1000,10000,100000', help='checkpoints in the cache')
    p.add_argument('--victims', type=int, default=200)
    args = p.parse_args(argv)
    print('policy | checkpoints | heap us/victim | scan us/victim')
    print('---|---|---|---')
    for name in ('lru', 'reuse'):
        for n in (int(x) for x in args.sizes.split(',')):
            heap_us, a = measure(name, n, args.victims, scan=False)
            scan_us, b = measure(name, n, args.victims, scan=True)
            assert a == b, 'the heap and the scan chose differently'
            print(f'{name} | {n:,} | {heap_us:.1f} | {scan_us:.1f}')


if __name__ == '__main__':
    main()
