"""A Store backend in a local folder (``store_backend='file:DIR'``): checkpoints that outlive
the engine on one machine, without a Mooncake master.

This module owns the folder's layout and its size limit. Invariants:

- A value is visible only complete: it is written to a temporary file in ``DIR/tmp``,
  ``fsync``-ed, then linked to its final name (``os.link``, which fails when the name exists:
  an atomic put-if-absent), and the folder is ``fsync``-ed. A process killed mid-put leaves at
  most a temporary file, which no reader looks at and the next open removes once its writer
  is gone; a torn value is never restored.
- Put results are exact with any number of writers, threads or processes: the link succeeds
  for exactly one of them (``STORED``), the others get ``EXISTS``.
- ``max_bytes`` bounds the bytes of complete values: after a put takes the folder over it,
  the least recently used values (by modification time; a read touches it) are removed until
  the folder is at 90 % of the limit. Other processes sharing the folder are seen by the
  rescan each eviction does. A value being read while it is evicted is read whole or missed.

Layout::

    DIR/objects/{namespace}/{kind}/{hash[:2]}/{hash}     one complete value per key
    DIR/tmp/{pid}-{random}.part                           values being written
"""
from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .backend import PutResult
from .mooncake_client import StoreClientStats

__all__ = ['FileStore', 'EVICT_TO']

EVICT_TO = 0.9          # an eviction brings the folder down to this fraction of max_bytes
_KEY_CHARS = frozenset('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_')


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class _Entry:
    size: int
    used: float


class FileStore:
    """A :class:`.backend.StoreBackend` over a local folder (safe for several processes).

    Args:
        root: the folder (created if missing).
        max_bytes: most bytes of complete values kept (LRU eviction beyond); 0 = no limit.

    Raises:
        ValueError: ``max_bytes`` is negative, or ``root`` cannot be created or written
            (named ``store_backend``).
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int = 0):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f'store_file_max_bytes must be an int >= 0 (bytes), got {max_bytes!r}')
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._objects, self._tmp = self.root / 'objects', self.root / 'tmp'
        try:
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True, exist_ok=True)
            probe = self._tmp / f'{os.getpid()}-probe.part'
            probe.write_bytes(b'')
            probe.unlink()
        except OSError as err:
            raise ValueError(f'store_backend folder {str(self.root)!r} cannot be used: {err}') from err
        self._lock = threading.Lock()
        self._closed = False
        self.stats = StoreClientStats()
        self._remove_stale_parts()
        self._entries: dict[Path, _Entry] = {}
        self._bytes = 0
        self._rescan()

    # layout ---------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        """``DIR/objects/ns/kind/hh/hash`` for ``ns/kind/hash``; any other key is flattened
        into one file name of safe characters."""
        parts = key.split('/')
        if not key or any(not p or set(p) - _KEY_CHARS for p in parts):
            raise ValueError(f'a Store key must be "/"-separated parts of [A-Za-z0-9_-], got {key!r}')
        *head, name = parts
        return self._objects.joinpath(*head, name[:2], name)

    def _remove_stale_parts(self) -> None:
        """Delete temporary files whose writer process is gone (torn writes)."""
        for part in self._tmp.glob('*.part'):
            pid = part.name.split('-', 1)[0]
            if not pid.isdigit() or not _pid_alive(int(pid)):
                part.unlink(missing_ok=True)

    def _rescan(self) -> None:
        """Rebuild the size index from the folder (other processes may have written)."""
        entries = {}
        for dirpath, _, files in os.walk(self._objects):
            for name in files:
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                entries[path] = _Entry(st.st_size, st.st_mtime)
        self._entries = entries
        self._bytes = sum(e.size for e in entries.values())

    # operations -----------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return not self._closed

    def begin_torn_write(self, key: str, value) -> Path:
        """Write the first half of ``value`` to a temporary file and stop there, as a writer
        killed mid-put would (fault tests only). Returns the temporary file."""
        data = memoryview(value).cast('B')
        part = self._tmp / f'{os.getpid()}-{secrets.token_hex(8)}.part'
        with open(part, 'wb') as f:
            f.write(data[:data.nbytes // 2])
            f.flush()
            os.fsync(f.fileno())
        return part

    def put(self, key: str, value, *, replace: bool = False) -> PutResult:
        """Write ``value`` under ``key`` atomically (see the module docstring). ``replace``
        swaps in the new value with ``os.replace`` (``REPAIRED``). Never raises: an I/O error
        (disk full, permissions) is ``FAILED``, counted in ``stats.put_failures``."""
        if self._closed:
            self.stats.put_failures += 1
            return PutResult.FAILED
        data = memoryview(value).cast('B')
        part = self._tmp / f'{os.getpid()}-{secrets.token_hex(8)}.part'
        try:
            path = self._path(key)
            if not replace and path.exists():
                with self._lock:
                    self.stats.existing += 1
                return PutResult.EXISTS
            with open(part, 'wb') as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            if replace:
                os.replace(part, path)
            else:
                try:
                    os.link(part, path)          # fails if another writer linked first
                except FileExistsError:
                    with self._lock:
                        self.stats.existing += 1
                    return PutResult.EXISTS
            self._fsync_dir(path.parent)
        except (OSError, ValueError) as err:
            with self._lock:
                self.stats.put_failures += 1
                self.stats.last_error = f'put {key}: {err}'
            return PutResult.FAILED
        finally:
            part.unlink(missing_ok=True)
        with self._lock:
            old = self._entries.get(path)
            self._entries[path] = _Entry(data.nbytes, time.time())
            self._bytes += data.nbytes - (old.size if old else 0)
            self.stats.puts += 1
            self.stats.put_bytes += data.nbytes
            if replace:
                self.stats.repaired += 1
            if self.max_bytes and self._bytes > self.max_bytes:
                self._evict()
        return PutResult.REPAIRED if replace else PutResult.STORED

    @staticmethod
    def _fsync_dir(folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _evict(self) -> None:
        """Remove least recently used values until the folder holds at most
        ``EVICT_TO * max_bytes`` bytes (lock held). Rescans first: other processes write too."""
        self._rescan()
        target = int(self.max_bytes * EVICT_TO)
        for path, entry in sorted(self._entries.items(), key=lambda item: item[1].used):
            if self._bytes <= target:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self._bytes -= entry.size
            del self._entries[path]
            self.stats.evicted += 1

    def get(self, key: str) -> bytes | None:
        """The value under ``key`` (and mark it recently used); None when missing
        (``stats.get_misses``) or unreadable (``stats.get_failures``)."""
        if self._closed:
            self.stats.get_failures += 1
            return None
        try:
            path = self._path(key)
            data = path.read_bytes()
            try:
                os.utime(path)                   # least recently *used*: a read counts
            except OSError:
                pass
        except FileNotFoundError:
            with self._lock:
                self.stats.get_misses += 1
            return None
        except (OSError, ValueError) as err:
            with self._lock:
                self.stats.get_failures += 1
                self.stats.last_error = f'get {key}: {err}'
            return None
        with self._lock:
            self.stats.gets += 1
            self.stats.get_bytes += len(data)
            entry = self._entries.get(path)
            if entry is not None:
                entry.used = time.time()
        return data

    def batch_exists(self, keys: list[str]) -> list[bool] | None:
        """Per key, whether a complete value is stored; None when the folder cannot be read."""
        if self._closed:
            self.stats.exists_failures += len(keys)
            return None
        try:
            return [self._path(k).exists() for k in keys]
        except (OSError, ValueError) as err:
            with self._lock:
                self.stats.exists_failures += len(keys)
                self.stats.last_error = f'exists: {err}'
            return None

    def exists(self, key: str) -> bool:
        return bool((self.batch_exists([key]) or [False])[0])

    def remove(self, key: str) -> bool:
        try:
            path = self._path(key)
            path.unlink(missing_ok=True)
        except (OSError, ValueError):
            return False
        with self._lock:
            entry = self._entries.pop(path, None)
            if entry is not None:
                self._bytes -= entry.size
        return True

    @property
    def num_bytes(self) -> int:
        """Bytes of complete values this process knows of (rescanned at each eviction)."""
        with self._lock:
            return self._bytes

    def close(self) -> None:
        self._closed = True


def parse_store_backend(value: str | None) -> tuple[str, str | None]:
    """``None``/``'mooncake'`` -> ``('mooncake', None)``; ``'file:DIR'`` -> ``('file', DIR)``.

    Raises:
        ValueError: anything else, or ``file:`` without a folder (names ``store_backend``).
    """
    if value is None or value == 'mooncake':
        return 'mooncake', None
    if isinstance(value, str) and value.startswith('file:') and value[5:].strip():
        return 'file', os.path.expanduser(value[5:])
    raise ValueError(f'store_backend must be "mooncake" or "file:DIR" (a folder), got {value!r}')

