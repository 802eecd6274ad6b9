"""benchmark/benchmark_throughput.py runs end to end on the tiny model: engine greedy outputs
equal transformers' at every batch size, every measurement has min <= median <= max, the op
profile is filled, llama.cpp is skipped cleanly without its binaries, and the files are written."""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location('benchmark_throughput', ROOT / 'benchmark' / 'benchmark_throughput.py')
    mod = importlib.util.module_from_spec(spec)
    sys.modules['benchmark_throughput'] = mod
    spec.loader.exec_module(mod)
    return mod


def test_small_run_writes_results_and_greedy_equals_transformers(tiny_qwen3_next, tmp_path):
    bench = _load()
    out = tmp_path / 'tp'
    bench.main(['--model', tiny_qwen3_next, '--threads', '1', '--batches', '1,3', '--prefill', '80',
                '--prompt-len', '9', '--decode-tokens', '5', '--repeats', '2', '--llama-bench', str(tmp_path / 'none'),
                '--bandwidth-mb', '8',
                '--out', str(out)])
    results = json.loads((tmp_path / 'tp.json').read_text())
    assert (tmp_path / 'tp.png').stat().st_size > 0
    assert [r['batch'] for r in results['decode']] == [1, 3]
    assert all(r['greedy_equal_to_hf'] for r in results['decode'])
    assert set(results['decode'][1]) >= {'engine', 'hf_batched', 'hf_one_at_a_time'}
    for row in results['decode'] + results['prefill']:
        for system, stats in row.items():
            if isinstance(stats, dict):
                for key in ('wall_s', 'tok_s', 'tok_per_cpu_s'):
                    assert stats[key]['min'] <= stats[key]['median'] <= stats[key]['max'], (system, key)
    assert [r['tokens'] for r in results['prefill']] == [80]
    assert all(r['engine'] > 0 and r['hf'] > 0 for r in results['ops'])
    # the step's bytes against the measured bandwidth: the limit is those bytes at that rate
    assert results['gemv_bandwidth_gb_s'] > 0
    assert results['gemv_bandwidth_gb_s'] == max(results['gemv_bandwidth_torch_gb_s'],
                                                 results['gemv_bandwidth_native_gb_s'] or 0.0)
    # measured on a matrix in 4 KiB pages and on one in huge pages (as the engine holds its
    # weights); the limit uses the faster
    assert results['gemv_bandwidth_gb_s'] == max(results['gemv_bandwidth_plain_pages_gb_s'],
                                                 results['gemv_bandwidth_huge_pages_gb_s'])
    for r in results['ops']:
        assert r['engine_step_s'] > 0 and r['step_bytes']['total'] == sum(
            r['step_bytes'][k] for k in ('dense', 'experts', 'state', 'kv'))
        assert abs(r['limit_step_s'] * results['gemv_bandwidth_gb_s'] * 1e9 - r['step_bytes']['total']) < 1
        assert r['fraction_of_limit'] == r['limit_step_s'] / r['engine_step_s']
    # native kernel calls are part of the engine's count (float32 CPU: the decode kernels run
    # when the library builds here)
    from lmdeploy.pytorch.kernels.cpu_native import native_library
    assert all(0 <= r['engine_native'] < r['engine'] for r in results['ops'])
    assert all((r['engine_native'] > 0) == (native_library() is not None) for r in results['ops'])
    assert 'skipped' in results['llama_cpp']
    precision = results['precision']
    assert set(precision) == {'max_abs_logit', 'engine_batch1', 'hf_incremental_batch1', 'hf_incremental_batch3'}
    assert precision['max_abs_logit'] > 0
    assert precision['engine_batch1'] <= 1e-4     # the documented float32 bound on the test model


def test_greedy_divergences_locate_the_first_differing_token_and_its_margin(tiny_qwen3_next):
    """A divergence report names each differing sequence's first differing token and transformers'
    logit margin of its own choice over ours there (>= 0: its choice is its argmax)."""
    import torch
    from transformers import AutoModelForCausalLM
    bench = _load()
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_next, dtype=torch.float32).eval()
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8, 1, 4]]
    theirs = bench.hf_generate(hf, prompts, 6)
    ours = [list(t) for t in theirs]
    ours[1][3] = (theirs[1][3] + 1) % hf.config.vocab_size     # sequence 1 differs from token 3 on
    ours[1][4] = theirs[1][4]
    report = bench.greedy_divergences(hf, prompts, ours, theirs)
    assert [(d['seq'], d['token'], d['engine'], d['hf']) for d in report] == [(1, 3, ours[1][3], theirs[1][3])]
    assert report[0]['hf_margin'] > 0
    # a mixture-of-experts model: the smallest gap between a token's k-th and (k+1)-th routing
    # probability over that forward, recomputed here from transformers' router logits
    res = hf(input_ids=torch.tensor([prompts[1] + ours[1][:3]]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    gaps = [float((r.softmax(-1).topk(k + 1, dim=-1).values[:, k - 1]
                   - r.softmax(-1).topk(k + 1, dim=-1).values[:, k]).min()) for r in res.router_logits]
    assert report[0]['router_margin'] == pytest.approx(min(gaps), rel=1e-6) and report[0]['router_margin'] >= 0
    assert bench.greedy_divergences(hf, prompts, theirs, theirs) == []


def test_bfloat16_run_compares_both_systems_in_bf16(tiny_qwen3_next, tmp_path):
    """--dtype bfloat16 runs the engine and transformers in bf16 (both report speeds), records the
    dtype, and leaves out the float32-only parts (divergence report, precision block)."""
    bench = _load()
    out = tmp_path / 'bf'
    bench.main(['--model', tiny_qwen3_next, '--dtype', 'bfloat16', '--threads', '1', '--batches', '2',
                '--prefill', '40', '--prompt-len', '7', '--decode-tokens', '4', '--repeats', '1',
                '--skip-one-at-a-time', '--llama-bench', str(tmp_path / 'none'), '--out', str(out)])
    results = json.loads((tmp_path / 'bf.json').read_text())
    assert results['dtype'] == 'bfloat16'
    assert 'precision' not in results
    (row,) = results['decode']
    assert 'greedy_divergences' not in row and isinstance(row['greedy_equal_to_hf'], bool)
    assert row['engine']['tok_s']['median'] > 0 and row['hf_batched']['tok_s']['median'] > 0
    assert results['prefill'][0]['engine']['tok_s']['median'] > 0


FAKE_BATCHED_BENCH = '''#!{python}
"""Stands in for llama.cpp's llama-batched-bench: checks the arguments and prints one jsonl
record whose seconds grow with the work asked for (1 ms per prompt token, 10 ms per decode step)."""
import json, sys
args = sys.argv[1:]
opt = {{args[i]: args[i + 1] for i in range(0, len(args) - 1) if args[i].startswith('-')}}
assert opt['--output-format'] == 'jsonl' and opt['-t'] == opt['-tb'] == '1', args
pp, tg, pl = int(opt['-npp']), int(opt['-ntg']), int(opt['-npl'])
assert int(opt['-c']) >= pl * (pp + tg), args
with open({log!r}, 'a') as f:
    f.write(json.dumps([pp, tg, pl]) + '\\n')
t_pp, t_tg = 0.001 * pl * pp, 0.01 * tg
print('| some markdown line |')
print(json.dumps(dict(pp=pp, tg=tg, pl=pl, t_pp=t_pp, t_tg=t_tg, t=t_pp + t_tg)))
'''


def test_llama_cpp_runs_as_a_third_system_with_the_engines_token_count(tiny_qwen3_next, tmp_path):
    """With llama-batched-bench and a GGUF file, every repeat also runs llama.cpp: at batch N the
    same forward passes as the engine (N prompts, decode-tokens - 1 decode steps), tokens/s over
    its own seconds counted like the engine's; at prefill length L, L over its prompt seconds. A
    binary that fails is recorded once as skipped, and the run still completes."""
    bench = _load()
    log = tmp_path / 'calls.jsonl'
    fake = tmp_path / 'llama-batched-bench'
    fake.write_text(FAKE_BATCHED_BENCH.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    gguf = tmp_path / 'm.gguf'
    gguf.write_bytes(b'GGUF')
    out = tmp_path / 'lc'
    bench.main(['--model', tiny_qwen3_next, '--threads', '1', '--batches', '1,3', '--prefill', '40',
                '--prompt-len', '7', '--decode-tokens', '5', '--repeats', '2', '--skip-one-at-a-time',
                '--llama-batched-bench', str(fake), '--gguf', str(gguf), '--out', str(out)])
    results = json.loads((tmp_path / 'lc.json').read_text())
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [[7, 4, 1]] * 2 + [[7, 4, 3]] * 2 + [[40, 1, 1]] * 2
    assert results['llama_cpp'] == {'binary': str(fake), 'gguf': str(gguf), 'threads': 1}
    for row in results['decode']:
        lc = row['llama_cpp']
        seconds = 0.001 * row['batch'] * 7 + 0.01 * 4
        assert abs(lc['tok_s']['median'] - row['batch'] * 5 / seconds) < 1e-6 * lc['tok_s']['median']
        assert lc['wall_s']['min'] <= lc['wall_s']['median'] <= lc['wall_s']['max']
        assert lc['tok_per_cpu_s'] is None and lc['peak_mb'] is None
    (pre,) = results['prefill']
    assert abs(pre['llama_cpp']['tok_s']['median'] - 40 / 0.04) < 1e-6
    fake.write_text('#!/bin/sh\necho broken >&2\nexit 3\n')
    bench.main(['--model', tiny_qwen3_next, '--threads', '1', '--batches', '2', '--prefill', '30',
                '--prompt-len', '5', '--decode-tokens', '3', '--repeats', '1', '--skip-one-at-a-time',
                '--llama-batched-bench', str(fake), '--gguf', str(gguf), '--out', str(out)])
    results = json.loads((tmp_path / 'lc.json').read_text())
    assert 'broken' in results['llama_cpp']['skipped']
    assert 'llama_cpp' not in results['decode'][0] and 'llama_cpp' not in results['prefill'][0]
    assert results['decode'][0]['engine']['tok_s']['median'] > 0


def test_llama_cpp_run_that_printed_no_record_is_made_again(tmp_path):
    """A ``llama-batched-bench`` run that exits 0 and prints no jsonl record (its asynchronous
    logger lost the line) is made again; after EMPTY_RUN_ATTEMPTS such runs the system is skipped
    with a note that says so."""
    import stat
    sys.path.insert(0, str(ROOT / 'benchmark'))
    from throughput_measure import LlamaCpp
    count = tmp_path / 'runs.txt'
    fake = tmp_path / 'llama-batched-bench'
    fake.write_text('#!/bin/sh\n'
                    f'echo run >> {count}\n'
                    f'[ "$(wc -l < {count})" -ge 3 ] || exit 0\n'       # the first two print nothing
                    'echo \'{"pp": 8, "tg": 3, "pl": 1, "t_pp": 0.2, "t_tg": 0.3, "t": 0.5}\'\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    gguf = tmp_path / 'model.gguf'
    gguf.write_bytes(b'GGUF')
    llama = LlamaCpp(str(fake), str(gguf), 1)
    assert LlamaCpp.EMPTY_RUN_ATTEMPTS == 3
    lc = llama.decode(1, 8, 4)
    assert lc is not None and lc['wall_s'] == 0.5 and lc['prefill_s'] == 0.2 and lc['decode_s'] == 0.3
    assert count.read_text().count('run') == 3 and llama.available
    count.write_text('')
    fake.write_text('#!/bin/sh\nexit 0\n')                             # never prints a record
    assert llama.decode(1, 8, 4) is None
    assert not llama.available and 'no jsonl record in 3 runs' in llama.note


def test_decode_step_bytes_count_weights_touched_experts_state_and_kv(tiny_qwen3_next):
    """The bytes of a decode step on the tiny Qwen3-Next (float32), derived here from its config:
    4 layers of 4 experts (k = 2, intermediate 32, hidden 64), 3 Gated DeltaNet layers (conv 128
    channels x 3 taps, state 4 heads x 16 x 16) and 1 attention layer (2 KV heads x 16)."""
    import torch
    from transformers import AutoModelForCausalLM
    _load()
    from step_bytes import decode_step_bytes
    config = json.loads((Path(tiny_qwen3_next) / 'config.json').read_text())
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_next, dtype=torch.float32).eval()
    routed = 4 * 4 * (2 * 32 * 64 + 64 * 32) * 4             # layers x experts x (gate_up + down) x fp32
    params = sum(p.numel() for p in hf.parameters()) * 4
    state = 3 * (128 * 3 + 4 * 16 * 16) * 4                    # per sequence
    kv_token = 1 * 2 * 2 * 16 * 4                                # per sequence and token
    for batch, touched in ((1, routed // 2), (3, routed * 7 // 8)):    # 1 - (1 - 2/4) ** batch
        got = decode_step_bytes(hf, config, batch, context=40)
        assert got.experts == touched
        assert got.dense == params - 1024 * 64 * 4 - routed + batch * 64 * 4    # embedding: batch rows
        assert got.state == 2 * batch * state                   # read and written back
        assert got.kv == batch * 41 * kv_token
        assert got.total == got.dense + got.experts + got.state + got.kv
    import pytest
    with pytest.raises(ValueError, match='batch'):
        decode_step_bytes(hf, config, 0, context=4)


def test_gemv_bandwidth_reports_torch_and_the_native_product_and_takes_the_faster(monkeypatch):
    """Both GEMV figures are measured (the native one only when the library is built) and the
    bandwidth a step's limit uses is the faster of the two; bad sizes raise."""
    import pytest
    _load()
    import step_bytes
    from lmdeploy.pytorch.kernels import cpu_native
    got = step_bytes.measure_gemv_bandwidths(threads=1, megabytes=1, repeats=2)
    assert got.torch > 0
    assert (got.native is not None) == (cpu_native.native_library() is not None)
    assert got.best == max(got.torch, got.native or 0.0)
    assert step_bytes.GemvBandwidth(2.0, 3.0).best == 3.0 and step_bytes.GemvBandwidth(2.0, None).best == 2.0
    monkeypatch.setattr(cpu_native, 'matmul_rows', lambda x, w: None)      # library absent: torch only
    alone = step_bytes.measure_gemv_bandwidths(threads=1, megabytes=1, repeats=1)
    assert alone.native is None and alone.best == alone.torch > 0
    with pytest.raises(ValueError, match='megabytes'):
        step_bytes.measure_gemv_bandwidths(megabytes=0)


def test_save_model_keeps_the_generated_model_where_asked(tmp_path):
    """``--save-model DIR`` makes the --arch model in DIR (for make_gguf.py) instead of a temp dir,
    with the weights and config the benchmark itself would load."""
    bench = _load()
    args = argparse.Namespace(model=None, arch='lfm2', width_scale=1, preset='small', save_model=str(tmp_path / 'kept'))
    path = bench.prepare_model(args)
    assert path == str(tmp_path / 'kept')
    assert json.loads((tmp_path / 'kept' / 'config.json').read_text())['model_type'] == 'lfm2'
    assert list((tmp_path / 'kept').glob('*.safetensors'))


def test_ab_fused_decode_takes_the_fused_ops_out_and_restores_them():
    """benchmark/ab_fused_decode.py on a tiny Kimi-Linear: the unfused mode runs more torch ops and
    fewer native calls than the fused one (the MLA step, the router and nothing else taken out),
    and the registry is whole again afterwards."""
    spec = importlib.util.spec_from_file_location('ab_fused_decode', ROOT / 'benchmark' / 'ab_fused_decode.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    from lmdeploy.pytorch import kernels
    res = ab.run('kimi_linear', 1, [2], rounds=1, steps=2, ops=ab.DEFAULT_OPS, threads=1)
    fused, unfused = res[2]['fused'], res[2]['unfused']
    assert unfused['ops'] > fused['ops'] and unfused['native'] < fused['native']
    assert fused['best_ms'] > 0 and unfused['best_ms'] > 0
    assert all(kernels.find_kernel(op, 'cpu') is not None for op in ab.DEFAULT_OPS)


def test_ab_native_rows_moves_one_row_products_to_mkl_and_restores_the_rule(tiny_qwen3_next):
    """benchmark/ab_native_rows.py on the tiny Qwen3-Next: with 1-3 rows on MKL a batch-1 step
    makes fewer native calls (its dense products leave the native kernel), and the engine's
    library and row rule are back afterwards."""
    import pytest
    from lmdeploy.pytorch.kernels import cpu_native
    from lmdeploy.pytorch.kernels import linear as linear_mod
    if cpu_native.native_library() is None:
        pytest.skip('native CPU kernels not built here')
    spec = importlib.util.spec_from_file_location('ab_native_rows', ROOT / 'benchmark' / 'ab_native_rows.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    res = ab.run(tiny_qwen3_next, [1], rounds=1, steps=2, threads=1)
    native, mkl = res[1]['native_1_24'], res[1]['mkl_1_3']
    assert native['native'] > mkl['native'] and native['best_ms'] > 0 and mkl['best_ms'] > 0
    assert linear_mod.NATIVE_ROWS == range(1, 25) and cpu_native._LIB is cpu_native.native_library()


def test_ab_prefill_short_times_both_forms_and_restores_the_engine(tiny_qwen3_next):
    """benchmark/ab_prefill_short.py on the tiny Qwen3-Next: one time per round, shape and form,
    and the short-prompt windows are the engine's own again afterwards."""
    from lmdeploy.pytorch.kernels import cpu_native
    from lmdeploy.pytorch.models.blocks import gated_delta_net, moe
    spec = importlib.util.spec_from_file_location('ab_prefill_short', ROOT / 'benchmark' / 'ab_prefill_short.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    windows = (gated_delta_net.GDN_VARLEN_TOKENS, cpu_native.NATIVE_EXPERT_TOKENS, moe.FUSED_MOE_TOKENS)
    res = ab.main(['--model', tiny_qwen3_next, '--threads', '1', '--rounds', '1', '--shapes', '1x5,2x3'])
    assert sorted(res) == ['1x5', '2x3']
    assert all(len(v) == 1 and v[0] > 0 for r in res.values() for v in (r['before'], r['after']))
    assert (gated_delta_net.GDN_VARLEN_TOKENS, cpu_native.NATIVE_EXPERT_TOKENS, moe.FUSED_MOE_TOKENS) == windows


def test_ab_native_rows_runs_an_earlier_library_without_the_broadcast_form_on_mkl(monkeypatch):
    """An ``--old-library`` from before the broadcast-form product lacks its entry points: its mode
    carries row bound 0, so ``linear`` leaves 25-64 rows to MKL instead of calling into it."""
    import types
    from lmdeploy.pytorch.kernels import cpu_native, native_build
    if cpu_native.native_library() is None:
        pytest.skip('native CPU kernels not built here')
    spec = importlib.util.spec_from_file_location('ab_native_rows', ROOT / 'benchmark' / 'ab_native_rows.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    old = types.SimpleNamespace(lm_matmul_rows=cpu_native.native_library().lm_matmul_rows)
    monkeypatch.setattr(native_build, 'load_private', lambda path, argtypes, missing_ok=False: old)
    ways = ab.modes('old.so')
    assert ways['old_4_24'] == (old, range(4, 25), 0)
    assert ways['native_1_24'][2] == cpu_native._BCAST_MAX


def test_ab_bcast_rows_times_both_modes_and_restores_the_rule(tiny_qwen3_next):
    """benchmark/ab_bcast_rows.py on the tiny Qwen3-Next: a 30-token first step and 26-sequence
    decode steps run in both modes (the broadcast form only in its own), greedy tokens agree,
    and the engine's row rule is back afterwards."""
    from lmdeploy.pytorch.kernels import cpu_native
    if not cpu_native.bcast_rows():
        pytest.skip('the broadcast-form product is built without AVX-512 only')
    spec = importlib.util.spec_from_file_location('ab_bcast_rows', ROOT / 'benchmark' / 'ab_bcast_rows.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    before = cpu_native.CALLS['matmul_bcast']
    res = ab.run(tiny_qwen3_next, [26], rounds=1, prompt_len=30, threads=1)
    assert cpu_native.CALLS['matmul_bcast'] > before
    assert res['greedy_equal'] is True
    for key in ('first_step', 'decode_b26'):
        r = res[key]
        assert len(r['bcast']['runs_ms']) == len(r['mkl']['runs_ms']) == 1
        assert r['bcast']['best_ms'] > 0
        assert r['ratio'] == pytest.approx(r['mkl']['median_ms'] / r['bcast']['median_ms'])
    assert cpu_native.bcast_rows() == range(25, 65)


def test_ab_replay_binary_times_both_modes_and_restores_the_rule(tiny_qwen3_next, monkeypatch):
    """benchmark/ab_replay_binary.py on the tiny Qwen3-Next: batch 1 and 2 run replayed steps in
    both modes (native sums and products recorded only in the native one), greedy tokens agree,
    and the engine's rule is back afterwards."""
    from lmdeploy.pytorch.engine import decode_graph
    if decode_graph.cpu_native.native_library() is None:
        pytest.skip('decode graphs need the native CPU kernels')
    spec = importlib.util.spec_from_file_location('ab_replay_binary', ROOT / 'benchmark' / 'ab_replay_binary.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    rule, made, real = decode_graph._NATIVE_BINARY, [], decode_graph._native_binary

    def spy(*args):
        step = real(*args)
        made.append((bool(decode_graph._NATIVE_BINARY), step is not None))
        return step
    monkeypatch.setattr(decode_graph, '_native_binary', spy)
    res = ab.run(tiny_qwen3_next, [1, 2], rounds=1, steps=3, prompt_len=6, threads=1)
    assert res['greedy_equal'] is True
    assert (True, True) in made and (False, False) in made and (False, True) not in made
    for key in ('decode_b1', 'decode_b2'):
        r = res[key]
        assert len(r['native']['runs_ms']) == len(r['torch']['runs_ms']) == 1
        assert r['ratio'] == pytest.approx(r['torch']['median_ms'] / r['native']['median_ms'])
    assert decode_graph._NATIVE_BINARY is rule


def _ab_llama_pairs():
    spec = importlib.util.spec_from_file_location('ab_llama_pairs', ROOT / 'benchmark' / 'ab_llama_pairs.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


def test_ab_llama_pairs_counts_stalls_after_the_first_two_steps():
    """A stall is a step after the prefill and the first decode step that takes over ``factor``
    median steps; the first two are never counted, however slow."""
    ab = _ab_llama_pairs()
    steps = [[0.5, 0.5], [0.2, 0.2]] + [[0.01, 0.02]] * 9 + [[0.12, 0.04], [0.029, 0.03]]
    assert ab.stalls(steps, 3.0) == [[0.12, 0.04]]
    assert ab.stalls(steps, 20.0) == []
    assert ab.stalls(steps[:2], 3.0) == []


def test_ab_llama_pairs_interleaves_the_engine_and_llama_cpp(tiny_qwen3_next, tmp_path):
    """benchmark/ab_llama_pairs.py with a stand-in ``llama-batched-bench`` (prints one jsonl record
    of 0.5 s and logs its arguments): one llama.cpp run per pair with the engine's shape, and the
    ratio is llama.cpp's seconds over the engine's."""
    import stat
    ab = _ab_llama_pairs()
    log = tmp_path / 'calls.txt'
    fake = tmp_path / 'llama-batched-bench'
    fake.write_text('#!/bin/sh\n'
                    f'echo "$@" >> {log}\n'
                    'echo \'{"pp": 5, "tg": 2, "pl": 1, "t_pp": 0.1, "t_tg": 0.4, "t": 0.5}\'\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    gguf = tmp_path / 'model.gguf'
    gguf.write_bytes(b'GGUF')
    out = tmp_path / 'pairs.json'
    res = ab.main(['--model', tiny_qwen3_next, '--gguf', str(gguf), '--llama-batched-bench', str(fake),
                   '--pairs', '2', '--prompt-len', '5', '--decode-tokens', '3', '--threads', '1', '--out', str(out)])
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and all('-npp 5 -ntg 2 -npl 1' in c for c in calls)
    assert len(res['pairs']) == 2
    for r in res['pairs']:
        assert r['llama_s'] == 0.5 and r['ratio'] == pytest.approx(0.5 / r['engine_s'])
        # the split: the engine's first step against t_pp, its later steps against t_tg
        assert r['llama_prompt_s'] == 0.1 and r['prompt_ratio'] == pytest.approx(0.1 / r['engine_prompt_s'])
        assert r['llama_decode_s'] == 0.4 and r['decode_ratio'] == pytest.approx(0.4 / r['engine_decode_s'])
        assert 0 < r['engine_prompt_s'] and 0 < r['engine_decode_s']
        assert r['engine_prompt_s'] + r['engine_decode_s'] <= r['engine_s']
    for key in ('ratio', 'prompt_ratio', 'decode_ratio'):
        assert res[key]['min'] <= res[key]['median'] <= res[key]['max']
    assert json.loads(out.read_text())['batch'] == 1


def test_ab_native_product_times_both_libraries_and_checks_them_bit_for_bit():
    """benchmark/ab_native_product.py with this checkout's own library as the "old" one: one row
    per (shape, rows), both rates positive, and the outputs equal bit for bit."""
    from lmdeploy.pytorch.kernels import cpu_native
    lib = cpu_native.native_library()
    if lib is None:
        pytest.skip('native CPU kernels not built here')
    spec = importlib.util.spec_from_file_location('ab_native_product', ROOT / 'benchmark' / 'ab_native_product.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    res = ab.main(['--old-library', lib._name, '--rows', '1,3', '--shapes', '40x33,8x16', '--rounds', '1',
                   '--threads', '1', '--megabytes', '1'])
    assert [(r['N'], r['K'], r['rows']) for r in res] == [(40, 33, 1), (40, 33, 3), (8, 16, 1), (8, 16, 3)]
    assert all(r['equal'] and r['old_gbs'] > 0 and r['new_gbs'] > 0 for r in res)
    with pytest.raises(SystemExit):
        ab.main(['--old-library', lib._name, '--shapes', '40x'])


def test_ab_native_library_alternates_processes_and_compares_their_tokens(tiny_qwen3_next, tmp_path):
    """benchmark/ab_native_library.py with a copy of this checkout's library as the "old" one: each
    pair is two fresh processes, the old one running the given file and the new one the library
    the engine builds, both step times positive, the same tokens; too few tokens is a usage error."""
    import shutil
    from lmdeploy.pytorch.kernels import cpu_native
    lib = cpu_native.native_library()
    if lib is None:
        pytest.skip('native CPU kernels not built here')
    old = tmp_path / 'old.so'
    shutil.copyfile(lib._name, old)
    old.chmod(0o600)
    spec = importlib.util.spec_from_file_location('ab_native_library', ROOT / 'benchmark' / 'ab_native_library.py')
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    out = tmp_path / 'ab.json'
    res = ab.main(['--old-library', str(old), '--model', tiny_qwen3_next, '--pairs', '2', '--batch', '2',
                   '--requests', '1', '--prompt-len', '8', '--decode-tokens', '7', '--threads', '1',
                   '--out', str(out)])
    assert len(res['pairs']) == 2 and res['tokens_equal']
    for pair in res['pairs']:
        assert pair['old_library'] == str(old) and pair['new_library'] == lib._name
        assert pair['old_ms'] > 0 and pair['new_ms'] > 0
    assert json.loads(out.read_text())['results']['pairs'] == res['pairs']
    with pytest.raises(SystemExit):
        ab.main(['--old-library', str(old), '--model', tiny_qwen3_next, '--decode-tokens', '5'])
