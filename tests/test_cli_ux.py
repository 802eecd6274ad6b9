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
