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


# logprobs ``bytes`` ------------------------------------------------------------------------------------------
TEXT = 'héllo 世界 🌍 ok'


def _joined(texts, ids):
    return bytes(b for i in ids for b in texts.raw_bytes(i))


def test_byte_level_token_bytes_rebuild_multibyte_text(tokenizer):
    """Byte-level BPE (the tiny models' Qwen-style tokenizer): each token's bytes are its raw
    bytes, so tokens that split a character still concatenate to the text's UTF-8 bytes."""
    from lmdeploy.serve.openai.chat_output import TokenTexts
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(texts(i) == '\ufffd' for i in ids)                 # some tokens hold part of a character
    assert _joined(texts, ids) == TEXT.encode()
    assert texts.raw_bytes(2) == list(b'<|im_end|>')              # special tokens: their text
    every = range(len(tokenizer))
    assert all(bytes(texts.raw_bytes(i)).decode('utf-8', 'replace') == texts(i) for i in every)


def test_byte_fallback_token_bytes_rebuild_multibyte_text():
    """A sentencepiece-style tokenizer with ``<0xNN>`` byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from lmdeploy.serve.openai.chat_output import TokenTexts
    vocab = {'<unk>': 0, '<s>': 1, '</s>': 2, **{f'<0x{b:02X}>': 3 + b for b in range(256)}}
    for piece in ('▁h', 'é', 'llo', '▁ok', '▁', 'l', 'o', 'h'):
        vocab.setdefault(piece, len(vocab))
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token='<unk>', byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
    model.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(' ', 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token='<unk>', bos_token='<s>', eos_token='</s>')
    texts = TokenTexts(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert '<0xF0>' in tok.convert_ids_to_tokens(ids) and tok.decode(ids) == TEXT
    assert texts.raw_bytes(vocab['<0xE4>']) == [0xE4] and texts(vocab['<0xE4>']) == '\ufffd'
    # sentencepiece adds a leading '▁' to the text; its bytes are a space the decoded text strips
    assert _joined(texts, ids) == b' ' + TEXT.encode()


def test_unknown_vocabularies_keep_the_decoded_text():
    from lmdeploy.serve.openai.chat_output import TokenTexts

    class Plain:
        added_tokens_decoder = {}

        def decode(self, ids, skip_special_tokens=False):
            return {5: 'é', 6: '<0xE4>'}[ids[0]]

        def convert_ids_to_tokens(self, i):
            return {5: 'Ã©', 6: 'x'}[i]
    texts = TokenTexts(Plain())
    assert texts.raw_bytes(5) == list('é'.encode()) and texts.raw_bytes(6) == list(b'<0xE4>')


def _first_completed_cut(text: str, words: list[str]) -> str:
    """Reference: generate ``text`` one character at a time and stop at the first stop string
    that is complete (of several completing at once, the longest); cut before it."""
    for end in range(1, len(text) + 1):
        done = [w for w in words if w and text[:end].endswith(w)]
        if done:
            return text[:end - len(max(done, key=len))]
    return text


@pytest.mark.parametrize('seed', range(40))
def test_overlapping_stop_strings_cut_where_the_first_completed_one_starts(tokenizer, seed):
    """Any list order and any token chunking: the cut equals the character-by-character
    reference, including stop strings that overlap or contain one another."""
    rng = random.Random(seed)
    text = ''.join(rng.choice(['ab', 'ba', 'abc', ' ', 'cab', 'é', 'x']) for _ in range(25))
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    words = []
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(full))
        words.append(full[i:i + rng.randint(1, 6)])
    if rng.random() < 0.3:
        words.append('never-in-text')
    expected = _first_completed_cut(full, words)
    for order in (words, words[::-1], rng.sample(words, len(words))):
        streamed, detok = _stream(tokenizer, ids, order, rng)
        assert streamed == expected, (words, order)
        assert detok.stopped


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize('seed', range(15))
def test_completion_text_offsets_index_the_decoded_text(tokenizer, seed):
    """``text_offset`` of each generated token = the characters of the whole decoded output
    (special tokens skipped) that precede it, also when tokens split a multi-byte character
    or leave bytes that never form one, and when the offsets run across stream chunks: the
    decoded prefix before token i equals the text up to its offset, but for a character still
    incomplete there."""
    from types import SimpleNamespace

    from lmdeploy.serve.openai.chat_output import TextOffsets, TokenTexts, completion_logprobs
    rng = random.Random(seed)
    text = ''.join(rng.choice(['héllo ', '世界', '🌍', ' ok', 'ȥ', '\n']) for _ in range(12))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(3):                                 # special tokens the text skips
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(tokenizer.all_special_ids))
    for _ in range(8):                                 # any vocabulary entry: lone or invalid UTF-8 bytes too
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(len(tokenizer)))
    texts = TokenTexts(tokenizer)
    assert any(texts(i) == '\ufffd' for i in ids)      # some tokens hold part of a character
    full = tokenizer.decode(ids, skip_special_tokens=True)
    lps = [SimpleNamespace(token_id=i, logprob=-1.0, top=[]) for i in ids]
    offsets, got, i = TextOffsets(texts), [], 0
    while i < len(lps):                                # stream chunks of 1-4 tokens
        step = rng.randint(1, 4)
        got += completion_logprobs(texts, lps[i:i + step], 0, offsets)['text_offset']
        i += step
    assert got == sorted(got) and got[-1] <= len(full)
    for k, off in enumerate(got):
        before = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not before.endswith('\ufffd'):             # a clean character boundary before token k
            assert off == len(before) and full.startswith(before), (k, off)
        else:   # bytes held at the boundary: the token starts at their character or after it
            assert len(before.rstrip('\ufffd')) <= off <= _common_prefix(full, before), (k, off)
    assert got == completion_logprobs(texts, lps, 0)['text_offset']
