"""One engine in its own process, for the cross-process Store tests (tests/test_store_engine.py).

Usage: ``python3 tests/store_worker.py JOB.json RESULT.json``

JOB.json may also hold a list of jobs: they run one after another in this one process (one
interpreter start and torch import for all; tests/test_store_fresh_process.py), RESULT.json is
the list of their results, and a job that raises gives ``{"error": traceback}`` in its place
without stopping the others.

The job names a model, an engine config (passed to :class:`PytorchEngineConfig` as is, so it
carries the Mooncake master and metadata server) and a conversation: ``history`` (token ids
already said, may be empty) followed by ``turns``, each a list of new user token ids. Fault and
race tests add: ``barrier`` ({"dir", "parties"}: start the turns only once that many workers
have built their engines), ``hold_puts_s`` (every Store put waits until that many seconds after
the start, so workers that all found a key absent put it at once) and ``die_at_put`` (kill the
process by SIGKILL in the middle of its n-th Store put, 0-based). Image tests add ``multimodal``
(a ``torch.save`` file of a tuple of :class:`MultimodalInput`, passed with every turn; their
spans are absolute positions, so they stay valid as the conversation grows). Turn
``t``'s input is the previous turn's input plus its greedy reply plus ``turns[t]``. One new
engine (so an empty local cache) serves the turns in order, waiting for its Store puts after
each, and the worker writes one record per turn plus the engine's counters to RESULT.json::

    {"turns": [{"num_tokens", "cached_tokens", "store_hit_tokens", "local_hit_tokens",
                "save_points", "output_ids"}, ...],
     "history": [...final token ids...], "stats": {...engine.stats()...}, "idle": bool}

Exit code 0 only when every turn finished and the engine was idle afterwards (for a list: for
every job). The parent
process is the only reader; nothing here talks to anything but the master named in the job.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault('MC_TCP_BIND_ADDRESS', '127.0.0.1')   # before Mooncake is imported


def _die_mid_put(client, n: int) -> None:
    """Make the ``n``-th Store put (0-based) start and then kill this process (SIGKILL) before
    it ends: what a writer killed mid-put leaves behind. Mooncake: a started, never ended put
    (the key stays incomplete); a folder: half of the value in a temporary file."""
    put, count = client.put, [0]

    def put_then_die(key, value, **kw):
        if count[0] == n:
            if hasattr(client, 'begin_torn_write'):
                client.begin_torn_write(key, value)
            else:
                client._store.batch_put_session_start([key], [memoryview(value).nbytes])
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1
        return put(key, value, **kw)

    client.put = put_then_die
    put_many = getattr(client, 'put_many', None)
    if put_many is None:
        return

    def put_many_then_die(items):
        # the items before the n-th complete; the n-th starts and the process dies in it
        if count[0] <= n < count[0] + len(items):
            done = items[:n - count[0]]
            if done:
                put_many(done)
            key, value, _ = items[n - count[0]]
            count[0] = n
            put_then_die(key, value)
        count[0] += len(items)
        return put_many(items)

    client.put_many = put_many_then_die


def _barrier(folder: Path, parties: int, timeout_s: float = 300.0) -> None:
    """Wait until ``parties`` workers have reached this point (one ready file each)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f'{os.getpid()}.ready').touch()
    deadline = time.time() + timeout_s
    while len(list(folder.glob('*.ready'))) < parties and time.time() < deadline:
        time.sleep(0.02)


def _hold_puts(client, until: float) -> None:
    """Make the first Store put wait until the Unix time ``until``: the save's existence check has
    run by then, so workers held to one moment put the keys they all found absent at once."""
    put = client.put

    def held_put(key, value, **kw):
        time.sleep(max(0.0, until - time.time()))
        return put(key, value, **kw)

    client.put = held_put


def serve(job: dict) -> dict:
    """Run ``job``'s conversation on a new engine; returns the RESULT.json content."""
    import torch

    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine

    torch.set_num_threads(1)   # tiny model on a shared machine: extra threads only spin
    engine = Engine(job['model'], PytorchEngineConfig(**job['config']))
    if job.get('barrier'):              # {"dir", "parties"}: start together with the other workers
        _barrier(Path(job['barrier']['dir']), job['barrier']['parties'])
    if job.get('hold_puts_s'):
        _hold_puts(engine.store.client, time.time() + job['hold_puts_s'])
    if job.get('die_at_put') is not None:
        _die_mid_put(engine.store.client, job['die_at_put'])
    gen = GenerationConfig(max_new_tokens=job['max_new_tokens'], ignore_eos=True)
    ids = list(job['history'])
    multimodal = torch.load(job['multimodal'], weights_only=False) if job.get('multimodal') else ()
    turns = []
    try:
        for user in job['turns']:
            ids = ids + list(user)
            seq = engine.generate(ids, gen, multimodal=multimodal)
            engine.store.flush()
            turns.append(dict(num_tokens=len(ids), cached_tokens=seq.num_cached_tokens,
                              store_hit_tokens=seq.stats.store_hit_tokens, local_hit_tokens=seq.stats.hit_tokens,
                              save_points=list(seq.stats.plans[0].save_points), output_ids=seq.output_ids))
            ids = list(seq.token_ids)
        return dict(turns=turns, history=ids, stats=engine.stats(), idle=engine.is_idle())
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split('\n\n')[1], file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    if isinstance(job, list):
        results = [_serve_or_report(one) for one in job]
        Path(argv[2]).write_text(json.dumps(results))
        return 0 if all(r.get('idle') for r in results) else 1
    result = serve(job)
    Path(argv[2]).write_text(json.dumps(result))
    return 0 if result['idle'] else 1


def _serve_or_report(job: dict) -> dict:
    """:func:`serve`, or ``{"error": traceback}``: one failing job of a list leaves the others'
    results intact, so each test reports its own family."""
    import traceback
    try:
        return serve(job)
    except Exception:       # noqa: BLE001 - reported to the parent test, which fails on it
        return dict(error=traceback.format_exc())


if __name__ == '__main__':
    sys.exit(main(sys.argv))
