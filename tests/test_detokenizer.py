"""Incremental detokenization equals decoding the whole output at once, for any chunking."""
import random

import pytest
from transformers import AutoTokenizer

from lmdeploy.serve.pipeline import _Detokenizer


@pytest.fixture(scope='module')
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(tiny_qwen3, local_files_only=True)


def _stream(tokenizer, ids, stop_words, rng):
    detok, out, i = _Detokenizer(tokenizer, stop_words), [], 0
    while i < len(ids):
        step = rng.randint(1, 3)
        final = i + step >= len(ids)
        out.append(detok.add(ids[i:i + step], final))
        i += step
        if detok.stopped:
            break
    return ''.join(out), detok


@pytest.mark.parametrize('seed', range(20))
def test_streamed_text_equals_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    # byte-level tokens, including ones that end in the middle of a multi-byte character
    text = ''.join(rng.choice(['hello ', 'wörld ', '数据 ', '🙂', ' x=1;', '\n', 'tests ']) for _ in range(30))
    ids = tokenizer.encode(text, add_special_tokens=False) + [rng.randrange(3, 1024) for _ in range(20)]
    streamed, _ = _stream(tokenizer, ids, [], rng)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize('seed', range(10))
def test_stop_string_cuts_the_text_before_its_first_occurrence(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode('first part; then stop here, then more text stop here', add_special_tokens=False)
    streamed, detok = _stream(tokenizer, ids, ['stop here', 'never'], rng)
    assert detok.stopped and streamed == 'first part; then '
