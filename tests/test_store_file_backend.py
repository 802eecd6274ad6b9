"""The local-folder Store backend (``store_backend='file:DIR'``): no Mooncake master.

- Values appear atomically (temp file + fsync + link), so concurrent writers of a key get
  exactly one ``STORED`` and a writer killed mid-put leaves nothing a reader sees.
- The folder stays under ``store_file_max_bytes`` by removing the least recently used values.
- A conversation saved by one process is restored by a fresh process, outputs equal cold.

Engine geometry as in tests/test_store_engine.py: B = 16, A = 64, P = 64, tiny hybrid Qwen3-Next.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.store.backend import PutResult, StoreBackend
from lmdeploy.pytorch.store.file_backend import FileStore

WORKER = Path(__file__).with_name('store_worker.py')
B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)
NS = 'ab' * 16


def key(i: int, kind: str = 'kv') -> str:
    return f'{NS}/{kind}/{i:032x}'


def test_put_get_exists_remove_and_typed_results(tmp_path):
    store = FileStore(tmp_path)
    assert isinstance(store, StoreBackend)
    assert store.put(key(1), b'first') is PutResult.STORED
    assert store.put(key(1), b'second') is PutResult.EXISTS and store.get(key(1)) == b'first'
    assert store.put(key(1), b'fixed', replace=True) is PutResult.REPAIRED and store.get(key(1)) == b'fixed'
    assert store.batch_exists([key(1), key(2)]) == [True, False] and store.get(key(2)) is None
    assert store.remove(key(1)) and not store.exists(key(1))
    assert (tmp_path / 'objects' / NS / 'kv' / '00').is_dir() and not list((tmp_path / 'tmp').iterdir())
    assert store.put('../escape', b'x') is PutResult.FAILED            # keys never leave the folder
    store.close()
    assert store.put(key(3), b'x') is PutResult.FAILED and store.batch_exists([key(3)]) is None


def test_concurrent_writers_of_one_key_get_exactly_one_stored(tmp_path):
    stores = [FileStore(tmp_path) for _ in range(4)]     # four handles, as four engines would have
    barrier = threading.Barrier(4)
    results = [[] for _ in stores]

    def write(w):
        barrier.wait()
        for i in range(40):
            results[w].append(stores[w].put(key(i), bytes([w]) * 1000))

    threads = [threading.Thread(target=write, args=(w, )) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(40):
        winners = [w for w in range(4) if results[w][i] is PutResult.STORED]
        assert len(winners) == 1 and stores[0].get(key(i)) == bytes(winners) * 1000
    assert sum(s.stats.put_bytes for s in stores) == 40 * 1000


def test_least_recently_used_values_are_evicted_beyond_the_limit(tmp_path):
    store = FileStore(tmp_path, max_bytes=10_000)
    for i in range(9):
        assert store.put(key(i), bytes(1000)).gained
        time.sleep(0.01)                     # distinct modification times
    assert store.get(key(0)) is not None     # read: now the most recently used
    time.sleep(0.01)
    assert store.put(key(9), bytes(1500)).gained      # 10 500 bytes > 10 000: evict down to 9 000
    kept = [i for i in range(10) if store.exists(key(i))]
    assert kept == [0, 3, 4, 5, 6, 7, 8, 9] and store.num_bytes == 8500 and store.stats.evicted == 2
    reopened = FileStore(tmp_path, max_bytes=10_000)  # the limit holds across restarts
    assert reopened.num_bytes == 8500


def test_a_torn_temporary_file_of_a_dead_writer_is_removed_and_never_read(tmp_path):
    store = FileStore(tmp_path)
    part = store.begin_torn_write(key(5), bytes(range(256)))
    dead = tmp_path / 'tmp' / ('999999999-' + part.name.split('-', 1)[1])
    part.rename(dead)                        # as if written by a process that is gone
    assert not store.exists(key(5)) and store.get(key(5)) is None
    FileStore(tmp_path)
    assert not dead.exists()


def test_a_bad_folder_or_limit_is_a_config_error_naming_the_field(tmp_path):
    (tmp_path / 'file').write_text('not a folder')
    with pytest.raises(ValueError, match='store_backend'):
        FileStore(tmp_path / 'file' / 'store')
    with pytest.raises(ValueError, match='store_file_max_bytes'):
        FileStore(tmp_path, max_bytes=-1)
    with pytest.raises(ValueError, match='store_backend'):
        PytorchEngineConfig(store_backend='disk:/tmp/x')
    with pytest.raises(ValueError, match='two Stores'):
        PytorchEngineConfig(store_backend='file:/tmp/x', mooncake_master='local')


def test_the_backend_is_opened_by_its_scheme_and_named_as_opened(tmp_path):
    """``store/open_backend.py`` maps a config to its scheme, opens that scheme's backend and
    names it on the startup line; a config naming no Store has no scheme and opens nothing."""
    from lmdeploy.pytorch.store.open_backend import describe_store, open_store, store_scheme
    cfg = PytorchEngineConfig(store_backend=f'file:{tmp_path}/objects', store_file_max_bytes=1 << 20)
    assert store_scheme(cfg) == 'file' and describe_store(cfg) == f'file Store in {tmp_path}/objects'
    opened = open_store(cfg, state_bytes=100, kv_block_bytes=40)
    try:
        assert isinstance(opened.backend, FileStore) and opened.services is None
        assert opened.description == f'file Store in {tmp_path}/objects'
        assert (tmp_path / 'objects').is_dir()
    finally:
        opened.close()
    remote = PytorchEngineConfig(mooncake_master='10.0.0.7:50051',
                                 mooncake_metadata_server='http://10.0.0.7:8080/metadata')
    assert store_scheme(remote) == 'mooncake' and describe_store(remote) == 'Mooncake Store at 10.0.0.7:50051'
    assert store_scheme(PytorchEngineConfig(mooncake_master='local')) == 'mooncake'
    none = PytorchEngineConfig()
    assert store_scheme(none) is None and describe_store(none) == 'no Store'
    with pytest.raises(ValueError, match='store_backend or mooncake_master'):
        open_store(none, 100, 40)


# engines -----------------------------------------------------------------------------------
def store_config(folder: Path, **fields) -> dict:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
               store_backend=f'file:{folder}')
    cfg.update(fields)
    return cfg


def run_worker(tmp_path: Path, name: str, model: str, config: dict, turns, expect_rc: int = 0, **job) -> dict | None:
    path, out = tmp_path / f'{name}.json', tmp_path / f'{name}.out.json'
    path.write_text(json.dumps(dict(model=model, config=config, history=[], turns=turns,
                                    max_new_tokens=GEN.max_new_tokens, **job)))
    proc = subprocess.run([sys.executable, str(WORKER), str(path), str(out)], env=dict(os.environ),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == expect_rc, proc.stderr[-3000:]
    return json.loads(out.read_text()) if expect_rc == 0 else None


@pytest.fixture(scope='module')
def cold(tiny_qwen3_next):
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                                      max_prefill_token_num=P))
    yield lambda ids: eng.generate(ids, GEN).output_ids
    eng.close()


def test_a_conversation_is_restored_in_a_fresh_process_from_the_folder(tiny_qwen3_next, tmp_path, cold):
    folder = tmp_path / 'store'
    turns = [prompt(150, seed=5100), prompt(60, seed=5101)]
    a = run_worker(tmp_path, 'a', tiny_qwen3_next, store_config(folder), turns)
    S_K = a['stats']['store_put_bytes']
    assert [t['save_points'] for t in a['turns']] == [[64, 128], [192]]
    assert a['stats']['store_put_objects'] == {'state': 3, 'kv': 12}
    # the next process (a restart) restores each turn's deepest save point from the folder
    b = run_worker(tmp_path, 'b', tiny_qwen3_next, store_config(folder), turns)
    assert [t['store_hit_tokens'] for t in b['turns']] == [128, 192]
    assert [t['output_ids'] for t in b['turns']] == [t['output_ids'] for t in a['turns']]
    assert b['stats']['store_put_objects'] == {'state': 0, 'kv': 0} and S_K['state'] > 0
    ids = turns[0]
    assert a['turns'][0]['output_ids'] == cold(ids)
    second = ids + a['turns'][0]['output_ids'] + turns[1]
    assert a['turns'][1]['output_ids'] == cold(second)


@pytest.mark.parametrize('die_at', [0, 4, 9], ids=['first_kv', 'state_64', 'state_128'])
def test_a_torn_write_is_never_restored(tiny_qwen3_next, tmp_path, cold, die_at):
    """The writer is killed half-way through its ``die_at``-th put (KV 0-3, state 64, KV 4-7,
    state 128): that object never appears; a fresh engine restores only what was complete,
    computes the rest with the cold output, and puts the missing object."""
    folder = tmp_path / 'store'
    ids = prompt(150, seed=5200 + die_at)
    # one writer: the puts run in the order the docstring lists (several writers interleave them)
    run_worker(tmp_path, 'w', tiny_qwen3_next, store_config(folder, store_writers=1), [ids],
               expect_rc=-signal.SIGKILL, die_at_put=die_at)
    assert list((folder / 'tmp').glob('*.part'))          # the torn value is there, as a temporary file
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(folder)))
    try:
        assert not list((folder / 'tmp').glob('*.part'))  # its writer is gone: removed at open
        seq = eng.generate(ids, GEN)
        assert seq.output_ids == cold(ids)
        assert seq.stats.store_hit_tokens == {0: 0, 4: 0, 9: 64}[die_at]
        assert eng.stats()['store_rejected_objects'] == 0
        assert eng.store.flush(timeout=30)
    finally:
        eng.close()
    again = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(folder)))
    try:
        seq = again.generate(ids, GEN)
        assert seq.stats.store_hit_tokens == 128 and seq.output_ids == cold(ids)
    finally:
        again.close()


def test_one_engine_repairs_every_bad_object_of_a_prefix(tiny_qwen3_next, tmp_path, cold):
    """Three KV objects of one prefix hand-edited: the first engine that tries the prefix rejects it,
    marks all three bad (not only the first it read) and its save replaces all three, so the next
    engine restores the whole prefix with the cold output."""
    folder = tmp_path / 'store'
    ids = prompt(150, seed=5200)
    a = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(folder)))
    a.generate(ids, GEN)
    a.close()
    kv_files = sorted(p for p in folder.rglob('*') if p.is_file() and '/kv/' in str(p).replace(os.sep, '/'))
    assert len(kv_files) == 8
    for path in kv_files[1:4]:
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF             # inside the payload or MAC: the checksum or MAC fails
        path.write_bytes(bytes(data))
    b = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(folder)))
    out_b = b.generate(ids, GEN).output_ids
    b.store.flush()
    stats = b.stats()
    b.close()
    assert stats['store_rejected_objects'] == 3 and stats['store_repaired_objects'] == 3
    c = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(folder)))
    seq = c.generate(ids, GEN)
    c.close()
    assert seq.stats.store_hit_tokens == 128 and seq.output_ids == out_b == cold(ids)
