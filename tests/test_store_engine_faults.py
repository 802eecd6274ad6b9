"""The Mooncake Store tier at engine level under faults and misconfiguration, against a real
``mooncake_master``: tampered or foreign-namespace objects are counted misses, a killed master
or a full segment leaves output correct, failed puts are retried or hold back the state put,
the embedded master starts and stops with the engine, and bad Store configs and models the
Store does not apply to are refused or reported. Each test compares with an engine with
caching off and ends with ``engine.is_idle()``. Geometry as tests/test_store_engine.py
(B = 16, A = 64, P = 64); fault tests that kill the master or fill the segment start their own
services.
"""
from __future__ import annotations

import threading
import time

import pytest

from engine_utils import random_prompt as prompt
from store_engine_utils import (A, B, BUFFER, GEN, P, SMALL_SEGMENT, assert_prefix_complete, cold, cold_conversation,
                                key, make_engine, store_config)
from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.store.backend import PutResult
from lmdeploy.pytorch.store.mooncake_client import StoreClient, StoreUnavailableError, buffer_bytes_needed
from lmdeploy.pytorch.store.object_format import (HEADER_SIZE, MAC_SIZE, OBJECT_OVERHEAD, StoreObjectError,
                                                  decode_object, encode_object)
from lmdeploy.pytorch.store.services import MooncakeServices, free_ports


def _flip_payload_byte(value: bytes, target: str) -> bytes:
    data = bytearray(value)
    data[HEADER_SIZE + 5] ^= 0x40
    return bytes(data)


def _foreign_namespace(value: bytes, target: str) -> bytes:
    """The same payload, re-encoded under another engine's namespace (valid checksum and MAC)."""
    kind = 'state' if value[6] == 2 else 'kv'
    tokens = int.from_bytes(value[24:32], 'little')
    return encode_object(kind, bytes(16), tokens, value[HEADER_SIZE:-MAC_SIZE], key=target)


# A rejected boundary falls back to the next shallower one the Store holds: a bad state at 128
# leaves the intact prefix at 64; a bad KV block below 64 spoils both boundaries (one miss: the
# rejected block's key then counts as absent, so the boundary at 64 is not even tried).
@pytest.mark.parametrize('kind,boundary,tamper,reason,seed,cached,rejected', [
    ('state', 128, _flip_payload_byte, 'checksum', 500, 64, 1),
    ('kv', 48, _flip_payload_byte, 'checksum', 501, 0, 1),
    ('state', 128, _foreign_namespace, 'namespace', 502, 64, 1),
], ids=['state_bit_flip', 'kv_bit_flip', 'foreign_state'])
def test_tampered_object_is_a_counted_miss_and_output_stays_correct(make_engine, cold, mooncake_store, kind,
                                                                    boundary, tamper, reason, seed, cached,
                                                                    rejected):
    ids = prompt(150, seed=seed)
    writer = make_engine()
    target = key(writer, kind, ids, boundary)
    put = writer.store.client.put
    # the writer's put of ``target`` carries a modified copy: the first value of a key is kept
    writer.store.client.put = lambda k, v, **kw: put(k, tamper(bytes(v), target) if k == target else v, **kw)
    assert writer.generate(ids, GEN).output_ids == cold(ids)
    assert writer.store.flush(timeout=30)
    with pytest.raises(StoreObjectError) as err:
        decode_object(mooncake_store.get(target), kind, writer.store.namespace, boundary, key=target)
    assert err.value.reason == reason

    reader = make_engine()
    seq = reader.generate(ids, GEN)
    stats = reader.stats()
    assert stats['store_rejected_objects'] == rejected and stats['store_hit_tokens'] == cached
    assert seq.num_cached_tokens == cached and seq.output_ids == cold(ids)
    assert reader.store.flush(timeout=30) and reader.is_idle()


# faults -----------------------------------------------------------------------------------
def test_conversation_completes_after_the_master_is_killed(make_engine, cold, caplog):
    users = [prompt(150, seed=700), prompt(150, seed=701), prompt(100, seed=702)]
    replies = cold_conversation(cold, users)
    with MooncakeServices(segment_size=SMALL_SEGMENT) as services:
        eng = make_engine(services=services)
        ids = users[0]
        seq = eng.generate(ids, GEN)
        assert eng.store.flush(timeout=30)
        healthy = eng.stats()
        assert healthy['store_put_objects'] == {'state': 2, 'kv': 8} and healthy['store_put_failures'] == 0
        services.kill_master()
        start = time.monotonic()
        jobs = 0
        for user, reply in zip(users[1:], replies[1:]):
            ids = seq.token_ids + user
            seq = eng.generate(ids, GEN)
            assert seq.output_ids == reply
            jobs += len(seq.stats.plans[0].save_points)
            assert eng.store.flush(timeout=30)
        assert time.monotonic() - start < 15.0
        stats = eng.stats()
        assert jobs == 4
        # each save job stops at its first failed put; each admission's Store lookup fails once
        assert stats['store_put_failures'] == jobs and stats['store_get_failures'] == 2
        assert stats['store_put_objects'] == healthy['store_put_objects']
        assert stats['store_put_bytes'] == healthy['store_put_bytes']
        assert eng.is_idle()
        # the operator is told once (rate-limited), not once per failure
        warned = [r for r in caplog.records if r.levelname == 'WARNING' and 'Store operation failed' in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        start = time.monotonic()
        eng.close()
        eng.close()         # idempotent: a second close neither hangs nor touches the closed client
        assert time.monotonic() - start < 10.0


def test_unreachable_master_at_startup_is_an_error_naming_the_address(tiny_qwen3_next):
    rpc, http = free_ports('127.0.0.1', 2)
    address = f'127.0.0.1:{rpc}'
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, num_gpu_blocks=64,
               enable_prefix_caching=True, mooncake_master=address, mooncake_local_buffer_size=BUFFER,
               mooncake_metadata_server=f'http://127.0.0.1:{http}/metadata')
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=address):
        Engine(tiny_qwen3_next, PytorchEngineConfig(**cfg))
    assert time.monotonic() - start < 10.0


def test_store_config_errors_name_the_field(tiny_qwen3_next, mooncake_services):
    base = store_config(mooncake_services, num_gpu_blocks=64)
    with pytest.raises(ValueError, match='mooncake_metadata_server'):
        Engine(tiny_qwen3_next, PytorchEngineConfig(**dict(base, mooncake_metadata_server=None)))
    largest = 16896 + OBJECT_OVERHEAD               # the tiny model's state object (header + payload + MAC)
    need = buffer_bytes_needed(largest)
    assert need == 18432                            # Mooncake rounds an allocation up to 1/8 of its power of 2
    with pytest.raises(ValueError, match=f'mooncake_local_buffer_size.*{need}'):
        Engine(tiny_qwen3_next, PytorchEngineConfig(**dict(base, mooncake_local_buffer_size=need - 1)))
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(**dict(base, mooncake_local_buffer_size=need)))
    try:                                            # the smallest accepted buffer carries every object
        ids = prompt(150, seed=800)
        eng.generate(ids, GEN)
        assert eng.store.flush(timeout=30)
        assert eng.stats()['store_put_objects'] == {'state': 2, 'kv': 8}
        assert eng.stats()['store_put_failures'] == 0
    finally:
        eng.close()
    for name, value in (('mooncake_segment_size', 1 << 20), ('mooncake_embedded_segment_size', 8 << 20)):
        with pytest.raises(ValueError, match=name):
            PytorchEngineConfig(**{name: value})


def _fill(services: MooncakeServices, object_bytes: int) -> int:
    """Put filler objects until the segment refuses one of ``object_bytes``; objects put."""
    client = StoreClient.connect(services.master_address, services.metadata_server, local_buffer_size=2 << 20)
    count = 0
    try:
        for size in (1 << 20, object_bytes):
            for _ in range(SMALL_SEGMENT // size + 1):
                if not client.put(f'filler/{size}/{count}', bytes(size)).ok:
                    break
                count += 1
    finally:
        client.close()
    return count


def test_full_store_counts_put_failures_and_output_stays_correct(make_engine, cold):
    ids = prompt(150, seed=900)
    # By default a full Mooncake segment evicts >= 5% of its objects; with eviction off it refuses.
    no_eviction = ('--eviction_ratio=0', '--eviction_high_watermark_ratio=1.0')
    with MooncakeServices(segment_size=SMALL_SEGMENT, master_args=no_eviction) as services:
        eng = make_engine(services=services)
        kv_object = eng.cache_engine.kv_block_bytes + OBJECT_OVERHEAD   # the smallest object the engine puts
        assert _fill(services, kv_object) == 16       # 16 x 1 MiB, then not one KV-sized object more
        seq = eng.generate(ids, GEN)
        assert eng.store.flush(timeout=30)
        stats = eng.stats()
        assert seq.output_ids == cold(ids)
        assert stats['store_put_failures'] == 2            # two save jobs, each stops at its first put
        assert stats['store_put_objects'] == {'state': 0, 'kv': 0}
        again = eng.generate(ids, GEN)                      # the local prefix cache still serves
        assert again.stats.hit_tokens == 128 and again.output_ids == seq.output_ids
        assert eng.is_idle()
        eng.close()


def test_failed_block_put_is_retried_by_the_next_save_of_the_prefix(make_engine, cold, mooncake_store):
    ids = prompt(150, seed=1000)
    eng = make_engine()
    put, failed = eng.store.client.put, []

    def first_kv_put_fails(k, v, **kw):
        if '/kv/' in k and not failed:
            failed.append(k)
            return PutResult.FAILED
        return put(k, v, **kw)

    eng.store.client.put = first_kv_put_fails
    seq = eng.add_request(ids, GEN)
    while seq.num_computed_tokens < 64:
        eng.step()
    assert eng.store.flush(timeout=30)              # the save at 64 ran: block 0 failed, the job stopped
    assert eng.stats()['store_put_failures'] == 1 and eng.stats()['store_put_objects'] == {'state': 0, 'kv': 0}
    while not seq.is_finished:
        eng.step()
    assert eng.store.flush(timeout=30)
    S, K = eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes
    stats = eng.stats()
    assert stats['store_put_bytes'] == {'state': S, 'kv': 8 * K}      # the save at 128 re-put blocks 0..3
    assert failed == [key(eng, 'kv', ids, 16)]
    assert not mooncake_store.exists(key(eng, 'state', ids, 64)) and mooncake_store.exists(key(eng, 'state', ids, 128))
    assert_prefix_complete(eng, mooncake_store, ids, [64, 128])
    assert seq.output_ids == cold(ids) and eng.is_idle()


def test_state_is_not_put_when_a_queued_block_put_of_its_prefix_failed(make_engine, cold, mooncake_store):
    ids = prompt(150, seed=1100)
    eng = make_engine()
    put, release, failed = eng.store.client.put, threading.Event(), []

    def slow_failing_first_put(k, v, **kw):
        if not failed:      # the save at 64 stalls until the save at 128 has been queued, then fails
            failed.append(k)
            release.wait(30)
            return PutResult.FAILED
        return put(k, v, **kw)

    eng.store.client.put = slow_failing_first_put
    seq = eng.generate(ids, GEN)
    release.set()
    assert eng.store.flush(timeout=30)
    assert_prefix_complete(eng, mooncake_store, ids, [64, 128])
    assert not mooncake_store.exists(key(eng, 'state', ids, 128))
    assert eng.stats()['store_put_failures'] == 1
    # the next turn's save re-puts the missing blocks, and its state then has a complete prefix
    longer = seq.token_ids + prompt(60, seed=1101)
    turn2 = eng.generate(longer, GEN)
    assert turn2.stats.plans[0].save_points == [192]
    assert eng.store.flush(timeout=30)
    assert mooncake_store.exists(key(eng, 'state', longer, 192))
    assert_prefix_complete(eng, mooncake_store, longer, [64, 128, 192])
    assert turn2.output_ids == cold(longer) and eng.is_idle()


def test_embedded_mode_starts_its_own_master_and_stops_it_on_close(tiny_qwen3_next, cold, tmp_path):
    from lmdeploy.pytorch.store.mooncake_client import tcp_reachable
    ids = prompt(150, seed=1200)
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, mooncake_master='local',
               mooncake_embedded_segment_size=SMALL_SEGMENT, mooncake_local_buffer_size=BUFFER)
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(**cfg))
    services = eng.store.services
    try:
        assert eng.generate(ids, GEN).output_ids == cold(ids)
        assert eng.store.flush(timeout=30)
        assert eng.stats()['store_put_objects'] == {'state': 2, 'kv': 8}
        assert eng.store.secret is not None and len(eng.store.secret) == 64     # made for this run
        outsider = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(services)))
        try:        # without the run's secret: another namespace, so no hit and nothing to reject
            seq = outsider.generate(ids, GEN)
            assert seq.stats.store_hit_tokens == 0 and seq.output_ids == cold(ids)
            assert outsider.stats()['store_rejected_objects'] == 0
        finally:
            outsider.close()
        secret_file = tmp_path / 'secret'
        secret_file.write_bytes(eng.store.secret)
        cfg = store_config(services, store_secret_file=str(secret_file))
        reader = Engine(tiny_qwen3_next, PytorchEngineConfig(**cfg))
        try:
            seq = reader.generate(ids, GEN)
            assert seq.stats.store_hit_tokens == 128 and seq.output_ids == cold(ids)
        finally:
            reader.close()
    finally:
        eng.close()
    assert not tcp_reachable(services.host, services.rpc_port, 0.5)


def test_full_attention_models_do_not_use_the_store(tiny_qwen3, mooncake_services, caplog):
    caplog.set_level('INFO', logger='lmdeploy')
    eng = Engine(tiny_qwen3, PytorchEngineConfig(**store_config(mooncake_services)))
    assert eng.store is None and 'Mooncake Store tier is not used' in caplog.text
    ids = prompt(80, seed=700)
    assert eng.generate(ids, GEN).output_ids == eng.generate(ids, GEN).output_ids
    eng.close()


def test_store_without_prefix_caching_is_not_started_and_says_so(tiny_qwen3_next, caplog):
    caplog.set_level('WARNING', logger='lmdeploy')
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                      mooncake_master='local'))
    try:
        assert eng.store is None
        assert 'needs enable_prefix_caching' in caplog.text
    finally:
        eng.close()
