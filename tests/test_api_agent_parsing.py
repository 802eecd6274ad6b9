"""The agent API's pieces without a server: streamed tool-call and reasoning parsing, the chat
output's deltas, chat history rendering against ``apply_chat_template``, logprobs against
transformers, and the validator's 400 message. The served agent loop is in tests/test_api_agent.py.
"""
from __future__ import annotations

import functools
import json
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from agent_script import BROKEN, CALL, CALL_LS, CALL_READ, TOOLS, _merge_fragments, thinking_model

from lmdeploy import GenerationConfig
from lmdeploy.serve.openai.protocol import ChatMessage
from lmdeploy.serve.openai.reasoning_parser import get_reasoning_parser
from lmdeploy.serve.openai.tool_parser import get_tool_parser
from lmdeploy.serve.pipeline import Pipeline, render_chat


# parsers (no server) ---------------------------------------------------------------------------------------
def _feed(stream, text: str, cuts: list[int]):
    out, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out.append(stream.feed(text[prev:c]))
        prev = c
    out.append(stream.finish())
    return out


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
    from lmdeploy.serve.openai.tool_call import top_level_members
    def refuse(name):
        raise ValueError(name)
    try:
        ref = json.loads(text, parse_constant=refuse)        # strict JSON: no NaN / Infinity
    except ValueError:
        ref = None
    got = top_level_members(text)
    if not isinstance(ref, dict):
        assert got is None
    else:
        assert {k: v for k, (v, _) in got.items()} == ref
        assert all(json.loads(raw) == v for v, raw in got.values())


@pytest.mark.parametrize('body', ['{"name": "ls", "arguments": {"x": NaN}}', '{"name": "ls", "arguments": {"x": -Infinity}}',
                                  '{"name": "ls", "arguments": "{\\"x\\": Infinity}"}'])
def test_arguments_that_are_not_strict_json_end_before_it(body):
    """An arguments object streams from its first member on, so the call stays a call; the
    arguments end (closed, strict JSON) before what JSON does not allow, and that text is content.
    Arguments given as a string are read whole, and a string that is not JSON leaves the block as
    text."""
    text = f'<tool_call>\n{body}\n</tool_call>'
    got = get_tool_parser('hermes').parse(text)
    if '"arguments": {' in body:
        assert [(c.name, c.arguments) for c in got.calls] == [('ls', '{}')]
        assert got.content == body[body.index('"x"'):] + '\n</tool_call>'
    else:
        assert got.calls == [] and got.content == text


def test_tool_parser_reads_calls_and_keeps_malformed_blocks_as_text():
    parser = get_tool_parser('hermes')
    got = parser.parse('Let me look.\n' + CALL_LS + '\n' + BROKEN + '\n')
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [('ls', {'path': '.'})]
    assert got.content == 'Let me look.\n\n' + BROKEN
    cut = parser.parse(CALL_LS[:-3])            # cut off in the closing: still the call
    assert ([(c.name, c.arguments) for c in cut.calls], cut.content) == ([('ls', '{"path": "."}')], None)
    cut = parser.parse(CALL_LS[:CALL_LS.index('"path"') + 4])      # cut off in its arguments: closed there
    assert ([(c.name, c.arguments) for c in cut.calls], cut.content) == ([('ls', '{}')], None)
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
        assert _merge_fragments(frags) == [('read_file', '{"path": "a.txt"}'), ('ls', '{"path": "."}')]
        firsts = {}
        for f in frags:     # each call's first fragment names it; the later ones carry arguments only
            assert ('name' in f['function']) == (f['index'] not in firsts), f
            firsts.setdefault(f['index'], f)
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
