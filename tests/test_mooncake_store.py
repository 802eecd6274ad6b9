"""StoreClient and MooncakeServices against a real mooncake_master on 127.0.0.1."""
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest_store import unique_namespace
from lmdeploy.pytorch.store.backend import PutResult
from lmdeploy.pytorch.store.mooncake_client import ERR_RPC_FAIL, StoreClient, StoreUnavailableError
from lmdeploy.pytorch.store.object_format import (OBJECT_OVERHEAD, StoreObjectError, decode_object, encode_object,
                                                  object_key)
from lmdeploy.pytorch.store.services import MooncakeServices, find_binary, free_ports

REPO = Path(__file__).resolve().parents[1]
NS = bytes(range(16))
needs_mooncake = pytest.mark.skipif(find_binary('mooncake_master') is None,
                                    reason='mooncake_master binary not found: pip install -r requirements/store.txt')


def _key(kind='kv', h='00'):
    return object_key(unique_namespace(), kind, h)


def test_one_mib_object_round_trips(mooncake_store):
    payload = os.urandom(1 << 20)
    key = _key('state', 'ab' * 16)
    puts_before = mooncake_store.stats.puts
    assert mooncake_store.put(key, encode_object('state', NS, 2048, payload, key=key)) is PutResult.STORED
    value = mooncake_store.get(key)
    assert len(value) == (1 << 20) + OBJECT_OVERHEAD
    assert bytes(decode_object(value, 'state', NS, 2048, key=key)) == payload
    assert mooncake_store.stats.puts == puts_before + 1


def test_exists_and_batch_exists_report_exactly_the_stored_keys(mooncake_store):
    stored, missing = _key(), _key()
    assert mooncake_store.exists(stored) is False
    assert mooncake_store.put(stored, b'x' * 100) is PutResult.STORED
    assert mooncake_store.exists(stored) is True
    assert mooncake_store.batch_exists([stored, missing, stored]) == [True, False, True]
    assert mooncake_store.batch_exists([]) == []


def test_missing_key_is_a_counted_miss_not_a_failure(mooncake_store):
    misses, failures = mooncake_store.stats.get_misses, mooncake_store.stats.get_failures
    assert mooncake_store.get(_key()) is None
    assert (mooncake_store.stats.get_misses, mooncake_store.stats.get_failures) == (misses + 1, failures)


def test_put_of_existing_key_succeeds_and_keeps_the_first_value(mooncake_store):
    key = _key()
    assert mooncake_store.put(key, b'first') is PutResult.STORED
    assert mooncake_store.put(key, b'second value') is PutResult.EXISTS      # nothing gained
    # equal bytes cannot be told apart, which is why every Store object carries its writer's id
    assert mooncake_store.put(key, b'first') is PutResult.STORED
    assert mooncake_store.get(key) == b'first'


def test_value_larger_than_local_buffer_fails_without_raising(mooncake_store):
    failures = mooncake_store.stats.put_failures
    key = _key()
    assert mooncake_store.put(key, bytes((16 << 20) + 1)) is PutResult.FAILED
    assert mooncake_store.stats.put_failures == failures + 1
    assert mooncake_store.exists(key) is False


def test_object_put_by_an_exited_process_is_readable(mooncake_services, mooncake_store):
    key = _key('kv', 'cd' * 16)
    script = ('import sys\n'
              'from lmdeploy.pytorch.store.mooncake_client import StoreClient\n'
              'from lmdeploy.pytorch.store.object_format import encode_object\n'
              'c = StoreClient.connect(sys.argv[1], sys.argv[2])\n'
              'v = encode_object("kv", bytes(range(16)), 64, bytes(range(256)) * 1024, key=sys.argv[3])\n'
              'ok = c.put(sys.argv[3], v).gained\n'
              'c.close()\n'
              'sys.exit(0 if ok else 3)\n')
    env = dict(os.environ, PYTHONPATH=str(REPO), MC_TCP_BIND_ADDRESS='127.0.0.1')
    proc = subprocess.run([sys.executable, '-c', script, mooncake_services.master_address,
                           mooncake_services.metadata_server, key], env=env, cwd=REPO, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr.decode(errors='replace')[-2000:]
    value = mooncake_store.get(key)
    assert bytes(decode_object(value, 'kv', NS, 64, key=key)) == bytes(range(256)) * 1024


def test_corrupt_and_foreign_objects_read_back_are_rejected(mooncake_store):
    keys = [_key() for _ in range(4)]
    good = encode_object('kv', NS, 64, b'block bytes' * 100, key=keys[0])
    corrupt = bytearray(good)
    corrupt[-OBJECT_OVERHEAD] ^= 0x40          # a payload byte
    foreign = encode_object('kv', bytes(16), 64, b'block bytes' * 100, key=keys[1])
    values = (bytes(corrupt), foreign, b'not a store object at all, but long enough' * 2, good)  # good: copied
    for key, value in zip(keys, values):
        assert mooncake_store.put(key, value) is PutResult.STORED
    reasons = []
    for key in keys:
        with pytest.raises(StoreObjectError) as info:
            decode_object(mooncake_store.get(key), 'kv', NS, 64, key=key)
        reasons.append(info.value.reason)
    assert reasons == ['checksum', 'namespace', 'magic', 'key']


def test_unreachable_master_raises_naming_the_address_within_seconds():
    port, = free_ports('127.0.0.1', 1)
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f'127.0.0.1:{port}'):
        StoreClient.connect(f'127.0.0.1:{port}', f'http://127.0.0.1:{port}/metadata', connect_timeout_s=1.0)
    assert time.monotonic() - start < 3.0


def test_unreachable_metadata_server_raises_naming_the_url(mooncake_services):
    port, = free_ports('127.0.0.1', 1)
    with pytest.raises(StoreUnavailableError, match=f'http://127.0.0.1:{port}/metadata'):
        StoreClient.connect(mooncake_services.master_address, f'http://127.0.0.1:{port}/metadata')


def test_connect_rejects_a_malformed_master_address():
    with pytest.raises(ValueError, match='master_address'):
        StoreClient.connect('127.0.0.1', 'http://127.0.0.1:1/metadata')


@needs_mooncake
def test_killed_master_turns_operations_into_fast_failures():
    with MooncakeServices(segment_size=16 << 20) as services:
        client = StoreClient.connect(services.master_address, services.metadata_server,
                                     local_buffer_size=1 << 20, retry_interval_s=30.0)
        key = _key()
        assert client.put(key, b'before') is PutResult.STORED
        services.kill_master()
        start = time.monotonic()
        assert client.put(_key(), b'after') is PutResult.FAILED   # Mooncake: -900 (RPC failure), at once
        assert time.monotonic() - start < 6.0
        assert client.available is False
        assert client.stats.last_error.endswith(f'code {ERR_RPC_FAIL}')
        start = time.monotonic()                            # breaker open: no native call at all
        results = (client.get(key), client.exists(key), client.batch_exists([key, key]), client.put(key, b'x'))
        assert time.monotonic() - start < 0.5
        assert results == (None, False, None, PutResult.FAILED)
        assert (client.stats.put_failures, client.stats.get_failures, client.stats.exists_failures) == (2, 1, 3)
        client.close()
        client.close()
        assert client.put(key, b'x') is PutResult.FAILED    # closed: no native call (it would segfault)


class _NativeStub:
    """Answers like the native store with a scripted put code; counts calls."""

    def __init__(self, codes):
        self.codes, self.calls, self.value = list(codes), 0, b''
        self.answering = threading.Event()      # cleared: existence queries hang (a stopped master)
        self.answering.set()

    def put(self, key, value):
        self.calls += 1
        self.value = bytes(value)
        return self.codes.pop(0)

    def get_into_ranges(self, ptrs, keys, dst, src, sizes):     # the read-back of a put
        n = sizes[0][0][0]
        ctypes.memmove(ptrs[0], self.value[:n], n)
        return [[[n]]]

    def is_exist(self, key):                # the breaker's health probe
        self.answering.wait(30)
        return 0

    def close(self):
        return 0


def test_breaker_probes_the_master_before_calling_again():
    listener = socket.create_server(('127.0.0.1', 0))     # stands for a master that is back
    port = listener.getsockname()[1]
    native = _NativeStub([ERR_RPC_FAIL, 0])
    client = StoreClient(native, ('127.0.0.1', port), local_buffer_size=1024, retry_interval_s=0.2,
                         probe=np.zeros(64, dtype=np.uint8))
    failed, stored = PutResult.FAILED, PutResult.STORED
    assert client.put('k', b'v') is failed and native.calls == 1
    assert client.put('k', b'v') is failed and native.calls == 1   # inside the retry interval
    time.sleep(0.25)
    assert client.put('k', b'v') is stored and native.calls == 2    # probe succeeded, called again
    assert client.available is True
    native.codes.append(ERR_RPC_FAIL)
    assert client.put('k', b'v') is failed and native.calls == 3
    listener.close()                                               # master gone for good
    time.sleep(0.25)
    assert client.put('k', b'v') is failed and native.calls == 3   # probe refused, no native call
    client.close()


@pytest.mark.timing
def test_breaker_stays_open_for_a_master_that_accepts_tcp_but_never_answers():
    """A stopped master (SIGSTOP) keeps accepting TCP connections: the health probe is a native
    existence query that must answer within probe_timeout_s, so the breaker stays open and each
    call fails within that bound instead of hanging; once the master answers, it closes."""
    listener = socket.create_server(('127.0.0.1', 0))
    native = _NativeStub([0, 0])
    client = StoreClient(native, ('127.0.0.1', listener.getsockname()[1]), local_buffer_size=1024,
                         retry_interval_s=0.2, probe=np.zeros(64, dtype=np.uint8), probe_timeout_s=0.2)
    native.answering.clear()
    client.trip()                                                  # e.g. a call missed the tier's deadline
    assert client.available is False
    time.sleep(0.25)
    start = time.monotonic()
    assert client.put('k', b'v') is PutResult.FAILED and native.calls == 0
    assert time.monotonic() - start < 0.2 + 0.15                   # one bounded probe, no put
    time.sleep(0.25)
    start = time.monotonic()                                       # the stuck probe is not repeated
    assert client.put('k', b'v') is PutResult.FAILED and time.monotonic() - start < 0.1
    native.answering.set()
    time.sleep(0.25)
    assert client.put('k', b'v') is PutResult.STORED and native.calls == 1 and client.available
    client.close()
    listener.close()


@needs_mooncake
def test_services_report_a_slow_start_with_address_and_log():
    services = MooncakeServices(segment_size=16 << 20, start_timeout_s=0.001)
    # whichever process is not ready first (on a loaded machine the master can beat the first probe)
    pattern = (r'((mooncake_master|metadata server) did not accept connections at 127\.0\.0\.1:\d+'
               r'|segment owner for master 127\.0\.0\.1:\d+ was not ready) within 0\.001 s; last lines of .*\.log')
    with pytest.raises(RuntimeError, match=pattern):
        services.start()
    assert services._master is None and services.log_dir is None      # stopped and cleaned up


@needs_mooncake
def test_stop_ends_every_process_and_frees_the_ports():
    services = MooncakeServices(segment_size=16 << 20).start()
    procs = (services._master, services._client, services._metadata)
    ports = (services.rpc_port, services.metadata_port, services.metrics_port)
    assert services.master_address == f'127.0.0.1:{ports[0]}'
    assert services.metadata_server == f'http://127.0.0.1:{ports[1]}/metadata'
    services.stop()
    assert all(p.poll() is not None for p in procs)
    for port in ports:
        with pytest.raises(OSError):
            socket.create_connection(('127.0.0.1', port), timeout=0.5).close()


def test_value_larger_than_the_readers_local_buffer_is_a_failure_not_a_miss(mooncake_services, mooncake_store):
    key = _key()
    assert mooncake_store.put(key, bytes(8 << 20)) is PutResult.STORED
    small = StoreClient.connect(mooncake_services.master_address, mooncake_services.metadata_server,
                                local_buffer_size=4 << 20)
    try:
        assert small.get(key) is None
        assert (small.stats.get_failures, small.stats.get_misses) == (1, 0)
        assert small.exists(key) is True
    finally:
        small.close()
