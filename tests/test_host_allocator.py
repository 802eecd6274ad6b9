"""Host allocator tuning for CPU engines: freed activation memory is reused without page faults.

Each check runs in a fresh interpreter, since the tuning is process-wide and permanent.
"""
import os
import subprocess
import sys
import textwrap

import pytest

# Allocates and frees tensors of the sizes a CPU step does (64 KiB to 20 MiB, some kept alive
# while others come and go), then counts the minor page faults of 40 more rounds.
_WORKLOAD = textwrap.dedent('''
    import resource, sys, torch
    if sys.argv[1] == 'engine':
        from lmdeploy.pytorch.engine.engine import Engine
        from lmdeploy import PytorchEngineConfig
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        Engine(make_tiny_model(sys.argv[2]), PytorchEngineConfig(device_type='cpu', max_batch_size=2,
                                                                 session_len=256, num_gpu_blocks=16))
    elif sys.argv[1] == 'direct':
        from lmdeploy.pytorch.engine.host_allocator import tune_host_allocator
        print('applied', tune_host_allocator(), tune_host_allocator())
    sizes = [128 << 10, 512 << 10, 3 << 20, 9 << 20, 20 << 20, 64 << 10]
    def step():
        keep = []
        for s in sizes:
            t = torch.empty(s // 4); t.fill_(1.0); keep.append(t)
            u = torch.empty(s // 8); u.fill_(2.0)
    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        step()
    print('faults', (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40)
''')


def _run(mode: str, tmp_path, **env) -> dict:
    out = subprocess.run([sys.executable, '-c', _WORKLOAD, mode, str(tmp_path / 'model')], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **env}, check=True).stdout
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line}


pytestmark = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc mallopt')


def test_tuned_allocator_reuses_freed_memory_without_faults(tmp_path):
    direct = _run('direct', tmp_path)
    assert direct['applied'] == ['True', 'True']          # idempotent
    assert float(direct['faults'][0]) < 1.0               # ~20 per round untuned on glibc 2.3x


def test_cpu_engine_tunes_the_allocator(tmp_path):
    assert float(_run('engine', tmp_path)['faults'][0]) < 1.0


def test_opt_out_leaves_the_allocator_alone(tmp_path):
    """The control: with the tuning disabled the same workload does fault, so the checks above
    measure the tuning and not the workload."""
    off = _run('direct', tmp_path, LMDEPLOY_HOST_MALLOC_TUNING='0')
    assert off['applied'] == ['False', 'False']
    assert float(off['faults'][0]) >= 5.0
