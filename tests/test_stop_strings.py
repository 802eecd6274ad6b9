"""Stop strings end the sequence inside the engine (issue 31, item 4): the engine decodes each
sampled token of a request with stop strings in the step that sampled it, so the reply ends on
the token completing the match — no token is computed past it, whatever the token boundaries —
with finish_reason 'stop', the text cut before the match, and the turn-end checkpoint
(``decode_save_last``) at or below the cut. Streaming and blocking, pipeline and engine."""
import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine_utils import make_engine, random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.pytorch.engine.stop_strings import Detokenizer

PIECES = ['hello ', 'wörld ', '数据 ', '🙂', ' x=1;', '\n', 'tests ', 'ab', 'c', 'end.']


@pytest.fixture(scope='module')
def tokenizer(tiny_qwen3_next):
    return AutoTokenizer.from_pretrained(tiny_qwen3_next, local_files_only=True)


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _reference(tok, ids, words):
    """(tokens up to the one completing a stop string, cut, tokens wholly before the cut) by
    decoding every prefix; None when no stop string occurs."""
    k = next((k for k in range(1, len(ids) + 1) if any(w in _decode(tok, ids[:k]).rstrip('\ufffd') for w in words)),
             None)
    if k is None:
        return None
    text = _decode(tok, ids[:k])
    cut = min((text.find(w) + len(w), text.find(w)) for w in words if w in text)[1]
    kept = max(m for m in range(k + 1) if not _decode(tok, ids[:m]).endswith('\ufffd')
               and len(_decode(tok, ids[:m])) <= cut)
    return k, cut, kept


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=3, max_size=25), data=st.data())
def test_engine_side_matcher_stops_on_the_token_completing_a_stop_string(tokenizer, pieces, data):
    """Property: feeding one token at a time stops exactly at the first token whose text
    completes a stop string (also inside a token, or before a character split across tokens),
    cuts at its first occurrence, and the pipeline's chunked detokenizer finds the same cut."""
    tok = tokenizer
    ids = tok.encode(''.join(pieces), add_special_tokens=False)
    full = _decode(tok, ids)
    words = []
    for _ in range(data.draw(st.integers(1, 3))):
        a = data.draw(st.integers(0, len(full) - 1))
        b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
        words.append(full[a:b])
    words += data.draw(st.lists(st.sampled_from(['zzz', 'never', '🙂🙂🙂']), max_size=1))
    ref = _reference(tok, ids, words)
    detok = Detokenizer(tok, words)
    stopped_at = next((i + 1 for i, t in enumerate(ids) if detok.feed(t)), None)
    assert ref is not None and stopped_at == ref[0], (words, full)
    k, cut, kept = ref
    assert detok.text == full[:cut] and detok.kept_tokens == kept
    # the consumer's detokenizer, fed the engine's tokens in arbitrary chunks, ends there too
    consumer, out, i = Detokenizer(tok, words), [], 0
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=k, max_size=k))
    for size in sizes:
        if i >= k:
            break
        out.append(consumer.add(ids[i:i + size], final=i + size >= k))
        i += size
    assert consumer.stopped and ''.join(out) == full[:cut]


def _stop_across_tokens(tok, ids, start):
    """A 4-character string of the decoded output whose first occurrence crosses a token
    boundary at or after token ``start``; returns (word, the token completing it)."""
    text = _decode(tok, ids)
    for k in range(max(start, 2), len(ids)):
        head = _decode(tok, ids[:k])
        b = len(head)
        word = text[b - 2:b + 2]
        if b >= 2 and text.startswith(head) and len(word) == 4 and word.isprintable() and word.strip() \
                and '\ufffd' not in word and text.find(word) == b - 2:
            done = next(m for m in range(1, len(ids) + 1) if word in _decode(tok, ids[:m]))
            return word, done
    raise AssertionError(f'no stop string candidate in {text!r}')


def test_no_token_is_computed_past_the_match(tiny_qwen3_next, tokenizer):
    """Regression: the engine alone (no consumer sending a finish) ends the request on the
    token completing the stop string; before, it decoded on to max_new_tokens."""
    engine = make_engine(tiny_qwen3_next, block_size=16)
    prompt = random_prompt(40, 3)
    full = engine.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True)).output_ids
    word, done = _stop_across_tokens(tokenizer, full, 8)
    computed = []
    forward = engine.model_runner.forward

    def counting(sched):
        computed.extend(c.end - c.start for c in sched.chunks)
        return forward(sched)
    engine.model_runner.forward = counting
    seq = engine.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True, stop_words=[word]))
    assert seq.finish_reason == 'stop'
    assert seq.output_ids == full[:done]
    # the prompt and every output token but the last (sampled, never computed): none past the match
    assert sum(computed) == len(prompt) + done - 1
    assert _decode(tokenizer, full[:seq.num_kept_tokens - len(prompt)]) in _decode(tokenizer, full).split(word)[0]
    assert engine.is_idle()


def test_pipeline_blocking_streaming_and_async_end_on_the_matching_token(tiny_qwen3_next, tokenizer):
    cfg = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=64, block_size=16)
    prompt = random_prompt(30, 4)
    with pipeline(tiny_qwen3_next, backend_config=cfg) as pipe:
        full = pipe(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True))
        word, done = _stop_across_tokens(tokenizer, full.token_ids, 6)
        gen = GenerationConfig(max_new_tokens=40, ignore_eos=True, stop_words=[word])
        expected = full.text[:full.text.find(word)]
        for _ in range(3):      # the consumer used to race the engine: 2-3 tokens late
            blocking = pipe(prompt, gen)
            assert (blocking.text, blocking.finish_reason, blocking.generate_token_len) == (expected, 'stop', done)
            deltas = list(pipe.stream_infer(prompt, gen))
            assert ''.join(d.text for d in deltas) == expected
            assert (deltas[-1].finish_reason, deltas[-1].generate_token_len) == ('stop', done)

            async def run():
                return [r async for r in pipe.generate(prompt, gen)]
            deltas = asyncio.run(run())
            assert ''.join(d.text for d in deltas) == expected
            assert (deltas[-1].finish_reason, deltas[-1].generate_token_len) == ('stop', done)
        led = pipe.ledger()
        assert led['blocks_in_use'] == 0 and led['requests_running'] == 0


def test_turn_end_checkpoint_lands_at_the_cut_when_the_stop_string_crosses_a_block(tiny_qwen3_next, tokenizer):
    """A stop string whose tokens cross a block boundary: the turn-end checkpoint is the last
    block boundary of the tokens before the cut (kept in a second staging slot), not the one
    past it, and the next turn — which re-sends the visible reply — restores there."""
    B = 16
    cfg = dict(block_size=B, prefill_save_alignment=64, enable_prefix_caching=True, prefill_save_last_only=True,
               decode_save_last=True)
    engine = make_engine(tiny_qwen3_next, **cfg)
    prompt = random_prompt(150, 5)
    full = engine.generate(prompt, GenerationConfig(max_new_tokens=60, ignore_eos=True)).output_ids
    text = _decode(tokenizer, full)
    # a stop string starting before a block boundary of the sequence and ending after it
    found = None
    for k in range((len(prompt) // B + 2) * B - len(prompt), len(full) - 1):
        if (len(prompt) + k) % B:
            continue
        for left, right in ((2, 2), (1, 3), (3, 1), (1, 2), (2, 1)):
            head = _decode(tokenizer, full[:k])
            word = text[len(head) - left:len(head) + right]
            if text.startswith(head) and len(head) >= left and '\ufffd' not in word and word.strip() \
                    and len(word) == left + right and text.find(word) == len(head) - left \
                    and _decode(tokenizer, full[:k - 1]) and len(_decode(tokenizer, full[:k - 1])) <= len(head) - left:
                found = word, k
                break
        if found:
            break
    assert found, text
    word, k = found
    engine.prefix_cache.local.evict(10_000)
    seq = engine.generate(prompt, GenerationConfig(max_new_tokens=60, ignore_eos=True, stop_words=[word]))
    assert seq.finish_reason == 'stop' and seq.num_kept_tokens < len(prompt) + k
    cut_boundary = seq.num_kept_tokens // B * B
    assert cut_boundary < (seq.num_tokens - 1) // B * B       # the old rule's boundary lies past the cut
    assert seq.stats.turn_end_point == cut_boundary
    follow = prompt + full[:seq.num_kept_tokens - len(prompt)] + random_prompt(10, 6)
    nxt = engine.generate(follow, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    assert nxt.num_cached_tokens == cut_boundary > len(prompt) // B * B
    assert engine.is_idle()
