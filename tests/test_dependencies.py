"""Every third-party module the project imports is declared in its own requirements files.

CI builds the test environment from ``requirements/*.txt`` and ``setup.py`` alone (a fresh venv
without system site-packages), but a package another one happens to pull in, or one a machine
had installed by hand, can still hide a missing entry until a newcomer's install lacks it. This
test reads every ``import`` of the project's code, tests, benchmarks and scripts and checks the
distribution that provides it against the requirement files that folder may rely on:

    lmdeploy/  -> runtime.txt; store.txt and cuda.txt (extras) only behind a lazy or guarded import
    tests/, benchmark/, scripts/ -> runtime.txt, test.txt, store.txt; cuda.txt behind a guard

A guarded import sits in a ``try`` that catches ``ImportError`` (or ``Exception``), under
``if TYPE_CHECKING``, or in a function body (imported only when that feature is used).
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / 'requirements'

# Folders whose files are imported by name (sys.path or pytest's rootdir insertion), not installed.
LOCAL_DIRS = ('tests', 'benchmark', 'scripts')
# Modules that are no distribution of the index: llama.cpp's converter, found on a path the user
# gives to benchmark/make_gguf.py (imported only inside a try).
NOT_ON_INDEX = {'conversion', 'gguf'}
# Modules of an extra that a CPU machine does not install (so no metadata names their
# distribution here), with the distribution that provides them.
EXTRA_MODULES = {'fla': 'fla-core'}


def _canon(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r'[-_.]+', '-', name).lower()


def _requirements(*files: str) -> set[str]:
    names = set()
    for f in files:
        for line in (REQ / f).read_text().splitlines():
            m = re.match(r'\s*([A-Za-z0-9][A-Za-z0-9_.-]*)', line.split('#')[0])
            if m:
                names.add(_canon(m.group(1)))
    return names


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in ('ImportError', 'ModuleNotFoundError', 'Exception')
               for t in types)


def _imports(path: Path):
    """``(top-level module, guarded, lazy, line)`` for every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        guarded = lazy = False
        cur = node
        while cur in parents:
            up = parents[cur]
            if isinstance(up, ast.Try) and cur in up.body and any(map(_catches_import_error, up.handlers)):
                guarded = True
            if isinstance(up, ast.If) and 'TYPE_CHECKING' in ast.unparse(up.test):
                guarded = True
            if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lazy = True
            cur = up
        for name in names:
            yield name.split('.')[0], guarded, lazy, node.lineno


def _local_modules() -> set[str]:
    names = {'lmdeploy', *LOCAL_DIRS}     # the folders too: `from benchmark import ...`
    for d in LOCAL_DIRS:
        names |= {p.stem for p in (ROOT / d).rglob('*.py')}
    return names


def _python_files():
    for d in ('lmdeploy',) + LOCAL_DIRS:
        yield from sorted((ROOT / d).rglob('*.py'))


def _problems() -> list[str]:
    runtime = _requirements('runtime.txt')
    extras = _requirements('store.txt', 'cuda.txt')
    dev = runtime | _requirements('test.txt', 'store.txt')
    cuda = _requirements('cuda.txt')
    providers = importlib.metadata.packages_distributions()
    local = _local_modules()
    problems = []
    for path in _python_files():
        rel = path.relative_to(ROOT)
        in_package = rel.parts[0] == 'lmdeploy'
        for top, guarded, lazy, line in _imports(path):
            if top in sys.stdlib_module_names or top in local or top == '__future__':
                continue
            where = f'{rel}:{line} imports {top!r}'
            if top in NOT_ON_INDEX:
                if not guarded:
                    problems.append(f'{where} without a guard')
                continue
            dists = {_canon(d) for d in providers.get(top, ())}
            if not dists and top in EXTRA_MODULES:
                dists = {EXTRA_MODULES[top]}
            if not dists:
                if not guarded:
                    problems.append(f'{where}, which no installed distribution provides and no guard covers')
                continue
            if in_package:
                ok = dists & runtime or (dists & extras and (guarded or lazy))
                rule = 'requirements/runtime.txt (or an extra, imported lazily)'
            else:
                ok = dists & dev or (dists & cuda and guarded)
                rule = 'requirements/runtime.txt, test.txt or store.txt'
            if not ok:
                problems.append(f'{where} (distribution {sorted(dists)}), not declared in {rule}')
    return problems


def test_every_imported_distribution_is_declared():
    problems = _problems()
    assert not problems, '\n'.join(problems)


def test_the_check_sees_an_undeclared_import(tmp_path, monkeypatch):
    """The check is not vacuous: a module importing an installed but undeclared distribution
    (``pytest`` from package code, where only test.txt declares it) and an uninstalled module
    without a guard are both reported; the same imports in a function or ``try`` are accepted
    where the rules allow."""
    pkg = tmp_path / 'lmdeploy'
    pkg.mkdir()
    (pkg / 'bad.py').write_text('import pytest\nimport no_such_module_xyz\n')
    (pkg / 'ok.py').write_text('try:\n    import no_such_module_xyz\nexcept ImportError:\n    pass\n'
                               'def f():\n    import mooncake\n')
    for d in LOCAL_DIRS:
        (tmp_path / d).mkdir()
    monkeypatch.setattr(sys.modules[__name__], 'ROOT', tmp_path)
    problems = _problems()
    assert len(problems) == 2, problems
    assert "lmdeploy/bad.py:1 imports 'pytest'" in problems[0]
    assert "lmdeploy/bad.py:2 imports 'no_such_module_xyz'" in problems[1]


@pytest.mark.parametrize('name', ['runtime.txt', 'test.txt', 'store.txt', 'cuda.txt'])
def test_setup_reads_every_requirements_file(name):
    """setup.py installs each requirements file (runtime, or as the extra of its name), so what
    the files declare is what `pip install -e ".[test,store]"` installs."""
    setup = (ROOT / 'setup.py').read_text()
    assert f"_reqs('{name}')" in setup
