"""Large request bodies are decoded off the event loop, in slices (issue 31, item 8): ``/health``
keeps answering while a 4 MB token-id body is processed; the sliced decoder equals
``json.loads`` on every input (property test, tiny slices so every shape gets cut)."""
import json
import subprocess
import sys
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmdeploy.serve.openai.large_body import decode_json
from server_utils import ApiServer

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='[]0123456789, -\u0000ids:x"\\'),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    | st.lists(st.integers(-10**9, 10**9), min_size=0, max_size=60), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=_json, indent=st.sampled_from([None, 0, 1]), slice_bytes=st.integers(1, 16))
def test_sliced_decoding_equals_json_loads(value, indent, slice_bytes):
    body = json.dumps(value, indent=indent).encode()
    assert decode_json(body, slice_bytes) == json.loads(body)
    # a number array written out as text is still text
    text = json.dumps({'s': json.dumps(value)}).encode()
    assert decode_json(text, slice_bytes) == json.loads(text)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=80) | st.text(alphabet='[]0123456789, -\n\tx', max_size=80).map(str.encode),
       min_bytes=st.integers(1, 8), window=st.integers(1, 8))
def test_sliced_array_scan_finds_what_the_regex_finds(body, min_bytes, window):
    import re
    from lmdeploy.serve.openai.large_body import _int_arrays
    expected = [m.span() for m in re.finditer(rb'\[[0-9\s,\-]{%d,}\]' % min_bytes, body)]
    assert list(_int_arrays(body, min_bytes, window)) == expected


_POLLER = """
import sys, time, urllib.request
url, stop_after = sys.argv[1], float(sys.argv[2])
end = time.monotonic() + stop_after
while time.monotonic() < end:
    start = time.time()
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
    print(start, time.time() - start, flush=True)
    time.sleep(0.01)
"""


def _post(url: str, body: bytes) -> tuple[float, float]:
    """Send one body; returns (start, end) wall times. The prompt exceeds the session: 400."""
    req = urllib.request.Request(url, data=body, headers={'Content-Type': 'application/json'})
    started = time.time()
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except urllib.error.HTTPError as err:       # over the session length: 400, after the work
        assert err.code == 400 and b'session_len' in err.read()
    return started, time.time()


@pytest.mark.timing
def test_health_answers_within_100_ms_during_4_mb_bodies(tiny_qwen3):
    """``/health`` stays under 100 ms (p99) while the server receives, decodes, validates and
    frees token-id bodies of 4.9 MB (1.2M ids): one, then three bursts of two at once; and stays
    responsive while a 3.9 MB text body (2.7M tokens) is tokenized and freed. Before: the ids
    were visited on the event loop by a validator (~80 ms each), worker threads kept the GIL
    5 ms at a time against the loop, and the text's encoding (with offsets) took 0.17 s to free
    holding the GIL: p99 190-300 ms for the ids bursts, max 0.57-0.64 s for text bodies
    (benchmark/health_during_large_bodies.py). The poller runs in its own process, so the
    client's GIL does not count."""
    ids = [(i * 7919) % 1000 + 3 for i in range(1_200_000)]
    words = ['alpha', 'beta', 'gamma', 'delta', 'kappa', 'omega', 'sigma', 'theta']
    text = ' '.join(words[(i * 7) % len(words)] for i in range(4_000_000 // 6))
    with ApiServer(tiny_qwen3, '--device-type', 'cpu', '--num-gpu-blocks', '64') as server:
        model = server.get('/v1/models')[1]['data'][0]['id']
        url = server.base_url + '/v1/completions'
        id_body = json.dumps({'model': model, 'prompt': ids, 'max_tokens': 1}).encode()
        text_body = json.dumps({'model': model, 'prompt': text, 'max_tokens': 1}).encode()
        assert len(id_body) > 4_000_000 and len(text_body) > 3_900_000
        poller = subprocess.Popen([sys.executable, '-c', _POLLER, server.base_url + '/health', '1000'],
                                  stdout=subprocess.PIPE)
        time.sleep(1.0)
        id_windows = [_post(url, id_body)]
        with ThreadPoolExecutor(2) as pool:         # two at once, three times
            for _ in range(3):
                spans = list(pool.map(lambda b: _post(url, b), [id_body, id_body]))
                id_windows.append((min(s for s, _ in spans), max(e for _, e in spans)))
                time.sleep(0.2)
        text_window = _post(url, text_body)
        time.sleep(0.3)
        poller.terminate()
        out = poller.communicate(timeout=60)[0].decode()
    polls = [tuple(map(float, line.split())) for line in out.splitlines() if len(line.split()) == 2]

    def during(windows):    # the polls that overlap a request (upload, decoding, validation, answer, freeing)
        return sorted(d for t, d in polls if any(t + d >= a and t <= b + 0.2 for a, b in windows))
    id_polls, text_polls = during(id_windows), during([text_window])
    p99 = id_polls[min(len(id_polls) - 1, round(0.99 * (len(id_polls) - 1)))]
    print(f'/health during token-id bodies ({sum(b - a for a, b in id_windows):.2f} s): {len(id_polls)} polls, '
          f'p50 {id_polls[len(id_polls) // 2] * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, '
          f'max {id_polls[-1] * 1000:.0f} ms; during the text body ({text_window[1] - text_window[0]:.2f} s): '
          f'{len(text_polls)} polls, max {text_polls[-1] * 1000:.0f} ms')
    assert len(id_polls) >= 40 and len(text_polls) >= 10, (len(id_polls), len(text_polls))
    assert all(b - a < 20 for a, b in id_windows + [text_window])
    # The goal, 100 ms, bounds the p99 (the 2nd slowest of ~100 polls: one stall of the machine
    # rather than of the server passes). The text body's maximum is bounded at 0.4 s, not 0.1 s:
    # on this 2-core machine shared with other jobs (load average 4-7), 5 of 10 runs had one poll
    # of 120-302 ms (the others: max 16-70 ms), each time a single stall while the Rust tokenizer
    # ran with the GIL released; the same decode / validate / tokenize / free path run in one
    # process beside a 2 ms ticker thread left it at most 16 ms behind, so these are threads
    # waiting for a core, not for the event loop.
    assert p99 <= 0.100, id_polls[-5:]
    assert text_polls[-1] <= 0.400, text_polls[-5:]


@settings(max_examples=100, deadline=None)
@given(prompt=st.one_of(st.lists(st.integers(-5, 10**6), min_size=1, max_size=80),
                        st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=40), min_size=1, max_size=3),
                        st.lists(st.text(max_size=3), min_size=1, max_size=3), st.text(max_size=5)))
def test_validating_the_sliced_decoding_equals_validating_json_loads(prompt):
    """The pass-through of decoded integer arrays changes no accepted value and no prompt."""
    from lmdeploy.serve.openai.protocol import CompletionRequest
    body = json.dumps({'model': 'm', 'prompt': prompt}).encode()
    fast = CompletionRequest.model_validate(decode_json(body, 4))
    plain = CompletionRequest.model_validate(json.loads(body))
    assert fast.prompts() == plain.prompts() and fast.model_dump() == plain.model_dump()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | st.lists(st.sampled_from(['<|im_start|>', '<|im_end|>', ' alpha', 'beta ', '\n\n',
                                                               '  ', 'é', '中文', '12345', "'s", '\t']),
                                             max_size=30).map(''.join))
def test_the_fast_batch_encoding_gives_the_same_ids(text, tiny_qwen3_tokenizer):
    """Pipeline.tokenize prefers ``encode_batch_fast`` (no offsets, cheap to free): same ids."""
    backend = tiny_qwen3_tokenizer.backend_tokenizer
    fast = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
    assert fast == backend.encode_batch([text], add_special_tokens=False)[0].ids
    assert fast == tiny_qwen3_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope='module')
def tiny_qwen3_tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen3)
