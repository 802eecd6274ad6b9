"""Store object format, keys and namespaces (docs/en/advance/store.md, "Keys and value format"),
and the fake client used for fault tests."""
import hashlib
import json
import os
import pickle
import shutil
import struct
import zlib

import pytest
import torch

from lmdeploy.pytorch.store.mooncake_client import FakeStoreClient
from lmdeploy.pytorch.store.object_format import (FORMAT_VERSION, HEADER_SIZE, StoreObjectError, decode_object,
                                                  encode_object, model_identity, namespace_digest, object_key)

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))


def test_header_bytes_are_the_documented_layout():
    value = encode_object('state', NS, 1024, b'abc')
    assert HEADER_SIZE == 48 and len(value) == 51
    assert value[:4] == b'LMDS'
    assert struct.unpack_from('<HBB', value, 4) == (FORMAT_VERSION, 2, 0)
    assert value[8:24] == NS
    assert struct.unpack_from('<QQI', value, 24) == (1024, 3, 0)
    assert struct.unpack_from('<I', value, 44)[0] == zlib.crc32(value[:44] + b'abc')
    assert value[48:] == b'abc'
    assert encode_object('kv', NS, 64, b'')[6] == 1


@pytest.mark.parametrize('make', [bytes, bytearray, memoryview,
                                  lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).reshape(4, -1)])
def test_round_trip_returns_the_payload_bytes(make):
    payload = bytes(range(256)) * 4
    value = encode_object('kv', NS, 128, make(payload))
    out = decode_object(value, 'kv', NS, 128)
    assert isinstance(out, memoryview) and out.readonly
    assert bytes(out) == payload


def test_empty_payload_round_trips():
    assert bytes(decode_object(encode_object('state', NS, 0, b''), 'state', NS, 0)) == b''


def _reason(data, kind='kv', ns=NS, tokens=64):
    with pytest.raises(StoreObjectError) as info:
        decode_object(data, kind, ns, tokens)
    assert isinstance(info.value, ValueError)
    return info.value.reason


def test_each_mismatch_is_rejected_with_its_reason():
    good = encode_object('kv', NS, 64, b'payload-bytes')
    assert _reason(good[:47]) == 'truncated'
    assert _reason(b'') == 'truncated'
    assert _reason(b'XXXX' + good[4:]) == 'magic'
    assert _reason(good[:4] + struct.pack('<H', FORMAT_VERSION + 1) + good[6:]) == 'version'
    assert _reason(good[:7] + b'\x01' + good[8:]) == 'version'          # reserved byte set
    assert _reason(good, kind='state') == 'kind'
    assert _reason(good, ns=OTHER_NS) == 'namespace'
    assert _reason(good, tokens=128) == 'tokens'
    assert _reason(good[:-1]) == 'length'
    assert _reason(good + b'\0') == 'length'
    flipped = bytearray(good)
    flipped[HEADER_SIZE] ^= 0x01
    assert _reason(bytes(flipped)) == 'checksum'


def test_every_single_bit_flip_is_rejected():
    good = encode_object('state', NS, 2048, bytes(range(40)))
    for i in range(len(good)):
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[i] ^= bit
            with pytest.raises(StoreObjectError):
                decode_object(bytes(bad), 'state', NS, 2048)


def test_foreign_values_are_rejected_not_unpickled():
    assert _reason(pickle.dumps({'kv': [1, 2, 3]}) + bytes(64)) == 'magic'
    assert _reason(os.urandom(4096)) == 'magic'


def test_encode_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match='kind'):
        encode_object('blob', NS, 1, b'')
    with pytest.raises(ValueError, match='namespace_digest'):
        encode_object('kv', NS[:15], 1, b'')
    with pytest.raises(ValueError, match='num_tokens'):
        encode_object('kv', NS, -1, b'')
    with pytest.raises(ValueError, match='uint8'):
        encode_object('kv', NS, 1, torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match='contiguous'):
        encode_object('kv', NS, 1, torch.zeros(4, 4, dtype=torch.uint8).t())


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


def _write_model(folder, weight: bytes):
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps({'model_type': 'qwen3', 'hidden_size': 8}))
    (folder / 'model.safetensors').write_bytes(weight)
    (folder / 'tokenizer.json').write_text('{}')       # not part of the identity


def test_model_identity_ignores_location_and_mtime_but_sees_content(tmp_path):
    weight = bytes(range(256)) * 4096                   # 1 MiB
    _write_model(tmp_path / 'a', weight)
    ident = model_identity(tmp_path / 'a')
    assert ident['config'] == {'model_type': 'qwen3', 'hidden_size': 8}
    assert list(ident['weights']) == ['model.safetensors']
    assert ident['weights']['model.safetensors']['size'] == 1 << 20

    shutil.copytree(tmp_path / 'a', tmp_path / 'copy')
    os.utime(tmp_path / 'copy' / 'model.safetensors', (1, 1))
    assert model_identity(tmp_path / 'copy') == ident

    changed = bytearray(weight)
    changed[len(weight) * 2 // 5 + 100] ^= 0xFF         # inside the second of the 64 KiB samples
    _write_model(tmp_path / 'b', bytes(changed))
    assert model_identity(tmp_path / 'b') != ident

    with pytest.raises(ValueError, match='model_path'):
        model_identity(tmp_path / 'missing')


def test_fake_client_injects_failures_and_keeps_first_value():
    fake = FakeStoreClient(fail_puts=1)
    assert fake.put('k', b'one') is False
    assert fake.put('k', b'one') is True
    assert fake.put('k', b'two') is True                # already exists: success, value kept
    assert fake.get('k') == b'one'
    assert fake.batch_exists(['k', 'x']) == [True, False]
    assert fake.put_keys == ['k', 'k', 'k']
    assert (fake.stats.puts, fake.stats.put_failures, fake.stats.put_bytes) == (2, 1, 6)
    fake.down = True
    assert (fake.get('k'), fake.exists('k'), fake.put('z', b'1')) == (None, False, False)
    assert (fake.stats.get_failures, fake.stats.exists_failures, fake.stats.put_failures) == (1, 1, 2)
