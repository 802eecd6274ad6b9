"""The OpenAI-compatible server with the Mooncake Store: the Store metric series move with a
conversation and a fresh server restores from the Store; SIGTERM stops the embedded Store
services; the engine collector's Store series stay monotonic. Servers use the hybrid geometry of
tests/test_api_server.py (B=16, A=64, P=128).
"""
from __future__ import annotations

import os
import time
import uuid

import pytest
from server_utils import ApiServer
from api_server_helpers import ALIGN, HYBRID, SYSTEM_A, SYSTEM_B, TURNS, chat, is_idle, metrics, shared_head

from lmdeploy.metrics import EngineStatsCollector, ServerMetrics
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill


# the Mooncake Store tier through the server ------------------------------------------------------------------
@pytest.fixture(scope='module')
def store_servers(mooncake_services, tiny_qwen3_next):
    """Two hybrid servers sharing one external Mooncake Store (each with an empty local cache)."""
    flags = (*HYBRID, '--enable-prefix-caching', '--mooncake-master', mooncake_services.master_address,
             '--mooncake-metadata-server', mooncake_services.metadata_server,
             '--mooncake-local-buffer-size', str(16 << 20))
    pair = [ApiServer(tiny_qwen3_next, *flags), ApiServer(tiny_qwen3_next, *flags)]
    try:
        for p in pair:
            p.launch()
        for p in pair:
            p.wait_ready()
        yield pair
    finally:
        for p in pair:
            p.stop()


def wait_idle(server, timeout=20) -> dict:
    deadline = time.monotonic() + timeout
    while not is_idle(ledger := server.get('/debug/ledger')[1]):
        assert time.monotonic() < deadline, ledger
        time.sleep(0.05)
    return ledger


def test_store_series_move_and_a_fresh_server_restores_from_the_store(store_servers):
    writer, reader = store_servers
    # a system prompt no other test (or earlier session run) has stored
    messages = [{'role': 'system', 'content': f'Ledger {uuid.uuid4().hex}. ' + SYSTEM_B},
                {'role': 'user', 'content': TURNS[0]}]
    first = chat(writer, messages)
    n = first.usage.prompt_tokens
    wait_idle(writer)                                   # the Store worker finished its puts
    put = metrics(writer)
    # the system prompt's end (the shared head) is one of the save points
    plan = plan_prefill(n, 0, 128, 16, ALIGN, False, shared_head_tokens=shared_head(writer, messages))
    last = plan.save_points[-1]
    assert put['lmdeploy_store_put_objects_total{kind="state"}'] == len(plan.save_points)
    assert put['lmdeploy_store_put_objects_total{kind="kv"}'] == last // 16       # full blocks below b*
    state_bytes = put['lmdeploy_store_put_bytes_total{kind="state"}']
    kv_bytes = put['lmdeploy_store_put_bytes_total{kind="kv"}']
    assert state_bytes > 0 and state_bytes % len(plan.save_points) == 0 and kv_bytes % (last // 16) == 0
    assert put['lmdeploy_store_put_failures_total'] == 0

    again = chat(reader, messages)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == last
    got = metrics(reader)
    assert got['lmdeploy_store_hit_tokens_total'] == last
    assert got['lmdeploy_prefix_cache_hit_tokens_total'] == 0          # local hits only; its cache was empty
    assert got['lmdeploy_store_get_failures_total'] == 0 and got['lmdeploy_store_rejected_objects_total'] == 0


def _mooncake_children(pid: int) -> list[int]:
    """Pids of the ``mooncake_*`` processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open(f'/proc/{entry}/stat') as f:
                    comm, rest = f.read().split(' (', 1)[1].rsplit(')', 1)
            except (OSError, ValueError):
                continue
            if int(rest.split()[1]) == pid and comm.startswith('mooncake'):
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def test_sigterm_stops_the_embedded_store_services(tiny_qwen3_next):
    server = ApiServer(tiny_qwen3_next, *HYBRID, '--enable-prefix-caching', '--mooncake-master', 'local',
                       '--mooncake-embedded-segment-size', str(16 << 20)).start()
    try:
        children = _mooncake_children(server.proc.pid)      # mooncake_master, mooncake_meta, mooncake_owner
        assert len(children) == 3, children
        assert chat(server, [{'role': 'user', 'content': SYSTEM_A}]).usage.prompt_tokens > ALIGN
        server.proc.terminate()
        assert server.proc.wait(timeout=30) == 143     # a graceful exit, not death by the re-raised signal
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), 'embedded Mooncake processes outlived the server'
    finally:
        server.stop()


# metrics unit (no server) ----------------------------------------------------------------------------------
def test_engine_collector_exports_store_series_and_stays_monotonic():
    from prometheus_client import generate_latest
    stats = {'prefix_cache_queried_tokens': 100, 'checkpoints_skipped': {'no_free_slot': 2, 'exists': 1},
             'store_put_bytes': {'state': 4096, 'kv': 8192}, 'store_put_objects': {'state': 1, 'kv': 2},
             'store_hit_tokens': 64}
    m = ServerMetrics(lambda: stats)
    text = generate_latest(m.registry).decode()
    assert 'lmdeploy_store_put_bytes_total{kind="kv"} 8192.0' in text
    assert 'lmdeploy_store_put_objects_total{kind="state"} 1.0' in text
    assert 'lmdeploy_checkpoints_skipped_total{reason="exists"} 1.0' in text
    assert 'lmdeploy_store_get_failures_total 0.0' in text                      # missing key = 0
    stats = {'prefix_cache_queried_tokens': 40}                                  # a lower reading ...
    text = generate_latest(m.registry).decode()
    assert 'lmdeploy_prefix_cache_queried_tokens_total 100.0' in text           # ... never lowers a counter
    assert 'lmdeploy_checkpoints_skipped_total{reason="exists"} 1.0' in text
    collector = EngineStatsCollector(lambda: {'store_put_bytes': {'kv': 5}})
    families = {f.name: f for f in collector.collect()}
    assert sorted((s.labels['kind'], s.value) for s in families['lmdeploy_store_put_bytes'].samples) == \
        [('kv', 5.0), ('state', 0.0)]
