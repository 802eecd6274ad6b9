"""The Mooncake Store tier at engine level, against a real ``mooncake_master`` (issue 6).

Every test drives the tiny hybrid Qwen3-Next model greedily and checks, against an engine with
caching off: identical output ids, exact Store put bytes per turn (``len(save_points)·S +
new_blocks·K_blk`` with S and K_blk from the layer specs, equal to the simulator), the exact
cached tokens of a Store restore (in a fresh process, and a conversation split between two
processes: tests/test_store_fresh_process.py, one writer and one reader process for all kinds),
namespace isolation, rejection of tampered objects, and fault behaviour (killed master, full
store, failed puts). Each test ends with ``engine.is_idle()`` (no in-flight Store operation).

Geometry: B = 16 tokens per block, A = 64, P = 64 tokens per prefill chunk (512 for 16K+64).
Tests share the session's Mooncake services; every test draws its own prompt tokens (its own
seeds), so the chained block hashes, hence the Store keys, of one test never meet another's.
Fault tests that kill the master or fill the segment start their own services.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from engine_utils import random_prompt as prompt
from store_engine_utils import A, B, GEN, P, cold, key, make_engine, store_config  # noqa: F401 (others import it here)
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_specs import kv_bytes_per_block, state_bytes_per_slot
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill
from lmdeploy.pytorch.store.object_format import decode_object


ROOT = Path(__file__).resolve().parents[1]


def _simulator():
    name = 'simulate_store_writes'
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / 'benchmark' / f'{name}.py')
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


sim = _simulator()


def record_puts(eng: Engine) -> list[str]:
    """Wrap the engine's Store client so that every attempted put's key is recorded, in order."""
    keys, put = [], eng.store.client.put

    def recording_put(key, value, **kw):
        keys.append(key)
        return put(key, value, **kw)

    eng.store.client.put = recording_put
    return keys


def put_delta(before: dict, after: dict) -> tuple[int, int, int, int]:
    """(state bytes, kv bytes, state objects, kv objects) put between two ``engine.stats()``."""
    return tuple(after[f][k] - before[f][k] for f in ('store_put_bytes', 'store_put_objects') for k in ('state', 'kv'))


# byte accounting ----------------------------------------------------------------------------
USER_TURNS = (150, 150, 40, 200, 90)   # new user tokens of each turn; each reply adds GEN.max_new_tokens


def test_specs_give_the_simulators_S_and_K_blk(make_engine, tiny_qwen3_next):
    eng = make_engine()
    S, K = state_bytes_per_slot(eng.specs), kv_bytes_per_block(eng.specs, B)
    config = json.loads((Path(tiny_qwen3_next) / 'config.json').read_text())
    sizes = sim.sizes_from_config(config, tp=1, block_size=B)
    assert (S, K) == (sizes.state_bytes, sizes.kv_block_bytes) == (eng.cache_engine.state_bytes,
                                                                   eng.cache_engine.kv_block_bytes)
    # 3 linear layers x (conv 128 x 3 + delta 4 x 16 x 16) fp32; 1 full layer x K,V x 16 tokens x 2 heads x 16 fp32
    assert (S, K) == (16896, 4096)


def test_the_simulator_reads_a_vision_language_config_from_its_text_config(tiny_qwen3_5):
    """Qwen3.5's config nests the decoder's fields in ``text_config``: the simulator's S and K_blk
    equal the engine's, at tp 1 and per rank at tp 2."""
    config = json.loads((Path(tiny_qwen3_5) / 'config.json').read_text())
    eng = Engine(tiny_qwen3_5, PytorchEngineConfig(device_type='cpu', block_size=B, num_gpu_blocks=16))
    sizes = sim.sizes_from_config(config, tp=1, block_size=B)
    assert (sizes.state_bytes, sizes.kv_block_bytes) == (eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes)
    half = sim.sizes_from_config(config, tp=2, block_size=B)
    assert half.state_bytes * 2 == sizes.state_bytes


@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_every_turn_puts_save_points_times_S_plus_new_blocks_times_K_blk(make_engine, cold, mooncake_store,
                                                                           last_only):
    eng = make_engine(prefill_save_last_only=last_only)
    S, K = state_bytes_per_slot(eng.specs), kv_bytes_per_block(eng.specs, B)
    puts = record_puts(eng)
    ids, lengths, measured, seen = [], [], [], []
    stored_blocks = 0
    for t, user in enumerate(USER_TURNS):
        ids = ids + prompt(user, seed=100 + 10 * last_only + t)
        before = eng.stats()
        seq = eng.generate(ids, GEN)
        assert eng.store.flush(timeout=30)
        plan = seq.stats.plans[0]
        assert plan == plan_prefill(len(ids), seq.num_cached_tokens, P, B, A, last_only)
        new_blocks = max(0, max(plan.save_points, default=0) // B - stored_blocks)
        delta = put_delta(before, eng.stats())
        assert delta == (len(plan.save_points) * S, new_blocks * K, len(plan.save_points), new_blocks), t
        assert seq.output_ids == cold(ids)
        stored_blocks += new_blocks
        lengths.append(len(ids))
        measured.append(delta[:2])
        seen.append((seq.num_cached_tokens, plan.save_points))
        ids = seq.token_ids
    assert lengths == [150, 306, 352, 558, 654]
    result = sim.simulate(lengths, S, K, chunk_size=P, block_size=B, alignment=A)
    policy = result.last_only if last_only else result.default
    assert [(r.cached_tokens, r.save_points) for r in policy.turns] == seen
    assert [(r.state_bytes, r.kv_bytes) for r in policy.turns] == measured
    assert result.default.num_saves == 10 and result.last_only.num_saves == 5   # the policies differ here

    # exactly these objects were put, each once: a state per save point, KV blocks below the deepest
    saves = [b for _, points in seen for b in points]
    expected = {key(eng, 'state', ids, b) for b in saves} | {key(eng, 'kv', ids, e)
                                                            for e in range(B, max(saves) + 1, B)}
    assert len(puts) == len(set(puts)) and set(puts) == expected
    assert all(mooncake_store.exists(k) for k in expected)
    assert not mooncake_store.exists(key(eng, 'kv', ids, max(saves) + B))   # full block past the last save
    deepest = key(eng, 'state', ids, max(saves))
    assert len(decode_object(mooncake_store.get(deepest), 'state', eng.store.namespace, max(saves), key=deepest)) == S
    stats = eng.stats()
    assert (stats['store_put_failures'], stats['store_get_failures'], stats['store_rejected_objects']) == (0, 0, 0)
    assert eng.is_idle()


@pytest.mark.parametrize('decode_save_last', [False, True], ids=['last_only', 'last_only+turn_end'])
def test_a_turn_ended_early_by_its_caller_is_put_like_a_completed_one(make_engine, decode_save_last):
    """A stop string (or the server's end after the first tool call) ends a request from
    outside the engine. ``finish_early`` books it as a completed turn: with ``decode_save_last``
    the turn-end checkpoint is published and put with its blocks (an abort has none); the
    last-only prefill checkpoint is put either way, at its save point."""
    results = {}
    for how in ('abort', 'finish_early', 'complete'):
        eng = make_engine(prefill_save_last_only=True, decode_save_last=decode_save_last,
                          store_namespace=f'early-{how}-{decode_save_last}')
        ids = prompt(150, seed=71)
        seq = eng.add_request(ids, GenerationConfig(max_new_tokens=20 if how == 'complete' else 40,
                                                    ignore_eos=True))
        while seq.num_generated < 20 and not seq.is_finished:
            eng.step()
        if how != 'complete':
            getattr(eng, how)(seq)
        assert seq.is_finished and eng.store.flush(timeout=30)
        results[how] = (eng.stats()['store_put_objects'], seq.finish_reason, seq.stats.turn_end_point)
        assert eng.is_idle(), how
    # 150 prompt tokens: last-only saves at 128 (8 blocks); 150 + 19 computed: the turn ends at 160
    if decode_save_last:
        assert results['finish_early'] == ({'state': 2, 'kv': 10}, 'stop', 160)
        assert results['abort'] == ({'state': 1, 'kv': 8}, 'abort', None)
    else:
        assert results['finish_early'] == ({'state': 1, 'kv': 8}, 'stop', None)
    assert results['finish_early'][0] == results['complete'][0]
    assert results['finish_early'][2] == results['complete'][2]


def test_last_only_cuts_16k_plus_64_store_bytes_by_the_planned_fraction(make_engine, cold):
    scenario = next(s for s in sim.seed_scenarios() if s.name == '16K+64').scaled(Fraction(1, 16))
    assert scenario.input_lengths == (1028,)
    totals, namespaces = {}, set()
    for last_only in (False, True):
        eng = make_engine(max_prefill_token_num=512, prefill_save_last_only=last_only)
        ids = prompt(1028, seed=200 + last_only)
        seq = eng.generate(ids, GEN)
        assert eng.store.flush(timeout=30)
        assert seq.output_ids == cold(ids)
        assert seq.stats.plans[0].save_points == ([1024] if last_only else [512, 1024])
        stats = eng.stats()
        totals[last_only] = sum(stats['store_put_bytes'].values())
        namespaces.add(eng.store.namespace)
        assert eng.is_idle()
    S, K = eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes
    result = sim.simulate(scenario, S, K, chunk_size=512, block_size=B, alignment=A)
    assert (totals[False], totals[True]) == (result.default.total_bytes, result.last_only.total_bytes)
    assert (totals[False], totals[True]) == (2 * S + 64 * K, S + 64 * K)
    assert 1 - Fraction(totals[True], totals[False]) == result.reduction == Fraction(S, 2 * S + 64 * K)
    assert len(namespaces) == 1     # the policy changes what is written, never the bytes of an object


# isolation and verification ----------------------------------------------------------------
def test_engines_with_another_dtype_or_block_size_get_no_store_hits(make_engine, cold):
    ids = prompt(150, seed=400)
    writer = make_engine()
    assert writer.generate(ids, GEN).output_ids == cold(ids)
    assert writer.store.flush(timeout=30)
    for fields in (dict(dtype='bfloat16'), dict(block_size=32)):
        other = make_engine(**fields)
        seq = other.generate(ids, GEN)
        assert other.store.flush(timeout=30)
        assert seq.num_cached_tokens == 0 and other.stats()['store_hit_tokens'] == 0, fields
        # it saw none of the writer's objects, so it stored its own: 2 states under its namespace
        assert other.stats()['store_put_objects']['state'] == 2, fields
        assert other.store.namespace != writer.store.namespace
        assert other.is_idle()
    reader = make_engine()      # control: the same config does restore
    seq = reader.generate(ids, GEN)
    assert seq.stats.store_hit_tokens == 128 and seq.output_ids == cold(ids)


def test_store_restore_is_kept_in_the_local_prefix_cache(make_engine, cold):
    ids = prompt(150, seed=650)
    writer = make_engine()
    assert writer.generate(ids, GEN).stats.save_points == [64, 128]
    assert writer.store.flush(timeout=30)
    reader = make_engine()
    first = reader.generate(ids, GEN)
    assert (first.stats.store_hit_tokens, first.stats.hit_tokens) == (128, 0)
    assert reader.state_cache.num_published == 1          # the restored state, copied to a checkpoint
    again = reader.generate(ids, GEN)
    assert (again.stats.store_hit_tokens, again.stats.hit_tokens) == (0, 128)
    stats = reader.stats()
    assert (stats['store_hit_tokens'], stats['prefix_cache_hit_tokens']) == (128, 128)
    assert first.output_ids == again.output_ids == cold(ids)
    assert reader.store.flush(timeout=30) and reader.is_idle()


def test_two_restores_of_one_prefix_in_one_step_keep_one_local_checkpoint(make_engine, cold):
    """Two waiting requests restore the same boundary from the Store in the same step: each
    reserves a slot to keep the restore locally, only the first is published, the other slot is
    released (no node pointing at two slots, no slot published for a node it is not in)."""
    ids = prompt(150, seed=81)
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    writer = make_engine(store_namespace='two-restores')
    writer.generate(ids, gen)
    assert writer.store.flush(timeout=30)
    reader = make_engine(store_namespace='two-restores', num_checkpoint_slots=4)
    a, b = reader.add_request(ids, gen), reader.add_request(ids, gen)
    while not (a.is_finished and b.is_finished):
        reader.step()
    assert a.output_ids == b.output_ids == cold(ids)[:4]
    assert a.stats.store_hit_tokens == b.stats.store_hit_tokens == 128
    published = reader.state_cache._published
    assert all(node.checkpoint_slot == slot and node.parent is not None for slot, node in published.items())
    assert reader.ledger()['checkpoints_published'] == 1
    reader.prefix_cache.evict(10 ** 6)
    assert reader.ledger()['checkpoints_published'] == 0 and reader.ledger()['blocks_cached'] == 0
    assert reader.is_idle()


@pytest.mark.parametrize('spans,recompute_blocks,num_tokens,expected', [
    ((), 0, 144, 128),
    (((120, 136), ), 0, 144, 64),     # reusability rule 4: 128 lies inside the span
    ((), 1, 144, 64),                 # rule 3: 128 + 1·16 > floor_16(143) = 128
], ids=['plain', 'span_over_boundary', 'recompute_block'])
def test_store_restore_uses_only_reusable_boundaries(make_engine, cold, spans, recompute_blocks, num_tokens,
                                                     expected):
    ids = prompt(num_tokens, seed=600 + len(spans) + 2 * recompute_blocks)
    writer = make_engine()
    assert writer.generate(ids, GEN).stats.plans[0].save_points == [64, 128]
    assert writer.store.flush(timeout=30)
    reader = make_engine()
    seq = reader.generate(ids, GEN, multimodal_spans=spans, recompute_blocks=recompute_blocks)
    assert seq.stats.store_hit_tokens == seq.num_cached_tokens == expected
    assert seq.output_ids == cold(ids)
    assert reader.store.flush(timeout=30) and reader.is_idle()


def test_turn_end_checkpoint_reaches_the_store_and_a_fresh_engine_restores_past_the_reply(make_engine,
                                                                                         tiny_qwen3_next):
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    cold_engine = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256))
    writer = make_engine(decode_save_last=True, prefill_save_last_only=True)
    one = writer.generate(prompt(100, seed=900), gen)          # 100 + 29 computed: turn end at 128
    assert one.stats.turn_end_point == 128 and one.stats.save_points == [64]
    assert writer.store.flush(timeout=30)
    S, K = writer.cache_engine.state_bytes, writer.cache_engine.kv_block_bytes
    stats = writer.stats()
    # the prefill checkpoint at 64 and the turn end at 128 are both put (a regenerate needs 64), with 8 blocks
    assert stats['store_put_bytes'] == {'state': 2 * S, 'kv': 8 * K}
    reader = make_engine(decode_save_last=True, prefill_save_last_only=True)
    ids = one.token_ids + prompt(40, seed=901)
    two = reader.generate(ids, gen)
    assert two.num_cached_tokens == 128 and two.stats.store_hit_tokens == 128
    assert two.output_ids == cold_engine.generate(ids, gen).output_ids
    assert reader.store.flush(timeout=30) and reader.is_idle()


def test_turn_end_policy_puts_the_prefill_checkpoint_when_the_turn_end_is_not_reached(make_engine,
                                                                                     tiny_qwen3_next):
    """One new token after a 65-token prompt: the turn's last block boundary (64 of 65 computed)
    is the prefill save point itself, so no turn-end checkpoint is published there; the put of
    the prefill checkpoint at 64 is made, and a fresh engine restores it."""
    gen = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    cold_engine = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256))
    writer = make_engine(decode_save_last=True, prefill_save_last_only=True)
    ids = prompt(65, seed=910)
    one = writer.generate(ids, gen)
    assert one.stats.turn_end_point is None and one.stats.save_points == [64]
    assert writer.store.flush(timeout=30)
    S, K = writer.cache_engine.state_bytes, writer.cache_engine.kv_block_bytes
    assert writer.stats()['store_put_bytes'] == {'state': S, 'kv': 4 * K}
    reader = make_engine(decode_save_last=True, prefill_save_last_only=True)
    follow = ids + prompt(40, seed=911)
    two = reader.generate(follow, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert two.stats.store_hit_tokens == 64
    assert two.output_ids == cold_engine.generate(follow, GenerationConfig(max_new_tokens=8, ignore_eos=True)).output_ids
    assert reader.store.flush(timeout=30) and reader.is_idle() and writer.is_idle()


def test_turn_end_policy_keeps_the_prefill_put_of_an_aborted_request(make_engine):
    """Aborted mid-decode: the prefill checkpoint's put (made at its save point) stays, as with
    last-only alone; no turn-end put, and no slot stays pinned."""
    eng = make_engine(decode_save_last=True, prefill_save_last_only=True)
    seq = eng.add_request(prompt(100, seed=920), GenerationConfig(max_new_tokens=30, ignore_eos=True))
    while len(seq.output_ids) < 3:
        eng.step()
    assert seq.stats.save_points == [64] and eng.ledger()['checkpoints_pinned'] >= 1
    eng.abort(seq)
    eng.step()
    assert eng.store.flush(timeout=30)
    S, K = eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes
    assert eng.stats()['store_put_bytes'] == {'state': S, 'kv': 4 * K}
    assert eng.is_idle() and eng.ledger()['checkpoints_pinned'] == 0 and eng.ledger()['checkpoints_published'] >= 1
