"""The later model families' Store-byte presets (benchmark/family_presets.py): the README's
per-family table equals the simulator's, hand-derived S and K_blk of the published presets, and
the reduction ordered by S / K_blk across families; and ``--arch`` of benchmark_throughput.py
(a registered family's tiny model with scaled widths)."""
import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope='module')
def table():
    from benchmark.family_presets import family_table
    return family_table()


def test_readme_family_table_equals_the_simulator(table):
    from benchmark.family_presets import format_family_table
    from benchmark.simulate_store_writes import truncate_percent
    want = format_family_table(table, truncate_percent)
    lines = (ROOT / 'benchmark' / 'README.md').read_text().splitlines()
    start = lines.index(want[0])
    assert lines[start:start + len(want)] == want
    assert not lines[start + len(want)].startswith('|')     # no stale extra row


def test_published_presets_sizes_by_hand(table):
    charged = {p.preset: s.charged for p, s, _ in table}
    bf16, f32, B = 2, 4, 64
    # Mamba-1 layer: conv [d_inner, conv-1] bf16 + SSM [d_inner, d_state] float32; nothing per token
    assert charged['mamba-2.8b'] == (64 * (5120 * 3 * bf16 + 5120 * 16 * f32), 0)
    assert charged['falcon-mamba-7b'] == (64 * (8192 * 3 * bf16 + 8192 * 16 * f32), 0)
    # Mamba-2 layer: conv [d_inner + 2 groups d_state, conv-1] + SSM [heads, head_dim, d_state] float32
    assert charged['mamba2-2.7b'] == (64 * ((5120 + 2 * 128) * 3 * bf16 + 80 * 64 * 128 * f32), 0)
    assert charged['bamba-9b'] == (29 * ((8192 + 2 * 128) * 3 * bf16 + 128 * 64 * 128 * f32),
                                   3 * 2 * 8 * 128 * bf16 * B)
    # Jamba: 28 Mamba-1 layers (d_inner 8192), 4 attention layers of 8 KV heads x 128
    assert charged['jamba-v0.1'] == (28 * (8192 * 3 * bf16 + 8192 * 16 * f32), 4 * 2 * 8 * 128 * bf16 * B)
    # MiniMax-01: 70 lightning layers, float32 [64, 128, 128] each, no conv; 10 softmax layers
    assert charged['minimax-text-01'] == (70 * 64 * 128 * 128 * f32, 10 * 2 * 8 * 128 * bf16 * B)


def test_reduction_follows_the_state_to_block_ratio_across_families(table):
    # bytes(policy) = saves * S + blocks * K_blk with the same blocks under both policies, so the
    # reduction of a scenario is (saves_d - saves_l) S / (saves_d S + blocks K_blk): increasing in
    # S / K_blk, 0 without a state (unless window objects: the saves last-only skips put theirs),
    # 1 - saves_l / saves_d without KV
    from benchmark.store_sim import DEFAULT_ALIGNMENT, DEFAULT_BLOCK, DEFAULT_CHUNK, seed_scenarios, simulate
    # (a family with window objects is left out: its bytes hold a third term, new_window·K_win, whose
    # blocks per save are bounded by W, so no single ratio orders it; the README row shows it)
    ratio = {p.preset: Fraction(s.charged[0], s.charged[1]) if s.charged[1] and not s.window_rows else None
             for p, s, _ in table}
    for i, scenario in enumerate(seed_scenarios()):
        with_kv = sorted((ratio[p.preset], red[i]) for p, _, red in table if ratio[p.preset] is not None)
        assert [r for _, r in with_kv] == sorted(r for _, r in with_kv), scenario.name
        counts = simulate(scenario, 1, 0, chunk_size=DEFAULT_CHUNK, block_size=DEFAULT_BLOCK,
                          alignment=DEFAULT_ALIGNMENT)
        for p, s, red in table:
            if s.charged[0] == 0 and not s.window_rows:
                assert red[i] == 0, p.preset
            elif s.charged[0] == 0:     # no state, window objects: last-only skips some saves' windows
                assert 0 <= red[i] < 1, p.preset
            if s.charged[1] == 0:
                assert red[i] == 1 - Fraction(counts.last_only.num_saves, counts.default.num_saves), p.preset


def test_cli_takes_a_family_preset(capsys):
    from benchmark.simulate_store_writes import main
    (r, *_), = [main(['--preset', 'minimax-text-01', '--turns', '16448'])]
    assert (r.default.total_bytes, r.last_only.total_bytes) == (2 * 293601280 + 256 * 2621440,
                                                                293601280 + 256 * 2621440)
    assert '23.33%' in capsys.readouterr().out


def test_cli_charges_window_objects_of_a_mixed_family(capsys):
    """lara-mini-default (W = 512, B = 64, P = 8192): a 16,448-token turn saves at 8192 and 16384
    (default) or 16384 (last-only); the global rows of all 256 blocks below 16384 are put once, the
    window rows of blocks [120, 128) and [248, 256) only: 2·S + 256·K_glob + 16·K_win against
    S + 256·K_glob + 8·K_win."""
    from benchmark.simulate_store_writes import main
    S, K, KW = 15_024_128, 917_504, 1_703_936
    (r, *_), = [main(['--preset', 'lara-mini-default', '--turns', '16448'])]
    assert (r.default.total_bytes, r.last_only.total_bytes) == (2 * S + 256 * K + 16 * KW, S + 256 * K + 8 * KW)
    assert [t.new_window_blocks for t in r.default.turns] == [16]
    out = capsys.readouterr().out
    assert 'K_win = 1703936 bytes' in out and '9.80%' in out


def _throughput():
    spec = importlib.util.spec_from_file_location('benchmark_throughput', ROOT / 'benchmark' / 'benchmark_throughput.py')
    mod = importlib.util.module_from_spec(spec)
    sys.modules['benchmark_throughput'] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize('arch', ['lfm2', 'bamba', 'jamba', 'granitemoe_swa', 'minimax', 'bailing_hybrid',
                                  'olmo_hybrid'])
def test_arch_overrides_scale_the_tiny_widths_into_a_valid_config(arch):
    from lmdeploy.pytorch.models import get_model_class
    from lmdeploy.tools.make_tiny_model import build_config
    overrides = _throughput().arch_overrides(arch, 4)
    tiny = get_model_class(arch).tiny_config
    assert overrides['hidden_size'] == 4 * tiny['hidden_size'] == 256
    assert all(overrides[k] == 4 * tiny[k] for k in overrides)
    cfg = build_config(arch, 512, 2, 0, **overrides)      # transformers accepts the scaled fields
    assert cfg.hidden_size == 256 and cfg.num_hidden_layers == tiny['num_hidden_layers']


def test_arch_overrides_refuse_unknown_arch_and_bad_scale():
    bench = _throughput()
    with pytest.raises(ValueError, match='arch'):
        bench.arch_overrides('llama', 4)
    with pytest.raises(ValueError, match='width_scale'):
        bench.arch_overrides('lfm2', 0)


def test_step_bytes_read_lings_published_top_k_spelling(tmp_path):
    # bailing_hybrid's config.json names the routed experts per token num_experts_per_token; the
    # --arch bailing_hybrid run failed at its step-bytes line before this was read
    from transformers import AutoModelForCausalLM

    from lmdeploy.tools.make_tiny_model import make_tiny_model
    sys.path.insert(0, str(ROOT / 'benchmark'))
    from step_bytes import decode_step_bytes
    path = make_tiny_model(str(tmp_path / 'ling'), arch='bailing_hybrid')
    config = json.loads((tmp_path / 'ling' / 'config.json').read_text())
    assert 'num_experts_per_tok' not in config and config['num_experts_per_token'] == 2
    hf = AutoModelForCausalLM.from_pretrained(path)
    one, all16 = decode_step_bytes(hf, config, 1, 8), decode_step_bytes(hf, config, 16, 8)
    routed = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if '.experts.' in n)
    # k = 2 of E = 8 experts a token: exactly k / E of the routed bytes at batch 1, 1 - (6/8)^16 at 16
    assert one.experts == round(routed * 2 / 8)
    assert all16.experts == round(routed * (1 - (1 - 2 / 8) ** 16))


def test_cli_charges_window_objects_of_a_mixed_family_without_state(capsys):
    """granitemoe-swa-default (no state, W = 128, B = 64, P = 8192): a 16,448-token turn saves at
    8192 and 16384 (default) or 16384 (last-only), each an empty state object; the global rows of
    all 256 blocks are put once, the window rows of blocks [126, 128) and [254, 256) only:
    256·K_glob + 4·K_win against 256·K_glob + 2·K_win, a 2.23% reduction (before the model kept
    its window pool with a Store: 256 blocks of every layer under both, 0%)."""
    from benchmark.simulate_store_writes import main
    K, KW = 8_388_608, 25_165_824
    (r, *_), = [main(['--preset', 'granitemoe-swa-default', '--turns', '16448'])]
    assert (r.default.total_bytes, r.last_only.total_bytes) == (256 * K + 4 * KW, 256 * K + 2 * KW)
    assert [t.new_window_blocks for t in r.default.turns] == [4] and r.default.num_saves == 2
    assert '2.23%' in capsys.readouterr().out
