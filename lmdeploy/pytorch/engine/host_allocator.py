"""Keep freed host memory in the process instead of returning it to the kernel (CPU runs).

glibc ``malloc`` gives memory back to the kernel in two ways: a block above its mmap threshold
(128 KiB at first, raised by glibc itself up to 32 MiB as mapped blocks are freed) is unmapped
on ``free``, and free space at the top of the heap beyond the trim threshold (twice the mmap
threshold by default) is released. A CPU forward allocates and frees many activation tensors of
0.1-30 MB per step, so the next step faults those pages in again, one fault per 4 KiB page: on
the 2-core benchmark machine a 32-token prefill of the 249M-parameter test model spent about a
quarter of its time (103 ms -> 76 ms) on it — e.g. filling a fresh 512 KiB state took 720 us
instead of ~20 us.

:func:`tune_host_allocator` fixes both thresholds with ``mallopt`` (glibc's documented
``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD``, see ``man 3 mallopt``): blocks up to 32 MiB come
from the heap and freed heap memory stays mapped for reuse (blocks above 32 MiB, e.g. a long
prefill's largest activations, are still mapped and unmapped each time). The process's resident
memory then stays at its high-water mark instead of shrinking between steps. It is process-wide
and applied once, when an engine is created for the CPU, after its weights are loaded (they keep
their own mappings); set ``LMDEPLOY_HOST_MALLOC_TUNING=0`` to leave the allocator alone (e.g. when
a different allocator is preloaded, which this does not detect).
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
        True when both thresholds are set (now or by an earlier call); False when disabled by
        ``LMDEPLOY_HOST_MALLOC_TUNING=0``, when the C library is not glibc (nothing is changed
        then), or when ``mallopt`` refuses a value (a warning is logged). Never raises.
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
