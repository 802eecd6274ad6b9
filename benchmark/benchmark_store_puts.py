"""Store write-path throughput and the engine step time it costs.

Two measurements, printed as tables (and written as JSON with ``--out``):

1. **Puts per second** of the Store tier (:class:`StoreTier`) for each backend — a ``file:DIR``
   folder (write + fsync + link + folder fsync per object; one fsync per batch where the
   backend has ``put_many``) and a Mooncake Store with embedded services (one
   ``mooncake_master``, metadata server and segment owner on 127.0.0.1) — with 1 writer and
   with N writers. ``--saves`` save jobs of distinct prefixes, each ``--blocks`` new KV blocks
   of ``--kv-bytes`` plus one ``--state-bytes`` state, are submitted at once (the queue is made
   large enough that none is dropped); the clock runs from the first submit to the end of
   :meth:`StoreTier.flush`. objects/s = objects put / that time.
2. **Engine step time** (p50 / p99 of ``Engine.step()``, milliseconds) over a workload of
   ``--requests`` requests of ``--prompt`` tokens (two save points each) on the tiny hybrid
   Qwen3-Next (CPU), without the Store, and with a ``file:DIR`` Store with 1 and N writers;
   also the time per step the engine thread spent inside the Store tier (``submit``, ``probe``,
   ``load``: p50 and max, milliseconds), the saves it dropped (``store_dropped_puts``) and the
   objects put.

Usage::

    python benchmark/benchmark_store_puts.py                       # both tables
    python benchmark/benchmark_store_puts.py --writers 8 --saves 400 --out results/store_puts.json
    python benchmark/benchmark_store_puts.py --skip-mooncake       # no mooncake_master binary

Needs the ``mooncake_master`` binary for the Mooncake rows (``pip install -r requirements/store.txt``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault('MC_TCP_BIND_ADDRESS', '127.0.0.1')

from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes  # noqa: E402
from lmdeploy.pytorch.prefix_cache.plans import StorePut  # noqa: E402
from lmdeploy.pytorch.prefix_cache.store_tier import StoreTier  # noqa: E402
from lmdeploy.pytorch.store.object_format import OBJECT_OVERHEAD  # noqa: E402

B = 16


class _Payloads:
    """A cache-engine stand-in producing payloads of the benchmark's sizes (bytes)."""

    def __init__(self, kv_bytes: int, state_bytes: int):
        self.kv_block_bytes, self.state_bytes = kv_bytes, state_bytes

    def read_kv_blocks(self, ids):
        return torch.randint(0, 256, (len(ids), self.kv_block_bytes), dtype=torch.uint8)

    def read_state(self, slot):
        return torch.randint(0, 256, (self.state_bytes, ), dtype=torch.uint8)


def _open_backend(kind: str, folder: Path, object_bytes: int, writers: int):
    """``(client, services)`` for ``'file'`` or ``'mooncake'`` (embedded services; the local
    buffer sized as the engine sizes it: room for every writer's put plus one read)."""
    if kind == 'file':
        from lmdeploy.pytorch.store.file_backend import FileStore
        return FileStore(folder), None
    from lmdeploy.pytorch.store.mooncake_client import StoreClient, buffer_bytes_needed
    from lmdeploy.pytorch.store.services import MooncakeServices
    services = MooncakeServices(segment_size=1 << 30).start()
    need = buffer_bytes_needed(object_bytes)
    buffer = max(64 << 20, need * (writers + 1))
    client = StoreClient.connect(services.master_address, services.metadata_server, local_buffer_size=buffer,
                                 max_transfers=buffer // need)
    return client, services


def measure_puts(kind: str, writers: int, saves: int, blocks: int, kv_bytes: int, state_bytes: int) -> dict:
    """One puts-per-second row (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix='lmdeploy-store-bench-') as tmp:
        client, services = _open_backend(kind, Path(tmp), max(kv_bytes, state_bytes) + OBJECT_OVERHEAD, writers)
        tier = StoreTier(client, _Payloads(kv_bytes, state_bytes), os.urandom(16), B, queue_size=saves + 1,
                         services=services, writers=writers)
        try:
            puts = []
            for i in range(saves):
                ids = torch.randint(0, 1 << 30, (blocks * B, )).tolist()
                hashes = chain_block_hashes(ids, B, blocks)
                puts.append(StorePut(hashes, list(range(blocks)), blocks * B, 0))
            start = time.perf_counter()
            for put in puts:
                tier.submit(put)
            assert tier.flush(timeout=600), 'saves did not finish'
            elapsed = time.perf_counter() - start
            stats = tier.stats()
        finally:
            tier.close()
    objects = stats['store_put_objects']['kv'] + stats['store_put_objects']['state']
    return dict(backend='file:DIR' if kind == 'file' else 'mooncake (embedded)', writers=writers,
                put_many=kind == 'file' and hasattr(client, 'put_many'), objects=objects, seconds=elapsed,
                objects_per_s=objects / elapsed,
                mb_per_s=(stats['store_put_bytes']['kv'] + stats['store_put_bytes']['state']) / elapsed / 1e6,
                failures=stats['store_put_failures'], dropped=stats['store_dropped_puts'])


def measure_steps(model: str, label: str, store: str | None, writers: int, requests: int, prompt: int,
                  queue_size: int) -> dict:
    """Step-time percentiles of one engine configuration (see the module docstring)."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix='lmdeploy-store-bench-') as tmp:
        cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=64,
                   max_prefill_token_num=64, enable_prefix_caching=True, num_gpu_blocks=512,
                   num_checkpoint_slots=16, max_batch_size=8)
        if store == 'file':
            cfg.update(store_backend=f'file:{tmp}', store_writers=writers, store_queue_size=queue_size)
        eng = Engine(model, PytorchEngineConfig(**cfg))
        steps, in_store = [], []
        spent = [0.0]
        if eng.store is not None:       # time the engine thread spends inside the Store tier
            for name in ('submit', 'probe', 'load'):
                def timed(*a, _f=getattr(eng.store, name), **kw):
                    t = time.perf_counter()
                    try:
                        return _f(*a, **kw)
                    finally:
                        spent[0] += time.perf_counter() - t
                setattr(eng.store, name, timed)
        try:
            g = torch.Generator().manual_seed(0)
            for _ in range(requests):
                eng.add_request(torch.randint(10, 200, (prompt, ), generator=g).tolist(), gen)
            while eng.has_work:
                start, spent[0] = time.perf_counter(), 0.0
                eng.step()
                steps.append((time.perf_counter() - start) * 1e3)
                in_store.append(spent[0] * 1e3)
            stats = eng.stats()
            if eng.store is not None:
                eng.store.flush(timeout=600)
        finally:
            eng.close()
    steps.sort()
    in_store.sort()
    return dict(config=label, steps=len(steps), p50_ms=statistics.median(steps),
                p99_ms=steps[min(len(steps) - 1, int(0.99 * len(steps)))], max_ms=steps[-1],
                store_p50_ms=statistics.median(in_store), store_max_ms=in_store[-1],
                dropped=stats['store_dropped_puts'], put_objects=sum(stats['store_put_objects'].values()))


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = ' | '.join(name for name, _, _ in cols)
    lines = [head, ' | '.join('---' for _ in cols)]
    for row in rows:
        lines.append(' | '.join(format(row[key], fmt) for _, key, fmt in cols))
    return '\n'.join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--writers', type=int, default=4, help='N of the N-writer rows')
    p.add_argument('--saves', type=int, default=200, help='save jobs per puts/s row')
    p.add_argument('--blocks', type=int, default=4, help='new KV blocks per save job')
    p.add_argument('--kv-bytes', type=int, default=64 << 10, help='bytes of one KV block payload')
    p.add_argument('--state-bytes', type=int, default=1 << 20, help='bytes of one state payload')
    p.add_argument('--requests', type=int, default=48, help='requests of the step-time workload')
    p.add_argument('--prompt', type=int, default=150, help='prompt tokens of each of those requests')
    p.add_argument('--queue-size', type=int, default=64, help='store_queue_size of the step-time engines')
    p.add_argument('--skip-mooncake', action='store_true', help='only the file:DIR rows')
    p.add_argument('--skip-steps', action='store_true', help='only the puts/s table')
    p.add_argument('--skip-puts', action='store_true', help='only the step-time table')
    p.add_argument('--out', help='write both tables as JSON here')
    args = p.parse_args(argv)

    kinds = ['file'] + ([] if args.skip_mooncake else ['mooncake'])
    puts = [] if args.skip_puts else [measure_puts(kind, w, args.saves, args.blocks, args.kv_bytes, args.state_bytes)
                                      for kind in kinds for w in (1, args.writers)]
    if puts:
        print(f'\nStore puts ({args.saves} saves x ({args.blocks} KV blocks of {args.kv_bytes} B + 1 state of '
              f'{args.state_bytes} B))\n')
        print(_table(puts, [('backend', 'backend', ''), ('writers', 'writers', 'd'), ('put_many', 'put_many', ''),
                            ('objects', 'objects', 'd'), ('s', 'seconds', '.2f'),
                            ('objects/s', 'objects_per_s', '.0f'), ('MB/s', 'mb_per_s', '.1f'),
                            ('failures', 'failures', 'd')]))
    steps = []
    if not args.skip_steps:
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        with tempfile.TemporaryDirectory(prefix='lmdeploy-tiny-') as tmp:
            model = make_tiny_model(tmp, arch='qwen3_next', seed=0)
            for label, store, w in (('no Store', None, 1), ('file:DIR, 1 writer', 'file', 1),
                                    (f'file:DIR, {args.writers} writers', 'file', args.writers)):
                steps.append(measure_steps(model, label, store, w, args.requests, args.prompt, args.queue_size))
        print(f'\nEngine step time (tiny Qwen3-Next, CPU, {args.requests} requests of {args.prompt} tokens, '
              f'store_queue_size {args.queue_size})\n')
        print(_table(steps, [('config', 'config', ''), ('steps', 'steps', 'd'), ('p50 ms', 'p50_ms', '.2f'),
                             ('p99 ms', 'p99_ms', '.2f'), ('max ms', 'max_ms', '.2f'),
                             ('in Store p50 ms', 'store_p50_ms', '.3f'), ('in Store max ms', 'store_max_ms', '.3f'),
                             ('dropped', 'dropped', 'd'),
                             ('objects put', 'put_objects', 'd')]))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), puts=puts, steps=steps), indent=1))


if __name__ == '__main__':
    main()
