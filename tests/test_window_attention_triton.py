"""The Triton paged sliding-window attention (lmdeploy/pytorch/kernels/window_attention_triton.py)
against ``paged_window_attention_reference`` under ``TRITON_INTERPRET=1`` on CPU tensors: named
cases (decode steps, prefill chunks whose queries start mid-block, W = 1, windows shorter and
longer than the sequence, none, GQA groups of 1 to 4, sinks or not, key ranges over several key
tiles, a head_dim off the power-of-two tiles) and random steps of the same kinds. As in
tests/test_window_attention_batched.py (whose step builder this reuses), block tables are
shuffled, every cache entry no query may read is NaN and the table entries of blocks before
every window point at a NaN block; here some point at ids far past the cache, too. Inkling's
relative bias and logit multipliers in the same kernel against its per-sequence torch loop
(``tiled_attention``), on the same steps; and tiny granitemoe_swa and Inkling engines with the
interpreted kernel in every attention layer against their torch engines.

Tolerance 1e-5 absolute on outputs of magnitude ~1, as for the batched torch version: both
compute in float32; the kernel sums its softmax over tiles of 32 or 64 keys with online
rescaling and the reference over all keys at once, which moves a sum by a few float32 ulps
(measured: at most ~5e-7).

Also: the tile plan of a step, the registry's choice per device, and bad arguments (no triton
needed: they are refused before any launch).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels import window_attention as wa
from lmdeploy.pytorch.kernels import window_attention_triton as wat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_registry_picks_torch_on_cpu_and_triton_on_cuda():
    """Regression: CUDA ran the torch gathers and masked softmax (no Triton kernel was registered);
    Inkling's attention has only the CUDA kernel (its model keeps its torch path elsewhere)."""
    assert kernels.get_kernel('paged_window_attention', 'cpu') is wa.paged_window_attention
    assert kernels.find_kernel('relative_bias_attention', 'cpu') is None
    if kernels.triton_available():
        assert kernels.get_kernel('paged_window_attention', 'cuda') is wat.paged_window_attention_triton
        assert kernels.get_kernel('relative_bias_attention', 'cuda') is wat.relative_bias_attention_triton


def test_tiles_of_a_mixed_step():
    """Decode sequences get a tile of one row each, chunks tiles of ``rows`` rows (the last one
    short); rows, positions and sequence indices exact; built once per step and height."""
    from test_window_attention_batched import _step
    *_, ctx, _ = _step([(7, 1), (5, 9), (0, 1), (12, 4)], 4, 1, False, 4, 0)
    plan = wat.window_tiles(ctx, 4)
    assert [(rows, tiles.tolist()) for rows, tiles in plan] == [
        (1, [[0, 1, 7, 0], [10, 1, 0, 2]]),
        (4, [[1, 4, 5, 1], [5, 4, 9, 1], [9, 1, 13, 1], [11, 4, 12, 3]])]
    assert all(t.dtype == torch.int32 for _, t in plan)
    assert wat.window_tiles(ctx, 4) is plan
    assert wat.tile_rows(1) == 64 and wat.tile_rows(3) == 21 and wat.tile_rows(128) == 1


def test_bad_arguments_are_refused():
    from test_window_attention_batched import _step
    q, k, v, kc, vc, ctx, _ = _step([(3, 2)], 4, 1, False, 4, 0)
    with pytest.raises(ValueError, match='sliding_window must be >= 1'):
        wat.paged_window_attention_triton(q, k, v, kc, vc, ctx, 0.5, 0, None)
    with pytest.raises(ValueError, match='heads % kv_heads'):
        wat.paged_window_attention_triton(q[:, :1], k, v, kc, vc, ctx, 0.5, 4, None)     # 1 head, 2 KV heads
    with pytest.raises(ValueError, match='contiguous head_dim'):
        wat.paged_window_attention_triton(q, k, v, kc.transpose(2, 3), vc, ctx, 0.5, 4, None)
    rel, proj = torch.zeros(*q.shape[:2], 3), torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r'rel must be \[T, heads, d_rel\] and proj \[d_rel, E\]'):
        wat.relative_bias_attention_triton(q, k, v, rel, proj[:2], kc, vc, ctx, 0.5, 4, None)
    with pytest.raises(ValueError, match='sliding_window must be >= 1'):
        wat.relative_bias_attention_triton(q, k, v, rel, proj, kc, vc, ctx, 0.5, 0, None)


# In a subprocess so TRITON_INTERPRET=1 is set before triton is imported and does not leak.
_TRITON_SCRIPT = '''
import random, sys, torch
sys.path.insert(0, {tests!r})
from test_window_attention_batched import _step
from lmdeploy.pytorch.kernels import window_attention as wa
from lmdeploy.pytorch.kernels.window_attention_triton import paged_window_attention_triton
from lmdeploy.pytorch.model_inputs import StepContext

FIELDS = ('input_ids', 'positions', 'q_seqlens', 'q_start_loc', 'kv_seqlens', 'block_tables', 'state_slots',
          'block_size')


def check(seqs, window, gqa, sinks, block_size, seed, Hkv=2, D=4, far_ids=False):
    q, k, v, kc, vc, ctx, sink = _step(seqs, window, gqa, sinks, block_size, seed, Hkv=Hkv, D=D)
    if far_ids:     # blocks before every window: ids far past the cache (a read would fault)
        for (hist, _), table in zip(seqs, ctx.block_tables):
            table[:wa.window_key_range(hist, hist + 1, window)[0] // block_size] = 1 << 40
    ref_ctx = StepContext(**{{f: getattr(ctx, f) for f in FIELDS}})
    ref = wa.paged_window_attention_reference(q, k, v, kc.clone(), vc.clone(), ref_ctx, 0.5, window, sink)
    got = paged_window_attention_triton(q, k, v, kc, vc, ctx, 0.5, window, sink)
    case = (seqs, window, gqa, sinks, block_size, seed, Hkv, D)
    assert not got.isnan().any(), case
    err = (got - ref).abs().max().item()
    assert err <= 1e-5, (case, err)


# decode steps: windows shorter and longer than the sequences, W = 1, no window
check([(30, 1), (0, 1), (5, 1), (64, 1)], 8, 2, True, 4, 1)
check([(30, 1), (3, 1)], 1, 3, True, 16, 2)
check([(100, 1), (7, 1)], None, 1, False, 16, 3)
check([(40, 1), (11, 1)], 200, 4, True, 5, 4, far_ids=True)
# prefill chunks starting mid-block (history 13 with blocks of 4 and 16), with decode rows mixed in
check([(13, 20), (0, 1), (7, 40)], 5, 3, True, 4, 5, far_ids=True)
check([(13, 70), (2, 3)], None, 1, False, 16, 6)                        # several key tiles per row tile
check([(3, 9)], 1, 3, True, 1, 7)
check([(10, 30)], 200, 2, False, 5, 8)
check([(21, 50), (1, 1)], 24, 2, True, 16, 9, Hkv=1, D=80)              # head_dim 80: 128-wide, 32 keys a tile
check([(21, 50)], 4, 1, True, 16, 10, D=80)     # 64-row tiles over 32-key tiles: rows 32+ see none of the first
# random steps of the same kinds
rng = random.Random(0)
for seed in range(16):
    seqs = [(rng.randint(0, 70), rng.choice([1, 1, 2, 5, 17, 40])) for _ in range(rng.randint(1, 4))]
    window = rng.choice([None, 1, rng.randint(2, 40), 200])
    check(seqs, window, rng.choice([1, 2, 3, 4]), rng.random() < 0.5, rng.choice([1, 4, 5, 16]), seed,
          Hkv=rng.choice([1, 2]), D=rng.choice([4, 8, 20]), far_ids=rng.random() < 0.5)


# Inkling's relative bias (and logit multipliers) in the same kernel, against its per-sequence torch loop
import lmdeploy.pytorch.models.inkling as inkling
from lmdeploy.pytorch.kernels.attention import fill_kv_cache
from lmdeploy.pytorch.kernels.window_attention_triton import relative_bias_attention_triton


def check_bias(seqs, window, gqa, block_size, seed, d_rel, E, with_tau, Hkv=2, D=4):
    q, k, v, kc, vc, ctx, _ = _step(seqs, window, gqa, False, block_size, seed, Hkv=Hkv, D=D)
    gen = torch.Generator().manual_seed(seed)
    rel, proj = torch.randn(q.shape[0], q.shape[1], d_rel, generator=gen), torch.randn(d_rel, E, generator=gen)
    tau = 1 + torch.rand(q.shape[0], generator=gen) if with_tau else None
    ref_k, ref_v = kc.clone(), vc.clone()
    fill_kv_cache(k, v, ref_k, ref_v, ctx)
    ref = torch.full_like(q, float('nan'))
    inkling.tiled_attention(q, rel, proj, ref_k, ref_v, ctx, 0.3, window, tau, ref, list(range(len(seqs))))
    got = relative_bias_attention_triton(q, k, v, rel, proj, kc, vc, ctx, 0.3, window, tau)
    case = (seqs, window, gqa, block_size, seed, d_rel, E, with_tau, Hkv, D)
    assert not got.isnan().any(), case
    err = (got - ref).abs().max().item()
    assert err <= 1e-5, (case, err)


check_bias([(30, 1), (0, 1), (5, 1)], 8, 2, 4, 1, 3, 8, True)            # decode, E = window
check_bias([(13, 20), (0, 1), (7, 40)], 24, 3, 4, 2, 2, 5, False)       # chunks mid-block, E < window
check_bias([(13, 70), (2, 3)], None, 1, 16, 3, 4, 30, True)             # global: E < the history
check_bias([(40, 9), (3, 1)], 1, 2, 5, 4, 1, 1, True)                   # W = 1
for seed in range(6):
    seqs = [(rng.randint(0, 70), rng.choice([1, 1, 2, 7, 30])) for _ in range(rng.randint(1, 4))]
    window = rng.choice([None, 1, rng.randint(2, 40)])
    check_bias(seqs, window, rng.choice([1, 2, 3]), rng.choice([1, 4, 16]), 100 + seed, rng.randint(1, 5),
               rng.randint(1, 40), rng.random() < 0.5, Hkv=rng.choice([1, 2]), D=rng.choice([4, 8]))
print('ok')
'''


def test_triton_kernel_equals_the_reference_interpreted():
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', _TRITON_SCRIPT.format(tests=str(ROOT / 'tests'))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith('ok'), proc.stderr[-3000:]


_ENGINE_SCRIPT = '''
import sys
sys.path.insert(0, {tests!r})
from engine_utils import engine_prompt_logits, make_engine, random_prompt
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.kernels import find_kernel, register_kernel
from lmdeploy.pytorch.kernels import window_attention_triton as wat
from lmdeploy.tools.make_tiny_model import make_tiny_model

prompt, gen = random_prompt(70, seed=70), GenerationConfig(max_new_tokens=4, ignore_eos=True)
for arch, op, kernel in [('granitemoe_swa', 'paged_window_attention', wat.paged_window_attention_triton),
                         ('inkling_text', 'relative_bias_attention', wat.relative_bias_attention_triton)]:
    path = make_tiny_model({out!r} + arch, arch=arch, seed=0)
    runs = []
    for triton in (False, True):
        if triton:      # the GPU's choice, on CPU tensors: every attention layer of the engine through the kernel
            register_kernel(op, device_type='cpu', priority=100)(kernel)
            assert find_kernel(op, 'cpu') is kernel
        eng = make_engine(path, block_size=16, max_prefill_token_num=32)
        runs.append((engine_prompt_logits(eng, prompt)[0], eng.generate(prompt[:40], gen).token_ids))
    err = (runs[0][0] - runs[1][0]).abs().max().item()
    assert err <= 1e-4, (arch, err)
    assert runs[0][1] == runs[1][1], (arch, runs)
print('ok')
'''


def test_engines_through_the_interpreted_kernel_equal_the_torch_ones(tmp_path):
    """The tiny granitemoe_swa (global and sliding layers with sinks, 24-token windows) and
    Inkling (relative bias, log-scaled global layers) with the kernel in every attention layer: a
    70-token prompt in 32-token chunks over 16-token blocks (chunk ends inside windows; window
    layers in a block pool of their own) gives the torch engine's logits within 1e-4 (the
    engines' float32 bound against transformers), then the same greedy tokens."""
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    script = _ENGINE_SCRIPT.format(tests=str(ROOT / 'tests'), out=str(tmp_path / 'tiny_'))
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith('ok'), proc.stderr[-3000:]
