"""Constrained decoding: a grammar per guided request masks the tokens that would leave it.

A request's :class:`~lmdeploy.messages.StructuredOutput` is compiled once (cached by the
grammar library, keyed by the grammar text) into a grammar over the tokenizer's vocabulary;
each guided sequence owns one :class:`Guide`, a matcher that walks the tokens it generated::

    sample step     logits -> penalties -> logit_bias -> Guide.mask_ (-inf outside the grammar)
                    -> temperature / top-k / top-p -> token
    update          Guide.accept(token)   exactly once per appended token
    finish/abort    Guide.close()         (the ledger's grammar_matchers returns to 0)

The matcher only moves forward with tokens the sequence keeps, so a preempted sequence (its
tokens recomputed, none re-sampled) keeps its matcher as it is. Guided sequences decode without
speculative drafts (a draft would need the matcher at every draft position): the speculative
decoder gives them no draft room.

Grammar library: xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models", 2024), picked over llguidance by its per-token mask cost on
CPU (benchmark/benchmark_grammar_mask.py; numbers in benchmark/README.md). JSON is generated
without free whitespace (``", "`` and ``": "`` separators), so a weak model cannot loop on
spaces.

Work limits: compile time grows with the grammar's size, and superlinearly with an object's
optional properties and the schema's nesting (a tiny vocabulary: 128 optional properties 1.0 s,
1000 of them 110 s; objects nested 128 deep 0.4 s; a 100k-value enum took 48-64 s on a real
vocabulary), and xgrammar's compiler has no time limit or cancellation. So every schema of a
request is measured before anything is compiled (:func:`check_grammar_limits`), and one over
:data:`GRAMMAR_LIMITS` is a ``ValueError`` naming the limit: the size limits are what bound the
compile time.

Tool-call formats are data: :data:`TOOL_CALL_FORMATS` maps a format name to a function that
turns one tool (name, parameters schema) into the xgrammar ``Grammar`` of one whole call (its
opening text, its arguments, its closing text); the backend unites the tools and repeats the
call (newline-separated) unless ``parallel_tool_calls`` is False. A new format registers one
(:func:`register_tool_call_format`).
"""
from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict

import torch

from ...messages import StructuredOutput
from .utf8_guard import CLEAN, Utf8Guard

__all__ = ['GrammarBackend', 'Guide', 'TOOL_CALL_FORMATS', 'register_tool_call_format', 'GRAMMAR_LIMITS',
           'check_grammar_limits', 'check_tool_parameters']

logger = logging.getLogger('lmdeploy')

_SEPARATORS = (', ', ': ')
_ANY_OBJECT = {'type': 'object'}


# The most a request's schemas (json_schema, or every tool's parameters together) may hold:
# bytes of their compact JSON, nesting of JSON containers, enum / const values in all, and
# properties of one object that are not required (what the grammar's size grows fastest with).
GRAMMAR_LIMITS = {'schema_bytes': 64 << 10, 'nesting': 64, 'enum_values': 1024, 'optional_properties': 64}


def check_grammar_limits(spec: StructuredOutput) -> None:
    """Refuse a constraint whose grammar could take unbounded time to compile (see the module
    docstring); cheap (one iterative walk, no recursion, so any nesting is measured safely).

    Raises:
        ValueError: ``json_schema: ...`` or ``tools: ...`` naming the limit exceeded and its bound
            (:data:`GRAMMAR_LIMITS`).
    """
    if spec.type == 'json_schema':
        _check_limits([spec.json_schema], 'json_schema: ')
    elif spec.type == 'tool_calls':
        _check_limits([t.parameters for t in spec.tools], 'tools: ')


def _check_limits(schemas: list, what: str) -> None:
    """:func:`check_grammar_limits` over ``schemas`` together (None entries skipped); each
    message starts with ``what``."""
    limits = GRAMMAR_LIMITS
    enums = 0
    stack = [(s, 1) for s in schemas if s is not None]
    while stack:
        node, depth = stack.pop()
        if depth > limits['nesting']:
            raise ValueError(f'{what}the schema is nested more than {limits["nesting"]} levels deep '
                             '(grammar size limit)')
        if isinstance(node, dict):
            for key in ('enum', 'const'):
                if key in node:
                    enums += len(node[key]) if key == 'enum' and isinstance(node[key], list) else 1
            props = node.get('properties')
            if isinstance(props, dict):
                required = node.get('required') if isinstance(node.get('required'), list) else []
                optional = len(set(props) - {r for r in required if isinstance(r, str)})
                if optional > limits['optional_properties']:
                    raise ValueError(f'{what}an object has {optional} optional properties (not in "required"); '
                                     f'at most {limits["optional_properties"]} are allowed (grammar size limit)')
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        else:
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    if enums > limits['enum_values']:
        raise ValueError(f'{what}the schema has {enums} enum/const values; at most {limits["enum_values"]} are '
                         'allowed (grammar size limit)')
    size = sum(len(json.dumps(s, separators=(',', ':'), ensure_ascii=False).encode()) for s in schemas if s)
    if size > limits['schema_bytes']:
        raise ValueError(f'{what}the schema is {size} bytes of JSON; at most {limits["schema_bytes"]} are allowed '
                         '(grammar size limit)')


def _plain_bounded_strings(schema):
    """``schema`` with each length-bounded string (``minLength`` / ``maxLength``, no pattern,
    format, enum or const) as the equivalent pattern of plain characters.

    Why: xgrammar 0.2.9 compiles a length-bounded string to "any characters but quote,
    backslash, CR and LF", which admits raw control characters that JSON forbids (a reply no
    JSON parser reads); the pattern excludes them (and escapes, so characters = length). It
    also excludes the UTF-16 surrogates U+D800-U+DFFF: xgrammar reads their three-byte forms
    (``ED A0..BF xx``) as one character, which is not UTF-8, so the reply's text decodes each byte
    to U+FFFD and the string comes out longer than ``maxLength``. (Overlong forms, e.g.
    ``F0 8B B1 90``, stand for ordinary code points, so no character class excludes them: the
    guide's UTF-8 mask does, :mod:`.utf8_guard`, and the surrogates' too.)"""
    if isinstance(schema, list):
        return [_plain_bounded_strings(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _plain_bounded_strings(v) for k, v in schema.items()}
    if out.get('type') == 'string' and ('minLength' in out or 'maxLength' in out) \
            and not any(k in out for k in ('pattern', 'format', 'enum', 'const')):
        lo, hi = out.pop('minLength', 0), out.pop('maxLength', '')
        if isinstance(lo, int) and (hi == '' or isinstance(hi, int)):
            out['pattern'] = '^[^"\\\\\\x00-\\x1f\\ud800-\\udfff]{%d,%s}$' % (lo, hi)
    return out


def _json_grammar(xgr, schema: dict, strict: bool = True):
    """The compact-JSON grammar of ``schema``."""
    return xgr.Grammar.from_json_schema(json.dumps(_plain_bounded_strings(schema)), any_whitespace=False,
                                        separators=_SEPARATORS, strict_mode=strict)


def _literal(xgr, text: str):
    """A grammar matching exactly ``text``."""
    return xgr.Grammar.from_ebnf('root ::= ' + json.dumps(text, ensure_ascii=False))


def _hermes(xgr, name: str, parameters: dict):
    """``<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>``, ARGS compact JSON."""
    begin = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    args = _json_grammar(xgr, parameters)
    return xgr.Grammar.concat(_literal(xgr, begin), args, _literal(xgr, '}\n</tool_call>'))


def _qwen_xml(xgr, name: str, parameters: dict):
    """``<tool_call>\n<function=NAME>\n<parameter=KEY>VALUE</parameter>...\n</function>\n</tool_call>``
    (xgrammar's ``qwen_xml`` argument style; at most one whitespace character between parts)."""
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat
    tag = TagFormat(begin=f'<tool_call>\n<function={name}>\n',
                    content=JSONSchemaFormat(json_schema=parameters, style='qwen_xml', max_whitespace_cnt=1),
                    end='\n</function>\n</tool_call>')
    return xgr.Grammar.from_structural_tag(StructuralTag(format=tag))


TOOL_CALL_FORMATS = {'hermes': _hermes, 'qwen_xml': _qwen_xml}
_CALLS_RULE = 'lmdeploy_tool_calls'     # root of "one or more calls"
_CACHE_ENTRIES = 256                     # compiled grammars kept (a few hundred KB each at most)
_LIBRARY_LOCATION = re.compile(r'^\[[\d:]+\] \S+:\d+: ')


def register_tool_call_format(name: str, grammar_of):
    """Make ``grammar_of(xgrammar, function_name, parameters_schema) -> xgrammar.Grammar`` (one
    whole call of that function) the grammar of tool-call format ``name``
    (``StructuredOutput.tool_format``)."""
    TOOL_CALL_FORMATS[name] = grammar_of
    _tool_grammar_error.cache_clear()


def check_tool_parameters(parameters: dict | None, tool_format: str | None = None) -> None:
    """Refuse a function tool's ``parameters`` that constrained decoding could not use, so a
    request offering it is refused whatever its ``tool_choice`` (not only when a forced call
    compiles the grammar).

    Cost: one bounded walk (:data:`GRAMMAR_LIMITS`), then the grammar's construction, not its
    compilation over the vocabulary (under a millisecond for a typical tool, 25 ms for 1,000
    properties); results are cached by schema, since an agent sends the same tools every turn.

    Args:
        parameters: the JSON schema of the function's arguments; None or ``{}``: any object.
        tool_format: the :data:`TOOL_CALL_FORMATS` name whose call grammar the schema must
            build into; None: the plain JSON grammar.

    Raises:
        ValueError: the message does not name the field (the caller knows the client's name
            for it): the schema is not an object, its ``type`` is not ``"object"`` (a call's
            arguments are a JSON object), it is over :data:`GRAMMAR_LIMITS`, or the grammar
            library cannot build it (the library's reason).
    """
    if not parameters:
        return
    if not isinstance(parameters, dict):
        raise ValueError(f'must be a JSON schema object, not {type(parameters).__name__}')
    kind = parameters.get('type', 'object')
    if kind != 'object':
        raise ValueError(f'must be an object schema ("type": "object"; a call\'s arguments are a JSON object), '
                         f'got "type": {json.dumps(kind)}')
    _check_limits([parameters], '')     # before anything walks the schema recursively
    error = _tool_grammar_error(tool_format, json.dumps(parameters, sort_keys=True))
    if error is not None:
        raise ValueError(f'the schema cannot be used for constrained decoding: {error}')


@functools.lru_cache(maxsize=_CACHE_ENTRIES)
def _tool_grammar_error(tool_format: str | None, schema_json: str) -> str | None:
    """Why one call grammar of the schema ``schema_json`` in ``tool_format`` cannot be built, or
    None when it can (a reason, not an exception, so that refusals are cached too)."""
    import xgrammar as xgr
    schema = json.loads(schema_json)
    grammar_of = TOOL_CALL_FORMATS.get(tool_format)
    try:
        _json_grammar(xgr, schema) if grammar_of is None else grammar_of(xgr, 'f', schema)
    except (RuntimeError, ValueError, TypeError) as err:
        return _library_reason(err)
    return None


def _library_reason(err: Exception) -> str:
    """The grammar library's reason for refusing a schema, as a client should read it: the last
    line of ``err``, without the ``[hh:mm:ss] file.cc:line: `` prefix xgrammar puts on its C++
    errors (a time and a path of the library's build tree tell a client nothing); the
    exception's type name when it has no text."""
    text = str(err).strip()
    return _LIBRARY_LOCATION.sub('', text.splitlines()[-1]) if text else type(err).__name__


class GrammarBackend:
    """Compiles structured-output requests for one tokenizer and counts live matchers.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the logits (``config.vocab_size``; may exceed the tokenizer's size).
        stop_token_ids: ids that end a reply once the grammar is complete (the model's EOS).

    Thread safety: :meth:`compile` may run on any thread (request validation); matchers are
    used on the engine thread only.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.utf8 = Utf8Guard(info.decoded_vocab, vocab_size)
        self._cache: OrderedDict = OrderedDict()       # spec JSON -> compiled grammar (LRU)
        self._lock = threading.Lock()
        self.num_live = 0       # matchers created and not yet closed (the ledger's grammar_matchers)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of ``spec`` (the last :data:`_CACHE_ENTRIES` are kept).

        Raises:
            ValueError: the schema (or a tool's parameters) is over :data:`GRAMMAR_LIMITS` or
                cannot be compiled; the message names the part and the limit or the library's
                reason.
        """
        check_grammar_limits(spec)      # before anything walks the schema recursively
        key = spec.model_dump_json()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        try:
            if spec.type in ('json_object', 'json_schema'):
                schema = _ANY_OBJECT if spec.type == 'json_object' else spec.json_schema
                return self._compiler.compile_grammar(_json_grammar(self._xgr, schema, spec.strict))
            return self._compile_calls(spec)
        except (RuntimeError, ValueError, TypeError) as err:
            what = 'json_schema' if spec.type != 'tool_calls' else 'tools'
            raise ValueError(f'{what}: the schema cannot be used for constrained decoding: '
                             f'{_library_reason(err)}') from None

    def _compile_calls(self, spec: StructuredOutput):
        """One call of any of ``spec.tools`` (``parallel_tool_calls`` False), or one or more
        separated by newlines."""
        xgr = self._xgr
        grammar_of = TOOL_CALL_FORMATS.get(spec.tool_format)
        if grammar_of is None:
            raise ValueError(f'unknown tool_format {spec.tool_format!r}; known: {sorted(TOOL_CALL_FORMATS)}')
        calls = []
        for tool in spec.tools:
            try:
                calls.append(grammar_of(xgr, tool.name, tool.parameters if tool.parameters else _ANY_OBJECT))
            except RuntimeError as err:     # names the function whose parameters fail
                raise ValueError(f'function {tool.name!r}: {str(err).strip().splitlines()[-1]}') from None
        one = xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0]
        if not spec.parallel_tool_calls:
            return self._compiler.compile_grammar(one)
        text = f'{one}\n{_CALLS_RULE} ::= root ("\\n" root)*\n'
        return self._compiler.compile_grammar(text, root_rule_name=_CALLS_RULE)

    def guide(self, spec: StructuredOutput) -> Guide:
        """A new matcher for one sequence, past ``spec.prefix``.

        Raises:
            ValueError: as :meth:`compile`, or the grammar does not admit ``spec.prefix``.
        """
        matcher = self._xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=self.stop_token_ids or None)
        if spec.prefix and not matcher.accept_string(spec.prefix):
            raise ValueError(f'prefix: the grammar does not admit {spec.prefix!r} as the start of the reply')
        with self._lock:
            self.num_live += 1
        return Guide(self, matcher)

    def _closed(self) -> None:
        with self._lock:
            self.num_live -= 1


class Guide:
    """One sequence's grammar state (a matcher over the tokens it generated)."""

    def __init__(self, backend: GrammarBackend, matcher):
        self._backend = backend
        self._matcher = matcher
        self._bitmask = backend._xgr.allocate_token_bitmask(1, backend.vocab_size)
        self._utf8 = CLEAN       # where the reply's last character stands (utf8_guard)
        self.failed = False      # a token the grammar refused was appended (the reply is ended)

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the ``[vocab]`` float32 CPU ``logits`` of every token the grammar refuses next to
        -inf, in place, and of every token that would make the reply ill-formed UTF-8
        (:class:`~.utf8_guard.Utf8Guard`); returns ``logits``."""
        if self._matcher is None or self._matcher.is_terminated():
            return logits
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._backend._xgr.apply_token_bitmask_inplace(logits.view(1, -1), self._bitmask)
        return self._backend.utf8.restrict_(logits, self._utf8)

    def accept(self, token: int) -> None:
        """Advance by one appended token; a refused token sets :attr:`failed`."""
        if self._matcher is None or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token)):
            logger.warning('token %d does not continue the grammar; ending the reply', token)
            self.failed = True
        self._utf8 = self._backend.utf8.after(self._utf8, int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and took its stop token, or a refused token ended it."""
        return self.failed or (self._matcher is not None and self._matcher.is_terminated())

    @property
    def can_stop(self) -> bool:
        """The text so far is a complete reply: a stop token is allowed next."""
        return self._matcher is not None and self._matcher.is_completed()

    def close(self) -> None:
        """Free the matcher (idempotent)."""
        if self._matcher is not None:
            self._matcher = None
            self._backend._closed()
