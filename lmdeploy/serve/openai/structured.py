"""Request fields -> the engine's :class:`~lmdeploy.messages.StructuredOutput` (constrained decoding).

One mapping for every endpoint: chat and completions call it with their own fields, and the
other APIs map theirs onto the same arguments (Responses ``text.format`` is a
``response_format``; Anthropic ``tool_choice`` ``any`` / ``tool`` is ``"required"`` / a named
function)::

    response_format {"type": "json_object"}                 -> json_object
    response_format {"type": "json_schema", "json_schema":
                     {"name", "schema", "strict"}}          -> json_schema
    text.format {"type": "json_schema", "name", "schema",
                 "strict"} (Responses: flat)                -> json_schema
    tool_choice "required" (+ tools)                        -> tool_calls, every tool
    tool_choice {"type": "function", "function": {name}}    -> tool_calls, that tool only
    parallel_tool_calls false                               -> exactly one call

A call's syntax is the server's tool-call parser's format when a grammar is registered for it
(:data:`~lmdeploy.pytorch.engine.guided.TOOL_CALL_FORMATS`, under the parser's name or the
name in its class attribute ``grammar_format``), so what the grammar forces is what the parser
reads back.
"""
from __future__ import annotations

from ...messages import StructuredOutput, ToolSchema

__all__ = ['from_response_format', 'from_tool_choice', 'grammar_tool_format']


def _get(obj, name: str, default=None):
    """``obj.name`` or ``obj[name]`` (pydantic request models and plain dicts alike)."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def from_response_format(response_format) -> StructuredOutput | None:
    """The constraint of a ``response_format`` (a :class:`~.protocol.ResponseFormat` or its dict),
    or None for ``text`` / absent.

    Raises:
        ValueError: ``json_schema`` without a schema object.
    """
    if response_format is None:
        return None
    kind = _get(response_format, 'type')
    if kind == 'json_object':
        return StructuredOutput(type='json_object')
    if kind == 'json_schema':
        # chat nests {"name", "schema", "strict"} under json_schema; Responses' text.format has them flat
        spec = _get(response_format, 'json_schema')
        if spec is None and isinstance(response_format, dict):
            spec = response_format
        schema = _get(spec, 'schema_', None) if not isinstance(spec, dict) else spec.get('schema')
        if not isinstance(schema, dict):
            raise ValueError('json_schema.schema must be a JSON schema object')
        strict = _get(spec, 'strict')
        return StructuredOutput(type='json_schema', json_schema=schema, strict=True if strict is None else strict)
    return None


def from_tool_choice(tools, tool_choice, parallel_tool_calls: bool, tool_format: str) -> StructuredOutput | None:
    """The constraint of ``tool_choice`` over ``tools`` (OpenAI chat shapes, models or dicts), or
    None when it does not force a call (``auto``, ``none``, absent)."""
    if not tools or tool_choice in (None, 'auto', 'none'):
        return None
    functions = [_get(t, 'function') for t in tools]
    if tool_choice != 'required':
        name = _get(_get(tool_choice, 'function'), 'name')
        functions = [f for f in functions if _get(f, 'name') == name]
    schemas = [ToolSchema(name=_get(f, 'name'), parameters=_get(f, 'parameters')) for f in functions]
    return StructuredOutput(type='tool_calls', tools=schemas, tool_format=tool_format,
                            parallel_tool_calls=parallel_tool_calls)


def grammar_tool_format(parser_name: str | None) -> str | None:
    """The grammar format of tool-call parser ``parser_name`` (None without a parser: hermes):
    the parser class's ``grammar_format`` attribute if it has one, else its own name; None when
    no grammar is registered under that format."""
    from ...pytorch.engine.guided import TOOL_CALL_FORMATS
    from .tool_parser import TOOL_PARSERS
    name = parser_name or 'hermes'
    fmt = getattr(TOOL_PARSERS.get(name), 'grammar_format', None) or name
    return fmt if fmt in TOOL_CALL_FORMATS else None
