"""Store trust against a real ``mooncake_master`` on 127.0.0.1: model identity, authenticated
objects, loopback-only listeners, and what ``--api-keys`` covers.

- A checkpoint that differs from another in one tensor gets its own namespace and its own
  (cache-off) output, never the other's restored state.
- Objects forged by any client that reaches the master (valid header and checksum, no MAC or a
  MAC under the wrong secret) are rejected, counted, never restored; the request is served cold
  with the correct output.
- Engines sharing a secret (file or environment) restore each other's prefixes; Store bytes stay
  ``len(save_points)·S + new_blocks·K_blk`` (payload only), the values put are that plus
  ``OBJECT_OVERHEAD`` (64-byte header + 32-byte MAC) per object.
- Every listening socket of ``lmdeploy serve api_server --server-name 127.0.0.1
  --mooncake-master local`` and its children is on loopback: bound to 127.0.0.1, or (the ports
  Mooncake binds to every interface with no setting to change it) pinned to the ``lo`` interface.

Geometry as in tests/test_store_engine.py: B = 16, A = 64, P = 64, tiny hybrid Qwen3-Next.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_specs import kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
from lmdeploy.pytorch.store.listeners import ExposedPortError, listening_fds, pin_new_listeners
from lmdeploy.pytorch.store.object_format import MAC_SIZE, OBJECT_OVERHEAD, encode_object, object_key

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)
SECRET = b'test-store-secret-0123456789abcdef'
TENSOR = 'model.layers.1.linear_attn.in_proj_qkvz.weight'


def store_config(services, **fields) -> dict:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
               mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
               mooncake_local_buffer_size=1 << 20)
    cfg.update(fields)
    return cfg


@pytest.fixture
def engines(mooncake_services):
    """``make(model, **fields)``: a Store-backed engine on the shared services, closed at teardown."""
    made = []

    def make(model: str, **fields) -> Engine:
        eng = Engine(model, PytorchEngineConfig(**store_config(mooncake_services, **fields)))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def cold_output(model: str, ids: list[int]) -> list[int]:
    eng = Engine(model, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                            max_prefill_token_num=P))
    try:
        return eng.generate(ids, GEN).output_ids
    finally:
        eng.close()


@pytest.fixture(scope='module')
def secret_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp('secret') / 'store.secret'
    path.write_bytes(SECRET + b'\n')
    return str(path)


# model identity ------------------------------------------------------------------------------
def test_a_one_tensor_variant_gets_another_namespace_and_its_own_output(tiny_qwen3_next, engines, tmp_path):
    from safetensors.torch import load_file, save_file
    variant = tmp_path / 'variant'
    shutil.copytree(tiny_qwen3_next, variant)
    weights = load_file(variant / 'model.safetensors')
    gen = torch.Generator().manual_seed(13)
    weights[TENSOR] = weights[TENSOR] + 0.5 * torch.randn(weights[TENSOR].shape, generator=gen)
    save_file(weights, variant / 'model.safetensors', metadata={'format': 'pt'})
    # same config, same file size: only the bytes of one tensor differ (a partial fine-tune)
    assert (variant / 'config.json').read_text() == (Path(tiny_qwen3_next) / 'config.json').read_text()
    sizes = {(folder / 'model.safetensors').stat().st_size for folder in (variant, Path(tiny_qwen3_next))}
    assert len(sizes) == 1

    ids = prompt(150, seed=1300)
    original, changed = cold_output(tiny_qwen3_next, ids), cold_output(str(variant), ids)
    assert original != changed          # the tensor matters: a restored original state would be wrong
    writer = engines(tiny_qwen3_next)
    assert writer.generate(ids, GEN).output_ids == original
    assert writer.store.flush(timeout=30)

    reader = engines(str(variant))
    seq = reader.generate(ids, GEN)
    assert reader.store.namespace != writer.store.namespace
    assert seq.num_cached_tokens == 0 and seq.output_ids == changed
    assert reader.stats()['store_rejected_objects'] == 0

    copy = tmp_path / 'copy'                     # control: the same bytes elsewhere share the namespace
    shutil.copytree(tiny_qwen3_next, copy)
    again = engines(str(copy))
    assert again.store.namespace == writer.store.namespace
    seq = again.generate(ids, GEN)
    assert seq.stats.store_hit_tokens == 128 and seq.output_ids == original


# authenticated objects ----------------------------------------------------------------------
def _all_keys(services) -> list[str]:
    """Every key in the Store, from the master's admin HTTP port (what any client that reaches it sees)."""
    with urllib.request.urlopen(f'http://{services.host}:{services.metrics_port}/get_all_keys', timeout=10) as r:
        text = r.read().decode()
    return re.findall(r'[0-9a-f]{32}/(?:kv|state)/[0-9a-f]+', text)


@pytest.mark.parametrize('forgery', ['no_mac', 'wrong_secret'])
def test_forged_objects_are_rejected_counted_and_never_restored(tiny_qwen3_next, engines, mooncake_services,
                                                                mooncake_store, secret_file, forgery):
    seed = 1400 + (forgery == 'wrong_secret')
    victim = engines(tiny_qwen3_next, store_secret_file=secret_file)
    S, K = victim.cache_engine.state_bytes, victim.cache_engine.kv_block_bytes
    # the attacker learns the namespace from keys the victim stored earlier
    victim.generate(prompt(70, seed=seed + 10), GEN)
    assert victim.store.flush(timeout=30)
    ns_hex = victim.store.ns_hex
    assert any(k.startswith(ns_hex + '/state/') for k in _all_keys(mooncake_services))

    ids = prompt(150, seed=seed)            # a prompt the victim has not served yet
    hashes = chain_block_hashes(ids, B, 128 // B)
    ns = bytes.fromhex(ns_hex)

    def forged(kind: str, tokens: int, size: int, key: str) -> bytes:
        payload = torch.randn(size // 4, generator=torch.Generator().manual_seed(tokens)).numpy().tobytes()
        if forgery == 'no_mac':             # valid header and checksum, no MAC trailer
            return encode_object(kind, ns, tokens, payload, key=key)[:-MAC_SIZE]
        return encode_object(kind, ns, tokens, payload, b'attacker-guessed-secret-value', key=key)

    for i, h in enumerate(hashes):
        k = object_key(ns_hex, 'kv', h.hex())
        assert mooncake_store.put(k, forged('kv', (i + 1) * B, K, k))
    for b in (64, 128):
        k = object_key(ns_hex, 'state', hashes[b // B - 1].hex())
        assert mooncake_store.put(k, forged('state', b, S, k))

    cold = cold_output(tiny_qwen3_next, ids)
    before = victim.stats()
    seq = victim.generate(ids, GEN)
    after = victim.stats()
    # the deepest boundary is tried: its state fails its MAC, so the load verifies every object of
    # that prefix (the 8 forged KV blocks fail too) and marks all 9 bad; the boundary at 64 then has
    # no usable KV below it and is not tried
    assert after['store_rejected_objects'] - before['store_rejected_objects'] == 9
    assert seq.num_cached_tokens == 0 and after['store_hit_tokens'] == before['store_hit_tokens']
    assert seq.output_ids == cold
    # the victim's own saves replaced every object it rejected (the forged state at 64, never read,
    # stays until an engine rejects it)
    assert victim.store.flush(timeout=30)
    assert victim.stats()['store_repaired_objects'] - before['store_repaired_objects'] == 9
    # a second engine with the secret and an empty local cache restores the repaired prefix
    other = engines(tiny_qwen3_next, store_secret_file=secret_file)
    seq = other.generate(ids, GEN)
    assert other.stats()['store_rejected_objects'] == 0 and seq.num_cached_tokens == 128 and seq.output_ids == cold
    assert victim.store.flush(timeout=30) and other.store.flush(timeout=30) and victim.is_idle() and other.is_idle()


def test_engines_sharing_a_secret_restore_each_other_and_others_stay_apart(tiny_qwen3_next, engines, secret_file,
                                                                          monkeypatch, caplog):
    ids = prompt(150, seed=1500)
    cold = cold_output(tiny_qwen3_next, ids)
    writer = engines(tiny_qwen3_next, store_secret_file=secret_file)
    S, K = state_bytes_per_slot(writer.specs), kv_bytes_per_block(writer.specs, B)
    seq = writer.generate(ids, GEN)
    assert writer.store.flush(timeout=30)
    assert seq.stats.plans[0].save_points == [64, 128] and seq.output_ids == cold
    stats = writer.stats()
    # counted bytes are payload bytes: the formula exactly; each value also carries header + MAC
    assert stats['store_put_bytes'] == {'state': 2 * S, 'kv': 8 * K}
    assert stats['store_put_objects'] == {'state': 2, 'kv': 8}
    assert writer.store.client.stats.put_bytes == 2 * S + 8 * K + 10 * OBJECT_OVERHEAD
    assert OBJECT_OVERHEAD == 64 + 32

    monkeypatch.setenv('LMDEPLOY_STORE_SECRET', SECRET.decode())       # the same secret, from the environment
    reader = engines(tiny_qwen3_next)
    assert reader.store.namespace == writer.store.namespace
    seq = reader.generate(ids, GEN)
    assert seq.stats.store_hit_tokens == seq.num_cached_tokens == 128 and seq.output_ids == cold
    assert reader.stats()['store_rejected_objects'] == 0

    monkeypatch.setenv('LMDEPLOY_STORE_SECRET', 'a-different-team-secret-value')
    stranger = engines(tiny_qwen3_next)
    monkeypatch.delenv('LMDEPLOY_STORE_SECRET')
    caplog.set_level(logging.WARNING, logger='lmdeploy')
    open_engine = engines(tiny_qwen3_next)
    assert 'NOT authenticated' in caplog.text and 'can put objects that change' in caplog.text
    for eng in (stranger, open_engine):     # other secret / no secret: another namespace, nothing to reject
        assert eng.store.namespace != writer.store.namespace
        seq = eng.generate(ids, GEN)
        assert seq.num_cached_tokens == 0 and seq.output_ids == cold
        assert eng.stats()['store_rejected_objects'] == 0
        assert eng.store.flush(timeout=30) and eng.stats()['store_put_objects']['state'] == 2


def test_a_bad_secret_is_a_config_error_naming_the_field(tiny_qwen3_next, mooncake_services, tmp_path):
    short = tmp_path / 'short'
    short.write_text('too short\n')
    for path, match in ((short, 'store_secret_file.*at least 16 bytes'), (tmp_path / 'nope', 'store_secret_file')):
        with pytest.raises(ValueError, match=match):
            Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(mooncake_services, store_secret_file=str(path))))


# listeners -----------------------------------------------------------------------------------
def _ss_devices() -> dict[int, str | None]:
    """Port -> the interface a wildcard TCP listener is pinned to (``ss`` prints ``0.0.0.0%lo:PORT``)."""
    out = subprocess.run(['ss', '-ltnH'], capture_output=True, text=True, check=True).stdout
    devices = {}
    for line in out.splitlines():
        local = line.split()[3]
        m = re.match(r'^(.*?)(?:%(\S+))?:(\d+)$', local)
        if m and m.group(1) in ('0.0.0.0', '*', '[::]', '::'):
            devices[int(m.group(3))] = m.group(2)
    return devices


def test_every_listener_of_a_local_store_server_is_on_loopback(tiny_qwen3_next):
    psutil = pytest.importorskip('psutil')
    if shutil.which('ss') is None:
        pytest.skip('ss (iproute2) is needed to read which interface a socket is pinned to')
    from server_utils import ApiServer, http_json
    server = ApiServer(tiny_qwen3_next, '--block-size', '16', '--prefill-save-alignment', '64',
                       '--max-prefill-token-num', '128', '--session-len', '2048', '--enable-prefix-caching',
                       '--mooncake-master', 'local', '--mooncake-embedded-segment-size', str(16 << 20)).start()
    try:
        status, body = http_json(server.base_url + '/v1/completions',
                                 {'model': Path(tiny_qwen3_next).name, 'prompt': list(range(5, 200)),
                                  'max_tokens': 2})
        assert status == 200, body
        root = psutil.Process(server.proc.pid)
        procs = [root] + root.children(recursive=True)
        assert {p.name() for p in procs} >= {'mooncake_master', 'mooncake_meta', 'mooncake_owner'}
        listeners = [(p.name(), c.laddr.ip, c.laddr.port) for p in procs
                     for c in p.net_connections(kind='inet') if c.status == psutil.CONN_LISTEN]
        devices = _ss_devices()
        exposed = [item for item in listeners if item[1] not in ('127.0.0.1', '::1') and devices.get(item[2]) != 'lo']
        assert exposed == [], f'listening beyond loopback: {exposed} (all: {listeners})'
        assert (root.name(), '127.0.0.1', server.port) in listeners
        pinned = [item for item in listeners if devices.get(item[2]) == 'lo']
        # Mooncake's transfer ports (handshake + data) of the engine and of the segment owner
        assert len([i for i in pinned if i[0] == root.name()]) == 2 and \
            len([i for i in pinned if i[0] == 'mooncake_owner']) == 2, listeners
    finally:
        server.stop()


def test_pin_new_listeners_pins_only_new_wildcard_sockets():
    old = socket.create_server(('0.0.0.0', 0))
    before = listening_fds()
    assert old.fileno() in {item.fd for item in before}
    new_wild, new_local = socket.create_server(('0.0.0.0', 0)), socket.create_server(('127.0.0.1', 0))
    try:
        pinned = pin_new_listeners(before, 'test')
        assert [item.fd for item in pinned] == [new_wild.fileno()]
        assert new_wild.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16).rstrip(b'\0') == b'lo'
        assert old.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16).rstrip(b'\0') == b''
        with socket.create_connection(('127.0.0.1', new_wild.getsockname()[1]), timeout=2):
            pass                                            # still reachable from this machine
    finally:
        for s in (old, new_wild, new_local):
            s.close()


def test_an_unpinnable_port_is_refused_unless_allowed(monkeypatch):
    import lmdeploy.pytorch.store.listeners as listeners

    def refuse(fd):
        raise PermissionError(1, 'Operation not permitted')

    monkeypatch.setattr(listeners, 'pin_to_loopback', refuse)
    before = listening_fds()
    sock = socket.create_server(('0.0.0.0', 0))
    try:
        with pytest.raises(ExposedPortError, match=f'0.0.0.0:{sock.getsockname()[1]}.*LMDEPLOY_STORE_ALLOW_EXPOSED'):
            pin_new_listeners(before, 'test')
        monkeypatch.setenv('LMDEPLOY_STORE_ALLOW_EXPOSED_PORTS', '1')
        assert pin_new_listeners(before, 'test') == []
    finally:
        sock.close()


# API keys ------------------------------------------------------------------------------------
class _StubLoop:
    def call(self, fn, timeout=None):
        return {}


class _StubTokenizer:
    chat_template = ''


class _StubPipe:
    """What the server asks of a Pipeline for /metrics: no engine counters yet."""
    loop = _StubLoop()
    tokenizer = _StubTokenizer()

    def stats(self, timeout: float = 60.0) -> dict:
        return {}

    def ledger(self, timeout: float = 60.0) -> dict:
        return {}


@pytest.mark.parametrize('protect_metrics', [False, True])
def test_api_keys_cover_docs_and_schema_and_optionally_metrics(protect_metrics):
    from fastapi.testclient import TestClient

    from lmdeploy.serve.openai.api_server import create_app
    client = TestClient(create_app(_StubPipe(), 'm', ['k1'], protect_metrics=protect_metrics))
    key = {'Authorization': 'Bearer k1'}
    for path in ('/docs', '/openapi.json'):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=key).status_code == 200, path
    assert '/v1/chat/completions' in client.get('/openapi.json', headers=key).json()['paths']
    assert client.get('/health').status_code == 200
    assert client.get('/metrics').status_code == (401 if protect_metrics else 200)
    assert client.get('/metrics', headers=key).status_code == 200
    assert client.get('/redoc').status_code == 404
    open_client = TestClient(create_app(_StubPipe(), 'm', None, protect_metrics=protect_metrics))
    assert [open_client.get(p).status_code for p in ('/docs', '/openapi.json', '/metrics')] == [200, 200, 200]
