"""``lmdeploy serve fleet``: two tiny Qwen3-Next replicas on one ``file:`` Store behind the real
router (smg), started with the one command, against a single api_server as the reference.

- greedy replies through the fleet equal the single engine's, turn by turn;
- the replica serving a conversation is SIGKILLed while it decodes the next turn: the router
  retries that request on the other replica, which answers with the single engine's reply after
  restoring the conversation's prefix from the Store (exact Store hit tokens and exact payload
  bytes read);
- SIGTERM stops the router, the replicas and the Store the fleet made (ports free, folder gone);
- the flags passed on to replicas parse back to the same values; bad fleet arguments are refused.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request

import pytest
from api_server_helpers import HYBRID, SYSTEM_A, TURNS, chat, conversation, metrics
from server_utils import REPO_ROOT, ApiServer, free_port

from lmdeploy.serve.fleet import find_router

FLAGS = (*HYBRID, '--enable-prefix-caching', '--prefill-save-last-only')


def _have_smg() -> bool:
    try:
        find_router('smg')
    except ValueError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _have_smg(), reason='smg is not installed: pip install -e ".[fleet]"')


class _Fleet:
    """``python -m lmdeploy.cli.entrypoint serve fleet`` as a subprocess (router and replica ports fixed)."""

    def __init__(self, model_path: str, replicas: int):
        self.model_path, self.api_key = model_path, None
        self.port = free_port()
        self.replica_ports = [free_port() for _ in range(replicas)]
        self.log = tempfile.NamedTemporaryFile('w+', prefix='fleet_', suffix='.log', delete=False)
        cmd = [sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'serve', 'fleet', model_path,
               '--replicas', str(replicas), '--server-name', '127.0.0.1', '--server-port', str(self.port),
               '--replica-ports', *map(str, self.replica_ports), '--log-level', 'WARNING', *FLAGS]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get('PYTHONPATH')])),
                   PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')]))
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    @property
    def base_url(self) -> str:
        return f'http://127.0.0.1:{self.port}'

    def replica(self, i: int):
        return types.SimpleNamespace(base_url=f'http://127.0.0.1:{self.replica_ports[i]}', api_key=None,
                                     model_path=self.model_path)

    def output(self) -> str:
        with open(self.log.name, errors='replace') as f:
            return f.read()

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if 'fleet ready' in self.output():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f'the fleet did not start:\n{self.output()[-4000:]}')

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope='module')
def servers(tiny_qwen3_next):
    """(fleet of 2 replicas, single api_server without a Store), started together."""
    fleet = _Fleet(tiny_qwen3_next, 2)
    single = ApiServer(tiny_qwen3_next, *FLAGS).launch()
    try:
        single.wait_ready()
        fleet.wait_ready()
        yield fleet, single
    finally:
        single.stop()
        fleet.stop()
        os.unlink(fleet.log.name)


def _served(fleet: _Fleet, name: str = 'lmdeploy_prompt_tokens_total') -> list[float]:
    return [metrics(fleet.replica(i)).get(name, 0.0) for i in range(len(fleet.replica_ports))]


LONG = 300     # tokens of the reply in flight when its replica is killed (about a second of decode)


def _messages(got) -> list[dict]:
    messages = [{'role': 'system', 'content': SYSTEM_A}]
    for turn, (reply, _, _) in zip(TURNS, got):
        messages += [{'role': 'user', 'content': turn}, {'role': 'assistant', 'content': reply}]
    return messages + [{'role': 'user', 'content': TURNS[len(got)]}]


def _long_turn(server, messages) -> tuple[str, int, int]:
    r = chat(server, messages, max_tokens=LONG, extra_body={'ignore_eos': True})
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def test_fleet_greedy_equals_single_and_survives_a_killed_replica(servers):
    fleet, single = servers
    reference = conversation(single, SYSTEM_A, TURNS[:3])
    reference_long = _long_turn(single, _messages(reference))
    before = _served(fleet)
    got = conversation(fleet, SYSTEM_A, TURNS[:3])
    assert got == reference           # replies, prompt tokens and cached tokens, turn by turn
    served = [a - b for a, b in zip(_served(fleet), before)]
    # the whole conversation stayed on one replica (conversation affinity), which reused its prefix
    assert sorted(served) == [0, sum(r[1] for r in got)]
    assert got[0][2] == 0 and got[1][2] > 0 and got[2][2] > 0
    owner = served.index(max(served))
    owner_url = fleet.replica(owner).base_url
    _wait_store_idle(owner_url)
    m = metrics(fleet.replica(owner))
    # every state object and every KV block object has one payload size (bytes)
    state_bytes, kv_block_bytes = (m[f'lmdeploy_store_put_bytes_total{{kind="{k}"}}']
                                   / m[f'lmdeploy_store_put_objects_total{{kind="{k}"}}'] for k in ('state', 'kv'))
    survivor = fleet.replica(1 - owner)
    m0 = metrics(survivor)

    # turn 4 (non-streaming) goes to the owner, which is SIGKILLed while it decodes: the router
    # retries the request on the survivor, which restores the conversation's deepest saved prefix
    # from the Store (one state object and every KV block below it: its cache was empty)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault('r', _long_turn(fleet, _messages(got))))
    worker.start()
    deadline = time.monotonic() + 60
    while metrics(fleet.replica(owner)).get('lmdeploy_requests_running', 0) < 1:
        assert time.monotonic() < deadline and worker.is_alive(), 'turn 4 never ran on its replica'
        time.sleep(0.01)
    os.kill(_pid_on(fleet.replica_ports[owner]), signal.SIGKILL)
    worker.join(120)
    reply, prompt_tokens, hit = result['r']
    assert (reply, prompt_tokens) == reference_long[:2]
    m1 = metrics(survivor)
    assert m1['lmdeploy_prompt_tokens_total'] - m0['lmdeploy_prompt_tokens_total'] == prompt_tokens
    assert hit > 0 and hit % 64 == 0
    assert m1['lmdeploy_store_hit_tokens_total'] - m0['lmdeploy_store_hit_tokens_total'] == hit
    assert m1['lmdeploy_store_get_bytes_total'] - m0['lmdeploy_store_get_bytes_total'] == \
        state_bytes + hit // 16 * kv_block_bytes
    # later requests (the conversation from its start again) reach the survivor directly
    again = conversation(fleet, SYSTEM_A, TURNS[:3])
    assert [r[:2] for r in again] == [r[:2] for r in reference]


def _wait_store_idle(url: str, timeout: float = 30) -> None:
    import json
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + '/debug/ledger', timeout=10) as r:
            if not json.loads(r.read())['store_inflight']:
                return
        time.sleep(0.05)
    raise AssertionError('Store saves still in flight')


def _pid_on(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:``port`` (from /proc/net/tcp and /proc/*/fd)."""
    inodes = set()
    with open('/proc/net/tcp') as f:
        for line in list(f)[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == '0A' and int(local.split(':')[1], 16) == port:
                inodes.add(inode)
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            for fd in os.listdir(f'/proc/{pid}/fd'):
                link = os.readlink(f'/proc/{pid}/fd/{fd}')
                if re.fullmatch(r'socket:\[(\d+)\]', link) and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    raise LookupError(f'no process listens on port {port}')


def test_sigterm_stops_router_replicas_and_store(servers):
    fleet, _ = servers
    store = re.search(r'file Store in (\S+)/objects', fleet.output()).group(1)
    logs = re.search(r'logs in (\S+)', fleet.output()).group(1)
    assert os.path.isdir(store) and os.path.isdir(logs)
    assert fleet.stop() == 0
    out = fleet.output()
    assert 'fleet stopped' in out
    assert not os.path.exists(store)
    # a replica died (the kill test), so the logs are kept, the death reported once
    assert os.path.isdir(logs) and out.count('exited with code -9') == 1
    shutil.rmtree(logs)
    from lmdeploy.pytorch.store.services import port_in_use
    assert not any(port_in_use('127.0.0.1', p) for p in [fleet.port, *fleet.replica_ports])
    with pytest.raises(OSError):
        urllib.request.urlopen(fleet.base_url + '/health', timeout=2)


# the command line -----------------------------------------------------------------------------------
def _fleet_parser():
    from lmdeploy.cli.entrypoint import build_parser
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices['serve']
    return parser, next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction)).choices['fleet']


@pytest.mark.parametrize('flags', [
    [],
    ['--enable-prefix-caching', '--no-prefill-save-last-only', '--block-size', '16', '--cache-bytes', '123456'],
    ['--model-name', 'a', 'b', '--api-keys', 'k1', 'k2', '--log-level', 'warning', '--max-request-bytes', '7'],
    ['--speculative-config', '{"method": "ngram", "num_speculative_tokens": 3}', '--speculative-ngram-max', '4',
     '--store-backend', 'file:/tmp/x', '--store-timeout-s', '1.5', '--allowed-media-domains', 'Example.COM'],
])
def test_replica_flags_parse_back_to_the_same_values(flags):
    from lmdeploy.cli.fleet import FLEET_DESTS, replica_flags
    parser, fleet = _fleet_parser()
    args = parser.parse_args(['serve', 'fleet', 'M', '--replicas', '3', '--router-policy', 'round_robin',
                              '--server-port', '9000', *flags])
    forwarded = replica_flags(args, fleet)
    again = parser.parse_args(['serve', 'api_server', 'M', *forwarded])
    keep = {k: v for k, v in vars(args).items() if k not in FLEET_DESTS}
    assert keep == {k: v for k, v in vars(again).items() if k not in FLEET_DESTS}
    assert not {'--replicas', '--router-policy', '--server-port'} & set(forwarded)


def test_bad_fleet_arguments_are_refused(tiny_qwen3_next):
    from lmdeploy.cli.entrypoint import main
    from lmdeploy.serve.fleet import Fleet
    with pytest.raises(SystemExit) as exit_:
        main(['serve', 'fleet', tiny_qwen3_next, '--replicas', '0'])
    assert exit_.value.code == 2
    with pytest.raises(ValueError, match='router_policy: smg takes cache_aware'):
        Fleet(tiny_qwen3_next, [], replicas=2, port=free_port(), router='smg', policy='sticky')
    with pytest.raises(ValueError, match='router must be one of'):
        Fleet(tiny_qwen3_next, [], replicas=2, port=free_port(), router='nginx')
    import socket
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f'server_port: 127.0.0.1:{port} is already in use'):
            Fleet(tiny_qwen3_next, [], replicas=1, port=port)
        # refused before the fleet makes its Store folder (it used to be left behind)
        made = set(os.listdir(tempfile.gettempdir()))
        with pytest.raises(SystemExit) as exit_:
            main(['serve', 'fleet', tiny_qwen3_next, '--server-port', str(port)])
        assert exit_.value.code == 2
        assert {d for d in os.listdir(tempfile.gettempdir()) if d.startswith('lmdeploy-fleet')} <= made


def test_a_fleet_log_dir_that_cannot_be_a_folder_is_refused_naming_it(tmp_path, capsys):
    """A --fleet-log-dir that is a file, or lies under one, is a one-line error (it was a
    FileExistsError traceback once replicas were being started); nothing is created."""
    from lmdeploy.cli.entrypoint import main
    a_file = tmp_path / 'f'
    a_file.write_text('')
    for log_dir, says in [(a_file, 'exists and is not a directory'),
                          (a_file / 'sub' / 'x', f"cannot be created: '{a_file}' is not a directory")]:
        with pytest.raises(SystemExit) as exit_:
            main(['serve', 'fleet', str(tmp_path / 'model'), '--replicas', '1', '--server-name', '127.0.0.1',
                  '--server-port', '0', '--fleet-log-dir', str(log_dir)])
        assert exit_.value.code == 2
        assert capsys.readouterr().err == f"lmdeploy: error: fleet_log_dir (--fleet-log-dir) '{log_dir}' {says}\n"
    assert sorted(os.listdir(tmp_path)) == ['f']
