"""One engine in its own process, for the cross-process Store tests (tests/test_store_engine.py).

Usage: ``python3 tests/store_worker.py JOB.json RESULT.json``

The job names a model, an engine config (passed to :class:`PytorchEngineConfig` as is, so it
carries the Mooncake master and metadata server) and a conversation: ``history`` (token ids
already said, may be empty) followed by ``turns``, each a list of new user token ids. Turn
``t``'s input is the previous turn's input plus its greedy reply plus ``turns[t]``. One new
engine (so an empty local cache) serves the turns in order, waiting for its Store puts after
each, and the worker writes one record per turn plus the engine's counters to RESULT.json::

    {"turns": [{"num_tokens", "cached_tokens", "store_hit_tokens", "local_hit_tokens",
                "save_points", "output_ids"}, ...],
     "history": [...final token ids...], "stats": {...engine.stats()...}, "idle": bool}

Exit code 0 only when every turn finished and the engine was idle afterwards. The parent
process is the only reader; nothing here talks to anything but the master named in the job.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault('MC_TCP_BIND_ADDRESS', '127.0.0.1')   # before Mooncake is imported


def serve(job: dict) -> dict:
    """Run ``job``'s conversation on a new engine; returns the RESULT.json content."""
    import torch

    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine

    torch.set_num_threads(1)   # tiny model on a shared machine: extra threads only spin
    engine = Engine(job['model'], PytorchEngineConfig(**job['config']))
    gen = GenerationConfig(max_new_tokens=job['max_new_tokens'], ignore_eos=True)
    ids = list(job['history'])
    turns = []
    try:
        for user in job['turns']:
            ids = ids + list(user)
            seq = engine.generate(ids, gen)
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
    result = serve(job)
    Path(argv[2]).write_text(json.dumps(result))
    return 0 if result['idle'] else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv))
