"""Every 400 of the four APIs (chat completions, completions, responses, Anthropic messages)
names the field at fault in one form, OpenAI's: keys joined by dots, list indices in brackets
(``messages[0].content``, ``tools[1].function.name``); OpenAI's bodies carry it as ``param`` and
every message starts with it. Table tests over many invalid bodies, one fuzz test that breaks a
valid body at a random place, and the message-content rules (a user message needs content; an
assistant message may have none), through one in-process app over a tiny Qwen3."""
from __future__ import annotations

import copy
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MSG = [{'role': 'user', 'content': 'hi'}]
TOOL = {'type': 'function', 'function': {'name': 'ls', 'parameters': {'type': 'object'}}}
CALL = {'id': 'c1', 'type': 'function', 'function': {'name': 'ls', 'arguments': '{}'}}
# a location as OpenAI writes it: no ".0" segment, indices in brackets
LOCATION = re.compile(r'[A-Za-z_]\w*(?:\.\w+|\[\d+\])*')
PATHS = {'chat': '/v1/chat/completions', 'completions': '/v1/completions', 'responses': '/v1/responses',
         'messages': '/v1/messages'}
VALID = {'chat': {'model': 'tiny', 'max_tokens': 1, 'messages': MSG, 'tools': [TOOL], 'stop': ['x', 'y']},
         'completions': {'model': 'tiny', 'max_tokens': 1, 'prompt': ['a', 'b'], 'stop': ['x']},
         'responses': {'model': 'tiny', 'max_output_tokens': 1, 'store': False,
                       'input': [{'role': 'user', 'content': [{'type': 'input_text', 'text': 'hi'}]}],
                       'tools': [{'type': 'function', 'name': 'ls', 'parameters': {'type': 'object'}}]},
         'messages': {'model': 'tiny', 'max_tokens': 1, 'messages': [{'role': 'user', 'content': [
             {'type': 'text', 'text': 'hi'}]}], 'tools': [{'name': 'ls', 'input_schema': {'type': 'object'}}],
             'stop_sequences': ['x']}}


@pytest.fixture(scope='module')
def client(tiny_qwen3):
    from starlette.testclient import TestClient

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.pipeline import Pipeline
    pipe = Pipeline(tiny_qwen3, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                    block_size=16))
    with TestClient(create_app(pipe, 'tiny')) as c:
        yield c
    pipe.close()


def _location_of(api: str, response) -> str | None:
    """The location a 400 names, after checking its body has the API's error shape and that the
    message starts with it."""
    body = response.json()
    if api == 'messages':
        assert set(body) == {'type', 'error'} and body['error']['type'] == 'invalid_request_error', body
        match = LOCATION.match(body['error']['message'])
        assert match is not None and body['error']['message'][match.end():].startswith(': '), body
        return match.group(0)
    err = body['error']
    assert set(err) == {'message', 'type', 'param', 'code'} and err['type'] == 'invalid_request_error', body
    if err['param'] is not None:
        assert LOCATION.fullmatch(err['param']) and err['message'].startswith(err['param'] + ': '), err
    return err['param']


BAD = [
    ('chat', {'messages': [{'role': 'user', 'content': None}]}, 'messages[0].content'),
    ('chat', {'messages': MSG + [{'role': 'user'}]}, 'messages[1].content'),
    ('chat', {'messages': [{'role': 'user', 'content': []}]}, 'messages[0].content'),
    ('chat', {'messages': [{'role': 'system', 'content': None}, *MSG]}, 'messages[0].content'),
    ('chat', {'messages': [{'role': 'developer'}, *MSG]}, 'messages[0].content'),
    ('chat', {'messages': MSG + [{'role': 'assistant', 'content': None, 'tool_calls': [CALL]},
                                 {'role': 'tool', 'tool_call_id': 'c1', 'content': None}]}, 'messages[2].content'),
    ('chat', {'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text'}]}]},
     'messages[0].content[1].text'),
    ('chat', {'messages': MSG + [{'role': 'assistant', 'tool_calls': [{'function': {'name': 'f'}}]}]},
     'messages[1].tool_calls[0].function.arguments'),
    ('chat', {'stop': ['a', 7]}, 'stop[1]'),
    ('chat', {'messages': [{'role': 'user', 'content': [{'text': 'a'}]}]}, 'messages[0].content[0].type'),
    ('chat', {'tools': [TOOL, {'type': 'function', 'function': {}}]}, 'tools[1].function.name'),
    ('chat', {'tools': [TOOL, {'type': 'function', 'function': {'name': ' '}}]}, 'tools[1].function.name'),
    ('chat', {'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'array'}}}]},
     'tools[0].function.parameters'),
    ('chat', {'tools': [TOOL], 'tool_choice': {'type': 'function', 'function': {}}}, 'tool_choice.function.name'),
    ('chat', {'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': 5}}},
     'response_format.json_schema.schema'),
    ('chat', {'logit_bias': {'5': 101}}, 'logit_bias.5'),
    ('chat', {'top_logprobs': 2}, 'top_logprobs'),
    ('chat', {'n': 0}, 'n'),
    ('chat', {'modalities': ['text', 'audio']}, 'modalities'),
    ('chat', {'audio': {'voice': 'alloy', 'format': 'wav'}}, 'audio'),
    ('chat', {'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'},
                                                        {'type': 'image_url', 'image_url': {'url': 'data:,'}}]}]},
     'messages[0].content[1]'),
    ('completions', {'prompt': [[1, 2], [3, 'x']]}, 'prompt[1][1]'),
    ('completions', {'prompt': ['a', 5]}, 'prompt[1]'),
    ('completions', {'stop': [None]}, 'stop[0]'),
    ('completions', {'n': 100}, 'prompt'),
    ('completions', {'prompt': 'a', 'n': 200}, 'n'),
    ('responses', {'input': [{'role': 'user', 'content': [{'type': 'input_text'}]}]}, 'input[0].content[0].text'),
    ('responses', {'input': [{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': None}]},
     'input[1].content'),
    ('responses', {'tools': [{'type': 'function', 'name': 'ls'}, {'type': 'function', 'name': ''}]},
     'tools[1].name'),
    ('responses', {'tools': [{'type': 'function', 'name': 'f', 'parameters': {'type': 'array'}}]},
     'tools[0].parameters'),
    ('responses', {'tools': [{'type': 'code_interpreter'}]}, 'tools[0]'),
    ('responses', {'text': {'format': {'type': 'json_schema', 'name': 'x'}}}, 'text.format.schema'),
    ('responses', {'input': [{'role': 'user', 'content': [{'type': 'input_text', 'text': 'a'},
                                                          {'type': 'input_image', 'image_url': 'data:,'}]}]},
     'input[0].content[1]'),
    ('messages', {'messages': [{'role': 'user', 'content': None}]}, 'messages[0].content'),
    ('messages', {'messages': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'},
                               {'role': 'user', 'content': []}]}, 'messages[2].content'),
    ('messages', {'messages': [{'role': 'user', 'content': [{'type': 'text'}]}]}, 'messages[0].content[0].text'),
    ('messages', {'tools': [{'name': 'a', 'input_schema': {}}, {'name': ' ', 'input_schema': {}}]}, 'tools[1].name'),
    ('messages', {'tools': [{'name': 'f', 'input_schema': {'type': 'array'}}]}, 'tools[0].input_schema'),
    ('messages', {'stop_sequences': ['a', 3]}, 'stop_sequences[1]'),
    ('messages', {'messages': [{'role': 'user', 'content': [{'text': 'a'}]}]}, 'messages[0].content[0].type'),
]


@pytest.mark.parametrize('api, change, where', BAD, ids=[f'{a}:{w}' for a, _, w in BAD])
def test_a_400_names_the_field_in_openais_form(client, api, change, where):
    r = client.post(PATHS[api], json=dict(VALID[api], **change))
    assert r.status_code == 400, r.text
    assert _location_of(api, r) == where


@pytest.mark.parametrize('api, change, message', [
    ('chat', {'cache_salt': ''}, 'cache_salt: must not be empty'),
    ('chat', {'cache_salt': 'x' * 1025}, 'cache_salt: must have at most 1024 characters, got 1025'),
    ('chat', {'messages': [{'role': '', 'content': 'x'}]}, 'messages[0].role: must not be empty'),
    ('responses', {'input': ''}, 'input: must not be empty'),
    ('responses', {'input': []}, 'input: must not be empty'),
    ('messages', {'messages': []}, 'messages: must not be empty'),
    ('chat', {'messages': []}, 'messages: must not be empty'),
    ('chat', {'response_format': 'json'}, 'response_format: Input should be a JSON object'),
    ('messages', {'tools': [5]}, 'tools[0]: Input should be a JSON object'),
    ('chat', {'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'nope'}}}},
     'response_format: the schema cannot be used for constrained decoding: Unsupported type "nope"'),
    ('responses', {'text': {'format': {'type': 'json_schema', 'name': 'x', 'schema': {'type': 'nope'}}}},
     'text.format: the schema cannot be used for constrained decoding: Unsupported type "nope"'),
])
def test_a_400_message_speaks_the_clients_terms(client, api, change, message):
    """A length bound reads in characters or items (not pydantic's "items after validation"), a
    non-object where an object belongs says so in JSON's words; a schema the grammar compiler
    refuses is named by the client's field alone (not also by the engine's
    structured_output.json_schema)."""
    r = client.post(PATHS[api], json=dict(VALID[api], **change))
    assert r.status_code == 400 and r.json()['error']['message'] == message, r.text
    assert _location_of(api, r) == message.split(':')[0]


@pytest.mark.parametrize('api', sorted(PATHS))
def test_an_empty_or_non_object_body_says_what_to_send(client, api):
    for raw, message in ((b'', 'request body: empty; send a JSON object'),
                         (b'[1]', 'request body: Input should be a JSON object')):
        r = client.post(PATHS[api], content=raw, headers={'Content-Type': 'application/json'})
        assert r.status_code == 400, r.text
        body = r.json()
        assert (body['error']['message'], body.get('type', 'error')) == (message, 'error'), body
        assert api == 'messages' or body['error']['param'] is None


def test_an_assistant_message_may_have_no_content_and_text_output_is_served(client):
    """Only roles whose messages need content refuse null: an assistant message that only calls
    tools (and one with neither content nor calls) is served."""
    for assistant in ({'role': 'assistant', 'content': None, 'tool_calls': [CALL]},
                      {'role': 'assistant', 'tool_calls': [CALL]}):
        messages = MSG + [assistant, {'role': 'tool', 'tool_call_id': 'c1', 'content': '[]'},
                          {'role': 'user', 'content': 'and now?'}]
        r = client.post(PATHS['chat'], json=dict(VALID['chat'], messages=messages))
        assert r.status_code == 200, r.text
    r = client.post(PATHS['chat'], json=dict(VALID['chat'], messages=MSG + [{'role': 'assistant', 'content': None}]))
    assert r.status_code == 200, r.text
    # text output asked for explicitly is what is served
    assert client.post(PATHS['chat'], json=dict(VALID['chat'], modalities=['text'])).status_code == 200


# values of every JSON kind, none of which fits most fields
WRONG = st.sampled_from([None, 0, -1, 2 ** 64, 1.5, -1e300, True, '', 'x', [], [None], ['x', 1], {}, {'a': 1}])


def _places(node, path=()):
    """Every location inside a JSON value (the value itself excluded), as key / index tuples."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield path + (key,)
        yield from _places(value, path + (key,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_body_broken_anywhere_is_a_4xx_in_one_form_and_the_server_serves_on(client, data):
    """Fuzz over the class: a valid body of any API with one value replaced by a value of another
    kind is served or refused, never a 5xx; a 400 has its API's error shape and names a location
    in OpenAI's form, at the start of its message."""
    api = data.draw(st.sampled_from(sorted(PATHS)))
    body = copy.deepcopy(VALID[api])
    place = data.draw(st.sampled_from([p for p in _places(body) if p != ('model',)]))
    node = body
    for key in place[:-1]:
        node = node[key]
    node[place[-1]] = data.draw(WRONG)
    r = client.post(PATHS[api], json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code == 400:
        where = _location_of(api, r)
        assert where is None or not re.search(r'\.\d', where), where
    assert client.post(PATHS['chat'], json=dict(VALID['chat'], tools=None)).status_code == 200


METHODS = ('GET', 'POST', 'PUT', 'PATCH', 'DELETE', 'HEAD', 'OPTIONS')


def _error_shape(path: str, response, status: int) -> dict:
    """The error of a routing refusal: ``status``, the API's error body (none for HEAD), never
    FastAPI's ``{"detail": ...}``."""
    assert response.status_code == status, (path, response.status_code, response.text)
    if response.request.method == 'HEAD':
        return {}
    body = response.json()
    if path.startswith('/v1/messages'):
        assert set(body) == {'type', 'error'} and set(body['error']) == {'type', 'message'}, body
    else:
        assert set(body) == {'error'} and set(body['error']) == {'message', 'type', 'param', 'code'}, body
        assert body['error']['type'] == 'invalid_request_error', body
    return body['error']


def test_every_route_answers_a_method_it_does_not_serve_with_405_and_allow(client):
    """Over every registered route x method: a path the server serves (no path parameter) with
    a method it does not serve there is a 405 naming the method, with ``Allow`` listing the
    methods it does serve; a path only a template with a parameter matches is a 404 for such a
    method (``POST /v1/responses/compact`` is another endpoint, not a response id)."""
    from starlette.routing import Route
    served: dict[str, set[str]] = {}        # route path -> its methods (one route per method or several)
    for route in client.app.routes:
        if isinstance(route, Route):
            served.setdefault(route.path, set()).update(route.methods)
    assert {'/v1/chat/completions', '/v1/responses/{response_id}', '/v1/models/{model_id:path}'} <= set(served)
    for template, methods in served.items():
        static = '{' not in template
        path = template if static else re.sub(r'\{[^}]+\}', 'compact', template)
        for method in METHODS:
            if method in methods:
                continue
            r = client.request(method, path)
            if static:
                error = _error_shape(path, r, 405)
                assert set(r.headers['allow'].split(', ')) == methods, (path, r.headers)
                assert not error or error['message'] == f'method {method} is not allowed on {path}', error
            else:
                error = _error_shape(path, r, 404)
                assert not error or error['message'] == f'no such endpoint: {method} {path}', error


@pytest.mark.parametrize('path', ['/v1/responses/compact', '/v1/responses/resp_1/cancel', '/v1/nope', '/v1/',
                                  '/v1', '/v1/chat/completions/', '/v1/chat', '/v1/messages/nope', '/nope'])
def test_an_unknown_endpoint_is_a_404_with_the_apis_error_body(client, path):
    """What OpenAI answers for a URL it does not serve: 404 and its error body, for any method."""
    for method in METHODS:
        r = client.request(method, path, json={} if method in ('POST', 'PUT', 'PATCH') else None)
        error = _error_shape(path, r, 404)
        if path == '/v1/responses/compact' and method in ('GET', 'DELETE'):     # a stored response's id
            assert error['code'] == 'not_found' and error['param'] == 'response_id', error
        else:
            assert not error or error['message'] == f'no such endpoint: {method} {path}', error


def test_a_role_the_template_leaves_out_is_a_400_naming_it(client):
    """A template that skips roles it does not know (as Qwen3's does) served a mistyped role
    ("usr") as if the message had not been sent; a role outside OpenAI's whose text the prompt
    lacks is refused, naming the message's role. A template that renders it serves it, in
    whatever form (a rendering without the message decides, not a search for its text)."""
    tok = client.app.state.server.pipe.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m['role'] in ('user', 'assistant', 'system') %}"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "<|im_start|>assistant\n")
    try:
        for messages, where in (([{'role': 'usr', 'content': 'Go on.'}], 0),
                                (MSG + [{'role': 'narrator', 'content': [{'type': 'text', 'text': 'Once.'}]}], 1)):
            r = client.post(PATHS['chat'], json=dict(VALID['chat'], messages=messages))
            assert r.status_code == 400, r.text
            assert r.json()['error'] == {
                'message': f'messages[{where}].role: the chat template does not render role '
                           f'{messages[where]["role"]!r} (it left the message out); use one of user, assistant, '
                           'system, developer, tool', 'type': 'invalid_request_error',
                'param': f'messages[{where}].role', 'code': 'invalid_value'}, r.text
        # an empty custom message leaves nothing out; OpenAI's roles are the template's own affair
        assert client.post(PATHS['chat'], json=dict(VALID['chat'], messages=MSG + [
            {'role': 'narrator', 'content': ''}])).status_code == 200
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}<|im_start|>assistant\n")
        r = client.post(PATHS['chat'], json=dict(VALID['chat'], messages=[{'role': 'usr', 'content': 'Go on.'}]))
        assert r.status_code == 200, r.text
        # a template that renders a custom role transformed (Llama 3's ipython role as JSON: quotes
        # and newlines escaped) renders it: served, though its text is not in the prompt as sent
        tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'ipython' %}<|tool|>{{ m['content'] | tojson }}"
                             "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
                             "{% endfor %}<|im_start|>assistant\n")
        r = client.post(PATHS['chat'], json=dict(VALID['chat'], messages=MSG + [
            {'role': 'ipython', 'content': 'the tool said "42"\nand stopped'}]))
        assert r.status_code == 200, r.text
    finally:
        tok.chat_template = saved
    assert client.post(PATHS['chat'], json=VALID['chat']).status_code == 200
