"""The native CPU kernels' C source: real files that compile without a warning, whose prototypes
are exactly what ctypes binds, that a built package ships, and that models reach only through
the kernel registry."""
from __future__ import annotations

import ctypes
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels import cpu_native

ROOT = pathlib.Path(__file__).resolve().parents[1]
_CC = os.environ.get('CC') or next((c for c in ('cc', 'gcc', 'clang') if shutil.which(c)), None)

# C parameter type (spaces normalised) -> the code cpu_native._ARGTYPES uses
_C_TO_CODE = {'int': 'i32', 'int64_t': 'i64', 'float': 'f32'}
_PROTOTYPE = re.compile(r'^(void|int)\s+(lm_\w+)\s*\(([^)]*)\)\s*;', re.M | re.S)


def _code(param: str) -> str:
    """``'const float* x'`` -> ``'p'``; ``'int64_t ldx'`` -> ``'i64'``."""
    decl = ' '.join(param.replace('*', ' * ').split())
    if '*' in decl:
        return 'p'
    ctype = ' '.join(decl.split()[:-1]).removeprefix('const ').strip()
    return _C_TO_CODE[ctype]


def header_signatures(text: str) -> dict[str, tuple[str, str | None]]:
    """``{name: (argument codes, result code)}`` of every ``lm_*`` prototype in a header."""
    text = re.sub(r'/\*.*?\*/', '', text, flags=re.S)
    out = {}
    for result, name, params in _PROTOTYPE.findall(text):
        codes = '' if params.strip() == 'void' else ' '.join(_code(p) for p in params.split(','))
        out[name] = (codes, None if result == 'void' else 'i32')
    return out


def test_header_prototypes_equal_the_ctypes_bindings():
    """Every entry point the header declares is bound with the same argument and result types,
    and nothing is bound that the header does not declare."""
    declared = header_signatures(pathlib.Path(cpu_native.HEADER).read_text())
    assert len(declared) == 24         # lm_dsa_select and lm_dsa_attend the last two
    assert declared == cpu_native._ARGTYPES


def test_signature_check_sees_a_mismatch():
    """The parser reads types, so a swapped width is caught (the check above can fail)."""
    text = pathlib.Path(cpu_native.HEADER).read_text()
    changed = text.replace('int64_t ldx, const float* w, int N', 'int ldx, const float* w, int N', 1)
    assert changed != text
    assert header_signatures(changed) != cpu_native._ARGTYPES


def test_every_exported_definition_is_declared():
    """The source defines no non-static function the header lacks (the build's
    -Wmissing-prototypes also says so) and includes the header, so the compiler checks each
    definition against its prototype."""
    source = pathlib.Path(cpu_native.SOURCE).read_text()
    assert '#include "cpu_native.h"' in source
    defined = set(re.findall(r'^(?:void|int)\s+(lm_\w+)\s*\(', source, re.M))
    assert defined == set(cpu_native._ARGTYPES)


@pytest.mark.skipif(_CC is None, reason='no C compiler')
def test_source_compiles_without_warnings(tmp_path):
    """The build flags (-Wall -Wextra -Wmissing-prototypes) plus -Werror: no warning at all."""
    out = tmp_path / 'lib.so'
    done = subprocess.run(cpu_native.compile_command(_CC, str(out), ('-Werror',)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    for name in cpu_native._ARGTYPES:
        getattr(lib, name)


@pytest.mark.skipif(_CC is None, reason='no C compiler')
def test_a_prototype_mismatch_fails_the_build(tmp_path):
    """A definition that disagrees with its prototype is a compile error, not a silent ABI change."""
    shutil.copytree(cpu_native.SOURCE_DIR, tmp_path / 'csrc')
    src = tmp_path / 'csrc' / 'cpu_native.c'
    text = src.read_text()
    src.write_text(text.replace('void lm_rms_norm(const float* x, int64_t R,', 'void lm_rms_norm(const float* x, int R,',
                                1))
    assert src.read_text() != text
    cmd = [_CC, *cpu_native._FLAGS, '-I', str(tmp_path / 'csrc'), str(src), '-o', str(tmp_path / 'x.so'), '-lm']
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and 'lm_rms_norm' in done.stderr


def test_library_name_follows_source_and_header(monkeypatch):
    """A library built from another version of either file is never loaded for this one."""
    name = cpu_native._library_name()
    real = cpu_native._source_text
    monkeypatch.setattr(cpu_native, '_source_text', lambda: real() + '/* edited */')
    assert cpu_native._library_name() != name


def test_wheel_ships_the_c_source(tmp_path):
    """A non-editable install has the source to build from: the wheel holds csrc/*.c and *.h."""
    setuptools = pytest.importorskip('setuptools')
    if int(setuptools.__version__.split('.')[0]) < 70:
        pytest.skip('setuptools < 70 cannot build a wheel without the wheel package')
    tree = tmp_path / 'tree'
    tree.mkdir()
    for name in ('setup.py', 'README.md', 'MANIFEST.in'):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / 'requirements', tree / 'requirements')
    shutil.copytree(ROOT / 'lmdeploy', tree / 'lmdeploy', ignore=shutil.ignore_patterns('__pycache__'))
    done = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w',
                           str(tmp_path / 'dist'), str(tree)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / 'dist').glob('*.whl')
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {'lmdeploy/pytorch/kernels/csrc/cpu_native.c', 'lmdeploy/pytorch/kernels/csrc/cpu_native.h'} <= names


def test_models_reach_native_kernels_only_through_the_registry():
    """No model module imports the native kernels or asks for the device type to pick a kernel."""
    for path in (ROOT / 'lmdeploy' / 'pytorch' / 'models').glob('*.py'):
        text = path.read_text()
        assert 'cpu_native' not in text.replace(':mod:`~lmdeploy.pytorch.kernels.cpu_native`', ''), path.name
        assert not re.search(r"device\.type\s*==\s*'cpu'", text), path.name


@pytest.mark.parametrize('op', ['rms_norm', 'gated_rms_norm', 'moe_experts', 'paged_decode_attention'])
def test_native_ops_are_registered_for_cpu(op):
    """Each model-facing op has a torch implementation for any device and a CPU one (which runs
    the native kernel when it applies); the CPU one is chosen on CPU when the library is built."""
    kernels.get_kernel(op, 'cpu')
    devices = {dev for _, dev, _, _ in kernels._REGISTRY[op]}
    assert {'any', 'cpu'} <= devices
    if cpu_native.native_library() is not None:
        cpu_fn = next(fn for _, dev, _, fn in kernels._REGISTRY[op] if dev == 'cpu')
        assert kernels.get_kernel(op, 'cpu') is cpu_fn


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_registered_norms_equal_their_torch_form(dtype):
    """The CPU implementations agree with the torch ones (native: to float32 rounding; other
    dtypes: the same torch ops, bit for bit)."""
    from lmdeploy.pytorch.kernels.norm import gated_rms_norm_cpu, gated_rms_norm_torch, rms_norm_cpu, rms_norm_torch
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(5, 3, 40, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(40, generator=gen).to(dtype)
    for zc in (False, True):
        a, b = rms_norm_cpu(x, w, 1e-6, zc), rms_norm_torch(x, w, 1e-6, zc)
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, rtol=0 if dtype != torch.float32 else 1e-6,
                                   atol=0 if dtype != torch.float32 else 1e-6)
    a, b = gated_rms_norm_cpu(x, z, w, 1e-6), gated_rms_norm_torch(x, z, w, 1e-6)
    torch.testing.assert_close(a, b, rtol=0 if dtype != torch.float32 else 1e-6,
                               atol=0 if dtype != torch.float32 else 1e-6)
