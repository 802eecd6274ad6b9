"""The Qwen XML tool-call format (``qwen_xml``): typed round trips, streaming equal to the whole
reply for every cutting, prose tags that never stall, calls inside reasoning that stay reasoning,
the forced openings of ``tool_choice``, template detection, and the history re-rendering to the
generated text."""
from __future__ import annotations

import json

import pytest
from chat_templates import QWEN_XML_TEMPLATE, THINKING_TOOLS_TEMPLATE
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy.serve.openai.chat_output import ChatOutput
from lmdeploy.serve.openai.reasoning_parser import get_reasoning_parser
from lmdeploy.serve.openai.tool_call import merge_tool_call_fragments
from lmdeploy.serve.openai.tool_parser import detect_tool_format, get_tool_parser

_NAME = st.text(alphabet='abcdefghijklmnopqrstuvwxyzABCXYZ0123456789_-', min_size=1, max_size=12)
_STRING = st.text(max_size=16).filter(lambda s: '</parameter>' not in s)
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 9, 10 ** 9),
                  st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
_JSON = st.recursive(_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                     max_leaves=6)
_TYPED = {'string': _STRING, 'integer': st.integers(-10 ** 12, 10 ** 12), 'boolean': st.booleans(),
          'number': st.floats(allow_nan=False, allow_infinity=False),
          'array': st.lists(_JSON, max_size=3), 'object': st.dictionaries(st.text(max_size=4), _JSON, max_size=3)}


@st.composite
def calls(draw):
    """``(tools, [(name, {key: value})], text)``: functions with typed parameters, calls of them
    and the calls written as a Qwen3.5 template writes them (JSON for every non-string value)."""
    names = draw(st.lists(_NAME, min_size=1, max_size=3, unique=True))
    tools, made = [], []
    for name in names:
        keys = draw(st.lists(_NAME, max_size=4, unique=True))
        kinds = {k: draw(st.sampled_from(sorted(_TYPED))) for k in keys}
        tools.append({'type': 'function', 'function': {'name': name, 'parameters': {
            'type': 'object', 'properties': {k: {'type': t} for k, t in kinds.items()}}}})
        for _ in range(draw(st.integers(0, 2))):
            made.append((name, {k: draw(_TYPED[t]) for k, t in kinds.items() if draw(st.booleans())}))
    text = '\n'.join(render_call(n, args) for n, args in made)
    return tools, made, text


def render_call(name: str, args: dict) -> str:
    body = ''.join(f'<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n'
                   for k, v in args.items())
    return f'<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>'


def _stream(parser, text: str, cuts) -> tuple[str, list[tuple[str, str]]]:
    stream, content, frags, prev = parser.stream(), '', [], 0
    for c in sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]:
        piece, fs = stream.feed(text[prev:c])
        content, frags, prev = content + piece, frags + fs, c
    piece, fs = stream.finish()
    merged = merge_tool_call_fragments(frags + fs)
    return content + piece, [(f['function']['name'], f['function']['arguments']) for f in merged]


@settings(max_examples=300, deadline=None)
@given(calls(), st.sampled_from(['', 'Let me look.\n\n']), st.lists(st.integers(0, 2000), max_size=10))
def test_generated_calls_round_trip_typed_and_streamed_equal_parsed(case, lead, cuts):
    tools, made, text = case
    parser = get_tool_parser('qwen_xml', tools)
    whole = parser.parse(lead + text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == made
    assert whole.content == (lead.rstrip() or None if made else (lead + text) or None)
    content, got = _stream(parser, lead + text, cuts)
    assert (content or None, got) == (whole.content, [(c.name, c.arguments) for c in whole.calls])


PIECES = ['Sure. ', '\n', '<tool_call>\n<function=ls>\n<parameter=path>\n.\n</parameter>\n</function>\n</tool_call>',
          '<tool_call>', ' prose ', '<function=read_file>', '<parameter=n>\n', '3', '\n</parameter>', '\n</function>',
          '</tool_call>', '<tool_', '<param', '<think>\n', '</think>\n\n', 'x\ny', '<parameter=path>\n"a"\n',
          '<function=bad\nname>', '<parameter=>']
TOOLS = [{'type': 'function', 'function': {'name': 'ls', 'parameters': {'type': 'object', 'properties': {
    'path': {'type': 'string'}}}}}, {'type': 'function', 'function': {'name': 'read_file', 'parameters': {
        'type': 'object', 'properties': {'path': {'type': 'string'}, 'n': {'type': ['integer', 'null']}}}}}]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=9), st.lists(st.integers(0, 300), max_size=12))
def test_any_reply_any_cutting_streams_what_parse_returns(pieces, cuts):
    """Malformed, truncated and interleaved pieces too: the stream never disagrees with parse,
    and every call's arguments are a JSON object."""
    parser = get_tool_parser('qwen_xml', TOOLS)
    text = ''.join(pieces)
    whole = parser.parse(text)
    content, got = _stream(parser, text, cuts)
    assert (content or None, got) == (whole.content, [(c.name, c.arguments) for c in whole.calls])
    assert all(isinstance(json.loads(c.arguments), dict) for c in whole.calls)


def test_values_are_typed_by_the_schema_and_never_evaluated():
    tools = [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {
        's': {'type': 'string'}, 'i': {'type': 'integer'}, 'b': {'type': 'boolean'}, 'o': {'type': 'object'},
        'a': {'type': 'array'}, 'u': {'anyOf': [{'type': 'number'}, {'type': 'null'}]}}}}}]
    def args(**values):
        text = render_call('f', {}).replace('</function>', ''.join(
            f'<parameter={k}>\n{v}\n</parameter>\n' for k, v in values.items()) + '</function>')
        (call,) = get_tool_parser('qwen_xml', tools).parse(text).calls
        return json.loads(call.arguments)
    assert args(s='42', i='42', b='true', o='{"k": [1]}', a='[1, "x"]', u='null') == \
        {'s': '42', 'i': 42, 'b': True, 'o': {'k': [1]}, 'a': [1, 'x'], 'u': None}
    assert args(i='forty', b='yes', o='[1]', u='NaN') == {'i': 'forty', 'b': 'yes', 'o': '[1]', 'u': 'NaN'}
    assert args(i='__import__("os")', x='{"free": 1}', y='plain') == \
        {'i': '__import__("os")', 'x': {'free': 1}, 'y': 'plain'}      # no schema: JSON if it is JSON
    raw = get_tool_parser('qwen_xml', tools).parse(render_call('f', {}).replace(
        '</function>', '<parameter=i>\n1e3\n</parameter>\n</function>')).calls[0].arguments
    assert raw == '{"i": 1e3}'          # the model's own number text, so the history renders it again


def test_prose_tags_never_stall_the_stream_and_cut_calls_stay_calls():
    parser = get_tool_parser('qwen_xml', TOOLS)
    stream = parser.stream()
    assert stream.feed('Use the <tool_call> tag')[0] == 'Use the <tool_call> tag'
    assert stream.feed(' and <tool_')[0] == ' and'            # a possible opening is held, not more
    stream = parser.stream()
    content, frags = stream.feed('<tool_call>\n<function=ls>\n<parameter=path>\nsrc/ma')
    assert content == '' and [f['function'] for f in frags] == [{'name': 'ls', 'arguments': ''},
                                                               {'arguments': '{"path": "'}, {'arguments': 'src/ma'}]
    got = parser.parse('<tool_call>\n<function=ls>\n<parameter=path>\nsrc/ma')     # cut off (max_tokens)
    assert [(c.name, c.arguments) for c in got.calls] == [('ls', '{"path": "src/ma"}')]
    assert parser.parse('<tool_call>\n<function=ls>\n').calls[0].arguments == '{}'
    assert parser.parse('<tool_call>\n{"name": "ls"}\n</tool_call>').calls == []     # not this format


@pytest.mark.parametrize('fmt', ['hermes', 'qwen_xml'])
@pytest.mark.parametrize('separate', [True, False])
@pytest.mark.parametrize('started', [True, False])
def test_a_call_drafted_while_thinking_is_never_a_call(fmt, separate, started):
    call = render_call('ls', {'path': '.'}) if fmt == 'qwen_xml' else \
        '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
    text = ('' if started else '<think>\n') + 'I could run\n' + call + '\nbut no.\n</think>\n\nNo call needed.'
    reasoning = get_reasoning_parser('think') if separate else None
    for size in (1, 3, len(text)):
        out = ChatOutput(reasoning, started, get_tool_parser(fmt, TOOLS), '', True)
        msg = ChatOutput(reasoning, started, get_tool_parser(fmt, TOOLS), '', True).message(text)
        deltas = [out.feed(text[i:i + size]) for i in range(0, len(text), size)] + [out.finish()]
        assert 'tool_calls' not in msg and not any('tool_calls' in d for d in deltas)
        assert ''.join(d.get('content', '') for d in deltas) == msg['content']
        assert msg['content'] == ('No call needed.' if separate else text)
    after = text + '\n' + call         # a call after the reasoning is one
    msg = ChatOutput(None, started, get_tool_parser(fmt, TOOLS), '', True).message(after)
    assert [c['function']['name'] for c in msg['tool_calls']] == ['ls'] and msg['content'] == text
    stop = ChatOutput(None, started, get_tool_parser(fmt, TOOLS), '', False).first_call_stop()
    assert stop(text) is None and stop(after) == len(after)


@pytest.mark.parametrize('forced', [None, 'read_file'])
def test_forced_openings_parse_as_the_start_of_the_call(forced):
    parser = get_tool_parser('qwen_xml', TOOLS)
    prefix = parser.forced_prefix(forced)
    assert prefix == ('<tool_call>\n' if forced is None else '<tool_call>\n<function=read_file>\n')
    reply = ('' if forced else '<function=ls>\n') + '<parameter=path>\na\n</parameter>\n</function>\n</tool_call>'
    msg = ChatOutput(None, False, parser, prefix, False).message(reply)
    assert [(c['function']['name'], c['function']['arguments']) for c in msg['tool_calls']] == \
        [(forced or 'ls', '{"path": "a"}')] and msg['content'] is None
    stop = ChatOutput(None, False, parser, prefix, False).first_call_stop()
    assert stop(reply + '\n<tool_call>') == len(reply)


def test_auto_picks_the_format_the_template_writes():
    assert detect_tool_format(QWEN_XML_TEMPLATE) == 'qwen_xml'
    assert detect_tool_format(THINKING_TOOLS_TEMPLATE) == 'hermes'
    assert detect_tool_format('{{ messages }}') is None


def test_the_reply_sent_back_renders_to_the_generated_text(tiny_qwen3, tmp_path):
    """A parsed XML call returned to the client and sent back as history (arguments a JSON
    string) renders through the template to exactly the text the model generated, numbers and
    objects in the model's own spelling, so the next turn reuses the cached reply."""
    from chat_templates import with_template
    from transformers import AutoTokenizer

    from lmdeploy.serve.pipeline import render_chat
    tok = AutoTokenizer.from_pretrained(with_template(tiny_qwen3, str(tmp_path / 'm'), QWEN_XML_TEMPLATE))
    tools = TOOLS + [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {
        'n': {'type': 'number'}, 'o': {'type': 'object'}, 'b': {'type': 'boolean'}}}}}]
    reply = ('plan\n</think>\n\nLet me look.\n\n' + render_call('ls', {'path': 'a b'}) + '\n<tool_call>\n<function=f>\n'
             '<parameter=n>\n1e3\n</parameter>\n<parameter=o>\n{"k":[1, 2]}\n</parameter>\n<parameter=b>\ntrue\n'
             '</parameter>\n</function>\n</tool_call>')
    parser = get_tool_parser('qwen_xml', tools)
    msg = ChatOutput(get_reasoning_parser('think'), True, parser, '', True).message(reply)
    history = [{'role': 'user', 'content': 'go'}, msg]
    rendered = render_chat(tok, [parser.history_message(m) for m in history], tools)
    assert '<|im_start|>assistant\n<think>\n' + reply + '<|im_end|>' in rendered


# served (a scripted tiny Qwen3 with the XML template, prefix caching on) ----------------------------------------
XML_CALL = render_call('read_file', {'path': 'a.txt', 'n': 3})
XML_SCRIPT = [{'contains': 'read a.txt', 'turn': 0, 'reply': 'It is in a.txt.\n</think>\n\nReading.\n\n' + XML_CALL},
              {'contains': 'read a.txt', 'turn': 1, 'reply': 'Done\n</think>\n\nIt holds salt.'},
              {'contains': 'Draft only', 'reply': 'I might call\n' + XML_CALL + '\nbut no.\n</think>\n\nNo call.'}]


@pytest.fixture(scope='module')
def xml_server(tiny_qwen3, tmp_path_factory):
    import os
    import sys

    from chat_templates import with_template
    from server_utils import ApiServer
    tests = os.path.dirname(os.path.abspath(__file__))
    model = with_template(tiny_qwen3, str(tmp_path_factory.mktemp('xml') / 'model'), QWEN_XML_TEMPLATE)
    server = ApiServer(model, '--block-size', '16', '--enable-prefix-caching', '--session-len', '2048',
                       launcher=[sys.executable, os.path.join(tests, 'scripted_server.py')],
                       env={'LMDEPLOY_TEST_SCRIPT': json.dumps(XML_SCRIPT)})
    try:
        yield server.start()
    finally:
        server.stop()


def test_served_xml_calls_stream_and_the_next_turn_reuses_the_reply(xml_server):
    import openai
    client = openai.OpenAI(base_url=xml_server.base_url + '/v1', api_key='unused', max_retries=0, timeout=120)
    messages = [{'role': 'user', 'content': 'Please read a.txt.'}]
    kw = dict(model='model', messages=messages, tools=TOOLS, max_tokens=120)
    first = client.chat.completions.create(**kw)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == 'tool_calls'
    assert (msg.reasoning_content, msg.content) == ('It is in a.txt.', 'Reading.')
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [('read_file', {'path': 'a.txt', 'n': 3})]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    frags = [f.model_dump(exclude_none=True) for ch in chunks for f in ch.choices[0].delta.tool_calls or []]
    assert len(frags) > 3                   # arguments arrive as deltas, not one piece
    merged = merge_tool_call_fragments(frags)
    assert [(f['function']['name'], f['function']['arguments']) for f in merged] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    messages.append({'role': 'assistant', 'content': msg.content, 'reasoning_content': msg.reasoning_content,
                     'tool_calls': [c.model_dump() for c in msg.tool_calls]})
    messages.append({'role': 'tool', 'tool_call_id': msg.tool_calls[0].id, 'content': 'salt'})
    second = client.chat.completions.create(**dict(kw, messages=messages))
    assert second.choices[0].message.content == 'It holds salt.'
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1     # the final EOS is never fed
    assert computed // 16 * 16 > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == computed // 16 * 16


@pytest.mark.parametrize('stream', [False, True])
def test_served_call_drafted_while_thinking_is_not_a_call_with_reasoning_unsplit(xml_server, stream):
    """The generation prompt opens <think>; with separate_reasoning false the reply is raw text,
    and the call drafted inside the reasoning is not returned as a tool call."""
    import openai
    client = openai.OpenAI(base_url=xml_server.base_url + '/v1', api_key='unused', max_retries=0, timeout=120)
    kw = dict(model='model', messages=[{'role': 'user', 'content': 'Draft only.'}], tools=TOOLS, max_tokens=120,
              extra_body={'separate_reasoning': False})
    reply = 'I might call\n' + XML_CALL + '\nbut no.\n</think>\n\nNo call.'
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
        assert ''.join(ch.choices[0].delta.content or '' for ch in chunks if ch.choices) == reply
        assert chunks[-1].choices[0].finish_reason == 'stop'
    else:
        r = client.chat.completions.create(**kw).choices[0]
        assert (r.message.content, r.message.tool_calls, r.finish_reason) == (reply, None, 'stop')
