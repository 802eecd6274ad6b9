"""Block tables per paged group: a model of global and sliding-window layers keeps its window
layers' K/V in a pool of their own, one table per sequence that gives back the blocks out of the
window, so their memory is bounded by the window while the global group keeps every block.

- the grouping rule (``paged_groups``) and the pool sizing rule, exact values;
- a 2,100-token prompt in 64-token chunks then 30 decode steps on the tiny mixed
  ``granitemoe_swa`` (W = 24, B = 16): after every forward the window pool holds exactly
  ``ceil(c / B) - window_first_block(c)`` blocks (``ceil(W / B) + 1`` = 3 at most while decoding), the
  global pool ``ceil(c / B)``; tokens equal ``transformers``; every pool is free again afterwards;
- the same with the prefix cache on: the model has no state, so markers (zero-byte checkpoints)
  keep the window rows their restores read, ``ceil((W - 1) / B)`` each, and the window pool holds
  exactly those plus the live window while the global group keeps every block; tokens equal
  caching off, a rerun restores at the prompt's last marker;
- the same on the tiny ``lfm3``, ``lara_mini`` and ``inkling_text`` (recurrent or conv state besides global and
  40-token sliding layers; Inkling's own attention path must read the sliding layers' tables);
- the scheduler alone, random prompts, chunk sizes and pool sizes, several sequences at once
  (preemption included): each window table's leading ``FREED_BLOCK`` entries are exactly the
  blocks out of the window, no pool ever holds a block nobody references, and both pools end free.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import assert_idle, hf_greedy, make_engine, random_prompt, tiny_checkpoint_and_reference
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_engine import CacheEngine
from lmdeploy.pytorch.cache_specs import (FullAttentionSpec, LinearAttentionSpec, PagedGroup, SlidingWindowSpec,
                                          paged_groups, window_first_block)
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.engine.cache_sizing import size_caches
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.sequence import FREED_BLOCK, Sequence
from lmdeploy.pytorch.prefix_cache.null_cache import NullPrefixCache

W, B, P = 24, 16, 64        # the tiny granitemoe_swa window, the block size, the prefill chunk
GLOBAL, SLIDE = FullAttentionSpec(2, 8, torch.float32), SlidingWindowSpec(2, 8, torch.float32, 24)
STATE = LinearAttentionSpec((8, 3), torch.float32, (2, 4, 4))


def _blocks(n: int) -> int:
    return -(-n // B)


# ---------------------------------------------------------------- the rules, exact values
def test_paged_groups_split_global_and_window_layers():
    wide = SlidingWindowSpec(2, 8, torch.float32, 40)
    specs = [GLOBAL, SLIDE, STATE, wide, GLOBAL]
    assert paged_groups(specs) == [PagedGroup((0, 4), None), PagedGroup((1, 3), 40)]
    assert paged_groups(specs, split=False) == [PagedGroup((0, 1, 3, 4), None)]
    assert paged_groups([SLIDE, STATE, wide]) == [PagedGroup((0, 2), 40)]       # all slide: one window group
    assert paged_groups([GLOBAL, STATE]) == [PagedGroup((0,), None)]
    assert paged_groups([STATE]) == []


def test_window_pool_sizing_rule():
    """With ``num_gpu_blocks`` the global pool has that many blocks and the window pool
    ``min(max_batch_size x (ceil((W - 1 + P) / B) + 1), num_gpu_blocks)``; from a byte budget the
    window pool's bytes are taken first and the global pool gets the rest, never fewer blocks
    than one pool of both rows."""
    specs = [GLOBAL, SLIDE, SLIDE, GLOBAL]
    groups = paged_groups(specs)
    row_g = CacheEngine.group_bytes_per_block(specs, B, groups[0].entries)
    row_w = CacheEngine.group_bytes_per_block(specs, B, groups[1].entries)
    assert row_g == row_w == 2 * B * 2 * 2 * 8 * 4 and CacheEngine.bytes_per_block(specs, B) == 2 * row_g
    per_seq = -(-(W - 1 + P) // B) + 1
    assert per_seq == 7

    def sizes(**fields):
        cc = CacheConfig.from_engine_config(PytorchEngineConfig(block_size=B, **fields))
        return size_caches(specs, False, cc, torch.device('cpu'), 4, 4096, False, groups, P)

    fixed = sizes(num_gpu_blocks=256)
    assert (fixed.num_blocks, fixed.num_window_blocks) == (256, 4 * per_seq)
    assert sizes(num_gpu_blocks=10).num_window_blocks == 10
    budget = 100 * 2 * row_g            # 100 blocks of both rows
    derived = sizes(cache_bytes=budget)
    assert derived.num_window_blocks == 4 * per_seq
    assert derived.num_blocks == (budget - 4 * per_seq * row_w) // row_g == 172
    small = sizes(cache_bytes=20 * 2 * row_g)       # 20 shared blocks: the window pool never exceeds them
    assert (small.num_window_blocks, small.num_blocks) == (20, 20)


# ---------------------------------------------------------------- a long sequence, the real model
@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint, transformers reference) of the tiny granitemoe_swa: global and 24-token
    sliding layers."""
    return tiny_checkpoint_and_reference(tmp_path_factory, 'granitemoe_swa')


def _track_pools(eng) -> tuple[list, list]:
    """Per step of one sequence: ``(chunk start, chunk end, window blocks in use)`` once the
    step is scheduled (its blocks reserved), and ``(computed tokens, global blocks in use, window
    blocks in use)`` after its forward (out-of-window blocks given back)."""
    bm, wp = eng.block_manager, eng.window_pool
    scheduled, seen = [], []
    schedule, computed = eng.scheduler.schedule, eng.scheduler.computed

    def wrapped_schedule():
        out = schedule()
        [chunk] = out.chunks
        scheduled.append((chunk.start, chunk.end, wp.num_blocks - wp.num_free))
        return out

    def wrapped_computed(out):
        saves = computed(out)
        seen.append((out.chunks[0].seq.num_computed_tokens, bm.num_blocks - bm.num_free, wp.num_blocks - wp.num_free))
        return saves
    eng.scheduler.schedule, eng.scheduler.computed = wrapped_schedule, wrapped_computed
    return scheduled, seen


@pytest.fixture(scope='module')
def long_off(tiny):
    """A 2,100-token prompt and 30 greedy tokens on the tiny granitemoe_swa, prefix cache off, in
    64-token chunks: ``(engine, sequence, scheduled, seen)`` (:func:`_track_pools`)."""
    eng = make_engine(tiny[0], block_size=B, max_prefill_token_num=P, max_batch_size=2, num_gpu_blocks=160)
    scheduled, seen = _track_pools(eng)
    seq = eng.generate(random_prompt(2100, seed=21), GenerationConfig(max_new_tokens=30, ignore_eos=True))
    return eng, seq, scheduled, seen


def test_long_sequence_holds_window_bounded_memory_for_its_window_layers(tiny, long_off):
    _, hf = tiny
    n, new = 2100, 30
    ids = random_prompt(n, seed=21)
    eng, seq, scheduled, seen = long_off
    assert [(g.window, g.pool.num_blocks) for g in eng.scheduler.groups] == [(None, 160), (W, 2 * 7)]
    assert len(seen) == len(scheduled) == -(-n // P) + new - 1 == 33 + 29     # 33 prefill chunks, 29 decode steps
    for (start, end, reserved), (c, used_global, used_window) in zip(scheduled, seen):
        assert reserved == _blocks(end) - window_first_block(start, W, B)
        assert c == end and used_global == _blocks(c) and used_window == _blocks(c) - window_first_block(c, W, B)
    # while a forward runs: the window and one chunk (prefill), the window and one token (decode)
    # (chunks start on block ends here: 6, one below the bound ceil((W - 1 + P) / B) + 1 = 7 of any start)
    assert max(r for s, e, r in scheduled if e <= n) == _blocks(W - 1 + P) == 6
    assert max(r for s, e, r in scheduled if s >= n) == _blocks(W) + 1 == 3      # within ceil(W / B) + 2
    assert max(w for c, _, w in seen if c > n) == _blocks(W) + 1 == 3     # between decode steps
    assert seen[-1][1] == _blocks(n + new - 1) == 134
    assert seq.output_ids == hf_greedy(hf, ids, new)
    assert_idle(eng)


def _marker_windows(local) -> set[int]:
    """Ids of the nodes the published markers' restores read (the window-row rule)."""
    return {id(n) for node in local.cached_nodes() if node.checkpoint_slot is not None
            for n in local._window_reads(node)}


def test_long_sequence_with_prefix_caching_keeps_only_its_markers_window_rows(tiny, long_off):
    """The same 2,100-token prompt and 30 decode steps with the prefix cache on: the model has no
    state, so markers (zero-byte checkpoints) at its save points, 1024 and 2048 (A = 1024), and
    at the prompt's last full block boundary, 2096, keep the window rows their restores read,
    ceil((W - 1) / B) = 2 each. After every forward the window pool holds exactly the trie's
    window rows plus the live window (at most 3 markers x 2 + 3 blocks while decoding, against
    134 global blocks), the trie's window rows are exactly the markers' windows; the tokens equal
    caching off; the same prompt again restores 2096 tokens, attaching its 2 window blocks, and
    replies the same; the ledger is idle, every pool free once the cache is emptied."""
    path, _ = tiny
    n, new, per_marker = 2100, 30, -(-(W - 1) // B)
    ids = random_prompt(n, seed=21)
    gen = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    eng = make_engine(path, block_size=B, max_prefill_token_num=P, max_batch_size=2, num_gpu_blocks=160,
                      enable_prefix_caching=True, num_checkpoint_slots=8)
    # the window pool: 2 sequences' windows and chunks, and the window rows of 8 markers
    assert [(g.window, g.pool.num_blocks) for g in eng.scheduler.groups] == [(None, 160), (W, 2 * 7 + 8 * per_marker)]
    local, wp, bm = eng.prefix_cache.local, eng.window_pool, eng.block_manager
    seen, computed = [], eng.scheduler.computed

    def tracked(out):
        saves = computed(out)
        [c] = out.chunks
        seq = c.seq
        live = seq.window_block_ids[seq.num_window_freed_blocks:]
        shared = sum(1 for b in live if wp.refcount[b] > 1)
        assert len(live) == _blocks(c.end) - window_first_block(c.end, W, B)
        assert wp.num_blocks - wp.num_free == local.num_window_blocks + len(live) - shared
        assert set(local.trie.window_nodes) == _marker_windows(local)
        assert local.num_window_blocks <= eng.ledger()['checkpoints_published'] * per_marker
        seen.append((c.end, wp.num_blocks - wp.num_free, bm.num_blocks - bm.num_free))
        return saves
    eng.scheduler.computed = tracked
    seq = eng.generate(ids, gen)
    assert seq.stats.save_points == [1024, 2048, 2096]
    assert seq.output_ids == long_off[1].output_ids
    # while decoding: 3 markers' rows and the live window, never the sequence's 134 blocks
    assert max(w for c, w, _ in seen if c > n) <= 3 * per_marker + _blocks(W) + 1 == 9
    assert seen[-1][2] == _blocks(n + new - 1) == 134
    led = eng.ledger()
    assert (led['window_blocks_cached'], led['checkpoints_published'], led['blocks_cached']) == (6, 3, 133)
    again = eng.generate(ids, gen)
    assert again.num_cached_tokens == 2096 and again.output_ids == seq.output_ids
    # its first forward, [2096, 2100): the 6 cached rows and its window, blocks 129-131, of
    # which the 2 restored ones are 2096's cached rows
    assert seen[len(seen) - new] == (2100, 6 + 3 - 2, 133 + 1)
    assert eng.is_idle() and eng.stats()['prefix_cache_hit_tokens'] == 2096
    eng.prefix_cache.evict(10**6)
    assert_idle(eng)


@pytest.mark.parametrize('arch', ['lfm3', 'lara_mini', 'inkling_text'])
def test_hybrid_model_with_state_bounds_its_window_layers_too(tmp_path_factory, arch):
    """LFM3 (short conv state), Lara-4-Mini (Gated DeltaNet state) and Inkling (its own
    relative-bias attention path, which must read the sliding layers' tables), each with 40-token
    sliding and global layers: a 200-token prompt
    in 32-token chunks and 6 decode steps hold the exact window blocks after every forward, decode
    what ``transformers`` and the engine with the prefix cache on decode, and leave every pool free."""
    path, hf = tiny_checkpoint_and_reference(tmp_path_factory, arch)
    window, n, new = 40, 200, 6
    ids = random_prompt(n, seed=30)
    gen = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    eng = make_engine(path, block_size=B, max_prefill_token_num=32, max_batch_size=1)
    assert [(g.window, g.pool.num_blocks) for g in eng.scheduler.groups] == [(None, 256), (window, 6)]
    scheduled, seen = _track_pools(eng)
    seq = eng.generate(ids, gen)
    for (start, end, reserved), (c, used_global, used_window) in zip(scheduled, seen):
        assert reserved == _blocks(end) - window_first_block(start, window, B) <= 6
        assert used_global == _blocks(c) and used_window == _blocks(c) - window_first_block(c, window, B)
    assert seq.output_ids == hf_greedy(hf, ids, new)
    assert_idle(eng)
    cached = make_engine(path, block_size=B, max_prefill_token_num=32, enable_prefix_caching=True)
    assert cached.generate(ids, gen).output_ids == seq.output_ids


# ---------------------------------------------------------------- the scheduler alone, any geometry
def _scheduler(num_blocks: int, num_window: int, chunk: int, window: int, batch: int) -> Scheduler:
    cfg = SchedulerConfig.from_engine_config(PytorchEngineConfig(block_size=B, max_prefill_token_num=chunk,
                                                                 max_batch_size=batch))
    return Scheduler(cfg, BlockManager(num_blocks), None, NullPrefixCache(), window_pool=BlockManager(num_window),
                     pool_window=window)


def _check_tables(sched: Scheduler) -> None:
    """Each running sequence's window table: one entry per block of its global table, the
    leading ``FREED_BLOCK`` ones exactly those out of the window; every held block referenced
    exactly once (no prefix cache) and every pool's count balanced."""
    wp = sched.groups[1].pool
    held_g, held_w = [], []
    for seq in sched.running:
        assert len(seq.window_block_ids) == len(seq.block_ids)
        lead = window_first_block(seq.num_computed_tokens, sched.groups[1].window, B)
        assert seq.num_window_freed_blocks == min(lead, len(seq.block_ids)) and seq.num_freed_blocks == 0
        assert seq.window_block_ids[:seq.num_window_freed_blocks] == [FREED_BLOCK] * seq.num_window_freed_blocks
        held_w += seq.window_block_ids[seq.num_window_freed_blocks:]
        held_g += seq.block_ids
    assert len(set(held_g)) == len(held_g) and len(set(held_w)) == len(held_w) and min(held_w + [0]) >= 0
    assert all(sched.block_manager.refcount[b] == 1 for b in held_g) and all(wp.refcount[b] == 1 for b in held_w)
    assert sched.block_manager.num_free == sched.block_manager.num_blocks - len(held_g)
    assert wp.num_free == wp.num_blocks - len(held_w)


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 70), chunk=st.sampled_from([1, 7, 16, 40, 64]), data=st.data())
def test_window_tables_free_exactly_the_out_of_window_blocks(window, chunk, data):
    """Several sequences (random prompts, 1-20 generated tokens) in pools that may be short, so
    admissions wait and running sequences are preempted: a scheduled chunk's window table holds
    exactly the blocks from its start's window to its end (at most ``ceil((W - 1 + chunk) / B) + 1``),
    the tables stay exact after every forward, and both pools end free."""
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    per_seq = -(-(window - 1 + chunk) // B) + 1
    longest = _blocks(max(lengths) + 20)
    sched = _scheduler(data.draw(st.integers(longest, longest + 40)), data.draw(st.integers(per_seq, 3 * per_seq)),
                       chunk, window, batch=data.draw(st.integers(1, 4)))
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(random_prompt(n, seed=i), GenerationConfig(max_new_tokens=data.draw(st.integers(1, 20))))
        seqs.append(seq)
        sched.add(seq)
    for _ in range(10_000):
        if not sched.has_work:
            break
        out = sched.schedule()
        assert out.chunks, 'no progress'
        for chunk_ in out.chunks:        # reserved for the forward: the window and the chunk at most
            held = len(chunk_.seq.window_block_ids) - chunk_.seq.num_window_freed_blocks
            assert held == _blocks(chunk_.end) - min(window_first_block(chunk_.start, window, B), _blocks(chunk_.end))
            assert held <= per_seq
        sched.computed(out)
        _check_tables(sched)
        for chunk_ in out.chunks:
            seq = chunk_.seq
            if chunk_.sample:
                seq.token_ids.append(7)
                if seq.num_generated >= seq.gen_config.max_new_tokens:
                    sched.finish(seq, 'length')
    assert not sched.has_work and all(s.num_generated == s.gen_config.max_new_tokens for s in seqs)
    for group in sched.groups:
        assert group.pool.num_free == group.pool.num_blocks


def test_a_window_pool_needs_prefix_caching_off():
    """The prefix tiers index one table: a window pool of its own with a caching tier is refused."""
    class Caching(NullPrefixCache):
        caches_prefixes = True
    cfg = SchedulerConfig.from_engine_config(PytorchEngineConfig(block_size=B))
    with pytest.raises(ValueError, match='prefix caching off'):
        Scheduler(cfg, BlockManager(8), None, Caching(), window_pool=BlockManager(4), pool_window=W)
