"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns has the body::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

except under ``/v1/messages`` (the Anthropic Messages API), whose errors have Anthropic's shape::

    {"type": "error", "error": {"type": "invalid_request_error" | "authentication_error" | ..., "message": str}}

A location in the request (``param``, and the start of a 400's message) is written as OpenAI
writes it: keys joined by dots, list indices in brackets (``messages[0].content``,
``tools[1].function.parameters``; :func:`param_path`), in every API, Anthropic's included.

A path no route serves is a 404 (``no such endpoint: METHOD PATH``); a served path with a method
it does not serve is a 405 with ``Allow``, where "served" means a route without path parameters
has that path (a path only a parameter template matches, such as ``POST /v1/responses/compact``
against ``/v1/responses/{response_id}``, is a 404).

Invariant: a client mistake maps to a 4xx (pydantic validation errors and malformed JSON
become 400, not FastAPI's 422); only a server bug produces a 5xx, and no handler lets an
exception escape, so the server keeps serving after any bad request.
"""
from __future__ import annotations

import email.message
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ['APIError', 'error_body', 'error_body_for', 'api_error_from_validation', 'install_error_handlers',
           'param_path', 'located_error', 'ANTHROPIC_PREFIX']

logger = logging.getLogger('lmdeploy')

_TYPES = {400: 'invalid_request_error', 401: 'invalid_request_error', 403: 'permission_error',
          404: 'invalid_request_error', 405: 'invalid_request_error', 413: 'invalid_request_error',
          429: 'rate_limit_error'}


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body.

    Args:
        status: HTTP status code.
        message: human-readable explanation (shown to the client).
        param: the request field at fault, if any, as :func:`param_path` writes it (e.g.
            ``messages[0].role``).
        code: a machine-readable code (``invalid_api_key``, ``model_not_found`` ...).
        type: the OpenAI error type; default derived from ``status``.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, 'server_error' if status >= 500 else 'invalid_request_error')


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The OpenAI error JSON object (also sent as an SSE event when a stream fails)."""
    return {'error': {'message': message, 'type': type, 'param': param, 'code': code}}


ANTHROPIC_PREFIX = '/v1/messages'
_ANTHROPIC_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 403: 'permission_error',
                    404: 'not_found_error', 405: 'invalid_request_error', 413: 'request_too_large',
                    429: 'rate_limit_error', 503: 'overloaded_error'}


def error_body_for(path: str, status: int, message: str, type: str, param: str | None = None,
                   code: str | int | None = None) -> dict:
    """The error body a client of ``path`` expects: Anthropic's shape under ``/v1/messages``
    (its error type derived from ``status``), OpenAI's elsewhere."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + '/'):
        return {'type': 'error', 'error': {'type': _ANTHROPIC_TYPES.get(status, 'api_error'), 'message': message}}
    return error_body(message, type, param, code)


def _response(err: APIError, request: Request | None = None) -> JSONResponse:
    path = request.url.path if request is not None else ''
    return JSONResponse(error_body_for(path, err.status, err.message, err.type, err.param, err.code),
                        status_code=err.status)


def api_error_from_validation(errors: list[dict], body=None, rename: dict[str, str] | None = None) -> APIError:
    """A 400 for pydantic ``errors`` (``ValidationError.errors()``) of a request body, naming the
    field as :func:`install_error_handlers` does; ``rename`` maps a field's first path element to
    the name the client used (a request translated into another API's fields)."""
    return _validation_api_error(errors, _MISSING if body is None else body, rename)


def _validation_api_error(errors: list[dict], body, rename: dict[str, str] | None = None) -> APIError:
    # the deepest location: of the errors a union produces (one per member tried), the member
    # whose shape the value has gets furthest (a list of parts rather than the string branch);
    # at equal depth, the one that accepted more list items first (["a", 5] fails the strings
    # branch at [1], after "a" passed, and the token-ids branch at [0])
    first = errors[0] if errors else {'loc': (), 'msg': 'invalid request', 'type': 'invalid'}
    located = [(_location(e.get('loc', ()), body) + _tag_key(e), e) for e in errors] or [((), first)]
    parts, chosen = max(located, key=lambda pe: (len(pe[0]), [p for p in pe[0] if isinstance(p, int)]))
    if parts and rename and isinstance(parts[0], str):
        parts = (rename.get(parts[0], parts[0]), *parts[1:])
    param = param_path(parts)
    if param is None and chosen.get('type') == 'missing':       # FastAPI's error for no body at all
        message = 'request body: empty; send a JSON object'
    else:
        message = f'{param or "request body"}: {_describe(chosen)}'
    if len(errors) > 1:
        message += f' (and {len(errors) - 1} more error(s))'
    return APIError(400, message, param=param, code='invalid_value')


def _tag_key(error: dict) -> tuple:
    """``('type',)`` for an object of a tagged union that lacks its tag key (``{"text": "a"}``
    as a content part): the error is about that missing key, as a missing field's is."""
    key = str((error.get('ctx') or {}).get('discriminator', '')).strip("'")
    return (key,) if error.get('type') == 'union_tag_not_found' and key.isidentifier() else ()


def param_path(parts) -> str | None:
    """A location in a request as OpenAI's errors write it: keys joined by dots, list indices in
    brackets; ``('tools', 0, 'function', 'name')`` -> ``'tools[0].function.name'``, ``('stop',
    2)`` -> ``'stop[2]'``; ``None`` for the whole body (no parts). A key is written as given
    (``logit_bias.50256``: an object key, not an index)."""
    out = ''
    for p in parts:
        if isinstance(p, int) and not isinstance(p, bool):
            out += f'[{p}]'
        else:
            out += f'.{p}' if out else str(p)
    return out or None


def located_error(message: str, field: str, code: str = 'invalid_value') -> APIError:
    """A 400 about the request field ``field`` (``messages``, ``input``) whose ``message`` may
    already start with a location inside it (``messages[0].content[1]: not an image``, from a
    check that knew the part): ``param`` is then that location, as a validation error of the same
    part would name it; otherwise ``param`` is ``field`` and the message gets ``field: `` in front.
    """
    match = re.match(rf'({re.escape(field)}(?:\[\d+\]|\.\w+)*): ', message)
    if match is not None:
        return APIError(400, message, param=match.group(1), code=code)
    return APIError(400, f'{field}: {message}', param=field, code=code)


_TYPE_TAGS = frozenset({'str', 'int', 'float', 'bool', 'list', 'dict', 'none'})
_MISSING = object()


def _location(loc, body=_MISSING) -> tuple:
    """The request field an error's location points at, as parts: ``('messages', 0, 'content',
    1)`` (list indices as ints, keys as strings; :func:`param_path` writes it).

    Pydantic puts the union member it tried into the location (``'str'``,
    ``'list[tagged-union[...]]'``, a model name, a tag value). With the request ``body`` the
    location is walked through the actual JSON and such entries are skipped (a final key the
    object lacks is kept: a missing field); without it, type-like entries are skipped.
    """
    loc = tuple(loc[1:] if loc and loc[0] == 'body' else loc)
    parts, node = [], body
    for i, p in enumerate(loc):
        if body is not _MISSING:
            if isinstance(node, dict) and isinstance(p, str) and p in node:
                node = node[p]
            elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
                node = node[p]
            elif i == len(loc) - 1 and isinstance(node, dict) and isinstance(p, str) and p.isidentifier():
                pass            # a required key the object lacks
            else:
                continue        # a union member's tag
        elif isinstance(p, str) and (p in _TYPE_TAGS or not p.isidentifier()):
            continue
        parts.append(p)
    return tuple(parts)


def _describe(error: dict) -> str:
    ctx = error.get('ctx') or {}
    if error.get('type') == 'value_error' and 'error' in ctx:
        return str(ctx['error'])          # a validator's own message, without 'Value error, '
    if error.get('type') in ('too_short', 'too_long') and isinstance(error.get('input'), (str, list)):
        # pydantic's "Value / List should have at least 1 item after validation" (a length bound on
        # a string type with its own validator, or on a list): characters or items, plainly
        unit = 'characters' if isinstance(error['input'], str) else 'items'
        if error['type'] == 'too_short':
            bound = ctx.get('min_length')
            return 'must not be empty' if bound == 1 else f'must have at least {bound} {unit}'
        return f'must have at most {ctx.get("max_length")} {unit}, got {len(error["input"])}'
    if error.get('type') in ('model_attributes_type', 'model_type', 'dict_type'):
        # pydantic's "a valid dictionary or object to extract fields from": JSON has objects
        return 'Input should be a JSON object'
    if error.get('type') == 'union_tag_not_found':      # named at the missing key (_tag_key)
        return 'Field required'
    if error.get('type') == 'union_tag_invalid':
        key = str(ctx.get('discriminator', 'type')).strip("'")
        return f'unsupported {key} {ctx.get("tag")!r}; expected one of {ctx.get("expected_tags")}'
    return error['msg']


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return _response(err, request)


def _is_json_media_type(content_type: str) -> bool:
    """Whether FastAPI parses a body of this ``Content-Type`` as JSON: ``application/json`` or
    ``application/*+json`` (parameters such as ``charset`` allowed)."""
    if not content_type:
        return False
    message = email.message.Message()
    message['content-type'] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == 'application' and (subtype == 'json' or subtype.endswith('+json'))


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    errors = err.errors()
    first = errors[0] if errors else {'loc': (), 'msg': 'invalid request', 'type': 'invalid'}
    if first.get('type') == 'json_invalid':
        ctx = first.get('ctx') or {}
        return _response(APIError(400, f'malformed JSON body: {ctx.get("error", first["msg"])}',
                                  code='invalid_json'), request)
    body = getattr(err, 'body', None)
    content_type = request.headers.get('content-type', '') if request is not None else 'application/json'
    if first.get('loc') == ('body',) and first.get('type') in ('model_attributes_type', 'dict_type') \
            and not _is_json_media_type(content_type):
        # FastAPI reads a body as JSON only when it is declared so; anything else arrives as text
        return _response(APIError(400, f'the request body must be a JSON object sent with "Content-Type: '
                                  f'application/json" (got {content_type or "no Content-Type"!r})',
                                  code='invalid_content_type'), request)
    return _response(_validation_api_error(errors, _MISSING if body is None else body), request)


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    try:
        phrase = HTTPStatus(err.status_code).phrase
    except ValueError:
        phrase = 'error'
    message = err.detail if isinstance(err.detail, str) else phrase
    code = None
    if err.status_code == 400:      # only the framework's body parsing raises these (ours are APIError)
        message, code = f'malformed JSON body: {message} (not UTF-8, or nested too deeply)', 'invalid_json'
    status, headers = err.status_code, err.headers or {}
    if status == 405 and not _static_route(request):
        # only a template with a parameter matched (``/v1/responses/{response_id}`` for
        # ``POST /v1/responses/compact``): the path names no endpoint this server has, so it is
        # answered as OpenAI answers a URL it does not serve, not with that template's methods
        status, headers = 404, {}
    if status == 404:
        message = f'no such endpoint: {request.method} {request.url.path}'
    elif status == 405:
        message = f'method {request.method} is not allowed on {request.url.path}'
    response = _response(APIError(status, message, code=code), request)
    for key, value in headers.items():
        response.headers[key] = value
    return response


def _static_route(request: Request) -> bool:
    """Whether a route without path parameters has exactly ``request``'s path (its methods are
    what a 405's ``Allow`` lists)."""
    path = request.scope.get('path', request.url.path)
    return any(getattr(route, 'param_convertors', None) == {} and getattr(route, 'path', None) == path
               for route in request.app.router.routes)


async def _unexpected_error(request: Request, err: Exception) -> JSONResponse:
    logger.exception('unhandled error serving %s %s', request.method, request.url.path)
    return _response(APIError(500, f'internal server error: {type(err).__name__}', code='internal_error'), request)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception raised while serving ``app`` to an OpenAI error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
