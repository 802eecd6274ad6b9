"""The agent frameworks people use, each through its own API, against one server.

- openai-agents: an ``Agent`` with a function tool, run by ``Runner`` through its default
  Responses model and through ``OpenAIChatCompletionsModel``: three model turns (two calls, each
  executed by the framework, then the answer).
- langchain-openai: ``with_structured_output`` in its default mode (``response_format``
  json_schema) and ``method="function_calling"`` (a named ``tool_choice``), ``bind_tools`` with
  the call's result sent back as a ``ToolMessage``.
- pydantic-ai: an ``Agent`` whose output is a ``ToolOutput`` (a forced call of its output tool).
- anthropic: three turns of tool use, the middle one streamed, with ``count_tokens``.

Each test asserts what the client made of our reply: the framework's own types (a parsed tool
call it executed, a validated pydantic model), and the cache hits it reports after the first turn.
A module is skipped only when its package is absent.

Server: tiny full-attention Qwen3 with the Qwen3-style tools + thinking template, B=16, prefix
caching on, sampler scripted (tests/scripted_server.py) for the turns that must call a tool; the
structured outputs are the grammar's doing (the random model picks the values).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
from chat_templates import THINKING_TOOLS_TEMPLATE, with_template
from pydantic import BaseModel, Field
from server_utils import ApiServer

TESTS = os.path.dirname(os.path.abspath(__file__))
WEATHER = {'Paris': 'sunny, 21 C', 'Lyon': 'rain, 14 C'}
FINAL = 'Paris is sunny and Lyon is rainy.'


def _call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


ASK = 'Compare the weather in Paris and Lyon.'
SCRIPT = [{'contains': ASK, 'turn': 0, 'reply': _call('Paris')},
          {'contains': ASK, 'turn': 1, 'reply': _call('Lyon')},
          {'contains': ASK, 'turn': 2, 'reply': '<think>\nBoth are known.\n</think>\n\n' + FINAL}]
INSTRUCTIONS = ('You are a weather agent. Call get_weather once per city before you answer, then compare the '
                'cities in one sentence. ') * 3


class City(BaseModel):
    """A city and its population in millions."""
    name: str = Field(max_length=8)
    millions: int = Field(ge=0, le=40)


@pytest.fixture(scope='module')
def server(tiny_qwen3, tmp_path_factory):
    model = with_template(tiny_qwen3, str(tmp_path_factory.mktemp('clients') / 'model'), THINKING_TOOLS_TEMPLATE)
    proc = ApiServer(model, '--block-size', '16', '--enable-prefix-caching', '--session-len', '4096',
                     launcher=[sys.executable, os.path.join(TESTS, 'scripted_server.py')],
                     env={'LMDEPLOY_TEST_SCRIPT': json.dumps(SCRIPT)})
    try:
        yield proc.start()
    finally:
        proc.stop()


# openai-agents ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('api', ['responses', 'chat_completions'])
def test_openai_agents_runs_the_tool_twice_then_answers(server, api):
    agents = pytest.importorskip('agents')
    from openai import AsyncOpenAI
    agents.set_tracing_disabled(True)
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
    assert ran == ['Paris', 'Lyon']                     # our calls, parsed and executed by the framework
    assert result.final_output == FINAL
    usage = [r.usage for r in result.raw_responses]
    assert len(usage) == 3 and usage[0].input_tokens_details.cached_tokens == 0
    # each turn re-sends the previous one: its prompt (and the call) come from the prefix cache
    for before, after in zip(usage, usage[1:]):
        assert after.input_tokens_details.cached_tokens >= before.input_tokens // 16 * 16 > 0


# langchain-openai ---------------------------------------------------------------------------------------------------
def _chat_openai(server):
    lc = pytest.importorskip('langchain_openai')
    return lc.ChatOpenAI(model='model', base_url=server.base_url + '/v1', api_key='none', max_retries=0,
                         timeout=120, max_tokens=200, temperature=1.0, seed=0)


@pytest.mark.parametrize('method', [None, 'function_calling'])
def test_langchain_structured_output_is_a_validated_model(server, method):
    llm = _chat_openai(server)
    kw = {} if method is None else {'method': method}
    structured = llm.with_structured_output(City, include_raw=True, **kw)
    out = structured.invoke('Name a large city.')
    assert out['parsing_error'] is None
    assert isinstance(out['parsed'], City)                # validated by pydantic: the schema held
    raw = out['raw']
    if method == 'function_calling':
        assert [c['name'] for c in raw.tool_calls] == ['City']
        assert City(**raw.tool_calls[0]['args']) == out['parsed']
    else:
        assert City.model_validate_json(raw.content) == out['parsed']


def test_langchain_bind_tools_parses_the_call_and_takes_the_result(server):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return WEATHER[city]

    llm = _chat_openai(server).bind_tools([get_weather])
    messages = [SystemMessage(INSTRUCTIONS), HumanMessage(ASK)]
    for city in ('Paris', 'Lyon'):
        reply = llm.invoke(messages)
        assert [(c['name'], c['args']) for c in reply.tool_calls] == [('get_weather', {'city': city})]
        messages += [reply, ToolMessage(get_weather.invoke(reply.tool_calls[0]['args']),
                                        tool_call_id=reply.tool_calls[0]['id'])]
    answer = llm.invoke(messages)
    assert answer.content == FINAL and not answer.tool_calls
    assert answer.usage_metadata['input_token_details']['cache_read'] > 0


# pydantic-ai --------------------------------------------------------------------------------------------------------
def test_pydantic_ai_tool_output_is_a_validated_model(server):
    pytest.importorskip('pydantic_ai')
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel('model', provider=OpenAIProvider(base_url=server.base_url + '/v1', api_key='none'))
    agent = Agent(model, output_type=ToolOutput(City, name='final_result'),
                  model_settings=ModelSettings(max_tokens=200, temperature=1.0, seed=0, parallel_tool_calls=False))
    first = agent.run_sync('Name a large city.')
    assert isinstance(first.output, City)
    calls = [p for m in first.all_messages() for p in m.parts if getattr(p, 'part_kind', '') == 'tool-call']
    assert [c.tool_name for c in calls] == ['final_result']
    second = agent.run_sync('And another one.', message_history=first.all_messages())
    assert isinstance(second.output, City)
    assert second.usage.cache_read_tokens > 0


# anthropic ----------------------------------------------------------------------------------------------------------
def test_anthropic_three_turns_with_tools_streaming_and_count_tokens(server):
    anthropic = pytest.importorskip('anthropic')
    c = anthropic.Anthropic(base_url=server.base_url, api_key='none', max_retries=0, timeout=120)
    tools = [{'name': 'get_weather', 'description': 'The current weather of a city.',
              'input_schema': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}]
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
            assert reply.stop_reason == 'tool_use' and [u.input for u in uses] == [{'city': ('Paris', 'Lyon')[turn]}]
            messages += [{'role': 'assistant', 'content': [b.model_dump(exclude_none=True) for b in reply.content]},
                         {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': uses[0].id,
                                                      'content': WEATHER[uses[0].input['city']]}]}]
    assert replies[2].stop_reason == 'end_turn' and [b.type for b in replies[2].content] == ['thinking', 'text']
    assert replies[2].content[1].text == FINAL
    assert replies[0].usage.cache_read_input_tokens == 0
    for before, after in zip(replies, replies[1:]):
        prompt = before.usage.input_tokens + before.usage.cache_read_input_tokens
        assert after.usage.cache_read_input_tokens >= prompt // 16 * 16 > 0
