"""Concurrent Store writers count exactly what the Store gained (real ``mooncake_master``).

Mooncake's put keeps the first value of a key and reports success to every writer; the client
reads back the leading bytes of the stored value (each object carries its writer's id) and
answers ``STORED`` to the one writer whose value was kept, ``EXISTS`` to the others. So with any
number of writers of overlapping keys, the objects and bytes counted as put add up to exactly
the objects and bytes the Store holds.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_utils import random_prompt as prompt
from lmdeploy.pytorch.store.backend import PutResult
from lmdeploy.pytorch.store.mooncake_client import StoreClient
from lmdeploy.pytorch.store.object_format import OBJECT_OVERHEAD, encode_object, object_key

WORKER = Path(__file__).with_name('store_worker.py')
B, A, P = 16, 64, 64
NS = bytes(range(16))


def namespace_keys(services, ns_hex: str) -> list[str]:
    with urllib.request.urlopen(f'http://{services.host}:{services.metrics_port}/get_all_keys', timeout=10) as r:
        text = r.read().decode()
    return sorted(set(re.findall(re.escape(ns_hex) + r'/(?:kv|state)/[0-9a-f]+', text)))


@pytest.fixture(scope='module')
def writers(mooncake_services):
    """Four clients, each with its own native handle (as four engines would have)."""
    clients = [StoreClient.connect(mooncake_services.master_address, mooncake_services.metadata_server,
                                   local_buffer_size=4 << 20) for _ in range(4)]
    yield clients
    for c in clients:
        c.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sets(st.integers(0, 11), min_size=1), min_size=2, max_size=4),
       st.integers(1, 3000))
def test_overlapping_puts_at_once_count_each_object_once(writers, mooncake_services, key_sets, size):
    """Writers put overlapping key sets at the same moment (a barrier); per key exactly one
    writer is told STORED, and its value is the one the Store returns."""
    ns_hex = uuid.uuid4().hex
    keys = [object_key(ns_hex, 'kv', f'{i:032x}') for i in range(12)]
    barrier = threading.Barrier(len(key_sets))
    results: list[dict] = [{} for _ in key_sets]

    def write(w: int) -> None:
        values = {keys[i]: encode_object('kv', NS, 16 * (i + 1), bytes([w]) * size, key=keys[i], writer=w + 1)
                  for i in sorted(key_sets[w])}
        barrier.wait()
        for k, v in values.items():
            results[w][k] = (writers[w].put(k, v), v)

    threads = [threading.Thread(target=write, args=(w, )) for w in range(len(key_sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    union = {keys[i] for s in key_sets for i in s}
    stored = [(k, v) for r in results for k, (res, v) in r.items() if res is PutResult.STORED]
    assert all(res in (PutResult.STORED, PutResult.EXISTS) for r in results for res, _ in r.values())
    assert sorted(k for k, _ in stored) == sorted(union)                 # each key counted exactly once
    assert namespace_keys(mooncake_services, ns_hex) == sorted(union)
    reader = writers[0]
    assert all(reader.get(k) == v for k, v in stored)                   # the counted value is the kept one
    assert sum(len(v) - OBJECT_OVERHEAD for _, v in stored) == len(union) * size


def _store_config(services, namespace: str) -> dict:
    return dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
                enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
                mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
                mooncake_local_buffer_size=1 << 20, store_namespace=namespace)


def test_engines_saving_overlapping_prefixes_at_once_count_what_the_store_gained(tiny_qwen3_next, mooncake_services,
                                                                                tmp_path):
    """Three engines (processes) start the same 150-token prefix at one moment, two of them
    followed by their own 60-token suffix, and (held to one moment after their existence
    checks) put what they all found absent at once; summed over the engines, the objects and
    payload bytes counted equal the objects the Store holds in their namespace times S or K_blk."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine

    namespace = f'concurrent-{uuid.uuid4().hex}'
    shared = prompt(150, seed=4100)
    procs, outs = [], []
    for w in range(3):
        ids = shared + prompt(60, seed=4101 + w) if w else shared
        job, out = tmp_path / f'w{w}.json', tmp_path / f'w{w}.out.json'
        job.write_text(json.dumps(dict(model=tiny_qwen3_next, config=_store_config(mooncake_services, namespace),
                                       history=[], turns=[ids], max_new_tokens=4,
                                       barrier=dict(dir=str(tmp_path / 'barrier'), parties=3), hold_puts_s=6)))
        env = dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1')
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(job), str(out)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    stats = [json.loads(o.read_text())['stats'] for o in outs]
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(**_store_config(mooncake_services, namespace)))
    try:    # the same namespace and geometry as the workers
        ns_hex, S, K = eng.store.ns_hex, eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes
    finally:
        eng.close()
    keys = namespace_keys(mooncake_services, ns_hex)
    held = {'state': sum('/state/' in k for k in keys), 'kv': sum('/kv/' in k for k in keys)}
    # 64 and 128 shared, 192 twice (own suffixes); blocks 0-8 shared, 9-11 twice
    assert held == {'state': 4, 'kv': 15}
    assert {kind: sum(s['store_put_objects'][kind] for s in stats) for kind in held} == held
    assert {kind: sum(s['store_put_bytes'][kind] for s in stats) for kind in held} == \
        {'state': held['state'] * S, 'kv': held['kv'] * K}
    assert sum(s['store_existing_objects'] for s in stats) >= 2 * 10   # they did collide: the shared 10
