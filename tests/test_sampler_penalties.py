"""Presence and frequency penalties and logit_bias (OpenAI's definitions): against a direct
computation over random logits and replies, on greedy decoding and in the sampled distribution,
the prompt not counted, drafts counted while they are verified, and in the engine against a
token-by-token transformers reference."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.sampling.sampler import sample, target_distribution
from lmdeploy.pytorch.paging.sequence import Sequence
from lmdeploy.pytorch.spec_decode.acceptance import verify_drafts

V = 12


def _seq(prompt, generated, **gen):
    seq = Sequence(list(prompt), GenerationConfig(**gen))
    seq.token_ids.extend(generated)
    return seq


def _expected(logits, generated, presence, frequency, bias=None):
    out = logits.clone()
    for t in set(generated):
        out[t] -= presence + frequency * generated.count(t)
    for t, b in (bias or {}).items():
        out[t] += b
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, V - 1), max_size=6), st.lists(st.integers(0, V - 1), max_size=10),
       st.floats(-2, 2), st.floats(-2, 2), st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4),
       st.integers(0, 2 ** 31))
def test_penalised_logits_are_openais(prompt, generated, presence, frequency, bias, seed):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    seq = _seq(prompt or [0], generated, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias,
               logprobs=V)
    want = _expected(logits, generated, presence, frequency, bias)   # the prompt's tokens are not penalised
    token, _, logp = target_distribution(logits, seq)
    assert token == int(want.argmax())
    assert torch.allclose(logp, torch.log_softmax(want, -1), atol=1e-6)
    (got,), (lp,) = sample(logits[None], [seq])
    assert got == token and abs(lp.logprob - float(torch.log_softmax(want, -1)[token])) < 1e-6
    sampled = _seq(prompt or [0], generated, presence_penalty=presence, frequency_penalty=frequency,
                   logit_bias=bias, do_sample=True, temperature=0.7)
    _, probs, _ = target_distribution(logits, sampled)
    # 1e-5, not 1e-6: biases reach 100, and float32 rounding of logits that large (ulp ~1e-5 at
    # 100) differs between the sampler's in-place updates and this reference's
    assert torch.allclose(probs, torch.softmax((want - want.max()) / 0.7, -1), atol=1e-5)


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


def test_logit_bias_of_100_forces_and_minus_100_bans_a_token(tiny_qwen3_next):
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                      block_size=16))
    prompt = [random.Random(3).randrange(3, 1000) for _ in range(20)]
    plain = eng.generate(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True)).output_ids
    forced = eng.generate(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True, logit_bias={77: 100}))
    assert forced.output_ids == [77] * 8
    banned = eng.generate(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True,
                                                   logit_bias={plain[0]: -100}))
    assert banned.output_ids[0] != plain[0] and plain[0] not in banned.output_ids
    with pytest.raises(ValueError, match='logit_bias: token id 5000 is outside the vocabulary'):
        eng.generate(prompt, GenerationConfig(max_new_tokens=2, logit_bias={5000: 1.0}))
