"""File-system primitives of the ``file:`` Store backend (:mod:`.file_backend`) that hold against
a hostile local folder: pre-planted symbolic links, FIFOs, device nodes, directories where files
should be, files of any size, and folders another user controls.

Invariants (every function here keeps them):

- No path is ever resolved through a symbolic link: the folder is opened once (``O_NOFOLLOW``)
  and every later name is looked up one component at a time relative to an open directory
  descriptor (``openat`` style), with ``O_NOFOLLOW`` on every open and ``lstat`` semantics on
  every ``stat``.
- Nothing is opened for writing unless this call created it: new files use
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never ``O_TRUNC``), so no existing file is ever changed.
- Opening never blocks: reads use ``O_NONBLOCK`` and accept only a regular file (``S_ISREG``
  on the opened descriptor) of a bounded size, read with a bounded loop.
- What this module creates is private whatever the umask: folders 0700, files 0600 (set with
  ``fchmod`` after creation).
- A folder is used only when it is a real directory owned by the effective user and not
  writable by group or others.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat

__all__ = ['UnsafeEntryError', 'FileState', 'describe', 'open_private_root', 'open_dir', 'open_dir_chain',
           'entry_state', 'read_regular', 'create_file', 'remove_entry', 'lock_file_is_held', 'DIR_MODE', 'FILE_MODE']

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_CHUNK = 1 << 30          # Linux returns at most ~2 GiB per read(2); keep each call well below
_MAX_TREE_DEPTH = 32           # a deeper tree at an object path is not ours: removed without descending further


class UnsafeEntryError(OSError):
    """A folder entry this backend must not use: wrong type, owner or mode (``reason`` says which)."""

    def __init__(self, name: str, reason: str):
        super().__init__(errno.EPERM, f'{name!r} {reason}')
        self.reason = reason


class FileState:
    """What :func:`entry_state` found at a name."""
    MISSING = 'missing'      # nothing there
    OK = 'ok'                # a regular file within the size bound
    BAD = 'bad'              # something there that is not a usable value (type, size)


def _private_reason(st: os.stat_result) -> str | None:
    """Why a directory's ``stat`` makes it unusable, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return 'is not a directory'
    if st.st_uid != os.geteuid():
        return f'is owned by uid {st.st_uid}, not by this process\'s user (uid {os.geteuid()})'
    if st.st_mode & 0o022:
        return f'is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})'
    return None


def _check_ancestors(path: str) -> None:
    """Refuse a folder whose existing ancestors let another user replace it: one owned by a
    user other than root or this process's, or writable by others without the sticky bit."""
    euid = os.geteuid()
    parent = os.path.dirname(path)
    while True:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in (0, euid):
                raise UnsafeEntryError(parent, f'(an ancestor) is owned by uid {st.st_uid}, '
                                               'who could replace the folder')
            if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
                raise UnsafeEntryError(parent, '(an ancestor) is writable by everyone without the sticky bit')
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def open_private_root(path: str) -> int:
    """Open (creating it and missing parents with mode 0700 when absent) the folder ``path`` and
    return its directory descriptor (close-on-exec).

    Raises:
        UnsafeEntryError: ``path`` is a symbolic link, not a directory, not owned by the effective
            user, writable by group or others, or an ancestor lets another user replace it.
        OSError: it cannot be created or opened.
    """
    path = os.path.abspath(path)
    _check_ancestors(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UnsafeEntryError(path, 'is a symbolic link') from err
        raise
    try:
        reason = _private_reason(os.fstat(fd))
        if reason:
            raise UnsafeEntryError(path, reason)
        if missing:
            os.fchmod(fd, DIR_MODE)              # mkdir's mode is masked by the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(parent_fd: int, name: str, create: bool, repair: bool = True) -> tuple[int, bool]:
    """Open the sub-folder ``name`` of ``parent_fd``; returns ``(fd, created)``.

    With ``create`` a missing folder is made (0700). With ``repair`` anything else at the name
    (a symbolic link, file, FIFO, device) is removed and replaced by a folder (``create``), and
    a folder of ours writable by group or others is set to 0700; without it both are refused.
    A folder of ours with another mode (a world-readable 0755 of an older version) is set to 0700.

    Raises:
        FileNotFoundError: nothing at ``name`` and not ``create``.
        UnsafeEntryError: the folder there is another user's (never touched), or something
            there is refused as said above.
    """
    created = False
    for _ in range(3):
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
                created = True
            except FileExistsError:
                pass
            continue
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if not (create and repair):
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                raise UnsafeEntryError(name, describe(st)) from err
            remove_entry(parent_fd, name)
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise UnsafeEntryError(name, f'is owned by uid {st.st_uid}, not by this process\'s user '
                                             f'(uid {os.geteuid()})')
            if st.st_mode & 0o022 and not repair:
                raise UnsafeEntryError(name, f'is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})')
            if stat.S_IMODE(st.st_mode) != DIR_MODE:
                os.fchmod(fd, DIR_MODE)
        except BaseException:
            os.close(fd)
            raise
        return fd, created
    raise UnsafeEntryError(name, 'keeps changing while it is opened')


def open_dir_chain(base_fd: int, names: tuple[str, ...], create: bool, cache: dict, fresh: set | None = None) -> int:
    """The descriptor of ``base/names[0]/.../names[-1]``, opened one component at a time with
    :func:`open_dir`. ``cache`` maps name prefixes (tuples) to descriptors already opened (the
    caller closes them); ``fresh`` collects the descriptors of folders in which one was created
    (their directory entry needs an ``fsync`` to be durable)."""
    fd = base_fd
    for i in range(len(names)):
        prefix = names[:i + 1]
        nxt = cache.get(prefix)
        if nxt is None:
            nxt, created = open_dir(fd, names[i], create)
            cache[prefix] = nxt
            if created and fresh is not None:
                fresh.add(fd)
        fd = nxt
    return fd


def entry_state(dir_fd: int, name: str, max_size: int) -> tuple[str, os.stat_result | None]:
    """``(FileState, lstat)`` of ``name`` in ``dir_fd``: a regular file of at most ``max_size``
    bytes is ``OK``; anything else there is ``BAD``."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return FileState.MISSING, None
    if stat.S_ISREG(st.st_mode) and st.st_size <= max_size:
        return FileState.OK, st
    return FileState.BAD, st


def read_regular(dir_fd: int, name: str, max_size: int, touch: bool = True) -> tuple[str, bytes | None, str]:
    """Read the whole regular file ``name`` of ``dir_fd``: ``(FileState, data, why)``.

    ``BAD`` (data None, ``why`` says what) for anything but a regular file of at most
    ``max_size`` bytes read whole: a FIFO, socket, device, directory or symbolic link (never
    opened, or opened without blocking and refused), a larger file, or one that ends before
    its size (truncated while read). With ``touch`` the file's times are set to now through the
    descriptor (least-recently-used eviction).

    Raises:
        OSError: an I/O error other than the name being absent.
    """
    state, st = entry_state(dir_fd, name, max_size)
    if state is not FileState.OK:
        return state, None, '' if st is None else describe(st, max_size)
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return FileState.MISSING, None, ''
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            return FileState.BAD, None, f'cannot be opened as a file ({os.strerror(err.errno)})'
        raise
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or fst.st_size > max_size:
            return FileState.BAD, None, describe(fst, max_size)
        size = fst.st_size
        chunks, got = [], 0
        while got < size:
            chunk = os.read(fd, min(size - got, _READ_CHUNK))
            if not chunk:
                return FileState.BAD, None, f'ends after {got} of its {size} bytes'
            chunks.append(chunk)
            got += len(chunk)
        if touch:
            try:
                os.utime(fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    data = chunks[0] if len(chunks) == 1 else b''.join(chunks)
    return FileState.OK, data, ''


def describe(st: os.stat_result, max_size: int = 0) -> str:
    """What a ``stat`` result shows, for error texts: ``'is a FIFO'``, ``'holds N bytes, more
    than the M-byte bound'`` (a regular file)..."""
    if stat.S_ISREG(st.st_mode):
        return f'holds {st.st_size} bytes, more than the {max_size}-byte bound'
    kinds = [(stat.S_ISDIR, 'a directory'), (stat.S_ISLNK, 'a symbolic link'), (stat.S_ISFIFO, 'a FIFO'),
             (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'), (stat.S_ISSOCK, 'a socket')]
    return 'is ' + next((what for test, what in kinds if test(st.st_mode)), 'not a regular file')


def create_file(dir_fd: int, name: str, data: memoryview | None = None, sync: bool = True) -> int:
    """Create the new file ``name`` (mode 0600, never an existing path: ``O_EXCL``), write
    ``data`` whole and ``fsync`` it (``sync``). Without ``data`` the descriptor is returned
    open (the caller closes it); else the number of bytes written. A failed write removes the file.

    Raises:
        FileExistsError: ``name`` exists (whatever it is).
        OSError: the write or ``fsync`` failed (disk full...).
    """
    fd = os.open(name, _CREATE_FLAGS if data is not None else _CREATE_FLAGS & ~os.O_WRONLY | os.O_RDWR,
                 FILE_MODE, dir_fd=dir_fd)
    try:
        os.fchmod(fd, FILE_MODE)                  # the create mode is masked by the umask
        if data is None:
            return fd
        done = 0
        while done < data.nbytes:
            done += os.write(fd, data[done:done + _READ_CHUNK])
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.close(fd)
    return done


def remove_entry(dir_fd: int, name: str, depth: int = 0) -> int:
    """Remove whatever is at ``name`` in ``dir_fd`` (a directory with everything under it),
    without following links; returns the bytes of regular files removed. A missing name is 0."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    removed = 0
    if depth < _MAX_TREE_DEPTH:
        sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        try:
            for entry in list(os.scandir(sub)):
                removed += remove_entry(sub, entry.name, depth + 1)
        finally:
            os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)
    return removed


def lock_file_is_held(dir_fd: int, name: str) -> bool:
    """True when some process holds an ``flock`` on the regular file ``name`` of ``dir_fd``;
    False when it is free, missing or not a regular file (a writer that is gone holds nothing,
    whatever became of its process id)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)         # also drops the lock taken just above
