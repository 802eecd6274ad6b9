"""Store object format (header, payload, HMAC), keys, namespaces, model identity and the Store
secret (docs/en/advance/store.md, "Keys and value format"), and the fake client used for fault tests."""
import hashlib
import hmac
import json
import os
import pickle
import shutil
import struct
import zlib

import pytest
import torch

from lmdeploy.pytorch.store.backend import PutResult
from lmdeploy.pytorch.store.mooncake_client import FakeStoreClient
from lmdeploy.pytorch.store.identity import (engine_namespace, model_identity, resolve_secret, secret_key_id,
                                             weight_digest)
from lmdeploy.pytorch.store.object_format import (FORMAT_VERSION, HEADER_SIZE, MAC_SIZE, WRITER_OFFSET,
                                                  StoreObjectError, decode_object, encode_object, namespace_digest,
                                                  object_key)

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))


SECRET = b'0123456789abcdef-shared-secret'
KEY = object_key(NS.hex(), 'kv', 'ab' * 8)
SKEY = object_key(NS.hex(), 'state', 'ab' * 8)


def enc(kind, ns, tokens, payload, secret=None, key=None, writer=0):
    return encode_object(kind, ns, tokens, payload, secret, key=key or (SKEY if kind == 'state' else KEY),
                         writer=writer)


def dec(data, kind, ns, tokens, secret=None, key=None):
    return decode_object(data, kind, ns, tokens, secret, key=key or (SKEY if kind == 'state' else KEY))


def _key_mac(secret: bytes, key: str, covered: bytes) -> bytes:
    return hmac.new(secret, struct.pack('<H', len(key)) + key.encode() + covered, hashlib.sha256).digest()


def test_header_bytes_are_the_documented_layout():
    value = enc('state', NS, 1024, b'abc', SECRET, writer=0x0102030405060708)
    assert (HEADER_SIZE, MAC_SIZE, FORMAT_VERSION) == (64, 32, 3) and len(value) == 64 + 3 + 32
    assert value[:4] == b'LMDS'
    assert struct.unpack_from('<HBB', value, 4) == (FORMAT_VERSION, 2, 0)
    assert value[8:24] == NS
    assert struct.unpack_from('<QQQ', value, 24) == (1024, 3, 0x0102030405060708)
    assert value[48:56] == hashlib.blake2b(SKEY.encode(), digest_size=8).digest()      # the key's digest
    assert struct.unpack_from('<I', value, 56)[0] == 0
    assert struct.unpack_from('<I', value, 60)[0] == zlib.crc32(value[:60] + b'abc')
    assert value[64:67] == b'abc'
    assert value[67:] == _key_mac(SECRET, SKEY, value[:67])          # HMAC over key + header + payload
    unkeyed = enc('kv', NS, 64, b'')
    assert unkeyed[6] == 1 and unkeyed[64:] == _key_mac(b'', KEY, unkeyed[:64])


@pytest.mark.parametrize('make', [bytes, bytearray, memoryview,
                                  lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).reshape(4, -1)])
def test_round_trip_returns_the_payload_bytes(make):
    payload = bytes(range(256)) * 4
    value = enc('kv', NS, 128, make(payload))
    out = dec(value, 'kv', NS, 128)
    assert isinstance(out, memoryview) and out.readonly
    assert bytes(out) == payload


def test_empty_payload_round_trips():
    assert bytes(dec(enc('state', NS, 0, b''), 'state', NS, 0)) == b''


def _reason(data, kind='kv', ns=NS, tokens=64, secret=None, key=None):
    with pytest.raises(StoreObjectError) as info:
        dec(data, kind, ns, tokens, secret, key)
    assert isinstance(info.value, ValueError)
    return info.value.reason


def test_each_mismatch_is_rejected_with_its_reason():
    good = enc('kv', NS, 64, b'payload-bytes')
    assert _reason(good[:63]) == 'truncated'
    assert _reason(b'') == 'truncated'
    assert _reason(b'XXXX' + good[4:]) == 'magic'
    assert _reason(good[:4] + struct.pack('<H', FORMAT_VERSION + 1) + good[6:]) == 'version'
    assert _reason(good[:7] + b'\x01' + good[8:]) == 'version'          # reserved byte set
    assert _reason(good, kind='state') == 'kind'
    assert _reason(good, ns=OTHER_NS) == 'namespace'
    assert _reason(good, tokens=128) == 'tokens'
    assert _reason(good, key=object_key(NS.hex(), 'kv', 'cd' * 8)) == 'key'   # copied under another key
    assert _reason(good[:-1]) == 'length'
    assert _reason(good + b'\0') == 'length'
    flipped = bytearray(good)
    flipped[HEADER_SIZE] ^= 0x01
    assert _reason(bytes(flipped)) == 'checksum'
    assert _reason(good[:-MAC_SIZE]) == 'mac'                           # no MAC trailer at all
    assert _reason(good, secret=SECRET) == 'mac'                        # made without the secret


def _forge(value: bytes, payload: bytes, mac: bytes | None) -> bytes:
    """``value`` with ``payload`` swapped in, a valid checksum, and ``mac`` (None: no trailer)."""
    header = bytearray(value[:HEADER_SIZE])
    struct.pack_into('<Q', header, 32, len(payload))
    struct.pack_into('<I', header, 60, zlib.crc32(bytes(header[:60]) + payload))
    return bytes(header) + payload + (mac if mac is not None else b'')


@pytest.mark.parametrize('secret', [None, SECRET], ids=['no_secret', 'secret'])
def test_an_object_forged_without_the_secret_is_rejected(secret):
    good = enc('state', NS, 128, b'the true state' * 10, secret)
    assert bytes(dec(good, 'state', NS, 128, secret)) == b'the true state' * 10
    evil = b'garbage state!' * 10
    attempts = [_forge(good, evil, None), _forge(good, evil, bytes(MAC_SIZE)), _forge(good, evil, good[-MAC_SIZE:]),
                _forge(good, evil, _key_mac(b'wrong secret 0123', SKEY, good[:64] + evil))]
    for forged in attempts:
        assert _reason(forged, 'state', tokens=128, secret=secret) == 'mac'
    # without a secret anyone can compute the MAC: that is what the secret is for
    keyed = enc('state', NS, 128, evil, None)
    if secret is None:
        assert bytes(dec(keyed, 'state', NS, 128)) == evil
    else:
        assert _reason(keyed, 'state', tokens=128, secret=secret) == 'mac'


def test_every_single_bit_flip_is_rejected():
    good = enc('state', NS, 2048, bytes(range(40)), SECRET)
    for i in range(len(good)):
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[i] ^= bit
            with pytest.raises(StoreObjectError):
                dec(bytes(bad), 'state', NS, 2048, SECRET)
    writer = bytearray(good)
    writer[WRITER_OFFSET] ^= 1                 # the writer id is covered like every header byte
    assert _reason(bytes(writer), 'state', tokens=2048, secret=SECRET) == 'checksum'


def test_a_genuine_object_under_any_other_key_is_rejected_with_and_without_a_secret():
    """A value made for one key never verifies under another (other prefix hash, kind or
    namespace spelled in the key), whether or not a secret keys the MAC; with a secret, fixing
    up the key digest and the checksum still fails the MAC."""
    keys = [object_key(NS.hex(), kind, h) for kind in ('kv', 'state') for h in ('00' * 8, '01' * 8, 'ff' * 8)]
    keys.append(object_key(OTHER_NS.hex(), 'kv', '00' * 8))
    for secret in (None, SECRET):
        for made_for in keys:
            kind = made_for.split('/')[1]
            value = encode_object(kind, NS, 64, b'genuine bytes', secret, key=made_for)
            assert bytes(decode_object(value, kind, NS, 64, secret, key=made_for)) == b'genuine bytes'
            for other in keys:
                if other != made_for:
                    with pytest.raises(StoreObjectError) as info:
                        decode_object(value, kind, NS, 64, secret, key=other)
                    assert info.value.reason == 'key'
                    fixed = bytearray(value)
                    fixed[48:56] = hashlib.blake2b(other.encode(), digest_size=8).digest()
                    struct.pack_into('<I', fixed, 60, zlib.crc32(bytes(fixed[:60]) + b'genuine bytes'))
                    if secret is not None:          # the copier cannot recompute the MAC
                        with pytest.raises(StoreObjectError) as info:
                            decode_object(bytes(fixed), kind, NS, 64, secret, key=other)
                        assert info.value.reason == 'mac'


def test_foreign_values_are_rejected_not_unpickled():
    assert _reason(pickle.dumps({'kv': [1, 2, 3]}) + bytes(64)) == 'magic'
    assert _reason(os.urandom(4096)) == 'magic'


def test_encode_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match='kind'):
        enc('blob', NS, 1, b'')
    with pytest.raises(ValueError, match='namespace_digest'):
        enc('kv', NS[:15], 1, b'')
    with pytest.raises(ValueError, match='num_tokens'):
        enc('kv', NS, -1, b'')
    with pytest.raises(ValueError, match='uint8'):
        enc('kv', NS, 1, torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match='contiguous'):
        enc('kv', NS, 1, torch.zeros(4, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match='secret'):
        enc('kv', NS, 1, b'', 'a text secret')
    with pytest.raises(ValueError, match='key'):
        encode_object('kv', NS, 1, b'', key='')
    with pytest.raises(ValueError, match='writer'):
        enc('kv', NS, 1, b'', writer=-1)


def test_object_key_format_and_validation():
    assert object_key('ab12', 'state', '00ff') == 'ab12/state/00ff'
    assert object_key('ab12', 'kv', '00ff') == 'ab12/kv/00ff'
    with pytest.raises(ValueError, match='kind'):
        object_key('ab12', 'blocks', '00ff')
    with pytest.raises(ValueError, match='namespace_hex'):
        object_key('AB12', 'kv', '00ff')
    with pytest.raises(ValueError, match='prefix_hash_hex'):
        object_key('ab12', 'kv', '')
    with pytest.raises(ValueError, match='prefix_hash_hex'):
        object_key('ab12', 'kv', '00/ff')


IDENTITY = dict(model_identity={'config': {'model_type': 'qwen3_next', 'hidden_size': 64}, 'weights': {}},
                kv_dtype=torch.bfloat16, state_dtype='float32', block_size=64,
                layer_layout=['linear_attention', 'full_attention'], tp_rank=0, tp_size=1, adapter=None)


def test_namespace_digest_is_blake2b_of_canonical_json():
    canonical = {'model_identity': {'config': {'model_type': 'qwen3_next', 'hidden_size': 64}, 'weights': {}},
                 'kv_dtype': 'torch.bfloat16', 'state_dtype': 'float32', 'block_size': 64,
                 'layer_layout': ['linear_attention', 'full_attention'], 'tp_rank': 0, 'tp_size': 1,
                 'adapter': None, 'format_version': FORMAT_VERSION}
    text = json.dumps(canonical, sort_keys=True, separators=(',', ':'))
    expected = hashlib.blake2b(text.encode(), digest_size=16).digest()
    assert namespace_digest(**IDENTITY) == expected
    # dict key order and tuple-vs-list do not matter; torch.dtype equals its str
    reordered = dict(IDENTITY,
                     model_identity={'weights': {}, 'config': {'hidden_size': 64, 'model_type': 'qwen3_next'}},
                     layer_layout=('linear_attention', 'full_attention'), kv_dtype='torch.bfloat16')
    assert namespace_digest(**reordered) == expected


@pytest.mark.parametrize('change', [
    {'block_size': 128}, {'tp_rank': 1, 'tp_size': 2}, {'tp_size': 2}, {'kv_dtype': torch.float16},
    {'state_dtype': 'bfloat16'}, {'adapter': 'lora-a'}, {'layer_layout': ['full_attention', 'linear_attention']},
    {'model_identity': {'config': {'model_type': 'qwen3_next', 'hidden_size': 65}, 'weights': {}}},
    {'head_dim': 128}])
def test_every_identity_field_changes_the_namespace(change):
    assert namespace_digest(**dict(IDENTITY, **change)) != namespace_digest(**IDENTITY)


def test_a_config_with_infinite_or_nan_floats_has_a_namespace():
    """Nemotron-H configs hold ``time_step_limit = (0.0, inf)``: inf and nan get a tagged form
    that differs from every finite number and from the plain strings."""
    def with_limit(value):
        return namespace_digest(**dict(IDENTITY, model_identity={'config': {'time_step_limit': [0.0, value]}}))
    digests = [with_limit(v) for v in (float('inf'), float('-inf'), float('nan'), 1e30, 'inf')]
    assert len(set(digests)) == 5 and with_limit(float('inf')) == with_limit(float('inf'))


def test_namespace_digest_rejects_bad_fields_by_name():
    with pytest.raises(ValueError, match='tp_rank'):
        namespace_digest(**dict(IDENTITY, tp_rank=2, tp_size=2))
    with pytest.raises(ValueError, match='block_size'):
        namespace_digest(**dict(IDENTITY, block_size=0))
    with pytest.raises(ValueError, match=r'model_identity\.weights'):
        namespace_digest(**dict(IDENTITY, model_identity={'weights': object()}))
    with pytest.raises(ValueError, match='tp_size'):
        namespace_digest(**{k: v for k, v in IDENTITY.items() if k != 'tp_size'})
    with pytest.raises(ValueError, match='format_version'):
        namespace_digest(**dict(IDENTITY, format_version=2))


def _write_model(folder, weight: bytes, config=None):
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps(config or {'model_type': 'qwen3', 'hidden_size': 8,
                                                             '_name_or_path': str(folder),
                                                             'transformers_version': '4.57.0'}))
    (folder / 'model.safetensors').write_bytes(weight)
    (folder / 'tokenizer.json').write_text('{}')       # not part of the identity


WEIGHT = bytes(range(256)) * 4096                      # 1 MiB


def test_model_identity_hashes_every_weight_byte_and_ignores_location_and_mtime(tmp_path):
    cache = tmp_path / 'cache'
    _write_model(tmp_path / 'a', WEIGHT)
    ident = model_identity(tmp_path / 'a', cache_dir=cache)
    assert ident['config'] == {'model_type': 'qwen3', 'hidden_size': 8}      # provenance fields dropped
    assert ident['weights'] == {'model.safetensors': {'size': 1 << 20, 'sha256': hashlib.sha256(WEIGHT).hexdigest()}}
    assert ident['adapter_configs'] == {}

    shutil.copytree(tmp_path / 'a', tmp_path / 'copy')
    os.utime(tmp_path / 'copy' / 'model.safetensors', (1, 1))
    (tmp_path / 'copy' / 'config.json').write_text(json.dumps({'model_type': 'qwen3', 'hidden_size': 8,
                                                               '_name_or_path': '/elsewhere'}))
    assert model_identity(tmp_path / 'copy', cache_dir=cache) == ident

    # one byte anywhere (here: far from the file's start, middle and sampled windows) changes it
    for offset in (70_000, len(WEIGHT) - 1):
        changed = bytearray(WEIGHT)
        changed[offset] ^= 0xFF
        folder = tmp_path / f'changed{offset}'
        _write_model(folder, bytes(changed))
        assert model_identity(folder, cache_dir=cache)['weights'] != ident['weights'], offset

    (tmp_path / 'a' / 'lora').mkdir()
    (tmp_path / 'a' / 'lora' / 'adapter_config.json').write_text('{"r": 8}')
    (tmp_path / 'a' / 'lora' / 'adapter_model.safetensors').write_bytes(b'adapter')
    with_adapter = model_identity(tmp_path / 'a', cache_dir=cache)
    assert with_adapter['adapter_configs'] == {'lora/adapter_config.json': {'r': 8}}
    assert set(with_adapter['weights']) == {'model.safetensors', 'lora/adapter_model.safetensors'}

    with pytest.raises(ValueError, match='model_path'):
        model_identity(tmp_path / 'missing')


def test_weight_digest_is_cached_until_the_file_changes(tmp_path):
    path, cache = tmp_path / 'w.safetensors', tmp_path / 'cache'
    path.write_bytes(WEIGHT)
    calls = []
    assert weight_digest(path, cache_dir=cache, progress=lambda done, total: calls.append((done, total))) == \
        hashlib.sha256(WEIGHT).hexdigest()
    assert calls[-1] == (1 << 20, 1 << 20)
    calls.clear()
    again = weight_digest(path, cache_dir=cache, progress=lambda *a: calls.append(a))
    assert again == hashlib.sha256(WEIGHT).hexdigest()
    assert calls == []                                       # served from the cache: nothing read
    st = path.stat()
    changed = bytearray(WEIGHT)
    changed[12345] ^= 1
    path.write_bytes(bytes(changed))                         # same size, mtime put back: ctime still moves
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weight_digest(path, cache_dir=cache) == hashlib.sha256(bytes(changed)).hexdigest()
    unwritable = tmp_path / 'file-not-folder'
    unwritable.write_text('x')
    assert weight_digest(path, cache_dir=unwritable / 'sub') == hashlib.sha256(bytes(changed)).hexdigest()


def test_engine_namespace_covers_model_layout_override_and_secret(tmp_path):
    _write_model(tmp_path / 'm', WEIGHT)
    base = dict(dtype='torch.float32', block_size=16, layers=['full', 'linear'], cache_dir=tmp_path / 'cache')
    ns = engine_namespace(tmp_path / 'm', **base)
    assert len(ns) == 16 and engine_namespace(tmp_path / 'm', **base) == ns
    variants = [dict(base, dtype='torch.bfloat16'), dict(base, block_size=32), dict(base, layers=['full']),
                dict(base, tp_rank=1, tp_size=2), dict(base, tp_size=2), dict(base, adapter='lora-a'),
                dict(base, override='team-a/model-7'), dict(base, secret=SECRET)]
    found = {engine_namespace(tmp_path / 'm', **v) for v in variants}
    assert ns not in found and len(found) == len(variants)
    # the override stands in for the model files: another checkpoint, same override, same namespace
    _write_model(tmp_path / 'other', WEIGHT[::-1])
    assert engine_namespace(tmp_path / 'other', **dict(base, override='team-a/model-7')) == \
        engine_namespace(tmp_path / 'm', **dict(base, override='team-a/model-7'))
    assert engine_namespace(tmp_path / 'other', **base) != ns
    assert engine_namespace(tmp_path / 'm', **dict(base, secret=SECRET + b'2')) != \
        engine_namespace(tmp_path / 'm', **dict(base, secret=SECRET))


def test_secret_comes_from_the_file_then_the_environment(tmp_path):
    secret_file = tmp_path / 'secret'
    secret_file.write_bytes(SECRET + b'\n')
    assert resolve_secret(secret_file, {'LMDEPLOY_STORE_SECRET': 'another secret value!'}) == SECRET
    assert resolve_secret(None, {'LMDEPLOY_STORE_SECRET': 'another secret value!'}) == b'another secret value!'
    assert resolve_secret(None, {}) is None and resolve_secret(None, {'LMDEPLOY_STORE_SECRET': ''}) is None
    with pytest.raises(ValueError, match='store_secret_file.*cannot be read'):
        resolve_secret(tmp_path / 'missing', {})
    secret_file.write_bytes(b'short\n')
    with pytest.raises(ValueError, match='store_secret_file.*at least 16 bytes'):
        resolve_secret(secret_file, {})
    with pytest.raises(ValueError, match='LMDEPLOY_STORE_SECRET.*at least 16 bytes'):
        resolve_secret(None, {'LMDEPLOY_STORE_SECRET': 'short'})
    key_id = secret_key_id(SECRET)
    assert len(key_id) == 16 and key_id == secret_key_id(SECRET) != secret_key_id(SECRET + b'x')
    assert SECRET.hex()[:16] != key_id and secret_key_id(None) is None


def test_fake_client_injects_failures_and_keeps_first_value():
    fake = FakeStoreClient(fail_puts=1)
    assert fake.put('k', b'one') is PutResult.FAILED
    assert fake.put('k', b'one') is PutResult.STORED
    assert fake.put('k', b'two') is PutResult.EXISTS    # already exists: nothing gained, value kept
    assert fake.get('k') == b'one'
    assert fake.batch_exists(['k', 'x']) == [True, False]
    assert fake.put_keys == ['k', 'k', 'k']
    assert (fake.stats.puts, fake.stats.put_failures, fake.stats.put_bytes) == (1, 1, 3)
    assert fake.put('k', b'new', replace=True) is PutResult.REPAIRED and fake.get('k') == b'new'
    assert fake.remove('k') and not fake.exists('k')
    fake.down = True
    assert (fake.get('k'), fake.exists('k'), fake.put('z', b'1')) == (None, False, PutResult.FAILED)
    assert fake.batch_exists(['k']) is None              # a failed query is not "absent"
    assert (fake.stats.get_failures, fake.stats.exists_failures, fake.stats.put_failures) == (1, 2, 2)
