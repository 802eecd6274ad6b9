"""The front door: every request field is checked once, by the engine's RequestFactory, and a bad
one is refused with its name; the ``n`` choices of a request are checked once, not per choice.

One in-process app over the tiny Qwen3 (session_len 64, so a long prompt is cheap).
"""
from __future__ import annotations

import pytest

from lmdeploy import GenerationConfig
from lmdeploy.messages import StructuredOutput
from lmdeploy.pytorch.engine.requests import RequestError
from lmdeploy.pytorch.multimodal import MultimodalInput

SESSION_LEN = 64


@pytest.fixture(scope='module')
def client(tiny_qwen3):
    from starlette.testclient import TestClient

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.pipeline import Pipeline
    pipe = Pipeline(tiny_qwen3, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=32,
                                                    block_size=16, session_len=SESSION_LEN))
    with TestClient(create_app(pipe, 'tiny')) as c:
        c.pipe = pipe
        yield c
    pipe.close()


@pytest.fixture
def counted(client, monkeypatch):
    """Calls of the factory's check (per request) and of its per-token prompt check, counted."""
    factory = client.pipe.engine.requests
    calls = {'check': 0, 'prompt': 0, 'sequence': 0}

    def counting(name, key):
        inner = getattr(factory, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return inner(*args, **kwargs)
        monkeypatch.setattr(factory, name, wrapper)
    counting('check', 'check')
    counting('_check_prompt', 'prompt')
    counting('sequence', 'sequence')
    return calls


def _cases(vocab: int):
    """(field, token ids, check keywords, exact message or its start) per refused field."""
    schema = StructuredOutput(type='json_schema', json_schema={'type': 'objectx'})
    image = MultimodalInput(0, 2, b'\0' * 16, {'pixel_values': None})
    return [
        ('prompt', [], {}, 'the prompt is empty: at least 1 token is required'),
        ('prompt', [5, vocab], {}, f'token id {vocab} is outside the vocabulary [0, {vocab})'),
        ('prompt', list(range(3, 3 + SESSION_LEN)), {}, f'the prompt has {SESSION_LEN} tokens, which does not fit '
         f'session_len={SESSION_LEN} (at most {SESSION_LEN - 1} prompt tokens); '),
        ('stop_token_ids', [5], {'gen_config': GenerationConfig(stop_token_ids=[vocab])},
         f'stop_token_ids: {vocab} is outside the vocabulary [0, {vocab})'),
        ('logit_bias', [5], {'gen_config': GenerationConfig(logit_bias={vocab + 1: 1.0})},
         f'logit_bias: token id {vocab + 1} is outside the vocabulary [0, {vocab})'),
        ('structured_output', [5], {'gen_config': GenerationConfig(structured_output=schema)},
         'structured_output.json_schema'),
        ('multimodal', [5, 6, 7], {'multimodal': (image,)},
         "model_type 'qwen3' does not accept images in this engine"),
        ('multimodal', [5], {'multimodal': (MultimodalInput(0, 2, b'\0' * 16, None),)},
         'a multimodal span ends past the prompt of 1 tokens'),
        ('shared_head_tokens', [5], {'shared_head_tokens': -1}, 'shared_head_tokens must be None or an int >= 0, '
         'got -1'),
    ]


def test_each_bad_field_is_refused_with_its_name(client):
    factory = client.pipe.engine.requests
    cases = _cases(factory.vocab_size)
    assert {c[0] for c in cases} == {'prompt', 'stop_token_ids', 'logit_bias', 'structured_output', 'multimodal',
                                     'shared_head_tokens'}
    for field, ids, kwargs, message in cases:
        kwargs = dict(kwargs)
        gen = kwargs.pop('gen_config', None)
        with pytest.raises(RequestError) as err:
            factory.check(ids, gen, **kwargs)
        assert err.value.field == field, (field, str(err.value))
        assert str(err.value).startswith(message), (field, str(err.value))
        assert isinstance(err.value, ValueError)        # callers that catch ValueError still do


def test_a_request_bad_in_an_option_and_its_prompt_is_refused_for_the_option(client):
    factory = client.pipe.engine.requests
    vocab = factory.vocab_size
    with pytest.raises(RequestError) as err:
        factory.check([], GenerationConfig(logit_bias={vocab: 1.0}))
    assert err.value.field == 'logit_bias'


def test_a_good_request_becomes_choices_that_differ_only_in_their_seed(client):
    factory = client.pipe.engine.requests
    request = factory.check([5, 6, 7], GenerationConfig(max_new_tokens=3, random_seed=1), shared_head_tokens=2)
    other = request.choice(9)
    assert other.gen_config.random_seed == 9 and request.gen_config.random_seed == 1
    assert other.gen_config.model_copy(update={'random_seed': 1}) == request.gen_config
    assert (other.token_ids, other.shared_head_tokens) == (request.token_ids, request.shared_head_tokens) == \
        ((5, 6, 7), 2)
    seq = factory.sequence(other)
    assert seq.token_ids == [5, 6, 7] and seq.shared_head_tokens == 2 and seq.gen_config.random_seed == 9


def test_a_multi_choice_request_is_checked_once(client, counted):
    r = client.post('/v1/completions', json={'model': 'tiny', 'prompt': [[5, 6, 7], [8, 9]], 'n': 3,
                                             'max_tokens': 2, 'temperature': 0.5, 'seed': 4})
    assert r.status_code == 200, r.text
    assert len(r.json()['choices']) == 6
    # one check per prompt (its options and its token ids once), one sequence per choice
    assert counted == {'check': 2, 'prompt': 2, 'sequence': 6}
    counted.update(check=0, prompt=0, sequence=0)
    r = client.post('/v1/chat/completions', json={'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}],
                                                  'n': 3, 'max_tokens': 2})
    assert r.status_code == 200, r.text
    assert len(r.json()['choices']) == 3
    assert counted == {'check': 1, 'prompt': 1, 'sequence': 3}


@pytest.mark.parametrize('param', ['logit_bias', 'prompt'])
def test_a_bad_field_is_one_400_naming_it(client, counted, param):
    vocab = client.pipe.engine.requests.vocab_size
    body = {'model': 'tiny', 'n': 4, 'max_tokens': 2, 'prompt': [[5, 6, 7]]}
    if param == 'logit_bias':
        body['logit_bias'] = {str(vocab): 5}
        message = f'logit_bias: token id {vocab} is outside the vocabulary [0, {vocab})'
    else:
        body['prompt'] = [[5, vocab]]
        message = f'prompt: token id {vocab} is outside the vocabulary [0, {vocab})'
    r = client.post('/v1/completions', json=body)
    assert r.status_code == 400, r.text
    error = r.json()['error']
    assert (error['param'], error['code'], error['type']) == (param, 'invalid_value', 'invalid_request_error')
    assert error['message'] == message
    # checked once for the 4 choices: the options, then the prompt (not reached for a bad option)
    assert counted == {'check': 1, 'prompt': 1 if param == 'prompt' else 0, 'sequence': 0}
    assert client.pipe.ledger()['requests_waiting'] == 0
