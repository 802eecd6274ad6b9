"""Opt-in checkpoint policies beyond last-only: the turn-end checkpoint (``decode_save_last``)
and the junction checkpoint (``save_junction``), on the tiny Qwen3-Next.

Geometry: B = 16 tokens per block, A = 64, P = 128. Every output is compared with the same
prompt run with caching off.
"""
from __future__ import annotations

import pytest

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill, with_junction

B, A, P = 16, 64, 128
_REFERENCE: dict[tuple, list[int]] = {}


def engine(path: str, **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=16,
               prefill_save_last_only=True)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def reference(path: str, ids: list[int], gen: GenerationConfig) -> list[int]:
    key = (path, tuple(ids), gen.max_new_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = engine(path, enable_prefix_caching=False).generate(ids, gen).output_ids
    return _REFERENCE[key]


def test_with_junction_splits_the_chunk_holding_the_branch_point():
    plan = plan_prefill(300, 0, 128, B, A, True)                 # last-only: save at 256 only
    assert (plan.chunk_ends, plan.save_points) == ([128, 256, 300], [256])
    cut = with_junction(plan, 192)
    assert (cut.chunk_ends, cut.save_points, cut.junction) == ([128, 192, 256, 300], [192, 256], 192)
    assert with_junction(plan, 256) is plan                        # already a save point


@pytest.mark.parametrize('last_only', [True, False])
def test_turn_end_checkpoint_lets_the_next_turn_restore_past_the_reply(tiny_qwen3_next, last_only):
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    plain = engine(tiny_qwen3_next, prefill_save_last_only=last_only)
    turn_end = engine(tiny_qwen3_next, prefill_save_last_only=last_only, decode_save_last=True)
    first = prompt(100, 1)
    cached = {}
    for name, eng in (('plain', plain), ('turn_end', turn_end)):
        one = eng.generate(first, gen)
        assert one.output_ids == reference(tiny_qwen3_next, first, gen)
        # 100 prompt + 29 computed reply tokens: the last block boundary reached is 128
        assert one.stats.turn_end_point == (128 if name == 'turn_end' else None)
        second_ids = one.token_ids + prompt(40, 2)                # n = 170
        two = eng.generate(second_ids, gen)
        assert two.output_ids == reference(tiny_qwen3_next, second_ids, gen)
        cached[name] = two.num_cached_tokens
        assert eng.is_idle() and eng.ledger()['checkpoints_pinned'] == 0
    # without it the second turn restores the first prompt's last aligned save point (64)
    assert cached == {'plain': 64, 'turn_end': 128}
    assert turn_end.stats()['turn_end_checkpoints_saved'] == 2 and plain.stats()['turn_end_checkpoints_saved'] == 0


def test_an_identical_follow_up_restores_at_the_turn_end_boundary(tiny_qwen3_next):
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    eng = engine(tiny_qwen3_next, decode_save_last=True)
    one = eng.generate(prompt(90, 3), gen)                  # 90 + 39 computed: turn end at 128
    assert one.stats.turn_end_point == 128
    again = eng.generate(one.token_ids, gen)               # the whole first turn, as the next prompt
    assert again.num_cached_tokens == 128
    assert again.output_ids == reference(tiny_qwen3_next, one.token_ids, gen)


def test_a_short_reply_that_crosses_no_block_boundary_saves_no_turn_end(tiny_qwen3_next):
    gen = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    eng = engine(tiny_qwen3_next, decode_save_last=True)
    seq = eng.generate(prompt(100, 4), gen)                 # computed 102: boundary 96 is inside the prefill
    assert seq.stats.turn_end_point is None
    assert eng.is_idle() and eng.ledger()['checkpoints_published'] == 1     # the prefill save at 64


@pytest.mark.parametrize('junction', [False, True])
def test_junction_checkpoint_gives_later_siblings_the_branch_point(tiny_qwen3_next, junction):
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    eng = engine(tiny_qwen3_next, save_junction=junction)
    shared = prompt(150, 5)
    siblings = [shared + prompt(60, 10 + i) for i in range(3)]      # n = 210, diverging at 150
    seqs = [eng.generate(ids, gen) for ids in siblings]
    for seq, ids in zip(seqs, siblings):
        assert seq.output_ids == reference(tiny_qwen3_next, ids, gen)
    # last-only saves at 192 only, past the branch point; the second sibling's blocks match 144
    # tokens (9 blocks), so with the junction policy it also saves at 128, which the third reuses
    assert [s.num_cached_tokens for s in seqs] == ([0, 0, 128] if junction else [0, 0, 0])
    assert [s.stats.save_points for s in seqs] == ([[192], [128, 192], [192]] if junction else [[192]] * 3)
    assert eng.stats()['junction_checkpoints_saved'] == (1 if junction else 0)
    assert eng.stats()['state_miss_tokens'] == (144 + 16 if junction else 144 * 2)
    assert eng.is_idle()


@pytest.mark.parametrize('name', ['prefill_save_last_only', 'decode_save_last', 'save_junction'])
def test_a_save_policy_without_prefix_caching_warns_that_it_has_no_effect(tiny_qwen3_next, caplog, name):
    import logging
    with caplog.at_level(logging.WARNING, logger='lmdeploy'):
        eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=32,
                                                          **{name: True}))
    assert any(name in r.getMessage() and 'enable_prefix_caching' in r.getMessage() for r in caplog.records)
    eng.close()
