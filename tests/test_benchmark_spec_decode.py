"""benchmark/benchmark_spec_decode.py runs end to end: identical outputs with and without n-gram
drafts, and the copying workload accepts almost every draft."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_reports_identical_outputs_and_high_acceptance(tmp_path):
    spec = importlib.util.spec_from_file_location('benchmark_spec_decode',
                                                  ROOT / 'benchmark' / 'benchmark_spec_decode.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / 'r.json'
    result = module.main(['--preset', 'small', '--batches', '2', '--file-tokens', '64', '--decode-tokens', '24',
                          '--threads', '1', '--out', str(out)])
    (row,) = result['rows']
    assert row['identical_outputs'] and out.exists()
    assert row['ngram']['acceptance_rate'] > 0.9 and row['ngram']['mean_tokens_per_verify_step'] > 3
    assert row['plain']['draft_tokens'] == 0 and row['plain']['decoded_tokens'] == row['ngram']['decoded_tokens']
