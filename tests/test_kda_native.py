"""The native CPU KDA decode step (the delta-rule step of the native library with a decay per key
channel; its prototype and warnings are checked with the library's in test_cpu_native_source): it
equals the torch step and the token-by-token reference (any head count and width,
on cache-row views, rows around them untouched), the registry picks it on CPU, the varlen
kernel's in-place decode path uses it, and it refuses what it does not cover."""
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy.pytorch.kernels import _REGISTRY, get_kernel
from lmdeploy.pytorch.kernels import cpu_native
from lmdeploy.pytorch.kernels.kimi_delta_attention import (kda_decode_step_cpu, kda_decode_step_torch, kda_varlen,
                                                           recurrent_kda)

needs_library = pytest.mark.skipif(cpu_native.native_library() is None,
                                   reason='native CPU kernels could not be built here (no C compiler with OpenMP, '
                                          'or LMDEPLOY_CPU_KERNELS=0)')


def _close(actual, expected, scale):
    """float32 sums of dk products in another order: ~dk * 2^-24 of the terms' scale; 1e-5 of it
    is loose for every dk here and far below a real error (a missed decay, a wrong row)."""
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= 1e-5 * scale + 1e-6, f'max error {err} for a term scale of {scale}'


def _inputs(gen, n, heads, dk, dv):
    q, k = torch.randn(n, heads, dk, generator=gen), torch.randn(n, heads, dk, generator=gen)
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, dk, generator=gen) * 3.0        # per-channel log decays in (-3, 0]
    beta = torch.rand(n, heads, generator=gen)
    return q, k, v, g, beta


@needs_library
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 40), st.integers(1, 40), st.booleans(),
       st.integers(0, 2 ** 31))
def test_native_step_equals_torch_and_the_reference_on_cache_rows(n, heads, dk, dv, row_layout, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _inputs(gen, n, heads, dk, dv)
    size = heads * dk * dv
    cache = torch.randn(n + 3, size + (5 if row_layout else 0), generator=gen)
    before = cache.clone()
    state = cache[1:1 + n, :size].view(n, heads, dk, dv)       # the engine's view of its rows
    torch_state = state.clone()
    calls = cpu_native.CALLS['kda_step']
    o = kda_decode_step_cpu(q, k, v, g, beta, state)
    assert cpu_native.CALLS['kda_step'] == calls + 1       # the native kernel ran
    o_torch = kda_decode_step_torch(q, k, v, g, beta, torch_state)
    _close(o, o_torch, float(o_torch.abs().max()) + 1.0)
    _close(state, torch_state, float(torch_state.abs().max()) + 1.0)
    for i in range(n):
        o_ref, s_ref = recurrent_kda(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                     before[1 + i, :size].view(heads, dk, dv))
        _close(o[i], o_ref[0], float(o_ref.abs().max()) + 1.0)
        _close(state[i], s_ref, float(s_ref.abs().max()) + 1.0)
    assert torch.equal(cache[0], before[0]) and torch.equal(cache[1 + n:], before[1 + n:])
    if row_layout:
        assert torch.equal(cache[:, size:], before[:, size:])


@needs_library
def test_registry_picks_the_native_step_on_cpu():
    devices = {dev for _, dev, _, _ in _REGISTRY['kda_decode_step']}
    assert {'any', 'cpu'} <= devices
    assert get_kernel('kda_decode_step', 'cpu') is kda_decode_step_cpu
    assert get_kernel('kda_decode_step', 'meta') is kda_decode_step_torch
    for op in ('chunk_kda', 'recurrent_kda', 'kda_decode_step'):     # fla-core's, chosen on CUDA when installed
        assert 'cuda' in {dev for _, dev, _, _ in _REGISTRY[op]}


@needs_library
@pytest.mark.parametrize('slots, history', [([2, 3, 4], [True] * 3),          # one range: in place
                                            ([4, 2, 3], [True] * 3),          # a permuted range
                                            ([5, 1, 3], [True, False, True])])  # gaps, a fresh one
def test_varlen_decode_uses_the_native_step(slots, history):
    H, dk, dv, n = 2, 16, 8, len(slots)
    gen = torch.Generator().manual_seed(len(slots) + sum(slots))
    cache = torch.randn(7, H, dk, dv, generator=gen)
    before = cache.clone()
    q, k, v, g, beta = _inputs(gen, n, H, dk, dv)
    calls = cpu_native.CALLS['kda_step']
    out = kda_varlen(q, k, v, g, beta, cache, torch.arange(n + 1), torch.tensor(slots), torch.tensor(history))
    assert cpu_native.CALLS['kda_step'] == calls + 1
    for i, s in enumerate(slots):
        o_ref, s_ref = recurrent_kda(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                     before[s] if history[i] else None)
        _close(out[i], o_ref[0], float(o_ref.abs().max()) + 1.0)
        _close(cache[s], s_ref, float(s_ref.abs().max()) + 1.0)
    untouched = [s for s in range(7) if s not in slots]
    assert torch.equal(cache[untouched], before[untouched])


@needs_library
def test_native_step_refuses_what_it_does_not_cover():
    state = torch.zeros(2, 1, 4, 4)
    kq, v, a, b = torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 4), torch.ones(2, 1, 4), torch.ones(2, 1)
    assert cpu_native.delta_step_native(kq, v, a, b, state) is not None
    assert cpu_native.delta_step_native(kq, v, a, b, state.transpose(2, 3)) is None     # dv not unit stride
    assert cpu_native.delta_step_native(kq.bfloat16(), v, a, b, state) is None
    assert cpu_native.delta_step_native(kq, v, a[..., :3], b, state) is None           # decay not [N, H, dk]
    grad = torch.zeros(2, 1, 4, requires_grad=True)
    assert cpu_native.delta_step_native(kq, grad, a, b, state) is None                 # autograd graph
    # the CPU op falls back to torch where the kernel does not apply: a state not unit-strided along dv
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _inputs(gen, 2, 1, 4, 4)
    s_native = torch.randn(2, 1, 4, 4, generator=gen).transpose(2, 3)
    s_torch = s_native.clone()
    calls = cpu_native.CALLS['kda_step']
    o = kda_decode_step_cpu(q, k, v, g, beta, s_native)
    assert cpu_native.CALLS['kda_step'] == calls
    assert torch.equal(o, kda_decode_step_torch(q, k, v, g, beta, s_torch)) and torch.equal(s_native, s_torch)


@needs_library
def test_a_per_head_decay_is_the_per_channel_step_with_the_value_repeated():
    """One native step serves the gated delta rule (a decay per head) and KDA (per key channel):
    the same arithmetic, so bit-equal outputs and states."""
    gen = torch.Generator().manual_seed(3)
    kq, v = torch.randn(3, 2, 2, 16, generator=gen), torch.randn(3, 2, 8, generator=gen)
    a, b = torch.rand(3, 2, generator=gen), torch.rand(3, 2, generator=gen)
    state = torch.randn(3, 2, 16, 8, generator=gen)
    per_channel_state = state.clone()
    o = cpu_native.delta_step_native(kq, v, a, b, state)
    o_channel = cpu_native.delta_step_native(kq, v, a[..., None].expand(3, 2, 16).contiguous(), b, per_channel_state)
    assert torch.equal(o, o_channel) and torch.equal(state, per_channel_state)


_PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.kimi_delta_attention import kda_decode_step_torch
print('torch step', get_kernel('kda_decode_step', 'cpu') is kda_decode_step_torch)
"""


@pytest.mark.parametrize('env, reason', [({'LMDEPLOY_CPU_KERNELS': '0'}, 'LMDEPLOY_CPU_KERNELS=0'),
                                         ({'CC': 'false'}, 'failed')])
def test_switched_off_or_unbuildable_runs_the_torch_step(env, reason, tmp_path):
    import os
    import sys
    done = subprocess.run([sys.executable, '-c', _PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'LMDEPLOY_CACHE_DIR': str(tmp_path), **env})
    assert done.returncode == 0, done.stderr
    assert 'torch step True' in done.stdout and reason in done.stdout
    assert 'native CPU kernels unavailable' in done.stdout
