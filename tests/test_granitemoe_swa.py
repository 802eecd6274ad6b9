"""Granite MoE with sliding-window attention (``granitemoe_swa``) served exactly like transformers:
logits <= 1e-4 in fp32 at every prompt position (5-700 tokens, cold and in 32-token chunks whose
ends fall inside the 24-token windows), greedy tokens equal cold, chunked and after a local
prefix-cache restore, a 4-turn chat identical under every cache policy, TP2 = TP1, the layer
cache specs, config refusals naming their field, the audit of every field transformers reads,
random geometries (windows from 1 token up, NoPE and RoPE layers) in random chunks, and the
window kernel never reading a block wholly before its queries' windows."""
import inspect
import json
import os
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine_utils import (TOL, check_four_turn_chat_under_every_cache_policy, check_prompt_logits_match_transformers,
                          hf_greedy, make_engine, random_prompt, tiny_checkpoint_and_reference)
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_specs import (FullAttentionSpec, SlidingWindowSpec, kv_bytes_per_block, kv_window,
                                          window_first_block)
from lmdeploy.pytorch.paging.sequence import FREED_BLOCK
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import FIELDS, check_config


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path, transformers float32 reference)."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'granitemoe_swa')


def test_tiny_model_mixes_windows_rope_bases_and_sinks(tiny):
    config = json.load(open(os.path.join(tiny[0], 'config.json')))
    assert config['layer_types'] == ['full_attention', 'sliding_attention', 'sliding_attention', 'full_attention']
    assert config['sliding_window'] == 24 and 32 % 24 and 24 % 16     # chunk and block ends fall inside windows
    assert 0 in config['layer_rope_theta'] and len({t for t in config['layer_rope_theta'] if t}) == 2
    assert tiny[1].model.layers[1].self_attn.sinks.abs().max() > 1       # sinks large enough to matter


@pytest.mark.parametrize('n, chunk', [(5, 8192), (150, 32), (700, 32), (300, 8192)])
def test_prompt_logits_match_transformers_cold_and_chunked(tiny, n, chunk):
    check_prompt_logits_match_transformers(*tiny, n, chunk)


def test_greedy_equals_transformers_cold_chunked_and_after_prefix_cache_restore(tiny):
    """12 greedy tokens of a 200-token prompt equal transformers cold, in 32-token chunks, and
    with the prefix cache on both the first run and a rerun that restores 12 blocks (192 tokens:
    no state, but global and sliding layers, so one marker, a zero-byte checkpoint, at the prompt's
    last full block boundary keeps the window rows a restore there reads)."""
    path, hf = tiny
    ids = random_prompt(200, seed=11)
    expected = hf_greedy(hf, ids, 12)
    gen = GenerationConfig(max_new_tokens=12)
    cold = make_engine(path, block_size=16).generate(ids, gen).output_ids
    chunked = make_engine(path, block_size=16, max_prefill_token_num=32).generate(ids, gen).output_ids
    cached = make_engine(path, block_size=16, max_prefill_token_num=32, enable_prefix_caching=True)
    first, again = cached.generate(ids, gen), cached.generate(ids, gen)
    assert cold == chunked == first.output_ids == again.output_ids == expected
    assert first.num_cached_tokens == 0 and first.stats.save_points == [192] and again.num_cached_tokens == 192
    assert cached.window_pool is not None and cached.ledger()['checkpoints_published'] == 1


def test_four_turn_chat_is_identical_under_every_cache_policy(tiny):
    check_four_turn_chat_under_every_cache_policy(tiny[0])


def test_four_turn_chat_with_caching_keeps_the_window_pool_and_markers_window_rows(tiny):
    """Global and 24-token sliding layers, no state, caching on (B = 16, A = 64, 32-token chunks):
    the sliding layers keep their pool, and markers (zero-byte checkpoints) at the save points
    (multiples of 64) and at each prompt's last full block boundary keep the window rows their
    restores read: after turn t the trie holds exactly the markers' windows (3, 6, 10, 13 window
    blocks: two per marker, neighbours sharing one) against every global block. Replies equal
    caching off (and transformers on the last turn); turns 2-4 restore at the previous prompt's
    last marker (80, 144, 224) or, with ``decode_save_last``, at the reply's last block boundary
    when it has one of its own (96 after turn 1); idle after each turn, every pool free once the
    cache is emptied."""
    from engine_utils import assert_idle
    from lmdeploy.pytorch.cache_specs import window_first_block
    path, hf = tiny
    users = [random_prompt(n, seed=40 + i) for i, n in enumerate((90, 50, 70, 40))]
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    fields = dict(block_size=16, max_prefill_token_num=32, prefill_save_alignment=64, num_checkpoint_slots=16)
    engines = {name: make_engine(path, **fields, **extra) for name, extra in
               (('off', {}), ('on', dict(enable_prefix_caching=True)),
                ('turn_end', dict(enable_prefix_caching=True, decode_save_last=True)))}
    hits = {'on': [0, 80, 144, 224], 'turn_end': [0, 96, 144, 224]}
    window_rows = {'on': [3, 6, 10, 13], 'turn_end': [4, 7, 11, 14]}
    ids = {name: [] for name in engines}
    for t, user in enumerate(users):
        replies = {}
        for name, eng in engines.items():
            ids[name] = ids[name] + user
            seq = eng.generate(ids[name], gen)
            replies[name] = seq.output_ids
            prompt, ids[name] = ids[name], list(seq.token_ids)
            assert eng.is_idle()
            if name == 'off':
                continue
            local = eng.prefix_cache.local
            assert eng.window_pool is not None and local.markers
            assert seq.num_cached_tokens == hits[name][t]
            marked = [n for n in local.cached_nodes() if n.checkpoint_slot is not None]
            reads = {id(m) for n in marked for m in local._window_reads(n)}
            assert set(local.trie.window_nodes) == reads
            assert all(len(local._window_reads(n)) == n.depth - window_first_block(n.depth * 16, W, 16)
                       for n in marked)
            led = eng.ledger()
            assert led['window_blocks_cached'] == window_rows[name][t]
            assert led['blocks_cached'] == (len(ids[name]) - 1) // 16 and led['checkpoints_pinned'] == 0
        assert replies['on'] == replies['turn_end'] == replies['off']
    assert replies['off'] == hf_greedy(hf, prompt, 8)
    assert engines['turn_end'].stats()['turn_end_checkpoints_saved'] == 1     # (96; 144, 224, 272 were markers already)
    for eng in engines.values():
        eng.prefix_cache.evict(10**6)
        assert_idle(eng)


def test_cache_specs_are_global_and_sliding_window_kv(tiny):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    specs = get_model_class('granitemoe_swa').cache_specs(config, torch.float32)
    assert [type(s) for s in specs] == [FullAttentionSpec, SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec]
    assert specs[1].window == 24 and kv_window(specs) is None          # global layers read every earlier token
    assert kv_window(specs[1:3]) == 24 and kv_window([]) == 0
    head_dim = config.hidden_size // config.num_attention_heads
    assert kv_bytes_per_block(specs, 16) == 4 * 16 * 2 * config.num_key_value_heads * head_dim * 4
    with pytest.raises(ValueError, match='sliding_window'):
        SlidingWindowSpec(2, 16, torch.float32, 0)


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(layer_types=['full_attention'] * 2), 'layer_types'),
    (dict(layer_types=['full_attention', 'chunked_attention', 'full_attention', 'full_attention']), 'layer_types'),
    (dict(sliding_window=0), 'sliding_window'),
    (dict(sliding_window=None), 'sliding_window'),
    (dict(layer_rope_theta=[1.0, 2.0]), 'layer_rope_theta'),
    (dict(layer_rope_theta=[1.0, -1.0, 0, 0]), 'layer_rope_theta'),
    (dict(rope_parameters=dict(rope_type='dynamic', rope_theta=1e4, factor=2.0)), 'rope_type'),
    (dict(num_experts_per_tok=9), 'num_experts_per_tok'),
    (dict(num_local_experts=0), 'num_local_experts'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    for k, v in change.items():
        object.__setattr__(config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)


def test_audit_lists_every_field_transformers_reads_for_granitemoe_swa():
    import transformers.models.granitemoe_swa.modeling_granitemoe_swa as modeling
    source = inspect.getsource(modeling)
    read = set(re.findall(r'config\.(\w+)', source)) | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)',
                                                                       source))
    assert read and not read - set(FIELDS['granitemoe_swa']), sorted(read - set(FIELDS['granitemoe_swa']))


def test_tp2_logits_and_greedy_tokens_equal_tp1(tiny):
    """Attention by head (sinks with their query heads), the shared MLP by rows; experts replicated."""
    from test_tensor_parallel import check_tp2_equals_tp1
    check_tp2_equals_tp1(tiny[0])


def test_tp_refuses_a_head_count_it_cannot_split_naming_the_field(tiny):
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    config = AutoConfig.from_pretrained(tiny[0])
    with pytest.raises(ValueError, match='num_key_value_heads'):
        TPLayout(config, 0, 4)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_configs_match_transformers_in_random_chunks_then_decode(data):
    """Model level, random geometry (global / sliding layers, windows of 1-40 tokens, NoPE or RoPE
    per layer, shared MLP or none) and a random prefill chunking then 3 decode steps: logits
    <= 1e-4 of transformers' full forward, through NaN-poisoned scrambled blocks."""
    from transformers import GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM

    from model_harness import check_random_model_in_random_chunks_then_decode
    n_layers = data.draw(st.integers(1, 3))
    types = data.draw(st.lists(st.sampled_from(['full_attention', 'sliding_attention']), min_size=n_layers,
                               max_size=n_layers))
    thetas = data.draw(st.lists(st.sampled_from([0, 10000.0, 500.0]), min_size=n_layers, max_size=n_layers))
    config = GraniteMoeSWAConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=n_layers, layer_types=types,
        sliding_window=data.draw(st.integers(1, 40)), layer_rope_theta=thetas, num_attention_heads=4,
        num_key_value_heads=data.draw(st.sampled_from([1, 2, 4])), num_local_experts=4,
        num_experts_per_tok=data.draw(st.integers(1, 3)), intermediate_size=16,
        shared_intermediate_size=data.draw(st.sampled_from([0, 24])), embedding_multiplier=4.0,
        residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0, pad_token_id=0, bos_token_id=None,
        eos_token_id=1, rope_parameters=dict(rope_type='default', rope_theta=10000.0))
    check_random_model_in_random_chunks_then_decode(data, GraniteMoeSWAForCausalLM, 'granitemoe_swa', config, 70,
                                                    TOL)


@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 50), hist=st.integers(0, 90), new=st.integers(1, 40), gqa=st.sampled_from([1, 2]),
       sinks=st.booleans())
def test_window_kernel_equals_a_masked_softmax_and_never_reads_blocks_before_the_window(window, hist, new, gqa,
                                                                                        sinks):
    """``paged_window_attention`` equals a dense masked softmax (plus the sink logit in the
    denominator) over ``[history + new]`` keys, with every block that lies wholly before the
    first query's window replaced by NaN in the cache and its table entry pointing at a NaN block."""
    from lmdeploy.pytorch.kernels.window_attention import paged_window_attention
    from lmdeploy.pytorch.model_inputs import StepContext
    B, Hkv, D = 8, 2, 4
    H = Hkv * gqa
    gen = torch.Generator().manual_seed(window * 1000 + hist * 10 + new)
    n = hist + new
    keys, values = torch.randn(n, Hkv, D, generator=gen), torch.randn(n, Hkv, D, generator=gen)
    q = torch.randn(new, H, D, generator=gen)
    sink = torch.randn(H, generator=gen) if sinks else None
    nblocks = -(-n // B)
    k_cache = torch.full((nblocks + 1, B, Hkv, D), float('nan'))
    v_cache = k_cache.clone()
    table = torch.arange(nblocks, dtype=torch.int64)
    for j in range(hist):
        k_cache[j // B, j % B], v_cache[j // B, j % B] = keys[j], values[j]
    dead = max(0, hist - window + 1) // B             # blocks no new query's window reaches
    k_cache[:dead], v_cache[:dead] = float('nan'), float('nan')
    table[:dead] = nblocks                            # a freed block id may point anywhere
    ctx = StepContext(input_ids=torch.zeros(new, dtype=torch.int64), positions=torch.arange(hist, n),
                      q_seqlens=[new], q_start_loc=[0], kv_seqlens=[n], block_tables=[table], state_slots=[0],
                      kv_caches=[(k_cache, v_cache)], state_caches=[None], block_size=B)
    got = paged_window_attention(q, keys[hist:], values[hist:], k_cache, v_cache, ctx, 0.5, window, sink)
    q_pos, k_pos = torch.arange(hist, n)[:, None], torch.arange(n)[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    scores = torch.einsum('qhd,khd->hqk', q, keys.repeat_interleave(gqa, 1)) * 0.5
    scores = scores.masked_fill(~visible, float('-inf'))
    if sink is not None:
        scores = torch.cat([scores, sink[:, None, None].expand(H, new, 1)], -1)
    probs = scores.softmax(-1)[..., :n]
    ref = torch.einsum('hqk,khd->qhd', probs, values.repeat_interleave(gqa, 1))
    assert not got.isnan().any() and (got - ref).abs().max().item() <= 1e-5


# every paged layer sliding-window: a running sequence gives back blocks no window reaches --------
W, B, P = 24, 16, 32            # the tiny model's window, the block size and the prefill chunk below


@pytest.fixture(scope='module')
def all_swa(tmp_path_factory):
    """(checkpoint, transformers reference) of the tiny model with all four layers sliding."""
    from engine_utils import load_hf

    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path_factory.mktemp('tiny_all_swa')), arch='granitemoe_swa', seed=1,
                           layer_types=['sliding_attention'] * 4)
    return path, load_hf(path)


def _track_blocks_in_use(eng) -> list[int]:
    """Blocks referenced after each step's :meth:`Scheduler.computed` (the list fills as it runs)."""
    seen, computed = [], eng.scheduler.computed

    def wrapped(out):
        saves = computed(out)
        seen.append(eng.block_manager.num_blocks - eng.block_manager.num_free)
        return saves
    eng.scheduler.computed = wrapped
    return seen


@pytest.mark.parametrize('caching', [False, True])
def test_memory_of_a_long_all_swa_sequence_stays_within_its_window(all_swa, caching):
    """A 700-token prompt (32-token chunks) and 40 greedy tokens in a cache of 6 blocks (96
    tokens): transformers' tokens; session_len is not capped to the cache. Without the prefix
    cache the blocks in use never exceed ceil((W - 1 + P) / B) + 1 = 5 (47 without freeing) and
    all are free again at the end; with it, the cache evicts what the sequence let go."""
    from engine_utils import assert_idle
    path, hf = all_swa
    ids = random_prompt(700, seed=70)
    eng = make_engine(path, block_size=B, max_prefill_token_num=P, num_gpu_blocks=6, enable_prefix_caching=caching)
    assert [g.window for g in eng.scheduler.groups] == [W] and eng.window_pool is None and eng.session_len > 740
    seen = _track_blocks_in_use(eng)
    seq = eng.generate(ids, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    assert seq.output_ids == hf_greedy(hf, ids, 40) and len(seen) == 700 // P + 1 + 39
    if not caching:
        assert max(seen) <= -(-(W - 1 + P) // B) + 1 < -(-740 // B)
        assert_idle(eng)


def test_a_model_with_global_layers_keeps_every_global_block(tiny):
    """Mixed global and sliding layers: the global layers' table keeps every block (its group has no
    window) and session_len is capped to the cache; the sliding layers have a table and a pool of
    their own (tests/test_window_block_tables.py)."""
    eng = make_engine(tiny[0], block_size=B, max_prefill_token_num=P, num_gpu_blocks=16)
    seen = _track_blocks_in_use(eng)
    eng.generate(random_prompt(200, seed=5), GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert [g.window for g in eng.scheduler.groups] == [None, W] and eng.window_pool is not None
    assert max(seen) == -(-203 // B) and eng.session_len == 16 * B


def test_all_swa_four_turn_chat_is_identical_under_every_cache_policy(all_swa):
    """With blocks freed as windows pass, the prefix cache still caches (it took its own reference
    on each full block before the sequence let go) and every policy replies the same."""
    check_four_turn_chat_under_every_cache_policy(all_swa[0])


@settings(max_examples=6, deadline=None)
@given(n=st.integers(60, 260), evict_at=st.integers(1, 8), new=st.integers(1, 20))
def test_a_prefix_whose_window_block_was_evicted_is_never_restored(all_swa, n, evict_at, new):
    """A sequence frees its out-of-window blocks; while it runs, the prefix cache evicts everything
    it may (the freed blocks' nodes among them) at step ``evict_at``. When it ends, no node is
    made for a block it freed and the cache lost; the same prompt again restores only a prefix whose
    every block is still cached (never one whose window reaches an evicted block), attaching only
    the blocks its window reads (the ones before are FREED_BLOCK in its table), decodes what a
    cold engine decodes, and the block ledger balances."""
    path, _ = all_swa
    ids = random_prompt(n, seed=n)
    gen = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    eng = make_engine(path, block_size=B, max_prefill_token_num=P, enable_prefix_caching=True, num_gpu_blocks=64)
    steps, computed = [], eng.scheduler.computed

    def wrapped(out):
        saves = computed(out)
        steps.append(1)
        if len(steps) == evict_at:
            eng.prefix_cache.evict(eng.block_manager.num_blocks)
        return saves
    eng.scheduler.computed = wrapped
    first = eng.generate(ids, gen)
    nodes = eng.prefix_cache.cached_nodes()
    assert all(node.block_id >= 0 and eng.block_manager.refcount[node.block_id] == 1 for node in nodes)
    restored, schedule = [], eng.scheduler.schedule

    def scheduled():        # a restore attaches only its window's blocks, each one live
        out = schedule()
        for chunk in out.chunks:
            seq, c = chunk.seq, chunk.seq.num_cached_tokens
            if c and chunk.start == c:
                lead = window_first_block(c, W, B)
                assert seq.block_ids[:lead] == [FREED_BLOCK] * lead and seq.num_freed_blocks == lead
                assert all(eng.block_manager.refcount[b] >= 1 for b in seq.block_ids[lead:])
                restored.append(c)
        return out
    eng.scheduler.schedule = scheduled
    again = eng.generate(ids, gen)
    assert restored == ([again.num_cached_tokens] if again.num_cached_tokens else [])
    cold = make_engine(path, block_size=B, max_prefill_token_num=P).generate(ids, gen)
    assert first.output_ids == again.output_ids == cold.output_ids
    assert again.num_cached_tokens % B == 0
    led = eng.ledger()
    assert led['blocks_free'] + led['blocks_cached'] == led['blocks_total'] and led['blocks_in_use'] == 0


# the Store: a window model puts and restores exactly the blocks its windows read -------------------
def _store_round_trip(path, tmp_path, window, window_rows=None):
    """A 300-token prompt (A = P = 64: save points 64, 128, 192, 256) through a ``file:`` Store:
    a writer engine puts it, a new engine with an empty local cache restores 256 tokens from it.
    ``window``: every paged layer slides; ``window_rows``: the window group keeps a pool of its
    own (window objects). Returns (writer stats, K_blk, blocks in use after each of the reader's
    admissions, the cold engine's output ids, K_win: 0 without window objects)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmark'))
    from store_sim import simulate
    ids = random_prompt(300, seed=300)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    fields = dict(block_size=B, prefill_save_alignment=64, max_prefill_token_num=64, enable_prefix_caching=True,
                  store_backend=f'file:{tmp_path / "store"}')
    writer = make_engine(path, **fields)
    first = writer.generate(ids, gen)
    assert writer.store.flush(timeout=30) and writer.store.window == window
    assert writer.store.window_rows == window_rows and (writer.window_pool is not None) == bool(window_rows)
    stats, K = writer.stats(), writer.cache_engine.kv_block_bytes
    K_win = writer.cache_engine.window_block_bytes if window_rows else 0
    writer.close()
    # S = 0: a model without state puts an empty state object per save point
    predicted = simulate([300], 0, K, chunk_size=64, block_size=B, alignment=64, window=window,
                         window_block_bytes=K_win, window_rows=window_rows)
    assert sum(stats['store_put_bytes'].values()) == predicted.default.total_bytes
    reader = make_engine(path, **fields)
    seen, schedule = [], reader.scheduler.schedule

    def scheduled():        # blocks in use once the step's admissions hold theirs (before the forward)
        out = schedule()
        seen.append(reader.block_manager.num_blocks - reader.block_manager.num_free)
        return out
    reader.scheduler.schedule = scheduled
    try:
        again = reader.generate(ids, gen)
    finally:
        reader.close()
    cold = make_engine(path, block_size=B, max_prefill_token_num=64).generate(ids, gen).output_ids
    assert first.output_ids == again.output_ids == cold
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == again.stats.store_hit_tokens == 256
    return stats, K, seen, cold, K_win


def test_all_swa_store_puts_only_window_blocks_and_a_new_engine_restores_its_window(all_swa, tmp_path):
    """W = 24: the save at b puts blocks [floor((b - 23) / 16), b / 16): {2, 3}, {6, 7}, {10, 11},
    {14, 15}, 8 KV objects, and 4 empty state objects; the bytes equal the simulator's. A new
    engine restores 256 tokens from the Store and decodes what a cold engine decodes, holding
    only the window's blocks: 5 for [224, 300) at the first step, never the 19 of the prefix; so
    does a fresh process."""
    stats, K, seen, cold, _ = _store_round_trip(all_swa[0], tmp_path, W)
    assert stats['store_put_objects'] == {'state': 4, 'kv': 8}
    assert stats['store_put_bytes'] == {'state': 0, 'kv': 8 * K}
    assert seen[0] == 5 and max(seen) <= -(-(W - 1 + 64) // B) + 1 < -(-306 // B)
    # a fresh process (empty local cache, nothing imported before) restores the same from the folder
    from test_store_file_backend import run_worker, store_config
    ids = random_prompt(300, seed=300)
    fresh = run_worker(tmp_path, 'fresh', all_swa[0], store_config(tmp_path / 'store'), [ids])
    [turn] = fresh['turns']
    assert turn['store_hit_tokens'] == 256 and turn['output_ids'] == cold and fresh['idle']


def test_mixed_global_and_window_store_restores_every_block_in_a_new_engine(tiny, tmp_path):
    """Global layers read every earlier token: the global rows of the 16 blocks below 256 are put
    as KV objects and the sliding layers' rows of each save point's window only as window objects
    (W = 24: {2, 3}, {6, 7}, {10, 11}, {14, 15}), the prompt's last block boundary (288) being a
    local marker only; bytes ``0·4 + 16·K_glob + 8·K_win`` equal the simulator's with window rows
    (before the window pool was kept with a Store: 16 KV objects of every layer's rows), and a new
    engine restores 256 tokens."""
    stats, K, seen, _, K_win = _store_round_trip(tiny[0], tmp_path, None, window_rows=W)
    assert stats['store_put_objects'] == {'state': 4, 'kv': 16, 'window': 8}
    assert stats['store_put_bytes'] == {'state': 0, 'kv': 16 * K, 'window': 8 * K_win}
    assert seen[0] == -(-300 // B)


# the Store and host tier keep the window pool: markers' windows as window objects / entries -------
def _marker_windows(boundaries) -> set[int]:
    """Indices of the blocks the windows of restores at ``boundaries`` read (W = 24, B = 16)."""
    return {k for b in boundaries for k in range(window_first_block(b, W, B), b // B)}


def _live_window_tracker(eng) -> list[int]:
    """After each step: the window pool holds exactly the trie's window rows plus each running
    sequence's live window (shared blocks once); returns the live windows seen (filled as it runs)."""
    wp, local, computed, lives = eng.window_pool, eng.prefix_cache.local, eng.scheduler.computed, []

    def tracked(out):
        saves = computed(out)
        for c in out.chunks:
            seq = c.seq
            live = len(seq.window_block_ids) - seq.num_window_freed_blocks
            shared = sum(1 for b in seq.window_block_ids[seq.num_window_freed_blocks:] if wp.refcount[b] > 1)
            assert wp.num_blocks - wp.num_free == local.num_window_blocks + live - shared
            lives.append(live)
        return saves
    eng.scheduler.computed = tracked
    return lives


def test_a_store_keeps_the_window_pool_and_markers_and_restores_from_window_objects(tiny, tmp_path):
    """Regression (it fell back to one shared table, every sliding block kept): with a ``file:``
    Store the model keeps its window pool and markers. A 100-token prompt decoding 300 tokens
    holds at most ceil((W - 1 + P) / B) + 1 live window blocks, the trie only its markers' windows
    (64; 96, the prompt's last block boundary). A 220-token prompt puts, at its save points 64,
    128, 192, the global rows of every block below as KV objects, the rows of each window as window
    objects and an empty state object; its marker at 208 stays local. A new engine restores 192
    tokens (kept as a marker holding the window rows the load wrote) and decodes what a cold engine
    decodes, so does a fresh process; with the window object of block 11 (read only by 192's window) deleted, 192 is never
    offered (no failed load) and 128 is restored, same tokens. Idle afterwards."""
    from engine_utils import assert_idle
    from test_window_prefix_cache import _window_object
    path, _ = tiny
    store = tmp_path / 'store'
    fields = dict(block_size=B, max_prefill_token_num=P, prefill_save_alignment=64, enable_prefix_caching=True,
                  store_backend=f'file:{store}')
    eng = make_engine(path, **fields)
    local = eng.prefix_cache.local
    assert eng.window_pool is not None and local.markers and eng.store.window_rows == W
    assert [g.window for g in eng.scheduler.groups] == [None, W]
    lives = _live_window_tracker(eng)
    long = eng.generate(random_prompt(100, seed=90), GenerationConfig(max_new_tokens=300, ignore_eos=True))
    assert len(lives) > 300 and max(lives) <= -(-(W - 1 + P) // B) + 1
    assert long.stats.save_points == [64, 96] and local.num_window_blocks == len(_marker_windows([64, 96])) == 4
    del eng.scheduler.computed      # (the instance's wrapper: the class's method again)
    ids = random_prompt(220, seed=91)
    short = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    first = eng.generate(ids, short)
    assert eng.store.flush(timeout=30)
    assert first.stats.save_points == [64, 128, 192, 208]
    K, K_win = eng.cache_engine.kv_block_bytes, eng.cache_engine.window_block_bytes
    stats = eng.stats()
    # 64 of the first prompt (4 blocks, window {2, 3}), then 64, 128, 192 of this one
    assert stats['store_put_objects'] == {'state': 4, 'kv': 4 + 12, 'window': 2 + 6}
    assert stats['store_put_bytes'] == {'state': 0, 'kv': 16 * K, 'window': 8 * K_win}
    eng.prefix_cache.evict(10**6)
    assert_idle(eng)
    eng.close()
    cold = make_engine(path, block_size=B, max_prefill_token_num=P).generate(ids, short).output_ids
    assert first.output_ids == cold
    # a fresh process (empty local cache, nothing imported before) restores the same from the folder
    from test_store_file_backend import run_worker, store_config
    fresh = run_worker(tmp_path, 'fresh', path, store_config(store), [ids])
    [turn] = fresh['turns']
    assert turn['store_hit_tokens'] == 192 and turn['output_ids'][:4] == cold and fresh['idle']
    for deleted, restored in ((None, 192), (11, 128)):
        if deleted is not None:
            _window_object(store, ids, deleted).unlink()
        reader = make_engine(path, **fields)
        try:
            again = reader.generate(ids, short)
            assert again.num_cached_tokens == again.stats.store_hit_tokens == restored
            assert again.output_ids == cold
            assert reader.stats()['store_get_failures'] == 0 and reader.stats()['store_rejected_objects'] == 0
            assert again.stats.save_points == ([208] if restored == 192 else [192, 208])
            # the restored boundary became a marker keeping its window rows, as the ones saved after it
            kept = [restored] + again.stats.save_points
            markers = {n.depth * B for n in reader.prefix_cache.cached_nodes() if n.checkpoint_slot is not None}
            assert markers == set(kept) and reader.stats()['checkpoints_saved_by_reason']['restored'] == 1
            assert reader.ledger()['window_blocks_cached'] == len(_marker_windows(kept))
            reader.prefix_cache.evict(10**6)
            assert_idle(reader)
        finally:
            reader.close()


@pytest.mark.parametrize('policy, out, backend', [('default', 16, 'file'), ('default', 16, 'mooncake'),
                                                  ('last-only', 16, 'file'), ('default+turn-end', 16, 'file'),
                                                  ('default+turn-end', 2, 'file')])
def test_store_put_bytes_of_a_chat_equal_the_simulator_with_window_objects(tiny, tmp_path, request, policy, out,
                                                                           backend):
    """A 3-turn chat (146, 260, 400-token prompts, each the previous one + its reply + new tokens;
    B = 16, A = 64, P = 32) through a ``file:`` Store (and the session's Mooncake Store): the put
    bytes are ``0·saves +
    new_global·K_glob + new_window·K_win``, what ``simulate()`` charges with window rows, object
    for object; with ``prefill_save_last_only`` at the last save point of each turn only; with
    ``decode_save_last`` the turn-end markers are put as a hybrid's turn ends are
    (160, 272; 144 and 400 after 2-token replies, 144 being also the first prompt's last block
    boundary, otherwise a local-only marker; none where the reply's decode gave back a window block
    the turn end reads), the prompt-end markers never. ``sizes_from_config`` of config.json gives the engine's
    S = 0, K_glob, K_win and W."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmark'))
    from store_presets import sizes_from_config
    from store_sim import Scenario, simulate_policies
    path, _ = tiny
    lengths = [146, 260, 400]
    if backend == 'file':
        store = dict(store_backend=f'file:{tmp_path / "store"}')
    else:       # (prompts seeded for this test alone: the session's Store holds other tests' objects)
        services = request.getfixturevalue('mooncake_services')
        store = dict(mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server)
    eng = make_engine(path, block_size=B, max_prefill_token_num=P, prefill_save_alignment=64,
                      enable_prefix_caching=True, decode_save_last=policy.endswith('turn-end'),
                      prefill_save_last_only=policy == 'last-only', **store)
    try:
        ids, seqs = [], []
        for t, n in enumerate(lengths):
            ids = ids + random_prompt(n - len(ids), seed=500 + t)
            seqs.append(eng.generate(ids, GenerationConfig(max_new_tokens=out, ignore_eos=True)))
            ids = list(seqs[-1].token_ids)
        assert eng.store.flush(timeout=30)
        stats, K, K_win = eng.stats(), eng.cache_engine.kv_block_bytes, eng.cache_engine.window_block_bytes
    finally:
        eng.close()
    sizes = sizes_from_config(json.load(open(os.path.join(path, 'config.json'))), block_size=B)
    assert (sizes.state_bytes, sizes.kv_block_bytes, sizes.window_block_bytes, sizes.window_rows) == (0, K, K_win, W)
    want = simulate_policies(Scenario('chat', tuple(lengths), out), 0, K, policies=[policy], chunk_size=P,
                             block_size=B, alignment=64, **sizes.windows)[policy]
    if policy.endswith('turn-end'):
        assert [t.turn_end_point for t in want.turns] == ([160, 272, None] if out == 16 else [144, None, 400])
    assert stats['store_put_objects'] == {'state': want.num_saves, 'kv': sum(t.new_kv_blocks for t in want.turns),
                                          'window': sum(t.new_window_blocks for t in want.turns)}
    assert stats['store_put_bytes'] == {'state': 0, 'kv': sum(t.kv_bytes for t in want.turns),
                                        'window': sum(t.window_bytes for t in want.turns)}
    assert stats['store_put_failures'] == 0 and stats['store_put_bytes']['window'] > 0


def test_a_host_tier_keeps_the_window_pool_and_markers_of_demoted_prefixes(tiny):
    """Regression (it fell back to one shared table and built no host tier): with
    ``host_cache_bytes`` and two marker slots, prompts a, b, a (200 tokens, markers at 64, 128,
    192): b's markers demote a's to host memory (an empty state entry, the global rows of their
    blocks and the window rows of their windows only); the second a restores 192 tokens from the
    host tier, kept as a marker, and decodes what a cold engine decodes. Idle once both tiers
    are emptied."""
    from engine_utils import assert_idle, check_host_window_entries
    path, _ = tiny
    eng = make_engine(path, block_size=B, max_prefill_token_num=P, prefill_save_alignment=64,
                      enable_prefix_caching=True, host_cache_bytes=1 << 24, num_checkpoint_slots=2)
    host = eng.prefix_cache.host
    assert eng.window_pool is not None and host.window_rows == W and not host.has_state
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    a, b = random_prompt(200, seed=1), random_prompt(200, seed=2)
    first, other, again = (eng.generate(p, gen) for p in (a, b, a))
    assert again.num_cached_tokens == eng.stats()['host_hit_tokens'] == 192
    assert eng.stats()['checkpoints_saved_by_reason']['restored'] == 1
    cold = make_engine(path, block_size=B, max_prefill_token_num=P)
    assert first.output_ids == again.output_ids == cold.generate(a, gen).output_ids
    assert other.output_ids == cold.generate(b, gen).output_ids
    check_host_window_entries(host, eng.cache_engine, [a, b], B, W)
    eng.prefix_cache.evict(10**6)
    host.evict(10**12)
    assert_idle(eng)
    eng.close()
