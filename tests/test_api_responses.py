"""``/v1/responses`` with the real ``openai`` client: items in and out, tools, reasoning, the
streamed events (reassembled = non-streamed), the bounded response store and
``previous_response_id`` reusing the cached previous reply, errors naming the Responses field
(and an image refused by the text model named in each endpoint's own terms);
and, on the same server, fixes of the chat / completions fields the Responses path shares
(``tool_choice`` without tools, completions ``top_logprobs`` holding the sampled token, streamed
logprobs in step with the text when ``stop`` holds text back).

Server: tiny full-attention Qwen3 with the Qwen3-style tools + thinking template, B=16, prefix
caching on, sampler scripted (tests/scripted_server.py) so the random model emits tool calls.
"""
from __future__ import annotations

import json
import os
import re
import sys

import httpx
import openai
import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import ApiServer

from lmdeploy.serve.openai.response_store import ResponseStore, ResponseStoreLimits
from lmdeploy.serve.openai.responses_protocol import ResponsesRequest, input_messages

TESTS = os.path.dirname(os.path.abspath(__file__))
TOOLS = [{'type': 'function', 'name': 'ls', 'description': 'List a directory.',
          'parameters': {'type': 'object', 'properties': {'path': {'type': 'string'}}, 'required': ['path']}}]
CALL_LS = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
COUNT = ' one two three four five six seven eight nine ten.'
ANSWER = '<think>\nThe listing has a.txt.\n</think>\n\nIt holds a.txt and b.txt.'
SCRIPT = [{'contains': 'What is here?', 'turn': 0, 'reply': 'Let me look.\n' + CALL_LS},
          {'contains': 'What is here?', 'turn': 1, 'reply': ANSWER},
          {'contains': 'Think first.', 'reply': ANSWER},
          {'contains': 'Count aloud', 'reply': COUNT},
          {'contains': 'Namespace please', 'turn': 0, 'reply': CALL_LS.replace('"ls"', '"fs.ls"')},
          {'contains': 'Namespace please', 'turn': 1, 'reply': 'Listed.'}]
SYSTEM = 'You are a careful agent. Look before you answer and keep answers short. ' * 4


# the store (no server) ------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5), st.integers(0, 400), st.lists(st.tuples(st.sampled_from(['put', 'get', 'del', 'tick']),
                                                                 st.integers(0, 7), st.integers(0, 120)), max_size=40))
def test_the_store_never_exceeds_its_bounds_and_forgets_expired_entries(max_entries, max_bytes, ops):
    clock = Clock()
    store = ResponseStore(ResponseStoreLimits(max_entries, max_bytes, ttl=10.0), clock)
    alive: dict[str, float] = {}
    for op, key, n in ops:
        rid = f'resp_{key}'
        if op == 'put':
            stored = store.put(rid, {'id': rid, 'pad': 'x' * n}, [{'role': 'user', 'content': 'y' * n}])
            alive.pop(rid, None)
            if stored:
                alive[rid] = clock.t
        elif op == 'get':
            got = store.get(rid)
            assert got is None or got.body['id'] == rid
            if got is not None:
                assert alive[rid] > clock.t - 10.0          # never served past its ttl (the store's arithmetic:
                #                                              10.1 - 0.1 >= 10 but 0.1 > 10.1 - 10 in floats)
        elif op == 'del':
            store.delete(rid)
            alive.pop(rid, None)
        else:
            clock.t += n / 10
        assert len(store) <= max_entries and store.bytes <= max_bytes
        assert all(store.get(r) is None for r, t in alive.items() if t <= clock.t - 10.0)


def test_the_store_evicts_least_recently_used_first():
    store = ResponseStore(ResponseStoreLimits(max_entries=2, max_bytes=1 << 20, ttl=60), Clock())
    store.put('a', {}, [])
    store.put('b', {}, [])
    store.get('a')                  # a is now the most recent
    store.put('c', {}, [])
    assert store.get('b') is None and store.get('a') is not None and store.get('c') is not None
    with pytest.raises(ValueError, match='--response-store-ttl'):
        ResponseStoreLimits(ttl=0)


def test_input_items_become_chat_messages_one_assistant_message_per_turn():
    req = ResponsesRequest.model_validate({'model': 'm', 'input': [
        {'role': 'user', 'content': 'hi'},
        {'type': 'reasoning', 'id': 'rs_1', 'summary': [], 'content': [{'type': 'reasoning_text', 'text': 'plan'}]},
        {'type': 'message', 'role': 'assistant', 'content': [{'type': 'output_text', 'text': 'Looking.'}]},
        {'type': 'function_call', 'call_id': 'c1', 'name': 'ls', 'arguments': '{}'},
        {'type': 'function_call', 'call_id': 'c2', 'name': 'ls', 'arguments': '{"path": "a"}'},
        {'type': 'function_call_output', 'call_id': 'c1', 'output': 'a'},
        {'type': 'function_call_output', 'call_id': 'c2', 'output': [{'type': 'input_text', 'text': 'b'}]},
        {'role': 'assistant', 'content': 'Done.'}, {'role': 'assistant', 'content': 'Again.'}]})
    assert input_messages(req.input) == [
        {'role': 'user', 'content': 'hi'},
        {'role': 'assistant', 'content': 'Looking.', 'reasoning_content': 'plan', 'tool_calls': [
            {'id': 'c1', 'type': 'function', 'function': {'name': 'ls', 'arguments': '{}'}},
            {'id': 'c2', 'type': 'function', 'function': {'name': 'ls', 'arguments': '{"path": "a"}'}}]},
        {'role': 'tool', 'tool_call_id': 'c1', 'content': 'a'}, {'role': 'tool', 'tool_call_id': 'c2', 'content': 'b'},
        {'role': 'assistant', 'content': 'Done.'}, {'role': 'assistant', 'content': 'Again.'}]
    assert input_messages('hello') == [{'role': 'user', 'content': 'hello'}]


_ITEMS = {'reasoning': lambda n: {'type': 'reasoning', 'summary': [{'type': 'summary_text', 'text': 'r'}]},
          'call': lambda n: {'type': 'function_call', 'call_id': f'c{n}', 'name': 'ls', 'arguments': '{}'},
          'output': lambda n: {'type': 'function_call_output', 'call_id': f'c{n}', 'output': 'o'},
          'assistant': lambda n: {'role': 'assistant', 'content': 'ok'}}
_PARTS = {'text': lambda n: {'type': 'input_text', 'text': f't{n}'},
          'image': lambda n: {'type': 'input_image', 'image_url': f'https://h/{n}.png'}}


@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.one_of(st.sampled_from(sorted(_ITEMS)),
                                st.lists(st.sampled_from(sorted(_PARTS)), min_size=1, max_size=4)),
                      min_size=1, max_size=8))
def test_every_chat_image_part_maps_back_to_its_input_image(items):
    """Whatever reasoning, calls and outputs merge or split the chat messages, each image part of
    the chat messages is named by the ``input`` location of the input_image it came from."""
    n = iter(range(1000))
    raw = [_ITEMS[t](next(n)) if isinstance(t, str) else
           {'role': 'user', 'content': [_PARTS[p](next(n)) for p in t]} for t in items]
    req = ResponsesRequest.model_validate({'model': 'm', 'input': raw})
    image_parts: dict = {}
    chat = input_messages(req.input, image_parts)
    urls = {(i, j): p['image_url']['url'] for i, m in enumerate(chat) if isinstance(m['content'], list)
            for j, p in enumerate(m['content']) if p['type'] == 'image_url'}
    assert set(image_parts) == set(urls)
    for key, where in image_parts.items():
        a, b = map(int, re.fullmatch(r'input\[(\d+)\]\.content\[(\d+)\]', where).groups())
        assert raw[a]['content'][b]['image_url'] == urls[key]


# served ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def server(tiny_qwen3, tmp_path_factory):
    model = with_template(tiny_qwen3, str(tmp_path_factory.mktemp('responses') / 'model'), THINKING_TOOLS_TEMPLATE)
    proc = ApiServer(model, '--block-size', '16', '--enable-prefix-caching', '--session-len', '2048',
                     '--response-store-max-entries', '8',
                     launcher=[sys.executable, os.path.join(TESTS, 'scripted_server.py')],
                     env={'LMDEPLOY_TEST_SCRIPT': json.dumps(SCRIPT)})
    try:
        yield proc.start()
    finally:
        proc.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + '/v1', api_key='unused', max_retries=0, timeout=120)


def _strip(response: dict) -> dict:
    """A response without what differs between two runs of the same request (ids, times, cache hits)."""
    out = {k: v for k, v in response.items() if k not in ('id', 'created_at', 'completed_at')}
    out['usage'] = dict(response['usage'], input_tokens_details=None)
    out['output'] = [{k: v for k, v in item.items() if k not in ('id', 'call_id')} for item in response['output']]
    return out


def test_two_turns_with_previous_response_id_reuse_the_cached_reply(server):
    c = client(server)
    first = c.responses.create(model='model', instructions=SYSTEM, input='What is here?', tools=TOOLS,
                               max_output_tokens=100)
    assert first.status == 'completed' and [o.type for o in first.output] == ['message', 'function_call']
    assert first.output_text == 'Let me look.'
    call = first.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ('ls', {'path': '.'}, 'completed')
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = c.responses.create(model='model', instructions=SYSTEM, previous_response_id=first.id, tools=TOOLS,
                                input=[{'type': 'function_call_output', 'call_id': call.call_id,
                                        'output': 'a.txt\nb.txt'}],
                                max_output_tokens=100)
    assert [o.type for o in second.output] == ['reasoning', 'message']
    assert second.output[0].content[0].text == 'The listing has a.txt.'
    assert second.output_text == 'It holds a.txt and b.txt.'
    # KV exists for turn 1's prompt and every generated token but the final EOS (never fed)
    computed = first.usage.input_tokens + first.usage.output_tokens - 1
    assert computed // 16 * 16 > first.usage.input_tokens                 # the reply spans a block boundary
    assert second.usage.input_tokens_details.cached_tokens == computed // 16 * 16
    # the same conversation sent whole (no store) renders to the same prompt
    replay = c.responses.create(model='model', instructions=SYSTEM, tools=TOOLS, store=False, max_output_tokens=100,
                                input=[{'role': 'user', 'content': 'What is here?'},
                                       *[o.model_dump(exclude_none=True) for o in first.output],
                                       {'type': 'function_call_output', 'call_id': call.call_id,
                                        'output': 'a.txt\nb.txt'}])
    assert replay.usage.input_tokens == second.usage.input_tokens and replay.output_text == second.output_text
    got = c.responses.retrieve(second.id)
    assert got.model_dump() == second.model_dump()
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(replay.id)                      # store: false
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match='previous_response_id'):
        c.responses.create(model='model', previous_response_id=second.id, input='more')


@pytest.mark.parametrize('prompt', ['What is here?', 'Think first.'])
def test_streamed_events_rebuild_the_non_streamed_response(server, prompt):
    c = client(server)
    kw = dict(model='model', input=prompt, tools=TOOLS, max_output_tokens=100, store=False)
    whole = c.responses.create(**kw).model_dump()
    events = list(c.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ['response.created', 'response.in_progress'] and types[-1] == 'response.completed'
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response.model_dump()
    assert _strip(done) == _strip(whole)
    # the deltas alone rebuild every item
    text = {}
    for e in events:
        if e.type in ('response.output_text.delta', 'response.reasoning_text.delta',
                      'response.function_call_arguments.delta'):
            text[e.item_id] = text.get(e.item_id, '') + e.delta
    for item in done['output']:
        want = item['arguments'] if item['type'] == 'function_call' else item['content'][0]['text']
        assert text[item['id']] == want
    added = [e.item.type for e in events if e.type == 'response.output_item.added']
    assert added == [o['type'] for o in done['output']] == \
        [e.item.type for e in events if e.type == 'response.output_item.done']


def test_fields_the_server_cannot_honour_are_refused_by_name(server):
    c = client(server)
    for kw, field in [(dict(tools=[*TOOLS, {'type': 'code_interpreter', 'container': {'type': 'auto'}}]), 'tools[1]'),
                      (dict(tools=[{'type': 'custom', 'name': 'apply_patch'}]), 'tools[0]'),
                      (dict(tools=[{'type': 'namespace', 'name': 'fs', 'description': 'x',
                                    'tools': [{'type': 'custom', 'name': 'p'}]}]), 'tools[0].tools[0]'),
                      (dict(tools=[{'type': 'web_search'}], tool_choice='required'), 'tool_choice'),
                      (dict(background=True), 'background'),
                      (dict(tools=TOOLS, tool_choice={'type': 'function', 'name': 'rm'}), 'tool_choice'),
                      (dict(input=[{'type': 'item_reference', 'id': 'x'}]), 'input[0]')]:
        kw = dict(dict(model='model', input='hi'), **kw)
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(**kw)
        assert err.value.body['param'].startswith(field), (kw, err.value.body)
    # text.format reaches the chat path's response_format: the two endpoints agree on it
    schema = {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a']}
    with httpx.Client(timeout=120) as h:
        chat = h.post(server.base_url + '/v1/chat/completions', json={
            'model': 'model', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4,
            'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}}})
        resp = h.post(server.base_url + '/v1/responses', json={
            'model': 'model', 'input': 'hi', 'max_output_tokens': 4,
            'text': {'format': {'type': 'json_schema', 'name': 'x', 'schema': schema}}})
    assert resp.status_code == chat.status_code
    if chat.status_code == 400:
        assert resp.json()['error']['param'] == 'text.format'
    # an extension the chat path does not have yet is refused, never dropped (a salt that is
    # ignored would share the prefix cache across tenants)
    from lmdeploy.serve.openai.protocol import ChatCompletionRequest
    with httpx.Client(timeout=120) as h:
        salted = h.post(server.base_url + '/v1/responses', json={'model': 'model', 'input': 'hi', 'max_output_tokens': 2,
                                                                 'cache_salt': 'tenant-a'})
    if 'cache_salt' in ChatCompletionRequest.model_fields:
        assert salted.status_code == 200
    else:
        assert salted.status_code == 400 and salted.json()['error']['param'] == 'cache_salt'


def test_max_output_tokens_cut_is_incomplete(server):
    r = client(server).responses.create(model='model', input='Think first.', max_output_tokens=3, store=False)
    assert r.status == 'incomplete' and r.incomplete_details.reason == 'max_output_tokens'
    assert r.usage.output_tokens == 3


# chat / completions fields shared with the Responses path -----------------------------------------------------------
def test_tool_choice_without_tools_is_a_400_everywhere(server):
    c = client(server)
    for choice in ('auto', 'none', 'required', {'type': 'function', 'function': {'name': 'ls'}}):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model='model', messages=[{'role': 'user', 'content': 'hi'}], tool_choice=choice)
        assert err.value.body['param'] == 'tool_choice' and 'tools' in err.value.body['message']
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model='model', input='hi', tool_choice='required')
    assert err.value.body['param'] == 'tool_choice'


@pytest.mark.parametrize('k', [0, 2])
def test_completion_top_logprobs_hold_the_sampled_token(server, k):
    r = client(server).completions.create(model='model', prompt='The model speaks:', max_tokens=6, logprobs=k,
                                          extra_body={'ignore_eos': True})       # the model's own greedy reply
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and max(top.values()) == value     # greedy: the sampled token is the top one
        assert len(top) == 1 if k == 0 else 1 <= len(top) <= k


@pytest.mark.parametrize('stop', [['seven e'], ['nine', 'ght n']])
def test_streamed_logprobs_describe_exactly_their_chunk(server, stop):
    """The text waits while it may become a stop string; each chunk's entries are the tokens of
    its own text (the last chunk also carries the tokens the stop string cut off), and all
    chunks together equal the non-streamed logprobs."""
    c = client(server)
    kw = dict(model='model', prompt='Count aloud:', max_tokens=40, logprobs=1, stop=stop)
    whole = c.completions.create(**kw).choices[0]
    assert whole.text == COUNT[:min(COUNT.find(w) for w in stop)]
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    with_text = [ch for ch in chunks if ch.text]
    assert len(with_text) > 3
    for ch in chunks[:-1]:
        assert ''.join(ch.logprobs.tokens if ch.logprobs else []) == ch.text
    last = chunks[-1]
    assert ''.join(last.logprobs.tokens).startswith(last.text)
    tokens = [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset]
    assert (tokens, offsets) == (whole.logprobs.tokens, whole.logprobs.text_offset)
    assert ''.join(ch.text for ch in chunks) == whole.text


# tool types, log-probabilities ---------------------------------------------------------------------------------
NAMESPACE = {'type': 'namespace', 'name': 'fs', 'description': 'The file system.',
             'tools': [dict(TOOLS[0], description='List a directory.')]}


def test_namespaced_functions_are_called_by_namespace_and_name(server):
    c = client(server)
    kw = dict(model='model', instructions=SYSTEM, tools=[NAMESPACE, {'type': 'web_search'}], max_output_tokens=60)
    first = c.responses.create(**kw, input='Namespace please.')
    call = first.output[-1]
    assert (call.type, call.namespace, call.name, json.loads(call.arguments)) == ('function_call', 'fs', 'ls',
                                                                                 {'path': '.'})
    assert [t['type'] for t in first.model_dump()['tools']] == ['namespace', 'web_search']      # echoed as sent
    streamed = [e for e in c.responses.create(**kw, input='Namespace please.', stream=True, store=False)
                if e.type == 'response.output_item.done']
    assert (streamed[-1].item.namespace, streamed[-1].item.name) == ('fs', 'ls')
    second = c.responses.create(**kw, previous_response_id=first.id,
                                input=[{'type': 'function_call_output', 'call_id': call.call_id, 'output': 'a.txt'}])
    assert second.output_text == 'Listed.'
    computed = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == computed // 16 * 16     # the call re-rendered alike
    replay = c.responses.create(**kw, store=False, input=[
        {'role': 'user', 'content': 'Namespace please.'}, call.model_dump(exclude_none=True),
        {'type': 'function_call_output', 'call_id': call.call_id, 'output': 'a.txt', 'namespace': 'fs'}])
    assert replay.usage.input_tokens == second.usage.input_tokens and replay.output_text == 'Listed.'
    # web_search alone: accepted, never called (auto means the model may decline it)
    plain = c.responses.create(model='model', input='Think first.', tools=[{'type': 'web_search'}], tool_choice='auto',
                               max_output_tokens=60, store=False)
    assert plain.output_text == 'It holds a.txt and b.txt.'


def _chat_logprobs(server, top: int) -> list[dict]:
    with httpx.Client(timeout=120) as h:
        r = h.post(server.base_url + '/v1/chat/completions', json={
            'model': 'model', 'messages': [{'role': 'user', 'content': 'Speak freely.'}], 'max_tokens': 12,
            'temperature': 0, 'logprobs': True, 'top_logprobs': top,
            'chat_template_kwargs': {'enable_thinking': False}})
    choice = r.json()['choices'][0]
    return choice['message']['content'], choice['logprobs']['content']


def _same_entries(got: list[dict], want: list[dict]):
    # the same tokens; values within 1e-4 (the later request reads the earlier one's prompt from
    # the prefix cache, and logits of a cached prefix differ from a cold prefill in float32 rounding)
    strip = lambda es: [(e['token'], e['bytes'], [(t['token'], t['bytes']) for t in e['top_logprobs']])  # noqa: E731
                        for e in es]
    assert strip(got) == strip(want)
    for g, w in zip(got, want):
        assert abs(g['logprob'] - w['logprob']) <= 1e-4
        assert all(abs(a['logprob'] - b['logprob']) <= 1e-4 for a, b in zip(g['top_logprobs'], w['top_logprobs']))


@pytest.mark.parametrize('top', [0, 3])
def test_output_text_logprobs_equal_the_chat_ones(server, top):
    """The model's own greedy reply: the output_text's entries are the chat completion's for the
    same prompt, streamed deltas together are the whole list, and nothing comes without include."""
    text, want = _chat_logprobs(server, top)
    assert text and ''.join(e['token'] for e in want) == text
    c = client(server)
    kw = dict(model='model', input='Speak freely.', max_output_tokens=12, temperature=0, store=False,
              reasoning={'effort': 'none'}, top_logprobs=top)
    r = c.responses.create(**kw, include=['message.output_text.logprobs']).model_dump()
    part = r['output'][-1]['content'][0]
    assert part['text'] == text
    _same_entries(part['logprobs'], want)
    assert all(len(e['top_logprobs']) == top for e in part['logprobs'])
    events = list(c.responses.create(**kw, include=['message.output_text.logprobs'], stream=True))
    deltas = [lp.model_dump() for e in events if e.type == 'response.output_text.delta' for lp in e.logprobs]
    done = next(e for e in events if e.type == 'response.output_text.done')
    assert deltas == [lp.model_dump() for lp in done.logprobs]
    assert ''.join(e.delta for e in events if e.type == 'response.output_text.delta') == text
    _same_entries(deltas, want)
    assert events[-1].response.model_dump()['output'][-1]['content'][0]['logprobs'] == deltas
    plain = c.responses.create(**kw).model_dump()
    assert plain['output'][-1]['content'][0]['logprobs'] == []


def test_output_text_logprobs_skip_the_reasoning_and_the_call(server):
    c = client(server)
    r = c.responses.create(model='model', input='What is here?', tools=TOOLS, max_output_tokens=100, store=False,
                           include=['message.output_text.logprobs'], top_logprobs=1)
    msg = next(o for o in r.output if o.type == 'message')
    tokens = ''.join(lp.token for lp in msg.content[0].logprobs)
    assert msg.content[0].text == 'Let me look.' and tokens.strip() == 'Let me look.'
    r = c.responses.create(model='model', input='Think first.', max_output_tokens=100, store=False,
                           include=['message.output_text.logprobs'])
    tokens = ''.join(lp.token for lp in r.output[-1].content[0].logprobs)
    assert tokens.endswith('It holds a.txt and b.txt.') and 'listing' not in tokens


PNG = 'data:image/png;base64,iVBORw0KGgo='
# each endpoint's request with an image placed where its own index differs from the chat one,
# and how that API names the refused image: (path, body, the Responses/chat param (the part's
# location) or None for Anthropic's body, which has no param, the location and the part's name in
# the message)
IMAGE_REQUESTS = {
    'chat': ('/v1/chat/completions', {'model': 'model', 'max_tokens': 2, 'messages': [
        {'role': 'system', 'content': 'S'},
        {'role': 'user', 'content': [{'type': 'text', 'text': 'see'},
                                     {'type': 'image_url', 'image_url': {'url': PNG}}]}]},
        'messages[1].content[1]', "messages[1].content[1]: model 'model' does not accept image_url parts"),
    'responses': ('/v1/responses', {'model': 'model', 'max_output_tokens': 2, 'store': False, 'instructions': 'S',
                                    'input': [{'role': 'user', 'content': 'hi'}, {'role': 'user', 'content': [
                                        {'type': 'input_text', 'text': 'see'},
                                        {'type': 'input_image', 'image_url': PNG}]}]},
                  'input[1].content[1]', "input[1].content[1]: model 'model' does not accept input_image parts"),
    **{name: (path, {'model': 'model', 'max_tokens': 2, 'system': 'S', 'messages': [
        {'role': 'user', 'content': 'ls'},
        {'role': 'assistant', 'content': [{'type': 'tool_use', 'id': 't1', 'name': 'ls', 'input': {}}]},
        {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': 't1', 'content': 'a.txt'},
                                     {'type': 'text', 'text': 'see'},
                                     {'type': 'image', 'source': {'type': 'base64', 'media_type': 'image/png',
                                                                  'data': PNG.split(',')[1]}}]}]},
              None, "messages[2].content[2]: model 'model' does not accept image blocks")
       for name, path in (('messages', '/v1/messages'), ('count_tokens', '/v1/messages/count_tokens'))},
}


@pytest.mark.parametrize('api', sorted(IMAGE_REQUESTS))
def test_an_image_to_a_text_model_is_refused_in_each_apis_own_names(server, api):
    path, body, param, message = IMAGE_REQUESTS[api]
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400
        if param is None:       # Anthropic's error shape
            assert r.json() == {'type': 'error', 'error': {'type': 'invalid_request_error', 'message': message}}
        else:
            assert r.json() == {'error': {'message': message, 'type': 'invalid_request_error', 'param': param,
                                          'code': 'invalid_value'}}
        # the server keeps serving, the same endpoint included
        ok = c.post('/v1/responses', json={'model': 'model', 'input': 'hi', 'max_output_tokens': 2, 'store': False})
        assert ok.status_code == 200 and ok.json()['status'] in ('completed', 'incomplete')
