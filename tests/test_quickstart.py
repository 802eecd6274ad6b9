"""The README's two commands, as a new user runs them.

The quick start end to end: tiny hybrid model, a shared Mooncake Store, an api_server with
prefix caching and last-only checkpoints driving a 5-turn OpenAI conversation (the table), then
a fresh api_server restoring the conversation from the Store (Store hit tokens). The default run
uses the current environment (``LMDEPLOY_SKIP_INSTALL=1``); with
``LMDEPLOY_TEST_QUICKSTART_FULL=1`` (set by .ci/run) the script also builds its own virtual
environment from scratch, and the test then runs the activation line it printed and a
single-file test run in that environment, exactly as a new user would.

``scripts/run_tests.sh`` runs just the paths it is given.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_table(output: str) -> list[dict]:
    """Rows of the quick start's per-turn table."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ['turn', 'TTFT'])
    rows = []
    for line in lines[header + 1:]:
        parts = line.split()
        if len(parts) != 5 or not parts[0].isdigit():
            break
        rows.append({'turn': int(parts[0]), 'ttft': float(parts[1]), 'prompt_tokens': int(parts[2]),
                     'cached_tokens': int(parts[3]), 'store_bytes': int(parts[4])})
    return rows


def parse_restore(output: str) -> dict:
    """The fresh server's row: ``{'prompt_tokens', 'cached_tokens', 'store_hit_tokens'}``."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ['restore', 'TTFT'])
    parts = lines[header + 1].split()
    assert parts[:2] == ['turn', '6'], lines[header + 1]
    return {'ttft': float(parts[2]), 'prompt_tokens': int(parts[3]), 'cached_tokens': int(parts[4]),
            'store_hit_tokens': int(parts[5])}


def check_restore(row: dict, table: list[dict]) -> None:
    """A fresh server restored the conversation from the Store: every cached token is a Store
    hit, and the restore reaches at least as deep as the last turn's own cache hit."""
    assert row['prompt_tokens'] > table[-1]['prompt_tokens']
    assert row['store_hit_tokens'] > 0, row
    assert row['cached_tokens'] == row['store_hit_tokens'], row
    assert table[-1]['cached_tokens'] <= row['store_hit_tokens'] < row['prompt_tokens'], (row, table[-1])


def check_table(rows: list[dict]) -> None:
    assert [r['turn'] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]['cached_tokens'] == 0
    for prev, row in zip(rows, rows[1:]):
        assert row['cached_tokens'] > 0, row
        assert row['prompt_tokens'] > prev['prompt_tokens'], row      # append-only conversation
        assert row['cached_tokens'] < row['prompt_tokens'], row
    assert all(r['store_bytes'] > 0 for r in rows), rows              # one save per turn, each written
    assert all(r['ttft'] > 0 for r in rows)


def _run(env_extra: dict, timeout: int) -> str:
    env = dict(os.environ, **env_extra)
    proc = subprocess.run(['bash', os.path.join(ROOT, 'scripts', 'quickstart.sh')], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quickstart_prints_cached_tokens_store_bytes_and_a_fresh_server_restoring_from_the_store(tmp_path):
    out = _run({'LMDEPLOY_SKIP_INSTALL': '1', 'LMDEPLOY_QUICKSTART_DIR': str(tmp_path / 'qs')}, timeout=600)
    table = parse_table(out)
    check_table(table)
    check_restore(parse_restore(out), table)
    # the model whose path it prints is kept
    assert os.path.isfile(tmp_path / 'qs' / 'model' / 'config.json')
    assert 'source ' not in out    # no environment of its own to activate


@pytest.mark.skipif(os.environ.get('LMDEPLOY_TEST_QUICKSTART_FULL') != '1',
                    reason='full install run only in CI (.ci/run sets LMDEPLOY_TEST_QUICKSTART_FULL=1)')
def test_quickstart_from_a_fresh_virtual_environment(tmp_path):
    venv = tmp_path / 'venv'
    env = {'LMDEPLOY_VENV': str(venv), 'LMDEPLOY_QUICKSTART_DIR': str(tmp_path / 'qs')}
    out = _run(env, timeout=1800)
    table = parse_table(out)
    check_table(table)
    check_restore(parse_restore(out), table)
    activate = out.strip().splitlines()[-1]
    assert activate == f'source {venv}/bin/activate', activate
    # what the user does next: activate, find the command and the package, run one test file
    # (run_tests.sh adds the test extras to the same environment)
    script = (f'{activate} && cd / && lmdeploy --version && python3 -c "import lmdeploy" && cd {ROOT} '
              '&& bash scripts/run_tests.sh tests/test_prefill_plan.py')
    clean = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
    proc = subprocess.run(['bash', '-c', script], env=dict(clean, LMDEPLOY_VENV=str(venv)), capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _only_file_ran(proc.stdout, 'tests/test_prefill_plan.py')


def _only_file_ran(output: str, path: str) -> bool:
    """pytest -q's summary says tests passed and every listed duration is in ``path``."""
    passed = re.search(r'(\d+) passed', output)
    files = set(re.findall(r'(tests/[\w/]+\.py)::', output))
    return passed is not None and int(passed.group(1)) > 0 and files <= {path}


def test_run_tests_runs_just_the_paths_and_options_it_is_given():
    env = dict(os.environ, PYTHONPATH=ROOT)
    one = subprocess.run(['bash', 'scripts/run_tests.sh', 'tests/test_prefill_plan.py', '--collect-only'],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    ids = [line for line in one.stdout.splitlines() if '::' in line]
    assert ids and all(i.startswith('tests/test_prefill_plan.py::') for i in ids), ids[:5]
    node = ids[0]
    k = subprocess.run(['bash', 'scripts/run_tests.sh', node, '--collect-only'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert [line for line in k.stdout.splitlines() if '::' in line] == [node], k.stdout[-2000:]
    # options alone still apply to the whole suite (the default target, tests/); the ignore globs
    # are options too, and spare importing every test module just to find this one
    opt = subprocess.run(['bash', 'scripts/run_tests.sh', '-k', 'parse_table', '--collect-only',
                          '--ignore-glob=*/test_[!q]*.py', '--ignore-glob=*/test_q[!u]*.py'],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ids = [line for line in opt.stdout.splitlines() if '::' in line]
    assert 'tests/test_quickstart.py::test_parse_table_reads_the_printed_rows' in ids, opt.stdout[-2000:]


def _run_tests_header(*args, workers=None):
    """The session header pytest prints (-v against the script's -q) when ``scripts/run_tests.sh`` runs the one
    ``parse_table`` test through the whole-suite target (options only)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop('LMDEPLOY_TEST_WORKERS', None)
    if workers is not None:
        env['LMDEPLOY_TEST_WORKERS'] = workers
    run = subprocess.run(['bash', 'scripts/run_tests.sh', '-v', '-k', 'parse_table_reads',
                          '--ignore-glob=*/test_[!q]*.py', '--ignore-glob=*/test_q[!u]*.py', *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(r'\b1 passed\b', run.stdout), run.stdout[-2000:]
    return run.stdout


def test_run_tests_spreads_the_whole_suite_over_workers_unless_told_not_to():
    """The whole suite runs in min(CPUs, 4) pytest-xdist workers, a file per worker at a time;
    LMDEPLOY_TEST_WORKERS sets the count, and a run given its own -n or ``-p no:xdist`` keeps
    it (here: one process)."""
    expected = min(os.cpu_count() if not hasattr(os, 'sched_getaffinity') else len(os.sched_getaffinity(0)), 4)
    out = _run_tests_header()
    sessions = out.count('test session starts')
    if expected > 1:
        # the workers' run, then the `timing` tests' run in one process (none selected here)
        assert f'created: {expected}/{expected} workers' in out and sessions == 2, out[-2000:]
        assert re.search(r'\d+ deselected in', out.rstrip().splitlines()[-1]), out[-2000:]
    else:
        assert 'workers' not in out and sessions == 1, out[-2000:]
    if expected != 2:
        assert 'created: 2/2 workers' in _run_tests_header(workers='2')
    for workers, args in [('1', ()), ('3', ('-p', 'no:xdist')), ('3', ('-m', 'not timing'))]:
        out = _run_tests_header(*args, workers=workers)
        assert 'workers' not in out and out.count('test session starts') == 1, (workers, args, out[-2000:])
    bad = subprocess.run(['bash', 'scripts/run_tests.sh', '-k', 'nothing'], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, LMDEPLOY_TEST_WORKERS='two'),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "LMDEPLOY_TEST_WORKERS must be a count of processes, got 'two'" in bad.stderr


@pytest.mark.parametrize('script', ['scripts/quickstart.sh', 'scripts/run_tests.sh', '.ci/run'])
def test_no_ldconfig_pipe_into_grep_q_under_pipefail(script):
    """``ldconfig -p | grep -q`` under pipefail fails when grep exits before ldconfig has written
    everything (SIGPIPE): an apt-get (and a sudo prompt) for nothing, now and then."""
    with open(os.path.join(ROOT, script)) as f:
        text = f.read()
    assert 'set -euo pipefail' in text
    assert not re.search(r'ldconfig[^\n|]*\|\s*grep\s+-q', text)


def test_parse_table_reads_the_printed_rows():
    text = ('==> x\nturn   TTFT s  prompt tokens  cached tokens  Store bytes\n'
            '   1    0.208            326              0        98816\n'
            '   2    0.062            606            320        82432\n\n==> done\n')
    assert parse_table(text) == [
        {'turn': 1, 'ttft': 0.208, 'prompt_tokens': 326, 'cached_tokens': 0, 'store_bytes': 98816},
        {'turn': 2, 'ttft': 0.062, 'prompt_tokens': 606, 'cached_tokens': 320, 'store_bytes': 82432}]


def test_parse_restore_reads_the_fresh_servers_row():
    text = ('restore   TTFT s  prompt tokens  cached tokens  Store hit tokens\n'
            ' turn 6    0.255           1733           1408              1408\nStore hit tokens: ...\n')
    assert parse_restore(text) == {'ttft': 0.255, 'prompt_tokens': 1733, 'cached_tokens': 1408,
                                   'store_hit_tokens': 1408}


def test_the_tests_that_bound_a_latency_are_marked_timing():
    """The tests asserting a tight wall-clock bound (100 ms to a few seconds on a server or a
    stuck call) carry the ``timing`` mark, which scripts/run_tests.sh
    runs after the parallel run with nothing beside them (a probe under 100 ms missed its bound by
    2 ms with another worker's test on the second core)."""
    files = ['tests/test_api_agent.py', 'tests/test_large_body.py', 'tests/test_server_shutdown.py',
             'tests/test_mooncake_store.py', 'tests/test_store_write_path.py']
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '--collect-only', '-m',
                          'timing', *files], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=300)
    ids = sorted(line.split('::')[1] for line in run.stdout.splitlines() if '::' in line)
    assert ids == ['test_a_full_queue_drops_the_save_counts_it_and_a_later_save_puts_it',
                   'test_breaker_stays_open_for_a_master_that_accepts_tcp_but_never_answers',
                   'test_health_answers_within_100_ms_during_4_mb_bodies',
                   'test_issue_big_requests_do_not_freeze_the_server',
                   'test_sigterm_with_the_embedded_store_exits_within_the_grace_plus_two_seconds'], run.stdout[-2000:]
