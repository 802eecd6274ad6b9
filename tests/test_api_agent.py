"""An agent client against the OpenAI API: tools, tool-call history, reasoning, logprobs,
request limits, strict validation and graceful shutdown.

Servers (tiny hybrid Qwen3-Next with a Qwen3-style tools + thinking template, quick-start
geometry B=16, A=64 so a short agent conversation crosses checkpoint boundaries), all started
through tests/scripted_server.py, whose sampler is forced to scripted replies for chosen
turns (the model's own greedy reply otherwise), so the random tiny model emits tool calls:
  off    prefix caching off (the reference), --max-request-bytes 6000000
  cache  --enable-prefix-caching
  last   --enable-prefix-caching --prefill-save-last-only
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
import types

import httpx
import openai
import pytest
import torch
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import ApiServer

from lmdeploy import GenerationConfig
from lmdeploy.serve.openai.protocol import ChatMessage
from lmdeploy.serve.openai.reasoning_parser import get_reasoning_parser
from lmdeploy.serve.openai.tool_parser import get_tool_parser
from lmdeploy.serve.pipeline import Pipeline, render_chat

TESTS = os.path.dirname(os.path.abspath(__file__))
GEOMETRY = ('--block-size', '16', '--prefill-save-alignment', '64', '--max-prefill-token-num', '128',
            '--session-len', '2048')
MAX_BYTES = 6_000_000
TOOLS = [
    {'type': 'function', 'function': {'name': 'ls', 'description': 'List the files of a directory.',
                                      'parameters': {'type': 'object', 'properties': {'path': {'type': 'string'}},
                                                     'required': ['path']}}},
    {'type': 'function', 'function': {'name': 'read_file', 'description': 'Read a text file.',
                                      'parameters': {'type': 'object', 'properties': {'path': {'type': 'string'}},
                                                     'required': ['path']}}},
]
RESULTS = {'ls': 'a.txt\nb.txt', 'read_file': 'salt, wool, copper'}
CALL_LS = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
CALL_READ = ('<think>\nThe listing has a.txt; read it.\n</think>\n\nLet me read it.\n'
             '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>')
BROKEN = '<tool_call>\n{"name": "ls", "arguments": {oops}\n</tool_call>'
UNICODE = 'héllo 世界 🌍'
CALL_READ_PLAIN = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
COMPACT_ARGS = '{"path":".","deep":true,"note":"\\u00fc 1e3"}'       # not json.dumps' spacing, an escape
CALL_COMPACT = '<tool_call>\n{"name": "ls", "arguments": ' + COMPACT_ARGS + '}\n</tool_call>'
CALL_REPLIES = {'one call please': CALL_LS, 'two calls please': CALL_LS + '\n' + CALL_READ_PLAIN,
                'look first please': 'Let me look.\n' + CALL_LS,
                'look then two please': 'Two things.\n' + CALL_READ_PLAIN + '\n' + CALL_LS}
SCRIPT = [  # first match wins: a substring of the prompt, its ending, or the assistant turn index
    {'contains': 'greet the world', 'reply': UNICODE},
    *({'contains': key, 'reply': reply} for key, reply in CALL_REPLIES.items()),
    {'contains': 'break the call', 'reply': BROKEN},
    {'contains': 'compact call please', 'reply': CALL_COMPACT},
    {'contains': 'think aloud', 'reply': '<think>\nhmm\n</think>\n\nDone.'},
    {'contains': 'answer plainly', 'reply': 'Done.'},
    {'endswith': '"arguments":', 'reply': ' {"path": "b.txt"}}\n</tool_call>'},
    {'endswith': '<tool_call>\n', 'reply': '{"name": "ls", "arguments": {"path": "/"}}\n</tool_call>'},
    {'turn': 0, 'reply': CALL_LS},
    {'turn': 1, 'reply': CALL_READ},
]
SYSTEM = ('You are a coding agent working in a small repository. Use the tools to look at files before you '
          'answer, keep answers short, and say which file each fact came from. ') * 3


# parsers (no server) ---------------------------------------------------------------------------------------
def _feed(stream, text: str, cuts: list[int]):
    out, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out.append(stream.feed(text[prev:c]))
        prev = c
    out.append(stream.finish())
    return out


def _merge_fragments(frags: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    for f in frags:
        entry = calls.setdefault(f['index'], [None, ''])
        entry[0] = f['function'].get('name', entry[0])
        entry[1] += f['function'].get('arguments', '')
    return [tuple(calls[i]) for i in sorted(calls)]


PIECES = ['Sure. ', '\n', CALL_LS, '<tool_call>\n{"name": "read_file", "arguments": "{\\"path\\": \\"x\\"}"}'
          '\n</tool_call>', BROKEN, '<tool_', 'text <tool_call> unterminated', '  ', '</tool_call>', 'more']


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=6), st.lists(st.integers(1, 400), max_size=12))
def test_streamed_tool_calls_reassemble_to_the_parsed_reply(pieces, cuts):
    parser = get_tool_parser('hermes')
    text = ''.join(pieces)
    whole = parser.parse(text)
    out = _feed(parser.stream(), text, [c for c in cuts if c < len(text)])
    assert ''.join(c for c, _ in out) == (whole.content or '')
    assert _merge_fragments([f for _, fs in out for f in fs]) == [(c.name, c.arguments) for c in whole.calls]


_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_JSON = st.recursive(_JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _JSON, max_size=4), st.sampled_from([(',', ':'), (', ', ': '), (' ,', ' : ')]),
       st.booleans(), st.sampled_from([None, 1]), st.sampled_from(['', ' ', '\n']))
def test_call_arguments_are_the_models_own_text(tiny_qwen3, args, separators, ascii_only, indent, pad):
    """Whatever spacing, escaping and layout the model used for an arguments object, the parsed
    call returns exactly that text (JSON equal to the object), so a client that sends the reply
    back gets the model's own text from a template that prints string arguments verbatim
    (make-tiny-model's, like Qwen's)."""
    raw = json.dumps(args, separators=separators, ensure_ascii=ascii_only, indent=indent)
    text = f'<tool_call>\n{{"name": "ls",{pad}"arguments": {pad}{raw}{pad}}}\n</tool_call>'
    (call,) = get_tool_parser('hermes').parse(text).calls
    assert (call.name, call.arguments) == ('ls', raw) and json.loads(call.arguments) == args
    generated = f'<tool_call>\n{{"name": "ls", "arguments": {raw}}}\n</tool_call>'     # the template's layout
    (call,) = get_tool_parser('hermes').parse(generated).calls
    history = [{'role': 'user', 'content': 'x'},
               {'role': 'assistant', 'content': None, 'tool_calls': [call.to_openai()]}]
    assert '<|im_start|>assistant\n' + generated + '<|im_end|>' in render_chat(_tokenizer(tiny_qwen3), history)


@functools.lru_cache(maxsize=None)
def _tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_JSON.map(json.dumps), st.text(alphabet='{}[]":, \n0aen\\', max_size=24)))
def test_object_member_scan_agrees_with_json_loads(text):
    from lmdeploy.serve.openai.tool_parser import _top_level_members
    def refuse(name):
        raise ValueError(name)
    try:
        ref = json.loads(text, parse_constant=refuse)        # strict JSON: no NaN / Infinity
    except ValueError:
        ref = None
    got = _top_level_members(text)
    if not isinstance(ref, dict):
        assert got is None
    else:
        assert {k: v for k, (v, _) in got.items()} == ref
        assert all(json.loads(raw) == v for v, raw in got.values())


@pytest.mark.parametrize('body', ['{"name": "ls", "arguments": {"x": NaN}}', '{"name": "ls", "arguments": {"x": -Infinity}}',
                                  '{"name": "ls", "arguments": "{\\"x\\": Infinity}"}'])
def test_arguments_that_are_not_strict_json_leave_the_block_as_text(body):
    text = f'<tool_call>\n{body}\n</tool_call>'
    got = get_tool_parser('hermes').parse(text)
    assert got.calls == [] and got.content == text


def test_tool_parser_reads_calls_and_keeps_malformed_blocks_as_text():
    parser = get_tool_parser('hermes')
    got = parser.parse('Let me look.\n' + CALL_LS + '\n' + BROKEN + '\n')
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [('ls', {'path': '.'})]
    assert got.content == 'Let me look.\n\n' + BROKEN
    assert parser.parse(CALL_LS[:-3]).calls == []                       # cut off: plain text
    assert parser.parse(CALL_LS[:-3]).content == CALL_LS[:-3]
    assert parser.parse('<tool_call>\n["ls"]\n</tool_call>').calls == []      # not an object
    with pytest.raises(ValueError, match='hermes'):
        get_tool_parser('nope')


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(['<think>\nplan\n</think>\n\nAnswer.', 'plan</think>\n\nAnswer', '  Hello <think>',
                        '<think>\ncut off', '\n\n', '<thi', 'Answer only.', '<think></think>x']),
       st.booleans(), st.lists(st.integers(1, 40), max_size=8))
def test_streamed_reasoning_equals_the_parsed_reply(text, started, cuts):
    parser = get_reasoning_parser('think')
    out = _feed(parser.stream(started), text, [c for c in cuts if c < len(text)])
    assert (''.join(r for r, _ in out) or None, ''.join(c for _, c in out) or None) == parser.parse(text, started)


def test_reasoning_split_examples():
    parser = get_reasoning_parser('think')
    assert parser.parse('<think>\nplan\n</think>\n\nAnswer.') == ('plan', 'Answer.')
    assert parser.parse('plan</think>\n\nAnswer', started=True) == ('plan', 'Answer')
    assert parser.parse('<think>\ncut off') == ('cut off', None)
    assert parser.parse('Answer only.') == (None, 'Answer only.')


def test_chat_output_reasoning_then_calls_and_parallel_switch():
    from lmdeploy.serve.openai.chat_output import ChatOutput
    text = CALL_READ + '\n' + CALL_LS
    for parallel, names in ((True, ['read_file', 'ls']), (False, ['read_file'])):
        out = ChatOutput(get_reasoning_parser('think'), False, get_tool_parser('hermes'), '', parallel)
        msg = out.message(text)
        assert [c['function']['name'] for c in msg['tool_calls']] == names
        assert (msg['reasoning_content'], msg['content']) == ('The listing has a.txt; read it.', 'Let me read it.')
        assert out.finish_reason('stop') == 'tool_calls' and out.finish_reason('abort') == 'abort'
        stream = ChatOutput(get_reasoning_parser('think'), False, get_tool_parser('hermes'), '', parallel)
        deltas = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)] + [stream.finish()]
        assert [n for n, _ in _merge_fragments([f for d in deltas for f in d.get('tool_calls', [])])] == names
        assert ''.join(d.get('reasoning_content', '') for d in deltas) == msg['reasoning_content']
        assert ''.join(d.get('content', '') for d in deltas) == msg['content']


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([None, 'ls', 'read_file', '']), st.booleans(),
       st.lists(st.sampled_from(['', '{"path": "."}}', '\n</tool_call>', 'oops', '{"name": "ls", "arguments": {}}',
                                 '<think>x</think>', ' text ']), max_size=4),
       st.lists(st.integers(0, 60), max_size=6))
def test_streamed_chat_deltas_equal_the_whole_reply_with_a_forced_prefix(forced, reasoning, parts, cuts):
    """Any forced opening (``tool_choice`` required / named, or none), any reply (empty
    included: a reply that ends at once) and any chunking, fed as the server feeds it (only
    non-empty text, then ``finish``): the streamed content, reasoning and calls equal the
    non-streamed message."""
    from lmdeploy.serve.openai.chat_output import ChatOutput
    tools = get_tool_parser('hermes')
    prefix = '' if forced == '' else tools.forced_prefix(forced)
    text = ''.join(parts)
    parser = get_reasoning_parser('think') if reasoning else None
    msg = ChatOutput(parser, False, tools, prefix, True).message(text)
    stream = ChatOutput(parser, False, tools, prefix, True)
    bounds = [0] + sorted(c for c in cuts if c < len(text)) + [len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]) if text[a:b]] + [stream.finish()]
    assert (''.join(d.get('content', '') for d in deltas) or None) == (msg['content'] or None)
    if reasoning:
        assert (''.join(d.get('reasoning_content', '') for d in deltas) or None) == msg['reasoning_content']
    calls = _merge_fragments([f for d in deltas for f in d.get('tool_calls', [])])
    assert calls == [(c['function']['name'], c['function']['arguments']) for c in msg.get('tool_calls', [])]


def test_chat_output_deltas_never_repeat_an_index_and_first_call_stop():
    from lmdeploy.serve.openai.chat_output import ChatOutput
    text = CALL_READ + '\n' + CALL_LS
    for size in (1, 5, 40, len(text)):
        out = ChatOutput(get_reasoning_parser('think'), False, get_tool_parser('hermes'), '', True)
        deltas = [out.feed(text[i:i + size]) for i in range(0, len(text), size)]
        deltas[-1] = ChatOutput.merge_deltas(deltas[-1], out.finish())
        for d in deltas:
            indices = [f['index'] for f in d.get('tool_calls', [])]
            assert len(indices) == len(set(indices)), d
        frags = [f for d in deltas for f in d.get('tool_calls', [])]
        assert [(f['function']['name'], f['function']['arguments']) for f in frags] == \
            [('read_file', '{"path": "a.txt"}'), ('ls', '{"path": "."}')]
    # the first complete call ends the reply with parallel_tool_calls false; calls in the
    # reasoning block and malformed blocks do not count
    cases = [(CALL_READ + '\n' + CALL_LS, get_reasoning_parser('think'), len(CALL_READ)),
             ('<think>\n' + CALL_LS + '\n</think>\n\n' + BROKEN + '\n' + CALL_LS + 'more',
              get_reasoning_parser('think'), None),
             (BROKEN + '\n' + CALL_LS + '\n' + CALL_LS, None, len(BROKEN) + 1 + len(CALL_LS))]
    cases[1] = (cases[1][0], cases[1][1], len(cases[1][0]) - len('more'))
    for text, reasoning, want in cases:
        for size in (1, 7, len(text)):
            stop = ChatOutput(reasoning, False, get_tool_parser('hermes'), '', False).first_call_stop()
            got, seen = None, ''
            for i in range(0, len(text), size):
                seen += text[i:i + size]
                got = stop(seen)
                if got is not None:
                    break
            assert got == want, (text, size)
    prefix = get_tool_parser('hermes').forced_prefix('ls')
    stop = ChatOutput(None, False, get_tool_parser('hermes'), prefix, False).first_call_stop()
    assert stop('{"path": "."}}\n</tool_call>\n<tool_call>') == len('{"path": "."}}\n</tool_call>')
    assert ChatOutput(None, False, get_tool_parser('hermes'), '', True).first_call_stop() is None


# history rendering (no server) --------------------------------------------------------------------------------
CALL = {'id': 'call_1', 'type': 'function', 'function': {'name': 'ls', 'arguments': '{"path": "."}'}}
TRANSCRIPTS = [
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None, 'tool_calls': [CALL]},
     {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'a.txt'}],
    [{'role': 'developer', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is in the repo?'},
     {'role': 'assistant', 'content': 'Looking.', 'tool_calls': [
         CALL, {'id': 'call_2', 'type': 'function', 'function': {'name': 'read_file', 'arguments': '{"path": "a"}'}}]},
     {'role': 'tool', 'tool_call_id': 'call_1', 'name': 'ls', 'content': 'a.txt'},
     {'role': 'tool', 'tool_call_id': 'call_2', 'name': 'read_file', 'content': [{'type': 'text', 'text': 'salt'}]},
     {'role': 'assistant', 'content': 'It holds salt.'},
     {'role': 'user', 'content': [{'type': 'text', 'text': 'And '}, {'type': 'text', 'text': 'b?'}]}],
    [{'role': 'system', 'content': [{'type': 'text', 'text': 'You help.'}]},
     {'role': 'user', 'content': 'Hello'}, {'role': 'assistant', 'content': 'Hi!'},
     {'role': 'developer', 'content': 'Answer in one word.'}, {'role': 'user', 'content': 'Ready?'}],
]


@pytest.fixture(scope='module')
def thinking_model(tiny_qwen3_next, tmp_path_factory):
    return with_template(tiny_qwen3_next, str(tmp_path_factory.mktemp('thinking') / 'model'),
                         THINKING_TOOLS_TEMPLATE)


@pytest.mark.parametrize('which', ['chatml', 'thinking'])
@pytest.mark.parametrize('tools', [None, TOOLS], ids=['no_tools', 'tools'])
@pytest.mark.parametrize('index', range(len(TRANSCRIPTS)))
def test_history_renders_token_identically_to_apply_chat_template(tiny_qwen3_next, thinking_model, which,
                                                                  tools, index):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_next if which == 'chatml' else thinking_model)
    messages = TRANSCRIPTS[index]
    served = [ChatMessage(**m).for_template() for m in messages]      # what the server builds from the JSON
    stub = types.SimpleNamespace(tokenizer=tok, engine=types.SimpleNamespace(session_len=1 << 20))
    got = Pipeline.tokenize(stub, render_chat(tok, served, tools))
    as_system = [dict(m, role='system') if m['role'] == 'developer' else m for m in messages]
    try:
        want = tok.apply_chat_template(as_system, tools=tools, add_generation_prompt=True, tokenize=True)
    except TypeError:       # the tiny ChatML template cannot prefix a text-part system message to the tools
        assert which == 'chatml' and tools and isinstance(messages[0]['content'], list)
        as_system[0] = dict(as_system[0], content=''.join(p['text'] for p in messages[0]['content']))
        want = tok.apply_chat_template(as_system, tools=tools, add_generation_prompt=True, tokenize=True)
    want = want['input_ids']
    assert got == list(want)
    text = tok.decode(got)
    if index != 2:
        assert '<tool_call>' in text and 'a.txt' in text                 # the call and its result are in


def test_logprobs_equal_transformers_for_greedy(tiny_qwen3):
    from engine_utils import hf_prompt_logits, load_hf, make_engine, random_prompt
    engine = make_engine(tiny_qwen3)
    prompt = random_prompt(20, seed=4)
    seq = engine.add_request(prompt, GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3))
    lps = []
    while not seq.is_finished:
        lps += [lp for out in engine.step() if out.seq is seq for lp in out.logprobs]
    assert len(seq.output_ids) == 6
    hf = load_hf(tiny_qwen3)
    with torch.no_grad():
        ref = torch.log_softmax(hf_prompt_logits(hf, prompt + seq.output_ids[:-1])[len(prompt) - 1:], dim=-1)
    assert [lp.token_id for lp in lps] == seq.output_ids
    for lp, row in zip(lps, ref):
        assert abs(lp.logprob - float(row[lp.token_id])) <= 1e-4
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - float(r)) for (_, v), r in zip(lp.top, top.values)) <= 1e-4
        assert lp.top[0][0] == lp.token_id                   # greedy picks the most likely token

def test_sampler_logprobs_are_those_of_the_processed_distribution():
    from lmdeploy.pytorch.sampling.sampler import sample
    from lmdeploy.pytorch.paging.sequence import Sequence
    row = torch.tensor([[2.0, 0.8, 0.5, -1.0, 3.0]])
    # greedy with a repetition penalty on tokens 0 and 4: log-softmax of the penalised logits
    seq = Sequence([0, 4], GenerationConfig(repetition_penalty=2.0, logprobs=5))
    (token,), (lp,) = sample(row.clone(), [seq])
    want = torch.log_softmax(torch.tensor([1.0, 0.8, 0.5, -1.0, 1.5]), dim=-1)
    assert token == 4 and abs(lp.logprob - float(want[4])) < 1e-6
    assert [t for t, _ in lp.top] == [4, 0, 1, 2, 3] and abs(lp.top[1][1] - float(want[0])) < 1e-6
    # sampling at T=0.5 with top_k=2: only the two kept tokens, renormalised
    seq = Sequence([1], GenerationConfig(do_sample=True, temperature=0.5, top_k=2, logprobs=3, random_seed=3))
    (token,), (lp,) = sample(row.clone(), [seq])
    kept = torch.log_softmax(torch.tensor([2.0, 3.0]) / 0.5, dim=-1)
    assert token in (0, 4) and [t for t, _ in lp.top] == [4, 0]                  # filtered tokens left out
    assert max(abs(v - float(w)) for (_, v), w in zip(lp.top, kept.flip(0))) < 1e-6
    assert sample(row.clone(), [Sequence([1], GenerationConfig())])[1] == [None]       # off by default


# servers ------------------------------------------------------------------------------------------------------
def scripted(model: str, *flags: str) -> ApiServer:
    return ApiServer(model, *GEOMETRY, *flags, launcher=[sys.executable, os.path.join(TESTS, 'scripted_server.py')],
                     env={'LMDEPLOY_TEST_SCRIPT': json.dumps(SCRIPT)})


@pytest.fixture(scope='module')
def servers(thinking_model):
    procs = {'off': scripted(thinking_model, '--max-request-bytes', str(MAX_BYTES)),
             'cache': scripted(thinking_model, '--enable-prefix-caching'),
             'last': scripted(thinking_model, '--enable-prefix-caching', '--prefill-save-last-only')}
    try:
        for p in procs.values():
            p.launch()
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def client(server: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + '/v1', api_key='unused', max_retries=0, timeout=120)


def name(server: ApiServer) -> str:
    return os.path.basename(server.model_path.rstrip('/'))


def template_len(model: str, messages: list[dict], tools=None, **kwargs) -> int:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    as_system = [dict(m, role='system') if m['role'] == 'developer' else m for m in messages]
    return len(tok.apply_chat_template(as_system, tools=tools, add_generation_prompt=True, tokenize=True,
                                       **kwargs)['input_ids'])


def _stream_message(chunks) -> tuple[dict, str, list]:
    """Reassemble a streamed chat choice: (message fields, finish_reason, logprobs content)."""
    content, reasoning, frags, reason, lps = '', '', [], None, []
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ''
        reasoning += getattr(c.delta, 'reasoning_content', None) or ''
        frags += [f.model_dump(exclude_none=True) for f in c.delta.tool_calls or []]
        reason = c.finish_reason or reason
        lps += [e.model_dump() for e in (c.logprobs.content if c.logprobs else [])]
    return {'content': content or None, 'reasoning_content': reasoning or None,
            'tool_calls': _merge_fragments(frags)}, reason, lps


def agent_loop(server: ApiServer, stream: bool = False) -> list[dict]:
    """Three turns: two scripted tool calls (their results appended), then the model's own answer.
    Returns per turn the reply's fields, finish reason, usage and logprobs."""
    messages = [{'role': 'developer', 'content': SYSTEM}, {'role': 'user', 'content': 'What is in a.txt?'}]
    out = []
    for turn in range(3):
        kw = dict(model=name(server), messages=messages, tools=TOOLS, max_tokens=100, logprobs=True, top_logprobs=2)
        if stream:
            chunks = list(client(server).chat.completions.create(**kw, stream=True,
                                                                stream_options={'include_usage': True}))
            fields, reason, lps = _stream_message(chunks)
            usage = chunks[-1].usage
            calls = [{'id': f'call_{turn}_{i}', 'type': 'function', 'function': {'name': n, 'arguments': a}}
                     for i, (n, a) in enumerate(fields['tool_calls'])]
        else:
            r = client(server).chat.completions.create(**kw)
            msg, reason, usage = r.choices[0].message, r.choices[0].finish_reason, r.usage
            lps = [e.model_dump() for e in r.choices[0].logprobs.content]
            calls = [c.model_dump() for c in msg.tool_calls or []]
            fields = {'content': msg.content, 'reasoning_content': getattr(msg, 'reasoning_content', None),
                      'tool_calls': [(c['function']['name'], c['function']['arguments']) for c in calls]}
        out.append(dict(fields, finish_reason=reason, prompt_tokens=usage.prompt_tokens,
                        cached=usage.prompt_tokens_details.cached_tokens, prompt_len=template_len(
                            server.model_path, messages, TOOLS), logprobs=lps))
        messages.append({'role': 'assistant', 'content': fields['content'], **({'tool_calls': calls} if calls else {})})
        for c in calls:
            messages.append({'role': 'tool', 'tool_call_id': c['id'], 'name': c['function']['name'],
                             'content': RESULTS[c['function']['name']]})
    return out


@pytest.fixture(scope='module')
def reference_loop(servers):
    return agent_loop(servers['off'])


def test_agent_loop_calls_tools_and_every_later_turn_hits_the_cache(servers, reference_loop):
    first, second, third = reference_loop
    assert first['tool_calls'] == [('ls', '{"path": "."}')] and first['finish_reason'] == 'tool_calls'
    assert first['content'] is None and first['reasoning_content'] is None
    assert second['tool_calls'] == [('read_file', '{"path": "a.txt"}')] and second['finish_reason'] == 'tool_calls'
    assert (second['reasoning_content'], second['content']) == ('The listing has a.txt; read it.', 'Let me read it.')
    assert third['tool_calls'] == [] and third['finish_reason'] in ('stop', 'length') and third['content']
    # the server renders the whole history (tool calls, tool results, developer) as the template does
    assert [t['prompt_tokens'] for t in reference_loop] == [t['prompt_len'] for t in reference_loop]
    assert all(t['cached'] == 0 for t in reference_loop)
    for name_ in ('cache', 'last'):
        turns = agent_loop(servers[name_])
        strip = [{k: v for k, v in t.items() if k not in ('cached', 'logprobs')} for t in turns]
        assert strip == [{k: v for k, v in t.items() if k not in ('cached', 'logprobs')} for t in reference_loop]
        assert turns[0]['cached'] == 0 and all(t['cached'] > 0 for t in turns[1:]), (name_, turns)
        # turn k+1 reuses the last aligned boundary of turn k's prompt (its prefix is identical)
        assert [t['cached'] for t in turns[1:]] == [(t['prompt_tokens'] - 1) // 64 * 64 for t in turns[:-1]]
        for got, want in zip(turns, reference_loop):
            assert [e['token'] for e in got['logprobs']] == [e['token'] for e in want['logprobs']]
            assert max((abs(a['logprob'] - b['logprob']) for a, b in zip(got['logprobs'], want['logprobs'])),
                       default=0) <= 1e-4


def test_streamed_agent_loop_reassembles_to_the_non_streamed_replies(servers, reference_loop):
    streamed = agent_loop(servers['cache'], stream=True)
    keys = ('content', 'reasoning_content', 'tool_calls', 'finish_reason', 'prompt_tokens')
    assert [{k: t[k] for k in keys} for t in streamed] == [{k: t[k] for k in keys} for t in reference_loop]
    assert [len(t['logprobs']) for t in streamed] == [len(t['logprobs']) for t in reference_loop]


def test_logprobs_are_real_values(servers, reference_loop):
    third = reference_loop[2]['logprobs']
    assert third and all(e['logprob'] <= 0 and len(e['top_logprobs']) == 2 for e in third)
    # greedy: the chosen token is the most likely one
    assert all(e['top_logprobs'][0]['token'] == e['token'] and
               abs(e['top_logprobs'][0]['logprob'] - e['logprob']) < 1e-6 for e in third)
    assert all(e['logprob'] == 0.0 for e in reference_loop[0]['logprobs'])    # forced tokens: probability 1
    c = client(servers['off']).completions.create(model='model', prompt=[5, 6, 7, 8], max_tokens=5, logprobs=3,
                                                  extra_body={'ignore_eos': True})
    lp = c.choices[0].logprobs
    assert ''.join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 5
    assert all(len(top) <= 3 and max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    # each token's offset: where its text starts in the choice's text (a lone byte shows U+FFFD)
    text = c.choices[0].text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_logprobs_bytes_rebuild_multibyte_text_streamed_and_not(servers):
    """``bytes`` are each token's raw UTF-8 bytes: joined, they are the reply's bytes even where a
    token holds part of a character (its ``token`` shows U+FFFD); top_logprobs likewise."""
    kw = dict(model='model', messages=[{'role': 'user', 'content': 'Please greet the world.'}], max_tokens=40,
              logprobs=True, top_logprobs=3)
    r = client(servers['off']).chat.completions.create(**kw)
    assert r.choices[0].message.content == UNICODE
    whole = [e.model_dump() for e in r.choices[0].logprobs.content]
    assert r.usage.completion_tokens == len(whole) + 1          # the EOS is generated (billed), not an entry
    fields, _, streamed = _stream_message(client(servers['off']).chat.completions.create(**kw, stream=True))
    assert fields['content'] == UNICODE
    for entries in (whole, streamed):
        assert b''.join(bytes(e['bytes']) for e in entries) == UNICODE.encode()
        assert any(e['token'] == '\ufffd' for e in entries)
        for e in entries:
            assert e['top_logprobs'][0]['token'] == e['token'] and e['top_logprobs'][0]['bytes'] == e['bytes']
            for t in [e] + e['top_logprobs']:
                assert bytes(t['bytes']).decode('utf-8', 'replace') == t['token'], t
    assert [e['bytes'] for e in streamed] == [e['bytes'] for e in whole]


def _raw_chunks(server, body: dict) -> list[dict]:
    with httpx.Client(timeout=120) as c:
        with c.stream('POST', server.base_url + '/v1/chat/completions', json=dict(body, stream=True)) as r:
            return [json.loads(line[len('data: '):]) for line in r.iter_lines() if line.startswith('data: {')]


@pytest.mark.parametrize('key', list(CALL_REPLIES))
def test_streamed_tool_calls_one_entry_per_index_and_equal_to_non_streamed(servers, key):
    s = servers['off']
    body = {'model': 'model', 'messages': [{'role': 'user', 'content': f'Now, {key}.'}], 'tools': TOOLS,
            'max_tokens': 200}
    code, whole = post(s, '/v1/chat/completions', body)
    assert code == 200
    message = whole['choices'][0]['message']
    calls = message['tool_calls']
    assert len(calls) == CALL_REPLIES[key].count('<tool_call>')
    merged, content = {}, ''
    for chunk in _raw_chunks(s, body):
        for choice in chunk['choices']:
            content += choice['delta'].get('content') or ''
            frags = choice['delta'].get('tool_calls') or []
            assert len({f['index'] for f in frags}) == len(frags), chunk          # OpenAI: one entry per index
            for f in frags:
                m = merged.setdefault(f['index'], {'function': {'name': '', 'arguments': ''}})
                for field in ('id', 'type'):
                    if field in f:
                        assert field not in m
                        m[field] = f[field]
                m['function']['name'] += f['function'].get('name', '')
                m['function']['arguments'] += f['function'].get('arguments', '')
    assert sorted(merged) == list(range(len(calls)))
    for i, call in enumerate(calls):
        got = merged[i]
        assert got['id'].startswith('call_') and got['type'] == call['type'] == 'function'
        assert got['function'] == call['function']
    assert (content or None) == message['content']
    # the openai client's own stream accumulation
    with client(s).chat.completions.stream(model='model', messages=body['messages'], tools=TOOLS,
                                           max_tokens=200) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c['function']['name'], c['function']['arguments']) for c in calls]
    assert (final.message.content or None) == message['content'] and final.finish_reason == 'tool_calls'


@pytest.mark.parametrize('stream', [False, True], ids=['whole', 'stream'])
@pytest.mark.parametrize('key', ['two calls please', 'look then two please'])
def test_parallel_tool_calls_false_stops_generating_after_the_first_call(servers, thinking_model, key, stream):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    reply = CALL_REPLIES[key]
    ids = tok.encode(reply, add_special_tokens=False)
    first_end = reply.index('</tool_call>') + len('</tool_call>')
    upto = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k])) >= first_end)
    want = get_tool_parser('hermes').parse(reply)
    for parallel in (True, False):
        kw = dict(model='model', messages=[{'role': 'user', 'content': f'Now, {key}.'}], tools=TOOLS,
                  max_tokens=200, logprobs=True, parallel_tool_calls=parallel)
        if stream:
            chunks = list(client(servers['off']).chat.completions.create(
                **kw, stream=True, stream_options={'include_usage': True}))
            fields, reason, lps = _stream_message(chunks)
            usage, calls, content = chunks[-1].usage, fields['tool_calls'], fields['content']
        else:
            r = client(servers['off']).chat.completions.create(**kw)
            choice, usage = r.choices[0], r.usage
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            reason, lps, content = choice.finish_reason, choice.logprobs.content, choice.message.content
        assert reason == 'tool_calls' and content == want.content
        if parallel:
            assert calls == [(c.name, c.arguments) for c in want.calls] and len(calls) == 2
            assert usage.completion_tokens == len(ids) + 1 and len(lps) == len(ids)
        else:       # generation ended at the first call's closing tag: nothing after it was generated or billed
            assert calls == [(want.calls[0].name, want.calls[0].arguments)]
            assert usage.completion_tokens == upto == len(lps) < len(ids)


@pytest.fixture(scope='module')
def chatml_cache(tiny_qwen3):
    """Tiny full-attention Qwen3 with make-tiny-model's own chat template, prefix caching on."""
    server = scripted(tiny_qwen3, '--enable-prefix-caching')
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.mark.parametrize('ask, choice, call', [
    ('What is in a.txt?', 'auto', ('ls', '{"path": "."}')),
    ('A compact call please.', 'auto', ('ls', COMPACT_ARGS)),
    ('Read it.', {'type': 'function', 'function': {'name': 'read_file'}}, ('read_file', '{"path": "b.txt"}'))])
def test_next_turn_reuses_the_cached_tool_call_reply(chatml_cache, ask, choice, call):
    """The tool-call reply sent back as the server returned it (arguments a JSON string, content
    null) re-renders to the generated tokens, so turn 2 restores turn 1's prompt and reply. The
    arguments are the model's own text (here also compact, with an escape), not re-serialised;
    a named tool_choice's opening written by the server re-tokenizes the same way too."""
    messages = [{'role': 'user', 'content': ask}]
    first = client(chatml_cache).chat.completions.create(model=name(chatml_cache), messages=messages, tools=TOOLS,
                                                          max_tokens=100, tool_choice=choice)
    msg = first.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [call]
    messages.append({'role': 'assistant', 'content': msg.content, 'tool_calls': [c.model_dump() for c in
                                                                               msg.tool_calls]})
    messages.append({'role': 'tool', 'tool_call_id': msg.tool_calls[0].id, 'content': RESULTS['ls']})
    second = client(chatml_cache).chat.completions.create(model=name(chatml_cache), messages=messages, tools=TOOLS,
                                                           max_tokens=100)
    # KV exists for the prompt and every generated token but the final EOS (sampled, never fed)
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    block = 16
    assert computed // block * block > first.usage.prompt_tokens            # the reply spans a block boundary
    assert second.usage.prompt_tokens_details.cached_tokens == computed // block * block


def test_tool_choice_none_required_and_named(servers, thinking_model):
    s = servers['off']
    messages = [{'role': 'user', 'content': 'List the files.'}]
    none = client(s).chat.completions.create(model='model', messages=messages, tools=TOOLS, tool_choice='none',
                                             max_tokens=60)
    assert none.usage.prompt_tokens == template_len(thinking_model, messages)       # tools not rendered
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == CALL_LS
    assert none.choices[0].finish_reason == 'stop'
    required = client(s).chat.completions.create(model='model', messages=messages, tools=TOOLS,
                                                 tool_choice='required', max_tokens=60).choices[0]
    assert [(c.function.name, c.function.arguments) for c in required.message.tool_calls] == [('ls', '{"path": "/"}')]
    named = client(s).chat.completions.create(model='model', messages=messages, tools=TOOLS, max_tokens=60,
                                              tool_choice={'type': 'function', 'function': {'name': 'read_file'}})
    call = named.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ('read_file', {'path': 'b.txt'})
    assert named.choices[0].finish_reason == 'tool_calls' and call.id.startswith('call_')
    bad = client(s).with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match='not in tools'):
        bad.chat.completions.create(model='model', messages=messages, tools=TOOLS,
                                    tool_choice={'type': 'function', 'function': {'name': 'rm'}})


def test_malformed_tool_call_degrades_to_content(servers):
    messages = [{'role': 'user', 'content': 'Please break the call.'}]
    kw = dict(model='model', messages=messages, tools=TOOLS, max_tokens=60)
    r = client(servers['off']).chat.completions.create(**kw)
    assert r.choices[0].message.content == BROKEN and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == 'stop'
    fields, reason, _ = _stream_message(client(servers['off']).chat.completions.create(**kw, stream=True))
    assert (fields['content'], fields['tool_calls'], reason) == (BROKEN, [], 'stop')
    cut = client(servers['off']).chat.completions.create(**dict(kw, max_tokens=8)).choices[0]   # an unfinished call
    assert cut.finish_reason == 'length' and cut.message.tool_calls is None and cut.message.content.startswith('<')


def test_reasoning_split_thinking_switch_and_raw_mode(servers, thinking_model):
    s = servers['off']
    messages = [{'role': 'user', 'content': 'Please think aloud.'}]
    r = client(s).chat.completions.create(model='model', messages=messages, max_tokens=30).choices[0].message
    assert (r.reasoning_content, r.content) == ('hmm', 'Done.')
    raw = client(s).chat.completions.create(model='model', messages=messages, max_tokens=30,
                                            extra_body={'separate_reasoning': False}).choices[0].message
    assert raw.content == '<think>\nhmm\n</think>\n\nDone.' and getattr(raw, 'reasoning_content', None) is None
    fields, _, _ = _stream_message(client(s).chat.completions.create(model='model', messages=messages, max_tokens=30,
                                                                     stream=True))
    assert (fields['reasoning_content'], fields['content']) == ('hmm', 'Done.')
    plain = [{'role': 'user', 'content': 'Please answer plainly.'}]
    off = client(s).chat.completions.create(model='model', messages=plain, max_tokens=30,
                                            extra_body={'chat_template_kwargs': {'enable_thinking': False}})
    assert off.usage.prompt_tokens == template_len(thinking_model, plain, enable_thinking=False)
    assert off.usage.prompt_tokens > template_len(thinking_model, plain)      # the empty <think> block is in
    assert (getattr(off.choices[0].message, 'reasoning_content', None), off.choices[0].message.content) == \
        (None, 'Done.')


# the five reported problems -----------------------------------------------------------------------------------------
def post(server, path, body, timeout=60):
    with httpx.Client(timeout=timeout) as c:
        r = c.post(server.base_url + path, content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={'Content-Type': 'application/json'})
    return r.status_code, r.json()


def test_issue_tool_call_history_is_rendered(servers, thinking_model):
    messages = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': None, 'tool_calls': [CALL]},
                {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'a.txt'}]
    code, body = post(servers['off'], '/v1/chat/completions',
                      {'model': 'model', 'messages': messages, 'max_tokens': 1, 'tools': TOOLS})
    assert code == 200 and body['usage']['prompt_tokens'] == template_len(thinking_model, messages, TOOLS)


def test_issue_developer_role_acts_as_system(servers, thinking_model):
    dev = [{'role': 'developer', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    sys_ = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    a = client(servers['off']).chat.completions.create(model='model', messages=dev, max_tokens=4)
    b = client(servers['off']).chat.completions.create(model='model', messages=sys_, max_tokens=4)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == template_len(thinking_model, sys_)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_issue_big_requests_do_not_freeze_the_server(servers):
    s = servers['off']
    big = {'model': 'model', 'messages': [{'role': 'user', 'content': 'river town ' * 360_000}], 'max_tokens': 1}
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault('r', post(s, '/v1/chat/completions', big, 120)))
    thread.start()
    slowest, probes = 0.0, 0
    with httpx.Client(timeout=10) as c:
        time.sleep(0.5)                                  # the body is in; the worker thread is tokenizing
        while thread.is_alive():
            t = time.perf_counter()
            assert c.get(s.base_url + '/health').status_code == 200
            slowest = max(slowest, time.perf_counter() - t)
            probes += 1
            time.sleep(0.05)
    thread.join()
    code, body = result['r']
    assert code == 400 and body['error']['param'] == 'messages' and 'session_len=2048' in body['error']['message']
    assert slowest < 0.1 and probes >= 5, (slowest, probes)     # probed for the whole processing time
    # over the limit: 413 with an OpenAI body, before any parsing
    code, body = post(s, '/v1/chat/completions', b'{"model": "model", "messages": "' + b'x' * MAX_BYTES + b'"}')
    assert code == 413 and body['error']['code'] == 'request_too_large' and str(MAX_BYTES) in body['error']['message']
    assert 'lmdeploy_http_requests_total{path="/v1/chat/completions",status="413"} 1.0' in \
        httpx.get(s.base_url + '/metrics').text
    # 10,000 prompts are refused before any is tokenized
    t = time.perf_counter()
    code, body = post(s, '/v1/completions', {'model': 'model', 'prompt': ['river town ' * 40] * 10_000})
    assert code == 400 and body['error']['param'] == 'prompt' and '128' in body['error']['message']
    assert time.perf_counter() - t < 2


BAD_NUMBERS = [
    ('temperature', 1e308), ('temperature', 'Infinity'), ('repetition_penalty', 'Infinity'),
    ('repetition_penalty', 1e-300), ('top_k', 10 ** 12), ('max_tokens', 2 ** 70), ('top_p', 'NaN'),
    ('top_logprobs', 21), ('presence_penalty', 3), ('seed', 2 ** 64),
]


@pytest.mark.parametrize('field,value', BAD_NUMBERS, ids=[f'{f}={v}' for f, v in BAD_NUMBERS])
def test_issue_numbers_outside_their_range_are_refused(servers, field, value):
    body = {'model': 'model', 'messages': [{'role': 'user', 'content': 'hi'}], 'logprobs': True}
    raw = json.dumps(body)[:-1] + f', "{field}": {value}}}'       # Infinity / NaN as raw JSON literals
    code, resp = post(servers['off'], '/v1/chat/completions', raw.encode())
    assert code == 400, resp
    assert resp['error']['param'] == field and resp['error']['type'] == 'invalid_request_error'


def test_issue_surrogates_max_tokens_clamp_and_openapi(servers):
    s = servers['off']
    raw = b'{"model": "model", "messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    code, resp = post(s, '/v1/chat/completions', raw)
    assert code == 400 and resp['error']['param'] == 'messages.0.content' and 'surrogate' in resp['error']['message']
    # max_tokens past the session is clamped to what the session has left: 2048 - 2040 = 8 tokens
    code, resp = post(s, '/v1/completions', {'model': 'model', 'prompt': [5] * 2040, 'max_tokens': 2 ** 31 - 1,
                                             'ignore_eos': True})
    assert code == 200 and resp['usage']['completion_tokens'] == 8 and resp['choices'][0]['finish_reason'] == 'length'
    schema = httpx.get(s.base_url + '/openapi.json').json()
    chat = schema['paths']['/v1/chat/completions']['post']['responses']
    assert '422' not in chat and {'200', '400', '401', '404', '413', '500', '503'} <= set(chat)
    assert chat['400']['content']['application/json']['schema']['$ref'].endswith('/ErrorBody')
    assert '422' not in json.dumps(schema['paths'])


def test_issue_sigterm_drains_then_ends_requests_cleanly(tiny_qwen3):
    server = ApiServer(tiny_qwen3, '--session-len', '4096', '--shutdown-timeout', '3', '--log-level', 'INFO').start()
    results, started = {}, {'long_stream': threading.Event(), 'short_stream': threading.Event()}
    body = {'model': name(server), 'max_tokens': 3900, 'ignore_eos': True,
            'messages': [{'role': 'user', 'content': 'Describe every ledger.'}]}
    try:
        def stream(key, max_tokens):
            with httpx.Client(timeout=60) as c:
                with c.stream('POST', server.base_url + '/v1/chat/completions',
                              json=dict(body, max_tokens=max_tokens, stream=True,
                                        stream_options={'include_usage': key == 'short_stream'})) as r:
                    results[key] = []
                    for line in r.iter_lines():
                        if line:
                            results[key].append(line)
                            if len(results[key]) == 2:         # a generated token arrived
                                started[key].set()

        def blocking():
            with httpx.Client(timeout=60) as c:
                r = c.post(server.base_url + '/v1/chat/completions', json=body)
            results['long'] = (r.status_code, r.headers['content-type'], r.json())
        threads = [threading.Thread(target=stream, args=('long_stream', 3900)), threading.Thread(target=blocking),
                   threading.Thread(target=stream, args=('short_stream', 40))]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        server.proc.send_signal(signal.SIGTERM)                     # the short stream is still generating
        for t in threads:
            t.join(timeout=30)
        assert server.proc.wait(timeout=30) == 143
    finally:
        log = server.log()
        server.stop()
    short = results['short_stream']                                 # finished within the grace period
    assert short[-1] == 'data: [DONE]'
    chunks = [json.loads(e[len('data: '):]) for e in short[:-1]]
    assert chunks[-2]['choices'][0]['finish_reason'] == 'length' and chunks[-1]['usage']['completion_tokens'] == 40
    code, ctype, resp = results['long']
    assert code == 503 and ctype == 'application/json' and resp['error']['code'] == 'shutting_down'
    events = results['long_stream']
    assert events[-1] == 'data: [DONE]'
    assert json.loads(events[-2][len('data: '):])['error']['code'] == 'shutting_down'
    assert all(json.loads(e[len('data: '):]).get('object') == 'chat.completion.chunk' for e in events[:-2])
    assert 'Traceback' not in log and 'Cancel' not in log, log


def test_a_validator_error_is_a_400_with_its_own_message():
    """A request a model validator refuses (``tool_choice`` naming no tool) is a 400 whose
    message is the validator's text, without pydantic's ``Value error, `` prefix."""
    import asyncio
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
    from lmdeploy.serve.openai.errors import _validation_error
    from lmdeploy.serve.openai.protocol import ChatCompletionRequest
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest(model='m', messages=[{'role': 'user', 'content': 'hi'}], tools=TOOLS,
                              tool_choice={'type': 'function', 'function': {'name': 'rm'}})
    response = asyncio.run(_validation_error(None, RequestValidationError(exc.value.errors())))
    assert response.status_code == 400
    message = json.loads(response.body)['error']['message']
    assert message == "tool_choice: names 'rm', which is not in tools", message
    assert json.loads(response.body)['error']['param'] == 'tool_choice'
