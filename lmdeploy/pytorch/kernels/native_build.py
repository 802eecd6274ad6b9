"""Build, cache and load a native CPU library (:mod:`.cpu_native`'s).

A library is compiled from its C source by the system C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into a cache folder of the user's and loaded with :mod:`ctypes`. It runs
in this process, so the caller passes only trusted folders (:func:`.cpu_native._candidate_folders`)
and only a private file is loaded (:func:`load_private`). The caller keeps its file-name
prefix, entry-point bindings, log wording and once-per-process lock.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterable

logger = logging.getLogger('lmdeploy')

CTYPES = {'p': ctypes.c_void_p, 'i32': ctypes.c_int, 'i64': ctypes.c_int64, 'f32': ctypes.c_float}


def compile_library(path: str, command: Callable[[str, str], list[str]], prefix: str, what: str) -> str | None:
    """Compile to ``path`` atomically (concurrent builders each install a whole file).

    Args:
        path: the library file to create, in a trusted folder.
        command: ``command(cc, out)``, the compiler command line that writes ``out``.
        prefix: file-name prefix of this library; other ``{prefix}*.so`` files in the folder (other
            versions) are removed (a process that loaded one keeps its mapping).
        what: the library's name in the debug log of compiler warnings.

    Returns:
        The reason on failure (no compiler, the compiler failed or could not run), None on success.
    """
    cc = os.environ.get('CC') or next((c for c in ('cc', 'gcc', 'clang') if shutil.which(c)), None)
    if cc is None:
        return 'no C compiler: set CC or install gcc'
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=folder)
    os.close(fd)
    try:
        try:
            done = subprocess.run(command(cc, tmp), capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            return f'{cc}: {err}'
        if done.returncode != 0:
            return f'{cc} failed: {done.stderr.strip()[:800]}'   # the first errors are the telling ones
        if done.stderr.strip():
            logger.debug('%s: compiler warnings:\n%s', what, done.stderr.strip())
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith('.so') and name != os.path.basename(path):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
    return None


def load_private(path: str, argtypes: dict[str, tuple[str, str | None]], missing_ok: bool = False) -> ctypes.CDLL:
    """Load ``path`` when it is a regular file (not a symlink) of this user's that nobody else
    can write (it lies in a trusted folder, so nobody else can replace it between this check and
    the load), and bind each entry point of ``argtypes`` (``name: ('p i32 ...', result or None)``,
    letters of :data:`CTYPES`). With ``missing_ok`` an entry point the library lacks is skipped
    (the benchmarks' A/B against a library built from an earlier source).

    Raises:
        OSError: not a private file of this user's, or not loadable.
        AttributeError: an entry point is missing (a library of another version), unless
            ``missing_ok``.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f'{path} is not a private file of this user')
    lib = ctypes.CDLL(path)
    for name, (args, result) in argtypes.items():
        if missing_ok and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes = [CTYPES[a] for a in args.split()]
        fn.restype = CTYPES[result] if result else None
    return lib


def build_library(folders: Iterable[str], library_name: str, compile: Callable[[str], str | None],
                  load: Callable[[str], ctypes.CDLL], what: str, fallback: str) -> ctypes.CDLL | None:
    """Load the library from the first folder that has it, else compile it into the first folder
    where it then loads (a folder mounted noexec does not); None with the reasons logged once at
    INFO as ``{what} unavailable (...): {fallback}``. ``LMDEPLOY_CPU_KERNELS=0`` switches it off.

    Args:
        folders: trusted cache folders, in order of preference.
        library_name: the library's file name in a folder.
        compile: ``compile(path)``, the reason on failure or None (see :func:`compile_library`).
        load: ``load(path)``, the bound library; raises when the file is not usable.
        what, fallback: the log wording, e.g. ``'native CPU kernels'``, ``'torch kernels run'``.
    """
    if os.environ.get('LMDEPLOY_CPU_KERNELS', '1') == '0':
        logger.info('%s unavailable (switched off: LMDEPLOY_CPU_KERNELS=0): %s', what, fallback)
        return None
    reasons, tried = [], False
    for folder in folders:
        tried = True
        path = os.path.join(folder, library_name)
        try:
            if os.path.exists(path):
                lib = load(path)
            elif not os.access(folder, os.W_OK):
                reasons.append(f'{folder}: not writable')
                continue
            else:
                failure = compile(path)
                if failure is not None:
                    reasons.append(failure)
                    break          # a compiler problem: another folder would not help
                lib = load(path)
        except Exception as err:   # noqa: BLE001  (a broken or foreign library: next folder, then torch)
            reasons.append(f'{path}: {err}')
            continue
        logger.info('%s loaded from %s%s', what, path, f' (passed over: {"; ".join(reasons)})' if reasons else '')
        return lib
    if not tried:
        logger.info('%s unavailable (no private cache folder: set LMDEPLOY_CACHE_DIR to a folder only you can '
                    'write): %s', what, fallback)
        return None
    logger.info('%s unavailable (%s): %s', what, '; '.join(reasons), fallback)
    return None
