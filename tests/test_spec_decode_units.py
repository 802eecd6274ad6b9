"""Speculative decoding, pure parts: n-gram drafts, acceptance rules, configuration and CLI.

The sampling rule is checked against its promise (Leviathan et al. 2023; Chen et al. 2023):
the emitted tokens have exactly the target distribution, whatever the drafts are — a
chi-square goodness-of-fit test over many draws on a 4-token vocabulary.
"""
from __future__ import annotations

import argparse

import pytest
import torch
from scipy.stats import chi2

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.messages import SpeculativeConfig
from lmdeploy.pytorch.paging.sequence import Sequence
from lmdeploy.pytorch.spec_decode.acceptance import speculative_sample, verify_drafts
from lmdeploy.pytorch.spec_decode.ngram import propose_ngram


# ------------------------------------------------------------------ n-gram drafts
def test_ngram_continues_the_most_recent_match_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7]
    # suffix 5 6 7 (n=3) matches at 0 -> continuation 8 9 1; the shorter "6 7" match at 6 loses
    assert propose_ngram(tokens, 3, 1, 4) == [8, 9, 1]
    assert propose_ngram(tokens, 2, 1, 2) == [2, 5]        # n <= 2: "6 7" most recently at 6 -> 2 5
    assert propose_ngram(tokens, 10, 1, 4) == [8, 9, 1, 6, 7, 2, 5, 6, 7]   # stops at the sequence end


def test_ngram_without_a_match_drafts_nothing_and_respects_min_n():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 9, 2], 3, 1, 3) == [9, 2]
    assert propose_ngram([1, 2, 9, 2], 3, 2, 3) == []       # only the 1-gram "2" matched
    assert propose_ngram([7], 3, 1, 3) == [] and propose_ngram([7, 7], 0, 1, 3) == []


@pytest.mark.parametrize('kwargs', [dict(min_n=0), dict(min_n=3, max_n=2), dict(num_draft=-1)])
def test_ngram_bad_arguments_raise(kwargs):
    args = dict(num_draft=2, min_n=1, max_n=3) | kwargs
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1, 2], **args)


# ------------------------------------------------------------------ acceptance
def _seq(**gen) -> Sequence:
    return Sequence([1, 2, 3], GenerationConfig(**gen))


def _one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize('drafts, expected', [([4, 5, 6], [4, 5, 6, 7]),   # all accepted + bonus
                                              ([4, 0, 6], [4, 5]),         # first mismatch replaced
                                              ([0, 5, 6], [4])])
def test_greedy_acceptance_is_exact_match_then_the_target_token(drafts, expected):
    assert verify_drafts(_one_hot_logits([4, 5, 6, 7]), drafts, _seq()) == expected


def test_greedy_acceptance_counts_drafts_before_a_position_for_the_repetition_penalty():
    # row 1 prefers 4 (logit 5) over 6 (logit 4); with penalty 10 and draft 4 counted as seen,
    # 4 drops to 0.5 and 6 wins: the same token plain decoding picks after emitting 4
    logits = torch.zeros(2, 8)
    logits[0, 4] = 5.0
    logits[1, 4], logits[1, 6] = 5.0, 4.0
    assert verify_drafts(logits, [4], _seq(repetition_penalty=10.0)) == [4, 6]


P0 = torch.tensor([0.1, 0.4, 0.3, 0.2])
P1 = torch.tensor([0.25, 0.05, 0.6, 0.1])
P2 = torch.tensor([0.4, 0.3, 0.2, 0.1])


def _chi_square_p(counts: dict, expected: dict, n: int) -> float:
    keys = sorted(expected)
    observed = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    exp = torch.tensor([expected[k] * n for k in keys], dtype=torch.float64)
    assert set(counts) <= set(keys), set(counts) - set(keys)
    stat = float(((observed - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, len(keys) - 1))


@pytest.mark.parametrize('drafts', [[1, 2], [0, 3], [2, 2]])
def test_speculative_sampling_emits_the_target_distribution(drafts):
    """Joint law of (first token, second token if the first draft was accepted) over 20000 draws."""
    gen = torch.Generator().manual_seed(1234)
    probs = torch.stack([P0, P1, P2])
    n, counts = 20000, {}
    for _ in range(n):
        out = speculative_sample(probs, drafts, gen)
        assert 1 <= len(out) <= 3 and all(t == d for t, d in zip(out[:-1], drafts))
        key = (out[0], out[1]) if out[0] == drafts[0] else (out[0], None)
        counts[key] = counts.get(key, 0) + 1
    expected = {(x, None): float(P0[x]) for x in range(4) if x != drafts[0]}
    expected.update({(drafts[0], y): float(P0[drafts[0]] * P1[y]) for y in range(4)})
    assert _chi_square_p(counts, expected, n) > 1e-3
    # and a wrong law is rejected by the same test (the test can fail)
    wrong = {k: (v + (0.05 if k[0] == 0 else 0.0)) for k, v in expected.items()}
    total = sum(wrong.values())
    assert _chi_square_p(counts, {k: v / total for k, v in wrong.items()}, n) < 1e-6


def test_speculative_sampling_with_certain_drafts_accepts_all():
    probs = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert speculative_sample(probs, [1, 0], torch.Generator().manual_seed(0)) == [1, 0, 1]


def test_speculative_sampling_rejects_a_draft_of_probability_zero():
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(50):
        out = speculative_sample(probs, [2], torch.Generator().manual_seed(seed))
        assert out in ([0], [1])


def test_speculative_sampling_checks_the_shape():
    with pytest.raises(ValueError, match='K \\+ 1'):
        speculative_sample(torch.full((2, 4), 0.25), [1, 2, 3])


# ------------------------------------------------------------------ configuration and CLI
@pytest.mark.parametrize('fields, name', [(dict(method='eagle'), 'method'),
                                          (dict(method='ngram', num_speculative_tokens=0), 'num_speculative_tokens'),
                                          (dict(method='ngram', ngram_min=0), 'ngram_min'),
                                          (dict(method='ngram', ngram_min=5, ngram_max=2), 'ngram_min')])
def test_bad_speculative_config_names_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        PytorchEngineConfig(speculative_config=fields)


def test_speculative_config_defaults():
    cfg = PytorchEngineConfig(speculative_config={'method': 'ngram'}).speculative_config
    assert cfg == SpeculativeConfig(method='ngram', num_speculative_tokens=3, ngram_min=1, ngram_max=4)
    assert PytorchEngineConfig().speculative_config is None


@pytest.mark.parametrize('command', ['serve', 'chat'])
def test_speculative_flags_on_serve_and_chat(command):
    from lmdeploy.cli import chat, serve
    from lmdeploy.cli.serve import engine_config_from_args
    subparsers = argparse.ArgumentParser().add_subparsers()
    parser = serve.add_parser(subparsers) if command == 'serve' else chat.add_parser(subparsers)
    args = parser.parse_args(['MODEL', '--speculative-algorithm', 'qwen3_next_mtp',
                              '--speculative-num-draft-tokens', '2'])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig(method='qwen3_next_mtp',
                                                                                 num_speculative_tokens=2)
    assert engine_config_from_args(parser.parse_args(['MODEL'])).speculative_config is None
    args = parser.parse_args(['MODEL', '--speculative-config', '{"method": "ngram", "ngram_max": 6}',
                              '--speculative-num-draft-tokens', '5'])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig(method='ngram',
                                                                                 num_speculative_tokens=5, ngram_max=6)
    with pytest.raises(ValueError, match='--speculative-num-draft-tokens'):
        engine_config_from_args(parser.parse_args(['MODEL', '--speculative-algorithm', 'ngram',
                                                   '--speculative-num-draft-tokens', '0']))
    with pytest.raises(ValueError, match='--speculative-algorithm'):
        engine_config_from_args(parser.parse_args(['MODEL', '--speculative-num-draft-tokens', '2']))
    with pytest.raises(SystemExit):
        parser.parse_args(['MODEL', '--speculative-algorithm', 'eagle'])


def test_mtp_and_ngram_with_tensor_parallelism_are_accepted_and_bad_speculative_fields_name_the_field():
    import pytest

    from lmdeploy.messages import PytorchEngineConfig
    for method, canonical in (('mtp', 'mtp'), ('qwen3_next_mtp', 'mtp'), ('ngram', 'ngram')):
        cfg = PytorchEngineConfig(tp=2, speculative_config={'method': method, 'num_speculative_tokens': 2})
        assert cfg.speculative_config.method == canonical and cfg.tp == 2
    with pytest.raises(ValueError, match='num_speculative_tokens'):
        PytorchEngineConfig(tp=2, speculative_config={'method': 'qwen3_next_mtp', 'num_speculative_tokens': 0})
    with pytest.raises(ValueError, match='method'):
        PytorchEngineConfig(tp=2, speculative_config={'method': 'eagle'})


def test_mtp_is_the_method_name_and_qwen3_next_mtp_its_alias():
    """Both names validate (in the config, on assignment and as ``--speculative-algorithm``) to
    ``mtp`` and give the same decoding strategy; an unknown name is refused naming the field."""
    from lmdeploy.cli import serve
    from lmdeploy.cli.serve import engine_config_from_args
    from lmdeploy.pytorch.spec_decode.strategy import MTP, strategy_for
    a, b = SpeculativeConfig(method='mtp'), SpeculativeConfig(method='qwen3_next_mtp')
    assert a == b and a.method == b.method == 'mtp' and b.model_dump()['method'] == 'mtp'
    assert strategy_for(a) == strategy_for(b) == MTP and MTP.token_lookahead == 1
    c = SpeculativeConfig(method='ngram')
    c.method = 'qwen3_next_mtp'
    assert c.method == 'mtp'
    parser = serve.add_parser(argparse.ArgumentParser().add_subparsers())
    for name in ('mtp', 'qwen3_next_mtp'):
        args = parser.parse_args(['MODEL', '--speculative-algorithm', name])
        assert engine_config_from_args(args).speculative_config.method == 'mtp'
    with pytest.raises(ValueError, match='method'):
        SpeculativeConfig(method='nextn')
