"""Host memory in 2 MiB transparent huge pages: one arena that CPU tensors are carved from.

Why: a CPU decode step is bound by memory bandwidth. It streams every dense weight once (the
99M-parameter test preset reads about 293 MB per batch-1 step), and a float32 row of 1024
columns is exactly one 4 KiB page, so with ordinary pages the stream takes a TLB miss per row.
With 2 MiB pages one TLB entry covers 512 such rows. On the 2-core benchmark machine a
``[1024, 1024]`` product over 100 matrices read 26-28 GB/s from 4 KiB pages and 28-29 GB/s from
huge pages (``benchmark/README.md``, "Huge pages for CPU weights").

How: Linux backs an anonymous private mapping with huge pages when transparent huge pages
(THP) are ``always`` on, or are in ``madvise`` mode and the range was advised with
``madvise(MADV_HUGEPAGE)`` (the kernel's ``Documentation/admin-guide/mm/transhuge.rst``). The
advice must come *before the first write*: a page faulted in as 4 KiB stays 4 KiB until the
background ``khugepaged`` collapses it, if ever. Only 2 MiB-aligned 2 MiB ranges can be huge, so
the arena is one mapping of the requested bytes rounded up to 2 MiB plus 2 MiB of slack, whose
first 2 MiB boundary starts the usable range::

    mapping  |slack (never touched)| 2 MiB | 2 MiB | ... | 2 MiB |slack|
                                   ^ base (2 MiB aligned): madvise(base, usable, MADV_HUGEPAGE)
    tensors                        |w0   |w1      |w2 ...|        (each 4 KiB or 64 B aligned)

Untouched pages cost no resident memory, so a tensor carved from the arena costs memory only
once it is written, as a ``torch.empty`` of its own would. The price is paid at that first
write: on the benchmark VM faulting in a fresh huge page cost far more than its 512 small pages
(loading the 99m preset took up to twice as long), which is why the switch exists.

:class:`HugePageArena` owns one such mapping (a Python ``mmap``, private and anonymous: a
shared one would be shmem, whose huge pages follow another setting); tensors carved from it
keep it alive, and it is unmapped when the last of them is freed. :func:`huge_pages_wanted`
is the switch: on where ``madvise`` exists and THP is not ``never``; ``LMDEPLOY_HUGE_PAGES=0``
turns it off. Nothing here raises because of huge pages: a refused advice is logged at DEBUG and
the arena keeps ordinary pages.
"""
from __future__ import annotations

import logging
import mmap
import os

import torch

__all__ = ['HUGE_PAGE', 'HugePageArena', 'huge_pages_wanted', 'materialize', 'report_huge_pages', 'tensor_align',
           'thp_mode']

logger = logging.getLogger('lmdeploy')

HUGE_PAGE = 2 << 20          # bytes: the x86-64 / arm64 (4 KiB base page) PMD huge page
_PAGE = mmap.PAGESIZE        # bytes
_SMALL_ALIGN = 64            # bytes: a cache line; torch's own CPU allocations are 64-byte aligned
_THP_ENABLED = '/sys/kernel/mm/transparent_hugepage/enabled'


def thp_mode(path: str = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode: ``'always'``, ``'madvise'`` or ``'never'`` (the
    bracketed word of ``path``), or None where the file cannot be read (no THP, not Linux)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find('['), text.find(']')
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_wanted() -> bool:
    """Whether CPU weights go to a :class:`HugePageArena`: ``LMDEPLOY_HUGE_PAGES`` is not ``0``,
    Python's ``mmap`` can ``madvise(MADV_HUGEPAGE)`` here, and :func:`thp_mode` is ``always`` or
    ``madvise``."""
    if os.environ.get('LMDEPLOY_HUGE_PAGES', '1') == '0':
        return False
    if not (hasattr(mmap, 'MADV_HUGEPAGE') and hasattr(mmap.mmap, 'madvise')):
        return False
    return thp_mode() in ('always', 'madvise')


def _madvise(mapping: mmap.mmap, advice: int, offset: int, length: int) -> None:
    """``madvise(advice)`` on ``length`` bytes of ``mapping`` from ``offset`` (a multiple of the
    page size): the one system call of this module, which tests replace.

    Raises:
        OSError: the system call failed (e.g. ``EINVAL`` where the kernel has no THP).
    """
    mapping.madvise(advice, offset, length)


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def tensor_align(nbytes: int) -> int:
    """The alignment, in bytes, of a tensor of ``nbytes`` in an arena: a 4 KiB page for a tensor of
    at least a page (where huge pages are refused, a 4 KiB row then stays in one page), a cache
    line for a smaller one (so small tensors pack densely)."""
    return _PAGE if nbytes >= _PAGE else _SMALL_ALIGN


class HugePageArena:
    """One 2 MiB-aligned anonymous mapping advised ``MADV_HUGEPAGE`` before anything is written
    to it; :meth:`take` carves tensors from it in order (a bump allocator: nothing is freed
    before the whole arena).

    Args:
        nbytes: bytes the tensors to carve need, alignment included (see :meth:`plan`); >= 0.

    Attributes:
        base: address of the first usable byte (a multiple of :data:`HUGE_PAGE`).
        size: usable bytes (``nbytes`` rounded up to :data:`HUGE_PAGE`).
        advised: whether ``madvise(MADV_HUGEPAGE)`` succeeded.
        used: bytes carved so far, padding included.

    Raises:
        ValueError: ``nbytes < 0``, or too large for a mapping here (``OverflowError`` beyond
            ``ssize_t``).
        OSError: the mapping itself failed (e.g. ``ENOMEM``); a refused advice does not raise.
    """

    def __init__(self, nbytes: int):
        if nbytes < 0:
            raise ValueError(f'nbytes must be >= 0, got {nbytes}')
        self.size = _aligned(max(nbytes, 1), HUGE_PAGE)
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)    # holds a reference to the mapping
        offset = (-whole.data_ptr()) % HUGE_PAGE                  # a multiple of the page size
        self._bytes = whole[offset:offset + self.size]
        self.base = self._bytes.data_ptr()
        self.used = 0
        try:
            _madvise(self._map, mmap.MADV_HUGEPAGE, offset, self.size)
            self.advised = True
        except (OSError, ValueError) as err:
            self.advised = False
            logger.debug('madvise(MADV_HUGEPAGE) of a %.1f MiB host arena refused: %s', self.size / 2 ** 20, err)

    @staticmethod
    def plan(tensors) -> int:
        """Bytes an arena needs to :meth:`take` ``tensors`` (objects with ``shape``, ``dtype``;
        e.g. meta tensors) in order, with each one's alignment."""
        total = 0
        for t in tensors:
            nbytes = _numel(t.shape) * t.dtype.itemsize
            total = _aligned(total, tensor_align(nbytes)) + nbytes
        return total

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The next free, contiguous tensor of ``shape`` and ``dtype`` in the arena (its bytes are
        zero until written; aligned as :func:`tensor_align` says).

        Raises:
            MemoryError: the arena has no room left for it (it was planned too small).
        """
        nbytes = _numel(shape) * dtype.itemsize
        start = _aligned(self.used, tensor_align(nbytes))
        if start + nbytes > self.size:
            raise MemoryError(f'host arena of {self.size} bytes has no room for {nbytes} more at {start}')
        self.used = start + nbytes
        return self._bytes[start:start + nbytes].view(dtype).view(tuple(shape))

    def huge_bytes(self, smaps: str = '/proc/self/smaps') -> int | None:
        """Bytes of the arena's mapping backed by huge pages now (the ``AnonHugePages`` of the
        mappings ``smaps`` lists over the arena's range; a mapping the kernel merged with a
        neighbour counts whole), or None where ``smaps`` cannot be read."""
        lo, hi = self.base, self.base + self.size
        total, inside = 0, False
        try:
            with open(smaps) as f:
                for line in f:
                    head = line.split(None, 1)[0]
                    if '-' in head and not head.endswith(':'):        # a mapping's header line
                        start, _, end = head.partition('-')
                        inside = int(start, 16) < hi and int(end, 16) > lo
                    elif inside and head == 'AnonHugePages:':
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return total


def materialize(module: torch.nn.Module, device: str | torch.device, dtype: torch.dtype
                ) -> tuple[torch.nn.Module, HugePageArena | None]:
    """Give a module built on the meta device real memory on ``device``, floating-point tensors in
    ``dtype``: what ``module.to_empty(device=device).to(dtype)`` does, except that on a CPU
    device with :func:`huge_pages_wanted` every parameter is carved from one
    :class:`HugePageArena` (same shapes, strides and dtypes; zero bytes until loaded), so the
    weights are written into huge pages from the first byte and never exist twice.

    Args:
        module: the module, every parameter and buffer on the meta device.
        device: where it goes.
        dtype: the floating-point dtype (``Module.to(dtype)``, on meta first, so a module's own
            ``_apply`` keeping some parameters float32 is obeyed).

    Returns:
        ``(module, arena)``: ``arena`` is None where the parameters got ordinary allocations
        (another device, the switch off, or the mapping failed: logged at DEBUG, never raised).
        A parameter object shared by several modules stays one parameter.
    """
    device = torch.device(device)
    if device.type != 'cpu' or not huge_pages_wanted():
        return module.to_empty(device=device).to(dtype), None
    module = module.to(dtype)
    params = {id(p): p for p in module.parameters() if p.is_meta and p.is_contiguous()}
    try:
        arena = HugePageArena(HugePageArena.plan(params.values()))
    except (OSError, ValueError, OverflowError, RuntimeError) as err:    # the mapping, or frombuffer on it
        logger.debug('no huge-page host arena (%s): ordinary allocations', err)
        return module.to_empty(device=device), None
    placed: dict[int, torch.nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in placed:
                data = arena.take(p.shape, p.dtype) if id(p) in params else torch.empty_like(p, device=device)
                placed[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            setattr(mod, name, placed[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(mod, name, torch.empty_like(b, device=device))
    return module, arena


def report_huge_pages(arena: HugePageArena | None, what: str) -> int | None:
    """Log at DEBUG how much of ``arena`` (after its tensors were written) the kernel backs with
    huge pages; returns those bytes (None: no arena, or ``/proc/self/smaps`` unreadable)."""
    if arena is None:
        return None
    huge = arena.huge_bytes()
    logger.debug('%s in a huge-page host arena: %.1f MiB used at 0x%x, madvise %s, AnonHugePages %s',
                 what, arena.used / 2 ** 20, arena.base, 'ok' if arena.advised else 'refused',
                 'unknown' if huge is None else f'{huge / 2 ** 20:.1f} MiB ({100 * huge / max(arena.used, 1):.0f} %)')
    return huge


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
