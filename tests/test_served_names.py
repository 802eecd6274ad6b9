"""Agent CLIs on the first try: a server answers to several model names (``--model-name a b c``:
``/v1/models`` lists them, every endpoint serves any of them, an unknown one is a 404 listing
them), and a prompt longer than ``session_len`` is a 400 that names the flag raising it and what
set the limit (the model's ``max_position_embeddings`` by default)."""
from __future__ import annotations

import pytest

from engine_utils import make_engine

NAMES = ['local', 'claude-opus-4-8', 'gpt-6.2-sol']


@pytest.fixture(scope='module')
def client(tiny_qwen3):
    """An in-process app over the tiny Qwen3 served as NAMES; no session_len, so it is the
    model's max_position_embeddings (32768): the cache holds exactly that many tokens."""
    from starlette.testclient import TestClient

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.pipeline import Pipeline
    pipe = Pipeline(tiny_qwen3, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=2048,
                                                    block_size=16))
    assert pipe.engine.session_len == 32768
    with TestClient(create_app(pipe, NAMES)) as c:
        yield c
    pipe.close()


def test_models_lists_every_served_name_first_first(client):
    r = client.get('/v1/models')
    assert r.status_code == 200 and [m['id'] for m in r.json()['data']] == NAMES
    for name in NAMES:
        r = client.get(f'/v1/models/{name}')
        assert r.status_code == 200 and r.json()['id'] == name


@pytest.mark.parametrize('name', NAMES)
def test_every_endpoint_serves_each_name(client, name):
    msg = [{'role': 'user', 'content': 'hi'}]
    chat = client.post('/v1/chat/completions', json={'model': name, 'messages': msg, 'max_tokens': 2})
    comp = client.post('/v1/completions', json={'model': name, 'prompt': 'hi', 'max_tokens': 2})
    resp = client.post('/v1/responses', json={'model': name, 'input': 'hi', 'max_output_tokens': 2})
    anth = client.post('/v1/messages', json={'model': name, 'messages': msg, 'max_tokens': 2})
    assert [r.status_code for r in (chat, comp, resp, anth)] == [200] * 4, [r.text for r in (chat, comp, resp, anth)]
    assert chat.json()['model'] == comp.json()['model'] == NAMES[0]        # replies name the first


def test_an_unknown_name_is_a_404_listing_the_served_names(client):
    for path, body in (('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}]}),
                       ('/v1/completions', {'prompt': 'hi'})):
        r = client.post(path, json={'model': 'claude-haiku-9', 'max_tokens': 2, **body})
        assert r.status_code == 404, r.text
        error = r.json()['error']
        assert error['code'] == 'model_not_found' and error['param'] == 'model'
        assert error['message'] == ("the model 'claude-haiku-9' does not exist; this server serves 'local', "
                                    "'claude-opus-4-8', 'gpt-6.2-sol' (start it with --model-name NAME [NAME ...] "
                                    "to serve more names)")
    assert client.get('/v1/models/claude-haiku-9').status_code == 404


def test_a_prompt_over_session_len_is_a_400_naming_the_flag_and_the_models_limit(client):
    """Claude Code's first prompt (about 48K tokens) against the tiny model: the 400 said only that
    the prompt did not fit session_len=32768."""
    r = client.post('/v1/chat/completions', json={'model': 'local', 'max_tokens': 2,
                                                  'messages': [{'role': 'user', 'content': 'hello ' * 14000}]})
    assert r.status_code == 400, r.text
    message = r.json()['error']['message']
    assert 'which does not fit session_len=32768 (at most 32767 prompt tokens); session_len defaults to ' \
           "max_position_embeddings of the model's config.json; restart with a larger --session-len " \
           '(session_len), e.g. --session-len 65536' in message, message


def test_the_too_long_message_names_what_set_session_len(tiny_qwen3):
    explicit = make_engine(tiny_qwen3, session_len=100, block_size=16, num_gpu_blocks=64)
    with pytest.raises(ValueError) as err:
        explicit.requests.check(list(range(3, 153)), __import__('lmdeploy').GenerationConfig())
    assert str(err.value) == ('the prompt has 150 tokens, which does not fit session_len=100 (at most 99 prompt '
                              'tokens); restart with a larger --session-len (session_len), e.g. '
                              '--session-len 256')
    small_cache = make_engine(tiny_qwen3, block_size=16, num_gpu_blocks=4)      # 64 tokens < 32768
    with pytest.raises(ValueError) as err:
        small_cache.requests.check(list(range(3, 103)), __import__('lmdeploy').GenerationConfig())
    assert str(err.value).endswith('session_len=64 (at most 63 prompt tokens); the KV cache holds only 4 blocks x '
                                   '16 tokens: give it more with --num-gpu-blocks (num_gpu_blocks) or '
                                   '--cache-max-entry-count (cache_max_entry_count)'), str(err.value)
