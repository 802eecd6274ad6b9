"""``/v1/messages`` and ``/v1/messages/count_tokens`` with the real ``anthropic`` SDK (skipped when
it is not installed): tool_use / tool_result turns reusing the cached reply, thinking blocks,
tool_choice, streamed events reassembled = non-streamed, Anthropic-shaped errors, ``x-api-key``.

Server: tiny full-attention Qwen3, Qwen3-style tools + thinking template, B=16, prefix caching,
an API key, sampler scripted (tests/scripted_server.py).
"""
from __future__ import annotations

import json
import os
import re
import sys

import httpx
import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import ApiServer

anthropic = pytest.importorskip('anthropic')

TESTS = os.path.dirname(os.path.abspath(__file__))
KEY = 'sk-messages-test'
TOOLS = [{'name': 'ls', 'description': 'List a directory.',
          'input_schema': {'type': 'object', 'properties': {'path': {'type': 'string'}}, 'required': ['path']}}]
CALL_LS = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
ANSWER = '<think>\nThe listing has a.txt.\n</think>\n\nIt holds a.txt and b.txt.'
SCRIPT = [{'contains': 'What is here?', 'turn': 0, 'reply': 'Let me look.\n' + CALL_LS},
          {'contains': 'What is here?', 'turn': 1, 'reply': ANSWER},
          {'endswith': '"arguments":', 'reply': ' {"path": "b"}}\n</tool_call>'},
          {'endswith': '<tool_call>\n', 'reply': '{"name": "ls", "arguments": {"path": "/"}}\n</tool_call>'},
          {'contains': 'Think first.', 'reply': ANSWER},
          {'contains': 'Count aloud', 'reply': ' one two three four five six seven eight nine ten.'}]
SYSTEM = [{'type': 'text', 'text': 'You are a careful agent.'}, {'type': 'text', 'text': 'Keep answers short. ' * 8}]


def test_blocks_translate_into_chat_messages():
    from lmdeploy.serve.openai.anthropic import MessagesRequest, to_chat
    req = MessagesRequest.model_validate({
        'model': 'm', 'max_tokens': 9, 'system': SYSTEM, 'stop_sequences': ['END'], 'tools': TOOLS,
        'tool_choice': {'type': 'any', 'disable_parallel_tool_use': True}, 'thinking': {'type': 'disabled'},
        'messages': [
            {'role': 'user', 'content': [{'type': 'text', 'text': 'look '}, {'type': 'text', 'text': 'here'}]},
            {'role': 'assistant', 'content': [{'type': 'thinking', 'thinking': 'plan', 'signature': ''},
                                              {'type': 'text', 'text': 'Looking.'},
                                              {'type': 'tool_use', 'id': 't1', 'name': 'ls', 'input': {'path': '.'}}]},
            {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': 't1', 'content': 'a.txt'},
                                         {'type': 'image', 'source': {'type': 'url', 'url': 'https://x/y.png'}}]}]})
    chat = to_chat(req)
    assert chat['messages'] == [
        {'role': 'system', 'content': SYSTEM[0]['text'] + '\n' + SYSTEM[1]['text']},
        {'role': 'user', 'content': 'look here'},
        {'role': 'assistant', 'content': 'Looking.', 'reasoning_content': 'plan', 'tool_calls': [
            {'id': 't1', 'type': 'function', 'function': {'name': 'ls', 'arguments': '{"path": "."}'}}]},
        {'role': 'tool', 'tool_call_id': 't1', 'content': 'a.txt'},
        {'role': 'user', 'content': [{'type': 'image_url', 'image_url': {'url': 'https://x/y.png'}}]}]
    assert (chat['tool_choice'], chat['parallel_tool_calls'], chat['stop'], chat['max_completion_tokens']) == \
        ('required', False, ['END'], 9)
    assert chat['chat_template_kwargs'] == {'enable_thinking': False}
    assert chat['tools'][0]['function']['parameters'] == TOOLS[0]['input_schema']
    # a system message inside messages (Claude Code sends one) is a user turn with its text
    later = MessagesRequest.model_validate({'model': 'm', 'max_tokens': 9, 'system': 'S', 'messages': [
        {'role': 'user', 'content': 'hi'}, {'role': 'system', 'content': [{'type': 'text', 'text': 'Agents: a, b.'}]},
        {'role': 'user', 'content': 'go'}]})
    assert to_chat(later)['messages'] == [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'hi'},
                                          {'role': 'user', 'content': 'Agents: a, b.'},
                                          {'role': 'user', 'content': 'go'}]


_BLOCKS = {'text': lambda n: {'type': 'text', 'text': f't{n}'},
           'image': lambda n: {'type': 'image', 'source': {'type': 'url', 'url': f'https://h/{n}.png'}},
           'tool_result': lambda n: {'type': 'tool_result', 'tool_use_id': f'c{n}', 'content': 'r'}}


@settings(max_examples=60, deadline=None)
@given(system=st.booleans(), turns=st.lists(st.one_of(
    st.just('assistant'), st.just('system'), st.lists(st.sampled_from(sorted(_BLOCKS)), min_size=1, max_size=5)),
    min_size=1, max_size=6))
def test_every_chat_image_part_maps_back_to_its_image_block(system, turns):
    """Whatever tool results, texts and system turns shift the chat indices, each image part of
    the chat messages is named by the Messages location of the image block it came from."""
    n = iter(range(1000))
    messages = [{'role': 'assistant', 'content': 'ok'} if t == 'assistant' else
                {'role': 'system', 'content': [{'type': 'text', 'text': 'x'}]} if t == 'system' else
                {'role': 'user', 'content': [_BLOCKS[b](next(n)) for b in t]} for t in turns]
    from lmdeploy.serve.openai.anthropic import MessagesRequest, to_chat
    req = MessagesRequest.model_validate({'model': 'm', 'max_tokens': 9, 'messages': messages,
                                          **({'system': 'S'} if system else {})})
    image_parts: dict = {}
    chat = to_chat(req, image_parts)['messages']
    urls = {(i, j): p['image_url']['url'] for i, m in enumerate(chat) if isinstance(m['content'], list)
            for j, p in enumerate(m['content']) if p['type'] == 'image_url'}
    assert set(image_parts) == set(urls)
    for key, where in image_parts.items():
        a, b = map(int, re.fullmatch(r'messages\[(\d+)\]\.content\[(\d+)\]', where).groups())
        assert messages[a]['content'][b]['source']['url'] == urls[key]


@pytest.fixture(scope='module')
def server(tiny_qwen3, tmp_path_factory):
    model = with_template(tiny_qwen3, str(tmp_path_factory.mktemp('messages') / 'model'), THINKING_TOOLS_TEMPLATE)
    proc = ApiServer(model, '--block-size', '16', '--enable-prefix-caching', '--session-len', '2048', api_key=KEY,
                     launcher=[sys.executable, os.path.join(TESTS, 'scripted_server.py')],
                     env={'LMDEPLOY_TEST_SCRIPT': json.dumps(SCRIPT)})
    try:
        yield proc.start()
    finally:
        proc.stop()


def client(server, key: str = KEY):
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def test_tool_use_then_tool_result_reuses_the_cached_reply(server):
    c = client(server)
    messages = [{'role': 'user', 'content': 'What is here?'}]
    first = c.messages.create(model='model', system=SYSTEM, messages=messages, tools=TOOLS, max_tokens=100)
    assert first.stop_reason == 'tool_use' and [b.type for b in first.content] == ['text', 'tool_use']
    assert first.content[0].text == 'Let me look.'
    use = first.content[1]
    assert (use.name, use.input) == ('ls', {'path': '.'}) and use.id
    assert first.usage.cache_read_input_tokens == 0
    count = c.messages.count_tokens(model='model', system=SYSTEM, messages=messages, tools=TOOLS)
    assert count.input_tokens == first.usage.input_tokens
    messages += [{'role': 'assistant', 'content': [b.model_dump(exclude_none=True) for b in first.content]},
                 {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': use.id,
                                              'content': 'a.txt\nb.txt'}]}]
    second = c.messages.create(model='model', system=SYSTEM, messages=messages, tools=TOOLS, max_tokens=100)
    assert second.stop_reason == 'end_turn' and [b.type for b in second.content] == ['thinking', 'text']
    assert (second.content[0].thinking, second.content[1].text) == \
        ('The listing has a.txt.', 'It holds a.txt and b.txt.')
    computed = first.usage.input_tokens + first.usage.output_tokens - 1      # the final EOS is never fed
    assert computed // 16 * 16 > first.usage.input_tokens
    assert second.usage.cache_read_input_tokens == computed // 16 * 16
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert c.messages.count_tokens(model='model', system=SYSTEM, messages=messages, tools=TOOLS).input_tokens == total


@pytest.mark.parametrize('prompt', ['What is here?', 'Think first.'])
def test_streamed_events_rebuild_the_message(server, prompt):
    c = client(server)
    kw = dict(model='model', messages=[{'role': 'user', 'content': prompt}], tools=TOOLS, max_tokens=100)
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == 'message_start' and types[-1] == 'message_stop' and 'message_delta' in types
    strip = lambda m: [{k: v for k, v in b.model_dump().items() if k != 'id'} for b in m.content]     # noqa: E731
    assert strip(final) == strip(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    starts = [e.content_block.type for e in events if e.type == 'content_block_start']
    assert starts == [b.type for b in whole.content]
    assert types.count('content_block_stop') == len(starts)
    if 'tool_use' in starts:
        partial = ''.join(e.delta.partial_json for e in events
                          if e.type == 'content_block_delta' and e.delta.type == 'input_json_delta')
        assert json.loads(partial) == whole.content[-1].input


def test_tool_choice_any_tool_and_none(server):
    c = client(server)
    kw = dict(model='model', messages=[{'role': 'user', 'content': 'List the files.'}], tools=TOOLS, max_tokens=60)
    any_ = c.messages.create(**kw, tool_choice={'type': 'any'})
    assert [(b.name, b.input) for b in any_.content if b.type == 'tool_use'] == [('ls', {'path': '/'})]
    named = c.messages.create(**kw, tool_choice={'type': 'tool', 'name': 'ls'})
    assert [(b.name, b.input) for b in named.content if b.type == 'tool_use'] == [('ls', {'path': 'b'})]
    assert named.stop_reason == 'tool_use'
    none = c.messages.create(**dict(kw, messages=[{'role': 'user', 'content': 'What is here?'}]),
                             tool_choice={'type': 'none'})
    assert all(b.type == 'text' for b in none.content) and none.stop_reason == 'end_turn'


def test_thinking_disabled_and_max_tokens(server):
    c = client(server)
    kw = dict(model='model', messages=[{'role': 'user', 'content': 'Think first.'}], max_tokens=100)
    on = c.messages.count_tokens(model='model', messages=kw['messages'])
    off = c.messages.count_tokens(model='model', messages=kw['messages'], thinking={'type': 'disabled'})
    assert off.input_tokens > on.input_tokens            # the template's empty think block is in
    cut = c.messages.create(**dict(kw, max_tokens=3))
    assert cut.stop_reason == 'max_tokens' and cut.usage.output_tokens == 3


def test_errors_have_anthropics_shape_and_the_key_is_checked(server):
    with httpx.Client(timeout=60) as h:       # Claude Code's reachability probe of its base URL
        assert h.head(server.base_url + '/').status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as err:
        client(server, 'wrong').messages.create(model='model', messages=[{'role': 'user', 'content': 'x'}],
                                                max_tokens=5)
    assert err.value.body['error']['type'] == 'authentication_error'
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as err:
        c.messages.create(model='claude-x', messages=[{'role': 'user', 'content': 'x'}], max_tokens=5)
    assert err.value.body['type'] == 'error' and 'claude-x' in err.value.body['error']['message']
    for body, where in [({'messages': [{'role': 'user', 'content': 'x'}]}, 'max_tokens'),
                        ({'messages': [{'role': 'user', 'content': 'x'}], 'max_tokens': 5,
                          'tools': [{'name': 'ls', 'input_schema': {}}], 'tool_choice': {'type': 'tool', 'name': 'rm'}},
                         'tool_choice'),
                        ({'messages': [{'role': 'user', 'content': [{'type': 'document', 'source': {}}]}],
                          'max_tokens': 5}, 'messages[0].content[0]')]:
        with httpx.Client(timeout=60) as h:
            r = h.post(server.base_url + '/v1/messages', json=dict(model='model', **body), headers={'x-api-key': KEY})
        assert r.status_code == 400, r.text
        got = r.json()
        assert got['type'] == 'error' and got['error']['type'] == 'invalid_request_error'
        assert got['error']['message'].startswith(where), got


def test_a_stop_sequence_is_named_in_the_reply(server):
    c = client(server)
    kw = dict(model='model', messages=[{'role': 'user', 'content': 'Count aloud.'}], max_tokens=60)
    for stops, want in [(['nine', 'five'], 'five'), (['five', 'fiv', 'ten'], 'fiv')]:
        r = c.messages.create(**kw, stop_sequences=stops)
        assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ('stop_sequence', want, ' one two three four ')
        with c.messages.stream(**kw, stop_sequences=stops) as stream:
            events = list(stream)
            final = stream.get_final_message()
        delta = next(e for e in events if e.type == 'message_delta').delta
        assert (delta.stop_reason, delta.stop_sequence) == ('stop_sequence', want)
        assert final.content[0].text == r.content[0].text
    # ended by end-of-sequence, by the budget, or by a call: no stop sequence, whatever was asked
    done = c.messages.create(**kw, stop_sequences=['eleven'])
    assert (done.stop_reason, done.stop_sequence) == ('end_turn', None)
    cut = c.messages.create(**dict(kw, max_tokens=3), stop_sequences=['ten'])
    assert (cut.stop_reason, cut.stop_sequence) == ('max_tokens', None)
    call = c.messages.create(**dict(kw, messages=[{'role': 'user', 'content': 'What is here?'}]), tools=TOOLS,
                             stop_sequences=['Never'])
    assert (call.stop_reason, call.stop_sequence) == ('tool_use', None)
