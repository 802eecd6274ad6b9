"""Constrained decoding (lmdeploy.pytorch.engine.guided) and min_tokens, in the engine.

The tiny models have random weights, so any valid output is the grammar's doing: a hypothesis
generator draws JSON schemas (typed properties, enums, arrays, nesting, required) and every
reply must parse and validate against its schema. Then: tool calls parse with the server's
hermes parser and validate against the function's parameters; the mask composes with
logit_bias, penalties, sampling, a mixed batch, preemption, the prefix cache and speculative
decoding (guided requests get no drafts); matchers are freed on finish and abort.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from engine_utils import StepRecorder, assert_idle, make_engine, random_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.messages import SpeculativeConfig
from lmdeploy.messages import StructuredOutput, ToolSchema
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.serve.openai.tool_parser import get_tool_parser

EOS = 2     # <|im_end|> of the tiny tokenizers


# schemas whose every instance is short (bounded strings, numbers, arrays), so a random model
# under the mask finishes well inside the token budget
def _leaf():
    return st.one_of(
        st.builds(lambda n: {'type': 'string', 'maxLength': n}, st.integers(0, 6)),
        st.builds(lambda lo, w: {'type': 'integer', 'minimum': lo, 'maximum': lo + w},
                  st.integers(-50, 50), st.integers(0, 60)),
        st.just({'type': 'boolean'}),
        st.just({'type': 'null'}),
        st.builds(lambda vs: {'enum': vs}, st.lists(st.one_of(st.text('abc', max_size=3), st.integers(-5, 5)),
                                                    min_size=1, max_size=4, unique=True)),
    )


def _object(children):
    names = st.lists(st.text('abcdefgh', min_size=1, max_size=5), min_size=0, max_size=4, unique=True)

    def build(keys, data):
        props = {k: data.draw(children) for k in keys}
        required = [k for k in keys if data.draw(st.booleans())]
        return {'type': 'object', 'properties': props, 'required': required, 'additionalProperties': False}
    return st.builds(build, names, st.data())


def _array(children):
    return st.builds(lambda items, n: {'type': 'array', 'items': items, 'maxItems': n}, children, st.integers(0, 3))


SCHEMAS = st.recursive(_leaf(), lambda children: st.one_of(_object(children), _array(children)), max_leaves=8)
ROOT_SCHEMAS = st.one_of(_object(SCHEMAS), _array(SCHEMAS))


@pytest.fixture(scope='module')
def engine(tiny_qwen3):
    eng = make_engine(tiny_qwen3, num_gpu_blocks=64, max_batch_size=8)
    yield eng
    eng.close()


_TOKENIZERS = {}


def _decode(engine, ids) -> str:
    from transformers import AutoTokenizer
    tok = _TOKENIZERS.setdefault(engine.model_path, AutoTokenizer.from_pretrained(engine.model_path))
    return tok.decode([t for t in ids if t != EOS])


def _schema_cfg(schema, **kw) -> GenerationConfig:
    kw.setdefault('max_new_tokens', 400)
    return GenerationConfig(structured_output=StructuredOutput(type='json_schema', json_schema=schema), **kw)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=ROOT_SCHEMAS, prompt_seed=st.integers(0, 1000), sampled=st.booleans(), seed=st.integers(0, 1 << 20))
def test_any_schema_yields_a_reply_that_validates(engine, schema, prompt_seed, sampled, seed):
    cfg = _schema_cfg(schema, do_sample=sampled, temperature=1.3, random_seed=seed)
    seq = engine.generate(random_prompt(12, prompt_seed), cfg)
    assert seq.finish_reason == 'stop' and seq.output_ids[-1] == EOS, (schema, _decode(engine, seq.output_ids))
    doc = json.loads(_decode(engine, seq.output_ids))
    jsonschema.validate(doc, schema)
    assert_idle(engine)


def test_without_the_grammar_the_same_requests_do_not_validate(engine):
    """The property above is the grammar's doing: the same model unguided writes no JSON."""
    seq = engine.generate(random_prompt(12, 3), GenerationConfig(max_new_tokens=40))
    with pytest.raises(ValueError):
        json.loads(_decode(engine, seq.output_ids))


def test_json_object_and_bias_and_penalties_compose(engine):
    """logit_bias +100 on a token the grammar forbids does not unban it; penalties still apply."""
    seq = engine.generate(random_prompt(10, 5), GenerationConfig(
        max_new_tokens=300, structured_output=StructuredOutput(type='json_object'), logit_bias={100: 100.0, EOS: 100},
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5))
    text = _decode(engine, seq.output_ids)
    assert text.startswith('{'), text
    assert seq.output_ids[0] != 100 and seq.output_ids[0] != EOS
    if seq.finish_reason == 'stop':
        assert isinstance(json.loads(text), dict)


PARAMS = {'type': 'object', 'properties': {'city': {'type': 'string', 'maxLength': 5},
                                           'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}},
          'required': ['city', 'days'], 'additionalProperties': False}
TOOLS = [ToolSchema(name='get_weather', parameters=PARAMS),
         ToolSchema(name='ls', parameters={'type': 'object', 'properties': {'deep': {'type': 'boolean'}},
                                           'required': ['deep'], 'additionalProperties': False})]


@pytest.mark.parametrize('tools', [TOOLS, TOOLS[:1], TOOLS[1:]], ids=['required', 'named', 'named-ls'])
@pytest.mark.parametrize('prompt_seed', [0, 1, 2])
def test_forced_single_tool_call_parses_and_validates(engine, tools, prompt_seed):
    spec = StructuredOutput(type='tool_calls', tools=tools, parallel_tool_calls=False)
    seq = engine.generate(random_prompt(16, prompt_seed), GenerationConfig(max_new_tokens=200, structured_output=spec))
    assert seq.finish_reason == 'stop'
    parsed = get_tool_parser('hermes').parse(_decode(engine, seq.output_ids))
    assert parsed.content is None and len(parsed.calls) == 1
    call = parsed.calls[0]
    schema = {t.name: t.parameters for t in tools}
    assert call.name in schema
    jsonschema.validate(json.loads(call.arguments), schema[call.name])


def test_parallel_calls_are_one_or_more_valid_calls(engine):
    spec = StructuredOutput(type='tool_calls', tools=TOOLS)
    seq = engine.generate(random_prompt(16, 4), GenerationConfig(max_new_tokens=120, structured_output=spec))
    text = _decode(engine, seq.output_ids)
    if seq.finish_reason == 'length':       # a random model may keep calling: cut at the last whole call
        text = text[:text.rindex('</tool_call>') + len('</tool_call>')]
    calls = get_tool_parser('hermes').parse(text).calls
    assert len(calls) >= 1
    schema = {t.name: t.parameters for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schema[call.name])


def test_invalid_schema_is_a_value_error_naming_it(engine):
    for bad in ({'type': 'objectx'}, {'type': 'object', 'properties': {'a': {'$ref': '#/missing'}}}):
        with pytest.raises(ValueError, match=r'structured_output\.json_schema') as info:
            engine.requests.check([1], _schema_cfg(bad))
        # the library's reason, without the "[hh:mm:ss] file.cc:line: " of its C++ build tree
        assert not re.search(r'\[[\d:]+\]|\.cc:\d+', str(info.value)), str(info.value)
    with pytest.raises(ValueError) as info:
        engine.requests.check([1], _schema_cfg({'type': 'objectx'}))
    assert str(info.value).endswith('the schema cannot be used for constrained decoding: Unsupported type "objectx"')
    spec = StructuredOutput(type='tool_calls', tools=[ToolSchema(name='f', parameters={'type': 'nope'})])
    with pytest.raises(ValueError, match="structured_output.tools: .*function 'f'"):
        engine.requests.check([1], GenerationConfig(structured_output=spec))
    assert engine.ledger()['grammar_matchers'] == 0


BOUNDED = {'type': 'object', 'properties': {'s': {'type': 'string', 'maxLength': 4},
                                            't': {'type': 'string', 'minLength': 1, 'maxLength': 6}},
           'required': ['s', 't'], 'additionalProperties': False}


@pytest.fixture(scope='module')
def grammar_backend(tiny_qwen3):
    from transformers import AutoTokenizer

    from lmdeploy.pytorch.engine.guided import GrammarBackend
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    return tok, GrammarBackend(tok, len(tok), [EOS])


@pytest.fixture(scope='module')
def bounded_grammar(grammar_backend):
    return grammar_backend[1].compile(StructuredOutput(type='json_schema', json_schema=BOUNDED))


def test_a_bounded_string_admits_no_utf16_surrogate_bytes(bounded_grammar):
    """``ED B1 92`` (the three-byte form of U+DC52, not UTF-8) was one character to the grammar
    and three U+FFFD to the decoder, so a random reply broke ``maxLength``; real 2-, 3- and
    4-byte characters still count one each (five are one too many)."""
    import xgrammar as xgr
    for text, admitted in ((b'\xed\xb1\x92', False), (b'\xed\x9f\xbf', True), ('é中😀'.encode(), True),
                           ('é中😀xy'.encode(), False)):
        matcher = xgr.GrammarMatcher(bounded_grammar)
        assert matcher.accept_string(b'{"s": "' + text + b'"') == admitted, text


def _random_reply(tok, backend, spec, seed: int) -> list[int]:
    """A reply drawn uniformly among the tokens the guide allows at each step (a random model)."""
    import random
    rng, guide, ids = random.Random(seed), backend.guide(spec), []
    try:
        while not guide.done:
            logits = guide.mask_(torch.zeros(len(tok)))
            token = rng.choice(torch.nonzero(torch.isfinite(logits)).flatten().tolist())
            guide.accept(token)
            ids.append(token)
            assert len(ids) < 100
    finally:
        guide.close()
    return ids


def test_random_replies_are_well_formed_utf8_and_validate(grammar_backend):
    """Fuzz: 150 seeded random walks under the guide's mask (any allowed token, as a random
    model samples) decode as UTF-8 without an error and validate, ``maxLength`` counted in
    characters. Before the UTF-8 mask, overlong forms (``F0 8B B1 90``: seed 87) and surrogates
    got through and decoded to U+FFFD, one per byte."""
    tok, backend = grammar_backend
    spec = StructuredOutput(type='json_schema', json_schema=BOUNDED)
    for seed in range(150):
        ids = _random_reply(tok, backend, spec, seed)
        data = b''.join(backend.utf8._bytes[t] for t in ids if t != EOS)
        text = data.decode('utf-8')             # strict: raises on ill-formed bytes
        jsonschema.validate(json.loads(text), BOUNDED)
        assert text == tok.decode([t for t in ids if t != EOS])
    assert backend.num_live == 0


def test_utf8_guard_states_and_masks():
    """The decoder states of RFC 3629's well-formed sequences, and what each mask keeps: between
    characters everything but the ill-formed tokens; inside one only its continuations."""
    from lmdeploy.pytorch.engine.utf8_guard import CLEAN, Utf8Guard, step
    assert step(CLEAN, 'é中😀'.encode()) == CLEAN and step(CLEAN, b'\xf0') == (3, 0x90, 0xBF)
    for bad in (b'\xf0\x8b', b'\xed\xb1', b'\xe0\x80', b'\xc0', b'\xc1\xbf', b'\xf4\x90', b'\xf5', b'\x80'):
        assert step(CLEAN, bad) is None, bad
    vocab = [b'a', b'\xf0', b'\x8b', b'\x90', b'\x90\x80\x80', b'\xc0', b'', b'\xbf\xbf']
    guard = Utf8Guard(vocab, len(vocab))
    assert guard.ill_formed.tolist() == [2, 3, 4, 5, 7]
    after_f0 = guard.after(CLEAN, 1)
    assert after_f0 == (3, 0x90, 0xBF) and guard.keep[after_f0].tolist() == [3, 4, 7]
    logits = torch.zeros(len(vocab))
    assert torch.isfinite(guard.restrict_(logits.clone(), CLEAN)).tolist() == [1, 1, 0, 0, 0, 0, 1, 0]
    assert torch.isfinite(guard.restrict_(logits.clone(), after_f0)).tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    only_bad = torch.full((len(vocab),), float('-inf'))
    only_bad[2] = 0.0       # the grammar allows only an ill-formed token: its mask stays
    assert torch.isfinite(guard.restrict_(only_bad.clone(), after_f0)).tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert guard.after(after_f0, 4) == CLEAN and guard.after(after_f0, 0) == CLEAN     # (a fallback)


SCHEMA = {'type': 'object', 'properties': {'a': {'type': 'integer', 'minimum': 0, 'maximum': 999},
                                           'b': {'type': 'array', 'items': {'enum': ['x', 'yz']}, 'maxItems': 3}},
          'required': ['a', 'b'], 'additionalProperties': False}


def _run_batch(eng, jobs):
    seqs = [eng.add_request(ids, cfg) for ids, cfg in jobs]
    while eng.has_work:
        eng.step()
    return [(s.finish_reason, list(s.output_ids)) for s in seqs]


def _mixed_jobs():
    jobs = []
    for i in range(6):
        cfg = _schema_cfg(SCHEMA, max_new_tokens=60) if i % 2 == 0 else GenerationConfig(max_new_tokens=24,
                                                                                          ignore_eos=True)
        jobs.append((random_prompt(40 + 7 * i, 10 + i), cfg))
    return jobs


def test_mixed_batch_equals_each_request_alone(engine):
    jobs = _mixed_jobs()
    batched = _run_batch(engine, jobs)
    alone = [_run_batch(engine, [job])[0] for job in jobs]
    assert batched == alone
    for (reason, ids), (_, cfg) in zip(batched, jobs):
        if cfg.structured_output is not None:
            assert reason == 'stop'
            jsonschema.validate(json.loads(_decode(engine, ids)), SCHEMA)
    assert_idle(engine)


def test_preemption_keeps_the_grammar_in_step(engine, tiny_qwen3):
    """Few blocks: sequences are preempted and recomputed; replies equal the roomy engine's."""
    small = make_engine(tiny_qwen3, num_gpu_blocks=7, block_size=16, max_batch_size=6)
    try:
        jobs = _mixed_jobs()
        rec = StepRecorder(small)
        got = _run_batch(small, jobs)
        ends, recomputed = {}, set()
        for step in rec.steps:
            for seq_id, start, end, _ in step.chunks:
                if start < ends.get(seq_id, 0):
                    recomputed.add(seq_id)
                ends[seq_id] = end
        assert recomputed, 'nothing was preempted: the test did not exercise recomputation'
        assert got == [_run_batch(engine, [job])[0] for job in jobs]
        assert_idle(small)
    finally:
        small.close()


def test_abort_frees_the_matcher(engine):
    seq = engine.add_request(random_prompt(10, 1), _schema_cfg(SCHEMA))
    engine.step()
    assert engine.ledger()['grammar_matchers'] == 1
    engine.abort(seq)
    assert engine.ledger()['grammar_matchers'] == 0
    assert_idle(engine)


def test_prefix_cache_and_spec_decoding_leave_the_guided_reply_unchanged(tiny_qwen3_next):
    """Hybrid model: cache off / on (a second turn restoring a checkpoint) / n-gram drafting all
    give the same guided reply; the drafting engine gives the guided request no drafts."""
    prompt = random_prompt(150, 21)
    cfg = _schema_cfg(SCHEMA, max_new_tokens=60)
    replies = []
    for fields in ({}, {'enable_prefix_caching': True, 'block_size': 16, 'prefill_save_alignment': 64},
                   {'speculative_config': SpeculativeConfig(method='ngram', num_speculative_tokens=3)}):
        eng = make_engine(tiny_qwen3_next, num_gpu_blocks=64, **fields)
        try:
            first = eng.generate(prompt, cfg)
            again = eng.generate(prompt, cfg)
            if fields.get('enable_prefix_caching'):
                assert again.num_cached_tokens > 0
            if eng.spec is not None:
                assert eng.stats().get('spec_decode_draft_tokens', 0) == 0
            replies.append(first.output_ids)
            assert again.output_ids == first.output_ids
            assert eng.is_idle() and eng.ledger()['grammar_matchers'] == 0
        finally:
            eng.close()
    assert replies[0] == replies[1] == replies[2]
    jsonschema.validate(json.loads(_decode_path(tiny_qwen3_next, replies[0])), SCHEMA)


def _decode_path(path, ids):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path).decode([t for t in ids if t != EOS])


# min_tokens ------------------------------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_ids_until_reached(engine):
    """logit_bias +100 forces EOS at every step: the reply is EOS alone without min_tokens, and
    min_tokens tokens then EOS with it (vLLM's meaning: that many tokens before a stop token may
    come); a stop id is held back the same way."""
    forced = {EOS: 100.0}
    prompt = random_prompt(10, 2)
    assert engine.generate(prompt, GenerationConfig(max_new_tokens=20, logit_bias=forced)).output_ids == [EOS]
    for n in (1, 2, 5, 9):
        seq = engine.generate(prompt, GenerationConfig(max_new_tokens=20, logit_bias=forced, min_tokens=n))
        assert seq.finish_reason == 'stop' and seq.num_generated == n + 1 and seq.output_ids[-1] == EOS
        assert EOS not in seq.output_ids[:-1]
    stop = 77
    seq = engine.generate(prompt, GenerationConfig(max_new_tokens=20, logit_bias={stop: 100.0},
                                                   stop_token_ids=[stop], min_tokens=4, do_sample=True, random_seed=3))
    assert seq.num_generated == 5 and seq.output_ids[-1] == stop and stop not in seq.output_ids[:-1]
    seq = engine.generate(prompt, GenerationConfig(max_new_tokens=3, logit_bias=forced, min_tokens=10))
    assert seq.finish_reason == 'length' and EOS not in seq.output_ids


def test_min_tokens_counts_drafts_under_verification(tiny_qwen3):
    eng = Engine(tiny_qwen3, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                 speculative_config=SpeculativeConfig(method='ngram')))
    try:
        prompt = [5, 6, 7, 8] * 8
        plain = make_engine(tiny_qwen3, num_gpu_blocks=64)
        for n in (3, 6):
            cfg = GenerationConfig(max_new_tokens=20, logit_bias={EOS: 30.0}, min_tokens=n)
            assert eng.generate(prompt, cfg).output_ids == plain.generate(prompt, cfg).output_ids
        plain.close()
    finally:
        eng.close()


@pytest.mark.parametrize('prompt_seed', [0, 1, 2])
def test_qwen_xml_call_has_the_schema_parameters(engine, prompt_seed):
    """The qwen_xml grammar: one <function=NAME> block whose <parameter=KEY> values are the
    schema's required keys, the integer in its range."""
    import re
    spec = StructuredOutput(type='tool_calls', tool_format='qwen_xml', tools=TOOLS[:1], parallel_tool_calls=False)
    seq = engine.generate(random_prompt(16, prompt_seed), GenerationConfig(max_new_tokens=200, structured_output=spec))
    assert seq.finish_reason == 'stop'
    text = _decode(engine, seq.output_ids)
    m = re.fullmatch(r'<tool_call>\n<function=get_weather>\n(.*)\n</function>\n</tool_call>', text, re.S)
    assert m, text
    params = dict(re.findall(r'<parameter=(\w+)>(.*?)</parameter>', m.group(1), re.S))
    assert set(params) == {'city', 'days'} and 1 <= int(params['days'].strip()) <= 7
    assert_idle(engine)
