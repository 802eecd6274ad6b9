"""The ``transformers`` reference stays torch when kernel packages are installed (tests/hf_reference.py).

On the GPU machine (transformers 5.17 + fla-core) transformers handed even CPU tensors to fla's
Triton kernels. Here a child process simulates that machine: fake ``fla``, ``mamba_ssm`` and
``causal_conv1d`` packages whose kernels raise, and the device filter of newer transformers
removed. It first shows the simulation bites (Qwen3-Next's chunk rule, imported before the fix,
calls the fake), then that the references built after ``use_torch_reference`` run torch and equal
this process's: Qwen3-Next (module imported before the fix: its globals are rebound), Kimi-Linear,
Granite-4.0-H and LFM2 (its short conv's causal_conv1d fallback; imported after: the decorator
resolves no package).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ('qwen3_next', 'kimi_linear', 'granitemoehybrid', 'lfm2')

_SCRIPT = r'''
import importlib.machinery, sys, types
import torch
sys.path.insert(0, {tests!r})

FAKES = {{
    'fla.ops.gated_delta_rule': ('chunk_gated_delta_rule', 'fused_recurrent_gated_delta_rule'),
    'fla.ops.kda': ('chunk_kda', 'fused_recurrent_kda'),
    'mamba_ssm.ops.triton.ssd_combined': ('mamba_chunk_scan_combined', 'mamba_split_conv1d_scan_combined'),
    'mamba_ssm.ops.triton.selective_state_update': ('selective_state_update',),
    'mamba_ssm.ops.selective_scan_interface': ('mamba_inner_fn', 'selective_scan_fn'),
    'causal_conv1d': ('causal_conv1d_fn', 'causal_conv1d_update'),
}}

class FakeKernelCalled(RuntimeError):
    pass

def fake(name):
    def kernel(*args, **kwargs):
        raise FakeKernelCalled(name)
    return kernel

for path, names in FAKES.items():
    parts = path.split('.')
    for i in range(1, len(parts) + 1):
        name = '.'.join(parts[:i])
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)   # find_spec() sees an installed package
        if i > 1:
            setattr(sys.modules['.'.join(parts[:i - 1])], parts[i - 1], mod)
    for name in names:
        setattr(sys.modules[path], name, fake(name))

from transformers.integrations import hub_kernels
for package in ('fla', 'mamba_ssm', 'causal_conv1d'):   # as transformers 5.17: every device goes to the package
    getattr(hub_kernels, '_PACKAGE_SUPPORTED_DEVICES', {{}}).pop(package, None)

from transformers.models.qwen3_next import modeling_qwen3_next as qn
q = torch.randn(1, 5, 2, 8)
try:
    qn.torch_chunk_gated_delta_rule(q, q, q, torch.zeros(1, 5, 2), torch.ones(1, 5, 2))
except FakeKernelCalled:
    pass
else:
    raise SystemExit('the simulation does not route CPU tensors to the fake fla')

from engine_utils import hf_prompt_logits, load_hf
from hf_reference import torch_function
out = {{}}
for arch, path in {paths!r}.items():
    out[arch] = hf_prompt_logits(load_hf(path), {prompt!r})
assert torch_function(qn.torch_chunk_gated_delta_rule) is None   # rebound to the torch function itself
torch.save(out, {out!r})
print('ok')
'''


@pytest.fixture(scope='module')
def tiny_paths(tmp_path_factory):
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp('hf_reference')
    return {arch: make_tiny_model(str(root / arch), arch=arch, seed=0) for arch in ARCHS}


def test_reference_runs_torch_where_kernel_packages_take_cpu_tensors(tiny_paths, tmp_path):
    from engine_utils import hf_prompt_logits, load_hf, random_prompt
    prompt = random_prompt(40, seed=3)
    out = tmp_path / 'logits.pt'
    script = _SCRIPT.format(tests=str(ROOT / 'tests'), paths=tiny_paths, prompt=prompt, out=str(out))
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith('ok'), proc.stderr[-3000:]
    child = torch.load(out)
    for arch, path in tiny_paths.items():
        torch.testing.assert_close(child[arch], hf_prompt_logits(load_hf(path), prompt), atol=1e-5, rtol=0,
                                   msg=lambda m, arch=arch: f'{arch}: {m}')


def test_torch_function_unwraps_only_hub_wrappers():
    from hf_reference import torch_function, use_torch_reference
    from transformers.models.qwen3_next import modeling_qwen3_next as qn
    use_torch_reference()
    assert torch_function(qn.torch_chunk_gated_delta_rule) is None        # rebound to the torch function
    assert torch_function(qn.Qwen3NextRMSNorm) is None
    assert torch_function(torch.nn.functional.silu) is None
    from transformers.integrations import hub_kernels

    def ref(x):
        return x + 1
    wrapped = hub_kernels.use_kernel_func_from_hub_with_fallback('no_such_kernel', 'no_such_package')(ref)
    assert torch_function(wrapped) is ref
    assert wrapped(torch.ones(1)).item() == 2.0
