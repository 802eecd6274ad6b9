"""What an engine's Store objects are tied to: the model's math (the namespace) and the secret.

This module owns the two inputs that decide whether two engines may share a Store object:

- **Model identity** (:func:`model_identity`): the model's ``config.json`` (provenance fields
  dropped) and a full SHA-256 of every weight and adapter file, so that two checkpoints that
  differ in a single byte never share a namespace. Hashing reads every byte once; the result is
  cached per file (:func:`weight_digest`), keyed by the file's path, size, inode, mtime and
  ctime, so later starts cost a ``stat`` per file.
- **The Store secret** (:func:`resolve_secret`): the key of every object's HMAC-SHA256, read
  from a file or the ``LMDEPLOY_STORE_SECRET`` environment variable. Its key id (an HMAC of a
  fixed label, never the secret) joins the namespace, so engines with different secrets keep
  to disjoint keys instead of rejecting each other's objects.

:func:`engine_namespace` combines them with the engine's own layout (dtype, block size, layer
cache specs, adapter) into the 16-byte namespace digest of
:func:`.object_format.namespace_digest`. Objects are tensor-parallel independent: they hold every
head, and the engine always passes ``tp_rank=0, tp_size=1``, so engines of any ``tp`` share them.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..config import cache_root
from .object_format import namespace_digest

__all__ = ['SECRET_ENV', 'MIN_SECRET_BYTES', 'WEIGHT_SUFFIXES', 'digest_cache_dir', 'engine_namespace',
           'model_identity', 'resolve_secret', 'secret_key_id', 'weight_digest']

logger = logging.getLogger('lmdeploy')

SECRET_ENV = 'LMDEPLOY_STORE_SECRET'
MIN_SECRET_BYTES = 16
WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pt', '.pth', '.gguf')
_ADAPTER_CONFIGS = ('adapter_config.json', )
_PROVENANCE_FIELDS = ('transformers_version', )      # and every field starting with '_' (e.g. _name_or_path)
_CHUNK = 8 << 20                                     # bytes per read while hashing
_PROGRESS_EVERY_S = 5.0


def digest_cache_dir() -> Path:
    """Folder of cached weight digests: ``$LMDEPLOY_CACHE_DIR/weight-digests``, else
    ``$XDG_CACHE_HOME/lmdeploy/weight-digests``, else ``~/.cache/lmdeploy/weight-digests``."""
    return cache_root() / 'weight-digests'


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {'path': str(path.resolve()), 'size': st.st_size, 'ino': st.st_ino, 'dev': st.st_dev,
            'mtime_ns': st.st_mtime_ns, 'ctime_ns': st.st_ctime_ns}


def weight_digest(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                  progress: Callable[[int, int], None] | None = None) -> str:
    """SHA-256 (hex) of every byte of the file ``path``, cached.

    The cache entry (one small JSON file per weight file under ``cache_dir``, default
    :func:`digest_cache_dir`) is used only while the file's resolved path, size, inode, device,
    mtime and ctime are unchanged; any write to the file changes its ctime, so an edited file is
    hashed again. An unwritable cache folder only costs the hashing on every start.

    Args:
        path: the file.
        cache_dir: where cache entries live.
        progress: called as ``progress(bytes_done, bytes_total)`` while hashing (not on a hit).

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    key = _stat_key(path)
    folder = Path(cache_dir) if cache_dir is not None else digest_cache_dir()
    entry = folder / (hashlib.sha256(key['path'].encode()).hexdigest()[:32] + '.json')
    try:
        cached = json.loads(entry.read_text())
        if cached.get('key') == key and isinstance(cached.get('sha256'), str):
            return cached['sha256']
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    done, total = 0, key['size']
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, 'rb', buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            done += n
            if progress is not None:
                progress(done, total)
    digest = h.hexdigest()
    if _stat_key(path) != key:          # written while we read it: do not cache a torn digest
        return digest
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix='.tmp')
        with os.fdopen(fd, 'w') as f:
            json.dump({'key': key, 'sha256': digest}, f)
        os.replace(tmp, entry)
    except OSError as err:
        logger.debug('cannot cache the digest of %s in %s: %s', path, folder, err)
    return digest


class _Progress:
    """Logs hashing progress of a whole model at most every few seconds."""

    def __init__(self, model: Path, total: int):
        self.model, self.total, self.base = model, total, 0
        self.start = self.last = time.monotonic()

    def file(self, base: int) -> Callable[[int, int], None]:
        self.base = base
        return self

    def __call__(self, done: int, _file_total: int) -> None:
        now = time.monotonic()
        if now - self.last < _PROGRESS_EVERY_S:
            return
        self.last = now
        seen = self.base + done
        rate = seen / max(now - self.start, 1e-9)
        logger.info('hashing the weights of %s: %.1f of %.1f GiB (%.0f%%, %.0f MiB/s)', self.model, seen / 2**30,
                    self.total / 2**30, 100 * seen / max(self.total, 1), rate / 2**20)


def _files(root: Path, suffixes) -> list[Path]:
    return sorted(p for p in root.rglob('*') if p.is_file() and p.suffix in suffixes
                  and not any(part.startswith('.') for part in p.relative_to(root).parts))


def model_identity(model_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> dict:
    """Identity of a local Hugging Face checkpoint for :func:`.object_format.namespace_digest`.

    Returns ``{'config': ..., 'weights': {relative path: {'size': bytes, 'sha256': hex}},
    'adapter_configs': {relative path: parsed JSON}}``: ``config.json`` without provenance
    fields (``transformers_version`` and every field starting with ``_``, e.g.
    ``_name_or_path``), a full SHA-256 of every ``*.safetensors`` / ``*.bin`` / ``*.pt`` /
    ``*.pth`` / ``*.gguf`` file at any depth (hidden folders skipped), and every
    ``adapter_config.json``. Independent of the directory's location and of mtimes, so copies of
    one checkpoint share a namespace; a change of any weight byte changes it. The first call on a
    checkpoint reads every byte (logging progress); later calls hit the digest cache
    (:func:`weight_digest`).

    Raises:
        ValueError: ``model_path`` has no ``config.json``.
    """
    root = Path(model_path)
    config_file = root / 'config.json'
    if not config_file.is_file():
        raise ValueError(f'model_path {str(root)!r} has no config.json')
    config = {k: v for k, v in json.loads(config_file.read_text()).items()
              if not k.startswith('_') and k not in _PROVENANCE_FIELDS}
    files = _files(root, WEIGHT_SUFFIXES)
    total = sum(p.stat().st_size for p in files)
    progress = _Progress(root, total)
    weights, base = {}, 0
    for p in files:
        size = p.stat().st_size
        weights[p.relative_to(root).as_posix()] = {'size': size, 'sha256': weight_digest(
            p, cache_dir=cache_dir, progress=progress.file(base))}
        base += size
    elapsed = time.monotonic() - progress.start
    if elapsed > 1.0:
        logger.info('hashed the weights of %s (%.1f GiB) in %.0f s for the Store namespace; later starts reuse the '
                    'cached digests', root, total / 2**30, elapsed)
    adapters = {p.relative_to(root).as_posix(): json.loads(p.read_text())
                for p in sorted(root.rglob('*')) if p.name in _ADAPTER_CONFIGS and p.is_file()}
    return {'config': config, 'weights': weights, 'adapter_configs': adapters}


def resolve_secret(secret_file: str | os.PathLike | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The Store secret: the bytes of ``secret_file`` (trailing whitespace stripped) when given,
    else ``LMDEPLOY_STORE_SECRET`` (UTF-8) when set and non-empty, else None.

    Raises:
        ValueError: the file cannot be read, or the secret is shorter than 16 bytes (names
            ``store_secret_file`` or the variable).
    """
    environ = os.environ if environ is None else environ
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_bytes().rstrip()
        except OSError as err:
            raise ValueError(f'store_secret_file {str(secret_file)!r} cannot be read: {err}') from err
        source = f'store_secret_file {str(secret_file)!r}'
    elif environ.get(SECRET_ENV):
        secret, source = environ[SECRET_ENV].encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f'{source} holds {len(secret)} bytes; the Store secret must be at least {MIN_SECRET_BYTES} '
                         f'bytes (e.g. `openssl rand -hex 32`)')
    return secret


def secret_key_id(secret: bytes | None) -> str | None:
    """A public 16-hex-digit id of ``secret`` (HMAC-SHA256 of a fixed label; reveals nothing
    usable about the secret), or None without a secret."""
    if secret is None:
        return None
    return hmac.new(secret, b'lmdeploy store key id', hashlib.sha256).hexdigest()[:16]


def engine_namespace(model_path: str | os.PathLike, *, dtype: str, block_size: int, layers: list[str],
                     tp_rank: int = 0, tp_size: int = 1, adapter=None, override: str | None = None,
                     secret: bytes | None = None, cache_dir: str | os.PathLike | None = None,
                     paged_groups: list[list[int]] | None = None) -> bytes:
    """The engine's 16-byte Store namespace digest.

    Digest of the model identity (:func:`model_identity`; replaced by ``override`` when the
    operator manages identity with ``store_namespace``), ``dtype``, ``block_size``, the layer
    cache specs ``layers``, ``tp_rank``/``tp_size``, ``adapter``, the secret's key id and the
    object format version. The engine always passes ``tp_rank=0, tp_size=1`` (objects hold every
    head, in the single-process layout), so its namespace does not depend on its ``tp``.
    ``paged_groups`` (the cache entries of each paged group, when a mixed model's window layers
    keep a pool of their own and their rows are window objects) joins the digest only when
    given, so a model's namespace without the split is unchanged.

    Raises:
        ValueError: see :func:`model_identity` and :func:`.object_format.namespace_digest`.
    """
    model = {'operator_namespace': override} if override is not None else model_identity(model_path,
                                                                                          cache_dir=cache_dir)
    extra = {'paged_groups': [list(g) for g in paged_groups]} if paged_groups is not None else {}
    return namespace_digest(model=model, dtype=dtype, block_size=block_size, layers=list(layers), tp_rank=tp_rank,
                            tp_size=tp_size, adapter=adapter, secret_key_id=secret_key_id(secret), **extra)
