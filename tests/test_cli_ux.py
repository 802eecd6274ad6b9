"""A new user's first minutes with the ``lmdeploy`` command: ``--help`` answers without importing
torch or transformers, and a mistyped flag is answered in two lines."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# runs the console script's main() on argv, then reports which heavy modules the run imported
_PROBE = '''
import sys
from lmdeploy.cli.entrypoint import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print('IMPORTED', *sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules), file=sys.stderr)
'''


def _probe(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    return subprocess.run([sys.executable, '-c', _PROBE, *argv], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize('argv', [['--help'], ['serve', 'api_server', '--help'], ['make-tiny-model', '--help'],
                                  ['serve', 'api_server', '/m', '--enable-prefix-cashing']])
def test_help_and_flag_errors_import_neither_torch_nor_transformers(argv):
    """Help and command-line errors used to import torch (about 2.5 s on a loaded 2-core machine:
    the make-tiny-model parser lived in the checkpoint writer, the server's defaults in the
    server module); both load only when a command runs."""
    proc = _probe(*argv)
    imported = proc.stderr.strip().splitlines()[-1]
    assert imported.startswith('IMPORTED'), proc.stderr
    assert 'torch' not in imported.split() and 'transformers' not in imported.split(), proc.stderr
    if argv[-1] == '--help':
        assert proc.stdout.startswith('usage: lmdeploy'), proc.stdout


def test_a_mistyped_flag_is_the_error_the_suggestion_and_one_pointer_to_help(capsys):
    from lmdeploy.cli.entrypoint import main
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', '/m', '--enable-prefix-cashing'])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        'lmdeploy serve api_server: error: unrecognized arguments: --enable-prefix-cashing '
        '(did you mean --enable-prefix-caching?)\n'
        'see `lmdeploy serve api_server --help`\n')


def test_an_editable_install_builds_without_setuptools_warnings(tmp_path):
    """The quick start's ``pip install -e .`` printed two setuptools BuildBackendWarnings (51
    lines): csrc was an importable folder missing from ``packages``, and the import-hook editable
    strategy announces itself. Built here with setuptools' own PEP 517 hook, as pip calls it."""
    import shutil
    setuptools = pytest.importorskip('setuptools')
    if int(setuptools.__version__.split('.')[0]) < 70:
        pytest.skip('setuptools < 70 cannot build an editable wheel without the wheel package')
    tree = tmp_path / 'tree'
    tree.mkdir()
    for name in ('setup.py', 'README.md', 'MANIFEST.in'):
        shutil.copy(os.path.join(REPO_ROOT, name), tree / name)
    shutil.copytree(os.path.join(REPO_ROOT, 'requirements'), tree / 'requirements')
    shutil.copytree(os.path.join(REPO_ROOT, 'lmdeploy'), tree / 'lmdeploy',
                    ignore=shutil.ignore_patterns('__pycache__'))
    hook = 'import sys; from setuptools import build_meta; print(build_meta.build_editable(sys.argv[1]))'
    done = subprocess.run([sys.executable, '-W', 'default', '-c', hook, str(tmp_path / 'dist')], cwd=tree,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'Warning' not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].endswith('.whl')


@pytest.mark.parametrize('config, in_use, line', [
    (dict(store_backend='file:/srv/ckpt'), True, 'file Store in /srv/ckpt'),
    (dict(mooncake_master='local'), True, 'embedded Mooncake Store'),
    (dict(mooncake_master='10.0.0.7:50051', mooncake_metadata_server='http://10.0.0.7:8080/metadata'), True,
     'Mooncake Store at 10.0.0.7:50051'),
    (dict(store_backend='file:/srv/ckpt'), False, 'no Store'),
    (dict(), False, 'no Store')])
def test_the_startup_line_names_the_store_backend_really_used(config, in_use, line):
    """``--store-backend file:DIR`` was announced as 'Mooncake Store at None'."""
    from types import SimpleNamespace

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.pipeline import engine_summary
    cfg = PytorchEngineConfig(enable_prefix_caching=True, block_size=16, **config)
    engine = SimpleNamespace(config=cfg, device='cpu', block_manager=SimpleNamespace(num_blocks=64),
                             cache_engine=SimpleNamespace(num_slots=4), store=object() if in_use else None)
    assert engine_summary(engine) == f'64 KV blocks x 16 tokens on cpu, 4 state slots, {line}'


def test_mooncake_client_logs_keep_the_latest_few_and_never_a_running_process(tmp_path, monkeypatch):
    """One ``logs/mooncake-PID.log`` per server or chat run used to pile up without end."""
    from lmdeploy.cli.serve import KEPT_NATIVE_LOGS, native_log_path
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path))
    logs = tmp_path / 'logs'
    logs.mkdir()
    dead = [4_194_304 + i for i in range(8)]        # above Linux's largest pid: no such process
    for i, pid in enumerate(dead):                  # dead[0] written last
        (logs / f'mooncake-{pid}.log').write_text('x')
        os.utime(logs / f'mooncake-{pid}.log', (1e9 + 10 * (8 - i), 1e9 + 10 * (8 - i)))
    running = logs / f'mooncake-{os.getppid()}.log'
    running.write_text('x')
    os.utime(running, (1e9, 1e9))                   # the oldest of all, but its process runs
    (logs / 'notes.txt').write_text('x')            # not a Mooncake log: left alone
    path = native_log_path()
    assert path == str(logs / f'mooncake-{os.getpid()}.log')
    kept = {p.name for p in logs.iterdir()}
    assert kept == {'notes.txt', running.name} | {f'mooncake-{pid}.log' for pid in dead[:KEPT_NATIVE_LOGS - 1]}


def test_an_unreachable_master_fails_before_any_warning_about_authentication(tiny_qwen3_next, caplog):
    """The fatal 'master unreachable' is what stops the server; the unauthenticated-objects warning
    used to print first (it is only true of a Store that was reached)."""
    import logging

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.store.mooncake_client import StoreUnavailableError
    from lmdeploy.pytorch.store.services import free_ports
    rpc, http = free_ports('127.0.0.1', 2)
    cfg = PytorchEngineConfig(device_type='cpu', dtype='float32', block_size=16, prefill_save_alignment=64,
                              num_gpu_blocks=64, enable_prefix_caching=True, mooncake_master=f'127.0.0.1:{rpc}',
                              mooncake_metadata_server=f'http://127.0.0.1:{http}/metadata')
    caplog.set_level(logging.WARNING, logger='lmdeploy')
    with pytest.raises(StoreUnavailableError, match=f'127.0.0.1:{rpc}'):
        Engine(tiny_qwen3_next, cfg)
    assert 'NOT authenticated' not in caplog.text, caplog.text


def test_model_name_takes_several_names_as_peers_served_model_name(capsys):
    from lmdeploy.cli.entrypoint import build_parser
    args = build_parser().parse_args(['serve', 'api_server', '/m', '--model-name', 'local', 'claude-opus-4-8'])
    assert args.model_name == ['local', 'claude-opus-4-8']
    assert build_parser().parse_args(['serve', 'api_server', '/m']).model_name is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(['serve', 'api_server', '/m', '--model-name', 'a', ' '])
    assert '--model-name' in capsys.readouterr().err
    from lmdeploy.serve.openai.handlers import served_names
    assert served_names('a') == ('a',) and served_names(['b', 'a', 'b']) == ('b', 'a')
    for bad in ([], [''], None):
        with pytest.raises(ValueError, match='model_name'):
            served_names(bad)


def test_python_dash_m_lmdeploy_is_the_command():
    """``python -m lmdeploy`` runs the same command as the console script (it was "No module named
    lmdeploy.__main__"), exit code included, and its help imports no torch either."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    ok = subprocess.run([sys.executable, '-m', 'lmdeploy', '--help'], capture_output=True, text=True, env=env,
                        timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith('usage: lmdeploy '), ok.stderr
    bad = subprocess.run([sys.executable, '-m', 'lmdeploy', 'serve', 'api_server', '/m', '--enable-prefix-cashing'],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr == ('lmdeploy serve api_server: error: unrecognized arguments: --enable-prefix-cashing '
                          '(did you mean --enable-prefix-caching?)\nsee `lmdeploy serve api_server --help`\n')
