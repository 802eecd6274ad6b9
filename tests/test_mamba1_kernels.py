"""The Mamba-1 selective scan (lmdeploy/pytorch/kernels/mamba1.py) against its token-by-token
float64 form: the chunked scan of one sequence (any chunk size, with and without an initial
state, a chunk cut short by the memory bound), the one-token step, and the varlen driver over
state slots (decode and prefill rows mixed, a slot without history holding garbage), a
property test over shapes, chunk lengths and decays, memory linear in the chunk length; the Triton
step and scan (mamba1_triton.py) under ``TRITON_INTERPRET=1``, and the registry's choice per device."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels import mamba1 as k

TOL = 2e-5
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _inputs(L, Dd=24, N=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, Dd, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(L, Dd, generator=g) - 2)
    A = -(1 + 15 * torch.rand(Dd, N, generator=g))
    B, C = torch.randn(L, N, generator=g), torch.randn(L, N, generator=g)
    D = torch.randn(Dd, generator=g)
    return x, dt, A, B, C, D


@pytest.mark.parametrize('L, chunk', [(0, 16), (1, 16), (37, 16), (37, 5), (64, 64), (50, 1)])
@pytest.mark.parametrize('with_state', [False, True])
def test_chunked_scan_equals_the_recurrence(L, chunk, with_state):
    x, dt, A, B, C, D = _inputs(L, seed=L + chunk)
    init = torch.randn(24, 8, generator=torch.Generator().manual_seed(L + chunk + 1)) if with_state else None
    before = None if init is None else init.clone()
    y, state = k.selective_scan_chunk(x, dt, A, B, C, D, init, chunk)
    ref_y, ref_state = k.selective_scan_reference(x, dt, A, B, C, D, init)
    assert y.dtype == state.dtype == torch.float32 and y.shape == (L, 24) and state.shape == (24, 8)
    assert (y.double() - ref_y).abs().max().item() <= TOL if L else y.numel() == 0
    assert (state.double() - ref_state).abs().max().item() <= TOL
    assert init is None or torch.equal(init, before)       # the initial state is read only


def test_the_memory_bound_cuts_the_chunk_and_changes_nothing_but_rounding(monkeypatch):
    x, dt, A, B, C, D = _inputs(40)
    monkeypatch.setattr(k, 'CHUNK_ELEMENTS', 24 * 8 * 3)        # Q = 3 tokens
    assert k.chunk_tokens(16, 24, 8) == 3
    y, state = k.selective_scan_chunk(x, dt, A, B, C, D, None, 16)
    ref_y, ref_state = k.selective_scan_reference(x, dt, A, B, C, D)
    assert (y.double() - ref_y).abs().max().item() <= TOL and (state.double() - ref_state).abs().max() <= TOL


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 70), chunk=st.integers(1, 40), Dd=st.integers(1, 9), N=st.integers(1, 6),
       decay=st.sampled_from([1e-4, 1.0, 16.0, 1e4]), seed=st.integers(0, 2 ** 16), with_state=st.booleans())
def test_scan_equals_the_recurrence_for_any_shape_chunk_and_decay(L, chunk, Dd, N, decay, seed, with_state):
    """Over shapes, chunk lengths (a power of two or not, longer than the sequence or not) and
    decays from almost none (``exp(a) ~ 1``: states grow) to total (``exp(a)`` underflows to 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, Dd, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(L, Dd, generator=g) - 1)
    A = -decay * (0.5 + torch.rand(Dd, N, generator=g))
    B, C, D = torch.randn(L, N, generator=g), torch.randn(L, N, generator=g), torch.randn(Dd, generator=g)
    init = torch.randn(Dd, N, generator=g) if with_state else None
    y, state = k.selective_scan_chunk(x, dt, A, B, C, D, init, chunk)
    ref_y, ref_state = k.selective_scan_reference(x, dt, A, B, C, D, init)
    scale = max(1.0, ref_y.abs().max().item(), ref_state.abs().max().item())   # states grow ~L without decay
    assert not y.isnan().any() and (y.double() - ref_y).abs().max().item() <= TOL * scale
    assert (state.double() - ref_state).abs().max().item() <= TOL * scale


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize('chunk', [16, 64, 256])
def test_scan_memory_is_linear_in_the_chunk_length(chunk):
    """Regression: the scan built a ``[Q, Q, D, N]`` decay tensor per chunk (quadratic in the
    chunk length Q). Now no tensor it makes is larger than one ``[Q, D, N]`` chunk."""
    Dd, N = 8, 4
    x, dt, A, B, C, D = _inputs(256, Dd=Dd, N=N, seed=5)
    with _LargestTensor() as seen:
        k.selective_scan_chunk(x, dt, A, B, C, D, None, chunk)
    assert seen.largest <= max(chunk * Dd * N, 256 * Dd)     # [Q, D, N], or the [L, D] output


def test_step_continues_the_scan():
    x, dt, A, B, C, D = _inputs(9)
    _, state = k.selective_scan_chunk(x[:8], dt[:8], A, B[:8], C[:8], D, None, 4)
    s = state[None].clone()
    y = k.selective_scan_step(x[8:], dt[8:], A, B[8:], C[8:], D, s)
    ref_y, ref_state = k.selective_scan_reference(x, dt, A, B, C, D)
    assert (y[0].double() - ref_y[8]).abs().max() <= TOL and (s[0].double() - ref_state).abs().max() <= TOL
    with pytest.raises(ValueError, match='state must be'):
        k.selective_scan_step(x[8:], dt[8:], A, B[8:], C[8:], D, state)


def test_varlen_mixes_decode_and_prefill_and_ignores_a_stale_slot():
    """Sequences of 1 (history), 7 (no history: its slot holds garbage), 1 (no history) and 5
    (history) rows in one call equal each sequence run alone; the slots hold the final states."""
    lengths, history, slots = [1, 7, 1, 5], [True, False, False, True], [3, 0, 5, 1]
    T = sum(lengths)
    x, dt, A, B, C, D = _inputs(T, seed=7)
    cache = torch.randn(6, 24, 8, generator=torch.Generator().manual_seed(8))
    start = cache.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    fn = get_kernel('selective_scan_varlen', 'cpu')
    y = fn(x, dt, A, B, C, D, cache, cu, torch.tensor(slots), torch.tensor(history), 4)
    for i, n in enumerate(lengths):
        sl = slice(cu[i].item(), cu[i + 1].item())
        init = start[slots[i]] if history[i] else None
        ry, rs = k.selective_scan_reference(x[sl], dt[sl], A, B[sl], C[sl], D, init)
        assert (y[sl].double() - ry).abs().max() <= TOL, i
        assert (cache[slots[i]].double() - rs).abs().max() <= TOL, i
    assert torch.equal(cache[[2, 4]], start[[2, 4]])       # untouched slots


def test_pure_decode_updates_a_sorted_slot_range_in_place():
    x, dt, A, B, C, D = _inputs(3, seed=3)
    cache = torch.randn(5, 24, 8, generator=torch.Generator().manual_seed(4))
    start = cache.clone()
    y = k.selective_scan_varlen(x, dt, A, B, C, D, cache, torch.arange(4), torch.tensor([1, 2, 3]),
                                torch.ones(3, dtype=torch.bool), 16)
    for i in range(3):
        ry, rs = k.selective_scan_reference(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, start[1 + i])
        assert (y[i].double() - ry[0]).abs().max() <= TOL and (cache[1 + i].double() - rs).abs().max() <= TOL
    assert torch.equal(cache[[0, 4]], start[[0, 4]])


@pytest.mark.parametrize('M, Dd, N', [(1, 1, 1), (3, 24, 8), (2, 37, 19)])
def test_native_step_equals_the_recurrence_on_cache_row_views(M, Dd, N):
    """The state is a view of every other slot of a cache (slot stride twice the row's), as the
    varlen driver passes a slot run; the slots between are untouched. B and C are column views of
    one projection, as the mixer splits them."""
    from lmdeploy.pytorch.kernels.cpu_native import native_library
    from lmdeploy.pytorch.kernels.mamba1_cpu import selective_scan_step_native
    if native_library() is None:
        pytest.skip('native CPU kernels could not be built here')
    x, dt, A, B, C, D = _inputs(M, Dd=Dd, N=N, seed=M + Dd)
    BC = torch.cat([B, C], dim=1)
    B, C = BC[:, :N], BC[:, N:]
    cache = torch.randn(2 * M, Dd, N, generator=torch.Generator().manual_seed(9))
    start = cache.clone()
    y = selective_scan_step_native(x, dt, A, B, C, D, cache[0::2])
    for m in range(M):
        ry, rs = k.selective_scan_reference(x[m:m + 1], dt[m:m + 1], A, B[m:m + 1], C[m:m + 1], D, start[2 * m])
        assert (y[m].double() - ry[0]).abs().max() <= TOL and (cache[2 * m].double() - rs).abs().max() <= TOL
    assert torch.equal(cache[1::2], start[1::2])
    assert selective_scan_step_native(x.double(), dt, A, B, C, D, cache[0::2]) is None     # float32 only


def test_registry_picks_native_then_torch_on_cpu_and_triton_on_cuda():
    from lmdeploy.pytorch import kernels
    from lmdeploy.pytorch.kernels.cpu_native import native_library
    from lmdeploy.pytorch.kernels.mamba1_cpu import selective_scan_step_cpu
    from lmdeploy.pytorch.kernels.mamba1_triton import selective_scan_chunk_triton, selective_scan_step_triton
    step_on_cpu = selective_scan_step_cpu if native_library() is not None else k.selective_scan_step
    assert kernels.get_kernel('selective_scan_step', 'cpu') is step_on_cpu
    assert kernels.get_kernel('selective_scan_chunk', 'cpu') is k.selective_scan_chunk
    if kernels.triton_available():
        assert kernels.get_kernel('selective_scan_step', 'cuda') is selective_scan_step_triton
        assert kernels.get_kernel('selective_scan_chunk', 'cuda') is selective_scan_chunk_triton


# In a subprocess so TRITON_INTERPRET=1 is set before triton is imported and does not leak.
_TRITON_SCRIPT = '''
import sys, torch
sys.path.insert(0, {tests!r})
from test_mamba1_kernels import _inputs
from lmdeploy.pytorch.kernels.mamba1 import selective_scan_reference as ref
from lmdeploy.pytorch.kernels.mamba1_triton import selective_scan_chunk_triton, selective_scan_step_triton

# decode: 3 sequences, state rows a strided view of a cache; D and N off the block sizes
x, dt, A, B, C, D = _inputs(3, Dd=40, N=19, seed=2)
cache = torch.randn(6, 40, 19, generator=torch.Generator().manual_seed(3))
state = cache[1::2]
want = [ref(x[m:m + 1], dt[m:m + 1], A, B[m:m + 1], C[m:m + 1], D, state[m]) for m in range(3)]
y = selective_scan_step_triton(x, dt, A, B, C, D, state)
torch.testing.assert_close(y, torch.cat([w[0] for w in want]).float(), atol=2e-5, rtol=1e-5)
torch.testing.assert_close(state, torch.stack([w[1] for w in want]).float(), atol=2e-5, rtol=1e-5)

# prefill: with and without an initial state, lengths 1 and 23, channels over one block
for L, Dd, N, init in [(1, 8, 16, False), (23, 40, 19, True), (23, 33, 8, False)]:
    x, dt, A, B, C, D = _inputs(L, Dd=Dd, N=N, seed=L + Dd)
    s0 = torch.randn(Dd, N, generator=torch.Generator().manual_seed(4)) if init else None
    y, final = selective_scan_chunk_triton(x, dt, A, B, C, D, s0)
    y_ref, s_ref = ref(x, dt, A, B, C, D, s0)
    torch.testing.assert_close(y, y_ref.float(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, s_ref.float(), atol=2e-5, rtol=1e-5)
y, final = selective_scan_chunk_triton(*_inputs(0, Dd=8, N=4)[:6], None)
assert y.shape == (0, 8) and not final.any()
print('ok')
'''


def test_triton_kernels_equal_the_recurrence_under_the_interpreter():
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', _TRITON_SCRIPT.format(tests=str(ROOT / 'tests'))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith('ok'), proc.stderr[-3000:]
