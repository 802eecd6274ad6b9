"""Request validation of the OpenAI-compatible API, over every field of the request models
(no server): an explicit ``null`` is the field's default, values of the wrong JSON type are
refused (no coercion) with a 400 naming the field, and the error of a field that takes several
shapes points at the element that is wrong."""
from __future__ import annotations

import asyncio
import json
import typing

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from lmdeploy.serve.openai.errors import _validation_error
from lmdeploy.serve.openai.protocol import ChatCompletionRequest, CompletionRequest

MINIMAL = {ChatCompletionRequest: {'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]},
           CompletionRequest: {'model': 'm', 'prompt': 'hi'}}
MODELS = list(MINIMAL)


def _error(model, body: dict) -> dict:
    """The OpenAI error object the server answers ``body`` with (``None`` when it is valid)."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        response = asyncio.run(_validation_error(None, RequestValidationError(exc.errors(), body=body)))
        assert response.status_code == 400
        return json.loads(response.body)['error']
    return None


def _scalar_kinds(annotation) -> set[type]:
    """The JSON scalar types a field annotation accepts (bool/int/float/str), ignoring None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _scalar_kinds(args[0])
    if args and typing.get_origin(annotation) in (typing.Union, getattr(__import__('types'), 'UnionType')):
        return set().union(*(_scalar_kinds(a) for a in args))
    return {annotation} & {bool, int, float, str}


def _fields(model):
    for name, field in model.model_fields.items():
        yield name, field, _scalar_kinds(field.annotation)


@pytest.mark.parametrize('model', MODELS, ids=lambda m: m.__name__)
def test_null_is_the_default_for_every_optional_field(model):
    base = model.model_validate(MINIMAL[model])
    checked = 0
    for name, field, _ in _fields(model):
        if field.is_required():
            continue
        got = model.model_validate(dict(MINIMAL[model], **{name: None}))
        assert getattr(got, name) == getattr(base, name), name
        checked += 1
    assert checked >= 15


WRONG = {bool: [1, 0, 'yes', 'true'], int: ['3', True, 2.5], float: ['0.5', True], str: [5, True, 1.5]}


@pytest.mark.parametrize('model', MODELS, ids=lambda m: m.__name__)
def test_a_value_of_the_wrong_type_is_a_400_naming_the_field(model):
    checked = 0
    for name, field, kinds in _fields(model):
        if not kinds:
            continue
        for value in WRONG[next(iter(kinds))] if len(kinds) == 1 else []:
            if isinstance(value, bool) and bool in kinds or isinstance(value, int) and not isinstance(value, bool) \
                    and (int in kinds or float in kinds) or isinstance(value, float) and float in kinds:
                continue
            err = _error(model, dict(MINIMAL[model], **{name: value}))
            assert err is not None, (name, value)
            assert err['param'] == name and err['message'].startswith(name + ': '), (name, value, err)
            assert err['code'] == 'invalid_value'
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize('body, param, says', [
    ({'stop': ['a', 'b', 7]}, 'stop[2]', 'string'),
    ({'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'audio'}]}]},
     'messages[0].content[1]', "unsupported type 'audio'"),
    ({'messages': [{'role': 'user', 'content': [{'type': 'text'}]}]}, 'messages[0].content[0].text', 'required'),
    ({'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {}}]}]},
     'messages[0].content[0].image_url.url', 'required'),
    ({'tool_choice': {'type': 'function'}}, 'tool_choice.function', 'required'),
    ({'messages': [{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'tool_calls': [{'function': {}}]}]},
     'messages[1].tool_calls[0].function.name', 'required'),
])
def test_the_error_of_a_several_shaped_field_names_the_wrong_element(body, param, says):
    err = _error(ChatCompletionRequest, dict(MINIMAL[ChatCompletionRequest], **body))
    assert err['param'] == param and says in err['message'], err


def test_a_valid_request_passes_and_keeps_its_values():
    body = dict(MINIMAL[ChatCompletionRequest], temperature=1, top_p=0.5, n=2, stream=True,
                stream_options={'include_usage': True}, response_format={'type': 'text'}, logprobs=True,
                top_logprobs=2, max_tokens=7)
    req = ChatCompletionRequest.model_validate(body)
    assert (req.temperature, req.top_p, req.n, req.max_new(), req.top_logprobs) == (1.0, 0.5, 2, 7, 2)
    assert isinstance(req, BaseModel) and _error(ChatCompletionRequest, body) is None
