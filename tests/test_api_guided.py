"""Structured output, forced tool calls and min_tokens through the OpenAI API (in-process app,
tiny Qwen3 with a Qwen3-style tools template and the hermes parser).

The model has random weights: a reply that validates is the grammar's doing.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCHEMA = {'type': 'object', 'properties': {'name': {'type': 'string', 'maxLength': 8},
                                           'age': {'type': 'integer', 'minimum': 0, 'maximum': 120},
                                           'tags': {'type': 'array', 'items': {'enum': ['a', 'b']}, 'maxItems': 3}},
          'required': ['name', 'age', 'tags'], 'additionalProperties': False}
WEATHER = {'type': 'object', 'properties': {'city': {'type': 'string', 'maxLength': 6},
                                            'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}},
           'required': ['city', 'days'], 'additionalProperties': False}
TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'parameters': WEATHER}},
         {'type': 'function', 'function': {'name': 'ls', 'parameters': {
             'type': 'object', 'properties': {'deep': {'type': 'boolean'}}, 'required': ['deep'],
             'additionalProperties': False}}}]
MSG = [{'role': 'user', 'content': 'What is the weather in Paris?'}]


@pytest.fixture(scope='module')
def client(tiny_qwen3, tmp_path_factory):
    from starlette.testclient import TestClient

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.pipeline import Pipeline
    model = with_template(tiny_qwen3, str(tmp_path_factory.mktemp('tools_tpl')), THINKING_TOOLS_TEMPLATE)
    pipe = Pipeline(model, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=128,
                                               block_size=16, enable_prefix_caching=True))
    app = create_app(pipe, 'tiny', tool_call_parser='hermes')
    with TestClient(app) as c:
        c.pipe = pipe
        yield c
    pipe.close()


def _chat(client, **body):
    body = {'model': 'tiny', 'messages': MSG, 'max_tokens': 200, **body}
    return client.post('/v1/chat/completions', json=body)


@pytest.mark.parametrize('seed', [0, 1])
def test_json_schema_reply_validates(client, seed):
    r = _chat(client, seed=seed, temperature=1.0,
              response_format={'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': SCHEMA,
                                                                      'strict': True}})
    assert r.status_code == 200, r.text
    choice = r.json()['choices'][0]
    assert choice['finish_reason'] == 'stop'
    jsonschema.validate(json.loads(choice['message']['content']), SCHEMA)


def test_json_object_and_completions_response_format(client):
    r = _chat(client, max_tokens=30, response_format={'type': 'json_object'})
    assert r.status_code == 200 and r.json()['choices'][0]['message']['content'].startswith('{')
    r = client.post('/v1/completions', json={'model': 'tiny', 'prompt': 'A person:', 'max_tokens': 200,
                                             'response_format': {'type': 'json_schema',
                                                                 'json_schema': {'name': 'p', 'schema': SCHEMA}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()['choices'][0]['text']), SCHEMA)


@pytest.mark.parametrize('body, param', [
    ({'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'objectx'}}}},
     'response_format'),
    ({'response_format': {'type': 'json_schema'}}, 'response_format'),
    ({'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'nope'}}}],
      'tool_choice': 'required'}, 'tools'),
    ({'tools': TOOLS, 'tool_choice': 'required', 'response_format': {'type': 'json_object'}}, 'response_format'),
])
def test_invalid_constraints_are_400s_naming_the_field(client, body, param):
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()['error']
    assert err['param'] == param or err['param'].startswith(param), err
    assert client.pipe.ledger()['grammar_matchers'] == 0


@pytest.mark.parametrize('choice', ['required', {'type': 'function', 'function': {'name': 'ls'}}])
def test_forced_tool_call_is_one_valid_call(client, choice):
    r = _chat(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    out = r.json()['choices'][0]
    assert out['finish_reason'] == 'tool_calls' and not out['message']['content'], out
    (call,) = out['message']['tool_calls']
    schemas = {t['function']['name']: t['function']['parameters'] for t in TOOLS}
    if isinstance(choice, dict):
        assert call['function']['name'] == 'ls'
    jsonschema.validate(json.loads(call['function']['arguments']), schemas[call['function']['name']])


def test_forced_tool_call_streams_the_same_call(client):
    body = dict(tools=TOOLS, tool_choice={'type': 'function', 'function': {'name': 'get_weather'}},
                parallel_tool_calls=False)
    plain = _chat(client, **body).json()['choices'][0]['message']['tool_calls'][0]['function']
    name, args = None, ''
    with client.stream('POST', '/v1/chat/completions', json={'model': 'tiny', 'messages': MSG, 'max_tokens': 200,
                                                             'stream': True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith('data: ') or line == 'data: [DONE]':
                continue
            for c in json.loads(line[6:])['choices']:
                for tc in c['delta'].get('tool_calls') or []:
                    name = tc['function'].get('name') or name
                    args += tc['function'].get('arguments') or ''
    assert (name, args) == (plain['name'], plain['arguments'])
    jsonschema.validate(json.loads(args), WEATHER)


def test_min_tokens_through_the_api(client):
    eos = 2
    r = _chat(client, max_tokens=20, logit_bias={str(eos): 100}, min_tokens=6)
    assert r.status_code == 200 and r.json()['usage']['completion_tokens'] == 7, r.text
    r = _chat(client, max_tokens=20, logit_bias={str(eos): 100})
    assert r.json()['usage']['completion_tokens'] == 1


def test_cache_salt_through_the_api(client):
    """Chat and completions: salt 2 gets no cached tokens of salt 1's prompt; the same salt does."""
    prompt = 'salted ' * 40

    def cached(path, salt):
        body = {'model': 'tiny', 'max_tokens': 2, 'cache_salt': salt}
        body.update({'prompt': prompt} if path == '/v1/completions' else
                    {'messages': [{'role': 'user', 'content': prompt}]})
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()['usage']['prompt_tokens_details']['cached_tokens']
    for path in ('/v1/completions', '/v1/chat/completions'):
        cached(path, f'one{path}')
        assert cached(path, f'one{path}') > 0
        assert cached(path, f'two{path}') == 0
    r = client.post('/v1/completions', json={'model': 'tiny', 'prompt': 'x', 'cache_salt': ''})
    assert r.status_code == 400 and r.json()['error']['param'] == 'cache_salt'


def test_grammar_format_of_a_parser():
    """A parser's grammar: its grammar_format attribute, else its name; none registered -> None."""
    from lmdeploy.serve.openai.structured import grammar_tool_format
    from lmdeploy.serve.openai.tool_call import ToolParser
    from lmdeploy.serve.openai.tool_parser import TOOL_PARSERS, register_tool_parser
    assert grammar_tool_format(None) == grammar_tool_format('hermes') == 'hermes'

    @register_tool_parser('test_xml_calls')
    class _XML(ToolParser):
        grammar_format = 'qwen_xml'
    try:
        assert grammar_tool_format('test_xml_calls') == 'qwen_xml'
        _XML.grammar_format = None
        assert grammar_tool_format('test_xml_calls') is None
    finally:
        TOOL_PARSERS.pop('test_xml_calls')


def test_mapping_takes_chat_responses_and_anthropic_shapes():
    """The request-to-config mapping the other endpoints reuse: chat's nested json_schema,
    Responses' flat text.format, dict tools and a named choice."""
    from lmdeploy.serve.openai.structured import from_response_format, from_tool_choice
    nested = from_response_format({'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': SCHEMA}})
    flat = from_response_format({'type': 'json_schema', 'name': 'p', 'schema': SCHEMA, 'strict': False})
    assert nested.json_schema == flat.json_schema == SCHEMA and nested.strict and not flat.strict
    assert from_response_format({'type': 'text'}) is None and from_response_format(None) is None
    with pytest.raises(ValueError, match='schema'):
        from_response_format({'type': 'json_schema', 'json_schema': {'name': 'p'}})
    named = from_tool_choice(TOOLS, {'type': 'function', 'function': {'name': 'ls'}}, False, 'hermes')
    assert [t.name for t in named.tools] == ['ls'] and not named.parallel_tool_calls
    assert [t.name for t in from_tool_choice(TOOLS, 'required', True, 'hermes').tools] == ['get_weather', 'ls']
    assert from_tool_choice(TOOLS, 'auto', True, 'hermes') is None and from_tool_choice([], 'required', True, 'x') is None


# tool schemas constrained decoding cannot use: refused whatever tool_choice says ----------------------------
UNUSABLE = [({'type': 'string'}, 'must be an object schema'),
            ({'type': 'object', 'properties': {'a': {'type': 'nonsense'}}}, 'Unsupported type "nonsense"'),
            ({'type': 'object', 'properties': {'a': {'type': 'string', 'pattern': '(('}}}, 'Regex parsing error'),
            ({'type': 'object', 'properties': {f'p{i}': {'type': 'integer'} for i in range(65)}},
             '65 optional properties')]


@pytest.mark.parametrize('schema, says', UNUSABLE, ids=['string-root', 'unknown-type', 'bad-pattern', 'limit'])
def test_an_unusable_tool_schema_is_a_400_naming_it_on_every_endpoint(client, schema, says):
    """With tool_choice auto (no grammar compiled) as with a forced call, a tool whose parameters
    constrained decoding cannot use is a 400 naming that schema in the client's own terms
    (chat, Responses incl. a namespace, Messages), and the next valid request is served."""
    tools = [TOOLS[0], {'type': 'function', 'function': {'name': 'f', 'parameters': schema}}]
    where = 'tools[1].function.parameters'
    for choice in ('auto', 'none', 'required', {'type': 'function', 'function': {'name': 'get_weather'}}):
        r = _chat(client, tools=tools, tool_choice=choice, max_tokens=2)
        assert r.status_code == 400, (choice, r.text)
        err = r.json()['error']
        assert (err['param'], err['type'], err['code']) == (where, 'invalid_request_error', 'invalid_value')
        assert err['message'].startswith(f'{where}: ') and says in err['message'], err
    r = client.post('/v1/responses', json={'model': 'tiny', 'input': 'hi', 'max_output_tokens': 2, 'tools': [
        {'type': 'function', 'name': 'g', 'parameters': WEATHER},
        {'type': 'namespace', 'name': 'ns', 'tools': [{'type': 'function', 'name': 'ok', 'parameters': WEATHER},
                                                      {'type': 'function', 'name': 'f', 'parameters': schema}]}]})
    assert r.status_code == 400, r.text
    err = r.json()['error']
    assert err['param'] == 'tools[1].tools[1].parameters' and says in err['message'], err
    r = client.post('/v1/messages', json={'model': 'tiny', 'max_tokens': 2, 'messages': MSG, 'tools': [
        {'name': 'g', 'input_schema': WEATHER}, {'name': 'f', 'input_schema': schema}],
        'tool_choice': {'type': 'auto'}})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body['type'] == 'error' and body['error']['type'] == 'invalid_request_error'
    assert body['error']['message'].startswith('tools[1].input_schema: ') and says in body['error']['message']
    r = _chat(client, tools=TOOLS, max_tokens=2)
    assert r.status_code == 200, r.text
    assert client.pipe.ledger()['grammar_matchers'] == 0


def _fragments():
    """Schema fragments the grammar library accepts and ones it refuses, mixed at any depth."""
    good = st.sampled_from([{'type': 'string'}, {'type': 'integer', 'minimum': 0}, {'enum': ['a', 1]},
                            {'type': 'string', 'pattern': '^[a-z]+$'}, {'type': 'boolean'}, {}])
    bad = st.sampled_from([{'type': 'nonsense'}, {'type': 'string', 'pattern': '(('}, {'$ref': '#/nowhere'},
                           {'type': 'object', 'properties': 5}])
    leaves = st.one_of(good, good, bad)
    return st.recursive(leaves, lambda c: st.one_of(
        st.dictionaries(st.sampled_from('abc'), c, max_size=3).map(lambda p: {'type': 'object', 'properties': p}),
        st.builds(lambda items: {'type': 'array', 'items': items}, c)), max_leaves=5)


@pytest.fixture(scope='module')
def grammars(tiny_qwen3):
    from transformers import AutoTokenizer

    from lmdeploy.pytorch.engine.guided import GrammarBackend
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    return GrammarBackend(tok, len(tok), [2])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(root=st.one_of(_fragments(), st.dictionaries(st.sampled_from('xyz'), _fragments(), max_size=3).map(
    lambda p: {'type': 'object', 'properties': p})), fmt=st.sampled_from(['hermes', 'qwen_xml']))
def test_tool_schema_check_accepts_exactly_what_a_forced_call_compiles(grammars, root, fmt):
    """The check every tool passes (any tool_choice) accepts a parameters schema exactly when it
    is an object schema (or {}) and the forced call's full grammar compiles in that format."""
    from lmdeploy.messages import StructuredOutput, ToolSchema
    from lmdeploy.pytorch.engine.guided import check_tool_parameters
    try:
        check_tool_parameters(root, fmt)
        accepted = True
    except ValueError:
        accepted = False
    spec = StructuredOutput(type='tool_calls', tools=[ToolSchema(name='f', parameters=root)], tool_format=fmt)
    try:
        grammars.compile(spec)
        compiles = True
    except ValueError:
        compiles = False
    assert accepted == (root.get('type', 'object') == 'object' and compiles), (root, fmt)
