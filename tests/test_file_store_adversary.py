"""The ``file:DIR`` Store backend against a hostile local file system (no engine, all fast).

Each attack kind is a parameter: whoever can create names in or around DIR plants symbolic
links to a victim file, FIFOs, devices, sockets, directories, oversized or shrinking files,
stale temporary files, or hands over a folder another user controls. The backend must refuse
the folder at start (``ValueError`` naming ``store_backend``) or treat the planted entry as a
miss that never blocks, never touch the victim, and replace the entry at the next put. Several
processes sharing DIR keep the byte budget of the folder, not of each process; everything
created is 0700/0600 whatever the umask; a batch put ``fsync``-s each folder once.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import random
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import pytest

from lmdeploy.pytorch.store import file_backend
from lmdeploy.pytorch.store import safe_fs
from lmdeploy.pytorch.store.backend import PutResult
from lmdeploy.pytorch.store.file_backend import FileStore

NS = 'cd' * 16
OTHER_UID = 65534          # "nobody": the tests run as root and hand folders to this user
SECRET = b'root-only secret\n'


def key(i: int, kind: str = 'kv') -> str:
    return f'{NS}/{kind}/{i:032x}'


def obj_path(root: Path, k: str) -> Path:
    ns, kind, name = k.split('/')
    return root / 'objects' / ns / kind / name[:2] / name


@pytest.fixture
def victim(tmp_path):
    """A root-only file the attacker wants truncated, overwritten or read."""
    path = tmp_path / 'victim'
    path.write_bytes(SECRET)
    path.chmod(0o600)
    yield path
    st = path.stat()
    assert path.read_bytes() == SECRET and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def call_with_timeout(fn, timeout: float = 0.5):
    """``fn()``'s result, or fail when it does not return within ``timeout`` seconds (a read
    blocked on a FIFO hangs for ever: the thread is a daemon)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert out, f'{fn} did not return within {timeout} s'
    return out[0]


# the folder itself ------------------------------------------------------------------------
def _symlinked(tmp_path):
    real = tmp_path / 'real'
    real.mkdir(mode=0o700)
    (tmp_path / 'store').symlink_to(real)
    return tmp_path / 'store', 'symbolic link'


def _other_owner(tmp_path):
    d = tmp_path / 'store'
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    return d, f'owned by uid {OTHER_UID}'


def _mode(mode):
    def make(tmp_path):
        d = tmp_path / 'store'
        d.mkdir()
        d.chmod(mode)
        return d, 'writable by group or others'
    return make


def _ancestor_other_owner(tmp_path):
    up = tmp_path / 'theirs'
    up.mkdir(mode=0o755)
    os.chown(up, OTHER_UID, OTHER_UID)
    return up / 'store', f'ancestor) is owned by uid {OTHER_UID}'


def _ancestor_world_writable(tmp_path):
    up = tmp_path / 'shared'
    up.mkdir()
    up.chmod(0o777)
    return up / 'store', 'writable by everyone without the sticky bit'


def _sub(name, how):
    """A store folder whose sub-folder ``name`` another user owns, is writable by others, or
    is a symbolic link to a folder elsewhere."""
    def make(tmp_path):
        d = tmp_path / 'store'
        d.mkdir(mode=0o700)
        if how == 'symlink':
            (tmp_path / 'elsewhere').mkdir(mode=0o700)
            (d / name).symlink_to(tmp_path / 'elsewhere')
            return d, f"'{name}' is a symbolic link"
        (d / name).mkdir(mode=0o700)
        if how == 'other_owner':
            os.chown(d / name, OTHER_UID, OTHER_UID)
            return d, f"'{name}' is owned by uid {OTHER_UID}"
        (d / name).chmod(0o777)
        return d, f"'{name}' is writable by group or others"
    return make


def _a_file(tmp_path):
    (tmp_path / 'store').write_bytes(b'')
    return tmp_path / 'store', 'Not a directory'


@pytest.mark.parametrize('make', [_symlinked, _other_owner, _mode(0o770), _mode(0o707), _mode(0o777),
                                  _ancestor_other_owner, _ancestor_world_writable, _a_file,
                                  _sub('objects', 'symlink'), _sub('tmp', 'other_owner'), _sub('writers', 'mode')],
                         ids=['symlink', 'other_owner', 'group_writable', 'world_writable', 'mode_0777',
                              'ancestor_other_owner', 'ancestor_world_writable', 'a_file',
                              'objects_symlink', 'tmp_other_owner', 'writers_world_writable'])
def test_an_unsafe_folder_is_refused_at_start_and_left_untouched(tmp_path, make):
    folder, reason = make(tmp_path)
    before = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None
    with pytest.raises(ValueError, match='store_backend') as err:
        FileStore(folder)
    assert reason in str(err.value)
    assert (sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None) == before


def test_a_sticky_world_writable_ancestor_is_accepted(tmp_path):
    up = tmp_path / 'sticky'
    up.mkdir()
    up.chmod(0o1777)                       # like /tmp: nobody can rename another user's folder
    FileStore(up / 'store').close()


# symbolic links at every name the backend uses --------------------------------------------
def _plant(root: Path, where: str, victim: Path) -> None:
    """Point the name ``where`` of a fresh store folder at ``victim`` (or its folder)."""
    root.mkdir(mode=0o700)
    if where == 'probe':                  # the open-time probe name the old backend wrote with O_TRUNC
        (root / 'tmp').mkdir(mode=0o700)
        for pid in range(os.getpid() - 5, os.getpid() + 200):
            (root / 'tmp' / f'{pid}-probe.part').symlink_to(victim)
    elif where in ('tmp', 'objects', 'writers'):
        (root / where).symlink_to(victim.parent)
    elif where == 'lock':
        (root / '.lock').symlink_to(victim)
    elif where == 'namespace':
        (root / 'objects').mkdir(mode=0o700)
        (root / 'objects' / NS).symlink_to(victim.parent)
    elif where == 'object':
        obj_path(root, key(1)).parent.mkdir(parents=True, mode=0o700)
        obj_path(root, key(1)).symlink_to(victim)


@pytest.mark.parametrize('where', ['probe', 'tmp', 'objects', 'writers', 'lock', 'namespace', 'object'])
def test_symlinks_planted_in_the_folder_never_reach_the_victim(tmp_path, victim, where):
    """A link where the backend's own folders or lock file belong is refused at start; one
    below (a namespace folder, an object) reads as absent and is replaced by the next put."""
    root = tmp_path / 'store'
    _plant(root, where, victim)
    if where in ('tmp', 'objects', 'writers', 'lock'):
        with pytest.raises(ValueError, match='store_backend .* is a symbolic link'):
            FileStore(root)
        return
    store = FileStore(root, max_bytes=300)
    assert store.get(key(1)) is None and store.batch_exists([key(1)]) == [False]
    assert store.put(key(1), b'v' * 100) in (PutResult.STORED, PutResult.REPAIRED)
    for i in range(2, 6):                 # evictions rescan and unlink under the folder
        assert store.put(key(i), bytes([i]) * 100).gained
    assert store.put(key(9), b'r' * 100, replace=True) is PutResult.REPAIRED
    assert store.get(key(9)) == b'r' * 100 and store.remove(key(9))
    store.close()
    FileStore(root).close()
    assert not any(p.is_symlink() for p in root.rglob('*'))
    assert sorted(p.name for p in victim.parent.iterdir() if p.name != 'store') == ['victim']


def test_a_link_planted_below_the_folder_after_start_is_replaced_by_the_next_put(tmp_path, victim):
    root = tmp_path / 'store'
    store = FileStore(root)
    assert store.put(key(1), b'a').gained
    ns = root / 'objects' / NS
    os.rename(ns, root / 'old')
    ns.symlink_to(victim.parent)           # the namespace folder now leads out of the store
    assert store.get(key(1)) is None and store.batch_exists([key(1), key(2)]) == [False, False]
    assert store.put(key(1), b'b') is PutResult.STORED and store.get(key(1)) == b'b'
    assert ns.is_dir() and not ns.is_symlink()


# what can sit at an object's path -----------------------------------------------------------
def _fifo(path, victim):
    os.mkfifo(path, 0o600)


def _dev_zero_link(path, victim):
    path.symlink_to('/dev/zero')


def _char_device(path, victim):
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))       # what /dev/zero is
    except PermissionError:
        pytest.skip('mknod needs CAP_MKNOD')


def _socket(path, victim):
    cwd = os.getcwd()
    os.chdir(path.parent)                 # a socket path is limited to 108 bytes
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()
    finally:
        os.chdir(cwd)


def _directory(path, victim):
    path.mkdir(mode=0o700)
    (path / 'inner').mkdir(mode=0o700)
    (path / 'inner' / 'f').write_bytes(b'x' * 10)
    (path / 'link').symlink_to(victim)


def _victim_link(path, victim):
    path.symlink_to(victim)


def _oversized(path, victim):
    path.write_bytes(b'o' * 1001)          # max_object_bytes is 1000 below


HOSTILE = dict(fifo=_fifo, dev_zero_link=_dev_zero_link, char_device=_char_device, socket=_socket,
               directory=_directory, victim_link=_victim_link, oversized=_oversized)


@pytest.mark.parametrize('kind', list(HOSTILE))
def test_anything_but_a_bounded_regular_file_at_an_object_path_is_a_quick_miss_and_repaired(tmp_path, victim, kind):
    root = tmp_path / 'store'
    store = FileStore(root, max_object_bytes=1000)
    path = obj_path(root, key(7))
    path.parent.mkdir(parents=True, exist_ok=True)
    HOSTILE[kind](path, victim)
    assert call_with_timeout(lambda: store.get(key(7))) is None
    assert store.stats.get_failures == 1 and store.batch_exists([key(7)]) == [False]
    assert store.put(key(7), b'good') is PutResult.REPAIRED and store.stats.repaired == 1
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert store.get(key(7)) == b'good' and store.batch_exists([key(7)]) == [True]
    assert store.num_bytes == 4          # nothing the planted entry held is counted


def test_every_bad_object_of_a_prefix_is_repaired_by_one_batch(tmp_path, victim):
    """One engine's save replaces all of them (the old backend needed one fresh engine per
    bad object): each reads absent, so the tier puts each again."""
    root = tmp_path / 'store'
    store = FileStore(root, max_object_bytes=1000)
    keys = [key(i) for i in range(len(HOSTILE) + 3)]
    for k, make in zip(keys, list(HOSTILE.values())):
        obj_path(root, k).parent.mkdir(parents=True, exist_ok=True)
        make(obj_path(root, k), victim)
    assert store.put_many([(k, b'ok', False) for k in keys[-3:]]) == [PutResult.STORED] * 3
    assert call_with_timeout(lambda: store.batch_exists(keys)) == [False] * len(HOSTILE) + [True] * 3
    results = store.put_many([(k, f'v{i}'.encode(), False) for i, k in enumerate(keys)])
    assert results == [PutResult.REPAIRED] * len(HOSTILE) + [PutResult.EXISTS] * 3
    assert [store.get(k) for k in keys] == [f'v{i}'.encode() for i in range(len(HOSTILE))] + [b'ok'] * 3
    # the tier's replace=True (an object it rejected on content) works for every key at once
    assert store.put_many([(k, b'fixed', True) for k in keys]) == [PutResult.REPAIRED] * len(keys)
    assert all(store.get(k) == b'fixed' for k in keys) and store.num_bytes == 5 * len(keys)


def test_a_file_that_shrinks_while_read_is_a_miss(tmp_path, monkeypatch):
    store = FileStore(tmp_path / 'store')
    assert store.put(key(1), b'z' * 4096).gained
    real_fstat = safe_fs.os.fstat

    def fstat_then_truncate(fd):
        st = real_fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size == 4096:
            os.truncate(obj_path(tmp_path / 'store', key(1)), 100)
        return st

    monkeypatch.setattr(safe_fs.os, 'fstat', fstat_then_truncate)
    assert store.get(key(1)) is None
    monkeypatch.undo()
    assert 'ends after 100 of its 4096 bytes' in store.stats.last_error


@pytest.mark.parametrize('count', [b'', b'junk', b'\xff' * 8, struct.pack('<Qd', 0, time.time() - 120),
                                   struct.pack('<Qd', 0, time.time() + 3600), struct.pack('<Qd', (1 << 64) - 1, 0)],
                         ids=['empty', 'short', 'old_format', 'zero_scanned_long_ago', 'zero_scanned_in_future', 'max'])
def test_a_forged_byte_count_is_corrected_by_the_next_put(tmp_path, count):
    root = tmp_path / 'store'
    store = FileStore(root, max_bytes=1000)
    assert store.put_many([(key(i), b'x' * 100, False) for i in range(5)]) == [PutResult.STORED] * 5
    (root / '.lock').write_bytes(count)
    assert store.put(key(5), b'y' * 100).gained and store.num_bytes == _folder_bytes(root) == 600
    for i in range(6, 12):
        assert store.put(key(i), b'y' * 100).gained
    assert store.num_bytes == _folder_bytes(root) <= 1000


# temporary files ------------------------------------------------------------------------------
def test_stale_temporary_files_are_removed_whatever_their_pid(tmp_path, monkeypatch):
    root = tmp_path / 'store'
    live = FileStore(root)                       # a running writer, mid-put
    live_part = live.begin_torn_write(key(1), b'a' * 100)
    tmp = root / 'tmp'
    (root / 'writers' / ('e' * 16 + '.lock')).write_bytes(b'')       # a writer that died: lock free
    planted = {
        'dead_writer': tmp / ('e' * 16 + '-' + '1' * 16 + '.part'),
        'live_pid': tmp / f'{os.getpid()}-{"2" * 16}.part',          # old naming, a live (reused) pid
        'no_writer': tmp / ('f' * 16 + '-' + '3' * 16 + '.part'),
        'too_old': tmp / (live_part.name.split('-')[0] + '-' + '4' * 16 + '.part'),
    }
    for p in planted.values():
        p.write_bytes(b'p' * 100)
    old = time.time() - file_backend.STALE_PART_S - 5
    os.utime(planted['too_old'], (old, old))
    os.mkfifo(tmp / 'fifo')
    (tmp / 'dir.part').mkdir()
    (tmp / 'link.part').symlink_to(tmp_path)
    monkeypatch.setattr(file_backend, 'CLEAN_EVERY_S', 0.0)
    assert live.put(key(2), b'x').gained            # the running writer cleans at its next put
    assert sorted(p.name for p in tmp.iterdir()) == [live_part.name]
    assert sorted(p.name for p in (root / 'writers').iterdir()) == [live._writer + '.lock']
    assert live.num_bytes == 1                     # nothing in tmp is a value
    live.close()                                   # its lock is free now: its part is stale
    FileStore(root).close()
    assert list(tmp.iterdir()) == []


def test_a_writer_killed_mid_put_leaves_nothing_after_the_next_open(tmp_path):
    root = tmp_path / 'store'
    FileStore(root).close()
    ctx = multiprocessing.get_context('fork')
    proc = ctx.Process(target=_torn_writer, args=(str(root), ))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -9 and len(list((root / 'tmp').glob('*.part'))) == 1
    store = FileStore(root)
    assert list((root / 'tmp').iterdir()) == [] and store.get(key(3)) is None
    assert sorted(p.name for p in (root / 'writers').iterdir()) == [store._writer + '.lock']


def _torn_writer(root: str) -> None:
    FileStore(root).begin_torn_write(key(3), b't' * 1000)
    os.kill(os.getpid(), 9)


# modes, disk full, batches --------------------------------------------------------------------
@pytest.mark.parametrize('umask', [0o000, 0o077, 0o022])
def test_everything_created_is_private_whatever_the_umask(tmp_path, umask):
    root = tmp_path / 'a' / 'store'                 # missing parents are created too
    old = os.umask(umask)
    try:
        store = FileStore(root)
        store.put_many([(key(i), b'x' * i, False) for i in range(1, 4)] + [(key(300, 'state'), b'y', False)])
        store.put(key(1), b'new', replace=True)
    finally:
        os.umask(old)
    created = [root, tmp_path / 'a', *root.rglob('*')]
    for p in created:
        st = os.lstat(p)
        assert stat.S_IMODE(st.st_mode) == (0o700 if stat.S_ISDIR(st.st_mode) else 0o600), p
    assert len([p for p in created if p.is_file()]) == 4 + 2      # values, .lock, this writer's lock


def test_legacy_world_readable_subfolders_are_made_private(tmp_path):
    root = tmp_path / 'store'
    for sub in ('objects', 'tmp', f'objects/{NS}', f'objects/{NS}/kv', f'objects/{NS}/kv/00'):
        (root / sub).mkdir(mode=0o755, parents=True)
        (root / sub).chmod(0o755)
    store = FileStore(root)
    assert store.get(key(1)) is None
    for sub in ('objects', 'tmp', f'objects/{NS}', f'objects/{NS}/kv', f'objects/{NS}/kv/00'):
        assert stat.S_IMODE(os.lstat(root / sub).st_mode) == 0o700, sub


def test_a_full_disk_fails_the_put_counts_it_and_leaves_nothing(tmp_path, monkeypatch):
    store = FileStore(tmp_path / 'store', max_bytes=10_000)
    assert store.put(key(1), b'a' * 100).gained
    real_write = safe_fs.os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(safe_fs.os, 'write', full)
    assert store.put_many([(key(2), b'b' * 100, False), (key(1), b'c', True)]) == [PutResult.FAILED] * 2
    monkeypatch.setattr(safe_fs.os, 'write', real_write)
    assert store.stats.put_failures == 2 and 'No space left' in store.stats.last_error
    assert list((tmp_path / 'store' / 'tmp').iterdir()) == [] and store.num_bytes == 100
    assert store.get(key(1)) == b'a' * 100 and store.put(key(2), b'b' * 100) is PutResult.STORED


def test_put_many_results_in_order_and_one_directory_fsync_per_folder(tmp_path, monkeypatch):
    store = FileStore(tmp_path / 'store', max_object_bytes=1000)
    assert store.put(key(0), b'first').gained
    calls = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        calls.append('dir' if stat.S_ISDIR(os.fstat(fd).st_mode) else 'file')
        return real_fsync(fd)

    monkeypatch.setattr(os, 'fsync', counting_fsync)
    items = [(key(i), bytes([i]) * 10, False) for i in range(1, 9)]          # one folder (.../kv/00)
    items += [(key(0), b'again', False), (key(0), b'swap', True), ('../escape', b'x', False),
              (key(20), b'x' * 1001, False), (key(21), 'not bytes', False)]
    results = store.put_many(items)
    assert results == [PutResult.STORED] * 8 + [PutResult.EXISTS, PutResult.REPAIRED] + [PutResult.FAILED] * 3
    assert calls.count('file') == 9 and calls.count('dir') == 1
    assert store.get(key(0)) == b'swap' and store.num_bytes == 80 + 4
    assert (store.stats.puts, store.stats.existing, store.stats.repaired, store.stats.put_failures) == (10, 1, 1, 3)
    calls.clear()
    assert store.put(key(1 << 120), b'n') is PutResult.STORED      # new folders: their parents are synced too
    assert calls == ['file', 'dir', 'dir']


# several processes on one folder --------------------------------------------------------------
def _writer(root: str, max_bytes: int, first: int, count: int, size: int, batch: int, barrier, out) -> None:
    store = FileStore(root, max_bytes=max_bytes)
    barrier.wait()              # every process has opened (and scanned) the folder before any writes
    results = []
    for i in range(first, first + count, batch):
        last = min(i + batch, first + count)
        items = [(key(j), j.to_bytes(4, 'little') * (size // 4), False) for j in range(i, last)]
        results += [r.value for r in store.put_many(items)] if batch > 1 else [store.put(*items[0][:2]).value]
    store.close()
    out.put(results)


def _run_writers(root: Path, max_bytes: int, ranges: list[tuple[int, int]], size: int, batch: int) -> list[list[str]]:
    ctx = multiprocessing.get_context('fork')
    barrier, out = ctx.Barrier(len(ranges)), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(root), max_bytes, a, n, size, batch, barrier, out))
             for a, n in ranges]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def _folder_bytes(root: Path) -> int:
    """Bytes of the regular files under ``objects`` (links not followed)."""
    sizes = [p.lstat() for p in (root / 'objects').rglob('*')]
    return sum(st.st_size for st in sizes if stat.S_ISREG(st.st_mode))


@pytest.mark.parametrize('writers', [2, 3])
def test_processes_sharing_a_folder_keep_one_byte_budget(tmp_path, writers):
    """Each process puts 95 % of the budget: alone none would evict, together they must. The
    old backend counted per process and kept about N times the limit."""
    root, size, budget = tmp_path / 'store', 1000, 20_000
    _run_writers(root, budget, [(w * 1000, 19) for w in range(writers)], size, batch=1)
    used = _folder_bytes(root)
    assert used <= budget and list((root / 'tmp').iterdir()) == []
    assert FileStore(root, max_bytes=budget).num_bytes == used


def test_processes_sharing_a_folder_with_batches_keep_one_byte_budget(tmp_path):
    root, size, budget = tmp_path / 'store', 1000, 20_000
    _run_writers(root, budget, [(w * 1000, 40) for w in range(3)], size, batch=4)
    used = _folder_bytes(root)
    assert used <= budget and FileStore(root, max_bytes=budget).num_bytes == used


def test_processes_writing_the_same_keys_store_each_exactly_once(tmp_path):
    root = tmp_path / 'store'
    results = _run_writers(root, 0, [(0, 24)] * 3, 64, batch=4)
    for i in range(24):
        assert sum(r[i] == 'stored' for r in results) == 1
        assert sum(r[i] == 'exists' for r in results) == 2
    assert _folder_bytes(root) == 24 * 64 == FileStore(root).num_bytes


# a random walk over operations and attacks ------------------------------------------------------
def test_random_operations_and_plantings_keep_every_invariant(tmp_path, victim):
    """Seeded random puts (single, batched, replacing), reads, existence checks, removals and
    entries planted at value paths (FIFO, links to the victim and to /dev/zero, a char device,
    a socket, an empty directory). After every step: a read returns the last value stored
    under the key or None (evicted), never blocks, and a planted key reads absent until the
    next put repairs it; the folder's count equals its bytes and stays within the limit."""
    rng = random.Random(1234)
    root, budget = tmp_path / 'store', 2000
    store = FileStore(root, max_bytes=budget, max_object_bytes=1000)
    keys = [key(i) for i in range(12)]
    model: dict[str, bytes | None] = {}         # last value stored; None: something planted there
    planters = [_fifo, _dev_zero_link, _char_device, _socket, _victim_link, lambda p, v: p.mkdir()]
    for step in range(300):
        op, k = rng.random(), rng.choice(keys)
        if op < 0.35:
            batch = rng.sample(keys, rng.randint(1, 4))
            items = [(b, rng.randbytes(rng.randint(50, 300)), rng.random() < 0.2) for b in batch]
            for (b, v, replace), r in zip(items, store.put_many(items)):
                if replace:
                    assert r is PutResult.REPAIRED
                elif model.get(b, b'') is None:          # planted: replaced by this put (or gone
                    assert r in (PutResult.REPAIRED, PutResult.STORED)   # with an eviction scan)
                else:
                    assert r in (PutResult.STORED, PutResult.EXISTS)
                    if r is PutResult.EXISTS:
                        continue
                model[b] = v
            assert store.num_bytes == _folder_bytes(root) <= budget, step
        elif op < 0.65:
            got = call_with_timeout(lambda: store.get(k))
            assert got is None if model.get(k) is None else got in (model[k], None), step
        elif op < 0.8:
            assert store.batch_exists([k]) == [bool(model.get(k)) and obj_path(root, k).is_file()], step
        elif op < 0.9:
            assert store.remove(k)
            model.pop(k, None)
            assert store.num_bytes == _folder_bytes(root), step
        else:
            store.remove(k)
            path = obj_path(root, k)
            path.parent.mkdir(parents=True, exist_ok=True)
            rng.choice(planters)(path, victim)
            model[k] = None
    store.close()
