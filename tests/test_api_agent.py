"""An agent client against the OpenAI API: tools, tool-call history, reasoning, logprobs,
request limits, strict validation and graceful shutdown.

Servers (tiny hybrid Qwen3-Next with a Qwen3-style tools + thinking template, quick-start
geometry B=16, A=64 so a short agent conversation crosses checkpoint boundaries), all started
through tests/scripted_server.py, whose sampler is forced to scripted replies for chosen
turns (the model's own greedy reply otherwise), so the random tiny model emits tool calls:
  off    prefix caching off (the reference), --max-request-bytes 6000000
  cache  --enable-prefix-caching
  last   --enable-prefix-caching --prefill-save-last-only
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from server_utils import ApiServer, running
from agent_script import (BROKEN, CALL, CALL_LS, CALL_REPLIES, COMPACT_ARGS, MAX_BYTES, RESULTS, TOOLS, UNICODE,
                          _raw_chunks, _stream_message, agent_loop, client, name, post, scripted, template_len,
                          thinking_model)

from lmdeploy.serve.openai.tool_parser import get_tool_parser


@pytest.fixture(scope='module')
def servers(thinking_model):
    procs = {'off': scripted(thinking_model, '--max-request-bytes', str(MAX_BYTES)),
             'cache': scripted(thinking_model, '--enable-prefix-caching'),
             'last': scripted(thinking_model, '--enable-prefix-caching', '--prefill-save-last-only')}
    with running(procs):
        yield procs


@pytest.fixture(scope='module')
def reference_loop(servers):
    return agent_loop(servers['off'])


def test_agent_loop_calls_tools_and_every_later_turn_hits_the_cache(servers, reference_loop):
    first, second, third = reference_loop
    assert first['tool_calls'] == [('ls', '{"path": "."}')] and first['finish_reason'] == 'tool_calls'
    assert first['content'] is None and first['reasoning_content'] is None
    assert second['tool_calls'] == [('read_file', '{"path": "a.txt"}')] and second['finish_reason'] == 'tool_calls'
    assert (second['reasoning_content'], second['content']) == ('The listing has a.txt; read it.', 'Let me read it.')
    assert third['tool_calls'] == [] and third['finish_reason'] in ('stop', 'length') and third['content']
    # the server renders the whole history (tool calls, tool results, developer) as the template does
    assert [t['prompt_tokens'] for t in reference_loop] == [t['prompt_len'] for t in reference_loop]
    assert all(t['cached'] == 0 for t in reference_loop)
    for name_ in ('cache', 'last'):
        turns = agent_loop(servers[name_])
        strip = [{k: v for k, v in t.items() if k not in ('cached', 'logprobs')} for t in turns]
        assert strip == [{k: v for k, v in t.items() if k not in ('cached', 'logprobs')} for t in reference_loop]
        assert turns[0]['cached'] == 0 and all(t['cached'] > 0 for t in turns[1:]), (name_, turns)
        # turn k+1 reuses the last aligned boundary of turn k's prompt (its prefix is identical)
        assert [t['cached'] for t in turns[1:]] == [(t['prompt_tokens'] - 1) // 64 * 64 for t in turns[:-1]]
        for got, want in zip(turns, reference_loop):
            assert [e['token'] for e in got['logprobs']] == [e['token'] for e in want['logprobs']]
            assert max((abs(a['logprob'] - b['logprob']) for a, b in zip(got['logprobs'], want['logprobs'])),
                       default=0) <= 1e-4


def test_streamed_agent_loop_reassembles_to_the_non_streamed_replies(servers, reference_loop):
    streamed = agent_loop(servers['cache'], stream=True)
    keys = ('content', 'reasoning_content', 'tool_calls', 'finish_reason', 'prompt_tokens')
    assert [{k: t[k] for k in keys} for t in streamed] == [{k: t[k] for k in keys} for t in reference_loop]
    assert [len(t['logprobs']) for t in streamed] == [len(t['logprobs']) for t in reference_loop]


def test_logprobs_are_real_values(servers, reference_loop):
    third = reference_loop[2]['logprobs']
    assert third and all(e['logprob'] <= 0 and len(e['top_logprobs']) == 2 for e in third)
    # greedy: the chosen token is the most likely one
    assert all(e['top_logprobs'][0]['token'] == e['token'] and
               abs(e['top_logprobs'][0]['logprob'] - e['logprob']) < 1e-6 for e in third)
    assert all(e['logprob'] == 0.0 for e in reference_loop[0]['logprobs'])    # forced tokens: probability 1
    c = client(servers['off']).completions.create(model='model', prompt=[5, 6, 7, 8], max_tokens=5, logprobs=3,
                                                  extra_body={'ignore_eos': True})
    lp = c.choices[0].logprobs
    assert ''.join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 5
    assert all(len(top) <= 3 and max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    # each token's offset: where its text starts in the choice's text (a lone byte shows U+FFFD)
    text = c.choices[0].text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_logprobs_bytes_rebuild_multibyte_text_streamed_and_not(servers):
    """``bytes`` are each token's raw UTF-8 bytes: joined, they are the reply's bytes even where a
    token holds part of a character (its ``token`` shows U+FFFD); top_logprobs likewise."""
    kw = dict(model='model', messages=[{'role': 'user', 'content': 'Please greet the world.'}], max_tokens=40,
              logprobs=True, top_logprobs=3)
    r = client(servers['off']).chat.completions.create(**kw)
    assert r.choices[0].message.content == UNICODE
    whole = [e.model_dump() for e in r.choices[0].logprobs.content]
    assert r.usage.completion_tokens == len(whole) + 1          # the EOS is generated (billed), not an entry
    fields, _, streamed = _stream_message(client(servers['off']).chat.completions.create(**kw, stream=True))
    assert fields['content'] == UNICODE
    for entries in (whole, streamed):
        assert b''.join(bytes(e['bytes']) for e in entries) == UNICODE.encode()
        assert any(e['token'] == '\ufffd' for e in entries)
        for e in entries:
            assert e['top_logprobs'][0]['token'] == e['token'] and e['top_logprobs'][0]['bytes'] == e['bytes']
            for t in [e] + e['top_logprobs']:
                assert bytes(t['bytes']).decode('utf-8', 'replace') == t['token'], t
    assert [e['bytes'] for e in streamed] == [e['bytes'] for e in whole]


@pytest.mark.parametrize('key', list(CALL_REPLIES))
def test_streamed_tool_calls_one_entry_per_index_and_equal_to_non_streamed(servers, key):
    s = servers['off']
    body = {'model': 'model', 'messages': [{'role': 'user', 'content': f'Now, {key}.'}], 'tools': TOOLS,
            'max_tokens': 200}
    code, whole = post(s, '/v1/chat/completions', body)
    assert code == 200
    message = whole['choices'][0]['message']
    calls = message['tool_calls']
    assert len(calls) == CALL_REPLIES[key].count('<tool_call>')
    merged, content = {}, ''
    for chunk in _raw_chunks(s, body):
        for choice in chunk['choices']:
            content += choice['delta'].get('content') or ''
            frags = choice['delta'].get('tool_calls') or []
            assert len({f['index'] for f in frags}) == len(frags), chunk          # OpenAI: one entry per index
            for f in frags:
                m = merged.setdefault(f['index'], {'function': {'name': '', 'arguments': ''}})
                for field in ('id', 'type'):
                    if field in f:
                        assert field not in m
                        m[field] = f[field]
                m['function']['name'] += f['function'].get('name', '')
                m['function']['arguments'] += f['function'].get('arguments', '')
    assert sorted(merged) == list(range(len(calls)))
    for i, call in enumerate(calls):
        got = merged[i]
        assert got['id'].startswith('call_') and got['type'] == call['type'] == 'function'
        assert got['function'] == call['function']
    assert (content or None) == message['content']
    # the openai client's own stream accumulation
    with client(s).chat.completions.stream(model='model', messages=body['messages'], tools=TOOLS,
                                           max_tokens=200) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c['function']['name'], c['function']['arguments']) for c in calls]
    assert (final.message.content or None) == message['content'] and final.finish_reason == 'tool_calls'


@pytest.mark.parametrize('stream', [False, True], ids=['whole', 'stream'])
@pytest.mark.parametrize('key', ['two calls please', 'look then two please'])
def test_parallel_tool_calls_false_stops_generating_after_the_first_call(servers, thinking_model, key, stream):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    reply = CALL_REPLIES[key]
    ids = tok.encode(reply, add_special_tokens=False)
    first_end = reply.index('</tool_call>') + len('</tool_call>')
    upto = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k])) >= first_end)
    want = get_tool_parser('hermes').parse(reply)
    for parallel in (True, False):
        kw = dict(model='model', messages=[{'role': 'user', 'content': f'Now, {key}.'}], tools=TOOLS,
                  max_tokens=200, logprobs=True, parallel_tool_calls=parallel)
        if stream:
            chunks = list(client(servers['off']).chat.completions.create(
                **kw, stream=True, stream_options={'include_usage': True}))
            fields, reason, lps = _stream_message(chunks)
            usage, calls, content = chunks[-1].usage, fields['tool_calls'], fields['content']
        else:
            r = client(servers['off']).chat.completions.create(**kw)
            choice, usage = r.choices[0], r.usage
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            reason, lps, content = choice.finish_reason, choice.logprobs.content, choice.message.content
        assert reason == 'tool_calls' and content == want.content
        if parallel:
            assert calls == [(c.name, c.arguments) for c in want.calls] and len(calls) == 2
            assert usage.completion_tokens == len(ids) + 1 and len(lps) == len(ids)
        else:       # generation ended at the first call's closing tag: nothing after it was generated or billed
            assert calls == [(want.calls[0].name, want.calls[0].arguments)]
            assert usage.completion_tokens == upto == len(lps) < len(ids)


@pytest.fixture(scope='module')
def chatml_cache(tiny_qwen3):
    """Tiny full-attention Qwen3 with make-tiny-model's own chat template, prefix caching on."""
    server = scripted(tiny_qwen3, '--enable-prefix-caching')
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.mark.parametrize('ask, choice, call', [
    ('What is in a.txt?', 'auto', ('ls', '{"path": "."}')),
    ('A compact call please.', 'auto', ('ls', COMPACT_ARGS)),
    ('Read it.', {'type': 'function', 'function': {'name': 'read_file'}}, ('read_file', '{"path": "b.txt"}'))])
def test_next_turn_reuses_the_cached_tool_call_reply(chatml_cache, ask, choice, call):
    """The tool-call reply sent back as the server returned it (arguments a JSON string, content
    null) re-renders to the generated tokens, so turn 2 restores turn 1's prompt and reply. The
    arguments are the model's own text (here also compact, with an escape), not re-serialised;
    a named tool_choice's opening written by the server re-tokenizes the same way too."""
    messages = [{'role': 'user', 'content': ask}]
    first = client(chatml_cache).chat.completions.create(model=name(chatml_cache), messages=messages, tools=TOOLS,
                                                          max_tokens=100, tool_choice=choice)
    msg = first.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [call]
    messages.append({'role': 'assistant', 'content': msg.content, 'tool_calls': [c.model_dump() for c in
                                                                               msg.tool_calls]})
    messages.append({'role': 'tool', 'tool_call_id': msg.tool_calls[0].id, 'content': RESULTS['ls']})
    second = client(chatml_cache).chat.completions.create(model=name(chatml_cache), messages=messages, tools=TOOLS,
                                                           max_tokens=100)
    # KV exists for the prompt and every generated token but the final EOS (sampled, never fed)
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    block = 16
    assert computed // block * block > first.usage.prompt_tokens            # the reply spans a block boundary
    assert second.usage.prompt_tokens_details.cached_tokens == computed // block * block


def test_tool_choice_none_required_and_named(servers, thinking_model):
    s = servers['off']
    messages = [{'role': 'user', 'content': 'List the files.'}]
    none = client(s).chat.completions.create(model='model', messages=messages, tools=TOOLS, tool_choice='none',
                                             max_tokens=60)
    assert none.usage.prompt_tokens == template_len(thinking_model, messages)       # tools not rendered
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == CALL_LS
    assert none.choices[0].finish_reason == 'stop'
    required = client(s).chat.completions.create(model='model', messages=messages, tools=TOOLS,
                                                 tool_choice='required', max_tokens=60).choices[0]
    assert [(c.function.name, c.function.arguments) for c in required.message.tool_calls] == [('ls', '{"path": "/"}')]
    named = client(s).chat.completions.create(model='model', messages=messages, tools=TOOLS, max_tokens=60,
                                              tool_choice={'type': 'function', 'function': {'name': 'read_file'}})
    call = named.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ('read_file', {'path': 'b.txt'})
    assert named.choices[0].finish_reason == 'tool_calls' and call.id.startswith('call_')
    bad = client(s).with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match='not in tools'):
        bad.chat.completions.create(model='model', messages=messages, tools=TOOLS,
                                    tool_choice={'type': 'function', 'function': {'name': 'rm'}})


def test_malformed_tool_call_degrades_to_content(servers):
    messages = [{'role': 'user', 'content': 'Please break the call.'}]
    kw = dict(model='model', messages=messages, tools=TOOLS, max_tokens=60)
    r = client(servers['off']).chat.completions.create(**kw)
    assert r.choices[0].message.content == BROKEN and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == 'stop'
    fields, reason, _ = _stream_message(client(servers['off']).chat.completions.create(**kw, stream=True))
    assert (fields['content'], fields['tool_calls'], reason) == (BROKEN, [], 'stop')
    cut = client(servers['off']).chat.completions.create(**dict(kw, max_tokens=8)).choices[0]   # an unfinished call
    assert cut.finish_reason == 'length' and cut.message.tool_calls is None and cut.message.content.startswith('<')


def test_reasoning_split_thinking_switch_and_raw_mode(servers, thinking_model):
    s = servers['off']
    messages = [{'role': 'user', 'content': 'Please think aloud.'}]
    r = client(s).chat.completions.create(model='model', messages=messages, max_tokens=30).choices[0].message
    assert (r.reasoning_content, r.content) == ('hmm', 'Done.')
    raw = client(s).chat.completions.create(model='model', messages=messages, max_tokens=30,
                                            extra_body={'separate_reasoning': False}).choices[0].message
    assert raw.content == '<think>\nhmm\n</think>\n\nDone.' and getattr(raw, 'reasoning_content', None) is None
    fields, _, _ = _stream_message(client(s).chat.completions.create(model='model', messages=messages, max_tokens=30,
                                                                     stream=True))
    assert (fields['reasoning_content'], fields['content']) == ('hmm', 'Done.')
    plain = [{'role': 'user', 'content': 'Please answer plainly.'}]
    off = client(s).chat.completions.create(model='model', messages=plain, max_tokens=30,
                                            extra_body={'chat_template_kwargs': {'enable_thinking': False}})
    assert off.usage.prompt_tokens == template_len(thinking_model, plain, enable_thinking=False)
    assert off.usage.prompt_tokens > template_len(thinking_model, plain)      # the empty <think> block is in
    assert (getattr(off.choices[0].message, 'reasoning_content', None), off.choices[0].message.content) == \
        (None, 'Done.')


def test_issue_tool_call_history_is_rendered(servers, thinking_model):
    messages = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None, 'tool_calls': [CALL]},
                {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'a.txt'}]
    code, body = post(servers['off'], '/v1/chat/completions',
                      {'model': 'model', 'messages': messages, 'max_tokens': 1, 'tools': TOOLS})
    assert code == 200 and body['usage']['prompt_tokens'] == template_len(thinking_model, messages, TOOLS)


def test_issue_developer_role_acts_as_system(servers, thinking_model):
    dev = [{'role': 'developer', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    sys_ = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    a = client(servers['off']).chat.completions.create(model='model', messages=dev, max_tokens=4)
    b = client(servers['off']).chat.completions.create(model='model', messages=sys_, max_tokens=4)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == template_len(thinking_model, sys_)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.timing
def test_issue_big_requests_do_not_freeze_the_server(servers):
    s = servers['off']
    big = {'model': 'model', 'messages': [{'role': 'user', 'content': 'river town ' * 360_000}], 'max_tokens': 1}
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault('r', post(s, '/v1/chat/completions', big, 120)))
    thread.start()
    slowest, probes = 0.0, 0
    with httpx.Client(timeout=10) as c:
        time.sleep(0.5)                                  # the body is in; the worker thread is tokenizing
        while thread.is_alive():
            t = time.perf_counter()
            assert c.get(s.base_url + '/health').status_code == 200
            slowest = max(slowest, time.perf_counter() - t)
            probes += 1
            time.sleep(0.05)
    thread.join()
    code, body = result['r']
    assert code == 400 and body['error']['param'] == 'messages' and 'session_len=2048' in body['error']['message']
    assert slowest < 0.1 and probes >= 5, (slowest, probes)     # probed for the whole processing time
    # over the limit: 413 with an OpenAI body, before any parsing
    code, body = post(s, '/v1/chat/completions', b'{"model": "model", "messages": "' + b'x' * MAX_BYTES + b'"}')
    assert code == 413 and body['error']['code'] == 'request_too_large' and str(MAX_BYTES) in body['error']['message']
    assert 'lmdeploy_http_requests_total{path="/v1/chat/completions",status="413"} 1.0' in \
        httpx.get(s.base_url + '/metrics').text
    # 10,000 prompts are refused before any is tokenized
    t = time.perf_counter()
    code, body = post(s, '/v1/completions', {'model': 'model', 'prompt': ['river town ' * 40] * 10_000})
    assert code == 400 and body['error']['param'] == 'prompt' and '128' in body['error']['message']
    assert time.perf_counter() - t < 2


BAD_NUMBERS = [
    ('temperature', 1e308), ('temperature', 'Infinity'), ('repetition_penalty', 'Infinity'),
    ('repetition_penalty', 1e-300), ('top_k', 10 ** 12), ('max_tokens', 2 ** 70), ('top_p', 'NaN'),
    ('top_logprobs', 21), ('presence_penalty', 3), ('seed', 2 ** 64),
]


@pytest.mark.parametrize('field,value', BAD_NUMBERS, ids=[f'{f}={v}' for f, v in BAD_NUMBERS])
def test_issue_numbers_outside_their_range_are_refused(servers, field, value):
    body = {'model': 'model', 'messages': [{'role': 'user', 'content': 'hi'}], 'logprobs': True}
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'       # Infinity / NaN as raw JSON literals
    code, resp = post(servers['off'], '/v1/chat/completions', raw.encode())
    assert code == 400, resp
    assert resp['error']['param'] == field and resp['error']['type'] == 'invalid_request_error'


def test_issue_surrogates_max_tokens_clamp_and_openapi(servers):
    s = servers['off']
    raw = b'{"model": "model", "messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    code, resp = post(s, '/v1/chat/completions', raw)
    assert code == 400 and resp['error']['param'] == 'messages[0].content' and 'surrogate' in resp['error']['message']
    # max_tokens past the session is clamped to what the session has left: 2048 - 2040 = 8 tokens
    code, resp = post(s, '/v1/completions', {'model': 'model', 'prompt': [5] * 2040, 'max_tokens': 2 ** 31 - 1,
                                             'ignore_eos': True})
    assert code == 200 and resp['usage']['completion_tokens'] == 8 and resp['choices'][0]['finish_reason'] == 'length'
    schema = httpx.get(s.base_url + '/openapi.json').json()
    chat = schema['paths']['/v1/chat/completions']['post']['responses']
    assert '422' not in chat and {'200', '400', '401', '404', '413', '500', '503'} <= set(chat)
    assert chat['400']['content']['application/json']['schema']['$ref'].endswith('/ErrorBody')
    assert '422' not in json.dumps(schema['paths'])


def test_issue_sigterm_drains_then_ends_requests_cleanly(tiny_qwen3):
    server = ApiServer(tiny_qwen3, '--session-len', '4096', '--shutdown-timeout', '3', '--log-level', 'INFO').start()
    results, started = {}, {'long_stream': threading.Event(), 'short_stream': threading.Event()}
    body = {'model': name(server), 'max_tokens': 3900, 'ignore_eos': True,
            'messages': [{'role': 'user', 'content': 'Describe every ledger.'}]}
    try:
        def stream(key, max_tokens):
            with httpx.Client(timeout=60) as c:
                with c.stream('POST', server.base_url + '/v1/chat/completions',
                              json=dict(body, max_tokens=max_tokens, stream=True,
                                        stream_options={'include_usage': key == 'short_stream'})) as r:
                    results[key] = []
                    for line in r.iter_lines():
                        if line:
                            results[key].append(line)
                            if len(results[key]) == 2:         # a generated token arrived
                                started[key].set()

        def blocking():
            with httpx.Client(timeout=60) as c:
                r = c.post(server.base_url + '/v1/chat/completions', json=body)
            results['long'] = (r.status_code, r.headers['content-type'], r.json())
        threads = [threading.Thread(target=stream, args=('long_stream', 3900)), threading.Thread(target=blocking),
                   threading.Thread(target=stream, args=('short_stream', 40))]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        server.proc.send_signal(signal.SIGTERM)                     # the short stream is still generating
        for t in threads:
            t.join(timeout=30)
        assert server.proc.wait(timeout=30) == 143
    finally:
        log = server.log()
        server.stop()
    short = results['short_stream']                                 # finished within the grace period
    assert short[-1] == 'data: [DONE]'
    chunks = [json.loads(e[len('data: '):]) for e in short[:-1]]
    assert chunks[-2]['choices'][0]['finish_reason'] == 'length' and chunks[-1]['usage']['completion_tokens'] == 40
    code, ctype, resp = results['long']
    assert code == 503 and ctype == 'application/json' and resp['error']['code'] == 'shutting_down'
    events = results['long_stream']
    assert events[-1] == 'data: [DONE]'
    assert json.loads(events[-2][len('data: '):])['error']['code'] == 'shutting_down'
    assert all(json.loads(e[len('data: '):]).get('object') == 'chat.completion.chunk' for e in events[:-2])
    assert 'Traceback' not in log and 'Cancel' not in log, log
