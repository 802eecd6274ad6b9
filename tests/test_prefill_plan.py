"""Reusable boundaries, chunk plans and save points (docs/en/advance/prefix_caching.md)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy.pytorch.paging.prefill_plan import (PrefillPlan, ReuseRules, is_reusable, last_reusable, next_chunk_end,
                                                  num_remaining_chunks, plain_chunk_ends, plan_prefill, prefill_grid,
                                                  shared_head_boundary, with_junction, with_last_block_end)

B, A, P = 64, 1024, 8192
K = 1024


# ---------------------------------------------------------------- examples of "Which boundaries are reusable"
@pytest.mark.parametrize('n, lookahead, recompute, spans, expected', [
    (2049, 0, 1, (), 1024),                # 2048 fails rule 3: 2048 + 64 > floor_64(2048)
    (2049, 1, 0, (), 2048),
    (1024, 0, 0, (), None),                # rule 2: b <= 1023
    (3000, 0, 0, ((1000, 1100),), 2048),
    (2100, 0, 0, ((2000, 2100),), 1024),   # span covers 2048
])
def test_last_reusable_matches_spec_examples(n, lookahead, recompute, spans, expected):
    assert last_reusable(n, B, A, lookahead, recompute, spans) == expected


def test_rule2_needs_one_token_of_suffix():
    assert last_reusable(2048, B, A) == 1024
    assert last_reusable(2049, B, A) == 2048
    assert not is_reusable(2048, 2048, B, A)
    assert is_reusable(2048, 2049, B, A)


def test_lookahead_needs_its_tokens_after_boundary():
    assert last_reusable(2050, B, A, token_lookahead=2) == 2048
    assert last_reusable(2049, B, A, token_lookahead=2) == 1024


def test_rule3_recompute_blocks_need_full_blocks_after_boundary():
    # floor_64(n - 1) must reach 2048 + r * 64
    assert last_reusable(2048 + 64 + 1, B, A, recompute_blocks=1) == 2048
    assert last_reusable(2048 + 64, B, A, recompute_blocks=1) == 1024
    assert last_reusable(2048 + 128 + 1, B, A, recompute_blocks=2) == 2048


def test_span_covering_boundary_moves_back_by_whole_alignments():
    assert last_reusable(5000, B, A, multimodal_spans=[(3000, 4500)]) == 2048
    assert last_reusable(5000, B, A, multimodal_spans=[(1, 4500)]) is None
    assert last_reusable(5000, B, A, multimodal_spans=[(3000, 4500), (1500, 2100)]) == 1024


def test_span_starting_at_boundary_is_legal_without_lookahead_only():
    spans = [(2048, 2100)]
    assert is_reusable(2048, 3000, B, A, 0, 0, spans)
    assert last_reusable(3000, B, A, 0, 0, spans) == 2048
    # with ℓ = 1 the chunk ending at 2048 reads token 2048, inside the span: s < b + ℓ < e
    assert not is_reusable(2048, 3000, B, A, 1, 0, spans)
    assert last_reusable(3000, B, A, 1, 0, spans) == 1024


def test_span_ending_at_boundary_is_legal():
    assert is_reusable(2048, 3000, B, A, 0, 0, [(2000, 2048)])
    assert is_reusable(2048, 3000, B, A, 1, 0, [(2000, 2048)])


def test_unaligned_or_nonpositive_boundary_is_not_reusable():
    assert not is_reusable(0, 5000, B, A)
    assert not is_reusable(1088, 5000, B, A)
    assert not is_reusable(-1024, 5000, B, A)


# ---------------------------------------------------------------- examples of "Save policies"
def test_16k_plus_64_default_saves_every_aligned_chunk_end():
    plan = plan_prefill(16 * K + 64, 0, P, B, A, last_only=False)
    assert plan.chunk_ends == [8192, 16384, 16448]
    assert plan.save_points == [8192, 16384]
    assert plan.num_chunks == 3


def test_16k_plus_64_last_only_saves_once():
    plan = plan_prefill(16 * K + 64, 0, P, B, A, last_only=True)
    assert plan.chunk_ends == [8192, 16384, 16448]
    assert plan.save_points == [16384]


def test_2049_recompute_one_block_last_only_saves_at_1024():
    plan = plan_prefill(2049, 0, P, B, A, last_only=True, recompute_blocks=1)
    assert plan.chunk_ends == [1024, 2049]
    assert plan.save_points == [1024]
    assert plan_prefill(2049, 0, P, B, A, last_only=False, recompute_blocks=1).save_points == [1024]


def test_2049_lookahead_one_saves_at_2048():
    plan = plan_prefill(2049, 0, P, B, A, last_only=True, token_lookahead=1)
    assert plan.chunk_ends == [2048, 2049]
    assert plan.save_points == [2048]


@pytest.mark.parametrize('cached', [16384, 16400, 16447])
def test_hit_at_or_beyond_last_reusable_has_no_save_point(cached):
    for last_only in (False, True):
        plan = plan_prefill(16 * K + 64, cached, P, B, A, last_only)
        assert plan.save_points == []
        assert plan.chunk_ends == [16448]
        assert plan.chunk_starts == [cached]


def test_no_reusable_boundary_gives_plain_chunks():
    for last_only in (False, True):
        plan = plan_prefill(1000, 0, 300, B, A, last_only)
        assert plan.chunk_ends == [300, 600, 900, 1000]
        assert plan.save_points == []


def test_last_only_cuts_the_chunk_crossing_target():
    # b* = 9216; chunks 0-8192, 8192-9216 (cut), 9216-10000
    plan = plan_prefill(10000, 0, P, B, A, last_only=True)
    assert plan.chunk_ends == [8192, 9216, 10000]
    assert plan.save_points == [9216]
    # default moves every chunk end to an aligned boundary
    plan = plan_prefill(10000, 0, P, B, A, last_only=False)
    assert plan.chunk_ends == [8192, 9216, 10000]
    assert plan.save_points == [8192, 9216]


def test_last_only_chunks_follow_the_default_grid():
    # last-only ends its forwards where the default policy does (the grid is a function of the
    # prompt alone, so both policies compute the same numbers); it saves only at b* = 4096
    plan = plan_prefill(5000, 100, 1500, B, A, last_only=True)
    assert plan.chunk_ends == [1024, 2048, 3072, 4096, 5000]
    assert plan.save_points == [4096]
    plan = plan_prefill(5000, 100, 1500, B, A, last_only=False)
    assert plan.chunk_ends == [1024, 2048, 3072, 4096, 5000]
    assert plan.save_points == [1024, 2048, 3072, 4096]


def test_default_span_moves_chunk_end_back():
    plan = plan_prefill(5000, 0, P, B, A, last_only=False, multimodal_spans=[(3000, 4500)])
    assert plan.chunk_ends == [2048, 5000]
    assert plan.save_points == [2048]


# ---------------------------------------------------------------- seed-table scenarios
@pytest.mark.parametrize('n, cached, default, last', [
    (8 * K + 64, 0, [8192], [8192]),
    (16 * K + 64, 0, [8192, 16384], [16384]),
    (32 * K + 64, 0, [8192, 16384, 24576, 32768], [32768]),
    (64 * K + 64, 0, [8192 * i for i in range(1, 9)], [65536]),
    (36 * K + 64, 32 * K, [36864], [36864]),           # next turn, 4K longer
    (48 * K + 64, 32 * K, [40960, 49152], [49152]),    # next turn, 16K longer
])
def test_seed_table_save_points(n, cached, default, last):
    assert plan_prefill(n, cached, P, B, A, last_only=False).save_points == default
    assert plan_prefill(n, cached, P, B, A, last_only=True).save_points == last


def test_remaining_chunks_and_next_end():
    plan = plan_prefill(16 * K + 64, 0, P, B, A, last_only=True)
    assert [num_remaining_chunks(plan, x) for x in (0, 8191, 8192, 16384, 16448)] == [3, 3, 2, 1, 0]
    assert [next_chunk_end(plan, x) for x in (0, 8192, 16400, 16448)] == [8192, 16384, 16448, None]
    assert plan.is_save_point(16384) and not plan.is_save_point(8192)
    assert plan.num_tokens == 16448


def test_plan_compares_equal_to_lists():
    assert plan_prefill(2049, 0, P, B, A, True) == PrefillPlan([2048, 2049], [2048], 0)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize('kwargs, name', [
    (dict(num_tokens=0), 'num_tokens'),
    (dict(cached_tokens=-1), 'cached_tokens'),
    (dict(cached_tokens=100), 'cached_tokens'),
    (dict(chunk_size=0), 'chunk_size'),
    (dict(block_size=0), 'block_size'),
    (dict(alignment=96), 'alignment'),
    (dict(alignment=0), 'alignment'),
    (dict(token_lookahead=-1), 'token_lookahead'),
    (dict(recompute_blocks=-1), 'recompute_blocks'),
    (dict(multimodal_spans=[(5, 5)]), 'multimodal_spans'),
    (dict(multimodal_spans=[(-1, 5)]), 'multimodal_spans'),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    args = dict(num_tokens=100, cached_tokens=0, chunk_size=10, block_size=64, alignment=128,
                last_only=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        plan_prefill(**args)


def test_last_reusable_validates_alignment():
    with pytest.raises(ValueError, match='alignment'):
        last_reusable(5000, 64, 100)


# ---------------------------------------------------------------- properties
def brute_reusable(b, n, bs, al, la, r, spans):
    floor_b = (n - 1) // bs * bs
    return (b > 0 and b % al == 0 and b <= n - max(1, la) and b + r * bs <= floor_b
            and not any(s < b < e or s < b + la < e for s, e in spans))


def brute_end_allowed(b, n, la, spans):
    return b == n or not any(s < b < e or s < b + la < e for s, e in spans)


def brute_chunk_end(start, budget_end, n, la, spans):
    """The largest end in (start, budget_end] splitting no span, else the smallest one above."""
    inside = [b for b in range(start + 1, budget_end + 1) if brute_end_allowed(b, n, la, spans)]
    if inside:
        return max(inside)
    return min(b for b in range(budget_end + 1, n + 1) if brute_end_allowed(b, n, la, spans))


def brute_last_reusable(n, bs, al, la, r, spans):
    found = [b for b in range(1, n + 1) if brute_reusable(b, n, bs, al, la, r, spans)]
    return max(found) if found else None


@st.composite
def plan_args(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16, 64]))
    al = bs * draw(st.integers(1, 8))
    n = draw(st.integers(1, 12 * al + 7))
    c = draw(st.integers(0, n - 1))
    chunk = draw(st.integers(1, 4 * al))
    la = draw(st.integers(0, 3))
    r = draw(st.integers(0, 3))
    spans = []
    for _ in range(draw(st.integers(0, 3))):
        s = draw(st.integers(0, n))
        spans.append((s, s + draw(st.integers(1, 2 * al))))
    return n, c, chunk, bs, al, la, r, tuple(spans)


@settings(max_examples=300, deadline=None)
@given(plan_args())
def test_last_reusable_agrees_with_brute_force(args):
    n, _, _, bs, al, la, r, spans = args
    expected = brute_last_reusable(n, bs, al, la, r, spans)
    assert last_reusable(n, bs, al, la, r, spans) == expected
    if expected is not None:
        assert is_reusable(expected, n, bs, al, la, r, spans)


@settings(max_examples=300, deadline=None)
@given(plan_args(), st.booleans())
def test_plan_invariants(args, last_only):
    n, c, chunk, bs, al, la, r, spans = args
    plan = plan_prefill(n, c, chunk, bs, al, last_only, la, r, spans)
    starts = [c] + plan.chunk_ends[:-1]
    assert plan.chunk_ends[-1] == n
    assert plan.chunk_starts == starts
    assert all(end > start for start, end in zip(starts, plan.chunk_ends))
    for start, end in zip(starts, plan.chunk_ends):
        # within the budget, or the first end that does not split a span when none within it does
        assert end - start <= chunk or (brute_end_allowed(end, n, la, spans) and not any(
            brute_end_allowed(b, n, la, spans) for b in range(start + 1, end)))
    assert all(brute_end_allowed(end, n, la, spans) for end in plan.chunk_ends)
    assert set(plan.save_points) <= set(plan.chunk_ends)
    assert plan.save_points == sorted(plan.save_points)
    for b in plan.save_points:
        assert b > c and brute_reusable(b, n, bs, al, la, r, spans)
    target = brute_last_reusable(n, bs, al, la, r, spans)
    if last_only:
        assert plan.save_points == ([target] if target is not None and target > c else [])
    else:
        reusable_ends = [e for e in plan.chunk_ends if brute_reusable(e, n, bs, al, la, r, spans)]
        assert plan.save_points == reusable_ends
        # each chunk end is the deepest reusable boundary the budget allows, when there is one
        for start, end in zip(starts, plan.chunk_ends):
            budget_end = min(start + chunk, n)
            inside = [b for b in range(start + 1, budget_end + 1) if brute_reusable(b, n, bs, al, la, r, spans)]
            assert end == (max(inside) if inside else brute_chunk_end(start, budget_end, n, la, spans))
        if target is not None and target > c:
            assert plan.save_points[-1] == target


@settings(max_examples=200, deadline=None)
@given(plan_args())
def test_chunk_ends_are_the_same_grid_under_every_policy(args):
    """The chunk grid is a function of the prompt alone: caching off (prefill_grid from 0) and
    on (either policy, with or without a junction save point that the grid already has), and a
    restore at a grid end continues on the cold grid."""
    n, c, chunk, bs, al, la, r, spans = args
    cold = prefill_grid(n, 0, chunk, bs, al, la, r, spans)
    for last_only in (False, True):
        assert plan_prefill(n, 0, chunk, bs, al, last_only, la, r, spans).chunk_ends == cold
        assert plan_prefill(n, c, chunk, bs, al, last_only, la, r, spans).chunk_ends == \
            prefill_grid(n, c, chunk, bs, al, la, r, spans)
    target = brute_last_reusable(n, bs, al, la, r, spans)
    assert target is None or target in cold          # last-only's save point is a grid end
    for g in cold[:-1][-3:]:                         # a restore at a grid end: the rest of the cold grid
        last_only = g % 2 == 0
        assert plan_prefill(n, g, chunk, bs, al, last_only, la, r, spans).chunk_ends == [e for e in cold if e > g]


@st.composite
def head_plan_args(draw):
    n, c, chunk, bs, al, la, r, spans = draw(plan_args())
    head = draw(st.integers(0, n + al))
    return n, c, chunk, bs, al, la, r, spans, head


@settings(max_examples=200, deadline=None)
@given(head_plan_args(), st.booleans())
def test_shared_head_save_point_is_reusable_and_within_the_head(args, last_only):
    n, c, chunk, bs, al, la, r, spans, head = args
    plan = plan_prefill(n, c, chunk, bs, al, last_only, la, r, spans, shared_head_tokens=head)
    wanted = max((b for b in range(1, min(head, n) + 1) if brute_reusable(b, n, bs, al, la, r, spans)), default=None)
    assert shared_head_boundary(head, n, bs, al, la, r, spans) == wanted
    # the chunk ends are the grid with the head, the same under both policies and with caching off
    assert plan.chunk_ends == prefill_grid(n, c, chunk, bs, al, la, r, spans, shared_head_tokens=head)
    assert plan.chunk_ends == plan_prefill(n, c, chunk, bs, al, not last_only, la, r, spans, head).chunk_ends
    assert all(end - start <= chunk or brute_end_allowed(end, n, la, spans) and not any(
        brute_end_allowed(b, n, la, spans) for b in range(start + 1, end))
        for start, end in zip(plan.chunk_starts, plan.chunk_ends))
    assert set(plan.save_points) <= set(plan.chunk_ends)
    if wanted is not None and wanted > c:
        assert plan.shared_head == wanted and wanted in plan.save_points and wanted <= head
        assert brute_reusable(plan.shared_head, n, bs, al, la, r, spans)
    else:   # no head boundary, or the cache hit already reaches it: no head save point
        assert plan.shared_head is None
        assert plan.save_points == plan_prefill(n, c, chunk, bs, al, last_only, la, r, spans).save_points
    target = brute_last_reusable(n, bs, al, la, r, spans)
    if last_only:
        assert plan.save_points == sorted({b for b in (target, wanted) if b is not None and b > c})
    # a second session sharing the head restores at the head's boundary: it continues on the grid
    if wanted is not None and wanted > 0:
        cold = prefill_grid(n, 0, chunk, bs, al, la, r, spans, shared_head_tokens=head)
        assert wanted in cold
        assert plan_prefill(n, wanted, chunk, bs, al, last_only, la, r, spans, head).chunk_ends == \
            [e for e in cold if e > wanted]


# ---------------------------------------------------------------- the shared head's save point
@pytest.mark.parametrize('n, c, chunk, la, r, spans, head, ends, default, last', [
    # Claude Code-shaped: 40,039 tokens, 37,120 shared (boundary 36864), P = 8192
    (40039, 0, P, 0, 0, (), 37120, [8192, 16384, 24576, 32768, 36864, 39936, 40039],
     [8192, 16384, 24576, 32768, 36864, 39936], [36864, 39936]),
    # the second session restored the head: no head save point, the grid continues from 36864
    (40039, 36864, P, 0, 0, (), 37120, [39936, 40039], [39936], [39936]),
    # the head is inside the first chunk
    (16448, 0, P, 0, 0, (), 3000, [2048, 10240, 16384, 16448], [2048, 10240, 16384], [2048, 16384]),
    # the head's boundary is b* itself: one save point under last-only
    (3000, 0, P, 0, 0, (), 2900, [2048, 3000], [2048], [2048]),
    # ℓ = 1: 2048 needs token 2048 after it (rule 2 allows it); r = 1 moves it to 1024
    (2049, 0, P, 1, 0, (), 2048, [2048, 2049], [2048], [2048]),
    (2049, 0, P, 0, 1, (), 2048, [1024, 2049], [1024], [1024]),
    # an image [2000, 2100) covers 2048: the head's boundary moves below it
    (5000, 0, P, 0, 0, ((2000, 2100),), 2500, [1024, 4096, 5000], [1024, 4096], [1024, 4096]),
    # a head shorter than A has no boundary
    (5000, 0, P, 0, 0, (), 1000, [4096, 5000], [4096], [4096]),
    # small chunks: the head's forward ends at 3072, the next starts there
    (5000, 0, 1500, 0, 0, (), 3500, [1024, 2048, 3072, 4096, 5000], [1024, 2048, 3072, 4096], [3072, 4096]),
])
def test_shared_head_examples(n, c, chunk, la, r, spans, head, ends, default, last):
    plans = [plan_prefill(n, c, chunk, B, A, last_only, la, r, spans, shared_head_tokens=head)
             for last_only in (False, True)]
    assert [p.chunk_ends for p in plans] == [ends, ends]
    assert [p.save_points for p in plans] == [default, last]


@pytest.mark.parametrize('head, ends, default, last', [
    (200, [128, 192, 256, 300], [128, 192, 256], [192, 256]),     # head 192 splits the second chunk
    (140, [128, 256, 300], [128, 256], [128, 256]),                # head 128 is already a chunk end
    (None, [128, 256, 300], [128, 256], [256]),
])
def test_shared_head_examples_small_blocks(head, ends, default, last):
    # B = 16, A = 64, P = 128, n = 300
    plans = [plan_prefill(300, 0, 128, 16, 64, last_only, shared_head_tokens=head) for last_only in (False, True)]
    assert [(p.chunk_ends, p.save_points) for p in plans] == [(ends, default), (ends, last)]


def test_shared_head_none_changes_nothing():
    for last_only in (False, True):
        assert plan_prefill(40039, 0, P, B, A, last_only, shared_head_tokens=None) == \
            plan_prefill(40039, 0, P, B, A, last_only)


def test_shared_head_rejects_negative_lengths():
    with pytest.raises(ValueError, match='shared_head_tokens'):
        plan_prefill(5000, 0, P, B, A, True, shared_head_tokens=-1)


def test_junction_and_turn_end_keep_the_shared_head():
    plan = plan_prefill(40039, 0, P, B, A, True, shared_head_tokens=37120)
    assert with_junction(plan, 20480).shared_head == 36864
    assert with_last_block_end(plan, B).shared_head == 36864
    # a junction at the head's boundary adds nothing: it is already a save point
    assert with_junction(plan, 36864) is plan


def test_reuse_rules_plan_and_grid_take_the_head():
    rules = ReuseRules(40039, B, A)
    assert rules.plan(0, P, True, 37120).save_points == [36864, 39936]
    assert rules.grid(0, P, 37120) == [8192, 16384, 24576, 32768, 36864, 39936, 40039]
    assert rules.grid(0, P) == [8192, 16384, 24576, 32768, 39936, 40039]


def test_grid_differs_from_plain_chunks_only_where_a_boundary_moves_an_end():
    # P a multiple of A, no spans: the hybrid grid is the plain one until b* cuts the last chunk
    assert prefill_grid(16448, 0, P, B, A) == plain_chunk_ends(0, 16448, P) == [8192, 16384, 16448]
    assert prefill_grid(10000, 0, P, B, A) == [8192, 9216, 10000] != plain_chunk_ends(0, 10000, P)


@settings(max_examples=300, deadline=None)
@given(plan_args(), st.booleans())
def test_last_block_end_split_keeps_the_plan_invariants(args, last_only):
    """with_last_block_end (decode_save_last) adds floor_B(n) as a chunk end whenever a forward may
    end there (above the cached tokens, below n, ℓ tokens after it, no span split) and changes
    nothing else: the same save points, every other chunk end kept, chunks only shorter."""
    n, c, chunk, bs, al, la, r, spans = args
    plan = plan_prefill(n, c, chunk, bs, al, last_only, la, r, spans)
    cut = with_last_block_end(plan, bs, la, spans)
    t = n // bs * bs
    wanted = c < t < n and t + la <= n and brute_end_allowed(t, n, la, spans)
    assert set(cut.chunk_ends) == set(plan.chunk_ends) | ({t} if wanted else set())
    assert cut.chunk_ends == sorted(set(cut.chunk_ends)) and cut.chunk_ends[-1] == n
    assert (cut.save_points, cut.cached_tokens, cut.junction) == (plan.save_points, plan.cached_tokens, plan.junction)
    assert all(brute_end_allowed(end, n, la, spans) for end in cut.chunk_ends)
    longest = max(b - a for a, b in zip(plan.chunk_starts, plan.chunk_ends))
    assert max(b - a for a, b in zip(cut.chunk_starts, cut.chunk_ends)) <= longest
    if not wanted:
        assert cut is plan
