"""Store objects are bound to their keys, against a real ``mooncake_master`` on 127.0.0.1.

Anyone who reaches the master (no secret needed) can list the keys (the admin port), read a
genuine object and re-put it under another key (``upsert``). A genuine object under any key but
its own must never be restored: the reader rejects it (counted in ``store_rejected_objects``),
computes the prefix, and answers exactly like a cold engine. With a secret the MAC covers the
full key; without one the header's key digest (covered by the checksum) catches a plain copy.

Geometry as in tests/test_store_trust.py: B = 16, A = 64, P = 64, tiny hybrid Qwen3-Next.
"""
from __future__ import annotations

import re
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)


def store_config(services, **fields) -> PytorchEngineConfig:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
               mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
               mooncake_local_buffer_size=1 << 20)
    cfg.update(fields)
    return PytorchEngineConfig(**cfg)


def namespace_keys(services, ns_hex: str) -> list[str]:
    """Every key of namespace ``ns_hex``, from the master's admin port (what any client sees)."""
    with urllib.request.urlopen(f'http://{services.host}:{services.metrics_port}/get_all_keys', timeout=10) as r:
        text = r.read().decode()
    return sorted(set(re.findall(re.escape(ns_hex) + r'/(?:kv|state)/[0-9a-f]+', text)))


def serve(eng: Engine, turns: list[list[int]]) -> list:
    """Serve a conversation (each turn: previous input + reply + the new user ids); the sequences."""
    ids, seqs = [], []
    for user in turns:
        seq = eng.generate(ids + user, GEN)
        seqs.append(seq)
        ids = list(seq.token_ids)
    return seqs


CONVERSATIONS = [[prompt(150, seed=3100), prompt(60, seed=3101)],
                 [prompt(150, seed=3102), prompt(60, seed=3103)]]    # the same depths: swappable objects


def depth(value: bytes) -> int:
    """The token count a value's header carries (its depth in its chain)."""
    return int.from_bytes(value[24:32], 'little')


@pytest.fixture(scope='module')
def conversation(tiny_qwen3_next, mooncake_services, mooncake_store, tmp_path_factory):
    """A conversation saved by a writer with a secret of its own: the cold outputs, the genuine
    values of every key the writer stored, and the secret file."""
    secret = tmp_path_factory.mktemp('binding') / 'store.secret'
    secret.write_bytes(b'key-binding-test-secret-0123456789')
    cold = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                                       max_prefill_token_num=P))
    try:
        cold_outputs = [[seq.output_ids for seq in serve(cold, turns)] for turns in CONVERSATIONS]
    finally:
        cold.close()
    writer = Engine(tiny_qwen3_next, store_config(mooncake_services, store_secret_file=str(secret)))
    try:
        assert [[seq.output_ids for seq in serve(writer, turns)] for turns in CONVERSATIONS] == cold_outputs
        assert writer.store.flush(timeout=30)
        ns_hex = writer.store.ns_hex
    finally:
        writer.close()
    keys = namespace_keys(mooncake_services, ns_hex)
    assert sum('/state/' in k for k in keys) >= 6 and sum('/kv/' in k for k in keys) >= 20
    genuine = {k: mooncake_store.get(k) for k in keys}
    assert all(genuine.values())
    return dict(cold=cold_outputs, genuine=genuine, secret=str(secret))


def _restore_genuine(store, genuine: dict) -> None:
    for k, v in genuine.items():
        assert store._store.upsert(k, v) == 0


def _copy_attack(store, genuine: dict, mapping: dict) -> None:
    """Put the genuine value of ``mapping[key]`` under ``key`` (overwriting), as an attacker with
    only master access can."""
    for target, source in mapping.items():
        assert store._store.upsert(target, genuine[source]) == 0


def copies(genuine: dict):
    """Each key gets the genuine object of another key: any other, those of the same kind and
    depth (the other conversation's, which the header alone cannot tell apart) listed first,
    so that Hypothesis starts from, and shrinks towards, the hardest copies."""
    def others(k):
        same = [o for o in genuine if o != k and o.split('/')[1] == k.split('/')[1]
                and depth(genuine[o]) == depth(genuine[k])]
        return same + [o for o in genuine if o != k and o not in same]
    return st.fixed_dictionaries({k: st.sampled_from(others(k)) for k in sorted(genuine)})


def _read_back(tiny_qwen3_next, services, secret) -> dict:
    reader = Engine(tiny_qwen3_next, store_config(services, store_secret_file=secret))
    try:
        convs = [serve(reader, turns) for turns in CONVERSATIONS]
        assert reader.store.flush(timeout=30)
        return dict(outputs=[[s.output_ids for s in seqs] for seqs in convs],
                    hits=[s.stats.store_hit_tokens for seqs in convs for s in seqs],
                    stats=reader.stats(), idle=reader.is_idle())
    finally:
        reader.close()


def test_copied_objects_are_never_restored(tiny_qwen3_next, mooncake_services, mooncake_store, conversation):
    """Property: whichever way two conversations' genuine objects are moved between their keys
    (each key holding another key's object), a fresh engine with the secret restores none of
    them, counts them rejected, and answers exactly like a cold engine."""
    genuine = conversation['genuine']

    @settings(max_examples=3, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(copies(genuine))
    def check(mapping):
        _copy_attack(mooncake_store, genuine, mapping)
        try:
            got = _read_back(tiny_qwen3_next, mooncake_services, conversation['secret'])
        finally:
            _restore_genuine(mooncake_store, genuine)
        assert got['outputs'] == conversation['cold']
        assert got['hits'] == [0] * 4 and got['stats']['store_hit_tokens'] == 0
        assert got['stats']['store_rejected_objects'] >= 1 and got['idle']

    check()


def test_one_state_moved_to_another_prompts_key_at_the_same_depth_is_rejected(tiny_qwen3_next, mooncake_services,
                                                                              mooncake_store, conversation):
    """The reported case: prompt X's state at depth d re-put under prompt Y's state key at d,
    and X's KV blocks under Y's KV keys (every object genuine, every key Y's). Regression: the
    format without key binding restored Y from X's bytes."""
    genuine = conversation['genuine']
    other_ids = prompt(150, seed=3199)
    writer = Engine(tiny_qwen3_next, store_config(mooncake_services, store_secret_file=conversation['secret']))
    try:
        cold_y = writer.generate(other_ids, GEN).output_ids    # Y computed once: its keys now exist
        assert writer.store.flush(timeout=30)
        y_keys = [k for k in namespace_keys(mooncake_services, writer.store.ns_hex) if k not in genuine]
    finally:
        writer.close()
    x_keys = [k for k in genuine if k not in y_keys]

    def by_depth(keys, values):         # (kind, depth) -> key; X: one of the two conversations' objects
        return {(k.split('/')[1], depth(values[k])): k for k in keys}
    y_values = {k: mooncake_store.get(k) for k in y_keys}
    x_by, y_by = by_depth(x_keys, genuine), by_depth(y_keys, y_values)
    mapping = {y_by[d]: x_by[d] for d in y_by if d in x_by}
    assert any(d[0] == 'state' for d in y_by if d in x_by)
    _copy_attack(mooncake_store, genuine, mapping)
    try:
        reader = Engine(tiny_qwen3_next, store_config(mooncake_services, store_secret_file=conversation['secret']))
        try:
            seq = reader.generate(other_ids, GEN)
            stats = reader.stats()
            assert reader.store.flush(timeout=30)
        finally:
            reader.close()
    finally:
        for k, v in y_values.items():
            mooncake_store._store.upsert(k, v)
    assert seq.output_ids == cold_y and seq.stats.store_hit_tokens == 0
    assert stats['store_rejected_objects'] >= 1


def test_without_a_secret_a_plain_copy_is_rejected_too(tiny_qwen3_next, mooncake_services, mooncake_store):
    """No secret: the key digest in the (checksummed) header still rejects a copied object."""
    ids = prompt(150, seed=3150)
    ns = 'f' * 31 + '0'
    cfg = store_config(mooncake_services, store_namespace=ns)
    writer = Engine(tiny_qwen3_next, cfg)
    try:
        cold = writer.generate(ids, GEN).output_ids
        assert writer.store.flush(timeout=30)
        keys = namespace_keys(mooncake_services, writer.store.ns_hex)
    finally:
        writer.close()
    genuine = {k: mooncake_store.get(k) for k in keys}
    _copy_attack(mooncake_store, genuine, dict(zip(keys, keys[1:] + keys[:1])))   # a rotation
    reader = Engine(tiny_qwen3_next, cfg)
    try:
        seq = reader.generate(ids, GEN)
        assert seq.output_ids == cold and seq.stats.store_hit_tokens == 0
        assert reader.stats()['store_rejected_objects'] >= 1
    finally:
        reader.close()
