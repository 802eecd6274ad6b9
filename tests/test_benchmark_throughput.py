"""benchmark/benchmark_throughput.py runs end to end on the tiny model: engine greedy outputs
equal transformers' at every batch size, every measurement has min <= median <= max, the op
profile is filled, llama.cpp is skipped cleanly without its binaries, and the files are written."""
import importlib.util
import json
import sys
from pathlib import Path

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
