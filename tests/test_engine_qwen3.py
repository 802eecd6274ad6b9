"""The engine serves Qwen3 exactly (issue 2): transformers' logits at every prompt position
under any chunking, greedy output equal to transformers ``generate`` under continuous batching
and preemption, seeded sampling, and every block free again after finish or abort."""
import math

import pytest

from engine_utils import (TOL, StepRecorder, assert_idle, engine_prompt_logits, make_engine, random_prompt,
                          reference_fixtures, run_alone, run_staggered, step_until)
from lmdeploy import GenerationConfig

LENGTHS = [1, 63, 64, 65, 1000]
NEW_TOKENS = 32
# 8 prompts: one-block, block-edge and multi-chunk lengths (chunk 32 below)
STAGGER_LENGTHS = [3, 17, 40, 63, 64, 65, 90, 130]
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS)

hf, prompt_refs, stagger_prompts, hf_continuations = reference_fixtures('tiny_qwen3', LENGTHS, STAGGER_LENGTHS, 100,
                                                                        NEW_TOKENS)


@pytest.mark.parametrize('block_size', [64, 16])
@pytest.mark.parametrize('chunk', [16, 8192])
@pytest.mark.parametrize('n', LENGTHS)
def test_prompt_logits_equal_transformers_at_every_position(tiny_qwen3, prompt_refs, n, chunk, block_size):
    ids, ref = prompt_refs[n]
    engine = make_engine(tiny_qwen3, max_prefill_token_num=chunk, block_size=block_size)
    logits, forwards = engine_prompt_logits(engine, ids)
    assert forwards == math.ceil(n / chunk)      # the prompt really was split into chunks of <= P
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= TOL
    assert_idle(engine)


def test_staggered_greedy_equals_transformers_generate_and_each_prompt_alone(
        tiny_qwen3, stagger_prompts, hf_continuations):
    engine = make_engine(tiny_qwen3, max_prefill_token_num=32, block_size=16, max_batch_size=8)
    rec = StepRecorder(engine)
    seqs = run_staggered(engine, stagger_prompts, GREEDY, every=2)
    batched = [s.output_ids for s in seqs]
    assert rec.num_mixed_steps > 0           # prefill chunks and decode tokens shared forwards
    assert rec.max_concurrent() >= 4
    assert batched == hf_continuations
    assert_idle(engine)
    alone = run_alone(make_engine(tiny_qwen3), stagger_prompts, GREEDY)
    assert batched == alone
    assert all(len(out) == NEW_TOKENS or out[-1] == 2 for out in batched)


def test_cache_too_small_for_all_requests_preempts_and_keeps_greedy_output(
        tiny_qwen3, stagger_prompts, hf_continuations):
    # block 16: the longest request (130 + 32 tokens) needs 11 blocks; 8 requests need 53
    engine = make_engine(tiny_qwen3, block_size=16, num_gpu_blocks=12, max_prefill_token_num=64)
    seqs = run_staggered(engine, stagger_prompts, GREEDY, every=1)
    assert any(len(s.stats.plans) > 1 for s in seqs)    # some request was preempted and re-admitted
    assert [s.output_ids for s in seqs] == hf_continuations
    assert_idle(engine)


def test_same_seed_same_sample_and_temperature_zero_is_greedy(tiny_qwen3, stagger_prompts, hf_continuations):
    engine = make_engine(tiny_qwen3, max_prefill_token_num=32)
    prompt = stagger_prompts[2]
    sampled = dict(do_sample=True, temperature=1.0, top_p=0.9, top_k=100, max_new_tokens=24, ignore_eos=True)
    first = engine.generate(prompt, GenerationConfig(random_seed=7, **sampled)).output_ids
    again = engine.generate(prompt, GenerationConfig(random_seed=7, **sampled)).output_ids
    other = engine.generate(prompt, GenerationConfig(random_seed=8, **sampled)).output_ids
    assert first == again
    assert first != other
    # the same seed in a batch with other requests (and arriving late) gives the same tokens
    seqs = [engine.add_request(stagger_prompts[i], GREEDY) for i in (0, 1, 3)]
    engine.step()
    seqs.append(engine.add_request(prompt, GenerationConfig(random_seed=7, **sampled)))
    step_until(engine, lambda: all(s.is_finished for s in seqs))
    assert seqs[-1].output_ids == first
    assert first != hf_continuations[2][:24]                     # sampling really sampled
    zero = GenerationConfig(do_sample=True, temperature=0.0, max_new_tokens=NEW_TOKENS)
    assert engine.generate(prompt, zero).output_ids == hf_continuations[2]
    top1 = GenerationConfig(do_sample=True, top_k=1, random_seed=3, max_new_tokens=NEW_TOKENS)
    assert engine.generate(prompt, top1).output_ids == hf_continuations[2]
    assert_idle(engine)


def test_abort_in_prefill_and_in_decode_frees_every_block(tiny_qwen3, stagger_prompts, hf_continuations):
    engine = make_engine(tiny_qwen3, max_prefill_token_num=16, block_size=16, max_batch_size=2)
    long_prompt = random_prompt(200, seed=5)
    # prefill: 3 chunks of 16 computed, 152 prompt tokens still to go
    in_decode = engine.add_request(stagger_prompts[0], GREEDY)
    in_prefill = engine.add_request(long_prompt, GREEDY)
    waiting = engine.add_request(stagger_prompts[1], GREEDY)      # max_batch_size 2: never admitted
    step_until(engine, lambda: in_prefill.num_computed_tokens >= 48)
    assert in_prefill.num_computed_tokens == 48 and in_prefill.is_prefill
    assert 1 <= in_decode.num_generated < NEW_TOKENS and not in_decode.is_prefill
    assert waiting.num_computed_tokens == 0 and not waiting.block_ids
    assert engine.ledger()['blocks_in_use'] == 48 // 16 + 1
    engine.abort(in_prefill)
    engine.abort(in_decode)
    engine.abort(waiting)
    assert [s.finish_reason for s in (in_prefill, in_decode, waiting)] == ['abort'] * 3
    assert_idle(engine)
    engine.step()                                                 # nothing left to run
    assert_idle(engine)
    # the engine keeps serving, with the same output as before the aborts
    assert engine.generate(stagger_prompts[0], GREEDY).output_ids == hf_continuations[0]
    assert_idle(engine)


def test_bad_requests_are_rejected_and_engine_keeps_serving(tiny_qwen3, stagger_prompts, hf_continuations):
    engine = make_engine(tiny_qwen3, session_len=100)
    with pytest.raises(ValueError, match='empty'):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r'100 tokens.*session_len=100'):
        engine.add_request(random_prompt(100, seed=1), GREEDY)
    with pytest.raises(ValueError, match='2000'):
        engine.add_request([5, 2000], GREEDY)
    with pytest.raises(ValueError, match='max_new_tokens'):
        GenerationConfig(max_new_tokens=-1)
    assert_idle(engine)
    assert engine.generate(stagger_prompts[3], GREEDY).output_ids == hf_continuations[3]


def test_request_outgrowing_the_whole_cache_ends_with_length_instead_of_hanging(tiny_qwen3):
    engine = make_engine(tiny_qwen3, block_size=16, num_gpu_blocks=2)
    assert engine.session_len == 32                     # capped to what 2 blocks of 16 tokens hold
    seq = engine.add_request(random_prompt(20, seed=4), GenerationConfig(max_new_tokens=32, ignore_eos=True))
    step_until(engine, lambda: seq.is_finished, max_steps=50)
    assert (seq.finish_reason, seq.num_generated) == ('length', 12)
    with pytest.raises(ValueError, match=r'40 tokens.*session_len=32'):
        engine.add_request(random_prompt(40, seed=4), GREEDY)
    assert_idle(engine)


def test_extreme_sampling_settings_neither_fail_the_batch_nor_leave_the_limit(tiny_qwen3, stagger_prompts,
                                                                                hf_continuations):
    engine = make_engine(tiny_qwen3, max_prefill_token_num=32)
    prompt = stagger_prompts[2]
    extreme = dict(do_sample=True, max_new_tokens=NEW_TOKENS, ignore_eos=True, random_seed=1)
    seqs = [engine.add_request(prompt, GREEDY),
            engine.add_request(prompt, GenerationConfig(temperature=1e-40, **extreme)),   # float32 overflow
            # GenerationConfig refuses a penalty below 0.01; the sampler still guards a request built
            # without validation (model_construct), whose penalised logits overflow float32
            engine.add_request(prompt, GenerationConfig.model_construct(
                **{**GenerationConfig().model_dump(), **extreme, 'temperature': 1.0, 'repetition_penalty': 1e-45}))]
    step_until(engine, lambda: all(s.is_finished for s in seqs))
    assert [s.finish_reason for s in seqs] == ['length'] * 3        # not 'error' for the whole batch
    assert seqs[0].output_ids == hf_continuations[2]
    assert seqs[1].output_ids == hf_continuations[2]                 # the T -> 0 limit is greedy
    assert_idle(engine)


def test_sampler_maps_overflowed_logits_to_their_limit():
    import torch

    from lmdeploy.pytorch.sampling.sampler import sample_tokens
    from lmdeploy.pytorch.paging.sequence import Sequence
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [float('nan')] * 4, [0.5, float('nan'), 2.5, 1.0]])
    seqs = [Sequence([0], GenerationConfig(do_sample=True, temperature=1e-40, random_seed=s)) for s in range(3)]
    assert sample_tokens(logits, seqs) == [1, 0, 2]   # argmax; all-NaN row: no crash; NaN entry never drawn
    # temperatures below float32's range (they round to 0 in a float32 division) are still the
    # T -> 0 limit, the argmax, for every seed (they used to fall back to temperature 1)
    rows = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    for t in (1e-40, 1e-46, 5e-324):
        seqs = [Sequence([0], GenerationConfig(do_sample=True, temperature=t, random_seed=s)) for s in range(16)]
        assert sample_tokens(rows, seqs) == rows.argmax(-1).tolist(), t
    # seen tokens 0 and 2 overflow to +inf under a near-zero penalty (refused by GenerationConfig,
    # below 0.01; the sampler still guards a request built without validation): one of them is drawn
    seqs = [Sequence([0, 2], GenerationConfig.model_construct(**{**GenerationConfig().model_dump(), 'do_sample': True,
                                                                  'repetition_penalty': 1e-45, 'random_seed': s}))
            for s in range(8)]
    assert set(sample_tokens(torch.tensor([[1.0, 3.0, 2.0, -1.0]] * 8), seqs)) <= {0, 2}
