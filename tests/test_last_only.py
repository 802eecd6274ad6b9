"""``prefill_save_last_only``: one reusable checkpoint per input turn (issue 5).

Geometry: B = 16, A = 64, P = 64, so the default policy saves at every chunk end (several per
turn) while last-only saves once, at ``b* = last_reusable(n)``. Outputs are compared with an
engine with caching off; plans are recomputed with ``plan_prefill``.
"""
from __future__ import annotations

import logging

import pytest

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.prefill_plan import last_reusable, plan_prefill

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)
_REFERENCE: dict[tuple, list[int]] = {}






def engine(path: str, **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A,
               max_prefill_token_num=P, enable_prefix_caching=True, num_gpu_blocks=256,
               num_checkpoint_slots=16, max_batch_size=4)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def reference(path: str, ids: list[int]) -> list[int]:
    """Greedy output with caching off (memoized)."""
    key = (path, tuple(ids))
    if key not in _REFERENCE:
        _REFERENCE[key] = engine(path, enable_prefix_caching=False).generate(ids, GEN).output_ids
    return _REFERENCE[key]


def assert_idle(eng: Engine) -> None:
    led = eng.ledger()
    assert eng.is_idle(), led
    assert led['blocks_free'] + led['blocks_cached'] == led['blocks_total']
    assert led['runtime_slots_free'] == led['runtime_slots_total'] and led['checkpoints_pinned'] == 0


# ------------------------------------------------------------------ the review case
@pytest.mark.parametrize('last_only', [False, True])
def test_recompute_block_moves_the_save_to_a_boundary_a_warm_request_can_use(tiny_qwen3_next, last_only):
    # n = 129, r = 1: a restore at b needs blocks through b + 16 <= floor_16(128) = 128, so
    # b* = 64, not 128; the identical warm request restores it
    ids = prompt(129, 1)
    eng = engine(tiny_qwen3_next, prefill_save_last_only=last_only)
    cold = eng.generate(ids, GEN, recompute_blocks=1, token_lookahead=0)
    warm = eng.generate(ids, GEN, recompute_blocks=1, token_lookahead=0)
    assert cold.stats.plans[0].save_points == cold.stats.save_points == [64]
    assert warm.num_cached_tokens == 64 and warm.stats.save_points == []
    assert warm.stats.plans[0].chunk_ends == [128, 129]
    assert cold.output_ids == warm.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


def test_a_save_placed_without_recompute_blocks_is_useless_to_a_request_that_needs_them(tiny_qwen3_next):
    # the pre-fix behaviour, reproduced on purpose: the last-only save at 128 (planned with
    # r = 0) cannot seed a request with r = 1 (block [128, 144) never exists for n = 129)
    ids = prompt(129, 1)
    eng = engine(tiny_qwen3_next, prefill_save_last_only=True)
    cold = eng.generate(ids, GEN)
    assert cold.stats.save_points == [128]
    warm = eng.generate(ids, GEN, recompute_blocks=1)
    assert warm.num_cached_tokens == 0
    assert warm.stats.save_points == [64]                 # its own plan saves where r allows
    assert cold.output_ids == warm.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


# ------------------------------------------------------------------ a 5-turn conversation
def _conversation(eng: Engine) -> list:
    ids, seqs = prompt(320, 2), []
    for t in range(5):
        if seqs:
            ids = ids + seqs[-1].output_ids + prompt(200, 20 + t)
        seqs.append(eng.generate(ids, GEN))
    return seqs


def test_last_only_saves_once_per_turn_at_b_star(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next, prefill_save_last_only=True)
    seqs = _conversation(eng)
    prev_b = 0
    for seq in seqs:
        n, c = seq.num_prompt_tokens, seq.num_cached_tokens
        b_star = last_reusable(n, B, A)
        plan = plan_prefill(n, c, P, B, A, last_only=True)
        assert seq.stats.plans == [plan]
        assert seq.stats.save_points == ([b_star] if b_star > c else [])
        assert seq.stats.prefill_forwards == plan.num_chunks
        assert c >= prev_b
        prev_b = b_star
        assert seq.output_ids == reference(tiny_qwen3_next, seq.token_ids[:n])
    assert [s.num_prompt_tokens for s in seqs] == [320, 526, 732, 938, 1144]
    assert [s.num_cached_tokens for s in seqs] == [0, 256, 512, 704, 896]
    assert [s.stats.save_points for s in seqs] == [[256], [512], [704], [896], [1088]]
    # a 6th turn of 1152 tokens: b* = 1088 (1152 needs one more token), which the hit reaches
    ids = seqs[-1].token_ids + prompt(2, 30)
    sixth = eng.generate(ids, GEN)
    assert (sixth.num_cached_tokens, last_reusable(1152, B, A)) == (1088, 1088)
    assert sixth.stats.plans[0].save_points == sixth.stats.save_points == []
    assert sixth.stats.prefill_forwards == 1
    assert sixth.output_ids == reference(tiny_qwen3_next, ids)
    # a first turn of A tokens has no reusable boundary at all
    short = eng.generate(prompt(A, 31), GEN)
    assert last_reusable(A, B, A) is None and short.stats.save_points == []
    assert eng.stats()['checkpoints_saved'] == 5
    assert_idle(eng)


def test_default_policy_saves_every_chunk_end_on_the_same_conversation(tiny_qwen3_next):
    last_only = _conversation(engine(tiny_qwen3_next, prefill_save_last_only=True))
    eng = engine(tiny_qwen3_next)
    default = _conversation(eng)
    assert [s.stats.save_points for s in default] == [
        [64, 128, 192, 256], [320, 384, 448, 512], [576, 640, 704], [768, 832, 896], [960, 1024, 1088]]
    # same hits, same chunks: only the number of checkpoints differs
    assert [s.num_cached_tokens for s in default] == [s.num_cached_tokens for s in last_only]
    assert [s.stats.prefill_forwards for s in default] == [s.stats.prefill_forwards for s in last_only]
    assert [s.output_ids for s in default] == [s.output_ids for s in last_only]
    assert eng.stats()['checkpoints_saved'] == 4 + 4 + 3 + 3 + 3
    assert_idle(eng)


def test_remaining_prefill_chunks_follow_the_last_only_plan(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next, prefill_save_last_only=True, max_prefill_token_num=100)
    seq = eng.add_request(prompt(300, 3), GEN)
    eng.step()
    # the default policy's grid (each end at the largest multiple of A within 100 tokens), which
    # last-only shares so that both compute the same numbers; b* = 256 is one of its ends
    assert seq.plan.chunk_ends == [64, 128, 192, 256, 300] and seq.plan.save_points == [256]
    remaining = [eng.scheduler.remaining_prefill_chunks(seq)]
    while seq.is_prefill:
        eng.step()
        remaining.append(eng.scheduler.remaining_prefill_chunks(seq))
    assert remaining == [4, 3, 2, 1, 0]
    while eng.has_work:
        eng.step()
    assert seq.stats.prefill_forwards == 5 and seq.stats.save_points == [256]
    assert_idle(eng)


# ------------------------------------------------------------------ the trade-off, measured
def test_diverging_conversations_hit_less_with_last_only(tiny_qwen3_next):
    """Two conversations share 300 tokens, then differ; the first is 400 tokens (b* = 384).
    Printed (run with ``-s``): cached tokens of the second under each policy."""
    first = prompt(400, 4)
    second = first[:300] + prompt(100, 5)
    hits = {}
    for last_only in (False, True):
        eng = engine(tiny_qwen3_next, prefill_save_last_only=last_only)
        eng.generate(first, GEN)
        seq = eng.generate(second, GEN)
        assert seq.output_ids == reference(tiny_qwen3_next, second)
        hits['last-only' if last_only else 'default'] = seq.num_cached_tokens
        assert_idle(eng)
    print(f'\ndiverging at 300 of 400 tokens (b* = 384): cached tokens of the second conversation '
          f'default={hits["default"]} last-only={hits["last-only"]}')


# ------------------------------------------------------------------ full attention ignores it
def test_full_attention_model_ignores_last_only_and_logs_once(tiny_qwen3, caplog):
    ids = prompt(150, 6)
    runs = {}
    for last_only in (False, True):
        with caplog.at_level(logging.INFO, logger='lmdeploy'):
            caplog.clear()
            eng = engine(tiny_qwen3, prefill_save_last_only=last_only)
            seqs = [eng.generate(ids, GEN) for _ in range(3)]
        notes = [r for r in caplog.records if 'prefill_save_last_only' in r.getMessage()]
        assert len(notes) == (1 if last_only else 0)
        runs[last_only] = [(s.output_ids, s.num_cached_tokens, s.stats.plans, s.stats.save_points) for s in seqs]
        assert_idle(eng)
    assert runs[True] == runs[False]
    assert [r[1] for r in runs[True]] == [0, 144, 144]
    assert runs[True][0][0] == reference(tiny_qwen3, ids)


def test_last_only_flag_reaches_scheduler(tiny_qwen3_next, tiny_qwen3):
    assert engine(tiny_qwen3_next, prefill_save_last_only=True).scheduler.last_only is True
    assert engine(tiny_qwen3_next).scheduler.last_only is False
    assert engine(tiny_qwen3, prefill_save_last_only=True).scheduler.last_only is False
    assert PytorchEngineConfig().prefill_save_last_only is False
