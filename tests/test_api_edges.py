"""API edges found by adversarial review and by agent clients (Codex CLI, Claude Code), through
one in-process app over a tiny Qwen3 (Qwen3-style tools + thinking template, hermes parser,
prefix caching on) served with two API keys:

- tenants: each key's stored responses and cached prefixes are its own;
- limits: oversized grammars and deeply nested bodies are 4xx, never 500, and the server serves on;
- Messages structured output (``output_config.format``);
- streamed tool calls (name first, argument fragments as they come, also when cut);
- OpenAI-compatibility details (``root``, ``matched_stop``, ``continuous_usage_stats``, ...).

The model has random weights: a reply that validates is the grammar's doing.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template

K1, K2 = 'sk-tenant-one', 'sk-tenant-two'
H1, H2 = {'Authorization': f'Bearer {K1}'}, {'Authorization': f'Bearer {K2}'}
MSG = [{'role': 'user', 'content': 'What is the weather in Paris?'}]


@pytest.fixture(scope='module')
def client(tiny_qwen3, tmp_path_factory):
    from starlette.testclient import TestClient

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.pipeline import Pipeline
    model = with_template(tiny_qwen3, str(tmp_path_factory.mktemp('edges_tpl')), THINKING_TOOLS_TEMPLATE)
    pipe = Pipeline(model, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=128,
                                               block_size=16, enable_prefix_caching=True))
    app = create_app(pipe, 'tiny', [K1, K2], tool_call_parser='hermes')
    with TestClient(app, headers=H1) as c:
        c.pipe, c.server = pipe, app.state.server
        yield c
    pipe.close()


def _chat(client, headers=H1, **body):
    body = {'model': 'tiny', 'messages': MSG, 'max_tokens': 200, **body}
    return client.post('/v1/chat/completions', json=body, headers=headers)


# tenants ----------------------------------------------------------------------------------------------------
def test_stored_responses_belong_to_their_key(client):
    r = client.post('/v1/responses', json={'model': 'tiny', 'input': 'Remember the word copper.',
                                           'max_output_tokens': 4}, headers=H1)
    assert r.status_code == 200, r.text
    rid = r.json()['id']
    missing = client.get('/v1/responses/resp_never_stored', headers=H2)
    assert missing.status_code == 404
    for method in ('GET', 'DELETE'):      # k2 sees exactly what an unknown id gets
        other = client.request(method, f'/v1/responses/{rid}', headers=H2)
        assert other.status_code == 404 and other.json()['error']['code'] == 'not_found', other.text
        assert other.json()['error']['message'].replace(rid, 'X') == \
            missing.json()['error']['message'].replace('resp_never_stored', 'X')
    cont = client.post('/v1/responses', json={'model': 'tiny', 'input': 'Which word?', 'max_output_tokens': 2,
                                              'previous_response_id': rid}, headers=H2)
    assert cont.status_code == 400 and cont.json()['error']['code'] == 'previous_response_not_found', cont.text
    # the owner still has it all
    assert client.get(f'/v1/responses/{rid}', headers=H1).json()['id'] == rid
    cont = client.post('/v1/responses', json={'model': 'tiny', 'input': 'Which word?', 'max_output_tokens': 2,
                                              'previous_response_id': rid}, headers=H1)
    assert cont.status_code == 200, cont.text
    assert client.delete(f'/v1/responses/{rid}', headers=H1).status_code == 200


def _cached(client, prompt: str, headers, path='/v1/chat/completions', **extra) -> int:
    body = {'model': 'tiny', 'max_tokens': 1, **extra}
    body.update({'prompt': prompt} if path == '/v1/completions' else
                {'messages': [{'role': 'user', 'content': prompt}]})
    r = client.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()['usage']['prompt_tokens_details']['cached_tokens']


@pytest.mark.parametrize('path', ['/v1/chat/completions', '/v1/completions'])
def test_prefix_cache_is_per_key(client, path):
    """k2 sending k1's exact prompt gets no cached token (also with the same cache_salt); k1
    gets its hit; with sharing turned on, k2 hits as well."""
    prompt = f'The secret ledger of {path} holds salt, wool and copper. ' * 6
    assert _cached(client, prompt, H1, path) == 0
    assert _cached(client, prompt, H1, path) > 0
    assert _cached(client, prompt, H2, path) == 0
    assert _cached(client, prompt, H1, path, cache_salt='s') == 0      # a request salt: its own space ...
    assert _cached(client, prompt, H2, path, cache_salt='s') == 0      # ... and still the key's own
    assert _cached(client, prompt, H1, path, cache_salt='s') > 0
    client.server.share_prefix_cache_across_keys = True
    try:
        assert _cached(client, prompt + 'x', H1, path) == 0
        assert _cached(client, prompt + 'x', H2, path) > 0
    finally:
        client.server.share_prefix_cache_across_keys = False


# limits -----------------------------------------------------------------------------------------------------
def _nested(depth: int, kind: str):
    """A JSON text nested ``depth`` deep: lists, objects, or both alternating."""
    if kind == 'list':
        return '[' * depth + ']' * depth
    if kind == 'dict':
        return '{"a":' * depth + '1' + '}' * depth
    return '{"a":[' * (depth // 2) + '1' + ']}' * (depth // 2)


def _deep_bodies():
    """Bodies nested in several places and shapes, small (FastAPI parses them) and over the
    256 KiB the server decodes off the event loop (padded with a long prompt)."""
    pad = 'x' * (300 << 10)
    for depth in (900, 5000, 100000):
        for kind in ('list', 'dict', 'mixed'):
            deep = _nested(depth, kind)
            for where in ('top', 'kwargs', 'metadata', 'schema'):
                if where == 'top':
                    yield f'{where}-{kind}-{depth}', '/v1/chat/completions', deep
                    continue
                for big in (False, True):
                    content = json.dumps(pad if big else 'hi')
                    head = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": %s}]' % content
                    field = {'kwargs': '"chat_template_kwargs": {"x": %s}',
                             'metadata': '"metadata": %s',
                             'schema': '"response_format": {"type": "json_schema", "json_schema": '
                                       '{"name": "d", "schema": {"type": "object", "properties": {"a": %s}}}}'}[where]
                    yield (f'{where}-{kind}-{depth}-{"big" if big else "small"}', '/v1/chat/completions',
                           head + ', ' + field % deep + '}')
    for depth in (900, 5000):
        deep = _nested(depth, 'dict')
        yield (f'tools-{depth}', '/v1/chat/completions', '{"model": "tiny", "max_tokens": 1, "messages": [{"role": '
               '"user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": '
               '{"a": %s}}}], "tool_choice": "required"}' % deep)
        yield (f'metadata-responses-{depth}', '/v1/responses', '{"model": "tiny", "input": "hi", "max_output_tokens": '
               '1, "metadata": {"a": %s}, "tools": [{"type": "function", "name": "f", "parameters": {"a": %s}}]}'
               % (deep, deep))
        yield (f'metadata-messages-{depth}', '/v1/messages', '{"model": "tiny", "max_tokens": 1, "messages": '
               '[{"role": "user", "content": "hi"}], "metadata": {"a": %s}}' % deep)
    yield 'responses-input', '/v1/responses', '{"model": "tiny", "input": %s}' % _nested(5000, 'list')
    yield 'messages-system', '/v1/messages', '{"model": "tiny", "max_tokens": 1, "messages": %s}' % _nested(5000,
                                                                                                         'dict')
    yield 'completions-prompt', '/v1/completions', '{"model": "tiny", "prompt": %s}' % _nested(5000, 'list')


def test_deep_and_huge_bodies_are_4xx_never_500(client):
    """Fuzz over nesting shapes, depths, places and body sizes: never a 5xx; a deep schema or
    body is a 4xx with an error body (a deep value in an ignored field may be served); the
    server then serves a normal request."""
    failures = []
    for name, path, body in _deep_bodies():
        r = client.post(path, content=body.encode(), headers={**H1, 'Content-Type': 'application/json'})
        refused = 400 <= r.status_code < 500 and 'error' in r.json()
        if not refused and (r.status_code != 200 or not name.startswith(('metadata', 'kwargs'))):
            failures.append((name, r.status_code, r.text[:200]))
    assert not failures, failures
    assert _chat(client, max_tokens=2).status_code == 200


def _deep_schema(levels: int) -> dict:
    schema = {'type': 'string'}
    for _ in range(levels):
        schema = {'type': 'object', 'properties': {'a': schema}, 'required': ['a']}
    return schema


@pytest.mark.parametrize('schema, limit', [
    ({'type': 'object', 'properties': {'x': {'enum': [f'v{i}' for i in range(100_000)]}}}, 'enum/const values'),
    ({'type': 'object', 'properties': {f'p{i}': {'type': 'integer'} for i in range(1000)}}, 'optional properties'),
    (_deep_schema(40), 'nested more than 64'),
    ({'type': 'object', 'properties': {f'p{i}': {'type': 'string', 'description': 'd' * 2000} for i in range(40)},
      'required': [f'p{i}' for i in range(40)]}, 'bytes of JSON'),
])
def test_grammar_size_limits_are_400s_before_compiling(client, schema, limit):
    """Each of these took seconds to minutes of compile time before the limits; now a 400 names
    the field and the limit at once, for response_format, forced tools and Messages output."""
    import time
    start = time.perf_counter()
    r = _chat(client, response_format={'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}})
    assert r.status_code == 400 and limit in r.json()['error']['message'], r.text
    assert r.json()['error']['param'] == 'response_format'
    tools = [{'type': 'function', 'function': {'name': 'f', 'parameters': schema}}]
    r = _chat(client, tools=tools, tool_choice='required')
    assert r.status_code == 400 and limit in r.json()['error']['message'], r.text
    assert r.json()['error']['param'] == 'tools[0].function.parameters'      # every tool is checked on its own
    r = client.post('/v1/responses', json={'model': 'tiny', 'input': 'hi', 'max_output_tokens': 4, 'text': {
        'format': {'type': 'json_schema', 'name': 'x', 'schema': schema}}}, headers=H1)
    assert r.status_code == 400 and r.json()['error']['param'] == 'text.format' and limit in r.text, r.text
    r = client.post('/v1/messages', json={'model': 'tiny', 'max_tokens': 4, 'messages': MSG, 'output_config': {
        'format': {'type': 'json_schema', 'schema': schema}}}, headers=H1)
    assert r.status_code == 400 and r.json()['error']['message'].startswith('output_config.format'), r.text
    assert time.perf_counter() - start < 5
    assert client.pipe.ledger()['grammar_matchers'] == 0


def test_grammar_within_the_limits_compiles(client):
    """The limits' own values are accepted: 64 optional properties, 1024 enum values in all."""
    schema = {'type': 'object', 'properties': {f'p{i}': {'enum': [f'v{j}' for j in range(16)]} for i in range(64)}}
    r = _chat(client, max_tokens=4, response_format={'type': 'json_schema', 'json_schema': {'name': 'x',
                                                                                           'schema': schema}})
    assert r.status_code == 200, r.text


# Messages structured output ---------------------------------------------------------------------------------
TITLE = {'type': 'object', 'properties': {'title': {'type': 'string', 'maxLength': 12},
                                          'isNewTopic': {'type': 'boolean'}},
         'required': ['title', 'isNewTopic'], 'additionalProperties': False}


@pytest.mark.parametrize('field', ['output_config', 'output_format'])
@pytest.mark.parametrize('stream', [False, True])
def test_messages_output_format_is_enforced(client, field, stream):
    """Claude Code's title request: the reply's text is JSON valid for the schema and ends there
    (stop_reason end_turn), not a budget-long ramble."""
    fmt = {'type': 'json_schema', 'schema': TITLE}
    body = {'model': 'tiny', 'max_tokens': 300, 'stream': stream, 'temperature': 1.0,
            'messages': [{'role': 'user', 'content': 'Write a title for: fix the parser'}],
            field: {'format': fmt} if field == 'output_config' else fmt}
    if stream:
        text, reason = '', None
        with client.stream('POST', '/v1/messages', json=body, headers={'x-api-key': K1}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith('data: '):
                    ev = json.loads(line[6:])
                    if ev['type'] == 'content_block_delta' and ev['delta']['type'] == 'text_delta':
                        text += ev['delta']['text']
                    if ev['type'] == 'message_delta':
                        reason = ev['delta']['stop_reason']
    else:
        r = client.post('/v1/messages', json=body, headers={'x-api-key': K1})
        assert r.status_code == 200, r.text
        blocks = [b for b in r.json()['content'] if b['type'] == 'text']
        text, reason = blocks[0]['text'], r.json()['stop_reason']
    jsonschema.validate(json.loads(text), TITLE)
    assert reason == 'end_turn'


def test_messages_output_format_errors_name_the_field(client):
    body = {'model': 'tiny', 'max_tokens': 10, 'messages': [{'role': 'user', 'content': 'hi'}],
            'output_config': {'format': {'type': 'json_schema', 'schema': {'type': 'objectx'}}}}
    r = client.post('/v1/messages', json=body, headers={'x-api-key': K1})
    assert r.status_code == 400 and r.json()['error']['message'].startswith('output_config.format'), r.text


# streamed tool calls ----------------------------------------------------------------------------------------
from hypothesis import assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6),
                  st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
_VALUE = st.recursive(_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=5), _VALUE, max_size=3), st.sampled_from([(',', ':'), (', ', ': ')]),
       st.sampled_from(['hermes', 'qwen_xml']), st.floats(0, 1), st.lists(st.integers(1, 300), max_size=8))
@example(args={'': None}, separators=(',', ':'), fmt='qwen_xml', cut_at=1.0, cuts=[])   # the empty name
def test_streamed_call_cut_anywhere_equals_the_parsed_reply(args, separators, fmt, cut_at, cuts):
    """A call cut at any character and streamed in any chunking: the streamed name and argument
    fragments equal the non-streamed parse; once the name has gone out, the arguments are strict
    JSON; uncut, they are the model's own text."""
    from lmdeploy.serve.openai.tool_call import merge_tool_call_fragments
    from lmdeploy.serve.openai.tool_parser import get_tool_parser
    # the XML format writes a name between '<parameter=' and '>' on its own line: a name holding
    # '<', '>' or a newline cannot be written (the empty name can: '<parameter=>')
    assume(fmt == 'hermes' or not any(set(k) & set('<>\n') for k in args))
    schema = {'type': 'object', 'properties': {k: {} for k in args}}
    parser = get_tool_parser(fmt, [{'type': 'function', 'function': {'name': 'ls', 'parameters': schema}}])
    raw = json.dumps(args, separators=separators)
    if fmt == 'hermes':
        full = '<tool_call>\n{"name": "ls", "arguments": ' + raw + '}\n</tool_call>'
    else:
        full = '<tool_call>\n<function=ls>\n' + ''.join(
            f'<parameter={k}>\n{json.dumps(v)}\n</parameter>\n' for k, v in args.items()) + '</function>\n</tool_call>'
    text = full[:int(len(full) * cut_at)]
    whole = parser.parse(text)
    stream, frags, content, prev = parser.stream(), [], '', 0
    for c in sorted({c for c in cuts if c < len(text)}) + [len(text)]:
        piece, got = stream.feed(text[prev:c])
        content, frags, prev = content + piece, frags + got, c
    piece, got = stream.finish()
    content, frags = content + piece, frags + got
    merged = [(f['function']['name'], f['function'].get('arguments', '')) for f in merge_tool_call_fragments(frags)]
    assert merged == [(c.name, c.arguments) for c in whole.calls]
    assert content == (whole.content or '')
    for call in whole.calls:
        json.loads(call.arguments)
    if text == full:
        assert [c.name for c in whole.calls] == ['ls'] and json.loads(whole.calls[0].arguments) == args
        if fmt == 'hermes':
            assert whole.calls[0].arguments == raw


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.dictionaries(st.text(max_size=4), _VALUE, max_size=4).map(json.dumps),
                 st.text(alphabet='{}[]":,. \n0123456789-eEtrufalsn\\x', max_size=30)), st.floats(0, 1))
def test_json_prefix_closes_any_cut_as_strict_json(text, cut_at):
    """Fed any text (JSON objects, or near-JSON noise) up to any cut: what went out plus
    ``closing()`` is strict JSON, a prefix-preserving completion of what went out; a whole object
    goes out unchanged and ends with 'done'; nothing is taken after 'bad' or 'done'."""
    from lmdeploy.serve.openai.json_prefix import JSONPrefix
    if not text.startswith('{'):
        text = '{' + text
    checker, out, state = JSONPrefix(), '', 'ok'
    for ch in text[:max(1, int(len(text) * cut_at))]:
        piece, state = checker.push(ch)
        out += piece
        if state != 'ok':
            break
    closed = out + ('' if state == 'done' else checker.closing())
    json.loads(closed, parse_constant=lambda name: pytest.fail(f'{name} is not JSON'))
    try:
        whole = json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except ValueError:
        whole = None
    if isinstance(whole, dict) and cut_at == 1 and text == text.strip():
        assert (out, state) == (text, 'done')


TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'parameters': {
    'type': 'object', 'properties': {'city': {'type': 'string', 'maxLength': 12},
                                     'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}},
    'required': ['city', 'days'], 'additionalProperties': False}}}]


def _streamed(client, body) -> tuple[list[dict], str | None]:
    frags, reason = [], None
    with client.stream('POST', '/v1/chat/completions', json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith('data: ') and line != 'data: [DONE]':
                for c in json.loads(line[6:])['choices']:
                    frags += c['delta'].get('tool_calls') or []
                    reason = c['finish_reason'] or reason
    return frags, reason


@pytest.mark.parametrize('choice', ['required', {'type': 'function', 'function': {'name': 'get_weather'}}])
def test_forced_tool_call_streams_its_name_and_arguments_also_when_cut(client, choice):
    """Streamed, the name comes in the call's first fragment, the arguments in later ones, and
    they add up to the non-streamed call; cut by max_tokens inside the arguments, the stream
    still carries the call (name, partial arguments closed as strict JSON), equal to the
    non-streamed reply, finish_reason "length"."""
    body = {'model': 'tiny', 'messages': MSG, 'tools': TOOLS, 'tool_choice': choice, 'parallel_tool_calls': False,
            'temperature': 1.0, 'seed': 3}
    whole = client.post('/v1/chat/completions', json=dict(body, max_tokens=200)).json()
    call = whole['choices'][0]['message']['tool_calls'][0]['function']
    frags, reason = _streamed(client, dict(body, max_tokens=200))
    assert reason == 'tool_calls' and frags[0]['function']['name'] == call['name']
    assert len(frags) > 2 and all('name' not in f['function'] for f in frags[1:])
    assert ''.join(f['function'].get('arguments', '') for f in frags) == call['arguments']
    # a budget that ends inside the arguments: the tokens of the reply up to their middle
    head = '' if isinstance(choice, dict) else '{"name": "get_weather", "arguments": '
    cut = len(client.pipe.tokenize(head + call['arguments'][:len(call['arguments']) // 2]))
    plain = client.post('/v1/chat/completions', json=dict(body, max_tokens=cut)).json()['choices'][0]
    frags, reason = _streamed(client, dict(body, max_tokens=cut))
    assert (plain['finish_reason'], reason) == ('length', 'length')
    (partial,) = plain['message']['tool_calls']
    assert frags[0]['function']['name'] == partial['function']['name'] == call['name']
    assert ''.join(f['function'].get('arguments', '') for f in frags) == partial['function']['arguments']
    assert partial['function']['arguments'] != call['arguments']
    json.loads(partial['function']['arguments'])


# OpenAI-compatibility details -------------------------------------------------------------------------------
EOS = 2             # <|im_end|> of the tiny tokenizer
LEAD_BYTE = 163     # 'ä': the byte 0xE4 alone, the first byte of a three-byte UTF-8 character


def test_model_card_has_root(client):
    card = client.get('/v1/models').json()['data'][0]
    assert card['id'] == 'tiny' and card['root'] == client.pipe.model_path.rstrip('/').split('/')[-1]
    assert client.get('/v1/models/tiny').json()['root'] == card['root']


def _events(client, path, body):
    with client.stream('POST', path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith('data: ') and line != 'data: [DONE]']


@pytest.mark.parametrize('path', ['/v1/chat/completions', '/v1/completions'])
def test_matched_stop_names_the_stop_string_or_token(client, path):
    def body(**kw):
        b = {'model': 'tiny', 'max_tokens': 12, **kw}
        b.update({'prompt': 'Rivers and towns'} if path == '/v1/completions' else {'messages': MSG})
        return b

    def answer(**kw):
        whole = client.post(path, json=body(**kw)).json()['choices'][0]
        last = [c for e in _events(client, path, body(**kw)) for c in e['choices'] if c['finish_reason']][-1]
        assert last['matched_stop'] == whole['matched_stop']
        return whole['finish_reason'], whole['matched_stop']
    full = client.post(path, json=body()).json()['choices'][0]
    text = full['text'] if path == '/v1/completions' else full['message']['content']
    stop = text[3:6]
    assert answer() == ('length', None)
    assert answer(stop=['zzzz', stop]) == ('stop', stop)
    assert answer(logit_bias={str(EOS): 100}) == ('stop', EOS)


@pytest.mark.parametrize('path', ['/v1/chat/completions', '/v1/completions'])
def test_continuous_usage_stats_puts_usage_on_every_chunk(client, path):
    body = {'model': 'tiny', 'max_tokens': 5, 'stream_options': {'include_usage': True, 'continuous_usage_stats': True}}
    body.update({'prompt': 'Rivers'} if path == '/v1/completions' else {'messages': MSG})
    events = _events(client, path, body)
    assert all(e['usage'] is not None for e in events)
    done = [e['usage']['completion_tokens'] for e in events]
    assert done == sorted(done) and done[-1] == 5 and events[-1]['choices'] == []
    plain = _events(client, path, dict(body, stream_options={'include_usage': True}))
    assert all(e['usage'] is None for e in plain[:-1]) and plain[-1]['usage']['completion_tokens'] == 5


def test_a_chunk_with_only_logprobs_has_empty_content(client):
    """Partial UTF-8 bytes: the token's entry is ready before any text; the chunk says content ""."""
    events = _events(client, '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'max_tokens': 2,
                                                       'logprobs': True, 'logit_bias': {str(LEAD_BYTE): 100}})
    with_lp = [c for e in events for c in e['choices'] if c['logprobs']]
    assert with_lp and all(isinstance(c['delta'].get('content'), str) for c in with_lp)
    assert any(c['delta']['content'] == '' for c in with_lp)


def test_completions_logprobs_zero_returns_the_sampled_tokens_logprob(client):
    r = client.post('/v1/completions', json={'model': 'tiny', 'prompt': 'Rivers', 'max_tokens': 3, 'logprobs': 0})
    lp = r.json()['choices'][0]['logprobs']
    assert len(lp['tokens']) == len(lp['token_logprobs']) == 3
    assert all(isinstance(v, float) and v <= 0 for v in lp['token_logprobs'])
    assert [list(t.values()) for t in lp['top_logprobs']] == [[v] for v in lp['token_logprobs']]


@pytest.mark.parametrize('seed', [-(1 << 63) - 1, 1 << 64, 10 ** 30])
def test_out_of_range_seed_is_a_400(client, seed):
    for path, extra in (('/v1/chat/completions', {'messages': MSG}), ('/v1/completions', {'prompt': 'x'})):
        r = client.post(path, json={'model': 'tiny', 'max_tokens': 1, 'seed': seed, **extra})
        assert r.status_code == 400 and r.json()['error']['param'] == 'seed', r.text


def test_custom_roles_are_the_templates_to_render_or_refuse(client):
    msgs = [{'role': 'narrator', 'content': 'Once upon a time.'}, {'role': 'user', 'content': 'Go on.'}]
    r = _chat(client, messages=msgs, max_tokens=2)        # this template refuses other roles
    assert r.status_code == 400 and 'narrator' in r.json()['error']['message'], r.text
    tok = client.pipe.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n")
    try:
        r = _chat(client, messages=msgs, max_tokens=2)
        assert r.status_code == 200, r.text
        want = len(tok.encode('<|im_start|>narrator\nOnce upon a time.<|im_end|>\n<|im_start|>user\nGo on.'
                              '<|im_end|>\n<|im_start|>assistant', add_special_tokens=False))   # (Jinja drops
        #                                                                   the template's last newline)
        assert r.json()['usage']['prompt_tokens'] == want
    finally:
        tok.chat_template = saved
    for bad in ('', 5, None):
        r = _chat(client, messages=[{'role': bad, 'content': 'x'}])
        assert r.status_code == 400 and r.json()['error']['param'].startswith('messages'), r.text
