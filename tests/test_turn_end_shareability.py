"""Turn-end checkpoints never cost the prompt's shareability (issue 31, item 3): with
``decode_save_last`` a fresh engine restores from the Store at least as much for a regenerate of
the same prompt or an edited reply as ``prefill_save_last_only`` alone, and more for the exact
continuation — exactly the hits and bytes benchmark/store_follow_ups.py predicts. (The former
rule put the turn end *instead of* the prompt's save point: 0 tokens for both.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_utils import random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.store_follow_ups import follow_ups  # noqa: E402

B, A, P = 16, 64, 64
N, REPLY, NEW, EDIT_AT = 150, 40, 20, 10


def test_simulator_rule_never_restores_less_than_last_only():
    """Over prompt and reply lengths: the chosen rule's hits are >= last-only's for every
    workload, and its continue hit >= the former rule's."""
    for n in range(65, 400, 37):
        for reply in (1, 3, 17, 40, 130):
            rows = {r.policy: r for r in follow_ups(n, reply, 10, 1, chunk_size=P, block_size=B, alignment=A,
                                                   new_tokens=NEW, edit_at=reply // 2)}
            lo, te, old = rows['last-only'], rows['last-only+turn-end'], rows['last-only+turn-end-replacing']
            assert all(te.hits[w] >= lo.hits[w] for w in lo.hits), (n, reply, rows)
            assert te.hits['continue'] >= old.hits['continue'], (n, reply, rows)


def _engine(model, services, namespace, **policy) -> Engine:
    return Engine(model, PytorchEngineConfig(
        device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
        enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=16, max_batch_size=2,
        mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
        mooncake_local_buffer_size=1 << 20, store_namespace=namespace, prefill_save_last_only=True, **policy))


@pytest.mark.parametrize('decode_save_last', [False, True], ids=['last_only', 'last_only+turn_end'])
def test_a_fresh_engine_restores_regenerate_edit_and_continue_as_predicted(tiny_qwen3_next, mooncake_services,
                                                                           decode_save_last):
    namespace = f'shareability-{decode_save_last}'
    prompt = random_prompt(N, 9100)
    writer = _engine(tiny_qwen3_next, mooncake_services, namespace, decode_save_last=decode_save_last)
    try:
        before = writer.stats()['store_put_bytes']
        reply = writer.generate(prompt, GenerationConfig(max_new_tokens=REPLY, ignore_eos=True)).output_ids
        assert writer.store.flush(timeout=30)
        after = writer.stats()['store_put_bytes']
        S, K = writer.cache_engine.state_bytes, writer.cache_engine.kv_block_bytes
    finally:
        writer.close()
    # each from a fresh engine (an empty local cache), in an order where no reader's own puts
    # (it is a writer too) serve a later one: the regenerate's turn end at floor_16(150) = 144
    # would serve the edit
    follow = {'edit': prompt + reply[:EDIT_AT] + random_prompt(REPLY - EDIT_AT + NEW, 9101),
              'regenerate': prompt,
              'continue': prompt + reply + random_prompt(NEW, 9102)}
    hits = {}
    for workload, ids in follow.items():
        reader = _engine(tiny_qwen3_next, mooncake_services, namespace, decode_save_last=decode_save_last)
        try:
            seq = reader.generate(ids, GenerationConfig(max_new_tokens=1))
            hits[workload] = seq.stats.store_hit_tokens
        finally:
            reader.close()
    name = 'last-only+turn-end' if decode_save_last else 'last-only'
    (predicted, ) = follow_ups(N, REPLY, S, K, chunk_size=P, block_size=B, alignment=A, new_tokens=NEW,
                               edit_at=EDIT_AT, policies=[name])
    assert hits == predicted.hits
    assert sum(after[k] - before[k] for k in ('state', 'kv')) == predicted.total_bytes
    assert hits['regenerate'] == hits['edit'] == 128            # b* = last_reusable(150), also with the turn end
    assert hits['continue'] == (176 if decode_save_last else 128)   # te = floor_16(150 + 40 - 1)
