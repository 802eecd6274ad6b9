"""Keep freed host memory in the process instead of returning it to the kernel (CPU runs).

glibc ``malloc`` serves large requests with ``mmap`` and hands them back with ``munmap`` on
``free``, and trims the heap top back to the kernel once it grows past a threshold. A CPU
forward allocates and frees many activation tensors of 0.1-30 MB per step, so each step pays a
page fault for every 4 KiB page of each of them again: on the 2-core benchmark machine a
32-token prefill of the 281M-parameter test model spent about a quarter of its time (103 ms ->
76 ms) in faults — e.g. filling a fresh 512 KiB state took 720 us instead of ~20 us.

:func:`tune_host_allocator` raises both thresholds with ``mallopt`` (glibc's documented
``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD``, see ``man 3 mallopt``): requests up to 32 MiB come
from the heap and freed memory stays mapped for reuse. The process's resident memory then stays
at its high-water mark instead of shrinking between steps. It is process-wide and applied once,
when an engine is created for the CPU; set ``LMDEPLOY_HOST_MALLOC_TUNING=0`` to leave the
allocator alone (e.g. when a different allocator is preloaded, which this does not detect).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ['tune_host_allocator', 'MMAP_THRESHOLD', 'TRIM_THRESHOLD']

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1    # glibc <malloc.h> parameter numbers
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # bytes; glibc's largest accepted value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30   # bytes of free heap top kept before trimming

_applied: bool | None = None


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds once per process (see the module docstring).

    Returns:
        True when the thresholds are set (now or by an earlier call); False when disabled by
        ``LMDEPLOY_HOST_MALLOC_TUNING=0``, or when the C library is not glibc or refuses the
        values (nothing is changed then). Never raises.
    """
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get('LMDEPLOY_HOST_MALLOC_TUNING', '1') == '0':
        _applied = False
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
        mallopt = libc.mallopt
        libc.gnu_get_libc_version        # glibc only: other C libraries number the options differently
    except (OSError, AttributeError):
        _applied = False
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _applied:
        logger.warning('mallopt refused the host allocator thresholds; CPU steps may pay page faults')
    return _applied
