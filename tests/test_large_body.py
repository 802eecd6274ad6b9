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


def test_health_answers_within_100_ms_during_4_mb_bodies(tiny_qwen3):
    """``/health`` stays under 100 ms while the server receives, decodes, validates, tokenizes
    and frees 4 MB bodies: one token-id body (1.2M ids), two at once, and one text body (2.7M
    tokens). Before: the ids were visited on the event loop by a validator (~80 ms each), the
    text's encoding with offsets took 0.17 s to free holding the GIL, and the worker threads kept
    the GIL 5 ms at a time against the loop: max 0.42 s (ids, two at once) and 0.64 s (text)
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
        windows = [_post(url, id_body)]
        with ThreadPoolExecutor(2) as pool:         # two at once
            spans = list(pool.map(lambda b: _post(url, b), [id_body, id_body]))
        windows.append((min(s for s, _ in spans), max(e for _, e in spans)))
        windows.append(_post(url, text_body))
        time.sleep(0.3)
        poller.terminate()
        out = poller.communicate(timeout=60)[0].decode()
    polls = [tuple(map(float, line.split())) for line in out.splitlines() if len(line.split()) == 2]
    # the polls that overlap a request (its upload, decoding, validation, answer and freeing)
    latencies = sorted(d for t, d in polls if any(t + d >= a and t <= b + 0.2 for a, b in windows))
    busy = sum(b - a for a, b in windows)
    print(f'/health during {busy:.2f} s of 4 MB bodies: {len(latencies)} polls, p50 '
          f'{latencies[len(latencies) // 2] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms')
    for name, (a, b) in zip(('ids', 'ids x2', 'text'), windows):
        inside = [d for t, d in polls if t + d >= a and t <= b + 0.2]
        slow = [(round(t - a, 2), round(d * 1000)) for t, d in polls if t + d >= a and t <= b + 0.2 and d > 0.05]
        print(f'  {name}: {b - a:.2f} s, {len(inside)} polls, max {max(inside) * 1000:.0f} ms; over 50 ms at '
              f'(s after the send, ms): {slow}')
    assert len(latencies) >= 10 and all(b - a < 20 for a, b in windows), windows
    assert latencies[-1] <= 0.100, latencies[-5:]


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
