"""The engine's measured Store put bytes equal the simulator's prediction to the byte (issue 8).

Two seed scenarios scaled by 1/16 (16K+64 and the first 3 turns of "32K+64, +4K per turn") run
on the tiny hybrid model against the real Mooncake Store and a ``file:`` Store, under both save
policies, with the
benchmark's own geometry (B=16, A=64, P=512) and ``simulate()`` fed the engine's real object
sizes ``S = cache_engine.state_bytes`` and ``K_blk = cache_engine.kv_block_bytes``.
"""
import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from engine_utils import make_engine, random_prompt
from lmdeploy import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / 'benchmark' / f'{name}.py')
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load('benchmark_prefix_cache')
sim = sys.modules['simulate_store_writes']
SCALE = Fraction(1, 16)


def _run_conversation(engine, lengths: list[int], output_tokens: int, seed: int) -> list:
    """Append-only conversation: turn t+1 = turn t's prompt + reply + fresh tokens."""
    seqs, ids = [], []
    for t, n in enumerate(lengths):
        ids = ids + random_prompt(n - len(ids), seed + t)
        seq = engine.generate(ids, GenerationConfig(max_new_tokens=output_tokens, ignore_eos=True))
        seqs.append(seq)
        ids = list(seq.token_ids)
    return seqs


def _store_fields(backend: str, request, tmp_path) -> dict:
    """Engine fields for the Mooncake Store of the session, or a ``file:`` Store in ``tmp_path``."""
    if backend == 'file':
        return dict(store_backend=f'file:{tmp_path / "store"}')
    services = request.getfixturevalue('mooncake_services')
    return dict(mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server)


def check_store_put_bytes_equal_the_simulator(model_path: str, last_only: bool, store_fields: dict, max_turns: int,
                                              seed: int, saves_and_objects: bool = False) -> tuple[dict, int, int]:
    """The seed scenarios '16k' and 'mt4k' (first ``max_turns`` turns) scaled by 1/16, run on
    ``model_path`` with the benchmark's geometry against the Store of ``store_fields``: per turn
    the restored tokens, and per scenario the put bytes, equal ``simulate()`` fed the engine's S
    and K_blk, with no failed put; with ``saves_and_objects`` also the save points and the put
    object counts. ``sizes_from_config`` of the checkpoint's config.json gives the same S and
    K_blk. Prompts are seeded ``seed + 1000 * scenario + 100 * last_only`` (the Store is shared
    by the session, so each caller passes its own ``seed``).

    Returns:
        ``(config.json as a dict, S, K_blk)`` for the caller's own extra checks.
    """
    geo = bench.Geometry.from_scale(SCALE)
    scenarios = bench.select_scenarios(['16k', 'mt4k'], SCALE, max_turns=max_turns)
    engine = make_engine(model_path, block_size=geo.block_size, prefill_save_alignment=geo.alignment,
                         max_prefill_token_num=geo.chunk_size, enable_prefix_caching=True,
                         prefill_save_last_only=last_only, num_gpu_blocks=512, **store_fields)
    S, K = engine.cache_engine.state_bytes, engine.cache_engine.kv_block_bytes
    # a mixed model whose window layers keep a pool of their own puts their rows as window objects
    store = engine.store
    windows = dict(window=store.window, window_block_bytes=engine.cache_engine.window_block_bytes
                   if store.window_rows else 0, window_rows=store.window_rows)
    kinds = ('state', 'kv', 'window') if store.window_rows else ('state', 'kv')
    try:
        for i, scenario in enumerate(scenarios):
            before = engine.stats()
            seqs = _run_conversation(engine, list(scenario.input_lengths), scenario.output_tokens,
                                     seed=seed + 1000 * i + 100 * last_only)
            engine.store.flush()
            after = engine.stats()
            pred = sim.simulate(scenario, S, K, chunk_size=geo.chunk_size, block_size=geo.block_size,
                                alignment=geo.alignment, **windows)
            policy = pred.last_only if last_only else pred.default
            assert [s.num_cached_tokens for s in seqs] == [t.cached_tokens for t in policy.turns]
            if saves_and_objects:
                assert [s.stats.save_points for s in seqs] == [t.save_points for t in policy.turns]
            put = {k: after['store_put_bytes'][k] - before['store_put_bytes'][k] for k in kinds}
            want = {'state': sum(t.state_bytes for t in policy.turns), 'kv': sum(t.kv_bytes for t in policy.turns),
                    'window': sum(t.window_bytes for t in policy.turns)}
            assert put == {k: want[k] for k in kinds}
            if saves_and_objects:
                objects = {k: after['store_put_objects'][k] - before['store_put_objects'][k] for k in kinds}
                want = {'state': policy.num_saves, 'kv': sum(t.new_kv_blocks for t in policy.turns),
                        'window': sum(t.new_window_blocks for t in policy.turns)}
                assert objects == {k: want[k] for k in kinds}
            assert after['store_put_failures'] == before['store_put_failures']
    finally:
        engine.close()
    # the sizes the server-side benchmark derives from config.json are the engine's own
    config = json.loads((Path(model_path) / 'config.json').read_text())
    sizes = sim.sizes_from_config(config, block_size=geo.block_size)
    assert (sizes.state_bytes, sizes.kv_block_bytes, sizes.windows) == (S, K, windows)
    return config, S, K


@pytest.mark.parametrize('backend', ['mooncake', 'file'])
@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_engine_store_put_bytes_equal_simulator_prediction(tiny_qwen3_next, request, tmp_path, backend, last_only):
    geo = bench.Geometry.from_scale(SCALE)
    assert (geo.block_size, geo.alignment, geo.chunk_size) == (16, 64, 512)
    scenarios = bench.select_scenarios(['16k', 'mt4k'], SCALE, max_turns=3)
    assert [s.input_lengths for s in scenarios] == [(1028, ), (2052, 2308, 2564)]
    # prompts unique to this test and policy: the Store is shared by the session
    check_store_put_bytes_equal_the_simulator(tiny_qwen3_next, last_only, _store_fields(backend, request, tmp_path),
                                              max_turns=3, seed=880_000, saves_and_objects=True)


@pytest.mark.parametrize('reply', [None, 2], ids=['scenario_reply', 'two_token_reply'])
def test_engine_turn_end_policy_equals_simulator_prediction(tiny_qwen3_next, mooncake_services, reply):
    """last-only + turn-end on the scaled 3-turn conversation: restores at the turn-end boundary,
    save points, turn-end points, Store bytes and object counts all as the simulator predicts
    (the prefill checkpoint and the turn end are both put); also with replies
    too short to cross a block boundary (the turn end is then the prompt's last block boundary)."""
    import dataclasses
    geo = bench.Geometry.from_scale(SCALE)
    (scenario, ) = bench.select_scenarios(['mt4k'], SCALE, max_turns=3)
    if reply is not None:       # prompts 40 tokens past the scenario's, so the turn end is not b* itself
        scenario = dataclasses.replace(scenario, output_tokens=reply,
                                       input_lengths=tuple(n + 40 for n in scenario.input_lengths))
    engine = make_engine(tiny_qwen3_next, block_size=geo.block_size, prefill_save_alignment=geo.alignment,
                         max_prefill_token_num=geo.chunk_size, enable_prefix_caching=True,
                         prefill_save_last_only=True, decode_save_last=True, num_gpu_blocks=512,
                         mooncake_master=mooncake_services.master_address,
                         mooncake_metadata_server=mooncake_services.metadata_server)
    S, K = engine.cache_engine.state_bytes, engine.cache_engine.kv_block_bytes
    try:
        before = engine.stats()
        seqs = _run_conversation(engine, list(scenario.input_lengths), scenario.output_tokens,
                                 seed=885_000 if reply is None else 886_000)    # no blocks shared with the other run
        engine.store.flush()
        after = engine.stats()
    finally:
        engine.close()
    policy = sim.simulate_policies(scenario, S, K, policies=['last-only+turn-end'], chunk_size=geo.chunk_size,
                                   block_size=geo.block_size, alignment=geo.alignment)['last-only+turn-end']
    assert [s.num_cached_tokens for s in seqs] == [t.cached_tokens for t in policy.turns]
    assert [t.cached_tokens for t in policy.turns][1:] == [t.turn_end_point for t in policy.turns][:-1]
    assert [s.stats.save_points for s in seqs] == [t.save_points for t in policy.turns]
    assert [s.stats.turn_end_point for s in seqs] == [t.turn_end_point for t in policy.turns]
    put = {k: after['store_put_bytes'][k] - before['store_put_bytes'][k] for k in ('state', 'kv')}
    assert put == {'state': sum(t.state_bytes for t in policy.turns), 'kv': sum(t.kv_bytes for t in policy.turns)}
    objects = {k: after['store_put_objects'][k] - before['store_put_objects'][k] for k in ('state', 'kv')}
    assert objects == {'state': policy.num_saves, 'kv': sum(t.new_kv_blocks for t in policy.turns)}
    assert policy.num_saves == sum(len(s.stats.save_points) + (s.stats.turn_end_point is not None) for s in seqs)


@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_engine_shared_head_saves_equal_simulator_prediction(tiny_qwen3_next, tmp_path, last_only):
    """Three agent sessions sharing a 600-token prefix whose first 560 tokens are the shared head
    (given to the engine as ``shared_head_tokens``), 200 tokens of their own, against a ``file:``
    Store: restored tokens, save points, Store bytes and objects as the simulator predicts with
    ``head_tokens`` (the head's save point at 512 is charged like any other)."""
    geo = bench.Geometry.from_scale(SCALE)
    scenario = sim.Branching('agent sessions', 600, 200, 3, 4, head_tokens=560)
    engine = make_engine(tiny_qwen3_next, block_size=geo.block_size, prefill_save_alignment=geo.alignment,
                         max_prefill_token_num=geo.chunk_size, enable_prefix_caching=True,
                         prefill_save_last_only=last_only, num_gpu_blocks=512,
                         store_backend=f'file:{tmp_path / "store"}')
    S, K = engine.cache_engine.state_bytes, engine.cache_engine.kv_block_bytes
    shared = random_prompt(scenario.shared_tokens, 887_000 + last_only)
    own = [random_prompt(scenario.suffix_tokens, 887_100 + 10 * last_only + i) for i in range(scenario.siblings)]
    assert len({o[0] for o in own}) == scenario.siblings          # they diverge right after the shared tokens
    try:
        seqs = [engine.generate(shared + o, GenerationConfig(max_new_tokens=scenario.output_tokens, ignore_eos=True),
                                shared_head_tokens=scenario.head_tokens) for o in own]
        engine.store.flush()
        stats = engine.stats()
    finally:
        engine.close()
    name = 'last-only' if last_only else 'default'
    policy = sim.simulate_policies(scenario, S, K, policies=[name], chunk_size=geo.chunk_size,
                                   block_size=geo.block_size, alignment=geo.alignment)[name]
    assert [t.cached_tokens for t in policy.turns] == [0, 512, 512]
    assert [s.num_cached_tokens for s in seqs] == [t.cached_tokens for t in policy.turns]
    assert [s.stats.save_points for s in seqs] == [t.save_points for t in policy.turns]
    assert stats['store_put_bytes'] == {'state': sum(t.state_bytes for t in policy.turns),
                                        'kv': sum(t.kv_bytes for t in policy.turns)}
    assert stats['store_put_objects'] == {'state': policy.num_saves, 'kv': sum(t.new_kv_blocks for t in policy.turns)}
    assert stats['shared_head_checkpoints_saved'] == 1 and stats['store_put_failures'] == 0


def test_scaled_seed_scenarios_predict_these_exact_bytes():
    # S and K_blk of the tiny model at B=16 (checked against the engine above)
    g = bench.Geometry.from_scale(SCALE)
    plan = bench.Plan(bench.select_scenarios(['16k', 'mt4k'], SCALE, 3), g, 16896, 4096, 1, 1, 0)
    totals = [(plan.expected(s, False).total_bytes, plan.expected(s, True).total_bytes) for s in plan.scenarios]
    # 16K+64: 2 saves + 64 blocks vs 1 save + 64 blocks; 3 turns: 6 vs 3 saves, 160 blocks each
    assert totals == [(2 * 16896 + 64 * 4096, 16896 + 64 * 4096), (6 * 16896 + 160 * 4096, 3 * 16896 + 160 * 4096)]


def test_geometry_rejects_alignment_not_multiple_of_block():
    with pytest.raises(ValueError, match='alignment'):
        bench.Geometry.from_scale(Fraction(1), block_size=48, alignment=1024, chunk_size=8192)
    with pytest.raises(ValueError, match='chunk-size'):
        bench.Geometry.from_scale(Fraction(1, 3), alignment=64)
    assert bench.Geometry.from_scale(Fraction(1)) == bench.Geometry(64, 1024, 8192)
    assert bench.Geometry.from_scale(Fraction(1, 8)) == bench.Geometry(16, 128, 1024)


def test_paired_ci_uses_the_t_distribution():
    mean, low, high = bench.paired_ci([1.0, 2.0, 3.0])        # sd 1, n 3, t(0.975, 2) = 4.3027
    assert mean == 2.0
    assert (round(low, 3), round(high, 3)) == (round(2 - 4.302653 / 3 ** 0.5, 3), round(2 + 4.302653 / 3 ** 0.5, 3))
    assert bench.paired_ci([0.5])[0] == 0.5


def test_unknown_scenario_key_raises_naming_the_field():
    with pytest.raises(ValueError, match='scenarios'):
        bench.select_scenarios(['99k'], SCALE, None)


class _FakeServer:
    """Answers like an api_server whose cache and Store follow (or break) the plan."""

    def __init__(self, replies, cached, put):
        self.replies, self.cached, self.put = list(replies), list(cached), put
        self.reads = 0

    def complete(self, ids, max_tokens):
        return bench.TurnResult(len(ids), self.cached.pop(0), 0.01, 0.02, self.replies.pop(0))

    def store_counters(self):
        self.reads += 1
        return (self.put if self.reads == 2 else {'state': 0, 'kv': 0}), {'state': 0, 'kv': 0}


class _FakePrompts:
    def random_ids(self, n, *key):
        return [3] * n

    def next_turn(self, prev, reply, n, *key):
        return prev + [4] * (n - len(prev))


def _check_plan():
    g = bench.Geometry.from_scale(SCALE)
    return bench.Plan(bench.select_scenarios(['mt4k'], SCALE, 2), g, 16896, 4096, 1, 1, 0)


def test_run_sample_accepts_replies_hits_and_bytes_that_follow_the_plan():
    plan = _check_plan()          # turn 1: saves 512..2048 (default); turn 2 hits 2048, saves 2304
    on_default = ('on-default', True, False)
    put = {'state': 5 * 16896, 'kv': 144 * 4096}
    replies = {}
    r = bench.run_sample(_FakeServer(['a', 'b'], [0, 2048], put), plan, _FakePrompts(), on_default, 0, 0, 0, replies)
    assert r.put_bytes == put and [t.cached_tokens for t in r.turns] == [0, 2048]
    assert replies == {(0, 0, 0, 0): ('on-default', 'a'), (0, 0, 0, 1): ('on-default', 'b')}


@pytest.mark.parametrize('replies,cached,put,match', [
    (['a', 'X'], [0, 2048], {'state': 5 * 16896, 'kv': 144 * 4096}, 'greedy replies differ'),
    (['a', 'b'], [0, 0], {'state': 5 * 16896, 'kv': 144 * 4096}, 'cached tokens'),
    (['a', 'b'], [0, 2048], {'state': 4 * 16896, 'kv': 144 * 4096}, 'simulator predicts'),
], ids=['reply', 'cache_hit', 'bytes'])
def test_run_sample_aborts_on_a_failed_check(replies, cached, put, match):
    known = {(0, 0, 0, 0): ('off-default', 'a'), (0, 0, 0, 1): ('off-default', 'b')}
    with pytest.raises(bench.BenchmarkError, match=match):
        bench.run_sample(_FakeServer(replies, cached, put), _check_plan(), _FakePrompts(), ('on-default', True, False),
                         0, 0, 0, known)
