"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns has the body::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

Invariant: a client mistake maps to a 4xx (pydantic validation errors and malformed JSON
become 400, not FastAPI's 422); only a server bug produces a 5xx, and no handler lets an
exception escape, so the server keeps serving after any bad request.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ['APIError', 'error_body', 'install_error_handlers']

logger = logging.getLogger('lmdeploy')

_TYPES = {400: 'invalid_request_error', 401: 'invalid_request_error', 403: 'permission_error',
          404: 'invalid_request_error', 405: 'invalid_request_error', 413: 'invalid_request_error',
          429: 'rate_limit_error'}


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body.

    Args:
        status: HTTP status code.
        message: human-readable explanation (shown to the client).
        param: the request field at fault, if any (dotted path, e.g. ``messages.0.role``).
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


def _response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status)


_TYPE_TAGS = frozenset({'str', 'int', 'float', 'bool', 'list', 'dict', 'none'})


def _param(loc) -> str | None:
    """``('body', 'messages', 0, 'content', 'str')`` → ``messages.0.content``: pydantic appends the
    union member it tried (``str``, ``list[int]`` ...) to the location; the client wants the field."""
    parts = []
    for p in loc[1:] if loc and loc[0] == 'body' else loc:
        if isinstance(p, str) and (p in _TYPE_TAGS or not p.isidentifier()):
            break
        parts.append(str(p))
    return '.'.join(parts) or None


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return _response(err)


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    errors = err.errors()
    first = errors[0] if errors else {'loc': (), 'msg': 'invalid request', 'type': 'invalid'}
    if first.get('type') == 'json_invalid':
        ctx = first.get('ctx') or {}
        return _response(APIError(400, f'malformed JSON body: {ctx.get("error", first["msg"])}',
                                  code='invalid_json'))
    param = _param(first.get('loc', ()))
    # a validator's ValueError: its own message, without pydantic's 'Value error, ' prefix
    own = (first.get('ctx') or {}).get('error') if first.get('type') == 'value_error' else None
    message = f'{param or "request body"}: {own if own is not None else first["msg"]}'
    if len(errors) > 1:
        message += f' (and {len(errors) - 1} more error(s))'
    return _response(APIError(400, message, param=param, code='invalid_value'))


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    try:
        phrase = HTTPStatus(err.status_code).phrase
    except ValueError:
        phrase = 'error'
    message = err.detail if isinstance(err.detail, str) else phrase
    if err.status_code == 404:
        message = f'no such endpoint: {request.method} {request.url.path}'
    elif err.status_code == 405:
        message = f'method {request.method} is not allowed on {request.url.path}'
    response = _response(APIError(err.status_code, message))
    for key, value in (err.headers or {}).items():
        response.headers[key] = value
    return response


async def _unexpected_error(request: Request, err: Exception) -> JSONResponse:
    logger.exception('unhandled error serving %s %s', request.method, request.url.path)
    return _response(APIError(500, f'internal server error: {type(err).__name__}', code='internal_error'))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception raised while serving ``app`` to an OpenAI error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
