"""Trace format, block tokens, agent-shaped generators and the trace benchmark CLI
(benchmark/traces.py, benchmark/benchmark_trace.py)."""
from __future__ import annotations

import json
import random
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmark import benchmark_trace  # noqa: E402
from benchmark.traces import (BLOCK_TOKENS, GENERATORS, TraceRequest, claude_code_sessions,  # noqa: E402
                              codex_sessions, load_trace, many_short_chats, prompt_tokens, working_set, write_trace)

GOOD = {'timestamp': 0, 'input_length': 1000, 'output_length': 5, 'hash_ids': [7, 8]}


def _common(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# format ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('change, field_name', [
    ({'input_length': -3}, 'input_length'),
    ({'input_length': 0}, 'input_length'),
    ({'input_length': 2.5}, 'input_length'),
    ({'output_length': -1}, 'output_length'),
    ({'hash_ids': [7]}, 'hash_ids'),                  # 1000 tokens need 2 ids
    ({'hash_ids': [7, 8, 9]}, 'hash_ids'),
    ({'hash_ids': [7, 1.5]}, 'hash_ids'),
    ({'hash_ids': [7, 'x']}, 'hash_ids'),
    ({'hash_ids': [True, 8]}, 'hash_ids'),
    ({'hash_ids': [7, -1]}, 'hash_ids'),
    ({'hash_ids': '7,8'}, 'hash_ids'),
    ({'timestamp': -1}, 'timestamp'),
    ({'timestamp': 'soon'}, 'timestamp'),
    ({'shared_head_tokens': 1001}, 'shared_head_tokens'),
    ({'session': 3}, 'session'),
    ({'continuation': 'yes'}, 'continuation'),
])
def test_load_trace_rejects_a_bad_field_naming_line_and_field(tmp_path, change, field_name):
    path = tmp_path / 't.jsonl'
    lines = [json.dumps({**GOOD, 'timestamp': 0}), json.dumps({**GOOD, 'timestamp': 10, **change})]
    path.write_text('\n'.join(lines) + '\n')
    with pytest.raises(ValueError, match=rf't\.jsonl:2: field {field_name!r}'):
        load_trace(path)


@pytest.mark.parametrize('line, message', [
    ('{"timestamp": 5, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}\n'
     '{"timestamp": 4, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}', ":2: field 'timestamp'"),
    ('{"input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}', ":1: field 'timestamp': missing"),
    ('{"timestamp": 0,', ':1: not valid JSON'),
    ('[1, 2]', ':1: expected a JSON object'),
])
def test_load_trace_rejects_order_missing_fields_and_bad_json(tmp_path, line, message):
    path = tmp_path / 't.jsonl'
    path.write_text(line + '\n')
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_write_then_load_round_trips_and_optional_fields_default(tmp_path):
    rows = [TraceRequest(0.0, 1000, 5, (7, 8)),
            TraceRequest(12.5, 1500, 0, (7, 8, 9), shared_head_tokens=512, session='s-1', continuation=True)]
    write_trace(tmp_path / 't.jsonl', rows)
    assert load_trace(tmp_path / 't.jsonl') == rows
    assert json.loads((tmp_path / 't.jsonl').read_text().splitlines()[0]) == {
        'timestamp': 0, 'input_length': 1000, 'output_length': 5, 'hash_ids': [7, 8]}
    with pytest.raises(ValueError, match="field 'hash_ids'"):
        write_trace(tmp_path / 'bad.jsonl', [TraceRequest(0.0, 1000, 5, (7,))])


# block tokens ----------------------------------------------------------------------------------
def test_prompt_tokens_length_range_and_equal_ids_give_equal_tokens():
    a = TraceRequest(0, 1000, 1, (1, 2))
    toks = prompt_tokens(a, scale=32, vocab_size=1024, seed=0, lo=3)
    assert len(toks) == 31                           # 1000 // 32: 16 + 15 tokens
    assert len(prompt_tokens(TraceRequest(0, 1023, 1, (1, 2)), scale=32, vocab_size=1024)) == 31
    assert all(3 <= t < 1024 and type(t) is int for t in toks)
    b = TraceRequest(5, 2048, 1, (9, 1, 2, 4))       # the same blocks at other positions
    other = prompt_tokens(b, scale=32, vocab_size=1024, seed=0, lo=3)
    assert other[16:32] == toks[:16] and other[32:47] == toks[16:]
    assert prompt_tokens(a, scale=32, vocab_size=1024, seed=1, lo=3) != toks
    assert len(prompt_tokens(TraceRequest(0, 1, 1, (5,)), scale=32, vocab_size=1024)) == 1
    assert len(prompt_tokens(TraceRequest(0, 512, 1, (5,)), scale=1, vocab_size=1024)) == 512
    with pytest.raises(ValueError, match='scale'):
        prompt_tokens(a, scale=3, vocab_size=1024)
    with pytest.raises(ValueError, match='lo='):
        prompt_tokens(a, scale=32, vocab_size=1024, lo=1024)


@pytest.mark.parametrize('scale', [1, 8, 32])
def test_prompts_share_tokens_exactly_as_far_as_their_hash_ids_agree(scale):
    rng = random.Random(scale)
    per = BLOCK_TOKENS // scale
    for case in range(30):
        k = rng.randint(0, 5)
        ids_a = [rng.randrange(100) + 1000 * j for j in range(k)]
        tail_a, tail_b = rng.randint(1, 4), rng.randint(0, 4)
        a = tuple(ids_a + [rng.randrange(10**6, 2 * 10**6) for _ in range(tail_a)])
        b = tuple(ids_a + [rng.randrange(2 * 10**6, 3 * 10**6) for _ in range(tail_b)])
        ta = prompt_tokens(TraceRequest(0, len(a) * BLOCK_TOKENS, 1, a), scale, 32000, seed=case, lo=10)
        tb = prompt_tokens(TraceRequest(0, max(1, len(b)) * BLOCK_TOKENS, 1, b or (7,)), scale, 32000, seed=case,
                           lo=10)
        expect = k * per if b else 0
        assert _common(ta, tb) == expect, (case, k)


# generators ------------------------------------------------------------------------------------
def _by_session(rows):
    out: dict[str, list[TraceRequest]] = {}
    for r in rows:
        out.setdefault(r.session, []).append(r)
    return out


def _full(r: TraceRequest) -> tuple[int, ...]:
    return r.hash_ids[:r.input_length // BLOCK_TOKENS]


@pytest.mark.parametrize('gen', [claude_code_sessions, codex_sessions])
def test_agent_sessions_are_deterministic_share_the_head_and_extend_each_other(gen):
    rows = gen(num_sessions=12, seed=3)
    assert rows == gen(num_sessions=12, seed=3) and rows != gen(num_sessions=12, seed=4)
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(rows, rows[1:]))
    head = rows[0].shared_head_tokens
    assert head in (40_000, 12_000) and all(r.shared_head_tokens == head for r in rows)
    head_ids = rows[0].hash_ids[:head // BLOCK_TOKENS]
    assert all(r.hash_ids[:len(head_ids)] == head_ids for r in rows)
    # the head's partial last block is completed by each session's own text: never shared
    assert len({r.hash_ids[len(head_ids)] for r in rows if not r.continuation}) == 12
    extends = branches = 0
    for session in _by_session(rows).values():
        assert [r.continuation for r in session] == [False] + [True] * (len(session) - 1)
        for prev, cur in zip(session, session[1:]):
            if cur.input_length > prev.input_length and cur.hash_ids[:len(_full(prev))] == _full(prev):
                extends += 1
                continue
            # a branch or a compaction: it still shares the head with every earlier request
            branches += 1
            assert cur.hash_ids[:len(head_ids)] == head_ids
    assert extends >= 0.9 * (extends + branches) and branches >= 1


def test_agent_branch_cuts_an_earlier_request_mid_way():
    rows = claude_code_sessions(num_sessions=20, seed=0, compact_at=10**9)
    found = 0
    for session in _by_session(rows).values():
        for i in range(1, len(session)):
            prev, cur = session[i - 1], session[i]
            if cur.hash_ids[:len(_full(prev))] == _full(prev):
                continue
            # a retry: its longest shared prefix with an earlier request ends inside that request
            shared = max(_common(list(cur.hash_ids), list(p.hash_ids)) for p in session[:i])
            assert shared * BLOCK_TOKENS < max(p.input_length for p in session[:i])
            assert shared >= 40_000 // BLOCK_TOKENS
            found += 1
    assert found >= 3


def test_short_chats_zipf_heads_and_long_reuse_distance():
    rows = many_short_chats(num_sessions=300, seed=1)
    assert rows == many_short_chats(num_sessions=300, seed=1)
    sessions = _by_session(rows)
    assert len(sessions) == 300 and max(len(s) for s in sessions.values()) <= 6
    for session in sessions.values():
        for prev, cur in zip(session, session[1:]):
            assert cur.hash_ids == prev.hash_ids or (cur.input_length > prev.input_length
                                                    and cur.hash_ids[:len(_full(prev))] == _full(prev))
    heads = {}
    for session in sessions.values():
        heads[session[0].hash_ids[0]] = heads.get(session[0].hash_ids[0], 0) + 1
    counts = sorted(heads.values(), reverse=True)
    assert counts[0] > 3 * counts[len(counts) // 2]        # Zipf: the most popular prompt dominates
    index = {id(r): i for i, r in enumerate(rows)}
    gaps = sorted(index[id(b)] - index[id(a)] for s in sessions.values() for a, b in zip(s, s[1:]))
    assert gaps[len(gaps) // 2] >= 20                       # turns of one chat are far apart


def test_agent_fleet_streams_waves_sharing_only_the_head_and_loads_back(tmp_path):
    """A million-request trace is made a wave of sessions at a time: the exact count, timestamps
    non-decreasing across waves, every wave shares the agent's head and no other block with
    another, deterministic, and the streamed file loads back equal."""
    from benchmark.traces import agent_fleet, load_trace, write_trace_rows
    kw = dict(sessions_per_wave=2, head_tokens=1024, compact_at=8000)
    rows = list(agent_fleet(100, 'codex', **kw))
    assert len(rows) == 100 and rows == list(agent_fleet(100, 'codex', **kw))
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(rows, rows[1:]))
    waves: dict[str, set] = {}
    for r in rows:
        assert r.hash_ids[:2] == (0, 1)                 # the 1,024-token head: ids 0 and 1
        waves.setdefault(r.session.rsplit('-w', 1)[1], set()).update(r.hash_ids[2:])
    assert len(waves) >= 3
    ids = list(waves.values())
    assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:])
    assert write_trace_rows(tmp_path / 'fleet.jsonl', iter(rows)) == 100
    assert load_trace(tmp_path / 'fleet.jsonl') == rows
    with pytest.raises(ValueError, match='agent must be one of'):
        next(agent_fleet(1, 'nope'))


def test_committed_traces_are_the_seeded_generators_output(tmp_path):
    for name, gen in GENERATORS.items():
        path = ROOT / 'benchmark' / 'traces' / f'{name}.jsonl'
        assert path.stat().st_size < 2_000_000
        write_trace(tmp_path / path.name, gen(seed=0))
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), name
        assert 2000 <= len(load_trace(path)) <= 6000


def test_working_set_counts_distinct_blocks_and_the_prefix_ideal():
    rows = [TraceRequest(0, 1000, 1, (1, 2)),
            TraceRequest(1, 1536, 1, (1, 2, 3)),          # 2 blocks seen: 1024
            TraceRequest(2, 1000, 1, (1, 2)),             # all seen: capped at 999
            TraceRequest(3, 600, 1, (2, 4)),              # 2 without parent 1 is a different block: 0
            TraceRequest(4, 512, 1, (1,))]                # capped at 511
    ws = working_set(rows)
    assert ws == dict(requests=5, prompt_tokens=4648, distinct_blocks=4, distinct_block_tokens=512 * 3 + 88,
                      ideal_block_hit_tokens=1024 + 999 + 511, ideal_hit_fraction=2534 / 4648)
    assert benchmark_trace.block_level_ideal(rows, 32) == 32 + 30 + 15


# benchmark_trace ------------------------------------------------------------------------------
@dataclass
class _Result:
    prompt_tokens: int
    hit_tokens: int
    hit_tokens_by_tier: dict = field(default_factory=dict)
    checkpoints_saved: dict = field(default_factory=dict)
    evictions: dict = field(default_factory=dict)
    peak_bytes: int = 0
    per_request_hit_tokens: list = field(default_factory=list)


def _stub_simulator(calls: list) -> types.ModuleType:
    """simulate_trace: the ideal hits 1000 with peak 8000 bytes; under a budget the hit is
    lru 200 / reuse 500 / optimal 800 scaled by the budget's fraction of the peak."""
    def simulate_trace(requests, *, state_bytes, kv_block_bytes, save_policy='last_only', eviction='reuse',
                       budget_bytes=None, host_bytes=0, block_size=64, alignment=1024, chunk=8192, concurrency=4,
                       scale=1, **extra):
        calls.append(dict(n=len(requests), policy=save_policy, eviction=eviction, budget=budget_bytes,
                          host=host_bytes, S=state_bytes, K=kv_block_bytes))
        tokens = sum(r.input_length for r in requests)
        if budget_bytes is None:
            return _Result(tokens, 1000, {'device': 1000}, {'last': 30}, {}, 8000)
        hit = {'lru': 200, 'reuse': 500, 'optimal': 800}[eviction] * budget_bytes // 8000
        return _Result(tokens, hit, {'device': hit}, {'last': 30}, {'checkpoint': 7, 'kv': 9}, budget_bytes)
    return types.SimpleNamespace(simulate_trace=simulate_trace, SimResult=_Result)


def test_sim_mode_prints_the_table_from_simulate_trace(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setitem(sys.modules, 'benchmark.trace_sim', _stub_simulator(calls))
    trace = ROOT / 'benchmark' / 'traces' / 'claude_code.jsonl'
    out = benchmark_trace.main(['--trace', str(trace), '--limit', '30', '--state-bytes', '100', '--kv-block-bytes',
                                '10', '--budgets', '1,0.5', '--evictions', 'lru,reuse,optimal', '--json',
                                str(tmp_path / 'r.json')])
    text = capsys.readouterr().out
    assert 'policy' in text and 'x LRU' in text and 'assumption: prefill 10000 tok/s' in text
    assert len(out) == 2 * 2 * 3 and all(c['n'] == 30 and c['S'] == 100 and c['K'] == 10 for c in calls)
    assert [(c['policy'], c['eviction'], c['budget']) for c in calls[:4]] == [
        ('default', 'reuse', None), ('default', 'lru', 8000), ('default', 'reuse', 8000), ('default', 'optimal', 8000)]
    half = [r for r in out if r['policy'] == 'last_only' and r['budget'] == 0.5]
    assert [(r['eviction'], r['hit_tokens'], r['pct_ideal'], r['x_lru'], r['pct_optimal']) for r in half] == [
        ('lru', 100, 10.0, 1.0, 25.0), ('reuse', 250, 25.0, 2.5, 62.5), ('optimal', 400, 40.0, 4.0, 100.0)]
    assert half[1]['prefill_s_saved'] == 250 / 10_000
    line = next(l for l in text.splitlines() if l.startswith('last_only') and ' 0.5' in l and 'reuse' in l)
    assert line.split() == ['last_only', '0.5', '0', 'reuse', '250', '25.0', '2.50', '62.5', '30', '7', '9', '0.0']
    saved = json.loads((tmp_path / 'r.json').read_text())
    assert saved['working_set']['requests'] == 30 and len(saved['results']) == 12


def test_sim_mode_without_the_simulator_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, 'benchmark.trace_sim', None)
    trace = ROOT / 'benchmark' / 'traces' / 'short_chats.jsonl'
    with pytest.raises(SystemExit, match='benchmark/trace_sim.py'):
        benchmark_trace.main(['--trace', str(trace), '--limit', '5', '--state-bytes', '1', '--kv-block-bytes', '1'])


def test_server_geometry_reads_the_flags():
    assert benchmark_trace.server_geometry(['--block-size', '16', '--prefill-save-alignment=64',
                                            '--prefill-save-last-only']) == dict(
        block_size=16, alignment=64, chunk=8192, save_policy='last_only')
    assert benchmark_trace.server_geometry([])['save_policy'] == 'default'
    with pytest.raises(ValueError, match='--block-size'):
        benchmark_trace.server_geometry(['--block-size'])


def test_server_mode_replays_a_trace_slice_through_a_tiny_model(tiny_qwen3_next, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'benchmark.trace_sim', None)      # the block-level ideal
    trace = ROOT / 'benchmark' / 'traces' / 'short_chats.jsonl'
    rows = load_trace(trace)[:8]
    report = benchmark_trace.main(['--mode', 'server', '--trace', str(trace), '--limit', '8', '--concurrency', '2',
                                   '--timeout-s', '120', '--model-path', tiny_qwen3_next, '--json',
                                   str(tmp_path / 'r.json')])
    assert report['completed'] == 8 and report['errors'] == 0
    assert report['prompt_tokens'] == sum(max(1, r.input_length // 32) for r in rows)
    assert report['ideal_hit_tokens'] == benchmark_trace.block_level_ideal(rows, 32)
    assert report['hit_tokens'] == sum(report['per_request_cached_tokens'])
    assert report['metrics_delta']['lmdeploy_prefix_cache_queried_tokens_total'] == report['prompt_tokens']
    assert report['metrics_delta']['lmdeploy_prefix_cache_hit_tokens_total'] == report['hit_tokens']
    assert report['metrics_delta']['lmdeploy_store_put_bytes_total{kind=state}'] == 0     # no Store
    assert 'TTFT p50' in capsys.readouterr().out
