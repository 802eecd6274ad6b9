"""A real ``lmdeploy serve api_server`` with the embedded Mooncake Store, stopped by SIGTERM while
a request is still generating (issue 31, item 6): it exits within the grace
(``--shutdown-timeout``) + 2 s — the Store's helper processes are stopped together, not one
after another, and the interpreter's final teardown is skipped — and leaves nothing in the
temporary folder (first-hour item: logs live under the cache root)."""
import os
import signal
import threading
import time

import pytest

from server_utils import ApiServer

pytestmark = pytest.mark.skipif(not __import__('importlib').util.find_spec('mooncake'),
                                reason='needs mooncake-transfer-engine (requirements/store.txt)')

GRACE = 2.0


@pytest.mark.timing
def test_sigterm_with_the_embedded_store_exits_within_the_grace_plus_two_seconds(tiny_qwen3_next, tmp_path):
    tmp = tmp_path / 'tmp'
    tmp.mkdir()
    server = ApiServer(tiny_qwen3_next, '--device-type', 'cpu', '--enable-prefix-caching', '--mooncake-master',
                       'local', '--num-gpu-blocks', '160', '--session-len', '10000',
                       '--shutdown-timeout', str(GRACE), env={'TMPDIR': str(tmp)})
    with server:
        model = server.get('/v1/models')[1]['data'][0]['id']
        answers = []

        def long_request():     # still generating when the signal comes, and when the grace ends
            answers.append(server.post('/v1/completions', {'model': model, 'prompt': 'once upon a time',
                                                           'max_tokens': 9000, 'ignore_eos': True}, timeout=120))
        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(1.0)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        took = time.monotonic() - signalled
        client.join(60)
        log = server.log()
    print(f"exit {took:.2f} s after SIGTERM (grace {GRACE} s)")
    assert answers and answers[0][0] == 503, (answers, log[-3000:])      # ended by the deadline
    assert server.proc.returncode == 128 + signal.SIGTERM
    assert GRACE <= took <= GRACE + 2.0, (took, log[-3000:])
    # a clean stop leaves the temporary folder as it found it: the Store's service logs went with
    # it, the Mooncake client log and torch's compiler cache live under the cache root
    assert os.listdir(tmp) == [], os.listdir(tmp)
    assert '/logs/mooncake-' in log and str(tmp) not in log, log[-3000:]
