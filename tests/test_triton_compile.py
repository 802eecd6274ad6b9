"""The Triton kernels compile for an H100 / H200 (sm_90) here, with no GPU: what the interpreter
tests cannot see.

Triton's compiler runs without a device (its LLVM and ptxas ship in the wheel), so the GPU form of
each kernel is checked on every machine: it compiles; the SSD scan and the FP8 GEMM keep their
runtime loop bound (the constexpr end exists only for the interpreter: kernels.static_loop_end)
and their software pipelining (cp.async); float32 products never run in TF32 (Triton's default
for float32 ``tl.dot``, a 10-bit mantissa: it once cost the FP8 GEMM its float32 agreement);
bfloat16 ones still use the tensor cores (wgmma); the decode attention walks a while loop to its
loaded block count, and the window attention to its loaded key range, multiplying in full float32
precision whatever the cache dtype.
"""
from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip('triton')


def _compile(kernel, types: dict, constexprs: dict):
    """``kernel`` compiled for sm_90: ``{'ttir': str, 'ptx': str}``; skips where this triton
    cannot (the interpreter is on, or its compile API differs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if not hasattr(kernel, 'arg_names') or type(kernel).__name__ == 'InterpretedFunction':
        pytest.skip('TRITON_INTERPRET is set: the kernels are not compiled')
    signature = {name: types.get(name, 'constexpr' if name in constexprs else 'i32') for name in kernel.arg_names}
    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    except TypeError as err:
        pytest.skip(f'triton {triton.__version__} has another ASTSource API: {err}')
    compiled = triton.compile(source, target=GPUTarget('cuda', 90, 32))
    return {'ttir': compiled.asm['ttir'], 'ptx': compiled.asm['ptx']}


def _pointers(kernel, dtype: str) -> dict:
    return {name: f'*{dtype}' for name in kernel.arg_names if name.endswith('_ptr')}


def test_decode_attention_loops_to_its_loaded_block_count():
    from lmdeploy.pytorch.kernels import attention_triton
    _, kernel = attention_triton._kernel()
    for lens in ('i32', 'i64'):
        types = dict(_pointers(kernel, 'fp32'), table_ptr='*i32', lens_ptr=f'*{lens}', scale='fp32')
        asm = _compile(kernel, types, {'BLOCK_T': 64, 'BLOCK_D': 128})
        assert 'scf.while' in asm['ttir']


def test_ssd_scan_keeps_its_runtime_bound_pipelining_and_full_precision():
    """(State size 16, Granite's tiny model's: a 128-wide state takes ~25 s to compile here.)"""
    from lmdeploy.pytorch.kernels import mamba2_triton
    block_n = 16
    _, step, scan = mamba2_triton._kernels()
    asm = _compile(scan, _pointers(scan, 'fp32'), dict(HAS_INIT=True, HAS_D=True, CH=64, BLOCK_P=32, BLOCK_N=block_n,
                                                       STATIC_L=-1))
    assert re.search(r'scf\.for %\S+ = %\S+ to %L ', asm['ttir']), 'the chunk loop does not run to the argument L'
    assert 'cp.async' in asm['ptx']
    assert 'tf32' not in asm['ptx']
    asm = _compile(step, _pointers(step, 'fp32'), dict(HAS_D=True, BLOCK_P=32, BLOCK_N=block_n))
    assert 'tf32' not in asm['ptx']


@pytest.mark.parametrize('dtype', ['fp32', 'bf16'])
def test_fp8_gemm_float32_is_not_tf32_and_bfloat16_uses_the_tensor_cores(dtype):
    from lmdeploy.pytorch.kernels import fp8
    kernel = fp8._kernel()
    types = dict(_pointers(kernel, dtype), w_ptr='*u8', s_ptr='*fp32', b_ptr='*fp32')
    torch_dtype = {'fp32': torch.float32, 'bf16': torch.bfloat16}[dtype]
    asm = _compile(kernel, types, dict(BLOCK_N_Q=128, BLOCK_K_Q=128, HAS_BIAS=True, BM=64, BN=64, BK=64, STATIC_K=-1,
                                       DOT_PRECISION=fp8.dot_precision(torch_dtype)))
    assert re.search(r'scf\.for %\S+ = %\S+ to %K ', asm['ttir']), 'the K loop does not run to the argument K'
    assert 'cp.async' in asm['ptx']
    if dtype == 'fp32':
        assert 'tf32' not in asm['ptx']
    else:
        assert re.search(r'wgmma\.mma_async\S*\.bf16\.bf16', asm['ptx'])


def test_state_copy_compiles():
    from lmdeploy.pytorch.kernels import state_copy
    _, kernel = state_copy._triton_kernel()
    _compile(kernel, dict(buf_ptr='*i64', src_ptr='*i64', dst_ptr='*i64'), {'BLOCK': 1024})


@pytest.mark.parametrize('cache, bias', [('fp32', False), ('bf16', False), ('fp32', True)])
def test_window_attention_loops_to_its_loaded_key_range_in_full_precision(cache, bias):
    """Both products at full float32 precision for any cache dtype (the torch version's), the key
    loop a while loop to bounds loaded from the tile plan; with Inkling's relative bias (a 32-channel
    loop of gathers) and logit multipliers too."""
    from lmdeploy.pytorch.kernels import window_attention_triton
    _, kernel = window_attention_triton._kernel()
    types = dict(_pointers(kernel, cache), q_ptr=f'*{cache}', out_ptr=f'*{cache}', rel_ptr=f'*{cache}',
                 sink_ptr='*fp32', proj_ptr='*fp32', tau_ptr='*fp32', table_ptr='*i64', tiles_ptr='*i32', scale='fp32')
    asm = _compile(kernel, types, dict(ROWS=16 if bias else 1, HAS_SINK=not bias, HAS_BIAS=bias,
                                       D_REL=32 if bias else 1, HAS_TAU=bias, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64))
    assert 'scf.while' in asm['ttir']
    assert 'tf32' not in asm['ptx']
