"""The Store tier's write path never stalls the engine, and a frozen Store never stalls a request.

- Several writers: counters stay exact (bytes and objects only for what the Store gained), and a
  state object never appears above a missing block, whatever the interleaving.
- ``submit`` never waits: a full queue drops the save (``store_dropped_puts``) and a later save of
  the prefix puts it.
- The in-flight index: a prefix whose put is queued or running is probed as present and loaded
  byte-exact from the copied-out payload; once put, it is read from the Store.
- Deadline and breaker: a Store whose calls never return (a fake, and a real Mooncake master
  stopped with SIGSTOP) costs a request at most ``store_timeout_s`` once, then nothing.

Engine geometry as in tests/test_store_engine.py: B = 16, A = 64, P = 64, tiny hybrid Qwen3-Next.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.prefill_plan import ReuseRules
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
from lmdeploy.pytorch.prefix_cache.plans import StoreLoad, StorePut
from lmdeploy.pytorch.prefix_cache.store_tier import StoreTier
from lmdeploy.pytorch.store.mooncake_client import FakeStoreClient
from lmdeploy.pytorch.store.object_format import object_key

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)
NS = b'\x02' * 16
KV_BYTES, STATE_BYTES = 4, 8


class _Slots:
    """A cache engine stand-in: block ``b`` holds ``[b] * 4`` and slot ``s`` holds ``[100 + s] * 8``."""
    state_bytes, kv_block_bytes = STATE_BYTES, KV_BYTES

    def __init__(self):
        self.kv, self.state = {}, {}

    def read_kv_blocks(self, ids):
        return torch.stack([torch.full((KV_BYTES,), b, dtype=torch.uint8) for b in ids])

    def read_state(self, slot):
        return torch.full((STATE_BYTES,), 100 + slot, dtype=torch.uint8)

    def write_kv_block(self, block, payload):
        self.kv[block] = bytes(payload.numpy())

    def write_state(self, slot, payload):
        self.state[slot] = bytes(payload.numpy())


@dataclass
class _SlowFake(FakeStoreClient):
    """A fake Store whose puts and existence queries take 0-1 ms, so that writers interleave."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def put(self, key, value, *, replace=False):
        time.sleep(self.rng.random() / 1000)
        return super().put(key, value, replace=replace)

    def batch_exists(self, keys):
        time.sleep(self.rng.random() / 1000)
        return super().batch_exists(keys)


@dataclass
class _SlowBatchFake(_SlowFake):
    """As :class:`_SlowFake`, with ``put_many`` (one result per item, in order)."""
    batches: int = 0

    def put_many(self, items):
        self.batches += 1
        return [super(_SlowBatchFake, self).put(k, v, replace=r) for k, v, r in items]


@dataclass
class _GatedFake(FakeStoreClient):
    """A fake Store whose puts wait for ``gate``; ``entered`` counts puts that started."""
    gate: threading.Event = field(default_factory=threading.Event)
    entered: int = 0

    def put(self, key, value, *, replace=False):
        self.entered += 1
        self.gate.wait(30)
        return super().put(key, value, replace=replace)


def _wait(cond, timeout=10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, 'condition not reached'
        time.sleep(0.005)


def _submit(tier, ids, boundary, first_block=0, slot=0):
    hashes = chain_block_hashes(ids, B, boundary // B)
    tier.submit(StorePut(hashes, list(range(first_block, first_block + boundary // B)), boundary, slot))
    return hashes


def _key(kind, h):
    return object_key(NS.hex(), kind, h.hex())


# ------------------------------------------------------------------ counters with N writers
CONVERSATIONS = [prompt(6 * B, seed) for seed in (301, 302, 303)]


@settings(max_examples=25, deadline=None)
@given(saves=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), min_size=1, max_size=8),
       writers=st.sampled_from([1, 4]), engines=st.integers(1, 2), fail_puts=st.integers(0, 3),
       batched=st.booleans())
def test_counters_are_exact_and_states_complete_with_concurrent_writers(saves, writers, engines, fail_puts, batched):
    """Any saves of overlapping prefixes by one or two engines with 1 or 4 writers each, with or
    without a backend ``put_many``, some puts failing: the objects counted equal the objects
    stored, bytes equal their payload sizes, failures equal the failed puts, and every stored
    state has its whole prefix stored."""
    client = (_SlowBatchFake if batched else _SlowFake)(fail_puts=fail_puts)
    tiers = [StoreTier(client, _Slots(), NS, B, writers=writers) for _ in range(engines)]
    try:
        for i, (c, blocks) in enumerate(saves):
            _submit(tiers[i % engines], CONVERSATIONS[c], blocks * B, slot=c)
        assert all(t.flush(timeout=30) for t in tiers)
        stats = [t.stats() for t in tiers]
        kv = [k for k in client.objects if '/kv/' in k]
        states = [k for k in client.objects if '/state/' in k]
        assert sum(s['store_put_objects']['kv'] for s in stats) == len(kv)
        assert sum(s['store_put_objects']['state'] for s in stats) == len(states)
        assert sum(s['store_put_bytes']['kv'] for s in stats) == KV_BYTES * len(kv)
        assert sum(s['store_put_bytes']['state'] for s in stats) == STATE_BYTES * len(states)
        assert sum(s['store_put_failures'] for s in stats) == fail_puts - client.fail_puts
        assert sum(s['store_dropped_puts'] for s in stats) == 0
        for ids in CONVERSATIONS:
            hashes = chain_block_hashes(ids, B, 6)
            for n in range(1, 7):
                if _key('state', hashes[n - 1]) in client.objects:
                    assert all(_key('kv', h) in client.objects for h in hashes[:n]), n
        if batched and engines == 1 and saves[0][1] > 1:     # the first save put its blocks in one batch
            assert client.batches >= 1
        if fail_puts == 0:       # nothing failed: every save is stored
            for c, blocks in saves:
                hashes = chain_block_hashes(CONVERSATIONS[c], B, blocks)
                assert _key('state', hashes[-1]) in client.objects
                assert all(_key('kv', h) in client.objects for h in hashes)
    finally:
        for t in tiers:
            t.close(timeout=10)


# ------------------------------------------------------------------ submit never waits
@pytest.mark.timing
def test_a_full_queue_drops_the_save_counts_it_and_a_later_save_puts_it():
    client = _GatedFake()
    tier = StoreTier(client, _Slots(), NS, B, queue_size=1, writers=1)
    first, second, third = (prompt(100, seed) for seed in (311, 312, 313))
    try:
        _submit(tier, first, 64)
        _wait(lambda: client.entered == 1)       # the writer holds the first job, stuck in a put
        _submit(tier, second, 64)
        assert tier.queue_depth == 1
        start = time.monotonic()
        hashes = _submit(tier, third, 64)
        assert time.monotonic() - start < 0.1          # dropped, not waited for
        stats = tier.stats()
        assert (stats['store_dropped_puts'], stats['store_queue_depth']) == (1, 1)
        client.gate.set()
        assert tier.flush(timeout=10)
        assert _key('state', hashes[-1]) not in client.objects
        _submit(tier, third, 64)             # its keys were released: this save copies and puts them
        assert tier.flush(timeout=10)
        assert _key('state', hashes[-1]) in client.objects and all(_key('kv', h) in client.objects for h in hashes)
        stats = tier.stats()
        assert stats['store_put_objects'] == {'state': 3, 'kv': 12} and stats['store_dropped_puts'] == 1
        assert stats['store_queue_depth'] == 0
    finally:
        client.gate.set()
        tier.close(timeout=10)


# ------------------------------------------------------------------ the in-flight index
def test_a_queued_save_is_probed_and_loaded_from_memory_then_from_the_store():
    client = _GatedFake()
    slots = _Slots()
    tier = StoreTier(client, slots, NS, B, writers=2)
    ids = prompt(200, 321)
    try:
        hashes = _submit(tier, ids, 128, first_block=10, slot=3)
        _wait(lambda: client.entered >= 1)       # the put is running (stuck), nothing is stored
        assert not client.objects
        assert tier.probe(chain_block_hashes(ids, B), ReuseRules(200, B, A)) == [128]
        load = StoreLoad(None, 128, hashes, list(range(20, 28)), 0, 5)
        assert tier.load(load)
        expected_kv = {20 + i: bytes([10 + i]) * KV_BYTES for i in range(8)}
        assert slots.kv == expected_kv and slots.state == {5: bytes([103]) * STATE_BYTES}
        assert client.stats.gets == 0                       # no Store round trip
        client.gate.set()
        assert tier.flush(timeout=10)
        slots.kv.clear(), slots.state.clear()
        assert tier.load(load)                               # the index let go: read and verified
        assert slots.kv == expected_kv and slots.state == {5: bytes([103]) * STATE_BYTES}
        assert client.stats.gets == 9
    finally:
        client.gate.set()
        tier.close(timeout=10)


class _Wrapped:
    """Delegates to a backend; ``frozen`` (an Event that is set) makes chosen calls wait until
    ``thaw`` is set, like a Store that stopped answering."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls
        self.frozen, self.thaw = threading.Event(), threading.Event()
        self.entered = 0        # frozen calls that started waiting

    def _gate(self, name):
        if name in self.calls and self.frozen.is_set():
            self.entered += 1
            self.thaw.wait(60)

    def put(self, key, value, *, replace=False):
        self._gate('put')
        return self.inner.put(key, value, replace=replace)

    def get(self, key):
        self._gate('get')
        return self.inner.get(key)

    def batch_exists(self, keys):
        self._gate('batch_exists')
        return self.inner.batch_exists(keys)

    def __getattr__(self, name):
        attr = getattr(self.inner, name)         # put_many only where the backend has it
        if name == 'put_many':
            def put_many(items):
                self._gate('put')
                return attr(items)
            return put_many
        return attr


def file_config(folder, **fields) -> PytorchEngineConfig:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
               store_backend=f'file:{folder}')
    cfg.update(fields)
    return PytorchEngineConfig(**cfg)


@pytest.fixture(scope='module')
def cold(tiny_qwen3_next):
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                                      max_prefill_token_num=P))
    memo = {}

    def run(ids):
        if tuple(ids) not in memo:
            memo[tuple(ids)] = eng.generate(ids, GEN).output_ids
        return memo[tuple(ids)]

    return run


def test_a_second_request_restores_from_a_save_whose_puts_are_stuck(tiny_qwen3_next, tmp_path, cold):
    eng = Engine(tiny_qwen3_next, file_config(tmp_path))
    wrapped = eng.store.client = _Wrapped(eng.store.client, {'put'})
    wrapped.frozen.set()
    ids = prompt(150, seed=331)
    try:
        first = eng.generate(ids, GEN)
        assert first.stats.save_points == [64, 128] and eng.store.num_inflight == 2     # both stuck
        eng.prefix_cache.evict(10 ** 6)          # the local tier forgets: only the Store tier can help
        again = eng.generate(ids, GEN)
        assert again.stats.store_hit_tokens == 128 and again.output_ids == first.output_ids == cold(ids)
        assert eng.store.client.inner.stats.gets == 0 and eng.stats()['store_get_failures'] == 0
    finally:
        wrapped.thaw.set()
    assert eng.store.flush(timeout=30)
    assert eng.stats()['store_put_objects'] == {'state': 2, 'kv': 8}
    eng.close()


# ------------------------------------------------------------------ deadline and breaker
def test_a_store_that_never_answers_costs_one_deadline_then_nothing(tiny_qwen3_next, tmp_path, cold):
    """Fake frozen Store: every call waits until released. The first request probing the Store
    waits one deadline (0.3 s), the breaker opens; later requests, with or without a prefix in
    the Store, skip it and finish at their compute time; outputs equal cold."""
    eng = Engine(tiny_qwen3_next, file_config(tmp_path, store_timeout_s=0.3))
    stored, new, other = prompt(150, seed=341), prompt(150, seed=342), prompt(150, seed=343)
    eng.generate(stored, GEN)
    assert eng.store.flush(timeout=30)
    start = time.monotonic()
    assert eng.generate(prompt(150, seed=344), GEN).output_ids == cold(prompt(150, seed=344))
    compute = time.monotonic() - start     # a request of this size, the Store answering (one probe)
    wrapped = eng.store.client = _Wrapped(eng.store.client, {'put', 'get', 'batch_exists'})
    wrapped.frozen.set()
    eng.prefix_cache.evict(10 ** 6)
    try:
        start = time.monotonic()
        seq = eng.generate(new, GEN)         # no Store prefix: its probe misses the deadline
        first = time.monotonic() - start
        assert seq.output_ids == cold(new) and 0.3 <= first < 0.3 + compute + 0.5
        failures = eng.stats()['store_get_failures']
        assert failures == 1
        start = time.monotonic()
        seq = eng.generate(stored, GEN)      # its prefix is in the Store: skipped, computed
        assert time.monotonic() - start < compute + 0.5
        assert seq.output_ids == cold(stored) and seq.stats.store_hit_tokens == 0
        start = time.monotonic()
        assert eng.generate(other, GEN).output_ids == cold(other)
        assert time.monotonic() - start < compute + 0.5
        assert eng.stats()['store_get_failures'] > failures      # skipped lookups are counted misses
    finally:
        wrapped.thaw.set()
    assert eng.store.flush(timeout=30)
    eng.close()


@pytest.mark.parametrize('writers', [1, 4])
def test_the_engine_never_waits_for_stuck_writers(tiny_qwen3_next, tmp_path, cold, writers):
    """A regression of the engine step waiting on a full save queue: the queue holds 1 job and
    every writer is stuck in a put; each request still finishes at compute speed, the saves
    beyond the writers and the queue are dropped and counted, outputs equal cold."""
    eng = Engine(tiny_qwen3_next, file_config(tmp_path, store_queue_size=1, store_writers=writers))
    wrapped = eng.store.client = _Wrapped(eng.store.client, {'put'})
    wrapped.frozen.set()
    n = writers + 3
    try:
        start = time.monotonic()
        for i in range(n):
            ids = prompt(70, seed=350 + i)
            seq = eng.generate(ids, GEN)
            assert seq.stats.save_points == [64] and seq.output_ids == cold(ids)
            _wait(lambda: wrapped.entered == min(i + 1, writers))    # a free writer took the job
        assert time.monotonic() - start < 20
        stats = eng.stats()
        assert stats['store_dropped_puts'] == n - writers - 1     # one job per writer, one queued
        assert eng.ledger()['store_queue_depth'] == stats['store_queue_depth'] == 1
    finally:
        wrapped.thaw.set()
    assert eng.store.flush(timeout=30)
    assert eng.stats()['store_put_objects'] == {'state': writers + 1, 'kv': 4 * (writers + 1)}
    eng.close()


def test_a_stopped_mooncake_master_costs_one_deadline_then_nothing(tiny_qwen3_next, cold):
    """The real master, stopped with SIGSTOP (it keeps its sockets open): a request restoring
    from the Store waits at most its deadline and is computed; a request with no Store prefix
    finishes within 1 s; outputs equal cold."""
    from lmdeploy.pytorch.store.services import MooncakeServices, find_binary
    if find_binary('mooncake_master') is None:
        pytest.skip('mooncake_master binary not found: pip install -r requirements/store.txt')
    services = MooncakeServices(segment_size=16 << 20).start()
    eng = None
    try:
        eng = Engine(tiny_qwen3_next, PytorchEngineConfig(
            device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
            enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
            mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
            mooncake_local_buffer_size=1 << 20))
        stored, new = prompt(150, seed=361), prompt(150, seed=362)
        eng.generate(stored, GEN)
        assert eng.store.flush(timeout=30)
        eng.prefix_cache.evict(10 ** 6)
        os.kill(services._master.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            seq = eng.generate(stored, GEN)          # the load's read misses the deadline
            assert time.monotonic() - start < eng.config.store_timeout_s + 1.0
            assert seq.output_ids == cold(stored) and seq.stats.store_hit_tokens == 0
            start = time.monotonic()
            seq = eng.generate(new, GEN)
            assert time.monotonic() - start < 1.0 and seq.output_ids == cold(new)
            assert eng.stats()['store_get_failures'] >= 1
        finally:
            os.kill(services._master.pid, signal.SIGCONT)
        assert eng.store.flush(timeout=60)
    finally:
        if eng is not None:
            eng.close()
        services.stop()
