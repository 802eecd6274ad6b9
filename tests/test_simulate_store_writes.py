"""Store write-volume simulator of the two save policies."""
import importlib.util
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmark' / 'simulate_store_writes.py'


def _load():
    spec = importlib.util.spec_from_file_location('simulate_store_writes', SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules['simulate_store_writes'] = mod
    spec.loader.exec_module(mod)
    return mod


sim = _load()
SEED = dict(chunk_size=8192, block_size=64, alignment=1024)
SEED_REDUCTIONS = ['0.00%', '42.43%', '63.64%', '74.25%', '33.07%', '49.50%']


def test_seed_table_reductions_via_function():
    ratio = sim.SEED_STATE_TO_BLOCK_RATIO
    results = [sim.simulate(s, ratio.numerator, ratio.denominator, **SEED) for s in sim.seed_scenarios()]
    assert [sim.truncate_percent(r.reduction) for r in results] == SEED_REDUCTIONS
    # exact totals in units of K_blk / 2: S = 1435, K_blk = 2
    assert [(r.default.total_bytes, r.last_only.total_bytes) for r in results] == [
        (1691, 1691), (3382, 1947), (6764, 2459), (13528, 3483), (13016, 8711), (20292, 10247)]
    assert [(r.default.num_saves, r.last_only.num_saves) for r in results] == [
        (1, 1), (2, 1), (4, 1), (8, 1), (8, 5), (12, 5)]


def test_seed_32k_reduction_is_truncated_not_rounded():
    r = sim.simulate(sim.seed_scenarios()[2], 1435, 2, **SEED)
    assert r.reduction == 1 - Fraction(2459, 6764)       # 63.6458...%
    assert sim.truncate_percent(r.reduction) == '63.64%'


def test_seed_table_reductions_via_cli():
    out = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'seed-table'], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    names = [s.name for s in sim.seed_scenarios()]
    rows = [line.split() for line in out.splitlines() if any(line.startswith(n + ' ') for n in names)]
    assert [row[-1] for row in rows] == SEED_REDUCTIONS


def test_multi_turn_hits_previous_last_save_and_stores_only_new_blocks():
    r = sim.simulate(sim.seed_scenarios()[5], 1000, 10, **SEED)     # +16K per turn
    first, second = r.default.turns[:2]
    assert first.save_points == [8192, 16384, 24576, 32768] and first.new_kv_blocks == 512
    assert (second.num_tokens, second.cached_tokens) == (49216, 32768)
    assert second.save_points == [40960, 49152] and second.new_kv_blocks == 256
    assert second.state_bytes == 2000 and second.kv_bytes == 2560
    last = r.last_only.turns[1]
    assert (last.cached_tokens, last.save_points, last.new_kv_blocks) == (32768, [49152], 256)
    assert [t.cached_tokens for t in r.last_only.turns] == [0, 32768, 49152, 65536, 81920]


def test_turn_without_save_point_puts_nothing():
    r = sim.simulate([1000, 1000], 1000, 10, **SEED)
    assert r.default.total_bytes == r.last_only.total_bytes == 0
    assert r.reduction == 0


def test_recompute_blocks_moves_save_point_and_next_turn_hits_it():
    # turn 1 (2049 tokens, r=1) saves at 1024; turn 2 (2112 tokens) can restore 1024 (1024 + 64 <= 2048)
    r = sim.simulate([2049, 2112], 7, 1, **SEED, recompute_blocks=1)
    assert [(t.cached_tokens, t.save_points) for t in r.last_only.turns] == [(0, [1024]), (1024, [])]
    assert r.last_only.total_bytes == 7 + 16


def test_scaled_scenarios_keep_ratios_of_token_counts():
    small = [s.scaled(Fraction(1, 16)) for s in sim.seed_scenarios()]
    assert small[1].input_lengths == (1028, )
    assert small[4].input_lengths == (2052, 2308, 2564, 2820, 3076)
    r = sim.simulate(small[1], 1435, 2, chunk_size=512, block_size=16, alignment=64)
    assert r.default.turns[0].save_points == [512, 1024] and r.last_only.turns[0].save_points == [1024]
    with pytest.raises(ValueError, match='scale'):
        sim.seed_scenarios()[0].scaled(Fraction(1, 5))


def test_tiny_preset_sizes():
    sizes = sim.sizes_from_config(sim.TINY_CONFIG)
    # 3 layers * (conv 128 ch * 3 * 4 B + 4 heads * 16 * 16 * 4 B); 1 layer * 2 * 64 tok * 2 heads * 16 * 4 B
    assert (sizes.state_bytes, sizes.kv_block_bytes) == (3 * (1536 + 4096), 16384)
    assert sim.sizes_from_config(sim.TINY_CONFIG, block_size=16).kv_block_bytes == 4096


def test_qwen3_next_80b_sizes_per_rank():
    sizes = sim.sizes_from_config(sim.QWEN3_NEXT_80B_CONFIG)
    assert sizes.state_bytes == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert sizes.kv_block_bytes == 12 * 2 * 64 * 2 * 256 * 2
    tp4 = sim.sizes_from_config(sim.QWEN3_NEXT_80B_CONFIG, tp=4)   # 2 KV heads replicated: 1 per rank
    assert (tp4.state_bytes, tp4.kv_block_bytes, tp4.tp) == (36 * (2048 * 3 * 2 + 8 * 128 * 128 * 4), 786432, 4)
    assert sim.sizes_from_config(sim.QWEN3_NEXT_80B_CONFIG, kv_dtype='float8_e4m3fn').kv_block_bytes == 786432


def test_layer_types_override_interval():
    config = dict(sim.TINY_CONFIG, layer_types=['full_attention'] * 2 + ['linear_attention'] * 2)
    assert sim.sizes_from_config(config) == sim.StoreSizes(2 * 5632, 2 * 16384, 1)


def test_tiny_preset_cli_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'tiny', '--scale', '1/16', '--block-size', '16'],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert 'S = 16896 bytes, K_blk = 4096 bytes' in out
    row = next(line.split() for line in out.splitlines() if line.startswith('16K+64'))
    # 1028 tokens, P=512 B=16 A=64: default saves 512 and 1024, last-only 1024; 64 blocks stored
    assert row[1:5] == ['2', '1', str(2 * 16896 + 64 * 4096), str(16896 + 64 * 4096)]


@pytest.mark.parametrize('kwargs, name', [
    (dict(scenario=[2000, 1000]), 'input_lengths'),
    (dict(state_bytes=-1), 'state_bytes'),
    (dict(kv_block_bytes=-1), 'kv_block_bytes'),
    (dict(alignment=100), 'alignment'),
])
def test_simulate_rejects_bad_input(kwargs, name):
    args = dict(scenario=[4000], state_bytes=1, kv_block_bytes=1, **SEED)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        sim.simulate(**args)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match='tp'):
        sim.sizes_from_config(sim.TINY_CONFIG, tp=3)
    with pytest.raises(ValueError, match='linear_conv_kernel_dim'):
        sim.sizes_from_config({k: v for k, v in sim.TINY_CONFIG.items() if k != 'linear_conv_kernel_dim'})
    with pytest.raises(ValueError, match='kv_dtype'):
        sim.sizes_from_config(sim.TINY_CONFIG, kv_dtype='float13')


def test_cli_requires_one_size_source():
    proc = subprocess.run([sys.executable, str(SCRIPT), '--state-bytes', '10'], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode != 0 and 'kv-block-bytes' in proc.stderr
