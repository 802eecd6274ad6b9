"""scripts/gpu_check.sh, the one GPU run, checked where there is no GPU: it parses, lists every
test file that skips without CUDA, prints its commands in a dry run, refuses bad options, fails
cleanly without CUDA, and its benchmark runs (on CPU, tiny sizes)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'scripts' / 'gpu_check.sh'


def _run(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


# Three collections of tests/test_cuda.py in one new interpreter (one start and torch import, not
# three); a new process so that test_cuda's module-level state never meets this session's.
_COLLECT = """
import json, sys
import pytest

class Grab:
    def pytest_collection_finish(self, session):
        self.ids = sorted(item.nodeid for item in session.items)

found = []
for k in json.loads(sys.argv[1]):
    grab = Grab()
    code = pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', *k, 'tests/test_cuda.py'], plugins=[grab])
    assert code == 0, (k, code)
    found.append(grab.ids)
print(json.dumps(found))
"""


def test_the_two_cuda_processes_split_test_cuda_between_them():
    """Every CUDA test runs in exactly one of the two processes (their -k expressions are 'engine'
    and 'not engine'): collected here, where they skip."""
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    selections = [[], ['-k', 'engine'], ['-k', 'not engine']]
    done = subprocess.run([sys.executable, '-c', _COLLECT, json.dumps(selections)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    every, engine, rest = (set(ids) for ids in json.loads(done.stdout.strip().splitlines()[-1]))
    assert every and all(i.startswith('tests/test_cuda.py::') for i in every)
    assert engine and rest and not engine & rest and engine | rest == every


def _cuda_only_test_files() -> set[str]:
    """Test files whose tests all skip without CUDA (a module-level skip on CUDA's absence)."""
    pattern = re.compile(r'pytestmark\s*=\s*pytest\.mark\.skipif\(\s*not torch\.cuda\.is_available\(\)')
    return {f'tests/{p.name}' for p in (ROOT / 'tests').glob('test_*.py') if pattern.search(p.read_text())}


def _interpreted_triton_test_files() -> set[str]:
    """Test files that run a Triton kernel under the interpreter (they set ``TRITON_INTERPRET``)."""
    return {f'tests/{p.name}' for p in (ROOT / 'tests').glob('test_*.py')
            if p.name != 'test_gpu_check.py' and 'TRITON_INTERPRET' in p.read_text()}


def test_script_parses():
    done = subprocess.run(['bash', '-n', str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_list_names_every_cuda_test_file_and_the_benchmark():
    done = _run('--list')
    assert done.returncode == 0, done.stderr
    rows = [line.split(' ', 1) for line in done.stdout.splitlines()]
    cuda = {rest for kind, rest in rows if kind == 'cuda-test'}
    assert cuda == _cuda_only_test_files() and 'tests/test_cuda.py' in cuda
    # a test skipped without CUDA in any other file would run on no machine at all
    skip = re.compile(r'skipif\(\s*not\s+torch\.cuda\.is_available\(\)')
    per_test = {f'tests/{p.name}' for p in (ROOT / 'tests').glob('test_*.py') if skip.search(p.read_text())}
    assert per_test <= cuda, per_test - cuda
    kernel = [rest for kind, rest in rows if kind == 'kernel-test']
    # every Triton kernel's interpreter suite runs on the GPU machine too (its triton and numpy)
    assert _interpreted_triton_test_files() <= {path.split('::')[0] for path in kernel}
    assert 'tests/test_window_attention_triton.py' in kernel
    for path in cuda | set(kernel):
        assert (ROOT / path.split('::')[0]).is_file(), path       # a file or a test's node id
    bench = [rest for kind, rest in rows if kind == 'bench']
    # --eager-mode: the decode part times CUDA graphs on against off
    assert bench == ['benchmark/benchmark_cuda.py --device cuda --preset small --batches 1,8 --decode-tokens 32 '
                     '--repeats 10 --eager-mode']
    # the CUDA decode graphs' GPU tests (engine/cuda_graph.py) are among those it runs
    cuda_tests = (ROOT / 'tests' / 'test_cuda.py').read_text()
    assert 'def test_cuda_graph_engine_replay_equals_eager(' in cuda_tests
    assert 'def test_cuda_graph_engine_generate_equals_eager_mode(' in cuda_tests


def test_dry_run_prints_each_step_into_the_out_folder(tmp_path):
    out = tmp_path / 'results'
    done = _run('--dry-run', env={'OUT': str(out)})
    assert done.returncode == 0, done.stderr
    steps = re.findall(r'^\[(\w+)\]', done.stdout, re.M)
    assert steps == ['env', 'install', 'cuda_tests_1', 'cuda_tests_2', 'kernel_tests', 'bench_cuda']
    # the CUDA tests in two processes, split by complementary -k expressions
    assert f"-k engine --junitxml={out}/cuda_tests_1.xml tests/test_cuda.py" in done.stdout
    assert f"-k not engine --junitxml={out}/cuda_tests_2.xml tests/test_cuda.py" in done.stdout
    assert f'--out {out}/bench_cuda.json' in done.stdout
    assert out.is_dir()
    assert '--durations=15' in done.stdout        # the slowest tests are in each log
    done = _run('--dry-run', '--no-install', '--no-bench', '--out', str(tmp_path / 'other'), '--budget', '100')
    assert re.findall(r'^\[(\w+)\]', done.stdout, re.M) == ['env', 'cuda_tests_1', 'cuda_tests_2', 'kernel_tests']
    # every step's limit is cut to the budget left: 100 s less the seconds the script has run (bash's
    # SECONDS, which ticks on the clock's whole seconds: even a quick dry run can print ``timeout 99``,
    # as one CI run did)
    limits = [int(t) for t in re.findall(r'\btimeout (\d+) ', done.stdout)]
    assert len(limits) == 3 and all(90 <= t <= 100 for t in limits), limits


def test_only_and_k_rerun_just_the_named_steps_and_tests(tmp_path):
    done = _run('--dry-run', '--no-install', '--only', 'cuda_tests', '-k', 'granite or fp8', '--out', str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert re.findall(r'^\[(\w+)\]', done.stdout, re.M) == ['env', 'cuda_tests_1', 'cuda_tests_2']
    assert '-k (engine) and (granite or fp8) ' in done.stdout
    done = _run('--dry-run', '--no-install', '--only', 'kernel_tests,bench_cuda', '--no-bench', '--out', str(tmp_path))
    assert re.findall(r'^\[(\w+)\]', done.stdout, re.M) == ['env', 'kernel_tests']


@pytest.mark.parametrize('args, message', [(['--frobnicate'], 'unknown option --frobnicate'),
                                           (['--budget', 'soon'], '--budget needs whole seconds'),
                                           (['--out'], '--out needs a folder'),
                                           (['--only', 'cuda_tests,tea'], '--only: unknown step tea'),
                                           (['-k'], '-k needs a pytest expression')])
def test_bad_options_exit_2(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has CUDA')
def test_without_cuda_it_fails_with_a_report(tmp_path):
    done = _run('--no-install', '--python', sys.executable, env={'OUT': str(tmp_path)}, timeout=300)
    assert done.returncode == 3
    assert 'sees no CUDA device' in done.stderr
    env = json.loads((tmp_path / 'env.json').read_text())
    assert env['cuda_available'] is False and env['torch'] == torch.__version__
    summary = json.loads((tmp_path / 'summary.json').read_text())
    assert summary['failed'] == 1 and summary['steps']['env']['rc'] == 3


def test_benchmark_runs_on_cpu_with_tiny_sizes(tmp_path):
    out = tmp_path / 'bench.json'
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    done = subprocess.run([sys.executable, str(ROOT / 'benchmark' / 'benchmark_cuda.py'), '--device', 'cpu',
                           '--kernel-scale', '1', '--repeats', '1', '--skip-decode', '--out', str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result['kernels']) == {'paged_decode_attention', 'copy_state_slots', 'gated_delta_rule_decode',
                                      'gated_delta_rule_prefill', 'causal_conv1d_decode', 'moe_experts_batch16',
                                      'rms_norm'}
    assert all(row['registry_ms'] > 0 for row in result['kernels'].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has CUDA')
def test_a_cuda_test_skipped_in_either_process_fails_the_run(tmp_path):
    """The two CUDA processes run at once; a test one of them skips (here: every one, CUDA being
    faked only in the environment report) fails the run; a process -k leaves empty passes."""
    fake = tmp_path / 'python'
    fake.write_text(f'''#!/usr/bin/env bash
if [ "$1" = "-c" ] && [[ "$2" == *'info = {{"python"'* ]]; then
    exec {sys.executable} -c "import torch; torch.cuda.is_available = lambda: True
$2" "${{@:3}}"
fi
exec {sys.executable} "$@"
''')
    fake.chmod(0o755)
    out = tmp_path / 'out'
    done = _run('--python', str(fake), '--no-install', '--only', 'cuda_tests', '-k', 'registry_picks',
                '--out', str(out), timeout=300)
    assert done.returncode == 1, done.stderr
    assert "cuda_tests_1: no test matches -k 'registry_picks'" in done.stderr
    assert '1 CUDA test(s) skipped on a CUDA machine' in done.stderr
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['failed'] == 1 and set(summary['steps']) == {'cuda_tests_1', 'cuda_tests_2'}
    assert all(step['rc'] == 0 for step in summary['steps'].values())
