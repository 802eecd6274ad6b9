"""Engine step time with and without the ``file:`` Store, replaying a trace on a small device budget.

``/metrics`` exposes TTFT and time-per-output-token histograms, not the engine step, so this
benchmark drives :class:`~lmdeploy.pytorch.engine.engine.Engine` in-process (a tiny random-weight
Qwen3-Next on the CPU unless ``--model-path``) and times every ``Engine.step()``. The replay loop
is the cache-only simulator's (``benchmark/trace_sim.py``): ``--concurrency`` requests in flight,
admitted in trace order before each step, each prompt made by ``traces.prompt_tokens`` at
``--scale`` (the model's plain token ids; prompts share tokens exactly where the simulator's
do) and generating ``min(output_length / scale, --max-output)`` tokens (at least 1). So
the engine schedules exactly what the simulator schedules, and every request's hit can be
compared with the simulator's unlimited cache at the same geometry.

Configurations (one engine each, same trace and budget):

- ``none``: the device budget alone (``cache_bytes`` = ``--budget`` x the unlimited cache's peak
  bytes, plus the runtime state slots);
- ``file``: the same budget and a ``file:DIR`` Store (``--store-writers`` writers).

Printed per configuration: steps, step p50 / p99 / max (ms), hit tokens and % of the unlimited
cache, and **recomputed saved prefixes**: requests that hit fewer tokens than the unlimited cache
(a prefix this engine had saved — kept, queued or stored — computed again); with the Store every
saved prefix is reachable, so this should be 0 (a prefix whose put is still queued is restored
from the queued payload). Also the Store's dropped puts and put objects.

Step times follow the machine's load: on a shared machine run ``--configs none`` and
``--configs file`` as two processes at the same time, so both see the same load.

Usage::

    python3 benchmark/trace_step_time.py --trace TRACE.jsonl --limit 300 --budget 0.125
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.benchmark_trace import token_range  # noqa: E402
from benchmark.trace_sim import simulate_trace  # noqa: E402
from benchmark.traces import load_trace, prompt_tokens  # noqa: E402

# the seed geometry (B = 64, A = 1024, P = 8192) divided by the default scale 32
GEOMETRY = dict(block_size=16, alignment=64, chunk=256)


def _percentile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


def replay(model: str, rows, *, scale: int, concurrency: int, max_output: int, cache_bytes: int,
           store_dir: str | None, writers: int, eviction: str, tokens: tuple[int, int]) -> dict:
    """One engine over ``rows`` (see the module docstring); returns its measurements.

    Returns:
        dict: ``steps``, ``p50_ms``, ``p99_ms``, ``max_ms`` (``Engine.step()`` wall time),
        ``hits`` (per request, trace order), ``num_gpu_blocks``, the Store counters
        ``dropped`` and ``put_objects``. ``tokens``: ``[lo, hi)`` of the prompts' token ids.
    """
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    cfg = dict(device_type='cpu', dtype='float32', block_size=GEOMETRY['block_size'],
               prefill_save_alignment=GEOMETRY['alignment'], max_prefill_token_num=GEOMETRY['chunk'],
               prefill_save_last_only=True, enable_prefix_caching=True, cache_bytes=cache_bytes,
               max_batch_size=concurrency, cache_eviction=eviction)
    if store_dir is not None:
        cfg.update(store_backend=f'file:{store_dir}', store_writers=writers)
    eng = Engine(model, PytorchEngineConfig(**cfg))
    steps, hits, in_flight, nxt = [], [0] * len(rows), {}, 0
    try:
        while nxt < len(rows) or eng.has_work:
            while nxt < len(rows) and len(in_flight) < concurrency:
                r = rows[nxt]
                gen = GenerationConfig(max_new_tokens=max(1, min(r.output_length // scale, max_output)),
                                       ignore_eos=True)
                ids = prompt_tokens(r, scale, vocab_size=tokens[1], lo=tokens[0])
                in_flight[nxt] = eng.add_request(ids, gen)
                nxt += 1
            start = time.perf_counter()
            eng.step()
            steps.append((time.perf_counter() - start) * 1e3)
            for i, seq in list(in_flight.items()):
                if seq.is_finished:
                    hits[i] = seq.num_cached_tokens
                    del in_flight[i]
        stats = eng.stats()
        blocks = eng.block_manager.num_blocks
    finally:
        eng.close()
    steps.sort()
    return dict(steps=len(steps), p50_ms=statistics.median(steps), p99_ms=_percentile(steps, 0.99),
                max_ms=steps[-1], hits=hits, num_gpu_blocks=blocks, dropped=stats['store_dropped_puts'],
                put_objects=sum(stats['store_put_objects'].values()))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--trace', required=True, type=Path)
    p.add_argument('--limit', type=int, default=200, help='replay the first N requests')
    p.add_argument('--scale', type=int, default=32, help='512 trace tokens -> 512/scale')
    p.add_argument('--budget', type=float, default=0.125, help="fraction of the unlimited cache's peak bytes")
    p.add_argument('--concurrency', type=int, default=4)
    p.add_argument('--max-output', type=int, default=4, help='generated tokens per request at most')
    p.add_argument('--store-writers', type=int, default=2)
    p.add_argument('--eviction', default='reuse', choices=('reuse', 'lru'))
    p.add_argument('--configs', default='none,file', help='none and/or file')
    p.add_argument('--model-path', help='model directory (default: a tiny Qwen3-Next made on the fly)')
    p.add_argument('--json', type=Path, help='write the results here')
    args = p.parse_args(argv)
    rows = load_trace(args.trace)[:args.limit]
    with tempfile.TemporaryDirectory(prefix='lmdeploy-step-time-') as tmp:
        model = args.model_path
        if model is None:
            from lmdeploy.tools.make_tiny_model import make_tiny_model
            model = make_tiny_model(str(Path(tmp) / 'model'), arch='qwen3_next', seed=0)
        from lmdeploy import PytorchEngineConfig
        from lmdeploy.pytorch.engine.engine import Engine
        probe = Engine(model, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                  block_size=GEOMETRY['block_size'], max_batch_size=1))
        S, K = probe.cache_engine.state_bytes, probe.cache_engine.kv_block_bytes
        probe.close()
        sim = dict(state_bytes=S, kv_block_bytes=K, save_policy='last_only', concurrency=args.concurrency,
                   scale=args.scale, max_output=args.max_output, **GEOMETRY)
        ideal = simulate_trace(rows, **sim)
        # the budget of the simulator's rows, plus the runtime slots the engine also takes from it
        cache_bytes = int(ideal.peak_bytes * args.budget) + args.concurrency * S
        print(f'{len(rows)} requests at scale {args.scale}; S = {S} B, K_blk = {K} B; unlimited cache: '
              f'{ideal.hit_tokens} hit tokens of {ideal.prompt_tokens}, peak {ideal.peak_bytes} B; '
              f'budget {args.budget} -> cache_bytes {cache_bytes}', flush=True)
        results = []
        for config in [c.strip() for c in args.configs.split(',') if c.strip()]:
            store = str(Path(tmp) / f'store-{config}') if config == 'file' else None
            r = replay(model, rows, scale=args.scale, concurrency=args.concurrency, max_output=args.max_output,
                       cache_bytes=cache_bytes, store_dir=store, writers=args.store_writers, eviction=args.eviction,
                       tokens=token_range(model))
            short = [i for i, (a, b) in enumerate(zip(r['hits'], ideal.per_request_hit_tokens)) if a < b]
            r.update(config=config, hit_tokens=sum(r['hits']), ideal=ideal.hit_tokens,
                     pct_ideal=100.0 * sum(r['hits']) / max(ideal.hit_tokens, 1), recomputed=len(short),
                     recomputed_tokens=sum(ideal.per_request_hit_tokens[i] - r['hits'][i] for i in short))
            results.append(r)
            print(f"{config:5s} steps {r['steps']}  step p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms  "
                  f"max {r['max_ms']:.1f} ms  hit {r['hit_tokens']} ({r['pct_ideal']:.1f} % of unlimited)  "
                  f"recomputed saved prefixes {r['recomputed']} ({r['recomputed_tokens']} tokens)  "
                  f"dropped puts {r['dropped']}  put objects {r['put_objects']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != 'hits'} for r in results], indent=1))
    return results


if __name__ == '__main__':
    main()
