"""Byte format, keys and namespaces of Store objects (docs/en/advance/store.md, "Keys and value format").

This module owns everything that decides *which bytes* a Store object holds and *under which
key*; it does no I/O. Invariants:

- A value is a fixed 64-byte little-endian header, the raw payload, then a 32-byte MAC;
  nothing is pickled, so reading a foreign or corrupt object can never run code.
- A value is bound to its key: the header holds a digest of the full key (namespace, kind,
  prefix hash), covered by the checksum, and the MAC covers the key itself. A genuine object
  copied under another key (another prompt at the same depth) is rejected (``key``, or ``mac``
  when the copier also rewrote the digest), never restored.
- :func:`decode_object` returns a payload only when magic, format version, kind, namespace
  digest, token count, key digest, payload length, checksum and MAC all match; anything else
  raises :class:`StoreObjectError` (the caller counts it as a miss).
- Every value carries its writer's 64-bit id, so two writers of one key never produce the same
  bytes: a Store that keeps the first value of a key can tell whose value it kept
  (:mod:`.backend`, exact byte counts with concurrent writers).
- Two engines whose bytes could differ (model, dtypes, block size, layer layout, adapter,
  format version) get different namespace digests, hence disjoint keys (:mod:`.identity` builds
  the identity). Objects are tensor-parallel independent: they hold every head, and the engine
  always passes TP rank 0 and size 1 to the digest, so engines of any ``tp`` share them.

Value layout (offsets in bytes, all integers little-endian)::

    0      4     6    7    8               24       32        40       48         56   60    64        64+n
    +------+-----+----+----+---------------+--------+---------+--------+----------+----+-----+---------+--------+
    | LMDS | ver |kind| 0  | namespace(16) | tokens | pay.len | writer | key dig. | 0  | crc | payload | MAC 32 |
    +------+-----+----+----+---------------+--------+---------+--------+----------+----+-----+---------+--------+
     magic  u16   u8   u8   digest bytes    u64      u64 (=n)  u64      BLAKE2b-64 u32  u32   n bytes   HMAC-SHA256

Key digest: BLAKE2b with an 8-byte digest of the key's UTF-8 bytes.

Checksum: CRC-32 (``zlib.crc32``) over header bytes [0, 60) followed by the payload. It tells
accidental corruption (truncation, bit flips, torn writes) apart from forgery, at ~2.6 GB/s.
Because the key digest is among the bytes it covers, a value copied under another key fails
without a secret too (reason ``key``), unless whoever copied it also rewrote digest and checksum.

MAC: HMAC-SHA256 (RFC 2104 with SHA-256, Python's :mod:`hmac`) keyed with the Store secret over
the key's length (u16) and UTF-8 bytes, header bytes [0, 64) (checksum included), then the
payload. Without the secret nobody can make an object this engine accepts under any key, and a
genuine object moved to another key fails the MAC. With no secret configured the key is empty:
the MAC then only repeats the checksum's job, and anyone who can reach the Store can forge
objects (or copy one under another key and fix its digest and checksum).
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT_VERSION = 3                    # 2: the HMAC-SHA256 trailer; 3: key binding and writer id
MAGIC = b'LMDS'
KINDS = ('kv', 'state', 'handoff', 'window')
# handoff: a prefill engine's partial last block + state at its hand-off point (paging/handoff.py);
# window: one block row of a mixed model's sliding-window layers (its global layers' row is the kv object)
_KIND_CODE = {'kv': 1, 'state': 2, 'handoff': 3, 'window': 4}
_HEADER = struct.Struct('<4sHBB16sQQQ8sII')
HEADER_SIZE = _HEADER.size            # 64 bytes: the payload starts 16-byte aligned
_CRC_COVERED = HEADER_SIZE - 4        # the checksum covers every header byte before itself
WRITER_OFFSET = 40                    # where the writer id sits (see :mod:`.backend`)
KEY_DIGEST_SIZE = 8
MAC_SIZE = 32                         # HMAC-SHA256 trailer after the payload
OBJECT_OVERHEAD = HEADER_SIZE + MAC_SIZE   # bytes a value holds beyond its payload
DIGEST_SIZE = 16


class StoreObjectError(ValueError):
    """A Store value that must not be used; ``reason`` is one of ``truncated``, ``magic``,
    ``version``, ``kind``, ``namespace``, ``tokens``, ``key``, ``length``, ``checksum``, ``mac``
    (usable as a metric label). ``key`` means a value made for another key (copied there);
    ``mac`` means forged, written under another secret, or tampered with after its checksum was
    recomputed."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f'bad Store object ({reason}): {detail}')
        self.reason = reason


def _payload_view(payload) -> memoryview:
    """A flat byte view of ``payload`` (bytes, bytearray, memoryview or a contiguous CPU
    ``torch.uint8`` tensor of any shape) without copying."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).cast('B')
    import torch
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.device.type != 'cpu' or not payload.is_contiguous():
            raise ValueError(f'payload must be a contiguous CPU torch.uint8 tensor, got dtype={payload.dtype} '
                             f'device={payload.device} contiguous={payload.is_contiguous()}')
        return memoryview(payload.reshape(-1).numpy())
    raise ValueError(f'payload must be bytes, bytearray, memoryview or a uint8 tensor, got {type(payload).__name__}')


def _check_kind(kind: str) -> int:
    if kind not in _KIND_CODE:
        raise ValueError(f'kind must be one of {KINDS}, got {kind!r}')
    return _KIND_CODE[kind]


def _check_digest(digest: bytes) -> bytes:
    if not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_SIZE:
        raise ValueError(f'namespace_digest must be {DIGEST_SIZE} bytes, got {digest!r}')
    return bytes(digest)


def _check_tokens(num_tokens: int) -> int:
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 <= num_tokens < 1 << 64:
        raise ValueError(f'num_tokens must be an int in [0, 2**64), got {num_tokens!r}')
    return num_tokens


def _check_secret(secret) -> bytes:
    if secret is None:
        return b''
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f'secret must be bytes or None, got {type(secret).__name__}')
    return bytes(secret)


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f'key must be a non-empty str, got {key!r}')
    data = key.encode()
    if len(data) >= 1 << 16:
        raise ValueError(f'key must be shorter than 65536 UTF-8 bytes, got {len(data)}')
    return data


def key_digest(key: str) -> bytes:
    """The 8-byte BLAKE2b digest of ``key`` that a value's header holds."""
    return hashlib.blake2b(_key_bytes(key), digest_size=KEY_DIGEST_SIZE).digest()


def _check_writer(writer: int) -> int:
    if not isinstance(writer, int) or isinstance(writer, bool) or not 0 <= writer < 1 << 64:
        raise ValueError(f'writer must be an int in [0, 2**64), got {writer!r}')
    return writer


def _mac(secret: bytes, key: bytes, header: memoryview | bytes, payload: memoryview) -> bytes:
    h = hmac.new(secret, struct.pack('<H', len(key)) + key, hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()


def encode_object(kind: str, namespace_digest: bytes, num_tokens: int, payload, secret: bytes | None = None, *,
                  key: str, writer: int = 0) -> bytes:
    """Build one Store value for ``key``: the 64-byte header, ``payload``, then the 32-byte MAC.

    Args:
        kind: ``'kv'`` (the KV bytes of one block), ``'state'`` (a state snapshot), ``'handoff'``
            (a prefill engine's partial last block followed by its state snapshot) or ``'window'``
            (the sliding-window layers' bytes of one block, for a model whose window layers keep a
            pool of their own; its ``'kv'`` objects then hold the global layers' bytes only).
        namespace_digest: 16 bytes from :func:`namespace_digest`.
        num_tokens: tokens covered by the prefix this object belongs to (b for a state at
            boundary b; the block's end token for a KV block).
        payload: bytes, bytearray, memoryview or a contiguous CPU ``torch.uint8`` tensor; its
            bytes are copied verbatim.
        secret: the Store secret the MAC is keyed with; None = no secret (empty key).
        key: the Store key the value is put under (:func:`object_key`); the value verifies
            under this key only.
        writer: the writer's 64-bit id (random per engine), so that two writers' values of one
            key differ.

    Returns:
        ``OBJECT_OVERHEAD + len(payload)`` bytes (header 64 + payload + MAC 32).

    Raises:
        ValueError: a bad ``kind``, digest length, token count, payload, secret type, key or
            writer id.
    """
    mac_key = _check_secret(secret)
    code = _check_kind(kind)
    digest = _check_digest(namespace_digest)
    _check_tokens(num_tokens)
    key_data = _key_bytes(key)
    view = _payload_view(payload)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, code, 0, digest, num_tokens, view.nbytes, _check_writer(writer),
                          key_digest(key), 0, 0)
    crc = zlib.crc32(view, zlib.crc32(header[:_CRC_COVERED]))
    header = header[:_CRC_COVERED] + struct.pack('<I', crc)
    return b''.join((header, view, _mac(mac_key, key_data, header, view)))


def decode_object(data, expect_kind: str, namespace_digest: bytes, num_tokens: int,
                  secret: bytes | None = None, *, key: str) -> memoryview:
    """Verify a Store value read from ``key`` and return its payload.

    Args:
        data: the value as read from the Store (bytes-like).
        expect_kind: one of :data:`KINDS`.
        namespace_digest: this engine's 16-byte namespace digest.
        num_tokens: the token count the caller expects (see :func:`encode_object`).
        secret: the Store secret; None = no secret (empty key).
        key: the key the value was read from; a value made for another key is rejected.

    Returns:
        A zero-copy read-only ``memoryview`` of the payload bytes inside ``data``.

    Raises:
        StoreObjectError: the value is truncated, any header field, the checksum or the MAC
            does not match (``.reason`` says which, checked in layout order; a value without
            its MAC trailer is ``mac``).
        ValueError: bad arguments (kind, digest length, token count, secret type, key).
    """
    mac_key = _check_secret(secret)
    code = _check_kind(expect_kind)
    digest = _check_digest(namespace_digest)
    _check_tokens(num_tokens)
    key_data = _key_bytes(key)
    view = memoryview(data).cast('B')
    if view.nbytes < HEADER_SIZE:
        raise StoreObjectError('truncated', f'{view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header')
    magic, version, got_code, reserved8, got_digest, got_tokens, length, _writer, got_key, reserved32, crc = \
        _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise StoreObjectError('magic', f'magic {magic!r} != {MAGIC!r}')
    if version != FORMAT_VERSION or reserved8 or reserved32:
        raise StoreObjectError('version', f'format version {version} (reserved {reserved8}, {reserved32}); '
                                          f'expected {FORMAT_VERSION} with zero reserved fields')
    if got_code != code:
        raise StoreObjectError('kind', f'kind code {got_code} != {code} ({expect_kind})')
    if got_digest != digest:
        raise StoreObjectError('namespace', f'namespace {got_digest.hex()} != {digest.hex()}')
    if got_tokens != num_tokens:
        raise StoreObjectError('tokens', f'token count {got_tokens} != {num_tokens}')
    if got_key != key_digest(key):
        raise StoreObjectError('key', f'the value was made for another key than {key!r} (copied here?)')
    if view.nbytes == HEADER_SIZE + length:
        raise StoreObjectError('mac', 'the value has no MAC trailer')
    if length != view.nbytes - OBJECT_OVERHEAD:
        raise StoreObjectError('length', f'header says {length} payload bytes, value holds '
                                         f'{view.nbytes - OBJECT_OVERHEAD}')
    payload = view[HEADER_SIZE:HEADER_SIZE + length]
    if zlib.crc32(payload, zlib.crc32(view[:_CRC_COVERED])) != crc:
        raise StoreObjectError('checksum', 'payload checksum mismatch')
    if not hmac.compare_digest(_mac(mac_key, key_data, view[:HEADER_SIZE], payload), view[HEADER_SIZE + length:]):
        raise StoreObjectError('mac', 'MAC mismatch: forged, written under another secret, or tampered with')
    return payload.toreadonly()


def object_key(namespace_hex: str, kind: str, prefix_hash_hex: str) -> str:
    """The Store key ``f'{namespace_hex}/{kind}/{prefix_hash_hex}'``.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`, or a hex argument is empty or holds
            anything but lowercase hex digits (named in the message).
    """
    _check_kind(kind)
    for name, value in (('namespace_hex', namespace_hex), ('prefix_hash_hex', prefix_hash_hex)):
        if not isinstance(value, str) or not value or value.strip('0123456789abcdef'):
            raise ValueError(f'{name} must be a non-empty lowercase hex string, got {value!r}')
    return f'{namespace_hex}/{kind}/{prefix_hash_hex}'


def _canonical(field: str, value: Any) -> Any:
    """Turn ``value`` into plain JSON types so that equal identities serialize equally."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # JSON has no inf / nan; a config may hold them (Nemotron-H's time_step_limit = (0, inf)),
        # so they get a tagged form no finite number or plain string serializes to
        return value if math.isfinite(value) else {'__nonfinite_float__': repr(value)}
    if isinstance(value, enum.Enum):
        return _canonical(field, value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical(f'{field}.{k}', v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(f'{field}[{i}]', v) for i, v in enumerate(value)]
    if type(value).__module__ == 'torch' and type(value).__name__ == 'dtype':
        return str(value)                       # torch.bfloat16 -> 'torch.bfloat16'
    raise ValueError(f'{field} must be JSON-like (None, bool, int, float, str, list, dict, torch.dtype), '
                     f'got {type(value).__name__}')


def namespace_digest(**identity) -> bytes:
    """The 16-byte namespace digest of everything that changes the stored bytes.

    BLAKE2b-128 of the canonical JSON (sorted keys, no whitespace, torch dtypes as ``str``,
    tuples as lists) of ``identity`` plus ``format_version`` (:data:`FORMAT_VERSION`). Use
    ``.hex()`` of the result as the key namespace. Pass every field that changes the bytes:
    model identity (:func:`.identity.model_identity` of the checkpoint), KV/state dtypes, layer
    layout, adapter, and the three fields required below.

    Args:
        **identity: JSON-like values (None, bool, int, float, str, list/tuple, dict,
            torch.dtype, Enum, Path); must include ``block_size`` (int > 0), ``tp_size``
            (int >= 1) and ``tp_rank`` (int in ``[0, tp_size)``).

    Raises:
        ValueError: a required field is missing or out of range, ``format_version`` is
            passed (it is added here), or a value is not JSON-like (named).
    """
    for name in ('block_size', 'tp_rank', 'tp_size'):
        if name not in identity:
            raise ValueError(f'namespace_digest needs the field {name}')
    block_size, tp_rank, tp_size = identity['block_size'], identity['tp_rank'], identity['tp_size']
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f'block_size must be a positive int, got {block_size!r}')
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f'tp_size must be an int >= 1, got {tp_size!r}')
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f'tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}')
    if 'format_version' in identity:
        raise ValueError('format_version is added by namespace_digest; do not pass it')
    canonical = {k: _canonical(k, v) for k, v in identity.items()}
    canonical['format_version'] = FORMAT_VERSION
    text = json.dumps(canonical, sort_keys=True, separators=(',', ':'), ensure_ascii=True, allow_nan=False)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()
