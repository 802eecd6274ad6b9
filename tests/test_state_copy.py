"""Checkpoint state slot copy: torch op, Triton kernel (interpreted on CPU) and dispatch."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmdeploy.pytorch.kernels import get_kernel
from lmdeploy.pytorch.kernels.state_copy import copy_state_slots, copy_state_slots_torch, copy_state_slots_triton

ROOT = Path(__file__).resolve().parents[1]


def _random_case(num_slots, slot_bytes, num_pairs, seed):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (num_slots, slot_bytes), dtype=torch.uint8, generator=g)
    perm = torch.randperm(num_slots, generator=g)
    return buf, perm[:num_pairs].clone(), perm[num_pairs:2 * num_pairs].clone()


def test_torch_copy_moves_whole_rows_and_nothing_else():
    buf, src, dst = _random_case(12, 48, 4, seed=1)
    expected = buf.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[d] = buf[s]
    copy_state_slots_torch(buf, src, dst)
    assert torch.equal(buf, expected)


def test_empty_pair_list_is_a_noop():
    buf, _, _ = _random_case(4, 32, 0, seed=2)
    before = buf.clone()
    empty = torch.empty(0, dtype=torch.int64)
    copy_state_slots(buf, empty, empty)
    copy_state_slots_torch(buf, empty, empty)
    copy_state_slots_triton(buf, empty, empty)  # returns before touching triton
    assert torch.equal(buf, before)


def test_cpu_dispatch_uses_torch_and_cuda_prefers_triton():
    assert get_kernel('copy_state_slots', 'cpu') is copy_state_slots_torch
    assert get_kernel('copy_state_slots', 'cuda') is copy_state_slots_triton
    buf, src, dst = _random_case(6, 16, 2, seed=3)
    expected = buf.clone()
    copy_state_slots_torch(expected, src, dst)
    copy_state_slots(buf, src, dst)
    assert torch.equal(buf, expected)


@pytest.mark.parametrize('kwargs, name', [
    (dict(state_buf=torch.zeros(4, 24, dtype=torch.uint8)), 'slot_bytes'),
    (dict(state_buf=torch.zeros(4, 16, dtype=torch.int32)), 'state_buf'),
    (dict(state_buf=torch.zeros(4, 32, dtype=torch.uint8)[:, :16]), 'state_buf'),
    (dict(src=torch.tensor([0], dtype=torch.int32)), 'src'),
    (dict(dst=torch.tensor([[1]])), 'dst'),
    (dict(dst=torch.tensor([1, 2])), 'same length'),
])
def test_bad_arguments_raise_value_error(kwargs, name):
    args = dict(state_buf=torch.zeros(4, 16, dtype=torch.uint8), src=torch.tensor([0]), dst=torch.tensor([1]))
    args.update(kwargs)
    for fn in (copy_state_slots_torch, copy_state_slots_triton):
        with pytest.raises(ValueError, match=name):
            fn(**args)


# Runs in a subprocess so TRITON_INTERPRET=1 is set before triton is imported and does not leak.
_TRITON_SCRIPT = textwrap.dedent('''
    import torch
    from lmdeploy.pytorch.kernels.state_copy import copy_state_slots_torch, copy_state_slots_triton
    checked = 0
    # slot_bytes 16 (2 words), 1040 (130 words), 17600 (2200 words: 2 full 1024-word chunks + a tail)
    for num_slots, slot_bytes, num_pairs in [(2, 16, 1), (8, 1040, 3), (9, 17600, 4), (40, 1040, 17)]:
        g = torch.Generator().manual_seed(num_slots * 1000 + num_pairs)
        buf = torch.randint(0, 256, (num_slots, slot_bytes), dtype=torch.uint8, generator=g)
        perm = torch.randperm(num_slots, generator=g)
        src, dst = perm[:num_pairs].clone(), perm[num_pairs:2 * num_pairs].clone()
        ref = buf.clone()
        copy_state_slots_torch(ref, src, dst)
        assert not torch.equal(ref, buf)  # the case really moves bytes
        copy_state_slots_triton(buf, src, dst)
        assert torch.equal(buf, ref), (num_slots, slot_bytes, num_pairs)
        checked += 1
    print('checked', checked)
''')


def test_triton_kernel_matches_torch_under_interpreter():
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', _TRITON_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ['checked', '4']
