"""Clients, requests and the bad-request table shared by tests/test_api_server.py and
tests/test_api_server_store.py: the hybrid geometry (B=16, A=64, P=128), chat and metrics
helpers, a scripted multi-turn conversation, raw posts, and the requests each answered by an
OpenAI-style 4xx error.
"""
from __future__ import annotations

import httpx
import openai
from server_utils import ApiServer


KEY = 'sk-test-key'
HYBRID = ('--block-size', '16', '--prefill-save-alignment', '64', '--max-prefill-token-num', '128',
          '--session-len', '2048')
ALIGN = 64
SYSTEM_A = 'You are a careful assistant who answers in short sentences about rivers and towns. ' * 12
SYSTEM_B = 'You keep ledgers of salt, wool, copper, glass, paper and tea for the old library. ' * 12
TURNS = ['Where is the library?', 'What did the ships carry?', 'Who keeps the ledgers?', 'Tell me more.',
         'Thanks, goodbye.']


def shared_head(server: ApiServer, messages: list[dict], tools: list[dict] | None = None) -> int | None:
    """The shared head (tokens: system messages + tools) the server computes for a chat request,
    from the model's own tokenizer (:func:`lmdeploy.serve.pipeline.shared_head_tokens`)."""
    from transformers import AutoTokenizer

    from lmdeploy.serve.pipeline import render_chat, shared_head_tokens
    tok = AutoTokenizer.from_pretrained(server.model_path, local_files_only=True)

    def tokenize(text):
        return tok.encode(text, add_special_tokens=False)
    return shared_head_tokens(tok, tokenize, messages, tokenize(render_chat(tok, messages, tools)), tools)


def client(server: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + '/v1', api_key=server.api_key or 'unused', max_retries=0,
                         timeout=120)


def model_name(server: ApiServer) -> str:
    return 'tiny' if server.api_key else server.model_path.rstrip('/').split('/')[-1]


def chat(server, messages, max_tokens=8, **kw):
    return client(server).chat.completions.create(model=model_name(server), messages=messages,
                                                  max_tokens=max_tokens, **kw)


def metrics(server: ApiServer) -> dict[str, float]:
    """Parse /metrics into {'name{labels}': value}."""
    with httpx.Client() as c:
        text = c.get(server.base_url + '/metrics').text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith('#'):
            key, value = line.rsplit(' ', 1)
            out[key] = float(value)
    return out


def is_idle(ledger: dict) -> bool:
    return (ledger['blocks_in_use'] == 0 and ledger['runtime_slots_free'] == ledger['runtime_slots_total']
            and ledger['checkpoints_pinned'] == 0 and ledger['store_inflight'] == 0)


def conversation(server, system: str, turns=TURNS, max_tokens=8):
    """Run a multi-turn chat; returns [(reply, prompt_tokens, cached_tokens)] per turn."""
    messages = [{'role': 'system', 'content': system}]
    out = []
    for turn in turns:
        messages.append({'role': 'user', 'content': turn})
        r = chat(server, messages, max_tokens=max_tokens)
        reply = r.choices[0].message.content
        out.append((reply, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({'role': 'assistant', 'content': reply})
    return out


# errors ---------------------------------------------------------------------------------------------------
def raw_post(server, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    with httpx.Client(timeout=60) as c:
        r = c.post(server.base_url + path, content=body, headers={'Content-Type': 'application/json', **headers})
    return r.status_code, r.json()


MSG = [{'role': 'user', 'content': 'hi'}]
BAD_REQUESTS = [
    # (name, path, body (dict or raw bytes), headers override, status, param or None)
    ('malformed json', '/v1/chat/completions', b'{"model": "tiny", "messages": [', None, 400, None),
    ('body not an object', '/v1/chat/completions', b'[1, 2]', None, 400, None),
    ('no model', '/v1/chat/completions', {'messages': MSG}, None, 400, 'model'),
    ('empty messages', '/v1/chat/completions', {'model': 'tiny', 'messages': []}, None, 400, 'messages'),
    ('messages not a list', '/v1/chat/completions', {'model': 'tiny', 'messages': 'hi'}, None, 400, 'messages'),
    # a role the chat template refuses (other roles are the template's to render)
    ('unknown role', '/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'wizard', 'content': 'x'}]},
     None, 400, 'messages'),
    ('empty role', '/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': '', 'content': 'x'}]},
     None, 400, 'messages[0].role'),
    ('content not text', '/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 5}]},
     None, 400, 'messages[0].content'),
    ('negative max_tokens', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'max_tokens': -1},
     None, 400, 'max_tokens'),
    ('negative max_completion_tokens', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'max_completion_tokens': -5}, None, 400, 'max_completion_tokens'),
    ('max_tokens 0', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'max_tokens': 0},
     None, 400, 'max_tokens'),
    ('max_completion_tokens 0', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'max_completion_tokens': 0}, None, 400, 'max_completion_tokens'),
    ('completions max_tokens 0', '/v1/completions', {'model': 'tiny', 'prompt': 'x', 'max_tokens': 0},
     None, 400, 'max_tokens'),
    ('temperature < 0', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'temperature': -0.5},
     None, 400, 'temperature'),
    ('top_p 0', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'top_p': 0}, None, 400, 'top_p'),
    ('top_p > 1', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'top_p': 1.5}, None, 400, 'top_p'),
    ('n 0', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'n': 0}, None, 400, 'n'),
    ('stop not text', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'stop': 7}, None, 400, 'stop'),
    ('token id >= vocab', '/v1/completions', {'model': 'tiny', 'prompt': [1, 2, 1024]}, None, 400, 'prompt'),
    ('negative token id', '/v1/completions', {'model': 'tiny', 'prompt': [[3, -1]]}, None, 400, 'prompt'),
    ('empty prompt', '/v1/completions', {'model': 'tiny', 'prompt': []}, None, 400, 'prompt'),
    ('empty string prompt', '/v1/completions', {'model': 'tiny', 'prompt': ''}, None, 400, 'prompt'),
    ('prompt too long', '/v1/completions', {'model': 'tiny', 'prompt': [5] * 4100}, None, 400, 'prompt'),
    ('unknown model', '/v1/chat/completions', {'model': 'gpt-9', 'messages': MSG}, None, 404, 'model'),
    ('missing key', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG}, {'Authorization': ''}, 401, None),
    ('wrong key', '/v1/completions', {'model': 'tiny', 'prompt': 'x'}, {'Authorization': 'Bearer nope'}, 401,
     None),
    ('unknown endpoint', '/v1/embeddings', {'model': 'tiny', 'input': 'x'}, None, 404, None),
    # no coercion: a string or a boolean is not a number, a number is not a boolean
    ('max_tokens a string', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'max_tokens': '3'},
     None, 400, 'max_tokens'),
    ('max_tokens a boolean', '/v1/completions', {'model': 'tiny', 'prompt': 'x', 'max_tokens': True},
     None, 400, 'max_tokens'),
    ('stream a string', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'stream': 'yes'},
     None, 400, 'stream'),
    ('temperature a string', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'temperature': '0.5'},
     None, 400, 'temperature'),
    # the failing element of a field that takes several shapes
    ('stop list of numbers', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'stop': ['a', 5]},
     None, 400, 'stop[1]'),
    ('unknown content part', '/v1/chat/completions',
     {'model': 'tiny', 'messages': [{'role': 'user', 'content': [{'type': 'input_audio', 'input_audio': {}}]}]},
     None, 400, 'messages[0].content[0]'),
    ('text part without text', '/v1/chat/completions',
     {'model': 'tiny', 'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text'}]}]},
     None, 400, 'messages[0].content[1].text'),
    ('image part to a text model', '/v1/chat/completions',
     {'model': 'tiny', 'messages': [{'role': 'user', 'content': [
         {'type': 'text', 'text': 'see'}, {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,AA=='}}]}]},
     None, 400, 'messages[0].content[1]'),
    # messages OpenAI refuses
    ('tool message without tool_call_id', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG + [{'role': 'tool', 'content': '42'}]}, None, 400, 'messages[1]'),
    ('tool message without content', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG + [{'role': 'tool', 'tool_call_id': 'c1'}]}, None, 400, 'messages[1].content'),
    ('tool call without arguments', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG + [{'role': 'assistant', 'tool_calls': [
         {'id': 'c1', 'type': 'function', 'function': {'name': 'ls'}}]}]},
     None, 400, 'messages[1].tool_calls[0].function.arguments'),
    # options that cannot be honoured are refused, not ignored
    ('top_logprobs without logprobs', '/v1/chat/completions', {'model': 'tiny', 'messages': MSG, 'top_logprobs': 3},
     None, 400, 'top_logprobs'),
    ('stream_options without stream', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'stream_options': {'include_usage': True}}, None, 400, 'stream_options'),
    ('response_format with a schema that cannot be compiled', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'response_format': {'type': 'json_schema', 'json_schema': {
         'name': 'x', 'schema': {'type': 'objectx'}}}}, None, 400, 'response_format'),
    ('suffix', '/v1/completions', {'model': 'tiny', 'prompt': 'x', 'suffix': 'end'}, None, 400, 'suffix'),
    ('best_of above n', '/v1/completions', {'model': 'tiny', 'prompt': 'x', 'best_of': 3}, None, 400, 'best_of'),
    # the body cannot be read as JSON at all: code invalid_json
    ('body not UTF-8', '/v1/chat/completions', b'{"model": "tiny", "messages": "\xff\xfe"}', None, 400, None),
    ('body nested too deeply', '/v1/chat/completions', b'[' * 100000 + b']' * 100000, None, 400, None),
    ('trailing slash', '/v1/chat/completions/', {'model': 'tiny', 'messages': MSG}, None, 404, None),
    ('tool_choice string not a choice', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'tool_choice': 'always'}, None, 400, 'tool_choice'),
    ('tool without a name', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'tools': [{'type': 'function', 'function': {'name': ' '}}]},
     None, 400, 'tools[0].function.name'),
    ('two tools with one name', '/v1/chat/completions',
     {'model': 'tiny', 'messages': MSG, 'tools': [{'type': 'function', 'function': {'name': 'ls'}}] * 2},
     None, 400, 'tools'),
    ('empty token-id list', '/v1/completions', {'model': 'tiny', 'prompt': [[5, 6], []]}, None, 400, 'prompt'),
]
