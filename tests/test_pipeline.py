"""The pipeline (issue 2): every prompt form gives the engine's greedy output, streaming
and async deltas add up to the blocking result, stop strings cut the text before them, bad input
gets a clear error while the pipeline keeps serving, and aborted streams free every block."""
import asyncio
import json
import re
import time

import pytest

from engine_utils import make_engine, random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

SESSION_LEN = 256
GREEDY = GenerationConfig(max_new_tokens=16, ignore_eos=True)
PROMPT = 'The river town woke slowly. Fishermen pulled their boats'



@pytest.fixture(scope='module')
def pipe(tiny_qwen3):
    cfg = PytorchEngineConfig(device_type='cpu', session_len=SESSION_LEN, block_size=16, num_gpu_blocks=64,
                              max_prefill_token_num=64, max_batch_size=4)
    with pipeline(tiny_qwen3, backend_config=cfg) as p:
        yield p


@pytest.fixture(scope='module')
def reference(tiny_qwen3):
    """Greedy output ids of a separate engine for given prompt ids."""
    engine = make_engine(tiny_qwen3)
    return lambda ids, cfg=GREEDY: engine.generate(ids, cfg).output_ids


def assert_idle(pipe):
    led = pipe.ledger()
    assert led['blocks_free'] == led['blocks_total'] == 64
    assert led['blocks_in_use'] == 0


def test_every_prompt_form_gives_the_engine_greedy_output(pipe, reference):
    tok = pipe.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=False)
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Why is the sky blue?'}]
    chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)['input_ids'])
    tail = tok.encode('<|im_start|>assistant\n')
    assert chat_ids[0] == 1 and chat_ids[-len(tail):] == tail
    want = reference(ids)

    single = pipe(PROMPT, gen_config=GREEDY, do_preprocess=False)          # a raw continuation
    assert single.token_ids == want
    assert single.text == tok.decode(want, skip_special_tokens=True)
    assert (single.input_token_len, single.generate_token_len, single.finish_reason, single.cached_tokens) == \
        (len(ids), 16, 'length', 0)
    assert pipe(ids, gen_config=GREEDY).token_ids == want
    chat = pipe(messages, gen_config=GREEDY)
    assert chat.input_token_len == len(chat_ids)
    assert chat.token_ids == reference(chat_ids)
    # by default a plain string is a user message rendered with the chat template
    user_ids = list(tok.apply_chat_template([{'role': 'user', 'content': PROMPT}], add_generation_prompt=True,
                                            tokenize=True)['input_ids'])
    default = pipe(PROMPT, gen_config=GREEDY)
    assert default.input_token_len == len(user_ids) and default.token_ids == reference(user_ids)
    batch = pipe([PROMPT, messages, ids], gen_config=GREEDY, do_preprocess=False)
    assert [r.index for r in batch] == [0, 1, 2]
    assert [r.token_ids for r in batch] == [want, chat.token_ids, want]
    assert pipe([PROMPT, ids], gen_config=GREEDY)[0].token_ids == default.token_ids
    assert_idle(pipe)


def test_stream_and_async_deltas_add_up_to_the_blocking_result(pipe):
    prompts = [PROMPT, 'Hello! How can I help']
    blocking = pipe(prompts, gen_config=GREEDY)
    text, ids, reasons = ['', ''], [[], []], [[], []]
    for r in pipe.stream_infer(prompts, gen_config=GREEDY):
        text[r.index] += r.text
        ids[r.index] += r.token_ids
        reasons[r.index].append(r.finish_reason)
    for i, r in enumerate(blocking):
        assert (text[i], ids[i]) == (r.text, r.token_ids)
        assert reasons[i] == [None] * 15 + ['length']        # one delta per token, reason on the last

    async def collect():
        out = []
        async for r in pipe.generate(prompts[1], GREEDY):
            out.append(r)
        return out
    deltas = asyncio.run(collect())
    assert ''.join(r.text for r in deltas) == blocking[1].text
    assert sum((r.token_ids for r in deltas), []) == blocking[1].token_ids
    assert deltas[-1].finish_reason == 'length'
    assert_idle(pipe)


def _stop_string_across_tokens(tok, ids: list[int]) -> tuple[str, int]:
    """A 4-character string whose first occurrence in the decoded text crosses a token
    boundary (2 characters each side); returns it and its offset."""
    text = tok.decode(ids, skip_special_tokens=True)
    for k in range(2, len(ids)):
        b = len(tok.decode(ids[:k], skip_special_tokens=True))
        if b < 2 or not text.startswith(tok.decode(ids[:k], skip_special_tokens=True)):
            continue
        word = text[b - 2:b + 2]
        if len(word) == 4 and word.isprintable() and word.strip() and '\ufffd' not in word \
                and text.find(word) == b - 2:
            return word, b - 2
    raise AssertionError(f'no stop string candidate in {text!r}')


def test_stop_string_spanning_two_tokens_ends_text_before_it(pipe):
    tok = pipe.tokenizer
    full = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=24, ignore_eos=True))
    word, pos = _stop_string_across_tokens(tok, full.token_ids)
    stopped = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=24, ignore_eos=True, stop_words=[word]))
    assert stopped.text == full.text[:pos]
    assert stopped.finish_reason == 'stop'
    assert stopped.generate_token_len < 24
    streamed = ''.join(r.text for r in pipe.stream_infer(
        PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True, stop_words=[word])))
    assert streamed == full.text[:pos]
    # the stop string completes on the very last allowed token: still a stop, not 'length'
    last = next(m for m in range(1, 25) if word in tok.decode(full.token_ids[:m], skip_special_tokens=True))
    at_end = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=last, ignore_eos=True, stop_words=[word]))
    assert (at_end.text, at_end.finish_reason) == (full.text[:pos], 'stop')
    assert_idle(pipe)


def test_a_stop_string_ends_a_completed_turn_that_the_cache_keeps(tiny_qwen3_next):
    """A reply cut by a stop string is a completed turn, not an abort: with turn-end checkpoints
    on, it is published (sync and async paths), and the next turn, which appends the visible
    reply, is served from the cache past the prompt."""
    cfg = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=128, block_size=16, prefill_save_alignment=64,
                              enable_prefix_caching=True, prefill_save_last_only=True, decode_save_last=True)
    prompt = random_prompt(150, 5)
    full = make_engine(tiny_qwen3_next).generate(prompt, GenerationConfig(max_new_tokens=40,
                                                                          ignore_eos=True)).output_ids
    for mode in ('sync', 'async'):
        with pipeline(tiny_qwen3_next, backend_config=cfg) as pipe:
            tok = pipe.tokenizer
            word, _ = _stop_string_across_tokens(tok, full[20:])
            gen = GenerationConfig(max_new_tokens=40, ignore_eos=True, stop_words=[word])
            if mode == 'sync':
                stopped = pipe(prompt, gen_config=gen)
                reason, text, n = stopped.finish_reason, stopped.text, stopped.generate_token_len
            else:
                async def run():
                    return [r async for r in pipe.generate(prompt, gen)]
                deltas = asyncio.run(run())
                reason, text, n = deltas[-1].finish_reason, ''.join(d.text for d in deltas), deltas[-1].generate_token_len
            assert reason == 'stop' and 20 < n < 40, (mode, reason, n)
            assert pipe.stats()['turn_end_checkpoints_saved'] == 1, mode     # an abort publishes none
            assert text == tok.decode(full, skip_special_tokens=True)[:len(text)]
            # the next turn re-sends the reply's tokens before the stop string: served from the turn end
            follow = prompt + full[:n - 1] + random_prompt(10, 6)
            turn_end = (len(prompt) + n - 1) // 16 * 16      # last block boundary of the computed tokens
            assert pipe(follow, gen_config=GREEDY).cached_tokens == turn_end > len(prompt), mode
            led = pipe.ledger()
            assert led['blocks_in_use'] == 0 and led['checkpoints_pinned'] == 0


def test_stop_token_id_ends_output_before_it(pipe):
    full = pipe(PROMPT, gen_config=GREEDY)
    stop = full.token_ids[5]
    k = full.token_ids.index(stop)
    r = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=16, stop_token_ids=[stop]))
    assert (r.token_ids, r.finish_reason, r.stop_token_id) == (full.token_ids[:k], 'stop', stop)
    assert full.stop_token_id is None           # ended by its length
    assert r.text == pipe.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)
    # ignore_eos turns off EOS only: a stop token id still ends the output, before it
    r = pipe(PROMPT, gen_config=GenerationConfig(max_new_tokens=16, stop_token_ids=[stop], ignore_eos=True))
    assert (r.token_ids, r.finish_reason) == (full.token_ids[:k], 'stop')


def test_bad_input_gets_a_clear_error_and_the_pipeline_keeps_serving(pipe, reference):
    want = reference(pipe.tokenizer.encode(PROMPT, add_special_tokens=False))
    too_long = random_prompt(300, seed=9)
    cases = [(lambda: pipe('', gen_config=GREEDY), 'empty'),
             (lambda: pipe([], gen_config=GREEDY), 'non-empty'),
             (lambda: pipe(too_long, gen_config=GREEDY), r'300 tokens.*session_len=256'),
             (lambda: pipe([PROMPT, too_long], gen_config=GREEDY), r'300 tokens.*session_len=256'),
             (lambda: pipe([{'role': 'robot', 'content': 'hi'}]), 'robot'),
             (lambda: GenerationConfig(max_new_tokens=-1), 'max_new_tokens'),
             (lambda: PytorchEngineConfig(block_size=0), 'block_size')]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert pipe(PROMPT, gen_config=GREEDY, do_preprocess=False).token_ids == want   # still serving, same output
        assert_idle(pipe)                                           # and nothing left behind


def test_a_path_that_is_not_a_model_is_a_clear_error(tmp_path):
    missing = tmp_path / 'nowhere'
    with pytest.raises(ValueError, match='nowhere'):
        pipeline(str(missing))
    with pytest.raises(ValueError, match='config.json'):
        pipeline(str(tmp_path))
    other = tmp_path / 'llama'
    other.mkdir()
    (other / 'config.json').write_text(json.dumps({'model_type': 'llama', 'hidden_size': 8,
                                                   'num_attention_heads': 1, 'num_hidden_layers': 1}))
    with pytest.raises(ValueError, match=r"'llama'.*qwen3, .*qwen3_next"):
        pipeline(str(other))


def test_a_model_directory_without_tokenizer_files_is_a_clear_error(tiny_qwen3, tmp_path):
    import shutil
    bare = tmp_path / 'bare'
    shutil.copytree(tiny_qwen3, bare)
    for name in ('tokenizer.json', 'tokenizer_config.json'):
        (bare / name).unlink()
    with pytest.raises(ValueError, match='no tokenizer files'):
        pipeline(str(bare))


@pytest.mark.parametrize('name, says', [
    ('config.json', r"config\.json cannot be read as JSON: Expecting property name enclosed in double quotes"),
    ('generation_config.json', r'generation_config\.json cannot be loaded'),
    ('tokenizer_config.json', r'the tokenizer files .* cannot be loaded: JSONDecodeError'),
    ('tokenizer.json', r'the tokenizer files .* cannot be loaded: Exception: EOF while parsing'),
])
@pytest.mark.parametrize('content', ['{', ''])
def test_a_broken_json_file_of_the_model_is_a_value_error_naming_it(tiny_qwen3, tmp_path, name, says, content):
    """A truncated JSON file in the model directory (an interrupted copy) is a ValueError naming
    the directory and the file: transformers / tokenizers raised an OSError or a bare Exception,
    which reached the command line as a traceback with exit status 1."""
    import shutil
    broken = tmp_path / 'broken'
    shutil.copytree(tiny_qwen3, broken)
    (broken / name).write_text(content)
    if content == '':
        says = says.split(' cannot ')[0]        # the parser's words differ for an empty file
    with pytest.raises(ValueError, match=f"model_path '{re.escape(str(broken))}': {says}"):
        pipeline(str(broken))


def test_a_truncated_weight_file_is_a_value_error_naming_it(tiny_qwen3, tmp_path):
    """A weight file cut anywhere (in its length prefix, its header or its data: an interrupted
    copy) is refused when opened, naming the file; safetensors raised its own SafetensorError,
    a traceback with exit status 1 at the command line."""
    import os
    import shutil

    from lmdeploy.pytorch.models.checkpoint_files import open_safetensors
    src = os.path.join(tiny_qwen3, 'model.safetensors')
    size = os.path.getsize(src)
    with open(src, 'rb') as f:
        data = f.read()
    header_end = 8 + int.from_bytes(data[:8], 'little')
    cut = tmp_path / 'cut.safetensors'
    for length in sorted({0, 4, 8, 9, header_end // 2, header_end - 1, header_end, header_end + 1, size // 2,
                          size - 1}):
        cut.write_bytes(data[:length])
        with pytest.raises(ValueError, match=f"weight file '{re.escape(str(cut))}' cannot be read as safetensors: "
                                             'SafetensorError: '):
            with open_safetensors(str(cut)):
                pass
    broken = tmp_path / 'broken'
    shutil.copytree(tiny_qwen3, broken)
    with open(broken / 'model.safetensors', 'r+b') as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match="weight file .*model.safetensors' cannot be read as safetensors"):
        pipeline(str(broken))


@pytest.mark.parametrize('index', ['{', '{}', '{"weight_map": []}'])
def test_an_unreadable_shard_index_is_a_value_error_naming_it(tmp_path, index):
    from lmdeploy.pytorch.models.checkpoint_files import weight_files
    (tmp_path / 'model.safetensors.index.json').write_text(index)
    with pytest.raises(ValueError, match='model.safetensors.index.json has no readable "weight_map"'):
        weight_files(str(tmp_path))


def test_a_config_json_its_own_class_refuses_is_a_value_error(tiny_qwen3, tmp_path):
    """transformers' config validation (here: layer_types shorter than num_hidden_layers) raises
    huggingface_hub's validation error, an Exception but not a ValueError."""
    with open(f'{tiny_qwen3}/config.json') as f:
        config = json.load(f)
    config['layer_types'] = ['full_attention']
    (tmp_path / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json cannot be loaded: .*num_hidden_layers"):
        pipeline(str(tmp_path))


def test_a_config_json_that_is_not_an_object_is_a_value_error(tmp_path):
    (tmp_path / 'config.json').write_text('[1]')
    with pytest.raises(ValueError, match='config.json must hold a JSON object, got list'):
        pipeline(str(tmp_path))


def test_pipeline_arguments_it_does_not_take_are_a_value_error_naming_them(tiny_qwen3):
    """Other engines' pipeline keywords (e.g. ``chat_template_config``) are refused by name
    before anything loads, not a TypeError; ``log_level`` sets the lmdeploy logger."""
    import logging
    with pytest.raises(ValueError, match='chat_template_config'):
        pipeline(tiny_qwen3, chat_template_config=None)
    with pytest.raises(ValueError, match='log_level'):
        pipeline(tiny_qwen3, log_level='LOUD')
    before = logging.getLogger('lmdeploy').level
    try:
        cfg = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=16, block_size=16)
        with pipeline(tiny_qwen3, backend_config=cfg, log_level='error') as pipe:
            assert logging.getLogger('lmdeploy').level == logging.ERROR
            assert pipe('hi', gen_config=GenerationConfig(max_new_tokens=1, ignore_eos=True)).generate_token_len == 1
    finally:
        logging.getLogger('lmdeploy').setLevel(before)


def test_close_ends_requests_in_flight_and_later_calls_fail_clearly(tiny_qwen3_next):
    """close() while another thread waits on a long request: that call returns with 'abort';
    calls after close raise RuntimeError at once (they used to block forever)."""
    import threading
    cfg = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=64, block_size=16)
    p = pipeline(tiny_qwen3_next, backend_config=cfg)
    got = {}
    worker = threading.Thread(target=lambda: got.update(r=p('hello', gen_config=GenerationConfig(
        max_new_tokens=100000, ignore_eos=True))))
    worker.start()
    deadline = time.monotonic() + 60
    while not p.loop.call(lambda engine: engine.has_work) and time.monotonic() < deadline:   # it is running
        time.sleep(0.05)
    time.sleep(0.3)                                        # a few decode steps
    p.close()
    worker.join(timeout=30)
    assert not worker.is_alive() and got['r'].finish_reason == 'abort' and got['r'].generate_token_len > 0
    for call in (lambda: p('hello'), p.stats):
        with pytest.raises(RuntimeError, match='closed'):
            call()
    p.close()                                              # idempotent


@pytest.mark.parametrize('fields, name', [
    (dict(random_seed=2 ** 64), 'random_seed'), (dict(random_seed=-2 ** 63 - 1), 'random_seed'),
    (dict(temperature=float('inf')), 'temperature'), (dict(repetition_penalty=float('nan')), 'repetition_penalty'),
    (dict(top_k=2 ** 70), 'top_k'), (dict(stop_token_ids=[-1]), 'stop_token_ids'),
    (dict(logprobs=True), 'logprobs'), (dict(max_new_tokens=True), 'max_new_tokens'),
])
def test_generation_config_out_of_range_names_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        GenerationConfig(**fields)
    cfg = GenerationConfig()
    with pytest.raises(ValueError, match=name):                # assignment is validated too
        setattr(cfg, name, next(iter(fields.values())))


def test_config_dicts_and_ids_outside_the_vocabulary(pipe, reference):
    """``gen_config`` as a dict of fields works like the model; a stop token id outside the
    vocabulary is refused naming the field; the pipeline keeps serving."""
    ids = pipe.tokenizer.encode(PROMPT)
    got = pipe(ids, gen_config=dict(max_new_tokens=16, ignore_eos=True), do_preprocess=False)
    assert got.token_ids == reference(ids)
    with pytest.raises(ValueError, match='stop_token_ids'):
        pipe(PROMPT, gen_config=GenerationConfig(stop_token_ids=[10 ** 9]))
    with pytest.raises(ValueError, match='gen_config'):
        pipe(PROMPT, gen_config=[('max_new_tokens', 2)])
    assert pipe(ids, gen_config=GREEDY, do_preprocess=False).token_ids == reference(ids)
    assert_idle(pipe)


def test_abandoned_stream_and_cancelled_async_generator_free_every_block(pipe):
    long_cfg = GenerationConfig(max_new_tokens=200, ignore_eos=True)
    stream = pipe.stream_infer([PROMPT, random_prompt(100, seed=3)], long_cfg)
    first = next(stream)
    assert first.finish_reason is None
    stream.close()                                    # the consumer walks away mid-decode
    assert_idle(pipe)

    async def cancel_after_two():
        agen = pipe.generate(PROMPT, long_cfg)
        got = [await agen.__anext__(), await agen.__anext__()]
        await agen.aclose()
        return got
    got = asyncio.run(cancel_after_two())
    assert [r.finish_reason for r in got] == [None, None]
    assert_idle(pipe)


def test_lmdeploy_pipeline_stays_the_factory_after_the_implementation_is_imported(tiny_qwen3):
    import lmdeploy
    import lmdeploy.serve.pipeline  # noqa: F401  (importing the implementation must not shadow the factory)
    assert callable(lmdeploy.pipeline) and lmdeploy.pipeline.__module__ == 'lmdeploy'
    cfg = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=16, block_size=16)
    for _ in range(2):                      # the second call used to find a module, not the function
        with lmdeploy.pipeline(tiny_qwen3, backend_config=cfg) as pipe:
            assert pipe('hello', gen_config=GenerationConfig(max_new_tokens=2, ignore_eos=True)).generate_token_len == 2


def test_chat_keeps_the_history_and_reuses_its_prefix(tiny_qwen3_next):
    cfg = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=128, block_size=16, prefill_save_alignment=64,
                              enable_prefix_caching=True, prefill_save_last_only=True)
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with pipeline(tiny_qwen3_next, backend_config=cfg) as pipe:
        session = pipe.chat('Summarise the build log. ' * 12, system='You are a coding agent.', gen_config=gen)
        first = session.response
        session = pipe.chat('Now fix the failing test.', session, gen_config=gen)
        assert [m['role'] for m in session.messages] == ['system', 'user', 'assistant', 'user', 'assistant']
        assert session.messages[2]['content'] == first.text
        assert first.cached_tokens == 0 and session.response.cached_tokens > 0
        stats = pipe.stats()        # the engine's counters, read on its thread
        assert stats['prefix_cache_hit_tokens'] == session.response.cached_tokens
        assert stats['checkpoints_saved'] >= 1
        # the same turn as one stateless call gives the same reply
        again = pipe(session.messages[:-1], gen_config=gen)
        assert again.text == session.response.text


_THREADED_BUILD = '''
import sys, threading
from lmdeploy import PytorchEngineConfig
from lmdeploy.serve.pipeline import Pipeline
errors, pipes = [], []
def build():
    try:
        pipes.append(Pipeline(sys.argv[1], PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=8,
                                                               block_size=16)))
    except Exception as err:
        errors.append(repr(err))
threads = [threading.Thread(target=build) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(pipes), errors)
for p in pipes:
    p.close()
'''


def test_pipelines_built_from_two_threads_at_once_both_load(tiny_qwen3):
    """In a fresh interpreter (transformers not yet imported), two threads build a pipeline
    at once: both succeed (before: transformers' lazy imports raced, ImportError)."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, '-c', _THREADED_BUILD, tiny_qwen3], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=repo))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == '2 []', out.stdout + out.stderr[-3000:]
