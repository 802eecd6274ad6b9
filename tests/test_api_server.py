"""The OpenAI-compatible server, end to end: real `lmdeploy serve api_server` processes on
127.0.0.1 and the real `openai` client.

Four servers start together (their model loads overlap):
  qwen3  tiny Qwen3, an API key, --model-name tiny, session_len 4096
  off    tiny Qwen3-Next (hybrid), prefix caching off       — the reference outputs
  cache  tiny Qwen3-Next, --enable-prefix-caching
  last   tiny Qwen3-Next, --enable-prefix-caching --prefill-save-last-only
Hybrid servers use B=16, A=64, P=128 so a few-hundred-token conversation crosses boundaries.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest
from server_utils import ApiServer, running
from api_server_helpers import (ALIGN, BAD_REQUESTS, HYBRID, KEY, MSG, SYSTEM_A, SYSTEM_B, TURNS, chat, client,
                                conversation, is_idle, metrics, model_name, raw_post, shared_head)

from lmdeploy.pytorch.paging.prefill_plan import plan_prefill, shared_head_boundary


@pytest.fixture(scope='module')
def servers(tiny_qwen3, tiny_qwen3_next):
    procs = {
        'qwen3': ApiServer(tiny_qwen3, '--session-len', '4096', '--model-name', 'tiny', api_key=KEY),
        'off': ApiServer(tiny_qwen3_next, *HYBRID),
        'cache': ApiServer(tiny_qwen3_next, *HYBRID, '--enable-prefix-caching'),
        'last': ApiServer(tiny_qwen3_next, *HYBRID, '--enable-prefix-caching', '--prefill-save-last-only'),
    }
    with running(procs):
        yield procs


# basic endpoints ----------------------------------------------------------------------------------------
def test_models_health_and_auth(servers):
    s = servers['qwen3']
    models = client(s).models.list()
    assert [m.id for m in models.data] == ['tiny']
    assert s.get('/v1/models')[1]['data'][0]['max_model_len'] == 4096
    with httpx.Client() as c:
        assert c.get(s.base_url + '/health').status_code == 200          # no key needed
        r = c.get(s.base_url + '/v1/models')
        assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key'
        # without a key nothing else is answered: no route probing (404/405), no size limit (413),
        # no validation (400); with the key the same requests get their own status
        big = json.dumps({'model': 'tiny', 'prompt': 'x' * (17 << 20)})
        probes = [('GET', '/v1/nonexistent', None, 404), ('GET', '/v1/chat/completions', None, 405),
                  ('POST', '/v1/completions', big, 413), ('POST', '/v1/completions', '{"model": 5}', 400),
                  ('GET', '/debug/ledger', None, 200), ('GET', '/openapi.json', None, 200)]
        for method, path, body, with_key in probes:
            r = c.request(method, s.base_url + path, content=body, headers={'Content-Type': 'application/json'})
            assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key', (path, r.text[:200])
            r = c.request(method, s.base_url + path, content=body,
                          headers={'Content-Type': 'application/json', **s.auth})
            assert r.status_code == with_key, (path, r.text[:200])
        assert c.get(s.base_url + '/nonexistent').status_code == 404     # outside the protected paths


def test_stream_equals_non_stream_chat(servers):
    s = servers['qwen3']
    messages = [{'role': 'user', 'content': 'Tell me about the river town.'}]
    full = chat(s, messages, max_tokens=12)
    chunks = list(chat(s, messages, max_tokens=12, stream=True, stream_options={'include_usage': True}))
    text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == 'length'
    # the raw event stream ends with the [DONE] sentinel
    with httpx.Client(timeout=60) as c:
        raw = c.post(s.base_url + '/v1/chat/completions', headers=s.auth,
                     json={'model': 'tiny', 'messages': messages, 'max_tokens': 3, 'stream': True}).text
    events = [e for e in raw.split('\n\n') if e]
    assert events[-1] == 'data: [DONE]' and all(e.startswith('data: ') for e in events)


def test_completions_prompt_forms(servers):
    s = servers['qwen3']
    c = client(s)
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    batch = c.completions.create(model='tiny', prompt=ids, max_tokens=5)
    singles = [c.completions.create(model='tiny', prompt=p, max_tokens=5) for p in ids]
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert [ch.text for ch in batch.choices] == [r.choices[0].text for r in singles]
    assert batch.usage.prompt_tokens == 7 and batch.usage.completion_tokens == 10
    text = c.completions.create(model='tiny', prompt='The river town', max_tokens=4)
    texts = c.completions.create(model='tiny', prompt=['The river town', 'The river town'], max_tokens=4)
    assert [ch.text for ch in texts.choices] == [text.choices[0].text] * 2
    stream = c.completions.create(model='tiny', prompt=ids[0], max_tokens=5, stream=True)
    assert ''.join(ch.choices[0].text for ch in stream) == singles[0].choices[0].text


def test_n2_greedy_gives_identical_choices(servers):
    s = servers['qwen3']
    messages = [{'role': 'user', 'content': 'Count the gulls.'}]
    one = chat(s, messages, max_tokens=6)
    two = chat(s, messages, max_tokens=6, n=2)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert [ch.message.content for ch in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage.prompt_tokens == one.usage.prompt_tokens          # the prompt counts once
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_stop_string_cuts_the_reply(servers):
    s = servers['qwen3']
    messages = [{'role': 'user', 'content': 'Name the goods in the ledger.'}]
    full = chat(s, messages, max_tokens=12).choices[0].message.content
    stop = full[4:7]
    cut = chat(s, messages, max_tokens=12, stop=[stop, 'never-in-output']).choices[0]
    assert cut.message.content == full[:full.find(stop)] and cut.finish_reason == 'stop'


def test_a_stop_string_ends_the_reply_on_the_token_completing_it(servers):
    """The engine checks stop strings itself: completion_tokens counts exactly the tokens up to
    the one completing the stop string, blocking and streaming (the server used to end the
    request when its own detokenizer saw the match, 2-3 tokens later)."""
    s = servers['qwen3']
    messages = [{'role': 'user', 'content': 'Describe the harbour at dawn.'}]
    full = chat(s, messages, max_tokens=24, logprobs=True, extra_body={'ignore_eos': True}).choices[0]
    pieces = [bytes(t.bytes) for t in full.logprobs.content]
    text = b''.join(pieces).decode('utf-8', 'replace')
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if '\ufffd' not in text[i:i + 3]
                and text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    done = next(m for m in range(1, len(pieces) + 1) if stop in b''.join(pieces[:m]).decode('utf-8', 'ignore'))
    kw = dict(max_tokens=24, stop=[stop], extra_body={'ignore_eos': True})
    cut = chat(s, messages, **kw)
    assert (cut.choices[0].finish_reason, cut.usage.completion_tokens) == ('stop', done)
    events = list(client(s).chat.completions.create(model=model_name(s), messages=messages, stream=True,
                                                    stream_options={'include_usage': True}, **kw))
    assert ''.join(e.choices[0].delta.content or '' for e in events if e.choices) == cut.choices[0].message.content
    assert events[-1].usage.completion_tokens == done


def test_seeded_sampling_is_reproducible(servers):
    s = servers['qwen3']
    messages = [{'role': 'user', 'content': 'Pick any words.'}]
    kw = dict(max_tokens=10, temperature=1.0, seed=7, n=2, extra_body={'top_k': 50})
    first, second = chat(s, messages, **kw), chat(s, messages, **kw)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert texts[0] != texts[1]                                     # choice j samples with seed + j
    assert texts[0] != chat(s, messages, max_tokens=10).choices[0].message.content     # not greedy


def test_sixteen_concurrent_streams_equal_alone(servers):
    s = servers['qwen3']
    prompts = [[{'role': 'user', 'content': f'Question {i}: what did ship {i} carry?'}] for i in range(16)]
    alone = [chat(s, p, max_tokens=8).choices[0].message.content for p in prompts]

    async def run_all():
        c = openai.AsyncOpenAI(base_url=s.base_url + '/v1', api_key=KEY, max_retries=0, timeout=120)

        async def one(p):
            stream = await c.chat.completions.create(model='tiny', messages=p, max_tokens=8, stream=True)
            return ''.join([ch.choices[0].delta.content or '' async for ch in stream if ch.choices])
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await c.close()
    assert asyncio.run(run_all()) == alone
    assert len(set(alone)) > 1                   # the prompts really differ


@pytest.mark.parametrize('name,path,body,headers,status,param', BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(servers, name, path, body, headers, status, param):
    s = servers['qwen3']
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, resp = raw_post(s, path, raw, {**s.auth, **(headers or {})})
    assert code == status, resp
    err = resp['error']
    assert set(err) == {'message', 'type', 'param', 'code'} and err['message']
    assert err['type'] == 'invalid_request_error'
    assert err['param'] == param
    if status == 400 and param:
        assert err['code'] == 'invalid_value', err
        assert err['message'].startswith(param.split('.')[0]), err      # the message names its field
    if name in ('malformed json', 'body not UTF-8', 'body nested too deeply'):
        assert err['code'] == 'invalid_json' and err['message'].startswith('malformed JSON body'), err
    if name == 'empty token-id list':
        assert 'message' not in err['message'], err
    if name == 'trailing slash':
        assert '/v1/chat/completions/' in err['message'], err
    if name == 'image part to a text model':
        assert err['message'].startswith('messages[0].content[1]: '), err
    if name == 'prompt too long':
        assert '4100' in err['message'] and '4096' in err['message']
    if name in ('token id >= vocab', 'negative token id', 'prompt too long'):
        assert err['message'].startswith('prompt: '), err   # the message names its field too
    if name == 'token id >= vocab':
        assert '1024' in err['message']


def test_null_means_the_default_and_echo_and_model_retrieval(servers, tiny_qwen3):
    """Explicit nulls (sent by SDKs and proxies) behave as the omitted field; completions'
    ``max_tokens: null`` is its default 16; ``echo`` puts the prompt first (plain and streamed);
    ``GET /v1/models/{id}`` returns the card or a 404 naming the model."""
    s = servers['qwen3']
    c = client(s)
    nulls = {k: None for k in ('top_p', 'n', 'stream', 'logprobs', 'parallel_tool_calls', 'presence_penalty',
                               'frequency_penalty', 'top_k', 'repetition_penalty', 'ignore_eos', 'temperature',
                               'stop', 'seed', 'max_completion_tokens', 'tools', 'tool_choice', 'stream_options',
                               'separate_reasoning', 'response_format')}
    plain = raw_post(s, '/v1/chat/completions', json.dumps({'model': 'tiny', 'messages': MSG, 'max_tokens': 6}).encode(),
                     s.auth)
    code, resp = raw_post(s, '/v1/chat/completions',
                          json.dumps({'model': 'tiny', 'messages': MSG, 'max_tokens': 6, **nulls}).encode(), s.auth)
    assert code == 200 == plain[0], resp
    assert resp['choices'][0]['message']['content'] == plain[1]['choices'][0]['message']['content']
    code, resp = raw_post(s, '/v1/completions', json.dumps({'model': 'tiny', 'prompt': 'hi', 'max_tokens': None,
                                                            'ignore_eos': True, 'top_p': None, 'n': None,
                                                            'stream': None}).encode(), s.auth)
    assert code == 200 and resp['usage']['completion_tokens'] == 16, resp
    # echo
    want = c.completions.create(model='tiny', prompt='Once upon a time', max_tokens=4).choices[0].text
    got = c.completions.create(model='tiny', prompt='Once upon a time', max_tokens=4, echo=True, n=2, best_of=2)
    assert [ch.text for ch in got.choices] == ['Once upon a time' + want] * 2
    streamed = ''.join(ch.choices[0].text for ch in c.completions.create(
        model='tiny', prompt='Once upon a time', max_tokens=4, echo=True, stream=True) if ch.choices)
    assert streamed == 'Once upon a time' + want
    from transformers import AutoTokenizer
    prompt_text = AutoTokenizer.from_pretrained(tiny_qwen3).decode([300, 301, 302])
    want = c.completions.create(model='tiny', prompt=[300, 301, 302], max_tokens=2).choices[0].text
    got = c.completions.create(model='tiny', prompt=[300, 301, 302], max_tokens=2, echo=True).choices[0].text
    assert prompt_text and got == prompt_text + want
    # retrieval
    card = c.models.retrieve('tiny')
    assert card.id == 'tiny' and card.object == 'model'
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve('gpt-9')
    assert err.value.body['param'] == 'model' and 'gpt-9' in err.value.body['message']


def test_server_serves_normally_after_bad_requests(servers):
    s = servers['qwen3']
    before = metrics(s)
    for _ in range(3):
        raw_post(s, '/v1/chat/completions', b'{nope', s.auth)
    r = chat(s, MSG, max_tokens=4)
    assert r.choices[0].finish_reason == 'length' and r.usage.completion_tokens == 4
    after = metrics(s)
    key = 'lmdeploy_http_requests_total{path="/v1/chat/completions",status="400"}'
    assert after[key] - before.get(key, 0) == 3


def test_presence_and_frequency_penalties_reach_the_sampler(servers, tiny_qwen3):
    """The API's presence / frequency penalties give the engine's penalised greedy tokens."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    s = servers['qwen3']
    c = openai.OpenAI(base_url=s.base_url + '/v1', api_key=KEY)
    prompt = [300, 301, 302, 303, 304]
    eng = Engine(tiny_qwen3, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=32,
                                                 block_size=16))
    texts = {}
    for presence, frequency in ((0.0, 0.0), (-1.0, -0.5), (-2.0, 1.0)):
        r = c.completions.create(model='tiny', prompt=prompt, max_tokens=12, presence_penalty=presence,
                                 frequency_penalty=frequency, extra_body={'ignore_eos': True})
        want = eng.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True, presence_penalty=presence,
                                                     frequency_penalty=frequency))
        assert r.usage.completion_tokens == len(want.output_ids) == 12
        from transformers import AutoTokenizer
        assert r.choices[0].text == AutoTokenizer.from_pretrained(tiny_qwen3).decode(want.output_ids,
                                                                                     skip_special_tokens=True)
        texts[(presence, frequency)] = r.choices[0].text
    assert len(set(texts.values())) == 3           # each setting changes the reply


def test_logit_bias_forces_a_token_and_bad_entries_are_400s(servers):
    s = servers['qwen3']
    c = openai.OpenAI(base_url=s.base_url + '/v1', api_key=KEY)
    r = c.chat.completions.create(model='tiny', messages=MSG, max_tokens=5, logit_bias={'77': 100},
                                  extra_body={'ignore_eos': True}, logprobs=True)
    assert [lp.token for lp in r.choices[0].logprobs.content] == [r.choices[0].logprobs.content[0].token] * 5
    assert r.usage.completion_tokens == 5
    for bias, words in (({'99999999': 1}, 'outside the vocabulary'), ({'abc': 1}, 'decimal strings'),
                        ({'5': 101}, 'less than or equal to 100'), ({'-3': 1}, 'decimal strings')):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model='tiny', messages=MSG, max_tokens=2, logit_bias=bias)
        assert err.value.body['param'].startswith('logit_bias') and words in err.value.body['message'], err.value.body
    assert chat(s, MSG, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize('content_type', [None, 'text/plain', 'application/x-www-form-urlencoded', 'text/json',
                                          'application/jsonp'])
def test_a_json_body_without_a_json_content_type_says_so(servers, content_type):
    s = servers['qwen3']
    body = json.dumps({'model': model_name(s), 'messages': MSG, 'max_tokens': 1}).encode()
    headers = dict(s.auth)
    if content_type:
        headers['Content-Type'] = content_type
    with httpx.Client(timeout=60) as c:
        r = c.post(s.base_url + '/v1/chat/completions', content=body, headers=headers)
    err = r.json()['error']
    assert r.status_code == 400 and err['code'] == 'invalid_content_type', err
    assert 'Content-Type: application/json' in err['message'] and (content_type or 'no Content-Type') in err['message']
    assert chat(s, MSG, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize('content_type', ['application/json; charset=utf-8', 'application/vnd.api+json'])
def test_json_media_types_with_parameters_or_a_suffix_are_read_as_json(servers, content_type):
    s = servers['qwen3']
    body = json.dumps({'model': model_name(s), 'messages': MSG, 'max_tokens': 1}).encode()
    with httpx.Client(timeout=60) as c:
        r = c.post(s.base_url + '/v1/chat/completions', content=body, headers={**s.auth, 'Content-Type': content_type})
    assert r.status_code == 200, r.text


def test_http_metrics_label_one_models_path_and_the_docs(servers):
    s = servers['qwen3']
    before = metrics(s)
    with httpx.Client(timeout=60, headers=s.auth) as c:
        for path in (f'/v1/models/{model_name(s)}', '/v1/models/other/model', '/openapi.json', '/no/such/path'):
            c.get(s.base_url + path)
    after = metrics(s)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)
    assert delta('lmdeploy_http_requests_total{path="/v1/models/{model}",status="200"}') == 1
    assert delta('lmdeploy_http_requests_total{path="/v1/models/{model}",status="404"}') == 1
    assert delta('lmdeploy_http_requests_total{path="/openapi.json",status="200"}') == 1
    assert delta('lmdeploy_http_requests_total{path="other",status="404"}') == 1


# client disconnect --------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['qwen3', 'cache'])
def test_closed_stream_frees_resources(servers, name):
    s = servers[name]
    max_tokens = 3900 if name == 'qwen3' else 1900       # far more than a few seconds of decoding
    body = {'model': model_name(s), 'max_tokens': max_tokens, 'ignore_eos': True, 'stream': True,
            'messages': [{'role': 'user', 'content': 'Describe every ledger in the library, slowly. ' * 4}]}
    before = metrics(s)
    with httpx.Client(timeout=60) as c:
        with c.stream('POST', s.base_url + '/v1/chat/completions', json=body, headers=s.auth) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert sum(line.startswith('data: {') for line in got) >= 4
            busy = s.get('/debug/ledger')[1]
            assert not is_idle(busy)              # the request holds blocks (and a slot when hybrid)
    closed = time.monotonic()
    while not is_idle(s.get('/debug/ledger')[1]):
        assert time.monotonic() - closed < 3, 'request not aborted after the client left'
        time.sleep(0.05)
    after = metrics(s)
    abort = 'lmdeploy_requests_finished_total{finish_reason="abort"}'
    assert after[abort] - before.get(abort, 0) == 1
    assert after['lmdeploy_requests_running'] == 0
    assert after['lmdeploy_generation_tokens_total'] - before['lmdeploy_generation_tokens_total'] < max_tokens


def test_client_leaving_a_non_streaming_request_frees_resources(servers):
    s = servers['qwen3']
    body = {'model': 'tiny', 'max_tokens': 4000, 'ignore_eos': True, 'prompt': [5, 6, 7]}
    before = metrics(s)
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as c:
            c.post(s.base_url + '/v1/completions', json=body, headers=s.auth)
    left = time.monotonic()
    while not is_idle(s.get('/debug/ledger')[1]):
        assert time.monotonic() - left < 3, 'request not aborted after the client left'
        time.sleep(0.05)
    after = metrics(s)
    abort = 'lmdeploy_requests_finished_total{finish_reason="abort"}'
    assert after[abort] - before.get(abort, 0) == 1
    assert after['lmdeploy_generation_tokens_total'] - before['lmdeploy_generation_tokens_total'] < 4000


# hybrid prefix caching through the server ---------------------------------------------------------------
@pytest.fixture(scope='module')
def reference_conversation(servers):
    return conversation(servers['off'], SYSTEM_A)


@pytest.mark.parametrize('name', ['cache', 'last'])
def test_hybrid_five_turns_cached_and_equal(servers, reference_conversation, name):
    turns = conversation(servers[name], SYSTEM_A)
    assert [t[0] for t in turns] == [t[0] for t in reference_conversation]
    assert [t[1] for t in turns] == [t[1] for t in reference_conversation]
    assert all(t[2] == 0 for t in reference_conversation)
    assert turns[0][1] > 5 * ALIGN and turns[0][2] == 0
    # turn k restores the last aligned boundary of turn k-1's prompt (the last token is never cached)
    expected = [0] + [(n - 1) // ALIGN * ALIGN for _, n, _ in turns[:-1]]
    assert [t[2] for t in turns] == expected


def test_metrics_move_with_the_conversation(servers):
    s = servers['cache']
    before = metrics(s)
    turns = conversation(s, SYSTEM_B, turns=TURNS[:2])
    after = metrics(s)

    def delta(key):
        return after[key] - before.get(key, 0)
    (_, n1, c1), (_, n2, c2) = turns
    assert delta('lmdeploy_prefix_cache_queried_tokens_total') == n1 + n2
    assert delta('lmdeploy_prefix_cache_hit_tokens_total') == c1 + c2 and c2 > 0
    # default policy: the save points of each turn's plan (docs/en/advance/prefix_caching.md "Save policies"),
    # the system prompt's end (the shared head) among them
    head = shared_head(s, [{'role': 'system', 'content': SYSTEM_B}, {'role': 'user', 'content': TURNS[0]}])
    saves = sum(len(plan_prefill(n, c, 128, 16, ALIGN, False, shared_head_tokens=head).save_points)
                for n, c in ((n1, c1), (n2, c2)))
    assert saves >= 3
    assert delta('lmdeploy_checkpoints_saved_total') == saves
    assert delta('lmdeploy_time_to_first_token_seconds_count') == 2
    assert delta('lmdeploy_time_per_output_token_seconds_count') == 2
    assert delta('lmdeploy_requests_finished_total{finish_reason="length"}') == 2
    assert delta('lmdeploy_http_requests_total{path="/v1/chat/completions",status="200"}') == 2
    for series in ('lmdeploy_checkpoints_skipped_total{reason="no_free_slot"}', 'lmdeploy_state_miss_tokens_total',
                   'lmdeploy_store_put_bytes_total{kind="state"}', 'lmdeploy_store_put_bytes_total{kind="kv"}',
                   'lmdeploy_store_put_objects_total{kind="state"}', 'lmdeploy_store_put_objects_total{kind="kv"}',
                   'lmdeploy_store_put_failures_total', 'lmdeploy_store_get_failures_total',
                   'lmdeploy_store_hit_tokens_total'):
        assert series in after and delta(series) >= 0
    assert after['lmdeploy_store_put_bytes_total{kind="kv"}'] == 0       # this server has no Store


def test_a_second_agent_session_restores_the_system_prompt_and_tools_with_last_only(servers):
    """Two sessions of one agent: the same long system prompt and tool definitions, different
    first user messages (each longer than A, so the first session's last-only checkpoint lies past
    the point where they diverge). The second restores the head's last multiple of A, with the
    output of caching off."""
    system = 'You are a coding agent working in a repository of river-town ledgers. ' * 8
    tools = [{'type': 'function', 'function': {
        'name': f'tool_{name}', 'description': f'{name.capitalize()} files in the repository, carefully.',
        'parameters': {'type': 'object', 'properties': {'path': {'type': 'string'}}, 'required': ['path']}}}
        for name in ('read', 'edit', 'grep', 'glob', 'write', 'list')]
    sessions = [[{'role': 'system', 'content': system}, {'role': 'user', 'content': task * 6}]
                for task in ('Fix the failing ledger test. ', 'Explain how the salt ledger is kept. ')]
    replies = {name: [chat(servers[name], m, max_tokens=4, tools=tools) for m in sessions] for name in ('off', 'last')}
    head = shared_head(servers['last'], sessions[0], tools)
    assert head == shared_head(servers['last'], sessions[1], tools) and head > 5 * ALIGN
    n = replies['last'][1].usage.prompt_tokens
    boundary = shared_head_boundary(head, n, 16, ALIGN)
    assert boundary == head // ALIGN * ALIGN
    assert [r.usage.prompt_tokens_details.cached_tokens for r in replies['last']] == [0, boundary]
    assert [r.choices[0].message.content for r in replies['last']] == \
        [r.choices[0].message.content for r in replies['off']]


def _documented_series(path: str) -> set[str]:
    """Series names in the first column of the Metrics table of a docs page."""
    import re
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)).read()
    return set(re.findall(r'^\| `(lmdeploy_[a-z_]+)`', text, re.M))


def test_every_exported_series_is_in_the_docs_metrics_table(servers):
    """Each family /metrics exports (prefix caching on, hybrid model: state slots and checkpoints;
    Store and speculative-decoding counters are exported at 0 when off) has a row in the
    Metrics table of docs/en and docs/zh_cn (counters under their ``_total`` name)."""
    with httpx.Client() as c:
        text = c.get(servers['cache'].base_url + '/metrics').text
    exported = set()
    for line in text.splitlines():
        if line.startswith('# TYPE '):
            _, _, family, kind = line.split()
            if family.endswith('_created'):       # prometheus_client's creation timestamps
                continue
            exported.add(family + '_total' if kind == 'counter' and not family.endswith('_total') else family)
    assert {'lmdeploy_kv_blocks_in_use', 'lmdeploy_scheduler_requests_running',
            'lmdeploy_spec_decode_accepted_tokens_total', 'lmdeploy_requests_running'} <= exported
    for page in ('docs/en/api_server.md', 'docs/zh_cn/api_server.md'):
        documented = _documented_series(page)
        assert exported - documented == set(), page
        assert documented - exported == set(), page          # no stale rows either
