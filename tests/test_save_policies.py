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


def test_a_short_reply_that_crosses_no_block_boundary_still_saves_the_turn_end(tiny_qwen3_next):
    """The prompt's last block boundary (96 of 100) lies inside its last prefill chunk; with
    decode_save_last a forward ends there too, so a 3-token reply (computed 102) still gets its
    turn-end checkpoint at 96 and the next turn restores there."""
    gen = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    eng = engine(tiny_qwen3_next, decode_save_last=True)
    seq = eng.generate(prompt(100, 4), gen)
    assert seq.stats.plans[0].chunk_ends == [64, 96, 100] and seq.stats.prefill_forwards == 3
    assert seq.stats.turn_end_point == 96
    assert eng.is_idle() and eng.ledger()['checkpoints_published'] == 2     # the prefill save at 64, 96
    follow = seq.token_ids + prompt(20, 5)
    two = eng.generate(follow, gen)
    assert two.num_cached_tokens == 96 and two.output_ids == reference(tiny_qwen3_next, follow, gen)


@pytest.mark.parametrize('n,out', [(100, 1), (100, 4), (100, 5), (95, 2), (96, 1), (96, 3), (130, 1), (130, 15),
                                   (130, 30), (10, 3), (20, 1), (64, 1), (200, 9), (257, 2)])
def test_the_next_turn_restores_at_the_last_block_boundary_of_what_the_turn_computed(tiny_qwen3_next, n, out):
    """For any prompt length n and reply length out, the next turn of the conversation (the whole
    turn plus new text) restores at floor_B(n + out - 1), the last block boundary of the tokens
    the turn computed (0 below one block), and outputs equal a cache-off run."""
    gen = GenerationConfig(max_new_tokens=out, ignore_eos=True)
    eng = engine(tiny_qwen3_next, decode_save_last=True)
    first = prompt(n, 40 + n + out)
    one = eng.generate(first, gen)
    assert one.output_ids == reference(tiny_qwen3_next, first, gen)
    assert all(b - a <= P for a, b in zip(one.stats.plans[0].chunk_starts, one.stats.plans[0].chunk_ends))
    follow = one.token_ids + prompt(7, 41)
    two = eng.generate(follow, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    assert two.num_cached_tokens == (n + out - 1) // B * B
    assert two.output_ids == reference(tiny_qwen3_next, follow, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    assert eng.is_idle() and eng.ledger()['checkpoints_pinned'] == 0


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


def test_stats_keys_are_the_same_whatever_is_enabled(tiny_qwen3_next):
    """Engine.stats() returns every prefix-cache and Store key in every configuration (0 for a
    disabled tier), so code reading them works unchanged when a tier is turned off."""
    off = engine(tiny_qwen3_next, enable_prefix_caching=False)
    on = engine(tiny_qwen3_next, decode_save_last=True, save_junction=True)
    for eng in (off, on):
        eng.generate(prompt(80, 7), GenerationConfig(max_new_tokens=2, ignore_eos=True))
    assert set(off.stats()) == set(on.stats())
    assert {'turn_end_checkpoints_saved', 'junction_checkpoints_saved', 'store_put_bytes',
            'store_hit_tokens'} <= set(off.stats())
    zeros = off.stats()
    assert zeros['checkpoints_skipped'] == {} and zeros['store_put_bytes'] == {'state': 0, 'kv': 0}
    assert all(v == 0 for k, v in zeros.items() if not isinstance(v, dict))
    assert on.stats()['checkpoints_saved'] >= 1
