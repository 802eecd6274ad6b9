"""Prompt log-probabilities (GenerationConfig.prompt_logprobs; completions echo + logprobs and
vLLM's prompt_logprobs in the API): equal to transformers' log_softmax on the same weights,
over chunked prefill, with the prefix cache on (the prompt is recomputed: no cached tokens) and
through the API."""
from __future__ import annotations

import pytest
import torch
from engine_utils import hf_prompt_logits, load_hf, make_engine, random_prompt

from lmdeploy import GenerationConfig

TOL = 1e-4      # fp32 logits against transformers (log_softmax keeps the difference)


def _reference(hf, ids: list[int], k: int):
    logp = torch.log_softmax(hf_prompt_logits(hf, ids), dim=-1)[:-1]
    nxt = torch.tensor(ids[1:])
    chosen = logp.gather(1, nxt[:, None])[:, 0]
    return chosen, (logp > chosen[:, None]).sum(-1) + 1, torch.topk(logp, k, dim=-1)


@pytest.mark.parametrize('arch', ['tiny_qwen3', 'tiny_qwen3_next'])
def test_prompt_logprobs_equal_transformers_and_skip_the_cache(arch, request):
    model = request.getfixturevalue(arch)
    hf = load_hf(model)
    eng = make_engine(model, num_gpu_blocks=128, block_size=16, prefill_save_alignment=32,
                      max_prefill_token_num=48, enable_prefix_caching=True)
    try:
        ids = random_prompt(130, 4)
        k = 3
        chosen, ranks, (top_v, top_i) = _reference(hf, ids, k)
        plain = eng.generate(ids, GenerationConfig(max_new_tokens=3))         # caches the prompt
        for _ in range(2):
            seq = eng.generate(ids, GenerationConfig(max_new_tokens=3, prompt_logprobs=k))
            assert seq.num_cached_tokens == 0 and seq.output_ids == plain.output_ids
            lps = seq.prompt_logprobs
            assert [lp.token_id for lp in lps] == ids[1:]
            assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), chosen, atol=TOL)
            assert [lp.rank for lp in lps] == ranks.tolist()
            assert torch.allclose(torch.tensor([[v for _, v in lp.top] for lp in lps]), top_v, atol=TOL)
        assert eng.generate(ids, GenerationConfig(max_new_tokens=3)).num_cached_tokens > 0
        assert eng.is_idle()
    finally:
        eng.close()


@pytest.fixture(scope='module')
def client(tiny_qwen3):
    from starlette.testclient import TestClient

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.pipeline import Pipeline
    pipe = Pipeline(tiny_qwen3, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=64,
                                                    block_size=16, enable_prefix_caching=True))
    with TestClient(create_app(pipe, 'tiny')) as c:
        c.pipe = pipe
        yield c
    pipe.close()


def test_completions_echo_with_logprobs(client, tiny_qwen3):
    import json
    hf = load_hf(tiny_qwen3)
    prompt = 'Once upon a time there was'
    ids = client.pipe.encode(prompt, do_preprocess=False)
    chosen, _, _ = _reference(hf, ids, 1)
    body = {'model': 'tiny', 'prompt': prompt, 'max_tokens': 4, 'logprobs': 2, 'echo': True}
    r = client.post('/v1/completions', json=body)
    assert r.status_code == 200, r.text
    choice = r.json()['choices'][0]
    lp = choice['logprobs']
    n = len(ids)
    assert choice['text'].startswith(prompt) and len(lp['tokens']) == n + 4
    assert lp['token_logprobs'][0] is None and lp['top_logprobs'][0] is None
    assert torch.allclose(torch.tensor(lp['token_logprobs'][1:n]), chosen, atol=TOL)
    assert lp['text_offset'][:n] == sorted(lp['text_offset'][:n]) and lp['text_offset'][n] == len(prompt)
    # streamed: the same logprobs, the prompt's with the echoed text
    streamed = {'tokens': [], 'token_logprobs': []}
    with client.stream('POST', '/v1/completions', json=dict(body, stream=True)) as s:
        for line in s.iter_lines():
            if line.startswith('data: {'):
                for c in json.loads(line[6:])['choices']:
                    for key in streamed:
                        streamed[key] += (c['logprobs'] or {}).get(key, [])
    assert streamed == {key: lp[key] for key in streamed}


def test_prompt_logprobs_extension_on_chat_and_completions(client, tiny_qwen3):
    hf = load_hf(tiny_qwen3)
    r = client.post('/v1/completions', json={'model': 'tiny', 'prompt': [5, 6, 7, 8, 9], 'max_tokens': 2,
                                             'prompt_logprobs': 1})
    assert r.status_code == 200, r.text
    got = r.json()['choices'][0]['prompt_logprobs']
    chosen, ranks, _ = _reference(hf, [5, 6, 7, 8, 9], 1)
    assert got[0] is None and len(got) == 5
    for entry, t, v, rank in zip(got[1:], [6, 7, 8, 9], chosen.tolist(), ranks.tolist()):
        assert abs(entry[str(t)]['logprob'] - v) <= TOL and entry[str(t)]['rank'] == rank
        assert any(e['rank'] == 1 for e in entry.values())
    r = client.post('/v1/chat/completions', json={'model': 'tiny', 'max_tokens': 2, 'prompt_logprobs': 0,
                                                  'messages': [{'role': 'user', 'content': 'hi'}]})
    body = r.json()
    assert r.status_code == 200 and body['prompt_logprobs'][0] is None
    assert len(body['prompt_logprobs']) == body['usage']['prompt_tokens']
    assert body['usage']['prompt_tokens_details']['cached_tokens'] == 0


def test_prompt_logprobs_at_tp2_equal_transformers(tiny_qwen3_next):
    """The one worker path computes prompt logits on every rank: tp=2 serves prompt
    log-probabilities too, equal to transformers'."""
    hf = load_hf(tiny_qwen3_next)
    eng = make_engine(tiny_qwen3_next, tp=2, num_gpu_blocks=64, block_size=16, max_prefill_token_num=32)
    try:
        ids = random_prompt(70, 9)
        chosen, ranks, _ = _reference(hf, ids, 2)
        seq = eng.generate(ids, GenerationConfig(max_new_tokens=2, prompt_logprobs=2))
        lps = seq.prompt_logprobs
        assert [lp.token_id for lp in lps] == ids[1:]
        assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), chosen, atol=TOL)
        assert [lp.rank for lp in lps] == ranks.tolist()
    finally:
        eng.close()
