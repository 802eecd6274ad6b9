"""The engine serves hybrid Qwen3-Next exactly (issue 3): transformers' logits at every prompt
position while the recurrent state crosses unaligned prefill chunk ends, greedy output equal to
transformers ``generate`` under continuous batching, state-slot shortage and block preemption,
and every runtime state slot and block free again after finish or abort."""
import math

import pytest

from engine_utils import (TOL, StepRecorder, assert_idle, engine_prompt_logits, make_engine, random_prompt,
                          reference_fixtures, run_alone, run_staggered, step_until)
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.paging.prefill_plan import prefill_grid

LENGTHS = [1, 5, 64, 65, 700, 3000]
CHUNKS = [16, 100, 8192]
NEW_TOKENS = 32
# 6 prompts: tiny, block-edge and multi-chunk lengths (chunk 32 below, so state crosses 32k+r ends)
STAGGER_LENGTHS = [2, 5, 30, 64, 65, 150]
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS)

hf, prompt_refs, prompts, hf_continuations = reference_fixtures('tiny_qwen3_next', LENGTHS, STAGGER_LENGTHS, 200,
                                                                NEW_TOKENS)


def test_engine_is_hybrid_with_one_runtime_slot_per_batch_entry(tiny_qwen3_next):
    engine = make_engine(tiny_qwen3_next, max_batch_size=4)
    assert engine.is_hybrid
    assert_idle(engine)
    assert engine.ledger()['runtime_slots_total'] == 4


@pytest.mark.parametrize('chunk', CHUNKS)
@pytest.mark.parametrize('n', LENGTHS)
def test_prompt_logits_equal_transformers_at_every_position(tiny_qwen3_next, prompt_refs, n, chunk):
    ids, ref = prompt_refs[n]
    engine = make_engine(tiny_qwen3_next, max_prefill_token_num=chunk)
    logits, forwards = engine_prompt_logits(engine, ids)
    # the state really was carried across chunk ends: caching off too, forwards end on the prompt's
    # chunk grid (B = 64, A = 1024 by default), which also ends at each multiple of A it reaches
    assert forwards == len(prefill_grid(n, 0, chunk, 64, 1024)) >= math.ceil(n / chunk)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= TOL
    assert_idle(engine)


@pytest.mark.parametrize('n', [65, 700])
def test_prompt_logits_equal_transformers_with_16_token_blocks(tiny_qwen3_next, prompt_refs, n):
    ids, ref = prompt_refs[n]
    engine = make_engine(tiny_qwen3_next, max_prefill_token_num=100, block_size=16)
    logits, _ = engine_prompt_logits(engine, ids)
    assert (logits - ref).abs().max().item() <= TOL
    assert_idle(engine)


def test_greedy_continuations_equal_transformers_generate(tiny_qwen3_next, prompts, hf_continuations):
    engine = make_engine(tiny_qwen3_next, max_prefill_token_num=16)
    assert run_alone(engine, prompts, GREEDY) == hf_continuations
    assert all(len(out) == NEW_TOKENS or out[-1] == 2 for out in hf_continuations)
    assert_idle(engine)


def test_staggered_requests_share_batches_and_equal_each_prompt_alone(tiny_qwen3_next, prompts, hf_continuations):
    engine = make_engine(tiny_qwen3_next, max_prefill_token_num=32, block_size=16, max_batch_size=6)
    rec = StepRecorder(engine)
    seqs = run_staggered(engine, prompts, GREEDY, every=2)
    assert rec.num_mixed_steps > 0           # prefill chunks and decode tokens shared forwards
    assert rec.max_concurrent() >= 4
    assert [s.output_ids for s in seqs] == hf_continuations
    assert_idle(engine)
    alone = run_alone(make_engine(tiny_qwen3_next), prompts, GREEDY)
    assert alone == hf_continuations


def test_fewer_state_slots_than_requests_keeps_greedy_output(tiny_qwen3_next, prompts, hf_continuations):
    engine = make_engine(tiny_qwen3_next, num_state_slots=2, max_batch_size=4, max_prefill_token_num=32)
    rec = StepRecorder(engine)
    seqs = run_staggered(engine, prompts, GREEDY, every=1)
    assert rec.max_concurrent() == 2         # the third request waited for a slot
    assert [s.output_ids for s in seqs] == hf_continuations
    assert_idle(engine)
    assert engine.ledger()['runtime_slots_total'] == 2


def test_blocks_exhausted_preempts_and_keeps_greedy_output(tiny_qwen3_next, prompts, hf_continuations):
    # block 16: the longest request (150 + 32 tokens) needs 12 blocks; all 6 need 35
    engine = make_engine(tiny_qwen3_next, block_size=16, num_gpu_blocks=12, max_prefill_token_num=32,
                         max_batch_size=6)
    seqs = run_staggered(engine, prompts, GREEDY, every=1)
    assert any(len(s.stats.plans) > 1 for s in seqs)     # preempted (state dropped) and recomputed
    assert [s.output_ids for s in seqs] == hf_continuations
    assert_idle(engine)


def test_abort_in_prefill_and_in_decode_frees_every_slot_and_block(tiny_qwen3_next, prompts, hf_continuations):
    engine = make_engine(tiny_qwen3_next, max_prefill_token_num=16, block_size=16, max_batch_size=2)
    in_decode = engine.add_request(prompts[1], GREEDY)
    in_prefill = engine.add_request(random_prompt(200, seed=5), GREEDY)
    waiting = engine.add_request(prompts[2], GREEDY)              # max_batch_size 2: not admitted
    step_until(engine, lambda: in_prefill.num_computed_tokens >= 48)
    assert in_prefill.num_computed_tokens == 48 and in_prefill.is_prefill
    assert 1 <= in_decode.num_generated < NEW_TOKENS and not in_decode.is_prefill
    assert waiting.state_slot is None and not waiting.block_ids
    led = engine.ledger()
    assert (led['runtime_slots_free'], led['blocks_in_use']) == (0, 48 // 16 + 1)
    engine.abort(in_prefill)
    assert engine.ledger()['runtime_slots_free'] == 1
    engine.abort(in_decode)
    engine.abort(waiting)
    assert [s.finish_reason for s in (in_prefill, in_decode, waiting)] == ['abort'] * 3
    assert_idle(engine)
    # the freed slots still hold the aborted sequences' states; new requests must not see them
    seqs = [engine.add_request(prompts[i], GREEDY) for i in (5, 4)]
    step_until(engine, lambda: all(s.is_finished for s in seqs))
    assert [s.output_ids for s in seqs] == [hf_continuations[5], hf_continuations[4]]
    assert_idle(engine)
