"""Store write-volume and recompute simulator of the checkpoint save policies."""
import importlib.util
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

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
    # charged over ranks: state slices sum to the whole state, a replicated KV head counts once
    assert tp4.charged == (sizes.state_bytes, sizes.kv_block_bytes) == (4 * tp4.state_bytes, 2 * tp4.kv_block_bytes)


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
    with pytest.raises(ValueError, match='model_type'):
        sim.sizes_from_config({k: v for k, v in sim.TINY_CONFIG.items() if k != 'model_type'})
    with pytest.raises(ValueError, match='model_type'):
        sim.sizes_from_config(dict(sim.TINY_CONFIG, model_type='no_such_model'))
    with pytest.raises(ValueError, match='kv_dtype'):
        sim.sizes_from_config(sim.TINY_CONFIG, kv_dtype='float13')


def test_cli_requires_one_size_source():
    proc = subprocess.run([sys.executable, str(SCRIPT), '--state-bytes', '10'], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode != 0 and 'kv-block-bytes' in proc.stderr


# --- turn-end (decode_save_last) and junction (save_junction) checkpoints ----------------------------------------
TOY = dict(block_size=16, alignment=64)


def _policies(scenario, *names, chunk_size=128, state=10, kv=1):
    return sim.simulate_policies(scenario, state, kv, policies=names, chunk_size=chunk_size, **TOY)


def test_turn_end_checkpoint_toy_conversation():
    # B=16 A=64 P=128, S=10 K_blk=1; turns of 100 and 200 tokens, 20-token replies.
    # turn 1: b* = 64 (floor_16(99) = 96, aligned down to 64), chunks [64, 100]; computed 100 + 20 - 1 = 119,
    #   te = floor_16(119) = 112 >= 100 (a decode forward ends there) -> save; b* is put too:
    #   bytes 2 S + 112/16 = 7 blocks = 27 (the former rule, b* kept local: S + 7 = 17).
    # turn 2: shares min(100 + 20, 200) = 120 tokens, 119 computed -> 7 blocks matched; te = 112 is a block boundary
    #   with 112/16 <= 7 and 112 <= floor_16(199) = 192 -> c = 112, recompute 88 = 80 new tokens + 8;
    #   b* = 192, te = floor_16(219) = 208 -> 2 S + (13 - 7) blocks = 26 (replacing: 16).
    # last-only alone: c = 64 at turn 2, recompute 136; bytes (10 + 4) + (10 + 12 - 4) = 32.
    scenario = sim.Scenario('toy', (100, 200), 20)
    res = _policies(scenario, 'default', 'last-only', 'last-only+turn-end', 'last-only+turn-end-replacing')
    te = res['last-only+turn-end']
    assert [(t.cached_tokens, t.save_points, t.turn_end_point, t.new_kv_blocks, t.total_bytes) for t in te.turns] == [
        (0, [64], 112, 7, 27), (112, [192], 208, 6, 26)]
    assert [t.local_only for t in te.turns] == [None, None]
    assert [t.recomputed_tokens for t in te.turns] == [100, 88] and te.num_saves == 4
    assert sim.extra_recomputed(scenario, te) == [8]
    old = res['last-only+turn-end-replacing']
    assert [(t.cached_tokens, t.local_only, t.total_bytes) for t in old.turns] == [(0, 64, 17), (112, 192, 16)]
    assert old.num_saves == 2
    last = res['last-only']
    assert [(t.cached_tokens, t.total_bytes) for t in last.turns] == [(0, 14), (64, 18)]
    assert [(t.cached_tokens, t.total_bytes) for t in res['default'].turns] == [(0, 14), (64, 18)]


def test_turn_end_forward_ends_at_the_prompts_last_block_boundary():
    # 100 tokens, a 1-token reply: nothing decoded is computed, te = floor_16(100) = 96 < n.
    # P=128: last-only chunks [64, 100], split at 96 as the engine does with decode_save_last -> [64, 96, 100],
    #   te saved (2 S + 6 blocks: b* = 64 is put too). Without turn-end the chunks stay [64, 100].
    # P=32: last-only chunks [32, 64, 96, 100] already end at 96.
    one = sim.Scenario('one', (100, ), 1)
    turn = _policies(one, 'last-only+turn-end').popitem()[1].turns[0]
    assert (turn.chunk_ends, turn.turn_end_point, turn.local_only, turn.total_bytes) == ([64, 96, 100], 96, None, 26)
    assert _policies(one, 'last-only').popitem()[1].turns[0].chunk_ends == [64, 100]
    turn = _policies(one, 'last-only+turn-end', chunk_size=32).popitem()[1].turns[0]
    assert (turn.chunk_ends, turn.turn_end_point, turn.local_only, turn.total_bytes) == ([32, 64, 96, 100], 96, None, 26)


def test_junction_toy_branching():
    # 3 siblings of 150 shared + 60 own tokens (n = 210), 8-token replies; B=16 A=64 P=100, S=10 K_blk=1.
    # sibling 1 default: chunk ends 64 | 128 | 192 | 210 (each moved down to a multiple of 64), saves [64, 128, 192],
    #   3 S + 12 blocks = 42; last-only: the same chunks (the grid depends on the prompt alone), save [192],
    #   S + 12 = 22.
    # sibling 2: 150 shared tokens -> 9 full blocks matched (144 tokens). default restores 128, saves 192 of its own
    #   prefix: S + 3 blocks past the shared 9 = 13. last-only: 192 > 150 is not shared -> c = 0, S + 3 = 13.
    #   junction: matched 144 > c = 0, largest reusable <= 144 is 128, already a chunk end -> saves
    #   [128, 192]: 2 S + 3 = 23.
    # sibling 3: junction restores 128 (as default does); (128, 144] holds no multiple of 64 -> no second junction.
    scenario = sim.Branching('toy', 150, 60, 3, 8)
    res = _policies(scenario, 'default', 'last-only', 'last-only+junction', chunk_size=100)
    d, lo, j = res['default'], res['last-only'], res['last-only+junction']
    assert [(t.cached_tokens, t.save_points, t.total_bytes) for t in d.turns] == [
        (0, [64, 128, 192], 42), (128, [192], 13), (128, [192], 13)]
    assert [(t.cached_tokens, t.save_points, t.total_bytes) for t in lo.turns] == [
        (0, [192], 22), (0, [192], 13), (0, [192], 13)]
    assert [(t.cached_tokens, t.chunk_ends, t.save_points, t.junction, t.total_bytes) for t in j.turns] == [
        (0, [64, 128, 192, 210], [192], None, 22), (0, [64, 128, 192, 210], [128, 192], 128, 23),
        (128, [192, 210], [192], None, 13)]
    assert (d.total_bytes, lo.total_bytes, j.total_bytes) == (68, 48, 58)


def test_default_and_last_only_agree_with_simulate():
    for scenario in sim.seed_scenarios() + [sim.branching_scenario()]:
        old = sim.simulate(scenario, 1435, 2, **SEED)
        new = sim.simulate_policies(scenario, 1435, 2, policies=[sim.DEFAULT, sim.LAST_ONLY], **SEED)
        assert (new['default'], new['last-only']) == (old.default, old.last_only)


def test_seed_goal_turn_end_recomputes_new_tokens_plus_one_block():
    plus4k, plus16k = sim.seed_scenarios()[4:]
    r4 = sim.simulate_policies(plus4k, 1435, 2, policies=['default', 'last-only', 'last-only+turn-end'], **SEED)
    # +4K: new user tokens per later turn 4096 - 512 = 3584; turn-end te = floor_64(n + 511) = n + 448, so the next
    # turn recomputes 4096 - 448 = 3648 = 3584 + 64; last-only restores b* = n - 64 and recomputes 4160
    assert [t.recomputed_tokens for t in r4['last-only+turn-end'].turns[1:]] == [3584 + 64] * 4
    assert [t.recomputed_tokens for t in r4['last-only'].turns[1:]] == [4160] * 4
    assert sim.extra_recomputed(plus4k, r4['last-only+turn-end']) == [64] * 4
    # bytes (S = 1435, K_blk = 2): two state puts per turn (b*, so a regenerate or an edit still restores, and te)
    # + 776 blocks = 15902, more than the default's 13016 on +4K; the former rule (b* kept local) put one:
    # 8727 = last-only's 8711 plus the last reply's 8 blocks
    r4 = {**r4, **sim.simulate_policies(plus4k, 1435, 2, policies=['last-only+turn-end-replacing'], **SEED)}
    assert (r4['default'].total_bytes, r4['last-only'].total_bytes, r4['last-only+turn-end'].total_bytes,
            r4['last-only+turn-end-replacing'].total_bytes) == (13016, 8711, 10 * 1435 + 776 * 2, 5 * 1435 + 776 * 2)
    r16 = sim.simulate_policies(plus16k, 1435, 2, policies=['default', 'last-only+turn-end'], **SEED)
    assert [t.recomputed_tokens for t in r16['last-only+turn-end'].turns[1:]] == [16384 - 512 + 64] * 4
    # +16K: 10 state puts + floor_64(98368 + 511) / 64 = 1544 blocks = 17438 < 20292 (default)
    assert (r16['default'].total_bytes, r16['last-only+turn-end'].total_bytes) == (20292, 10 * 1435 + 1544 * 2)


def test_seed_goal_junction_on_branching():
    # 4 siblings, 20800 shared + 2048 own tokens (n = 22848); the 20800 shared tokens are 325 full blocks.
    # default: sibling 1 saves 8192, 16384, 22528; siblings 2-4 restore 16384. last-only: only 22528 (past the fork)
    # -> every sibling recomputes all. junction: sibling 2 adds a save at 20480, siblings 3-4 restore it.
    res = sim.simulate_policies(sim.branching_scenario(), 1435, 2,
                                policies=['default', 'last-only', 'last-only+junction'], **SEED)
    d, lo, j = res['default'], res['last-only'], res['last-only+junction']
    assert [t.cached_tokens for t in d.turns] == [0, 16384, 16384, 16384]
    assert [t.cached_tokens for t in lo.turns] == [0, 0, 0, 0]
    assert [t.cached_tokens for t in j.turns] == [0, 0, 20480, 20480]
    assert [a.num_saves - b.num_saves for a, b in zip(j.turns, lo.turns)] == [0, 1, 0, 0]
    assert [t.junction for t in j.turns] == [None, 20480, None, None]
    # 22528 / 64 = 352 blocks for sibling 1, then 352 - 325 shared = 27 own blocks per sibling
    assert (d.total_bytes, lo.total_bytes, j.total_bytes) == (6 * 1435 + (352 + 3 * 27) * 2, 4 * 1435 + 433 * 2,
                                                              5 * 1435 + 433 * 2)


def test_policy_names():
    assert sim.Policy.parse('last-only+turn-end') == sim.TURN_END
    assert sim.Policy.parse('default+junction').name == 'default+junction'
    with pytest.raises(ValueError, match='policies'):
        sim.Policy.parse('last-only+everything')
    with pytest.raises(ValueError, match='branching'):
        sim.Branching('bad', 10, 0).requests()


def test_branching_preset_cli():
    out = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'branching'], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert 'check last-only+junction: sibling hits [0, 20480, 20480] vs default [16384, 16384, 16384]' in out
    assert 'extra saves per sibling [0, 1, 0, 0]' in out
    out = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'seed-table', '--decode-save-last'],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.count('later turns recompute new tokens + [64, 64, 64, 64]') == 2
    proc = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'seed-table', '--policies', 'sometimes'],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and 'policies' in proc.stderr


def test_sizes_come_from_the_engine_models_specs():
    """The simulator reads the model's own cache specs (as the engine loads the config): a field
    the config leaves out takes transformers' default, exactly as in the engine (the conv
    kernel of Qwen3-Next defaults to 4), and S / K_blk equal the engine cache's payload bytes."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.cache_engine import CacheEngine
    from lmdeploy.pytorch.models import get_model_class
    missing = {k: v for k, v in sim.TINY_CONFIG.items() if k != 'linear_conv_kernel_dim'}
    assert sim.sizes_from_config(missing) == sim.sizes_from_config(sim.TINY_CONFIG)
    fields = {k: v for k, v in sim.TINY_CONFIG.items() if k != 'model_type'}
    cfg = AutoConfig.for_model('qwen3_next', **fields)
    specs = get_model_class('qwen3_next').cache_specs(cfg, torch.float32)
    engine = CacheEngine(specs, 16, 1, 1)
    assert sim.sizes_from_config(sim.TINY_CONFIG, block_size=16) == sim.StoreSizes(engine.state_bytes,
                                                                                   engine.kv_block_bytes)


def _first_line_sizes(out: str) -> tuple[int, int, int, int]:
    import re
    m = re.match(r'S = (\d+) bytes, K_blk = (\d+) bytes per rank \(tp=\d+; charged over ranks: S = (\d+), '
                 r'K_blk = (\d+)\)', out)
    assert m, out.splitlines()[0]
    return tuple(int(x) for x in m.groups())


def test_glm_5_3_flash_preset_prints_the_seed_deployment_sizes():
    """S and K_blk of the seed deployment (TP8, FP8 KV, MTP on) worked out here from the
    published config's numbers: 45 layers, every fourth (11) DSA, 34 KDA of 64 heads x 128 (8 per
    rank) with three bf16 convs of kernel 4 and a float32 state; per token per DSA layer a
    512-value latent and 2 x 128 indexer values, FP8, replicated; the MTP layer one more DSA row."""
    kda_layers, dsa_layers, mtp_layers, tp = 34, 11, 1, 8
    heads, d, kernel = 64 // tp, 128, 4
    per_rank_state = kda_layers * (3 * heads * d * (kernel - 1) * 2 + heads * d * d * 4)
    kv_block = (dsa_layers + mtp_layers) * 64 * (512 + 2 * 128) * 1
    done = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'glm-5.3-flash'], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _first_line_sizes(done.stdout) == (per_rank_state, kv_block, tp * per_rank_state, kv_block)
    reductions = [line.split()[-1] for line in done.stdout.splitlines() if line.endswith('%')]
    assert len(reductions) == 6 and reductions[0] == '0.00%'
    expected = [sim.truncate_percent(r.reduction) for r in
                (sim.simulate(s, tp * per_rank_state, kv_block, **SEED) for s in sim.seed_scenarios())]
    assert reductions == expected
    # without MTP and in bf16 the KV block changes as the config says; tp=1 holds every head
    done = subprocess.run([sys.executable, str(SCRIPT), '--preset', 'glm-5.3-flash', '--no-mtp', '--kv-dtype',
                           'bfloat16', '--tp', '1'], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    whole = tp * per_rank_state
    assert _first_line_sizes(done.stdout) == (whole, dsa_layers * 64 * 768 * 2, whole, dsa_layers * 64 * 768 * 2)


def test_glm_5_3_flash_sizes_refuse_bad_config():
    from benchmark.glm5_next_sizes import GLM_5_3_FLASH_CONFIG, glm5_next_specs
    with pytest.raises(ValueError, match='linear_num_heads'):
        glm5_next_specs(GLM_5_3_FLASH_CONFIG, tp=3)
    with pytest.raises(ValueError, match='indexer_types'):
        glm5_next_specs(dict(GLM_5_3_FLASH_CONFIG, indexer_types=['full']))
    shared = ['full' if i % 8 == 3 else 'shared' for i in range(45)]     # a 'shared' layer keeps no indexer keys
    specs = glm5_next_specs(dict(GLM_5_3_FLASH_CONFIG, indexer_types=shared))
    assert sum(len(s.tensors()) for s in specs if s.paged) == 11 + 6


def test_glm_5_3_flash_preset_matches_the_engine_model_when_there_is_one():
    """Once a glm5_next model file exists, its own cache specs must give the preset's sizes."""
    from lmdeploy.pytorch.models import get_model_class
    try:
        get_model_class('glm5_next')
    except (KeyError, ValueError):
        pytest.skip('no glm5_next model in the engine on this branch')
    from benchmark.glm5_next_sizes import GLM_5_3_FLASH_CONFIG, glm5_next_sizes
    fields = {k: v for k, v in GLM_5_3_FLASH_CONFIG.items() if k != 'num_nextn_predict_layers'}
    engine = sim.sizes_from_config(fields, tp=8, kv_dtype='float8_e4m3fn')
    s, k, s_all, k_all = glm5_next_sizes(GLM_5_3_FLASH_CONFIG, tp=8, block_size=64, kv_dtype=torch.float8_e4m3fn,
                                         state_dtype=torch.bfloat16, mtp=False)
    assert (engine.state_bytes, engine.kv_block_bytes, *engine.charged) == (s, k, s_all, k_all)


def test_shared_head_toy_branching():
    # 3 agent sessions: 150 shared tokens (a 140-token head of system prompt and tools, then the same
    # first words), 60 of their own (n = 210), 8-token replies; B=16 A=64 P=128, S=10 K_blk=1.
    # session 1, either policy: the head's boundary is 128 (a grid end), b* = 192: chunks [128, 192, 210],
    #   saves [128, 192]: 2 S + 12 blocks = 32.
    # sessions 2, 3: 9 full blocks matched (144 tokens); restore 128, save their own 192: S + 3 blocks = 13.
    # Without the head, last-only's only checkpoint (192) lies past the divergence: they restore nothing.
    with_head = sim.Branching('toy agent', 150, 60, 3, 8, head_tokens=140)
    res = _policies(with_head, 'default', 'last-only')
    for name in ('default', 'last-only'):
        assert [(t.cached_tokens, t.chunk_ends, t.save_points, t.shared_head, t.total_bytes)
                for t in res[name].turns] == [(0, [128, 192, 210], [128, 192], 128, 32),
                                              (128, [192, 210], [192], None, 13), (128, [192, 210], [192], None, 13)]
        assert res[name].num_saves == 4 and res[name].total_bytes == 58
    plain = _policies(sim.Branching('toy agent', 150, 60, 3, 8), 'last-only')['last-only']
    assert [t.cached_tokens for t in plain.turns] == [0, 0, 0]
    # a head shorter than A has no boundary: the same as no head
    short = _policies(sim.Branching('toy agent', 150, 60, 3, 8, head_tokens=60), 'last-only')['last-only']
    assert short == plain


def test_shared_head_scenario_checks_and_scaling():
    with pytest.raises(ValueError, match='head_tokens'):
        sim.Branching('x', 150, 60, 3, 8, head_tokens=151).requests()
    with pytest.raises(ValueError, match='head_tokens'):
        sim.Scenario('x', (100, 200), 8, head_tokens=101).requests()
    assert sim.Branching('x', 1600, 320, 2, 16, head_tokens=1280).scaled(Fraction(1, 16)).head_tokens == 80
    # every turn of a conversation carries the head; restores deeper than it skip its save
    turns = _policies(sim.Scenario('chat', (200, 400), 20, head_tokens=140), 'last-only')['last-only'].turns
    assert [(t.cached_tokens, t.save_points, t.shared_head) for t in turns] == [(0, [128, 192], 128),
                                                                                (192, [384], None)]


def test_cli_head_tokens_names_the_scenario(capsys):
    sim.main(['--preset', 'branching', '--head-tokens', '16384'])
    out = capsys.readouterr().out
    assert '4 siblings 20K+320 +2K head 16384' in out
    # last-only: sessions 2-4 restore the head's 16384 instead of nothing
    assert '      2   22848 |   16384   6464     1         1489 |   16384   6464     1         1489 |' in out


@pytest.mark.parametrize('window_rows,block', [(40, 16), (512, 64), (1, 16), (64, 16)])
def test_window_objects_cover_each_save_points_window_once(window_rows, block):
    """A mixed model with window objects (``window_rows`` = W, K_win): per policy the bytes are
    ``saves·S + new_global·K_glob + new_window·K_win``, where the global blocks are every block below
    a save point (as without windows) and the window blocks the union over save points b of
    ``[window_first_block(b, W), b/B)``, each object once per conversation (a prefix shared by the
    turns is one object). Checked against that set computed here, on every seed-table scenario."""
    from lmdeploy.pytorch.cache_specs import window_first_block
    S, K, KW = 7, 3, 5
    geo = dict(chunk_size=512, block_size=block, alignment=4 * block)
    for scenario in sim.seed_scenarios():
        scenario = scenario.scaled(Fraction(1, 16))
        plain = sim.simulate(scenario, S, K, **geo)
        got = sim.simulate(scenario, S, K, **geo, window_block_bytes=KW, window_rows=window_rows)
        for p, q in ((plain.default, got.default), (plain.last_only, got.last_only)):
            # the same save points and global blocks as without windows
            assert [t.save_points for t in q.turns] == [t.save_points for t in p.turns]
            assert [t.kv_bytes for t in q.turns] == [t.kv_bytes for t in p.turns]
            # append-only turns: prefixes are shared, so a window block is one object per index
            want = {k for t in q.turns for b in t.save_points
                    for k in range(window_first_block(b, window_rows, block), b // block)}
            assert sum(t.new_window_blocks for t in q.turns) == len(want)
            assert q.total_bytes == p.total_bytes + len(want) * KW
            assert sum(t.window_bytes for t in q.turns) == len(want) * KW


def test_window_rows_arguments_are_checked():
    for kwargs, field in ((dict(window_rows=0), 'window_rows'), (dict(window_block_bytes=-1), 'window_block_bytes'),
                          (dict(window=8, window_rows=8), 'exclude')):
        with pytest.raises(ValueError, match=field):
            sim.simulate([100], 1, 1, chunk_size=32, block_size=16, alignment=32, **kwargs)
