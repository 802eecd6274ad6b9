"""Multimodal spans and keys: no chunk end or save point inside an image's tokens (nor inside
it shifted by the lookahead ℓ), and image identity in every block hash from the image onward
(docs/en/advance/prefix_caching.md, "Images").

Geometry: B = 16 tokens per block, A = 64, P = 128 tokens per prefill chunk.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.multimodal import MultimodalInput, block_extra_keys
from lmdeploy.pytorch.paging.prefill_plan import is_chunk_end_allowed, plain_chunk_ends, plan_prefill
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes

B, A, P = 16, 64, 128
GEN = GenerationConfig(max_new_tokens=4, ignore_eos=True)


def splits(b: int, la: int, spans) -> bool:
    """The boundary rule, written out: ``b`` is strictly inside a span, or ``b + ℓ`` is."""
    return any(s < b < e or s < b + la < e for s, e in spans)


# ---------------------------------------------------------------- plans: exhaustive grid
def _edge_spans(n: int):
    """Spans whose start and end each sit at A-1, A or A+1 around every multiple of A below n
    (and short spans at those points), so every candidate boundary is straddled."""
    points = sorted({k * A + d for k in range(1, n // A + 1) for d in (-1, 0, 1)} | {0, 1})
    points = [p for p in points if 0 <= p <= n]
    for s, e in itertools.combinations(points, 2):
        yield ((s, e),)
    for s in points:                  # two images back to back, and a one-token image
        if s + 2 <= n:
            yield ((s, s + 1), (s + 1, s + 2))


@pytest.mark.parametrize('n', [130, 193, 257])
@pytest.mark.parametrize('la', [0, 1])
def test_no_save_or_chunk_end_inside_a_span_at_any_candidate_boundary(n, la):
    checked = 0
    for spans in _edge_spans(n):
        for chunk, last_only in itertools.product((A - 1, A, A + 1, 2 * A, P), (False, True)):
            for cached in (0, A):
                if cached >= n or splits(cached, la, spans):
                    continue          # a restore only ever lands on a reusable boundary
                plan = plan_prefill(n, cached, chunk, B, A, last_only, la, 0, spans)
                for end in plan.chunk_ends[:-1]:
                    assert not splits(end, la, spans), (spans, chunk, last_only, cached, plan)
                for b in plan.save_points:
                    assert not splits(b, la, spans) and b % A == 0
                assert plan.chunk_ends[-1] == n
                checked += 1
    assert checked > 400         # the grid is not vacuous


def test_chunk_end_moves_to_the_span_start_edge():
    # budget end 128 falls inside the image [100, 150): the chunk stops at its start edge
    assert plain_chunk_ends(0, 300, P, 0, ((100, 150),)) == [100, 228, 300]
    # with ℓ = 1 the forward ending at 100 would read token 100: stop at 99
    assert plain_chunk_ends(0, 300, P, 1, ((100, 150),)) == [99, 227, 300]
    # an image longer than the budget, starting at the chunk start: one longer forward, never split
    assert plain_chunk_ends(0, 300, P, 0, ((0, 200),)) == [200, 300]
    assert plan_prefill(300, 0, P, B, A, False, 0, 0, ((0, 200),)).chunk_ends == [200, 256, 300]
    # back-to-back images with ℓ = 1: 150 would make the forward read into the second one
    assert plain_chunk_ends(0, 300, 160, 1, ((100, 150), (150, 170))) == [99, 259, 300]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 400), la=st.integers(0, 2), chunk=st.integers(1, 200),
       starts=st.lists(st.integers(0, 399), max_size=3), lens=st.lists(st.integers(1, 150), min_size=3, max_size=3))
def test_plain_chunks_never_split_a_span(n, la, chunk, starts, lens):
    spans = tuple((s, min(n, s + ln)) for s, ln in zip(starts, lens) if s < n and s + 1 <= min(n, s + ln))
    ends = plain_chunk_ends(0, n, chunk, la, spans)
    assert ends[-1] == n and ends == sorted(set(ends))
    h = 0
    for end in ends:
        assert is_chunk_end_allowed(end, n, la, spans) and not (end < n and splits(end, la, spans))
        if end - h > chunk:            # longer than the budget only when nothing within it is allowed
            assert not any(is_chunk_end_allowed(b, n, la, spans) for b in range(h + 1, h + chunk + 1))
        h = end


# ---------------------------------------------------------------- keys
def image(start: int, end: int, tag: bytes) -> MultimodalInput:
    return MultimodalInput(start, end, tag.ljust(16, b'.'))


def test_image_hash_enters_every_block_hash_from_the_span_onward():
    ids = prompt(160, 1)
    base = chain_block_hashes(ids, B)
    a = chain_block_hashes(ids, B, extra_keys=block_extra_keys([image(40, 90, b'cat')], 10, B))
    b = chain_block_hashes(ids, B, extra_keys=block_extra_keys([image(40, 90, b'dog')], 10, B))
    a2 = chain_block_hashes(ids, B, extra_keys=block_extra_keys([image(40, 90, b'cat')], 10, B))
    first = 40 // B
    assert a[:first] == b[:first] == base[:first]                # before the image: shared
    assert all(x != y for x, y in zip(a[first:], b[first:]))     # from its block on: never
    assert all(x != y for x, y in zip(a[first:], base[first:]))
    assert a == a2                                               # the same image: the same keys
    # the same image at another offset is another prompt
    assert chain_block_hashes(ids, B, extra_keys=block_extra_keys([image(41, 90, b'cat')], 10, B)) != a
    assert block_extra_keys([image(200, 210, b'x')], 10, B) is None


def test_multimodal_input_validates_its_span():
    with pytest.raises(ValueError, match='start < end'):
        MultimodalInput(5, 5, b'h' * 16)
    with pytest.raises(ValueError, match='content_hash'):
        MultimodalInput(0, 5, b'')


# ---------------------------------------------------------------- engine (tiny Qwen3-Next)
def engine(path: str, **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A,
               max_prefill_token_num=P, enable_prefix_caching=True, num_gpu_blocks=256,
               num_checkpoint_slots=16, max_batch_size=8)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def run_recording_chunks(eng: Engine, ids, **kwargs):
    """Generate and return (sequence, the (start, end) of every forward it was in)."""
    seq = eng.add_request(ids, GEN, **kwargs)
    chunks = []
    while not seq.is_finished:
        sched_before = eng.scheduler.schedule
        def schedule():
            out = sched_before()
            chunks.extend((c.start, c.end) for c in out.chunks if c.seq is seq)
            return out
        eng.scheduler.schedule = schedule
        eng.step()
        eng.scheduler.schedule = sched_before
    return seq, chunks


@pytest.mark.parametrize('caching', [True, False])
def test_engine_chunk_ends_land_on_span_edges(tiny_qwen3_next, caching):
    eng = engine(tiny_qwen3_next, enable_prefix_caching=caching)
    ids = prompt(300, 3)
    seq, chunks = run_recording_chunks(eng, ids, multimodal=(image(100, 150, b'cat'), image(240, 262, b'dog')))
    prefill_ends = [e for s, e in chunks if e <= len(ids)]
    # 128 and 256 split an image, so the ends move down to the reusable 64 and 192, with caching
    # on (where they are saved) and off alike: the chunk grid depends on the prompt alone
    assert prefill_ends == [64, 192, 300]
    assert not any(splits(e, 0, seq.multimodal_spans) for e in prefill_ends)
    assert seq.stats.save_points == ([64, 192] if caching else [])


def test_same_text_different_image_never_hits_past_the_image_start(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    ids = prompt(200, 4)
    first = eng.generate(ids, GEN, multimodal=(image(80, 140, b'cat'),))
    assert first.stats.save_points == [64, 192]
    dog = (image(80, 140, b'dog'),)
    other = eng.requests.sequence(eng.requests.check(ids, GEN, multimodal=dog))
    # blocks match up to the image's block (80 tokens), never past it
    assert len(eng.prefix_cache.local.trie.match(ids, eng.prefix_cache.hashes(other))) == 80 // B
    other = eng.generate(ids, GEN, multimodal=dog)
    assert other.num_cached_tokens == 64                  # the last checkpoint before the image
    same = eng.generate(ids, GEN, multimodal=(image(80, 140, b'cat'),))
    assert same.num_cached_tokens == 192


def test_store_keys_carry_the_image_from_its_block_on(tiny_qwen3_next):
    # Store keys are built from the same chained hashes: equal below the image's block, different
    # from it on (for another image), equal again for the same image
    from lmdeploy.pytorch.store.object_format import object_key
    eng = engine(tiny_qwen3_next)
    ids = prompt(200, 4)
    keys = {}
    for tag in (b'cat', b'dog', b'cat2'):
        seq = eng.requests.sequence(eng.requests.check(ids, GEN, multimodal=(image(80, 140, tag[:3]),)))
        keys[tag] = [object_key('ab' * 16, 'state', h.hex()) for h in eng.prefix_cache.hashes(seq)]
    first = 80 // B
    assert keys[b'cat'][:first] == keys[b'dog'][:first]
    assert not set(keys[b'cat'][first:]) & set(keys[b'dog'][first:])
    assert keys[b'cat'] == keys[b'cat2']


@pytest.mark.parametrize('last_only', [False, True])
def test_incremental_multimodal_agent_turn_hits(tiny_qwen3_next, last_only):
    # turn 2 repeats turn 1 (same image) and its reply, then appends text: it restores turn 1's
    # deepest checkpoint (both policies save at the last reusable boundary of turn 1)
    eng = engine(tiny_qwen3_next, prefill_save_last_only=last_only)
    turn1 = prompt(150, 5)
    img = image(20, 100, b'cat')
    seq1 = eng.generate(turn1, GEN, multimodal=(img,))
    assert seq1.stats.save_points == [128]
    turn2 = turn1 + seq1.output_ids + prompt(60, 6)
    seq2 = eng.generate(turn2, GEN, multimodal=(img,))
    assert seq2.num_cached_tokens == 128
    # the same conversation about another image restores nothing past the image's block
    seq3 = eng.generate(turn2, GEN, multimodal=(image(20, 100, b'dog'),))
    assert seq3.num_cached_tokens == 0


def test_check_image_spans_accepts_a_well_placed_image_and_names_each_fault():
    """The image-span check both vision-language families (Qwen3.5, GLM-5.3-Flash) call."""
    import torch

    from lmdeploy.pytorch.models.blocks.vision import check_image_spans
    from lmdeploy.pytorch.multimodal import MultimodalInput

    img = 9
    data = {'pixel_values': torch.zeros(16, 4), 'image_grid_thw': torch.tensor([[1, 4, 4]])}  # 1*2*2 = 4 tokens
    ids = [1, 2, img, img, img, img, 3]
    check_image_spans(ids, [MultimodalInput(2, 6, b'h', data)], img, merge=2)
    check_image_spans(ids, [MultimodalInput(0, 3, b'h', None)], img, merge=2)     # no data: skipped
    cases = [(MultimodalInput(2, 6, b'h', data, modality='video'), 'only images are supported'),
             (MultimodalInput(2, 6, b'h', {'pixel_values': data['pixel_values']}), 'pixel_values and image_grid_thw'),
             (MultimodalInput(2, 5, b'h', data), 'span of 3 tokens, the image has 4'),
             (MultimodalInput(1, 5, b'h', data), r'span \[1, 5\) must hold only the image token 9')]
    for mm, message in cases:
        with pytest.raises(ValueError, match=message):
            check_image_spans(ids, [mm], img, merge=2)
