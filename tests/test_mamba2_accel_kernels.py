"""The accelerated Mamba-2 (SSD) kernels equal the recurrence written token by token: the native
CPU decode step (state views of a cache, widths off the vector length, groups, no skip), the
Triton decode step and chunk scan under ``TRITON_INTERPRET=1`` (sequence lengths off the
kernel's chunk, with and without an initial state); the registry picks them per device and the
CPU one falls back to torch where the native kernel does not apply."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels.cpu_native import native_library
from lmdeploy.pytorch.kernels.mamba2_cpu import ssd_step_native

ROOT = pathlib.Path(__file__).resolve().parents[1]
native = pytest.mark.skipif(native_library() is None, reason='native CPU kernels could not be built here')


def reference_scan(x, dt, A, B, C, D, state):
    """The Mamba-2 recurrence one token at a time in float64 (Dao & Gu, 2024):
    ``S <- exp(dt A) S + dt x B^T``, ``y = S C + D x``; ``x [L, H, P]``, ``dt [L, H]``,
    ``B, C [L, G, Dn]``, ``state [H, P, Dn]`` (not modified). Returns ``(y, final state)``."""
    L, H, P = x.shape
    r = H // B.shape[1]
    S = state.double().clone()
    ys = []
    for t in range(L):
        Bt = B[t].double().repeat_interleave(r, 0)                   # [H, Dn]
        Ct = C[t].double().repeat_interleave(r, 0)
        a = torch.exp(dt[t].double() * A.double())                   # [H]
        S = a[:, None, None] * S + (dt[t].double()[:, None] * x[t].double())[:, :, None] * Bt[:, None, :]
        y = (S * Ct[:, None, :]).sum(-1)
        if D is not None:
            y = y + D.double()[:, None] * x[t].double()
        ys.append(y)
    return torch.stack(ys).float() if ys else x.new_zeros(0, H, P), S.float()


def _inputs(N, H, P, G, Dn, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, P, generator=gen)
    dt = torch.rand(N, H, generator=gen) * 0.5 + 0.01
    A = -torch.rand(H, generator=gen) * 4 - 0.1
    B, C = (torch.randn(N, G, Dn, generator=gen) for _ in range(2))
    D = torch.randn(H, generator=gen)
    return x, dt, A, B, C, D


@native
@pytest.mark.parametrize('N, H, P, G, Dn', [(1, 1, 1, 1, 1), (3, 4, 8, 2, 16), (2, 6, 5, 3, 19), (5, 8, 64, 1, 128),
                                            (4, 2, 3, 2, 47)])
@pytest.mark.parametrize('skip', [True, False])
def test_native_step_equals_the_recurrence_on_cache_row_views(N, H, P, G, Dn, skip):
    """The state is a view of every other slot of a cache (slot stride twice the row's), as the
    mixer passes it; the slots between are untouched."""
    x, dt, A, B, C, D = _inputs(N, H, P, G, Dn, seed=N * 100 + Dn)
    D = D if skip else None
    cache = torch.randn(2 * N, H, P, Dn, generator=torch.Generator().manual_seed(7))
    before = cache.clone()
    state = cache[::2]
    expected_y, expected_s = zip(*(reference_scan(x[n:n + 1], dt[n:n + 1], A, B[n:n + 1], C[n:n + 1], D,
                                                  state[n]) for n in range(N)))
    y = ssd_step_native(x, dt, A, B, C, D, state)
    assert y.shape == (N, H, P) and y.dtype == torch.float32
    torch.testing.assert_close(y, torch.cat(expected_y), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, torch.stack(expected_s), atol=2e-6, rtol=1e-6)
    assert torch.equal(cache[1::2], before[1::2])


@native
def test_native_step_refuses_what_it_does_not_cover():
    x, dt, A, B, C, D = _inputs(2, 4, 8, 2, 16, seed=1)
    state = torch.zeros(2, 4, 8, 16)
    assert ssd_step_native(x.bfloat16(), dt, A, B, C, D, state) is None
    assert ssd_step_native(x, dt, A, B, C, D, state.transpose(2, 3).contiguous().transpose(2, 3)) is None
    assert ssd_step_native(x, dt, A, B[:, :1].expand(2, 3, 16), C, D, state) is None   # 4 heads, 3 groups
    assert ssd_step_native(x, dt, A, B, C, D, state[..., :8]) is None                  # B, C wider than the state
    leaf = x.clone().requires_grad_()
    assert ssd_step_native(leaf, dt, A, B, C, D, state) is None                        # autograd: torch runs
    y = ssd_step_native(x[:0], dt[:0], A, B[:0], C[:0], D, state[:0])
    assert y.shape == (0, 4, 8)


def test_registry_picks_native_on_cpu_and_triton_on_cuda():
    from lmdeploy.pytorch.kernels.mamba2_cpu import ssd_step_cpu
    from lmdeploy.pytorch.kernels.mamba2_triton import ssd_chunk_scan_triton, ssd_step_triton
    devices = {dev for _, dev, _, _ in kernels._REGISTRY['ssd_step']}
    assert {'any', 'cpu', 'cuda'} <= devices
    if native_library() is not None:
        assert kernels.get_kernel('ssd_step', 'cpu') is ssd_step_cpu
    if kernels.triton_available():
        assert kernels.get_kernel('ssd_step', 'cuda') is ssd_step_triton
        assert kernels.get_kernel('ssd_chunk_scan', 'cuda') is ssd_chunk_scan_triton


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_cpu_step_equals_the_torch_step(dtype):
    """Native for float32 (to rounding), the torch step itself for other dtypes (bit for bit)."""
    from lmdeploy.pytorch.kernels.mamba2 import ssd_step as ssd_step_torch
    from lmdeploy.pytorch.kernels.mamba2_cpu import ssd_step_cpu
    x, dt, A, B, C, D = _inputs(3, 4, 8, 2, 20, seed=5)
    x, B, C = x.to(dtype), B.to(dtype), C.to(dtype)
    s0 = torch.randn(3, 4, 8, 20, generator=torch.Generator().manual_seed(6))
    s1, s2 = s0.clone(), s0.clone()
    y1, y2 = ssd_step_cpu(x, dt, A, B, C, D, s1), ssd_step_torch(x, dt, A, B, C, D, s2)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(y1, y2, **tol)
    torch.testing.assert_close(s1, s2, **tol)


# In a subprocess so TRITON_INTERPRET=1 is set before triton is imported and does not leak.
_TRITON_SCRIPT = '''
import sys, torch
sys.path.insert(0, {tests!r})
from test_mamba2_accel_kernels import _inputs, reference_scan
from lmdeploy.pytorch.kernels.mamba2_triton import CHUNK, ssd_chunk_scan_triton, ssd_step_triton

# decode: N sequences, state rows a strided view of a cache; P and Dn off the block sizes
x, dt, A, B, C, D = _inputs(3, 6, 40, 3, 19, seed=2)
cache = torch.randn(6, 6, 40, 19, generator=torch.Generator().manual_seed(3))
state = cache[1::2]
ref = [reference_scan(x[n:n + 1], dt[n:n + 1], A, B[n:n + 1], C[n:n + 1], D, state[n]) for n in range(3)]
y = ssd_step_triton(x, dt, A, B, C, D, state)
torch.testing.assert_close(y, torch.cat([r[0] for r in ref]), atol=2e-5, rtol=1e-5)
torch.testing.assert_close(state, torch.stack([r[1] for r in ref]), atol=2e-6, rtol=1e-6)
y = ssd_step_triton(x, dt, A, B, C, None, cache[0::2])
assert y.shape == (3, 6, 40)

# prefill: one chunk, several chunks with a tail, with and without an initial state and skip
for L, H, P, G, Dn, init, skip in [(5, 2, 8, 1, 16, False, True), (2 * CHUNK + 21, 4, 40, 2, 19, True, True),
                                   (CHUNK, 2, 32, 2, 32, True, False), (40, 1, 8, 1, 200, True, True)]:
    x, dt, A, B, C, D = _inputs(L, H, P, G, Dn, seed=L)
    D = D if skip else None
    s0 = torch.randn(H, P, Dn, generator=torch.Generator().manual_seed(4)) if init else None
    y, final = ssd_chunk_scan_triton(x, dt, A, B, C, D, s0, chunk_size=256)
    y_ref, s_ref = reference_scan(x, dt, A, B, C, D, s0 if init else torch.zeros(H, P, Dn))
    scale = y_ref.abs().max().item()
    torch.testing.assert_close(y, y_ref, atol=2e-6 * scale + 1e-5, rtol=1e-5)
    torch.testing.assert_close(final, s_ref, atol=1e-5, rtol=1e-5)
print('ok')
'''


def test_triton_kernels_equal_the_recurrence_under_the_interpreter():
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', _TRITON_SCRIPT.format(tests=str(ROOT / 'tests'))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith('ok'), proc.stderr[-3000:]


@native
@pytest.mark.parametrize('slots, history', [([3, 4, 5], [True] * 3), ([5, 3, 4], [True] * 3),
                                            ([3, 4, 5], [True, False, True])])
def test_cpu_varlen_decode_updates_a_slot_run_in_place_and_equals_torch(slots, history, monkeypatch):
    """A decode step over one run of slots (in any order), all with history, runs natively on
    that slice of the cache (no gathered copy); a fresh sequence takes the gathered path (whose
    step is native on the copy); both equal the torch step, the other slots untouched."""
    from lmdeploy.pytorch.kernels import mamba2_cpu
    from lmdeploy.pytorch.kernels.mamba2 import mamba2_ssd_varlen, ssd_step
    N, H, P, G, Dn = 3, 4, 8, 2, 20
    x, dt, A, B, C, D = _inputs(N, H, P, G, Dn, seed=9)
    base = torch.randn(8, 2 * H * P * Dn, generator=torch.Generator().manual_seed(10))
    cache = base[:, :H * P * Dn].view(8, H, P, Dn)          # rows of a wider state buffer: a strided view
    ref_cache = cache.clone()
    on_cache = []
    real = mamba2_cpu.ssd_step_native
    monkeypatch.setattr(mamba2_cpu, 'ssd_step_native', lambda *a: on_cache.append(
        a[-1].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()) or real(*a))
    args = (torch.tensor([0, 1, 2, 3]), torch.tensor(slots), torch.tensor(history), 64)
    assert kernels.get_kernel('mamba2_ssd_varlen', 'cpu') is mamba2_ssd_varlen   # one driver, its step native
    y = mamba2_ssd_varlen(x, dt, A, B, C, D, cache, *args)
    mine = list(on_cache)
    idx = torch.tensor(slots)
    state = ref_cache[idx].masked_fill(~torch.tensor(history)[:, None, None, None], 0)
    y_ref = ssd_step(x, dt, A, B, C, D, state)
    ref_cache[idx] = state
    torch.testing.assert_close(y, y_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, atol=2e-6, rtol=1e-6)
    assert mine == [all(history)]
