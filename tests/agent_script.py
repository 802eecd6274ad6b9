"""The scripted agent server of tests/test_api_agent.py and tests/test_api_agent_parsing.py: its
replies (a substring of the prompt, its ending or the turn index picks a scripted reply), tools,
the thinking-template model, and the client helpers (one agent loop, streamed messages, raw posts).
"""
from __future__ import annotations

import json
import os
import sys

import httpx
import openai
import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from server_utils import ApiServer


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


def _merge_fragments(frags: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    for f in frags:
        entry = calls.setdefault(f['index'], [None, ''])
        entry[0] = f['function'].get('name', entry[0])
        entry[1] += f['function'].get('arguments', '')
    return [tuple(calls[i]) for i in sorted(calls)]


# history rendering (no server) --------------------------------------------------------------------------------
CALL = {'id': 'call_1', 'type': 'function', 'function': {'name': 'ls', 'arguments': '{"path": "."}'}}


@pytest.fixture(scope='module')
def thinking_model(tiny_qwen3_next, tmp_path_factory):
    return with_template(tiny_qwen3_next, str(tmp_path_factory.mktemp('thinking') / 'model'),
                         THINKING_TOOLS_TEMPLATE)


# servers ------------------------------------------------------------------------------------------------------
def scripted(model: str, *flags: str) -> ApiServer:
    return ApiServer(model, *GEOMETRY, *flags, launcher=[sys.executable, os.path.join(TESTS, 'scripted_server.py')],
                     env={'LMDEPLOY_TEST_SCRIPT': json.dumps(SCRIPT)})


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


def _raw_chunks(server, body: dict) -> list[dict]:
    with httpx.Client(timeout=120) as c:
        with c.stream('POST', server.base_url + '/v1/chat/completions', json=dict(body, stream=True)) as r:
            return [json.loads(line[len('data: '):]) for line in r.iter_lines() if line.startswith('data: {')]


# the five reported problems -----------------------------------------------------------------------------------------
def post(server, path, body, timeout=60):
    with httpx.Client(timeout=timeout) as c:
        r = c.post(server.base_url + path, content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={'Content-Type': 'application/json'})
    return r.status_code, r.json()
