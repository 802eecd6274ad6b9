"""Speculative decoding in the engine: outputs equal plain decoding, drafts are accepted or
rolled back exactly, and the prefix cache never sees a draft.

Geometry: B = 16, A = 64, P = 64 (several prefill chunks and save points per prompt). Every
output is compared with the same prompts decoded plainly (no drafts, caching off).

Draft sources used here:
- n-gram lookup on the random tiny model (drafts are proposed only where the sequence repeats,
  and are mostly wrong: the rollback path);
- *scripted* drafts: the plain output itself with chosen positions corrupted, so the number of
  accepted tokens per step is known exactly (partial acceptance, rollback of hybrid state);
- a *copying* model (the tiny model with its residual branches scaled down and ``lm_head`` a
  permutation of the embedding): it continues a fixed chain of tokens, so on a prompt that
  quotes the chain, n-gram drafts are mostly accepted;
- the MTP head of the tiny checkpoint (random: mostly rejected).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine_utils import random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)
CACHE = {'off': dict(enable_prefix_caching=False),
         'on': dict(enable_prefix_caching=True),
         'last_only': dict(enable_prefix_caching=True, prefill_save_last_only=True)}
_PLAIN: dict[tuple, list[int]] = {}


def engine(path: str, method: str | None = None, k: int = 3, cache: str = 'off', **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               num_gpu_blocks=384, num_checkpoint_slots=16, max_batch_size=8)
    cfg.update(CACHE[cache])
    if method is not None:
        cfg['speculative_config'] = dict(method=method, num_speculative_tokens=k)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def plain(path: str, ids: list[int], gen: GenerationConfig = GEN) -> list[int]:
    """Greedy output without drafts or caching (memoized)."""
    key = (path, tuple(ids), gen.max_new_tokens)
    if key not in _PLAIN:
        _PLAIN[key] = engine(path).generate(ids, gen).output_ids
    return _PLAIN[key]


def run_batch(eng: Engine, prompts: list[list[int]], gen: GenerationConfig = GEN) -> list[list[int]]:
    seqs = [eng.add_request(p, gen) for p in prompts]
    for _ in range(2000):
        if all(s.is_finished for s in seqs):
            break
        eng.step()
    assert all(s.is_finished for s in seqs)
    return [s.output_ids for s in seqs]


def assert_idle(eng: Engine) -> None:
    led = eng.ledger()
    assert eng.is_idle(), led
    assert led['blocks_free'] + led['blocks_cached'] == led['blocks_total']


def repetitive_prompt(seed: int, n: int = 40) -> list[int]:
    """A prompt that quotes itself (code-edit style), so n-gram lookup finds matches."""
    base = random_prompt(n, seed)
    return base + base[: n // 2] + base + base[: n // 3]


PROMPTS = [repetitive_prompt(s) for s in range(8)]


# ------------------------------------------------------------------ n-gram: identical outputs
@pytest.mark.parametrize('cache', ['off', 'on', 'last_only'])
def test_ngram_greedy_equals_plain_single_and_8_concurrent(tiny_qwen3_next, cache):
    eng = engine(tiny_qwen3_next, 'ngram', cache=cache)
    expected = [plain(tiny_qwen3_next, p) for p in PROMPTS]
    assert eng.generate(PROMPTS[0], GEN).output_ids == expected[0]
    assert run_batch(eng, PROMPTS) == expected
    if cache != 'off':          # warm: restored prefixes, then drafts on top
        assert run_batch(eng, PROMPTS) == expected
        assert eng.stats()['prefix_cache_hit_tokens'] > 0
    stats = eng.stats()
    assert stats['spec_decode_draft_tokens'] > 0 and stats['spec_decode_rollbacks'] > 0
    assert_idle(eng)


# ------------------------------------------------------------------ scripted drafts
def _script_drafts(eng: Engine, reference: dict[int, list[int]], wrong_at: int | None) -> None:
    """Replace the drafter: each sequence drafts its true continuation (from ``reference``,
    keyed by seq_id), with the draft at index ``wrong_at`` corrupted."""
    spec = eng.spec

    def propose(sched, new_tokens):
        for chunk in sched.chunks:
            seq = chunk.seq
            seq.draft_ids = []
            room = spec._draft_room(seq) if seq.seq_id in new_tokens and seq.seq_id in reference else 0
            if room:
                truth = reference[seq.seq_id][seq.num_generated:seq.num_generated + room]
                drafts = list(truth)
                if wrong_at is not None and wrong_at < len(drafts):
                    drafts[wrong_at] = 3 + (drafts[wrong_at] - 2) % 1000    # any other plain token
                seq.draft_ids = drafts

    spec.propose = propose


@pytest.mark.parametrize('model', ['tiny_qwen3_next', 'tiny_qwen3'])
@pytest.mark.parametrize('wrong_at', [None, 2, 0])
def test_scripted_drafts_accept_exactly_the_correct_prefix(request, model, wrong_at):
    path = request.getfixturevalue(model)
    K = 3
    gen = GenerationConfig(max_new_tokens=25, ignore_eos=True)
    prompts = [random_prompt(37 + 5 * i, 40 + i) for i in range(3)]
    expected = [plain(path, p, gen) for p in prompts]
    eng = engine(path, 'ngram', k=K, cache='on')
    seqs = [eng.add_request(p, gen) for p in prompts]
    _script_drafts(eng, {s.seq_id: e for s, e in zip(seqs, expected)}, wrong_at)
    emitted = []
    while not all(s.is_finished for s in seqs):
        emitted.append({o.seq.seq_id: len(o.new_token_ids) for o in eng.step()})
    assert [s.output_ids for s in seqs] == expected
    stats = eng.stats()
    per_step = {None: K + 1, 2: 3, 0: 1}[wrong_at]     # accepted drafts + the target's token
    for step in emitted[1:-1]:      # the first step is the prefill, the last may be cut by max_new_tokens
        assert set(step.values()) <= {per_step, 1}, step
    accepted = {None: K, 2: 2, 0: 0}[wrong_at]
    assert stats['spec_decode_accepted_tokens'] >= accepted * (stats['spec_decode_verify_steps'] - 3)
    if model == 'tiny_qwen3_next':   # hybrid state is rolled back unless every draft was kept
        assert (stats['spec_decode_rollbacks'] == 0) == (wrong_at is None)
    assert_idle(eng)


def test_rejected_draft_kv_is_never_published(tiny_qwen3_next):
    """Drafts that are wrong write KV past the accepted tokens; the blocks the cache holds after
    the request equal those of plain decoding, and a warm request restoring them decodes the
    same tokens."""
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    ids = random_prompt(60, 7)
    expected = plain(tiny_qwen3_next, ids, gen)
    eng = engine(tiny_qwen3_next, 'ngram', k=4, cache='on', decode_save_last=True)
    seq = eng.add_request(ids, gen)
    _script_drafts(eng, {seq.seq_id: expected}, wrong_at=1)
    while not seq.is_finished:
        eng.step()
    assert seq.output_ids == expected
    # the turn-end checkpoint (a decode-time save) is at a block boundary of accepted tokens
    assert seq.stats.turn_end_point is not None and seq.stats.turn_end_point % B == 0
    # every cached block holds the KV plain decoding writes for the same tokens
    ref = engine(tiny_qwen3_next, cache='on', decode_save_last=True)
    ref.generate(ids, gen)

    def cached_rows(eng):
        return {node.key: eng.cache_engine.kv_buf[node.block_id, :eng.cache_engine.kv_block_bytes].view(torch.float32)
                for node in eng.prefix_cache.local.trie.iter_nodes()}

    got, want = cached_rows(eng), cached_rows(ref)
    assert set(got) == set(want) and len(got) == (len(ids) + len(expected) - 1) // B
    # 1e-4 (the fp32 tolerance against transformers), not exact: the spec run computes the same
    # tokens in chunks of 2-5 (chunked delta rule) where plain decoding runs them one at a time;
    # KV written for another token at a position differs by orders of magnitude more
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-4
    # a follow-up turn restores prompt + reply from the cache and must continue exactly
    follow = ids + expected + random_prompt(5, 8)
    warm = eng.generate(follow, gen)
    assert warm.num_cached_tokens == seq.stats.turn_end_point
    assert warm.output_ids == plain(tiny_qwen3_next, follow, gen)
    assert_idle(eng)


# ------------------------------------------------------------------ a copying model
@pytest.fixture(scope='module')
def copying_model(tiny_qwen3_next, tmp_path_factory) -> tuple[str, list[int]]:
    """The tiny model rewired to continue a fixed chain: next token = chain successor of the
    current one (residual branches scaled by 0.1, ``lm_head`` = permuted embedding). Returns
    the path and the chain."""
    from safetensors.torch import load_file, save_file
    out = str(tmp_path_factory.mktemp('copying'))
    for name in os.listdir(tiny_qwen3_next):
        if name != 'model.safetensors':
            shutil.copy(os.path.join(tiny_qwen3_next, name), out)
    w = load_file(os.path.join(tiny_qwen3_next, 'model.safetensors'))
    for name in w:
        if name.endswith(('o_proj.weight', 'out_proj.weight', 'down_proj.weight')):
            w[name] = w[name] * 0.1
    emb = w['model.embed_tokens.weight']
    chain = (torch.randperm(emb.shape[0] - 3, generator=torch.Generator().manual_seed(0)) + 3).tolist()
    head = torch.zeros_like(emb)
    for a, b in zip(chain, chain[1:] + chain[:1]):
        head[b] = emb[a]                 # logit of b is largest when the hidden state is token a's
    w['lm_head.weight'] = head.contiguous()
    save_file(w, os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
    return out, chain


def test_ngram_on_a_copying_model_accepts_most_drafts(copying_model):
    path, chain = copying_model
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    # an edit of quoted code: the chain is quoted, then rewritten from its start
    prompts = [chain[100 * i:100 * i + 80] + chain[100 * i:100 * i + 6] for i in range(4)]
    for p, i in zip(prompts, range(4)):
        assert plain(path, p, gen) == chain[100 * i + 6:100 * i + 54], 'the rewired model must follow the chain'
    eng = engine(path, 'ngram', k=4)
    assert run_batch(eng, prompts, gen) == [plain(path, p, gen) for p in prompts]
    stats = eng.stats()
    rate = stats['spec_decode_accepted_tokens'] / stats['spec_decode_draft_tokens']
    assert rate > 0.9, stats
    # most steps emit K + 1 tokens: far fewer verify steps than tokens
    assert stats['spec_decode_verify_steps'] * 3 < 4 * 47
    assert_idle(eng)


# ------------------------------------------------------------------ sampling keeps the distribution
def test_sampling_with_drafts_keeps_the_plain_distribution(tiny_qwen3_next):
    """Chi-square goodness of fit of (first, second) generated tokens over 600 seeds against the
    exact plain-sampling law p(t1) p(t2 | t1), top-k 3: the second token always goes through
    speculative sampling of a draft the target gives probability strictly between 0 and 1."""
    from scipy.stats import chi2

    from lmdeploy.pytorch.sampling.sampler import target_distribution
    gen = dict(do_sample=True, temperature=1.5, top_k=3, max_new_tokens=3, ignore_eos=True)
    ids = random_prompt(8, 77)
    ref = engine(tiny_qwen3_next)

    def probs_after(tokens):
        ref.generate(tokens, GenerationConfig(max_new_tokens=1))
        row = ref.model_runner.last_logits[0]
        return target_distribution(row, ref.requests.sequence(ref.requests.check(tokens, GenerationConfig(**gen))))[1]

    p1 = probs_after(ids)
    support = p1.nonzero().flatten().tolist()
    assert len(support) == 3
    p2 = {t: probs_after(ids + [t]) for t in support}
    # draft the target's second most likely token: accepted with probability p2[t1][draft]
    draft = {t: int(p2[t].argsort(descending=True)[1]) for t in support}
    assert all(0.1 < float(p2[t][draft[t]]) < 0.9 for t in support)
    expected = {(a, b): float(p1[a] * p2[a][b]) for a in support for b in p2[a].nonzero().flatten().tolist()}

    eng = engine(tiny_qwen3_next, 'ngram', k=1)

    def propose(sched, new_tokens):
        for chunk in sched.chunks:
            seq = chunk.seq
            seq.draft_ids = [draft[seq.output_ids[0]]] if seq.num_generated == 1 and not seq.is_finished else []

    eng.spec.propose = propose
    n, counts = 600, {}
    for start in range(0, n, 8):
        seqs = [eng.add_request(ids, GenerationConfig(random_seed=s, **gen)) for s in range(start, start + 8)]
        while not all(s.is_finished for s in seqs):
            eng.step()
        for s in seqs:
            key = tuple(s.output_ids[:2])
            counts[key] = counts.get(key, 0) + 1
    stats = eng.stats()
    assert stats['spec_decode_verify_steps'] == n
    assert 0.1 * n < stats['spec_decode_accepted_tokens'] < 0.9 * n     # both paths taken
    assert set(counts) <= set(expected)
    keys = sorted(expected)
    stat = sum((counts.get(k, 0) - n * expected[k]) ** 2 / (n * expected[k]) for k in keys)
    assert chi2.sf(stat, len(keys) - 1) > 1e-3, (counts, expected)
    assert_idle(eng)


def test_draft_and_accepted_token_counters_are_exported(copying_model):
    from prometheus_client import CollectorRegistry, generate_latest

    from lmdeploy.metrics import EngineStatsCollector
    path, chain = copying_model
    eng = engine(path, 'ngram', k=4)
    eng.generate(chain[:40] + chain[:4], GenerationConfig(max_new_tokens=20, ignore_eos=True))
    stats = eng.stats()
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(eng.stats))
    text = generate_latest(registry).decode()
    assert f"lmdeploy_spec_decode_draft_tokens_total {float(stats['spec_decode_draft_tokens'])}" in text
    assert f"lmdeploy_spec_decode_accepted_tokens_total {float(stats['spec_decode_accepted_tokens'])}" in text
    assert 0 < stats['spec_decode_accepted_tokens'] <= stats['spec_decode_draft_tokens']


def test_pipeline_with_drafts_streams_the_same_text_and_stops_at_stop_strings(copying_model):
    """Several tokens per step reach the pipeline as one delta; text, ids, stop strings and
    cached tokens are those of plain decoding."""
    from lmdeploy import pipeline
    path, chain = copying_model
    base = dict(device_type='cpu', dtype='float32', session_len=512, block_size=16, num_gpu_blocks=128,
                max_prefill_token_num=64, max_batch_size=4)
    prompt = chain[:60] + chain[:5]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    with pipeline(path, backend_config=PytorchEngineConfig(**base)) as plain_pipe:
        want = plain_pipe([prompt], gen_config=gen)[0]
        stop_text = plain_pipe.tokenizer.decode(want.token_ids[12:14], skip_special_tokens=True)
        want_stop = plain_pipe([prompt], gen_config=GenerationConfig(max_new_tokens=30, ignore_eos=True,
                                                                     stop_words=[stop_text]))[0]
    spec = dict(method='ngram', num_speculative_tokens=4)
    with pipeline(path, backend_config=PytorchEngineConfig(speculative_config=spec, **base)) as p:
        got = p([prompt], gen_config=gen)[0]
        deltas = list(p.stream_infer([prompt], gen_config=gen))
        got_stop = p([prompt], gen_config=GenerationConfig(max_new_tokens=30, ignore_eos=True,
                                                           stop_words=[stop_text]))[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert sum((d.token_ids for d in deltas), []) == want.token_ids and ''.join(d.text for d in deltas) == want.text
    assert len(deltas) < len(want.token_ids)            # drafts were accepted: fewer deltas than tokens
    assert (got_stop.text, got_stop.finish_reason) == (want_stop.text, want_stop.finish_reason)
