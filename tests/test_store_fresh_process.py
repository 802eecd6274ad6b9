"""A Store restore in a fresh process, once per cache kind: what one process saved to the
Mooncake Store, a new process (new engines, empty local caches) restores and decodes the same
tokens, for every kind of cached state the engine serializes.

    kind                    families                        objects per saved prefix
    gated delta rule + KV   qwen3_next, qwen3_5_moe_text    state checkpoints + KV blocks
    KDA + MLA latent        kimi_linear, glm5_next          state + latent (and indexer-key) blocks
    Mamba-2 + KV            nemotron_h, granitemoehybrid    state + KV blocks
    Mamba-1 + KV            jamba                           state + KV blocks
    short conv + KV         lfm2                            conv-only state + KV blocks
    lightning + KV          minimax                         recurrent-only state + KV blocks
    state only              mamba2                          state checkpoints alone
    window rows + KV        lara_mini                       state + KV blocks (global layers) + window
                                                            objects (sliding layers, each save's window)
    speculative decoding    qwen3_next (MTP, n-gram)        as gated delta rule + KV, drafts on

plus one prompt with an image (glm5_next: the image's content hash is in the Store keys, so the
reader must restore past it) and one conversation split between the two processes (qwen3_next:
the reader continues from the Store what the writer began).

Why one writer and one reader process for all of them: what a fresh process proves (Store keys
and namespaces reproducible across processes, objects decoded by a process that never saw them
written) is per cache kind, while each process start costs an interpreter and a torch import;
two starts for every kind instead of two per family buy back most of that time. A job that
fails in a worker reports its traceback in its own result (tests/store_worker.py), so each test
still fails for its own family only. Every family keeps its cheap in-process new-engine Store
restore in its own test file.

Geometry: B = 16, A = 64, P = 64 (tests/store_engine_utils.py); every family gets a namespace of
its own, so the session's shared Store never holds its prompt beforehand.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine_utils import make_engine, random_prompt
from lmdeploy import GenerationConfig
from store_engine_utils import B, GEN, P, cold, cold_conversation, store_config  # noqa: F401 (cold: a fixture)

WORKER = Path(__file__).resolve().parent / 'store_worker.py'

KINDS = {
    'gated_delta_rule_kv': ('qwen3_next', 'qwen3_5_moe_text'),
    'kda_mla_latent': ('kimi_linear', 'glm5_next'),
    'mamba2_kv': ('nemotron_h', 'granitemoehybrid'),
    'mamba1_kv': ('jamba',),
    'short_conv_kv': ('lfm2',),
    'lightning_kv': ('minimax',),
    'state_only': ('mamba2',),
    'window_rows_kv': ('lara_mini',),
}
NOTHING_PAGED = {'mamba2'}
# window objects per arch: the blocks [window_first_block(b, W), b/B) of save points 64 ... 256 (W = 40)
WINDOW_OBJECTS = {'lara_mini': 12}
SPEC_METHODS = ('qwen3_next_mtp', 'ngram')
SPEC_GEN = GenerationConfig(max_new_tokens=12, ignore_eos=True)
PROMPT = random_prompt(300, seed=301)
_base = random_prompt(100, 31)
SPEC_PROMPT = _base + _base[:40] + random_prompt(60, 32)     # a repeat inside for the n-gram drafter
SPLIT_USERS = [random_prompt(150, seed=310), random_prompt(120, seed=311), random_prompt(100, seed=312)]


@pytest.fixture(scope='module')
def models(tmp_path_factory, tiny_qwen3_next, tiny_qwen3_5_moe_text) -> dict[str, str]:
    """arch → tiny checkpoint path (the session's Qwen3 ones, the others built here)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    paths = {'qwen3_next': tiny_qwen3_next, 'qwen3_5_moe_text': tiny_qwen3_5_moe_text}
    for archs in KINDS.values():
        for arch in archs:
            if arch not in paths:
                paths[arch] = make_tiny_model(str(tmp_path_factory.mktemp(f'tiny_{arch}')), arch=arch, seed=0)
    return paths


def _run(tmp: Path, name: str, jobs: list[dict]) -> list[dict]:
    """Run ``jobs`` one after another in one new store_worker process; their results."""
    job, out = tmp / f'{name}.json', tmp / f'{name}.out.json'
    job.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(WORKER), str(job), str(out)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1'))
    assert out.exists(), proc.stderr[-4000:]       # per-job failures are in the results
    return json.loads(out.read_text())


@pytest.fixture(scope='module')
def image_job(models, mooncake_services, tmp_path_factory) -> dict:
    """The glm5_next job whose one turn is a prompt with one image (a 24-token span before the
    first save point); the image's ``MultimodalInput`` is ``torch.save``d in ``job['multimodal']``."""
    import torch
    from transformers import AutoConfig

    from test_glm5_next import _image_prompt
    ids, mm, _ = _image_prompt(AutoConfig.from_pretrained(models['glm5_next']), 20, (1, 8, 12), 120, seed=5)
    path = tmp_path_factory.mktemp('image') / 'images.pt'
    torch.save((mm,), path)
    return dict(model=models['glm5_next'], history=[], turns=[ids], max_new_tokens=GEN.max_new_tokens,
                multimodal=str(path),
                config=store_config(mooncake_services, store_namespace=f'images-{uuid.uuid4().hex}'))


@pytest.fixture(scope='module')
def runs(models, image_job, mooncake_services, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Name → (writer's result, reader's result): every family's 300-token prompt, the two
    speculative-decoding runs and the split conversation, written by one process and then
    restored (continued) by one fresh process."""
    jobs = {}
    for archs in KINDS.values():
        for arch in archs:
            jobs[arch] = dict(model=models[arch], history=[], turns=[PROMPT], max_new_tokens=GEN.max_new_tokens,
                              config=store_config(mooncake_services, store_namespace=f'fresh-{uuid.uuid4().hex}'))
    for method in SPEC_METHODS:
        config = store_config(mooncake_services, num_checkpoint_slots=16,
                              speculative_config=dict(method=method, num_speculative_tokens=2),
                              store_namespace=f'spec-restore-{method}-{uuid.uuid4().hex}')
        jobs[f'spec_{method}'] = dict(model=models['qwen3_next'], config=config, history=[], turns=[SPEC_PROMPT],
                                      max_new_tokens=SPEC_GEN.max_new_tokens)
    jobs['image'] = image_job
    jobs['split'] = dict(model=models['qwen3_next'], history=[], turns=SPLIT_USERS[:1],
                         max_new_tokens=GEN.max_new_tokens,
                         config=store_config(mooncake_services, store_namespace=f'split-{uuid.uuid4().hex}'))
    tmp = tmp_path_factory.mktemp('fresh_process')
    written = dict(zip(jobs, _run(tmp, 'writer', list(jobs.values()))))
    readers = dict(jobs)
    readers['split'] = dict(jobs['split'], history=written['split'].get('history', []), turns=SPLIT_USERS[1:])
    restored = dict(zip(readers, _run(tmp, 'reader', list(readers.values()))))
    return {name: (written[name], restored[name]) for name in jobs}


def _ok(result: dict, name: str) -> dict:
    assert 'error' not in result, f'{name}: {result.get("error")}'
    assert result['idle'], name
    return result


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_a_fresh_process_restores_the_prompt_another_process_saved(kind, runs, models):
    """Writer: save points 64..256, 4 state objects and the 16 blocks below 256 (none when
    nothing is paged; with window rows also the window objects of each save point's window), no hit. Reader: 256 tokens from the Store (none locally), nothing put,
    and both decode what an engine with caching off decodes."""
    for arch in KINDS[kind]:
        a, b = (_ok(r, arch) for r in runs[arch])
        (ta,), (tb,) = a['turns'], b['turns']
        assert ta['save_points'] == [64, 128, 192, 256] and ta['cached_tokens'] == 0, arch
        assert tb['cached_tokens'] == tb['store_hit_tokens'] == 256 and tb['local_hit_tokens'] == 0, arch
        assert tb['save_points'] == [], arch
        window = {'window': WINDOW_OBJECTS[arch]} if arch in WINDOW_OBJECTS else {}
        assert a['stats']['store_put_objects'] == {'state': 4, 'kv': 0 if arch in NOTHING_PAGED else 16,
                                                   **window}, arch
        assert b['stats']['store_put_objects'] == {'state': 0, 'kv': 0, **{k: 0 for k in window}}, arch
        assert b['stats']['store_hit_tokens'] == 256, arch
        cold = make_engine(models[arch], max_prefill_token_num=P).generate(PROMPT, GEN).output_ids
        assert ta['output_ids'] == tb['output_ids'] == cold, arch


@pytest.mark.parametrize('method', SPEC_METHODS)
def test_a_fresh_process_restores_with_drafts_on_and_decodes_the_plain_tokens(method, runs, models):
    """Process A saves a prompt with drafts on, process B (empty local cache) restores 192
    tokens from the Store; both decode exactly the tokens of plain decoding with caching off,
    and B's MTP drafts were verified."""
    from test_spec_decode_mtp import plain
    a, b = (_ok(r, method) for r in runs[f'spec_{method}'])
    (ta,), (tb,) = a['turns'], b['turns']
    assert ta['store_hit_tokens'] == 0 and tb['store_hit_tokens'] == tb['cached_tokens'] == 192
    assert ta['output_ids'] == tb['output_ids'] == plain(models['qwen3_next'], SPEC_PROMPT, SPEC_GEN)
    if method == 'qwen3_next_mtp':
        assert b['stats']['spec_decode_verify_steps'] > 0


def test_conversation_split_between_two_processes_continues_from_the_store(runs, cold):
    """Turn 1 in the writer process; turns 2 and 3 in the reader (empty local cache): turn 2
    restores the writer's deepest save from the Store, turn 3 the reader's own checkpoint, and
    the reader re-puts none of the writer's blocks."""
    a, b = (_ok(r, 'split') for r in runs['split'])
    turns = a['turns'] + b['turns']
    assert [t['output_ids'] for t in turns] == cold_conversation(cold, SPLIT_USERS)
    assert [t['num_tokens'] for t in turns] == [150, 276, 382]
    assert [t['save_points'] for t in turns] == [[64, 128], [192, 256], [320]]
    # turn 2: B's empty local cache, A's deepest save from the Store; turn 3: B's own checkpoint
    assert [(t['store_hit_tokens'], t['local_hit_tokens']) for t in turns] == [(0, 0), (128, 0), (0, 256)]
    S, K = a['stats']['store_put_bytes']['state'] // 2, a['stats']['store_put_bytes']['kv'] // 8
    assert b['stats']['store_put_bytes'] == {'state': 3 * S, 'kv': (320 - 128) // B * K}   # A's blocks not re-put


def test_a_fresh_process_restores_past_an_image_another_process_saved(runs, models, image_job):
    """The writer saves a prompt with one image (its own namespace); the reader (empty local
    cache) restores past the image from the Store, and both decode what an engine with caching
    off decodes from the same image."""
    import torch
    a, b = (_ok(r, 'image') for r in runs['image'])
    (ta,), (tb,) = a['turns'], b['turns']
    multimodal = torch.load(image_job['multimodal'], weights_only=False)
    assert ta['cached_tokens'] == 0 and ta['save_points']
    assert tb['cached_tokens'] == tb['store_hit_tokens'] == ta['save_points'][-1] and tb['local_hit_tokens'] == 0
    assert tb['store_hit_tokens'] >= max(m.end for m in multimodal)
    (ids,) = image_job['turns']
    cold = make_engine(models['glm5_next'], max_prefill_token_num=P).generate(ids, GEN, multimodal=multimodal)
    assert ta['output_ids'] == tb['output_ids'] == cold.output_ids
