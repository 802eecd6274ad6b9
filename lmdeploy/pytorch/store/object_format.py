"""Byte format, keys and namespaces of Store objects (SPEC §7).

This module owns everything that decides *which bytes* a Store object holds and *under which
key*; it does no I/O. Invariants:

- A value is a fixed 48-byte little-endian header followed by the raw payload; nothing is
  pickled, so reading a foreign or corrupt object can never run code.
- :func:`decode_object` returns a payload only when magic, format version, kind, namespace
  digest, token count, payload length and checksum all match; anything else raises
  :class:`StoreObjectError` (the caller counts it as a miss).
- Two engines whose bytes could differ (model, dtypes, block size, layer layout, TP rank/size,
  adapter, format version) get different namespace digests, hence disjoint keys.

Header layout (offsets in bytes, all integers little-endian)::

    0      4      6    7    8                 24        32         40        44     48
    +------+------+----+----+-----------------+---------+----------+---------+------+---------
    | LMDS | ver  |kind| 0  | namespace (16)  | tokens  | pay. len | 0 (u32) | crc  | payload
    +------+------+----+----+-----------------+---------+----------+---------+------+---------
     magic  u16    u8   u8   digest bytes      u64       u64        reserved  u32

Checksum choice: CRC-32 (``zlib.crc32``) over header bytes [0, 44) followed by the payload. It
detects accidental corruption (truncation, bit flips, torn writes) at ~2.6 GB/s on one core,
about 4x faster than BLAKE2b, which matters for state snapshots of tens of MiB; it is not meant
to resist deliberate forgery (the Store is a trusted cluster-internal service).
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MAGIC = b'LMDS'
KINDS = ('kv', 'state')
_KIND_CODE = {'kv': 1, 'state': 2}
_HEADER = struct.Struct('<4sHBB16sQQII')
HEADER_SIZE = _HEADER.size            # 48 bytes: the payload starts 16-byte aligned
_CRC_COVERED = HEADER_SIZE - 4        # the checksum covers every header byte before itself
DIGEST_SIZE = 16
_SAMPLE_BYTES = 64 << 10              # bytes per content sample of a weight file
_SAMPLES_PER_FILE = 4


class StoreObjectError(ValueError):
    """A Store value that must not be used; ``reason`` is one of ``truncated``, ``magic``,
    ``version``, ``kind``, ``namespace``, ``tokens``, ``length``, ``checksum`` (usable as a
    metric label)."""

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


def encode_object(kind: str, namespace_digest: bytes, num_tokens: int, payload) -> bytes:
    """Build one Store value: the 48-byte header followed by ``payload``.

    Args:
        kind: ``'kv'`` (the KV bytes of one block) or ``'state'`` (a state snapshot).
        namespace_digest: 16 bytes from :func:`namespace_digest`.
        num_tokens: tokens covered by the prefix this object belongs to (b for a state at
            boundary b; the block's end token for a KV block).
        payload: bytes, bytearray, memoryview or a contiguous CPU ``torch.uint8`` tensor; its
            bytes are copied verbatim.

    Returns:
        ``HEADER_SIZE + len(payload)`` bytes.

    Raises:
        ValueError: a bad ``kind``, digest length, token count or payload type.
    """
    code = _check_kind(kind)
    digest = _check_digest(namespace_digest)
    _check_tokens(num_tokens)
    view = _payload_view(payload)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, code, 0, digest, num_tokens, view.nbytes, 0, 0)
    crc = zlib.crc32(view, zlib.crc32(header[:_CRC_COVERED]))
    return b''.join((header[:_CRC_COVERED], struct.pack('<I', crc), view))


def decode_object(data, expect_kind: str, namespace_digest: bytes, num_tokens: int) -> memoryview:
    """Verify a Store value and return its payload.

    Args:
        data: the value as read from the Store (bytes-like).
        expect_kind: ``'kv'`` or ``'state'``.
        namespace_digest: this engine's 16-byte namespace digest.
        num_tokens: the token count the caller expects (see :func:`encode_object`).

    Returns:
        A zero-copy read-only ``memoryview`` of the payload bytes inside ``data``.

    Raises:
        StoreObjectError: the value is truncated or any header field or the checksum does
            not match (``.reason`` says which, checked in header order).
        ValueError: bad arguments (kind, digest length, token count).
    """
    code = _check_kind(expect_kind)
    digest = _check_digest(namespace_digest)
    _check_tokens(num_tokens)
    view = memoryview(data).cast('B')
    if view.nbytes < HEADER_SIZE:
        raise StoreObjectError('truncated', f'{view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header')
    magic, version, got_code, reserved8, got_digest, got_tokens, length, reserved32, crc = \
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
    if length != view.nbytes - HEADER_SIZE:
        raise StoreObjectError('length', f'header says {length} payload bytes, value holds '
                                         f'{view.nbytes - HEADER_SIZE}')
    payload = view[HEADER_SIZE:]
    if zlib.crc32(payload, zlib.crc32(view[:_CRC_COVERED])) != crc:
        raise StoreObjectError('checksum', 'payload checksum mismatch')
    return payload.toreadonly()


def object_key(namespace_hex: str, kind: str, prefix_hash_hex: str) -> str:
    """The Store key ``f'{namespace_hex}/{kind}/{prefix_hash_hex}'`` (SPEC §7).

    Raises:
        ValueError: ``kind`` is not ``'kv'``/``'state'``, or a hex argument is empty or holds
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
        if not math.isfinite(value):
            raise ValueError(f'{field} must be finite, got {value!r}')
        return value
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
    """The 16-byte namespace digest of everything that changes the stored bytes (SPEC §7).

    BLAKE2b-128 of the canonical JSON (sorted keys, no whitespace, torch dtypes as ``str``,
    tuples as lists) of ``identity`` plus ``format_version`` (:data:`FORMAT_VERSION`). Use
    ``.hex()`` of the result as the key namespace. Pass every field that changes the bytes:
    model identity (e.g. :func:`model_identity` of the checkpoint), KV/state dtypes, layer
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


def _file_fingerprint(path: Path) -> str:
    """BLAKE2b-128 of a weight file's size, its first 64 KiB (the safetensors header: tensor
    names, dtypes, shapes, offsets) and 64 KiB samples at evenly spaced offsets.

    Reads at most ``(_SAMPLES_PER_FILE + 1) * 64 KiB`` bytes, so a multi-GiB checkpoint is
    fingerprinted in milliseconds. Retrained weights of equal shape change almost every byte
    and therefore the samples; an edit of a few bytes outside the samples is not detected.
    """
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=DIGEST_SIZE)
    offsets = {0} | {size * (i + 1) // (_SAMPLES_PER_FILE + 1) for i in range(_SAMPLES_PER_FILE)}
    with open(path, 'rb') as f:
        for off in sorted(offsets):
            f.seek(off)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def model_identity(model_path: str | os.PathLike) -> dict:
    """Identity of a local Hugging Face checkpoint for :func:`namespace_digest`.

    Returns ``{'config': <parsed config.json>, 'weights': {name: {'size': bytes, 'fingerprint':
    hex}}}`` over every ``*.safetensors``/``*.bin`` file in the directory. Independent of the
    directory's path and of file mtimes, so copies of the same checkpoint on different machines
    share a namespace.

    Raises:
        ValueError: ``model_path`` has no ``config.json``.
    """
    root = Path(model_path)
    config_file = root / 'config.json'
    if not config_file.is_file():
        raise ValueError(f'model_path {str(root)!r} has no config.json')
    config = json.loads(config_file.read_text())
    weights = {p.name: {'size': p.stat().st_size, 'fingerprint': _file_fingerprint(p)}
               for p in sorted(root.iterdir()) if p.is_file() and p.suffix in ('.safetensors', '.bin')}
    return {'config': config, 'weights': weights}
