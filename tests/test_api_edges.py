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
