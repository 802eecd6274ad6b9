"""The package's layering (.importlinter) holds: no module imports from a layer above its own.

import-linter (``lint-imports``) reads the contract in ``.importlinter`` at the repository root
and checks every import of the ``lmdeploy`` package, including imports inside functions. These
tests run it on the real tree, show that it does fail on an upward import (a copy of the
package with one added), and that every package and top-level module sits in some layer (a new
one left out would be unchecked).
"""
from __future__ import annotations

import configparser
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip('importlinter')

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / '.importlinter'


def _lint(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``lmdeploy`` found first on the path from ``cwd``."""
    env = dict(os.environ, PYTHONPATH=str(cwd))
    code = 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
    return subprocess.run([sys.executable, '-c', code, '--config', str(cwd / '.importlinter'), '--no-cache'],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _layers() -> list[list[str]]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    lines = [line.strip() for line in parser['importlinter:contract:layers']['layers'].splitlines() if line.strip()]
    return [[m.strip() for m in line.split('|')] for line in lines]


def test_contract_is_kept():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    contracts = [s for s in parser.sections() if s.startswith('importlinter:contract:')]
    assert f'Contracts: {len(contracts)} kept, 0 broken.' in done.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / 'lmdeploy', tmp_path / 'lmdeploy', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(CONFIG, tmp_path / '.importlinter')
    # a kernel that reaches up into the scheduler, inside a function like the lazy imports of the tree
    (tmp_path / 'lmdeploy' / 'pytorch' / 'kernels' / 'upward.py').write_text(
        'def f():\n    from ..engine.scheduler import Scheduler\n    return Scheduler\n')
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert 'BROKEN' in done.stdout and 'lmdeploy.pytorch.kernels.upward -> lmdeploy.pytorch.engine.scheduler' in \
        done.stdout, done.stdout


def test_every_package_is_in_a_layer():
    listed = {m for line in _layers() for m in line}
    found = set()
    for pkg in ('lmdeploy', 'lmdeploy.pytorch'):
        folder = ROOT.joinpath(*pkg.split('.'))
        for entry in folder.iterdir():
            if entry.name.startswith(('_', '.')):
                continue
            if entry.is_dir() and (entry / '__init__.py').exists():
                found.add(f'{pkg}.{entry.name}')
            elif entry.suffix == '.py':
                found.add(f'{pkg}.{entry.stem}')
    found.discard('lmdeploy.pytorch')   # the container of the lower layers, not a layer itself
    assert found - listed == set(), f'not in any layer of .importlinter: {sorted(found - listed)}'
    assert listed - found == set(), f'layers that do not exist: {sorted(listed - found)}'


def test_architecture_docs_show_the_contract():
    """docs/en and docs/zh_cn list the same layers, in the same order, as the contract."""
    for page in ('docs/en/architecture.md', 'docs/zh_cn/architecture.md'):
        text = (ROOT / page).read_text()
        block = text.split('\n```\nlmdeploy.cli\n', 1)[1].split('```', 1)[0]
        shown = [['lmdeploy.cli']] + [[m.strip() for m in line.split('  ')[0].split('|')]
                                      for line in block.splitlines() if line.strip()]
        assert shown == _layers(), page
