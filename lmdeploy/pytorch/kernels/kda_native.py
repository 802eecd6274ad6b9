"""Native CPU decode step of Kimi Delta Attention (float32).

Why: a KDA decode step is one pass over a ``[dk, dv]`` state per head and sequence (128 x 128
float32, 64 KiB, per head in Kimi-Linear-48B); the torch form of
:func:`~.kimi_delta_attention.kda_decode_step_torch` makes five passes over it (decay in
place, two batched products, the rank-1 update, the output product) plus a dozen small ops.
:func:`kda_step_native` reads the state twice and writes it once in one call (source
``csrc/kda_native.c``, prototype ``csrc/kda_native.h``).

The library is separate from :mod:`.cpu_native`'s (its own source, header, bindings and file
name ``kda_native_<hash>.so``) and is built, cached and trusted by the same rules: the same
cache folders (:func:`~.cpu_native._candidate_folders`, only a private folder and file are
used), the same compiler flags, ``LMDEPLOY_CPU_KERNELS=0`` switches it off, and without a
compiler the torch step runs (the reason logged once at INFO). Models never call it: the
registry's CPU ``kda_decode_step`` does (:mod:`.kimi_delta_attention`).

The sums run in another order than torch's: results agree to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import threading

import torch

from . import cpu_native, native_build

__all__ = ['SOURCE', 'HEADER', 'compile_command', 'kda_native_library', 'kda_native_available', 'kda_step_native']

logger = logging.getLogger('lmdeploy')

SOURCE = os.path.join(cpu_native.SOURCE_DIR, 'kda_native.c')
HEADER = os.path.join(cpu_native.SOURCE_DIR, 'kda_native.h')
_PREFIX = 'kda_native_'

_ARGTYPES = {   # C signature of each entry point: (argument types, result type)
    'lm_kda_step': ('p p p p p i32 i32 i32 i32 i64 i64 i64 p i32', None),
}

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _source_text() -> str:
    parts = []
    for path in (SOURCE, HEADER):
        with open(path) as f:
            parts.append(f.read())
    return '\0'.join(parts)


def _library_name() -> str:
    """File name of this source's library: by source, flags and the CPU it is tuned for."""
    key = hashlib.sha256('\0'.join([_source_text(), ' '.join(cpu_native._FLAGS), platform.machine(),
                                    cpu_native._cpu_flags()]).encode())
    return f'{_PREFIX}{key.hexdigest()[:20]}.so'


def compile_command(cc: str, out: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The compiler command that builds :data:`SOURCE` into ``out`` (``extra`` flags last)."""
    return [cc, *cpu_native._FLAGS, *extra, '-I', cpu_native.SOURCE_DIR, SOURCE, '-o', out, '-lm']


def _compile(path: str) -> str | None:
    """Compile to ``path`` (:func:`~.native_build.compile_library`); the reason on failure, None
    on success. Older versions of this library in the folder are removed."""
    return native_build.compile_library(path, compile_command, _PREFIX, 'native KDA kernel')


def _load(path: str) -> ctypes.CDLL:
    """Load ``path`` when it is a regular private file of this user's (in a trusted folder)."""
    return native_build.load_private(path, _ARGTYPES)


def _build() -> ctypes.CDLL | None:
    return native_build.build_library(cpu_native._candidate_folders(), _library_name(), _compile, _load,
                                      'native KDA kernel', 'torch runs')


def kda_native_library() -> ctypes.CDLL | None:
    """The loaded library, built on the first call (thread-safe, decided once per process);
    ``None`` when it cannot be built or ``LMDEPLOY_CPU_KERNELS=0``."""
    global _LIB, _TRIED
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                try:
                    _LIB = _build()
                except Exception as err:   # noqa: BLE001  (never fail the engine over an optional speed-up)
                    logger.info('native KDA kernel unavailable (%s): torch runs', err)
                    _LIB = None
                _TRIED = True
    return _LIB


def kda_native_available() -> bool:
    """Whether the library is loaded (the availability check of the CPU ``kda_decode_step``)."""
    return kda_native_library() is not None


def kda_step_native(kq: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor | None:
    """One KDA decode token for ``N`` sequences, the state updated in place, or ``None`` when
    the native kernel does not apply (the caller runs torch).

    ``S <- diag(a) S + k delta^T`` with ``delta = beta (v - (diag(a) S)^T k)`` and output
    ``S_new^T q`` (Kimi Team, "Kimi Linear", 2025; the per-channel form of the gated delta rule).

    Args:
        kq: float32 ``[N, H, 2, dk]``: the (L2-normalised) key, then the scaled query.
        v: float32 ``[N, H, dv]``.
        decay: float32 ``[N, H, dk]`` state multipliers ``a = exp(g)`` per key channel.
        beta: float32 ``[N, H]`` write strengths.
        state: float32 ``[N, H, dk, dv]`` with unit stride along ``dv`` (a view of the cache's
            rows is fine); updated in place.

    Returns:
        float32 ``o [N, H, dv]``, or ``None`` (dtype, device, shapes, strides, autograd, or no
        library).
    """
    if state.dim() != 4:
        return None
    N, H, dk, dv = state.shape
    if not (all(cpu_native.is_plain(t) for t in (kq, v, decay, beta, state)) and state.stride(-1) == 1
            and kq.shape == (N, H, 2, dk) and v.shape == (N, H, dv) and decay.shape == (N, H, dk)
            and beta.shape == (N, H)):
        return None
    lib = kda_native_library()
    if lib is None:
        return None
    kq, v, decay, beta = (t.contiguous() for t in (kq, v, decay, beta))
    out = torch.empty(N, H, dv, dtype=torch.float32)
    if N and H:
        cpu_native.CALLS['kda_step'] += 1
        lib.lm_kda_step(kq.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(), state.data_ptr(), N, H, dk,
                        dv, state.stride(0), state.stride(1), state.stride(2), out.data_ptr(),
                        torch.get_num_threads())
    return out
