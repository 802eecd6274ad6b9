"""Everything a first forward initialises lazily is safe when two threads get there at once.

The kernel registry imports its kernel modules on the first :func:`get_kernel`; the native CPU
library is built (or loaded) on first use; the Triton kernels are compiled on first use. Two
engines in one process (or two threads of one server) can make their first forward at the same
moment, and each must see the whole registry, one library, one compiled kernel.

The races are made certain, not likely: each test runs in a fresh interpreter (so nothing is
imported or built yet) with an import hook that makes one kernel module slow to import, so a
second thread always arrives while the first is inside the lazy initialisation.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Installed in the child before lmdeploy is imported: importing the named module takes 1.5 s more.
_SLOW_IMPORT = '''
import importlib.abc, importlib.machinery, sys, time

class _Slow(importlib.abc.MetaPathFinder):
    def __init__(self, name):
        self.name = name

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            time.sleep(1.5)
            run(module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Slow(SLOW_MODULE))
'''


def _child(code: str, slow_module: str, timeout: float = 600) -> dict:
    """Run ``code`` (after the slow-import hook) in a fresh interpreter; its last stdout line is JSON."""
    script = f'SLOW_MODULE = {slow_module!r}\n' + _SLOW_IMPORT + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''), OMP_NUM_THREADS='1')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_registry_first_lookups_from_many_threads():
    """Eight threads ask for kernels of different modules at once, the first time in the process:
    every lookup finds its kernel (before the fix, all but the first thread got ``KeyError``
    while the first was still importing the kernel modules)."""
    out = _child('''
    import json, threading
    import torch
    from lmdeploy.pytorch import kernels
    names = ['causal_conv1d_varlen', 'gated_delta_rule_varlen', 'paged_attention', 'copy_state_slots']
    barrier = threading.Barrier(8)
    results = [None] * 8

    def ask(i):
        barrier.wait()
        try:
            results[i] = kernels.get_kernel(names[i % len(names)], 'cpu').__name__
        except Exception as err:
            results[i] = f'{type(err).__name__}: {err}'

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({'results': results, 'registered': sorted(kernels._REGISTRY)}))
    ''', slow_module='lmdeploy.pytorch.kernels.causal_conv1d')
    assert not [r for r in out['results'] if 'Error' in r], out['results']
    assert {'causal_conv1d_varlen', 'gated_delta_rule_varlen', 'paged_attention'} <= set(out['registered'])


def test_registry_registration_while_looking_up():
    """Registrations racing lookups: every lookup returns a registered implementation, and once
    all registrations are done the highest priority one is chosen (the choice is never stale)."""
    out = _child('''
    import json, threading
    from lmdeploy.pytorch import kernels
    kernels.register_kernel('toy_op', priority=-1)(lambda x: -1)
    barrier = threading.Barrier(6)
    seen, errors = set(), []

    def register(i):
        barrier.wait()
        for p in range(50):
            kernels.register_kernel('toy_op', priority=i * 100 + p)(lambda x, _p=i * 100 + p: _p)

    def lookup():
        barrier.wait()
        for _ in range(400):
            try:
                seen.add(kernels.get_kernel('toy_op', 'cpu')(None))
            except Exception as err:
                errors.append(repr(err))

    threads = [threading.Thread(target=register, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=lookup) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({'errors': errors, 'final': kernels.get_kernel('toy_op', 'cpu')(None),
                      'count': len(kernels._REGISTRY['toy_op'])}))
    ''', slow_module='lmdeploy.pytorch.kernels.moe')
    assert out['errors'] == []
    assert out['count'] == 151
    assert out['final'] == 249


def test_native_library_built_once_under_threads(tmp_path):
    """Threads asking for the native library at once in a process with an empty kernel cache:
    one compile, one library object for all of them."""
    pytest.importorskip('ctypes')
    out = _child(f'''
    import json, os, threading
    os.environ['LMDEPLOY_CACHE_DIR'] = {str(tmp_path / 'cache')!r}
    from lmdeploy.pytorch.kernels import cpu_native
    compiles = []
    real = cpu_native._compile

    def counting(path):
        compiles.append(path)
        return real(path)
    cpu_native._compile = counting
    barrier = threading.Barrier(4)
    libs = [None] * 4

    def get(i):
        barrier.wait()
        libs[i] = id(cpu_native.native_library())

    threads = [threading.Thread(target=get, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({{'compiles': len(compiles), 'distinct': len(set(libs)),
                      'loaded': cpu_native.native_library() is not None}}))
    ''', slow_module='lmdeploy.pytorch.kernels.moe')
    if not out['loaded']:
        pytest.skip('no C compiler here: the native library is not built')
    assert out == {'compiles': 1, 'distinct': 1, 'loaded': True}


def test_two_engines_in_one_process_first_forwards_overlap(tiny_qwen3_next):
    """Two engines built in one process make their first forward at the same moment (the kernel
    modules' import made slow, so the second arrives mid-import): both finish, with the greedy
    tokens of one engine running alone. Before the fix the second raised
    ``KeyError: no kernel 'causal_conv1d_varlen'``."""
    out = _child(f'''
    import json, threading
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    cfg = dict(num_gpu_blocks=64, device_type='cpu', dtype='float32')
    engines = [Engine({tiny_qwen3_next!r}, PytorchEngineConfig(**cfg)) for _ in range(2)]
    prompts = [[5 + (7 * i) % 900 for i in range(40)], [11 + (13 * i) % 900 for i in range(70)]]
    gen = GenerationConfig(max_new_tokens=6)
    barrier = threading.Barrier(2)
    results = [None, None]

    def run(i):
        barrier.wait()
        try:
            seq = engines[i].generate(prompts[i], gen)
            results[i] = [seq.finish_reason, seq.token_ids[len(prompts[i]):]]
        except Exception as err:
            results[i] = [f'{{type(err).__name__}}: {{err}}', []]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    alone = []
    for i in range(2):
        seq = Engine({tiny_qwen3_next!r}, PytorchEngineConfig(**cfg)).generate(prompts[i], gen)
        alone.append([seq.finish_reason, seq.token_ids[len(prompts[i]):]])
    print(json.dumps({{'together': results, 'alone': alone}}))
    ''', slow_module='lmdeploy.pytorch.kernels.causal_conv1d')
    assert out['together'] == out['alone'], out
    assert all(r[0] == 'length' and len(r[1]) == 6 for r in out['alone'])

