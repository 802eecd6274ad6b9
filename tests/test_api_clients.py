"""The agent frameworks people use, each through its own API, against the server with the prefix
cache off, on and last-only.

- openai-agents: an ``Agent`` with a function tool, run by ``Runner`` through its default
  Responses model and through ``OpenAIChatCompletionsModel``: three model turns (two calls, each
  executed by the framework, then the answer).
- langchain-openai: ``with_structured_output`` in its default mode (``response_format``
  json_schema) and ``method="function_calling"`` (a named ``tool_choice``) over three turns,
  ``bind_tools`` with the call's result sent back as a ``ToolMessage``.
- pydantic-ai: an ``Agent`` whose output is a ``ToolOutput`` (a forced call of its output tool),
  three runs, each continuing the last one's history.
- anthropic: three turns of tool use, the middle one streamed, with ``count_tokens``.

Each conversation runs once against each of three servers and the replies (text, reasoning, tool
calls and their arguments, structured outputs, prompt sizes) must be identical; the cache-off
server reports no cached tokens, the other two a hit on every turn after the first. Each test
asserts what the client made of our reply: the framework's own types (a parsed tool call it
executed, a validated pydantic model). A module is skipped only when its package is absent.

Servers (started together, their model loads overlap): tiny hybrid Qwen3-Next with the
Qwen3-style tools + thinking template, B=16, A=16 (so every turn crosses checkpoint boundaries),
sampler scripted (tests/scripted_server.py) for the turns that must call a tool; the structured
outputs are the grammar's doing (the random model picks the values, seeded):
  off    prefix caching off (the reference)
  on     --enable-prefix-caching
  last   --enable-prefix-caching --prefill-save-last-only
"""
from __future__ import annotations

import json
import os
import sys

import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from pydantic import BaseModel, Field
from server_utils import ApiServer, running

TESTS = os.path.dirname(os.path.abspath(__file__))
WEATHER = {'Paris': 'sunny, 21 C', 'Lyon': 'rain, 14 C'}
FINAL = 'Paris is sunny and Lyon is rainy.'
BLOCK = 16
GEOMETRY = ('--block-size', str(BLOCK), '--prefill-save-alignment', str(BLOCK), '--session-len', '4096')
MODES = {'off': (), 'on': ('--enable-prefix-caching',),
         'last': ('--enable-prefix-caching', '--prefill-save-last-only')}
# ids the server or the client draws at random: everything else of a reply must match across servers
VOLATILE = {'id', 'call_id', 'tool_call_id', 'created_at', 'created', 'response_id'}


def _call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


ASK = 'Compare the weather in Paris and Lyon.'
SCRIPT = [{'contains': ASK, 'turn': 0, 'reply': _call('Paris')},
          {'contains': ASK, 'turn': 1, 'reply': _call('Lyon')},
          {'contains': ASK, 'turn': 2, 'reply': '<think>\nBoth are known.\n</think>\n\n' + FINAL}]
INSTRUCTIONS = ('You are a weather agent. Call get_weather once per city before you answer, then compare the '
                'cities in one sentence. ') * 3
CITY_TURNS = ['Name a large city.', 'And another one.', 'One more, please.']


class City(BaseModel):
    """A city and its population in millions."""
    name: str = Field(max_length=8)
    millions: int = Field(ge=0, le=40)


@pytest.fixture(scope='module')
def servers(tiny_qwen3_next, tmp_path_factory):
    model = with_template(tiny_qwen3_next, str(tmp_path_factory.mktemp('clients') / 'model'), THINKING_TOOLS_TEMPLATE)
    launcher = [sys.executable, os.path.join(TESTS, 'scripted_server.py')]
    env = {'LMDEPLOY_TEST_SCRIPT': json.dumps(SCRIPT)}
    procs = {mode: ApiServer(model, *GEOMETRY, *flags, launcher=launcher, env=env) for mode, flags in MODES.items()}
    with running(procs):
        yield procs


def _scrub(obj):
    """``obj`` (pydantic models, dicts, lists) as plain data without the randomly drawn ids."""
    if hasattr(obj, 'model_dump'):
        obj = obj.model_dump()
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj


def _across(servers, conversation):
    """Run ``conversation(server) -> (replies, prompts, cached)`` on every server.

    ``replies``: what the client got back, turn by turn; ``prompts``/``cached``: each turn's whole
    prompt and cached prompt tokens. Asserts the replies and prompts are identical on the three
    servers, no hit with the cache off, and with it on or last-only a hit on every later turn at
    least at the last aligned boundary before the previous prompt's last token (the hybrid
    model's deepest restorable checkpoint of a prefix the next turn re-sends unchanged).
    Returns the reference (cache-off) replies.
    """
    runs = {mode: conversation(s) for mode, s in servers.items()}
    replies, prompts, cached = runs['off']
    assert len(replies) >= 3 and cached == [0] * len(cached)
    for mode in ('on', 'last'):
        got_replies, got_prompts, got_cached = runs[mode]
        assert got_replies == replies, mode
        assert got_prompts == prompts, mode
        assert got_cached[0] == 0, (mode, got_cached)
        for before, after in zip(prompts, got_cached[1:]):
            assert after >= (before - 1) // BLOCK * BLOCK > 0, (mode, prompts, got_cached)
    return replies


# openai-agents ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('api', ['responses', 'chat_completions'])
def test_openai_agents_runs_the_tool_twice_then_answers(servers, api):
    agents = pytest.importorskip('agents')
    from openai import AsyncOpenAI
    agents.set_tracing_disabled(True)

    def conversation(server):
        ran = []

        @agents.function_tool
        def get_weather(city: str) -> str:
            """The current weather of a city."""
            ran.append(city)
            return WEATHER[city]

        client = AsyncOpenAI(base_url=server.base_url + '/v1', api_key='none', max_retries=0, timeout=120)
        model = agents.OpenAIResponsesModel('model', client) if api == 'responses' else \
            agents.OpenAIChatCompletionsModel('model', client)
        agent = agents.Agent(name='weather', instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                             # a salt per API: the other run's identical prompt is not a cache hit
                             model_settings=agents.ModelSettings(max_tokens=120, extra_body={'cache_salt': api}))
        result = agents.Runner.run_sync(agent, ASK)
        assert ran == ['Paris', 'Lyon']                 # our calls, parsed and executed by the framework
        assert result.final_output == FINAL
        usage = [r.usage for r in result.raw_responses]
        assert len(usage) == 3
        return ([_scrub(r.output) for r in result.raw_responses], [u.input_tokens for u in usage],
                [u.input_tokens_details.cached_tokens for u in usage])

    _across(servers, conversation)


# langchain-openai ---------------------------------------------------------------------------------------------------
def _chat_openai(server):
    lc = pytest.importorskip('langchain_openai')
    return lc.ChatOpenAI(model='model', base_url=server.base_url + '/v1', api_key='none', max_retries=0,
                         timeout=120, max_tokens=200, temperature=1.0, seed=0)


def _lc_usage(reply) -> tuple[int, int]:
    return reply.usage_metadata['input_tokens'], reply.usage_metadata['input_token_details'].get('cache_read', 0)


@pytest.mark.parametrize('method', [None, 'function_calling'])
def test_langchain_structured_output_is_a_validated_model(servers, method):
    from langchain_core.messages import HumanMessage, ToolMessage

    def conversation(server):
        llm = _chat_openai(server)
        kw = {} if method is None else {'method': method}
        structured = llm.with_structured_output(City, include_raw=True, **kw)
        messages, replies, usage = [], [], []
        for ask in CITY_TURNS:
            messages.append(HumanMessage(ask))
            out = structured.invoke(messages)
            assert out['parsing_error'] is None
            assert isinstance(out['parsed'], City)        # validated by pydantic: the schema held
            raw = out['raw']
            if method == 'function_calling':
                assert [c['name'] for c in raw.tool_calls] == ['City']
                assert City(**raw.tool_calls[0]['args']) == out['parsed']
                messages += [raw, ToolMessage('noted', tool_call_id=raw.tool_calls[0]['id'])]
            else:
                assert City.model_validate_json(raw.content) == out['parsed']
                messages.append(raw)
            replies.append((out['parsed'], raw.content, [(c['name'], c['args']) for c in raw.tool_calls]))
            usage.append(_lc_usage(raw))
        return replies, [u[0] for u in usage], [u[1] for u in usage]

    _across(servers, conversation)


def test_langchain_bind_tools_parses_the_call_and_takes_the_result(servers):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return WEATHER[city]

    def conversation(server):
        llm = _chat_openai(server).bind_tools([get_weather])
        messages = [SystemMessage(INSTRUCTIONS), HumanMessage(ASK)]
        replies, usage = [], []
        for city in ('Paris', 'Lyon'):
            reply = llm.invoke(messages)
            assert [(c['name'], c['args']) for c in reply.tool_calls] == [('get_weather', {'city': city})]
            messages += [reply, ToolMessage(get_weather.invoke(reply.tool_calls[0]['args']),
                                            tool_call_id=reply.tool_calls[0]['id'])]
            replies.append((reply.content, [(c['name'], c['args']) for c in reply.tool_calls]))
            usage.append(_lc_usage(reply))
        answer = llm.invoke(messages)
        assert answer.content == FINAL and not answer.tool_calls
        replies.append((answer.content, []))
        usage.append(_lc_usage(answer))
        return replies, [u[0] for u in usage], [u[1] for u in usage]

    _across(servers, conversation)


# pydantic-ai --------------------------------------------------------------------------------------------------------
def test_pydantic_ai_tool_output_is_a_validated_model(servers):
    pytest.importorskip('pydantic_ai')
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    def conversation(server):
        model = OpenAIChatModel('model', provider=OpenAIProvider(base_url=server.base_url + '/v1', api_key='none'))
        agent = Agent(model, output_type=ToolOutput(City, name='final_result'),
                      model_settings=ModelSettings(max_tokens=200, temperature=1.0, seed=0, parallel_tool_calls=False))
        history, replies, usage = None, [], []
        for ask in CITY_TURNS:
            run = agent.run_sync(ask, message_history=history)
            assert isinstance(run.output, City)
            calls = [p for m in run.new_messages() for p in m.parts if getattr(p, 'part_kind', '') == 'tool-call']
            assert [c.tool_name for c in calls] == ['final_result']
            replies.append((run.output, [(c.tool_name, c.args_as_dict()) for c in calls]))
            usage.append((run.usage.input_tokens, run.usage.cache_read_tokens))
            history = run.all_messages()
        return replies, [u[0] for u in usage], [u[1] for u in usage]

    _across(servers, conversation)


# anthropic ----------------------------------------------------------------------------------------------------------
def test_anthropic_three_turns_with_tools_streaming_and_count_tokens(servers):
    anthropic = pytest.importorskip('anthropic')
    tools = [{'name': 'get_weather', 'description': 'The current weather of a city.',
              'input_schema': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}]

    def conversation(server):
        c = anthropic.Anthropic(base_url=server.base_url, api_key='none', max_retries=0, timeout=120)
        messages = [{'role': 'user', 'content': ASK}]
        # salted: the agents tests' prompts open with the same system text
        kw = dict(model='model', system=INSTRUCTIONS, tools=tools, max_tokens=120, extra_body={'cache_salt': 'claude'})
        replies = []
        for turn in range(3):
            if turn == 1:
                with c.messages.stream(messages=messages, **kw) as stream:
                    reply = stream.get_final_message()
            else:
                reply = c.messages.create(messages=messages, **kw)
            replies.append(reply)
            counted = c.messages.count_tokens(model='model', system=INSTRUCTIONS, tools=tools, messages=messages)
            assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
            uses = [b for b in reply.content if b.type == 'tool_use']
            if turn < 2:
                assert reply.stop_reason == 'tool_use'
                assert [u.input for u in uses] == [{'city': ('Paris', 'Lyon')[turn]}]
                messages += [{'role': 'assistant', 'content': [b.model_dump(exclude_none=True) for b in reply.content]},
                             {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': uses[0].id,
                                                          'content': WEATHER[uses[0].input['city']]}]}]
        assert replies[2].stop_reason == 'end_turn' and [b.type for b in replies[2].content] == ['thinking', 'text']
        assert replies[2].content[1].text == FINAL
        return ([(r.stop_reason, _scrub(r.content)) for r in replies],
                [r.usage.input_tokens + r.usage.cache_read_input_tokens for r in replies],
                [r.usage.cache_read_input_tokens for r in replies])

    _across(servers, conversation)
