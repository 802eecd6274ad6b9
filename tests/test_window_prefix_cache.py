"""The prefix cache of a model of global and sliding-window layers keeps window rows: the global
group's blocks stay in the trie (every block), while a trie node keeps the window group's block of
its tokens only while a published checkpoint's restore reads it (the blocks of that checkpoint's
window), so the window layers' memory stays bounded by the window with caching on.

- a six-turn conversation on the tiny ``lara_mini`` (W = 40, B = 16, A = 64) with caching on: after
  every forward the window pool holds exactly the trie's window rows plus the live window, the
  trie's window rows are exactly the windows of its checkpoints (at most
  ``ceil((W - 1) / B)`` each) while it keeps every global block; replies equal caching off and
  ``transformers``; every later turn restores locally; idle afterwards, every pool free once the
  cache is emptied;
- the scheduler and the local tier alone, random conversations, window rows dropped and
  checkpoints evicted at random, saves whose copy fails: a restore is offered only where every
  window block it reads is held, and each pool's reference counts are exactly the trie's and the
  tables' references; the same for a model without state, whose markers (zero-byte checkpoints)
  keep the window rows and whose restores fall on the deepest block boundary with its window held.
  (The tiny ``granitemoe_swa``'s markers: tests/test_granitemoe_swa.py and
  tests/test_window_block_tables.py.)
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import (assert_idle, check_host_window_entries, hf_greedy, make_engine, random_prompt,
                          tiny_checkpoint_and_reference)
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.cache_specs import SlidingWindowSpec, kv_bytes_per_block, window_first_block
from lmdeploy.pytorch.config import SchedulerConfig
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.sequence import FREED_BLOCK, Sequence
from lmdeploy.pytorch.prefix_cache.coordinator import PrefixCache
from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache

B = 16


def _blocks(n: int) -> int:
    return -(-n // B)


def _checkpoint_windows(local: LocalTier) -> set[int]:
    """Ids of the nodes the published checkpoints' restores read (the window-row rule)."""
    out = set()
    for node in local.cached_nodes():
        if node.checkpoint_slot is not None:
            out.update(id(n) for n in local._window_reads(node))
    return out


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    return tiny_checkpoint_and_reference(tmp_path_factory, 'lara_mini')


def test_mixed_model_keeps_window_rows_of_its_checkpoints_only(tiny):
    path, hf = tiny
    window, chunk, turns, new = 40, 32, 6, 4
    gen = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    fields = dict(block_size=B, max_prefill_token_num=chunk, prefill_save_alignment=64, max_batch_size=1,
                  num_checkpoint_slots=16)
    off, on = make_engine(path, **fields), make_engine(path, enable_prefix_caching=True, **fields)
    per_ckpt = -(-(window - 1) // B)
    keep = 16 * per_ckpt
    assert [(g.window, g.pool.num_blocks) for g in on.scheduler.groups] == [(None, 256), (window, 6 + keep)]
    local, wp = on.prefix_cache.local, on.window_pool
    seen = []
    computed = on.scheduler.computed

    def tracked(out):
        saves = computed(out)
        [c] = out.chunks
        seq = c.seq
        live = len(seq.window_block_ids) - seq.num_window_freed_blocks
        shared = sum(1 for b in seq.window_block_ids[seq.num_window_freed_blocks:] if wp.refcount[b] > 1)
        # the pool holds the trie's window rows and the sequence's window, shared ones once
        assert wp.num_blocks - wp.num_free == local.num_window_blocks + live - shared
        assert live == _blocks(c.end) - window_first_block(c.end, window, B)
        seen.append(local.num_window_blocks)
        return saves
    on.scheduler.computed = tracked
    ids, prev = [], 0
    for turn in range(turns):
        ids = ids + random_prompt(50, seed=70 + turn)
        got = {cache: eng.generate(ids, gen) for cache, eng in ((False, off), (True, on))}
        assert got[True].output_ids == got[False].output_ids
        # restored from the trie: the deepest checkpoint (a multiple of 64 below the last prompt)
        assert got[True].num_cached_tokens == ((prev - 1) // 64 * 64 if prev else 0)
        prev = len(ids)
        assert set(local.trie.window_nodes) == _checkpoint_windows(local)
        ckpts = sum(1 for n in local.cached_nodes() if n.checkpoint_slot is not None)
        # A = 64 > W - 1 + B: no two checkpoints read one window block
        assert ckpts == (len(ids) - 1) // 64 and local.num_window_blocks == ckpts * per_ckpt
        ids = ids + got[True].output_ids
        # the global group keeps every computed block
        assert on.ledger()['blocks_cached'] == (len(ids) - 1) // B
        assert_idle(off)
        assert on.is_idle()
    assert got[True].output_ids == hf_greedy(hf, ids[:-new], new)
    # 4 checkpoints (64 ... 256) of 3 window blocks each, against 20 global blocks
    assert local.num_window_blocks == 4 * per_ckpt == 12 < on.ledger()['blocks_cached'] == 20
    assert max(seen) == 12
    led, ce = on.ledger(), on.cache_engine
    assert led['window_blocks_free'] == wp.num_blocks - 12 and led['window_blocks_cached'] == 12
    # payload bytes held: 20 global blocks, 12 window blocks (the sliding layers' rows), 4 states
    window_row = kv_bytes_per_block([s for s in on.specs if isinstance(s, SlidingWindowSpec)], B)
    assert window_row > 0
    assert led['device_cache_bytes'] == 20 * ce.kv_block_bytes + 12 * window_row + 4 * ce.state_bytes
    on.prefix_cache.evict(10**6)
    assert_idle(on)


# ---------------------------------------------------------------- the scheduler alone, any geometry
def _check_pools(sched: Scheduler, local: LocalTier) -> None:
    """Each pool's reference counts are exactly the trie's and the running tables' references."""
    wp = sched.groups[1].pool
    refs = [0] * wp.num_blocks
    for node in local.trie.window_nodes.values():
        refs[node.window_block] += 1
    for seq in sched.running:
        for b in seq.window_block_ids[seq.num_window_freed_blocks:]:
            assert b >= 0
            refs[b] += 1
    assert refs == wp.refcount
    assert wp.num_free == sum(1 for r in refs if r == 0)
    assert all(n.window_block >= 0 for n in local.trie.window_nodes.values())


@pytest.mark.parametrize('kind', ['state', 'markers', 'markers_host'])
@settings(max_examples=30, deadline=None)
@given(window=st.integers(1, 60), chunk=st.sampled_from([16, 32, 48]), data=st.data())
def test_a_restore_never_reads_a_missing_window_block(kind, window, chunk, data):
    """Random conversations (each turn extends an earlier one), several at once, in pools that may
    be short, turn-end checkpoints or not, prefill policy default or last-only; window rows dropped,
    checkpoints and blocks evicted at random, some save copies failing: every local restore the
    tiers offer reads only window blocks the trie holds, the restored table attaches exactly them,
    and both pools' counts stay exact. ``kind`` markers: a model without state (no runtime slot),
    whose zero-byte checkpoints keep the window rows; its restores may fall on any block boundary
    whose window is held (checked against a brute-force walk of the matched path). ``markers_host``:
    with a host tier too (bookkeeping only), markers evicted are demoted and restored from it,
    each restore kept as a marker holding the window blocks its load filled."""
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    A = data.draw(st.sampled_from([16, 32, 64]))
    batch = data.draw(st.integers(1, 3))
    markers = kind != 'state'
    per_seq = -(-(window - 1 + chunk) // B) + 1
    bm = BlockManager(data.draw(st.integers(60, 120)))
    wp = BlockManager(batch * per_seq + data.draw(st.integers(0, 12)))
    sc = StateCache(0 if markers else batch, 6)
    local = LocalTier(bm, B, sc, window_pool=wp, window=window, markers=markers)
    host = None
    if kind == 'markers_host':
        from lmdeploy.pytorch.prefix_cache.host_tier import HostTier
        host = HostTier(None, 1 << 20, B, 0, 1, window_block_bytes=1, window_rows=window, has_state=False)
    cache = PrefixCache(local, block_size=B, alignment=A, decode_save_last=data.draw(st.booleans()), host=host)
    cfg = SchedulerConfig.from_engine_config(PytorchEngineConfig(block_size=B, max_prefill_token_num=chunk,
                                                                 max_batch_size=batch, prefill_save_alignment=A,
                                                                 enable_prefix_caching=True,
                                                                 prefill_save_last_only=data.draw(st.booleans())))
    sched = Scheduler(cfg, bm, None if markers else sc, cache, window_pool=wp, pool_window=window)
    offered, host_restores = [], []
    match = local.match

    def ready(node) -> bool:
        return all(n.window_block >= 0 for n in local._window_reads(node))

    def checked_match(seq, hashes, rules):
        m = match(seq, hashes, rules)
        if m.cached_tokens:
            assert m.source == 'local' and (m.checkpoint_slot is None) == markers
            node = m.nodes[m.num_shared_blocks - 1]
            reads = local._window_reads(node)
            assert all(n.window_block >= 0 for n in reads)
            assert len(reads) == node.depth - window_first_block(node.depth * B, window, B)
            offered.append(m.cached_tokens)
        if markers:     # the deepest block boundary whose window is held, leaving a token to compute
            limit = min(len(m.nodes), (seq.num_tokens - 1) // B)
            want = max([d for d in range(1, limit + 1) if ready(m.nodes[d - 1])], default=0)
            assert m.cached_tokens == want * B
            assert local.depth(hashes, rules) == want * B
        return m
    local.match = checked_match
    convs = [random_prompt(rng.randint(20, 120), seed=rng.randint(0, 999)) for _ in range(2)]
    todo = data.draw(st.integers(6, 16))
    for _ in range(5000):
        while todo and len(sched.waiting) < 2:
            base = rng.choice(convs)
            prompt = base + random_prompt(rng.randint(1, 60), seed=rng.randint(0, 999))
            convs.append(prompt)
            sched.add(Sequence(prompt, GenerationConfig(max_new_tokens=rng.randint(1, 6))))
            todo -= 1
        if not sched.has_work:
            break
        out = sched.schedule()
        assert out.chunks, 'no progress'
        for c in out.chunks:
            seq = c.seq
            if c.start and seq.plan is not None and c.start == seq.plan.cached_tokens:     # admitted: a restore
                first = window_first_block(c.start, window, B)
                assert seq.num_window_freed_blocks == first
                assert all(b >= 0 for b in seq.window_block_ids[first:c.start // B])
        cache.loads_done(out.loads, True)
        for load in out.loads.host_loads:       # (the engine's _execute_loads, host part)
            ok = host.load(load)
            assert cache.host_loaded(load, ok) is None      # a marker: published at once, nothing to copy
            if not ok:
                sched.rollback(load.seq, out)
            else:
                node = local.trie.match(load.seq.token_ids, cache.hashes(load.seq))[load.boundary // B - 1]
                assert node.checkpoint_slot is not None and ready(node)
                host_restores.append(load.boundary)
        cache.saves_done(sched.computed(out), rng.random() > 0.1)
        for c in out.chunks:
            seq = c.seq
            if c.sample:
                seq.token_ids.append(rng.randint(0, 50))
                if seq.num_generated >= seq.gen_config.max_new_tokens:
                    cache.saves_done(sched.finish(seq, 'length'), True)
        r = rng.random()
        if r < 0.15 and local.trie.window_nodes:
            local.trie.drop_window(rng.choice(list(local.trie.window_nodes.values())))   # a lost window row
        elif r < 0.25:
            cache.evict(rng.randint(1, 8))
        elif r < 0.3:
            cache.evict_window(rng.randint(1, 4))
        _check_pools(sched, local)
    assert not sched.has_work and not todo
    assert sc.num_pinned == 0 and local.pins.num_held == 0 and local.pins.num_reclaimed == 0
    if markers:     # every window row the trie holds is one a marker's restore reads (rows dropped above: not all)
        assert set(local.trie.window_nodes) <= _checkpoint_windows(local)
    cache.evict(10**6)
    assert wp.num_free == wp.num_blocks and bm.num_free == bm.num_blocks and not local.trie.window_nodes


def test_window_rows_need_state_and_a_window():
    with pytest.raises(ValueError, match='window_pool needs a window'):
        LocalTier(BlockManager(8), B, None, window_pool=BlockManager(4), window=24)
    with pytest.raises(ValueError, match='window_pool needs a window'):
        LocalTier(BlockManager(8), B, StateCache(1, 2), window_pool=BlockManager(4))
    with pytest.raises(ValueError, match='markers need a window_pool'):
        LocalTier(BlockManager(8), B, StateCache(0, 2), markers=True)
    with pytest.raises(RuntimeError, match='keeps no markers'):
        LocalTier(BlockManager(8), B, StateCache(1, 2), window_pool=BlockManager(4), window=24).save_marker(
            None, None, 16)


def test_a_restore_is_kept_as_what_the_tier_keeps_and_a_host_tier_without_state_holds_none():
    """A marker tier keeps a host or Store restore with ``restored_marker`` (``cache_restored``
    copies a state it has not), a checkpoint tier the reverse; a host tier for a model without
    state refuses a state size, naming it."""
    from lmdeploy.pytorch.prefix_cache.host_tier import HostTier
    markers = LocalTier(BlockManager(8), B, StateCache(0, 2), window_pool=BlockManager(4), window=24, markers=True)
    with pytest.raises(RuntimeError, match='keeps a restore as a marker'):
        markers.cache_restored(None, [], 16)
    state = LocalTier(BlockManager(8), B, StateCache(1, 2), window_pool=BlockManager(4), window=24)
    with pytest.raises(RuntimeError, match='keeps no markers'):
        state.restored_marker(None, [], 16)
    with pytest.raises(ValueError, match='state_bytes must be 0'):
        HostTier(None, 1 << 20, B, 10, 1, has_state=False)


def test_a_host_tier_keeps_the_window_pool_and_window_rows_of_demoted_checkpoints(tiny):
    """With a host tier a mixed model keeps its window pool (regression: it fell back to one shared
    table): two checkpoint slots, prompts a, b, a (200 tokens, save points 64, 128, 192): b's saves
    demote a's checkpoints to host memory, holding the global rows of their blocks and the window
    rows of only their windows' blocks; the second a restores 192 tokens from the host tier and
    decodes what a cold engine decodes. Idle once both tiers are emptied."""
    path, _ = tiny
    window = 40
    eng = make_engine(path, block_size=B, max_prefill_token_num=32, prefill_save_alignment=64,
                      enable_prefix_caching=True, host_cache_bytes=1 << 24, num_checkpoint_slots=2)
    host = eng.prefix_cache.host
    assert eng.window_pool is not None and host.window_rows == window and len(eng.scheduler.groups) == 2
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    a, b = random_prompt(200, seed=1), random_prompt(200, seed=2)
    cold = make_engine(path, max_prefill_token_num=32)
    first, other, again = (eng.generate(p, gen) for p in (a, b, a))
    assert again.num_cached_tokens == eng.stats()['host_hit_tokens'] == 192
    assert first.output_ids == again.output_ids == cold.generate(a, gen).output_ids
    assert other.output_ids == cold.generate(b, gen).output_ids
    check_host_window_entries(host, eng.cache_engine, [a, b], B, window)
    eng.prefix_cache.evict(10**6)
    host.evict(10**12)
    assert_idle(eng)
    eng.close()


def _window_object(store_dir, ids, block: int):
    """The file of the window object of block ``block`` of prompt ``ids`` in a ``file:`` Store."""
    from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
    h = chain_block_hashes(ids, B, block + 1)[block].hex()
    [path] = list(store_dir.glob(f'objects/*/window/*/{h}'))
    return path


def test_a_store_keeps_the_window_pool_and_restores_from_window_objects(tmp_path, tiny):
    """With a ``file:`` Store a mixed model keeps its window pool (regression: it fell back to one
    shared table): the pool holds the trie's window rows plus the live window while a 100-token
    prompt decodes 120 tokens; the Store holds the global rows of every block below each save
    point and window objects of each save point's window only. A new engine restores 192 tokens
    (save points 64 ... 192 of a 200-token prompt) and decodes what a cold engine decodes; with the
    window object of block 11 (read only by 192's window [9, 12)) deleted, 192 is never offered (no
    failed load) and 128 is restored instead, same tokens. Every engine is idle afterwards."""
    path, _ = tiny
    window = 40
    store = tmp_path / 'store'
    fields = dict(block_size=B, max_prefill_token_num=32, prefill_save_alignment=64, enable_prefix_caching=True,
                  store_backend=f'file:{store}')
    eng = make_engine(path, **fields)
    wp, local = eng.window_pool, eng.prefix_cache.local
    assert wp is not None and eng.store.window_rows == window and len(eng.scheduler.groups) == 2
    computed, lives = eng.scheduler.computed, []

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
    gen = GenerationConfig(max_new_tokens=120, ignore_eos=True)
    eng.generate(random_prompt(100, seed=90), gen)
    # the live window never exceeds ceil((W - 1 + chunk) / B) + 1 blocks, the trie's rows one checkpoint's
    assert max(lives) <= _blocks(window - 1 + 32) + 1 and local.num_window_blocks == _blocks(window - 1)
    eng.scheduler.computed = computed
    ids = random_prompt(200, seed=91)
    short = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    first = eng.generate(ids, short)
    assert eng.store.flush(timeout=30)
    assert first.stats.save_points == [64, 128, 192]
    windows = {k for b in (64, 128, 192) for k in range(window_first_block(b, window, B), b // B)}
    stats = eng.stats()
    # the first prompt's one save point (64: blocks 0-3, window blocks 1-3), then this one's
    assert stats['store_put_objects'] == {'state': 4, 'kv': 4 + 12, 'window': 3 + len(windows)}
    eng.prefix_cache.evict(10**6)
    assert_idle(eng)
    eng.close()
    cold = make_engine(path, max_prefill_token_num=32).generate(ids, short).output_ids
    assert first.output_ids == cold
    for deleted, restored in ((None, 192), (11, 128)):
        if deleted is not None:
            _window_object(store, ids, deleted).unlink()
        reader = make_engine(path, **fields)
        try:
            again = reader.generate(ids, short)
            assert again.num_cached_tokens == again.stats.store_hit_tokens == restored
            assert again.output_ids == cold
            assert reader.stats()['store_get_failures'] == 0 and reader.stats()['store_rejected_objects'] == 0
            # the restored checkpoint keeps the window rows the load wrote (its window's blocks), as
            # does the one saved after it (192, when 128 was restored)
            kept = {k for b in [restored] + again.stats.save_points for k in range(window_first_block(b, window, B),
                                                                                 b // B)}
            assert again.stats.save_points == ([] if restored == 192 else [192])
            assert reader.ledger()['window_blocks_cached'] == len(kept)
            reader.prefix_cache.evict(10**6)
            assert_idle(reader)
        finally:
            reader.close()


def test_tp2_keeps_window_rows_and_replies_as_tp1(tiny):
    """Under tensor parallelism the window rows are block ids (every rank's slices of the same
    rows): a TP2 engine with caching on replies to staggered prompts sharing a 70-token head as a
    TP1 engine with caching off, twice, the second time restoring from its window rows."""
    from tp_utils import PROMPTS, engine
    from engine_utils import run_staggered
    path, _ = tiny
    gen = GenerationConfig(max_new_tokens=5, ignore_eos=True)
    ref = [s.output_ids for s in run_staggered(engine(path), PROMPTS, gen, every=2)]
    eng = engine(path, tp=2, enable_prefix_caching=True)
    try:
        assert eng.window_pool is not None
        for _ in range(2):
            assert [s.output_ids for s in run_staggered(eng, PROMPTS, gen, every=2)] == ref
        assert eng.stats()['prefix_cache_hit_tokens'] > 0 and eng.ledger()['window_blocks_cached'] > 0
        assert eng.is_idle()
    finally:
        eng.close()
