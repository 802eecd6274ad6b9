"""The README's "Agent CLIs" section, run as written: the server command (through
tests/scripted_server.py, the same CLI with a sampler scripted to answer "Hello.", so that the
random tiny model's replies end), then the Codex CLI and the Claude Code command lines.

Opt-in (``LMDEPLOY_TEST_AGENT_CLIS=1``): about a minute on 2 shared cores (57 s measured, most
of it the prefill of Claude Code's ~48K-token first prompt), plus about 30 s when the CLIs have
to be installed from npm (650 MB). They are taken from
``$AGENT_CLIENTS_PREFIX`` or ``.agent-clients/`` (where scripts/agent_clients.sh installs them),
else installed into a temporary prefix when the npm registry answers; skipped otherwise.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from server_utils import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('@openai/codex', '@anthropic-ai/claude-code')

pytestmark = pytest.mark.skipif(os.environ.get('LMDEPLOY_TEST_AGENT_CLIS') != '1',
                                reason='drives the npm agent CLIs (about a minute): set LMDEPLOY_TEST_AGENT_CLIS=1')


def readme_agent_commands() -> list[str]:
    """The bash blocks of the README's "Agent CLIs" section, continuation lines joined and
    ``npm install`` lines dropped: [server, codex, claude]."""
    text = open(os.path.join(REPO_ROOT, 'README.md')).read()
    section = text.split('\n## Agent CLIs\n', 1)[1].split('\n## ', 1)[0]
    blocks = re.findall(r'```bash\n(.*?)```', section, flags=re.S)
    commands = []
    for block in blocks:
        lines = [line for line in block.replace('\\\n', ' ').splitlines() if line.strip()]
        commands.append(' '.join(line for line in lines if not line.startswith('npm install')))
    return commands


def _clients_bin(tmp_root: str) -> str:
    """A node_modules/.bin holding codex and claude (see the module docstring); skips without."""
    for prefix in (os.environ.get('AGENT_CLIENTS_PREFIX'), os.path.join(REPO_ROOT, '.agent-clients')):
        if prefix and all(os.access(os.path.join(prefix, 'node_modules', '.bin', b), os.X_OK)
                          for b in ('codex', 'claude')):
            return os.path.join(prefix, 'node_modules', '.bin')
    if shutil.which('npm') is None:
        pytest.skip('npm is not installed')
    probe = subprocess.run(['npm', 'view', PACKAGES[0], 'version'], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f'the npm registry does not answer: {probe.stderr.strip()[-200:]}')
    prefix = os.path.join(tmp_root, 'npm')
    done = subprocess.run(['npm', 'install', '--prefix', prefix, '--no-fund', '--no-audit', *PACKAGES],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return os.path.join(prefix, 'node_modules', '.bin')


def test_readme_agent_cli_commands_work_as_written(tiny_qwen3, tmp_path):
    server_cmd, codex_cmd, claude_cmd = readme_agent_commands()
    assert server_cmd.startswith('lmdeploy serve api_server /path/to/model ') and '23333' in server_cmd
    assert codex_cmd.startswith('LMDEPLOY_API_KEY=none codex exec ')
    assert claude_cmd.startswith('ANTHROPIC_BASE_URL=http://127.0.0.1:23333 ') and ' claude -p ' in claude_cmd
    bin_dir = _clients_bin(str(tmp_path))
    port = str(free_port())
    argv = [a.replace('23333', port) for a in shlex.split(server_cmd)]
    argv[argv.index('/path/to/model')] = tiny_qwen3
    log = open(tmp_path / 'server.log', 'w+')
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, LMDEPLOY_TEST_SCRIPT=json.dumps([{'reply': 'Hello.'}]))
    server = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, 'tests', 'scripted_server.py'), *argv[1:]],
                              env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            try:
                with urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        work = tmp_path / 'work'
        work.mkdir()
        client_env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ['PATH'], HOME=str(tmp_path / 'home'),
                          CODEX_HOME=str(tmp_path / 'codex-home'), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC='1',
                          DISABLE_AUTOUPDATER='1', DISABLE_TELEMETRY='1')
        for folder in (client_env['HOME'], client_env['CODEX_HOME']):
            os.makedirs(folder)
        for name, cmd in (('codex', codex_cmd), ('claude', claude_cmd)):
            done = subprocess.run(['bash', '-c', cmd.replace('23333', port)], cwd=work, env=client_env,
                                  capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
            assert done.returncode == 0, (name, done.stdout[-2000:], done.stderr[-3000:])
            assert 'Hello.' in done.stdout, (name, done.stdout[-2000:])
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    served = open(log.name).read()
    assert ' 404 ' not in served and ' 400 ' not in served, served[-3000:]
