"""The README's first command, end to end: tiny hybrid model, api_server with prefix caching,
last-only checkpoints and the embedded Store, a 5-turn OpenAI conversation, and the table.

The default run uses the current environment (``LMDEPLOY_SKIP_INSTALL=1``); with
``LMDEPLOY_TEST_QUICKSTART_FULL=1`` (set by .ci/run) the script also builds its own virtual
environment from scratch, exactly as a new user runs it.
"""
import os
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


def test_quickstart_prints_cached_tokens_and_store_bytes_per_turn():
    check_table(parse_table(_run({'LMDEPLOY_SKIP_INSTALL': '1'}, timeout=600)))


@pytest.mark.skipif(os.environ.get('LMDEPLOY_TEST_QUICKSTART_FULL') != '1',
                    reason='full install run only in CI (.ci/run sets LMDEPLOY_TEST_QUICKSTART_FULL=1)')
def test_quickstart_from_a_fresh_virtual_environment(tmp_path):
    out = _run({'LMDEPLOY_VENV': str(tmp_path / 'venv')}, timeout=1800)
    check_table(parse_table(out))


def test_parse_table_reads_the_printed_rows():
    text = ('==> x\nturn   TTFT s  prompt tokens  cached tokens  Store bytes\n'
            '   1    0.208            326              0        98816\n'
            '   2    0.062            606            320        82432\n\n==> done\n')
    assert parse_table(text) == [
        {'turn': 1, 'ttft': 0.208, 'prompt_tokens': 326, 'cached_tokens': 0, 'store_bytes': 98816},
        {'turn': 2, 'ttft': 0.062, 'prompt_tokens': 606, 'cached_tokens': 320, 'store_bytes': 82432}]
