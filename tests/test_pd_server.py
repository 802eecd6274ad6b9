"""Prefill/decode disaggregation over HTTP, driven by ``vllm-router --vllm-pd-disaggregation``.

A ``--role prefill`` and a ``--role decode`` server share a ``file:`` Store; the router sends each
request to the prefill server (``max_tokens`` 1, ``kv_transfer_params``), then to the decode server
with the ``kv_transfer_params`` the prefill server answered. Shown:

- the router's replies (completions and chat) equal a colocated server's (``--role both``), and the decode server
  restores exactly n - 1 prompt tokens (``usage.prompt_tokens_details.cached_tokens`` when asked
  directly);
- the prefill server killed in the middle of a hand-off (its hand-off put hangs, then SIGKILL):
  the client gets an HTTP error, never a reply; the decode server, given the prompt anyway,
  computes it (no hand-off to restore) and answers what colocated serving answers.

Servers use B = 16, A = 64, P = 128 (tests/api_server_helpers.py ``HYBRID``).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from api_server_helpers import HYBRID
from server_utils import ApiServer, free_port, http_json

ROUTER = shutil.which('vllm-router')
pytestmark = pytest.mark.skipif(ROUTER is None, reason='vllm-router is not installed (requirements/test.txt)')
LAUNCHER = [sys.executable, str(Path(__file__).with_name('pd_prefill_launcher.py'))]
MODEL = ''     # the served model name (the fixture asks the server)
PROMPTS = ['The river runs past the old mill and the town where the ledgers of salt and wool are kept by ' * 3,
           'Copper, glass, paper and tea came in on the ships that the harbour master counted each spring ' * 2]


@pytest.fixture(scope='module')
def pd(tiny_qwen3_next, tmp_path_factory):
    folder = tmp_path_factory.mktemp('pd')
    store = ('--enable-prefix-caching', '--store-backend', f'file:{folder / "store"}')
    env = {'PD_BLOCK_HANDOFF': str(folder / 'block'), 'PD_HANDOFF_STARTED': str(folder / 'started')}
    prefill = ApiServer(tiny_qwen3_next, *HYBRID, *store, '--role', 'prefill', launcher=LAUNCHER, env=env)
    decode = ApiServer(tiny_qwen3_next, *HYBRID, *store, '--role', 'decode')
    both = ApiServer(tiny_qwen3_next, *HYBRID)
    servers = [prefill, decode, both]
    router = None
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        port = free_port()
        router = subprocess.Popen([ROUTER, '--vllm-pd-disaggregation', '--prefill', prefill.base_url, '--decode',
                                   decode.base_url, '--host', '127.0.0.1', '--port', str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f'http://127.0.0.1:{port}'
        deadline = time.monotonic() + 60
        while not _up(url + '/health'):
            assert time.monotonic() < deadline and router.poll() is None, 'vllm-router did not start'
            time.sleep(0.2)
        global MODEL
        MODEL = both.get('/v1/models')[1]['data'][0]['id']
        yield dict(prefill=prefill, decode=decode, both=both, router=url, folder=folder)
    finally:
        if router is not None:
            router.kill()
            router.wait()
        for s in servers:
            s.stop()


def _up(url: str) -> bool:
    try:
        return http_json(url, timeout=5)[0] == 200
    except OSError:
        return False


def _complete(base_url: str, prompt: str, timeout: float = 120) -> tuple[int, dict | str]:
    return http_json(base_url + '/v1/completions', dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0),
                     timeout=timeout)


def test_the_router_drives_prefill_then_decode_and_answers_as_colocated(pd):
    for prompt in PROMPTS:
        status, routed = _complete(pd['router'], prompt)
        assert status == 200, routed
        status, colocated = _complete(pd['both'].base_url, prompt)
        assert status == 200 and routed['choices'][0]['text'] == colocated['choices'][0]['text']
    chat = dict(model=MODEL, messages=[{'role': 'user', 'content': PROMPTS[1]}], max_tokens=6, temperature=0)
    status, routed = http_json(pd['router'] + '/v1/chat/completions', chat)
    assert status == 200, routed
    status, colocated = pd['both'].post('/v1/chat/completions', chat)
    assert status == 200 and routed['choices'][0]['message'] == colocated['choices'][0]['message']
    # asked directly: the prefill server answers the hand-off, the decode server restores n - 1 tokens
    prompt = PROMPTS[0] + 'and more.'
    status, handed = pd['prefill'].post('/v1/completions', dict(model=MODEL, prompt=prompt, max_tokens=6))
    assert status == 200 and handed['choices'][0]['finish_reason'] == 'handoff'
    assert handed['choices'][0]['text'] == '' and handed['usage']['completion_tokens'] == 0
    (key, ) = handed['kv_transfer_params']['handoff_ids']
    assert '/handoff/' in key
    status, decoded = pd['decode'].post('/v1/completions', dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                                kv_transfer_params=handed['kv_transfer_params']))
    n = decoded['usage']['prompt_tokens']
    assert status == 200 and decoded['usage']['prompt_tokens_details']['cached_tokens'] == n - 1
    assert decoded['choices'][0]['text'] == _complete(pd['both'].base_url, prompt)[1]['choices'][0]['text']
    # a one-token prompt has nothing to hand off: answered at once, no key
    status, one = pd['prefill'].post('/v1/completions', dict(model=MODEL, prompt=[5], max_tokens=6))
    assert status == 200 and one['choices'][0]['finish_reason'] == 'handoff'
    assert one['kv_transfer_params'] == {'handoff_ids': [None]}


def test_killing_the_prefill_server_mid_handoff_is_an_error_never_a_wrong_answer(pd):
    folder, prefill = pd['folder'], pd['prefill']
    (folder / 'block').touch()
    prompt = PROMPTS[1] + 'and then the mill.'
    result = {}
    client = threading.Thread(target=lambda: result.update(reply=_complete(pd['router'], prompt, timeout=60)))
    client.start()
    deadline = time.monotonic() + 60
    while not (folder / 'started').exists():         # the prefill server is inside its hand-off put
        assert time.monotonic() < deadline and client.is_alive(), result
        time.sleep(0.05)
    os.kill(prefill.proc.pid, signal.SIGKILL)
    client.join(60)
    status, body = result['reply']
    assert status >= 500, body                        # an error, not a reply
    # the decode server given the prompt anyway: no hand-off to restore, the colocated answer
    status, decoded = _complete(pd['decode'].base_url, prompt)
    n = decoded['usage']['prompt_tokens']
    assert status == 200 and decoded['usage']['prompt_tokens_details']['cached_tokens'] < n - 1
    assert decoded['choices'][0]['text'] == _complete(pd['both'].base_url, prompt)[1]['choices'][0]['text']
