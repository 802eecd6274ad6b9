"""A writer killed mid-put never blocks a prefix (real ``mooncake_master`` on 127.0.0.1).

A writer process is killed in the middle of one of its Store puts, at a random point of its
saves: the put has started (Mooncake reserved the key) and never ends, so the key stays
incomplete: existence checks report it absent while a plain put of it reports success. The
next engine that computes the prefix detects the disagreement, counts it
(``store_repaired_objects``) and replaces the object, so a fresh engine after it restores the
whole prefix, with the cold output.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

WORKER = Path(__file__).with_name('store_worker.py')
B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=4, ignore_eos=True)
PUTS = 10          # a fresh 150-token prompt: KV 0-3, state 64, KV 4-7, state 128


def store_config(services, namespace: str) -> dict:
    return dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
                enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
                mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
                mooncake_local_buffer_size=1 << 20, store_namespace=namespace)


def kill_writer_mid_put(tmp_path: Path, model: str, config: dict, ids: list[int], die_at: int) -> None:
    job, out = tmp_path / 'writer.json', tmp_path / 'writer.out.json'
    job.write_text(json.dumps(dict(model=model, config=config, history=[], turns=[ids],
                                   max_new_tokens=GEN.max_new_tokens, die_at_put=die_at)))
    env = dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1')
    proc = subprocess.run([sys.executable, str(WORKER), str(job), str(out)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not out.exists()


@pytest.fixture(scope='module')
def cold(tiny_qwen3_next):
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                                      max_prefill_token_num=P))
    yield lambda ids: eng.generate(ids, GEN).output_ids
    eng.close()


@pytest.mark.parametrize('trial', range(3))
def test_a_writer_killed_mid_put_never_blocks_the_prefix(trial, tiny_qwen3_next, mooncake_services, cold, tmp_path):
    die_at = random.randrange(PUTS)          # a random point of the writer's saves
    print(f'trial {trial}: the writer dies in its put #{die_at}')
    ids = prompt(150, seed=4200 + trial)
    config = store_config(mooncake_services, f'repair-{uuid.uuid4().hex}')
    # one writer, so exactly one put is in progress when the process dies (with N writers up to
    # N objects are left half-written, each repaired and counted the same way)
    kill_writer_mid_put(tmp_path, tiny_qwen3_next, dict(config, store_writers=1), ids, die_at)

    fixer = Engine(tiny_qwen3_next, PytorchEngineConfig(**config))
    try:
        seq = fixer.generate(ids, GEN)
        assert fixer.store.flush(timeout=60)
        stats = fixer.stats()
    finally:
        fixer.close()
    assert seq.output_ids == cold(ids)
    assert stats['store_repaired_objects'] == 1 and stats['store_put_failures'] == 0

    fresh = Engine(tiny_qwen3_next, PytorchEngineConfig(**config))
    try:
        seq = fresh.generate(ids, GEN)
        assert seq.stats.store_hit_tokens == seq.num_cached_tokens == 128      # the whole prefix
        assert seq.output_ids == cold(ids)
        assert fresh.stats()['store_rejected_objects'] == 0
    finally:
        fresh.close()
