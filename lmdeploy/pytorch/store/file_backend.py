"""A Store backend in a local folder (``store_backend='file:DIR'``): checkpoints that outlive
the engine on one machine, without a Mooncake master.

This module owns the folder's layout, its size limit and who may write it; the file-system
primitives that hold against a hostile folder (no symbolic link followed, nothing opened that
could block, nothing truncated) are in :mod:`.safe_fs`. Invariants:

- The folder is private: it must be a real directory (not a symbolic link) owned by the
  engine's effective user and not writable by group or others, else the engine refuses to
  start (``ValueError`` naming ``store_backend``). Everything created in it is 0700 (folders)
  or 0600 (files) whatever the umask.
- A value is visible only complete: it is written to a new temporary file in ``DIR/tmp``
  (unpredictable name, ``O_EXCL``), ``fsync``-ed, then linked to its final name (``link``
  fails when the name exists: an atomic put-if-absent), and the folder is ``fsync``-ed (once
  per folder per :meth:`FileStore.put_many` batch). A torn value is never restored.
- Put results are exact with any number of writers, threads or processes: values are linked
  under one folder lock (``flock`` on ``DIR/.lock``), so exactly one writer of a key gets
  ``STORED`` and the others ``EXISTS``.
- Only a regular file of at most ``max_object_bytes`` at a key's path is a value. Anything
  else there (FIFO, device, socket, symbolic link, directory, larger file) reads as a miss
  without blocking, ``batch_exists`` says absent, and the next put of the key replaces it
  (``REPAIRED``); a file that ends early while read is a miss too.
- ``max_bytes`` bounds the folder, not one process: ``DIR/.lock`` holds the bytes of stored
  values, updated under the lock by every writer and rebuilt by a scan of the folder at open,
  at each eviction and at least once a minute while written. After a put takes it over the limit, the
  folder is rescanned and the least recently used values (modification time; a read touches
  it) of all writers are removed until it holds at most 90 % of the limit.
- Temporary files of a writer that is gone are removed: every open :class:`FileStore` holds an
  ``flock`` on ``DIR/writers/{writer}.lock``, and a ``.part`` whose writer's lock is free (the
  process died, whatever became of its pid) or that is older than ``stale_part_s`` is deleted
  at the next start or put (at most once a second per process).

Layout::

    DIR/.lock                                            folder lock; bytes of stored values (u64 LE),
                                                         time of the last scan (f64 LE, Unix seconds)
    DIR/objects/{namespace}/{kind}/{hash[:2]}/{hash}     one complete value per key
    DIR/tmp/{writer}-{random}.part                       values being written
    DIR/writers/{writer}.lock                            held by each open FileStore
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import struct
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .backend import PutResult
from .mooncake_client import StoreClientStats
from .safe_fs import (FILE_MODE, FileState, UnsafeEntryError, create_file, describe, entry_state, lock_file_is_held,
                      open_dir, open_dir_chain, open_private_root, read_regular, remove_entry)

__all__ = ['FileStore', 'EVICT_TO', 'DEFAULT_MAX_OBJECT_BYTES', 'STALE_PART_S']

EVICT_TO = 0.9          # an eviction brings the folder down to this fraction of max_bytes
DEFAULT_MAX_OBJECT_BYTES = 4 << 30    # larger than any KV block or state checkpoint the engine writes
STALE_PART_S = 600.0    # a temporary file older than this is a stuck write: removed even if its writer lives
CLEAN_EVERY_S = 1.0     # how often a writer looks for temporary files of writers that are gone
RESCAN_EVERY_S = 60.0   # the folder's byte count is rebuilt by a scan at least this often while written
_KEY_CHARS = frozenset('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_')
_COUNT = struct.Struct('<Qd')      # DIR/.lock: bytes of stored values, Unix time of the last full scan
_COUNT_MAX = (1 << 64) - 1
_PART = re.compile(r'([0-9a-f]{16})-[0-9a-f]{16}\.part')
_WRITER_LOCK = re.compile(r'([0-9a-f]{16})\.lock')
_MAX_DEPTH = 32         # deeper folders under objects/ are never ours (keys have a few parts)


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_THREADS = 8


def _map(fn, writes: list, parts: dict) -> list:
    """``[fn(w, parts) for w in writes]``, on a thread pool when there is more than one (the
    pool is made again in a forked child: its parent's threads do not exist there)."""
    global _POOL
    if len(writes) <= 1:
        return [fn(w, parts) for w in writes]
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix='file-store-write'))
    return list(_POOL[1].map(fn, writes, [parts] * len(writes)))


def _listing(fd: int) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of each entry of the folder ``fd`` (entries gone meanwhile left out)."""
    out = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                pass
    return out


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FileStore:
    """A :class:`.backend.StoreBackend` over a local folder, safe for several processes and
    against anyone else who can write the folder (see the module docstring).

    Args:
        root: the folder (created with mode 0700 if missing).
        max_bytes: most bytes of stored values in the folder, all processes together (least
            recently used removed beyond); 0 = no limit.
        max_object_bytes: largest value (bytes) put or read; a larger file at a key's path is
            not a value (a miss, replaced by the next put). The Store tier may pass its largest
            object (header + payload + MAC).
        stale_part_s: seconds after which a temporary file is a stuck write and removed even
            if its writer still runs.

    Raises:
        ValueError: ``max_bytes`` is negative (named ``store_file_max_bytes``), ``max_object_bytes``
            is not positive, or ``root`` is refused (a symbolic link, another user's, writable by
            group or others, inside a folder another user can rename) or cannot be created or
            written (named ``store_backend``).
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int = 0, *,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES, stale_part_s: float = STALE_PART_S):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f'store_file_max_bytes must be an int >= 0 (bytes), got {max_bytes!r}')
        if not isinstance(max_object_bytes, int) or isinstance(max_object_bytes, bool) or max_object_bytes <= 0:
            raise ValueError(f'max_object_bytes must be an int > 0 (bytes), got {max_object_bytes!r}')
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.max_bytes = max_bytes
        self.max_object_bytes = max_object_bytes
        self.stale_part_s = float(stale_part_s)
        self._lock = threading.Lock()           # stats of this handle
        self._folder_guard = threading.Lock()   # threads of this process share one flock description
        self._closed = False
        self._last_clean = 0.0
        self.stats = StoreClientStats()
        self._writer = secrets.token_hex(8)
        self._writer_fd = -1
        fds: list[int] = []
        try:
            self._root_fd = open_private_root(str(self.root))
            fds.append(self._root_fd)
            subs: dict[str, int] = {}
            for create in (False, True):     # check those there before creating any
                for name in ('objects', 'tmp', 'writers'):
                    if name not in subs:
                        try:
                            subs[name], _ = open_dir(self._root_fd, name, create=create, repair=False)
                        except FileNotFoundError:
                            continue
                        fds.append(subs[name])
            self._objects_fd, self._tmp_fd, self._writers_fd = subs['objects'], subs['tmp'], subs['writers']
            self._lock_fd = self._open_folder_lock()
            fds.append(self._lock_fd)
            with self._folder():
                # registered under the folder lock: a cleaner never sees this lock file unheld
                self._writer_fd = create_file(self._writers_fd, f'{self._writer}.lock')
                fds.append(self._writer_fd)
                fcntl.flock(self._writer_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._clean_tmp()
                self._set_count(self._scan()[1], time.time())
        except UnsafeEntryError as err:
            _close_fds(fds)
            raise ValueError(f'store_backend folder {str(self.root)!r} refused: {err.strerror}') from err
        except OSError as err:
            _close_fds(fds)
            raise ValueError(f'store_backend folder {str(self.root)!r} cannot be used: {err}') from err
        # the folder descriptors live as long as this object: a call racing close() never
        # sees a descriptor number that was reused for something else (close() takes only the
        # writer lock out of this list)
        self._fds = fds
        weakref.finalize(self, _close_fds, fds)

    # folder-wide state ---------------------------------------------------------------------
    def _open_folder_lock(self) -> int:
        """``DIR/.lock`` (created 0600): the folder lock and the shared byte count.

        Raises:
            UnsafeEntryError: it is not a regular file of ours (a symbolic link, FIFO...).
        """
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        for _ in range(3):
            try:
                fd = os.open('.lock', flags, dir_fd=self._root_fd)
            except FileNotFoundError:
                try:
                    fd = create_file(self._root_fd, '.lock')
                except FileExistsError:
                    continue
            except OSError as err:       # a symbolic link (ELOOP), a directory (EISDIR), a FIFO (ENXIO)...
                st = os.stat('.lock', dir_fd=self._root_fd, follow_symlinks=False)
                raise UnsafeEntryError('.lock', describe(st)) from err
            st = os.fstat(fd)
            reason = (describe(st) if not stat.S_ISREG(st.st_mode) else
                      f'is owned by uid {st.st_uid}' if st.st_uid != os.geteuid() else None)
            if reason:
                os.close(fd)
                raise UnsafeEntryError('.lock', reason)
            if stat.S_IMODE(st.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
            return fd
        raise UnsafeEntryError('.lock', 'keeps changing while it is opened')

    @contextlib.contextmanager
    def _folder(self):
        """Hold the folder lock (every process and thread sharing the folder)."""
        with self._folder_guard:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _count(self) -> tuple[int, float]:
        """The folder's byte count and the time of its last full scan (0 when unreadable)."""
        raw = os.pread(self._lock_fd, _COUNT.size, 0)
        return _COUNT.unpack(raw) if len(raw) == _COUNT.size else (0, 0.0)

    def _set_count(self, used: int, scanned: float) -> None:
        os.pwrite(self._lock_fd, _COUNT.pack(min(max(0, used), _COUNT_MAX), scanned), 0)

    def _account(self, delta: int) -> None:
        """Add ``delta`` bytes to the folder's count (folder lock held), evicting if it is now
        over the limit. A count whose last scan is more than ``RESCAN_EVERY_S`` old (or in the
        future) is replaced by a scan: a writer killed between its link and its count update,
        or a hand-edited count, leaves the count wrong for at most that long."""
        used, scanned = self._count()
        now = time.time()
        if not 0.0 <= now - scanned <= RESCAN_EVERY_S:
            used, scanned = self._scan()[1], now          # the scan sees this batch's links
        else:
            used = max(0, used + delta)
        if self.max_bytes and used > self.max_bytes:
            self._evict()
        else:
            self._set_count(used, scanned)

    def _scan(self) -> tuple[list[tuple[int, int, tuple[str, ...], int]], int]:
        """Every value in the folder as ``(mtime_ns, bytes, path parts, inode)`` and their total
        (folder lock held). Entries that can never be values (links, FIFOs, devices, sockets,
        oversized files) are removed on the way; folders of another user are skipped."""
        entries, total = [], 0

        def walk(fd: int, prefix: tuple[str, ...]) -> None:
            nonlocal total
            for name, st in _listing(fd):
                if stat.S_ISDIR(st.st_mode):
                    if len(prefix) >= _MAX_DEPTH:
                        continue
                    try:
                        sub, _ = open_dir(fd, name, create=False)
                    except (FileNotFoundError, UnsafeEntryError):
                        continue
                    try:
                        walk(sub, prefix + (name, ))
                    finally:
                        os.close(sub)
                elif stat.S_ISREG(st.st_mode) and st.st_size <= self.max_object_bytes:
                    entries.append((st.st_mtime_ns, st.st_size, prefix + (name, ), st.st_ino))
                    total += st.st_size
                else:
                    try:
                        remove_entry(fd, name)
                    except OSError:
                        pass

        walk(self._objects_fd, ())
        return entries, total

    def _evict(self) -> None:
        """Rescan and remove least recently used values until the folder holds at most
        ``EVICT_TO * max_bytes`` bytes (folder lock held)."""
        entries, total = self._scan()
        evicted, cache = 0, {}
        try:
            if total > self.max_bytes:
                target = int(self.max_bytes * EVICT_TO)
                for _, size, parts, ino in sorted(entries):
                    if total <= target:
                        break
                    try:
                        parent = open_dir_chain(self._objects_fd, parts[:-1], False, cache)
                        st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                        if st.st_ino != ino:
                            continue
                        os.unlink(parts[-1], dir_fd=parent)
                    except OSError:
                        continue
                    total -= size
                    evicted += 1
        finally:
            _close_fds(list(cache.values()))
        self._set_count(total, time.time())
        with self._lock:
            self.stats.evicted += evicted

    def _clean_tmp(self) -> None:
        """Remove temporary files whose writer is gone (its lock is free) or that are older than
        ``stale_part_s``, anything else in ``tmp``, and free writer locks (folder lock held)."""
        now, alive = time.time(), {self._writer: True}

        def held(owner: str) -> bool:
            if owner not in alive:
                alive[owner] = lock_file_is_held(self._writers_fd, f'{owner}.lock')
            return alive[owner]

        for fd, pattern, keep_fresh in ((self._tmp_fd, _PART, True), (self._writers_fd, _WRITER_LOCK, False)):
            for name, st in _listing(fd):
                m = pattern.fullmatch(name)
                if m and stat.S_ISREG(st.st_mode) and held(m.group(1)) and \
                        not (keep_fresh and now - st.st_mtime > self.stale_part_s):
                    continue
                try:
                    remove_entry(fd, name)
                except OSError:
                    pass
        self._last_clean = time.monotonic()

    # layout ---------------------------------------------------------------------------------
    @staticmethod
    def _split(key: str) -> tuple[tuple[str, ...], str]:
        """``(('ns', 'kind', 'hh'), 'hash')`` for ``ns/kind/hash``: the folders and file name of
        a key's value (``DIR/objects/ns/kind/hh/hash``).

        Raises:
            ValueError: a part is empty or holds a character outside ``[A-Za-z0-9_-]``.
        """
        parts = key.split('/') if isinstance(key, str) else ['']
        if not key or any(not p or set(p) - _KEY_CHARS for p in parts) or len(parts) >= _MAX_DEPTH - 1:
            raise ValueError(f'a Store key must be "/"-separated parts of [A-Za-z0-9_-], got {key!r}')
        *head, name = parts
        return (*head, name[:2]), name

    # operations -----------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return not self._closed

    def _fail(self, what: str, counter: str, err) -> None:
        with self._lock:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            self.stats.last_error = f'{what}: {err}'

    def begin_torn_write(self, key: str, value) -> Path:
        """Write the first half of ``value`` to a temporary file and stop there, as a writer
        killed mid-put would (fault tests only). Returns the temporary file."""
        data = memoryview(value).cast('B')
        part = f'{self._writer}-{secrets.token_hex(8)}.part'
        create_file(self._tmp_fd, part, data[:data.nbytes // 2])
        return self.root / 'tmp' / part

    def put(self, key: str, value, *, replace: bool = False) -> PutResult:
        """Write ``value`` under ``key`` atomically (see the module docstring); one item of
        :meth:`put_many`. Never raises."""
        return self.put_many([(key, value, replace)])[0]

    def put_many(self, items: list[tuple[str, object, bool]]) -> list[PutResult]:
        """Store each ``(key, value, replace)`` (value: bytes-like of at most ``max_object_bytes``
        bytes); the results, in order, as :meth:`.backend.StoreBackend.put` gives them.

        ``STORED``: the key now holds this value. ``EXISTS``: a complete value was there (no
        write). ``REPAIRED``: ``replace`` swapped this value in atomically (a reader sees the old
        or the new one), or something that is not a value (a directory, FIFO, link, device,
        oversized file) sat at the key's path and was replaced. ``FAILED``: an I/O error (disk
        full, permissions) or a bad key, counted in ``stats.put_failures``; never raises.

        Each value is written and ``fsync``-ed to its own temporary file (up to 8 at once, on a
        thread pool), the batch is linked under the folder lock (one lock, one byte-count
        update and at most one eviction per batch), then each folder that gained names is
        ``fsync``-ed once. A key given twice in one batch is stored once (the second is
        ``EXISTS``, or ``REPAIRED`` with ``replace``).
        """
        results = [PutResult.FAILED] * len(items)
        if self._closed:
            with self._lock:
                self.stats.put_failures += len(items)
            return results
        cache, fresh, parts, pending, writes = {}, set(), {}, [], []
        sizes = [0] * len(items)
        try:
            for i, (key, value, replace) in enumerate(items):
                try:
                    head, name = self._split(key)
                    data = memoryview(value).cast('B')
                    sizes[i] = data.nbytes
                    if data.nbytes > self.max_object_bytes:
                        raise ValueError(f'{data.nbytes} bytes is more than max_object_bytes={self.max_object_bytes}')
                    parent = open_dir_chain(self._objects_fd, head, True, cache, fresh)
                    if not replace and entry_state(parent, name, self.max_object_bytes)[0] is FileState.OK:
                        results[i] = PutResult.EXISTS       # skip the write; the link below would fail too
                        continue
                    parts[i] = f'{self._writer}-{secrets.token_hex(8)}.part'
                    writes.append((i, key, parent, name, bool(replace), data))
                except (OSError, ValueError, TypeError) as err:
                    self._fail(f'put {key}', 'put_failures', err)
            # concurrent fsyncs share the file system's journal commits (ext4: 256 x 64 KiB
            # files in 66 ms with 8 threads against 866 ms one after the other)
            for (i, key, parent, name, replace, _), err in zip(writes, _map(self._write_part, writes, parts)):
                if err is None:
                    pending.append((i, key, parent, name, replace))
                else:
                    del parts[i]
                    self._fail(f'put {key}', 'put_failures', err)
            touched: dict[int, list[int]] = {}
            if pending:
                with self._folder():
                    delta = 0
                    for i, key, parent, name, replace in pending:
                        try:
                            results[i], change = self._install(parts[i], parent, name, sizes[i], replace)
                        except OSError as err:
                            self._fail(f'put {key}', 'put_failures', err)
                            continue
                        delta += change
                        if results[i].gained:
                            touched.setdefault(parent, []).append(i)
                    try:
                        if time.monotonic() - self._last_clean >= CLEAN_EVERY_S:
                            self._clean_tmp()
                        self._account(delta)
                    except OSError as err:      # the values are in; only the bookkeeping failed
                        with self._lock:
                            self.stats.last_error = f'put: accounting: {err}'
            for fd in set(touched) | fresh:
                try:
                    os.fsync(fd)
                except OSError as err:      # linked but maybe not durable: not known to be stored
                    for i in touched.get(fd, ()):
                        results[i] = PutResult.FAILED
                        self._fail(f'put {items[i][0]}', 'put_failures', err)
        finally:
            for part in parts.values():
                try:
                    os.unlink(part, dir_fd=self._tmp_fd)
                except OSError:
                    pass
            _close_fds(list(cache.values()))
        with self._lock:
            for result, size in zip(results, sizes):
                if result.gained:
                    self.stats.puts += 1
                    self.stats.put_bytes += size
                    self.stats.repaired += result is PutResult.REPAIRED
                elif result is PutResult.EXISTS:
                    self.stats.existing += 1
        return results

    def _write_part(self, write: tuple, parts: dict[int, str]) -> OSError | None:
        """Write one item's temporary file; the error instead of raising it."""
        try:
            create_file(self._tmp_fd, parts[write[0]], write[-1])
        except OSError as err:
            return err
        return None

    def _install(self, part: str, parent: int, name: str, size: int, replace: bool) -> tuple[PutResult, int]:
        """Give the temporary file ``part`` the name ``name`` in ``parent`` (folder lock held);
        returns the result and the change of the folder's bytes."""
        state, st = entry_state(parent, name, self.max_object_bytes)
        if state is FileState.OK:
            if not replace:
                return PutResult.EXISTS, 0
            os.rename(part, name, src_dir_fd=self._tmp_fd, dst_dir_fd=parent)
            return PutResult.REPAIRED, size - st.st_size
        if state is FileState.BAD:
            # what was there is not counted as a value (unless a scan counted files under a
            # directory there): the count may stay high until the next scan, never low
            remove_entry(parent, name)
        try:
            os.link(part, name, src_dir_fd=self._tmp_fd, dst_dir_fd=parent, follow_symlinks=False)
        except FileExistsError:         # a writer that does not take the folder lock
            return PutResult.EXISTS, 0
        repaired = replace or state is FileState.BAD
        return (PutResult.REPAIRED if repaired else PutResult.STORED), size

    def get(self, key: str) -> bytes | None:
        """The value under ``key`` (and mark it recently used); None when missing
        (``stats.get_misses``) or not a readable value (``stats.get_failures``: I/O error, or
        anything but a regular file of at most ``max_object_bytes`` bytes read whole). Never
        blocks on what sits at the key's path."""
        if self._closed:
            self._fail(f'get {key}', 'get_failures', 'closed')
            return None
        cache = {}
        try:
            head, name = self._split(key)
            try:
                parent = open_dir_chain(self._objects_fd, head, False, cache)
            except FileNotFoundError:
                state, data, why = FileState.MISSING, None, ''
            else:
                state, data, why = read_regular(parent, name, self.max_object_bytes)
        except (OSError, ValueError) as err:
            self._fail(f'get {key}', 'get_failures', err)
            return None
        finally:
            _close_fds(list(cache.values()))
        if state is FileState.BAD:
            self._fail(f'get {key}', 'get_failures', why)
            return None
        with self._lock:
            if data is None:
                self.stats.get_misses += 1
            else:
                self.stats.gets += 1
                self.stats.get_bytes += len(data)
        return data

    def batch_exists(self, keys: list[str]) -> list[bool] | None:
        """Per key, whether a value is stored (a regular file of at most ``max_object_bytes``;
        anything else at the path is absent, so the tier puts it again); None when the folder
        cannot be read."""
        if self._closed:
            with self._lock:
                self.stats.exists_failures += len(keys)
            return None
        cache = {}
        try:
            found = []
            for key in keys:
                head, name = self._split(key)
                try:
                    parent = open_dir_chain(self._objects_fd, head, False, cache)
                except (FileNotFoundError, UnsafeEntryError):
                    found.append(False)
                    continue
                found.append(entry_state(parent, name, self.max_object_bytes)[0] is FileState.OK)
            return found
        except (OSError, ValueError) as err:
            with self._lock:
                self.stats.exists_failures += len(keys)
                self.stats.last_error = f'exists: {err}'
            return None
        finally:
            _close_fds(list(cache.values()))

    def exists(self, key: str) -> bool:
        return bool((self.batch_exists([key]) or [False])[0])

    def remove(self, key: str) -> bool:
        """Remove whatever is at ``key``'s path; True when it is gone afterwards."""
        if self._closed:
            return False
        cache = {}
        try:
            head, name = self._split(key)
            with self._folder():
                try:
                    parent = open_dir_chain(self._objects_fd, head, False, cache)
                except FileNotFoundError:
                    return True
                state, st = entry_state(parent, name, self.max_object_bytes)
                remove_entry(parent, name)
                self._account(-st.st_size if state is FileState.OK else 0)
        except (OSError, ValueError):
            return False
        finally:
            _close_fds(list(cache.values()))
        return True

    @property
    def num_bytes(self) -> int:
        """Bytes of stored values in the folder, all writers together (the shared count,
        rebuilt by a scan at open, at each eviction and at least every ``RESCAN_EVERY_S``)."""
        return self._count()[0]

    def close(self) -> None:
        """Stop serving (idempotent): later calls fail, and this writer's lock is released so
        its temporary files count as stale."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.unlink(f'{self._writer}.lock', dir_fd=self._writers_fd)
        except OSError:
            pass
        self._fds.remove(self._writer_fd)
        _close_fds([self._writer_fd])


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

