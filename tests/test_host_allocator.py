"""Host allocator tuning for CPU engines: a freed activation-sized block stays in the heap for
reuse instead of being mapped fresh from the kernel (and faulted in again) every step.

Checked through glibc's own accounting (``mallinfo2``: bytes in mmapped blocks, free bytes in
the heap) rather than page-fault counts, which the kernel also raises for its own reasons (NUMA
balancing, page migration) and so vary from run to run. Each check runs in a fresh interpreter,
since the tuning is process-wide and permanent.
"""
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent('''
    import ctypes, sys, torch
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                                    'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
    libc = ctypes.CDLL('libc.so.6')
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == 'engine':
        from lmdeploy import PytorchEngineConfig
        from lmdeploy.pytorch.engine.engine import Engine
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        Engine(make_tiny_model(sys.argv[2]), PytorchEngineConfig(device_type='cpu', max_batch_size=2,
                                                                 session_len=256, num_gpu_blocks=16))
        from lmdeploy.pytorch.engine import host_allocator
        print('applied', host_allocator._applied)
    elif sys.argv[1] == 'direct':
        from lmdeploy.pytorch.engine.host_allocator import tune_host_allocator
        print('applied', tune_host_allocator(), tune_host_allocator())
    for mb in (1, 8, 20):   # activation sizes of a CPU step
        before = libc.mallinfo2()
        t = torch.empty(mb << 18)   # float32: mb MiB
        t.fill_(1.0)
        during = libc.mallinfo2()
        del t
        after = libc.mallinfo2()
        print('block', mb, (during.hblkhd - before.hblkhd) >> 20, after.fordblks >> 20)
''')


def _probe(mode: str, tmp_path, **env) -> tuple[list[str], list[tuple[int, int, int]]]:
    """``(applied flags, [(MiB requested, MiB mmapped for it, MiB free in the heap after freeing it)])``."""
    out = subprocess.run([sys.executable, '-c', _PROBE, mode, str(tmp_path / 'model')], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **env}, check=True).stdout
    applied, blocks = [], []
    for line in out.splitlines():
        words = line.split()
        if words and words[0] == 'applied':
            applied = words[1:]
        elif words and words[0] == 'block':
            blocks.append(tuple(int(w) for w in words[1:]))
    return applied, blocks


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL('libc.so.6'), 'mallinfo2')
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_mallinfo2(), reason='glibc >= 2.33 (mallinfo2) only')


def _assert_kept_in_heap(blocks):
    assert [b[0] for b in blocks] == [1, 8, 20]
    for mb, mapped, heap_free in blocks:
        assert mapped == 0, f'a {mb} MiB block was mmapped: {blocks}'
        assert heap_free >= mb, f'a freed {mb} MiB block left the heap: {blocks}'


def test_tuned_allocator_keeps_freed_blocks_in_the_heap(tmp_path):
    applied, blocks = _probe('direct', tmp_path)
    assert applied == ['True', 'True']          # idempotent
    _assert_kept_in_heap(blocks)


def test_cpu_engine_tunes_the_allocator(tmp_path):
    applied, blocks = _probe('engine', tmp_path)
    assert applied == ['True']
    _assert_kept_in_heap(blocks)


def test_opt_out_leaves_the_allocator_alone(tmp_path):
    """The control: untuned, glibc maps a fresh 20 MiB block from the kernel (so the checks above
    measure the tuning, not the probe; glibc raises its own threshold after freeing mapped
    blocks, which start-up may already have done for the smaller sizes)."""
    applied, blocks = _probe('direct', tmp_path, LMDEPLOY_HOST_MALLOC_TUNING='0')
    assert applied == ['False', 'False']
    assert blocks[-1][:2] == (20, 20), blocks
