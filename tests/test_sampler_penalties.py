"""Presence and frequency penalties (OpenAI's definition): against a direct computation over
random logits and replies, on greedy decoding and in the sampled distribution, the prompt not
counted, drafts counted while they are verified, and through the API against a cache-off engine."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.engine.sampler import sample, target_distribution
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.spec_decode.acceptance import verify_drafts

V = 12


def _seq(prompt, generated, **gen):
    seq = Sequence(list(prompt), GenerationConfig(**gen))
    seq.token_ids.extend(generated)
    return seq


def _expected(logits, generated, presence, frequency):
    out = logits.clone()
    for t in set(generated):
        out[t] -= presence + frequency * generated.count(t)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, V - 1), max_size=6), st.lists(st.integers(0, V - 1), max_size=10),
       st.floats(-2, 2), st.floats(-2, 2), st.integers(0, 2 ** 31))
def test_penalised_logits_are_openais(prompt, generated, presence, frequency, seed):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    seq = _seq(prompt or [0], generated, presence_penalty=presence, frequency_penalty=frequency, logprobs=V)
    want = _expected(logits, generated, presence, frequency)          # the prompt's tokens are not penalised
    token, _, logp = target_distribution(logits, seq)
    assert token == int(want.argmax())
    assert torch.allclose(logp, torch.log_softmax(want, -1), atol=1e-6)
    (got,), (lp,) = sample(logits[None], [seq])
    assert got == token and abs(lp.logprob - float(torch.log_softmax(want, -1)[token])) < 1e-6
    sampled = _seq(prompt or [0], generated, presence_penalty=presence, frequency_penalty=frequency,
                   do_sample=True, temperature=0.7)
    _, probs, _ = target_distribution(logits, sampled)
    assert torch.allclose(probs, torch.softmax((want - want.max()) / 0.7, -1), atol=1e-6)


def test_no_penalty_is_the_plain_argmax_and_the_prompt_never_counts():
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0])
    assert sample(logits[None], [_seq([1, 1, 1], [], frequency_penalty=2.0)])[0] == [1]   # prompt only
    assert sample(logits[None], [_seq([0], [1], frequency_penalty=0.2)])[0] == [2]          # 3.0 - 0.2 < 2.9
    assert sample(logits[None], [_seq([0], [1], presence_penalty=-1.0)])[0] == [1]          # negative: favoured
    assert sample(logits[None], [_seq([0], [1], presence_penalty=0.0, frequency_penalty=0.0)])[0] == [1]


def test_drafts_being_verified_count_as_generated():
    # row 1 prefers 4 (logit 5) over 6 (4.5); the accepted draft 4 costs it 1.0 under presence 1.0,
    # so 6 wins there: the token plain decoding picks after emitting 4
    logits = torch.zeros(2, 8)
    logits[0, 4] = 5.0
    logits[1, 4], logits[1, 6] = 5.0, 4.5
    assert verify_drafts(logits, [4], _seq([0], [], presence_penalty=1.0)) == [4, 6]
    assert verify_drafts(logits, [4], _seq([0], [])) == [4, 4]


# the random model does not repeat itself on this prompt, so penalties against repetition alone
# change nothing; negative presence makes it repeat, and a positive frequency then pushes back
@pytest.mark.parametrize('presence, frequency', [(-2.0, 1.0), (-1.0, 0.5), (-1.0, -0.5), (0.0, -2.0)])
def test_engine_penalties_follow_a_step_by_step_reference(tiny_qwen3_next, presence, frequency):
    """The engine's greedy tokens with penalties equal a reference that runs transformers one
    token at a time and applies the penalties to its logits."""
    from transformers import AutoModelForCausalLM

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    prompt = [random.Random(7).randrange(3, 1000) for _ in range(40)]
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True, presence_penalty=presence,
                           frequency_penalty=frequency)
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                      block_size=16))
    got = eng.generate(prompt, gen).output_ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_next, dtype=torch.float32).eval()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(16):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            token = int(_expected(logits, out, presence, frequency).argmax())
            out.append(token)
            ids.append(token)
    assert got == out
    plain = eng.generate(prompt, GenerationConfig(max_new_tokens=16, ignore_eos=True)).output_ids
    assert got != plain         # the penalties matter on this prompt, so the comparison above can fail
