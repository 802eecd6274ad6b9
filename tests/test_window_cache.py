"""Sliding-window attention as a cache kind, without a model: the window rule
(``window_first_block``: the first block a sequence resumed after b tokens reads), the Store tier
that puts and probes only a boundary's window blocks (a boundary whose window reaches a block
the Store lost is never offered, one whose older blocks are gone still is), the scheduler's
admission of a window restore (leading blocks neither attached nor allocated), and the
simulator's byte formula extended to windows.

Geometry: B = 16 tokens per block, A = 32 (many boundaries in short prompts).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_specs import (FullAttentionSpec, LinearAttentionSpec, SlidingWindowSpec, uses_store,
                                          window_first_block)
from lmdeploy.pytorch.kernels.window_attention import window_key_range
from lmdeploy.pytorch.paging.prefill_plan import ReuseRules, plan_prefill
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
from lmdeploy.pytorch.prefix_cache.plans import StoreLoad, StorePut
from lmdeploy.pytorch.prefix_cache.store_tier import StoreTier
from lmdeploy.pytorch.store.mooncake_client import FakeStoreClient
from lmdeploy.pytorch.store.object_format import object_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'benchmark'))
from store_sim import simulate  # noqa: E402

B, A = 16, 32
NS = b'\x02' * 16


# ---------------------------------------------------------------- the window rule
@pytest.mark.parametrize('b, window, first', [
    (80, 24, 3), (0, 24, 0), (23, 24, 0), (40, 24, 1), (48, 1, 3), (47, 1, 2), (64, 16, 3), (64, None, 0),
    (64, 0, 0), (1000, 4096, 0)])
def test_window_first_block_exact_values(b, window, first):
    assert window_first_block(b, window, B) == first


@settings(max_examples=200, deadline=None)
@given(b=st.integers(0, 2000), window=st.integers(1, 600), block=st.sampled_from([1, 4, 16, 64]),
       later=st.integers(0, 500))
def test_window_first_block_is_the_first_block_any_later_query_reads(b, window, block, later):
    """Queries at ``b`` and after read key positions from ``window_key_range(b, ...)`` on, whose
    block is the first one needed; every block before it is read by no query at or after ``b``."""
    first = window_first_block(b, window, block)
    lo, _ = window_key_range(b, b + 1, window)
    assert first == lo // block
    assert window_key_range(b + later, b + later + 1, window)[0] >= first * block


def test_only_state_or_a_sliding_layer_uses_the_store():
    full, slide = FullAttentionSpec(2, 8, torch.float32), SlidingWindowSpec(2, 8, torch.float32, 24)
    state = LinearAttentionSpec((8, 3), torch.float32, (2, 4, 4))
    assert not uses_store([full, full]) and uses_store([full, slide]) and uses_store([slide])
    assert uses_store([full, state]) and not uses_store([])


# ---------------------------------------------------------------- the Store tier with a window
class _Blocks:
    """A cache engine of a model without state: block ``i`` holds bytes ``[i] * 4``."""
    state_bytes, kv_block_bytes = 0, 4

    def __init__(self):
        self.kv, self.state_writes = {}, 0

    def read_kv_blocks(self, ids):
        return torch.stack([torch.full((4,), b, dtype=torch.uint8) for b in ids])

    def read_state(self, slot):
        raise AssertionError('a model without state has no slot to read')

    def write_kv_block(self, block, payload):
        self.kv[block] = bytes(payload.numpy())

    def write_state(self, slot, payload):
        self.state_writes += 1


def _kv_key(h: bytes) -> str:
    return object_key(NS.hex(), 'kv', h.hex())


def _state_key(h: bytes) -> str:
    return object_key(NS.hex(), 'state', h.hex())


def _save_every_boundary(window, n, client):
    """A tier with ``window`` puts every reusable boundary of an ``n``-token prompt (block i
    in block row i), then closes (and with it ``client``); returns (hashes, boundaries, rules,
    stats)."""
    ids = prompt(n, n)
    hashes = chain_block_hashes(ids, B)
    rules = ReuseRules(n, B, A)
    boundaries = sorted(rules.restore_candidates(0, len(hashes)))
    tier = StoreTier(client, _Blocks(), NS, B, window=window)
    for b in boundaries:
        tier.submit(StorePut(hashes[:b // B], list(range(b // B)), b, None))
    assert tier.flush(timeout=10)
    stats = tier.stats()
    tier.close()
    return hashes, boundaries, rules, stats


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 90), n=st.integers(40, 260), data=st.data())
def test_store_probe_never_offers_a_boundary_whose_window_reaches_a_lost_block(window, n, data):
    """Every reusable boundary is put with its window's blocks only (objects and bytes: the union
    of the windows; the state objects empty); then the Store loses a random subset of objects. A
    fresh tier (no beliefs) offers exactly the boundaries whose state object and window blocks
    all remain, deepest first; loading the deepest reads and writes only its window's blocks
    and no state."""
    client = FakeStoreClient()
    hashes, boundaries, rules, stats = _save_every_boundary(window, n, client)
    needed = {b: range(window_first_block(b, window, B), b // B) for b in boundaries}
    union = set().union(*needed.values())
    assert stats['store_put_objects'] == {'state': len(boundaries), 'kv': len(union)}
    assert stats['store_put_bytes'] == {'state': 0, 'kv': 4 * len(union)}
    assert set(client.objects) == {_kv_key(hashes[k]) for k in union} | {_state_key(hashes[b // B - 1])
                                                                           for b in boundaries}
    lost = data.draw(st.sets(st.sampled_from(sorted(client.objects)), max_size=4) if client.objects else st.just(set()))
    for key in lost:
        del client.objects[key]
    tier = StoreTier(FakeStoreClient(objects=client.objects), _Blocks(), NS, B, window=window)   # a fresh engine
    try:
        expected = [b for b in sorted(boundaries, reverse=True)
                    if _state_key(hashes[b // B - 1]) not in lost and not any(_kv_key(hashes[k]) in lost
                                                                             for k in needed[b])]
        assert tier.probe(hashes, rules) == expected
        if expected:
            b = expected[0]
            load = StoreLoad(None, b, hashes[:b // B], list(range(100, 100 + b // B)),
                             window_first_block(b, window, B), None)
            assert tier.load(load)
            assert tier.cache_engine.kv == {100 + k: bytes([k] * 4) for k in needed[b]}
            assert tier.cache_engine.state_writes == 0
    finally:
        tier.close()


def test_an_old_block_the_store_lost_does_not_hide_a_deeper_window():
    """Regression: without the window rule a prefix needed every block below it, so losing
    block 0 hid every boundary; with W = 24 only the blocks of each boundary's window count."""
    client = FakeStoreClient()
    hashes, boundaries, rules, _ = _save_every_boundary(24, 200, client)
    assert boundaries == [32, 64, 96, 128, 160, 192]
    del client.objects[_kv_key(hashes[0])]          # read only by the window of b = 32
    del client.objects[_kv_key(hashes[11])]         # block [176, 192): in the window of b = 192
    tier = StoreTier(FakeStoreClient(objects=client.objects), _Blocks(), NS, B, window=24)
    try:
        assert tier.probe(hashes, rules) == [160, 128, 96, 64]
    finally:
        tier.close()


# ---------------------------------------------------------------- window objects (a window group of its own)
class _Rows(_Blocks):
    """A mixed model's cache engine without state: global block ``i`` holds ``[i] * 4``, window-pool
    block ``j`` holds ``[j % 256] * 3``."""
    window_block_bytes = 3

    def __init__(self):
        super().__init__()
        self.win = {}

    def read_window_blocks(self, ids):
        return torch.stack([torch.full((3,), b % 256, dtype=torch.uint8) for b in ids])

    def write_window_block(self, block, payload):
        self.win[block] = bytes(payload.numpy())


def _window_key(h: bytes) -> str:
    return object_key(NS.hex(), 'window', h.hex())


WIN0 = 500      # the window-pool block of block k is WIN0 + k in the writer's table


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 90), n=st.integers(40, 260), data=st.data())
def test_window_objects_probe_offers_a_boundary_only_when_every_object_it_reads_exists(window, n, data):
    """A mixed model with window objects (``window_rows`` = W): every reusable boundary b is put as
    its state, the KV objects (global rows) of every block below b and the window objects of
    ``[window_first_block(b, W), b/B)`` only (objects and bytes: exactly those sets). The Store then
    loses a random subset; a fresh tier offers exactly the boundaries whose state, global blocks and
    window blocks all remain, deepest first, and loading the deepest writes every global block and
    only its window's rows into the window table."""
    client = FakeStoreClient()
    ids = prompt(n, n)
    hashes = chain_block_hashes(ids, B)
    rules = ReuseRules(n, B, A)
    boundaries = sorted(rules.restore_candidates(0, len(hashes)))
    tier = StoreTier(client, _Rows(), NS, B, window_rows=window)
    for b in boundaries:
        tier.submit(StorePut(hashes[:b // B], list(range(b // B)), b, None,
                             [WIN0 + k for k in range(b // B)]))
    assert tier.flush(timeout=10)
    stats = tier.stats()
    tier.close()
    needed = {b: range(window_first_block(b, window, B), b // B) for b in boundaries}
    union = set().union(*needed.values())
    below = set(range(max(boundaries, default=0) // B))
    assert stats['store_put_objects'] == {'state': len(boundaries), 'kv': len(below), 'window': len(union)}
    assert stats['store_put_bytes'] == {'state': 0, 'kv': 4 * len(below), 'window': 3 * len(union)}
    assert set(client.objects) == ({_kv_key(hashes[k]) for k in below} | {_window_key(hashes[k]) for k in union}
                                   | {_state_key(hashes[b // B - 1]) for b in boundaries})
    lost = data.draw(st.sets(st.sampled_from(sorted(client.objects)), max_size=4) if client.objects else st.just(set()))
    for key in lost:
        del client.objects[key]
    tier = StoreTier(FakeStoreClient(objects=client.objects), _Rows(), NS, B, window_rows=window)
    try:
        expected = [b for b in sorted(boundaries, reverse=True)
                    if _state_key(hashes[b // B - 1]) not in lost
                    and not any(_kv_key(hashes[k]) in lost for k in range(b // B))
                    and not any(_window_key(hashes[k]) in lost for k in needed[b])]
        assert tier.probe(hashes, rules) == expected
        if expected:
            b = expected[0]
            load = StoreLoad(None, b, hashes[:b // B], list(range(100, 100 + b // B)), 0, None,
                             window_block_ids=[-1] * needed[b].start + [700 + k for k in needed[b]])
            assert tier.load(load)
            assert tier.cache_engine.kv == {100 + k: bytes([k] * 4) for k in range(b // B)}
            assert tier.cache_engine.win == {700 + k: bytes([(WIN0 + k) % 256] * 3) for k in needed[b]}
    finally:
        tier.close()


def test_a_save_whose_window_blocks_were_given_back_is_not_made():
    """A turn end whose decode gave back a block of its window (FREED_BLOCK in the window table):
    nothing is put for it (its state could never be restored), and no key stays in flight."""
    client = FakeStoreClient()
    hashes = chain_block_hashes(prompt(100, 3), B)
    tier = StoreTier(client, _Rows(), NS, B, window_rows=40)
    try:
        table = [WIN0 + k for k in range(6)]
        table[3] = -1                                   # window_first_block(96, 40) = 3
        tier.submit(StorePut(hashes[:6], list(range(6)), 96, None, table))
        assert tier.flush(timeout=10) and not client.objects and not tier._pending
        table[3] = WIN0 + 3
        tier.submit(StorePut(hashes[:6], list(range(6)), 96, None, table))
        assert tier.flush(timeout=10)
        assert tier.stats()['store_put_objects'] == {'state': 1, 'kv': 6, 'window': 3}
    finally:
        tier.close()


def test_window_objects_are_a_kind_of_their_own():
    """A window object is never read as a KV object (kind code in the header and key) and the
    reverse: swapping the two under each other's key is rejected at load."""
    from lmdeploy.pytorch.store.object_format import StoreObjectError, decode_object, encode_object
    key_w, key_k = object_key(NS.hex(), 'window', 'ab'), object_key(NS.hex(), 'kv', 'ab')
    value = encode_object('window', NS, 16, b'xyz', key=key_w)
    assert decode_object(value, 'window', NS, 16, key=key_w) == b'xyz'
    for kind, key in (('kv', key_k), ('kv', key_w), ('window', key_k)):
        with pytest.raises(StoreObjectError):
            decode_object(value, kind, NS, 16, key=key)


# ---------------------------------------------------------------- the byte formula with a window
def test_simulator_charges_only_window_blocks():
    """n = 300, P = A = 64: save points 64, 128, 192, 256; W = 24 needs blocks {2, 3}, {6, 7},
    {10, 11}, {14, 15}; W = 40 adds blocks 1, 5, 9, 13; no window: all 16 blocks."""
    plan = plan_prefill(300, 0, 64, B, 64, False)
    assert plan.save_points == [64, 128, 192, 256]
    for window, blocks in ((24, 8), (40, 12), (None, 16), (1000, 16)):
        result = simulate([300], 0, 10, chunk_size=64, block_size=B, alignment=64, window=window)
        assert result.default.total_bytes == blocks * 10
    with pytest.raises(ValueError, match='window'):
        simulate([300], 0, 10, chunk_size=64, block_size=B, alignment=64, window=0)


# ---------------------------------------------------------------- admission of a window restore
def test_a_window_restore_attaches_and_allocates_only_its_window():
    """The scheduler commits a Store restore at 256 tokens (W = 24): 14 FREED_BLOCK entries
    (blocks 0-13, out of the window), then 5 allocated blocks for [224, 300), not 19."""
    from lmdeploy.pytorch.config import SchedulerConfig
    from lmdeploy.pytorch.engine.scheduler import Scheduler
    from lmdeploy.pytorch.paging.block_manager import BlockManager
    from lmdeploy.pytorch.paging.sequence import FREED_BLOCK, Sequence
    from lmdeploy.pytorch.prefix_cache.plans import PrefixMatch
    from lmdeploy.pytorch.prefix_cache.null_cache import NullPrefixCache

    class _Tier(NullPrefixCache):
        def __init__(self, match):
            self._m, self.pinned = match, []

        def match(self, seq):
            return self._m

    from lmdeploy import PytorchEngineConfig
    cfg = SchedulerConfig.from_engine_config(PytorchEngineConfig(block_size=B, max_prefill_token_num=64,
                                                                 prefill_save_alignment=64))
    bm = BlockManager(32)
    match = PrefixMatch([], 256, 'store', None, 0, 0, first_block=window_first_block(256, 24, B))
    sched = Scheduler(cfg, bm, None, _Tier(match))
    seq = Sequence(prompt(300, 9), GenerationConfig(max_new_tokens=1))
    sched.add(seq)
    [chunk] = sched.schedule().chunks
    assert (chunk.start, chunk.end) == (256, 300)
    assert seq.block_ids[:14] == [FREED_BLOCK] * 14 and min(seq.block_ids[14:]) >= 0
    assert len(seq.block_ids) == 19 and seq.num_freed_blocks == 14 and bm.num_free == 32 - 5


@pytest.mark.parametrize('sliding, window', [(True, 24), (False, None)])
def test_simulator_cli_reads_the_window_from_the_config(tmp_path, sliding, window):
    """``simulate_store_writes.py --config`` of the tiny granitemoe_swa: the window comes from the
    model's own specs (24 when every layer slides; with global layers the window layers' own
    window, 24, as window objects), and a 300-token prompt (B = 16, A = P = 64) is charged 4 empty
    state objects and 8 blocks, or the global rows of 16 blocks and the window rows of 8 (before
    this model kept its window pool with a Store: 16 blocks of every layer's rows)."""
    import json

    import simulate_store_writes as cli
    from lmdeploy.tools.make_tiny_model import build_config
    overrides = dict(layer_types=['sliding_attention'] * 4) if sliding else {}
    config = build_config('granitemoe_swa', vocab_size=64, eos_token_id=2, pad_token_id=0, **overrides).to_dict()
    config['dtype'] = 'float32'
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(config))
    sizes = cli.sizes_from_config(config, block_size=B)
    assert sizes.window == window and sizes.state_bytes == 0 and sizes.window_rows == (None if sliding else 24)
    [result] = cli.main(['--config', str(path), '--block-size', '16', '--alignment', '64', '--chunk-size', '64',
                         '--turns', '300', '--json'])
    assert result.default.turns[0].save_points == [64, 128, 192, 256]
    assert result.default.total_bytes == (8 * sizes.kv_block_bytes if sliding else
                                          16 * sizes.kv_block_bytes + 8 * sizes.window_block_bytes)
    assert sizes.window_block_bytes == (0 if sliding else sizes.kv_block_bytes)     # 2 global, 2 sliding layers


def test_the_window_split_joins_the_namespace():
    """A KV object of a split engine holds the global layers' rows only: its namespace names the
    groups, so an engine keeping one shared table (whose KV objects hold every layer's rows) never
    reads it, and the reverse; without the split the namespace is the one it always was."""
    from lmdeploy.pytorch.store.identity import engine_namespace
    from lmdeploy.pytorch.store.object_format import namespace_digest
    common = dict(dtype='torch.float32', block_size=B, layers=['a', 'b', 'c'], override='ops')
    plain = engine_namespace('unused', **common)
    split = engine_namespace('unused', **common, paged_groups=[[0, 2], [1]])
    assert plain != split != engine_namespace('unused', **common, paged_groups=[[0], [1, 2]])
    assert plain == namespace_digest(model={'operator_namespace': 'ops'}, dtype='torch.float32', block_size=B,
                                     layers=['a', 'b', 'c'], tp_rank=0, tp_size=1, adapter=None, secret_key_id=None)


def test_a_rejected_window_object_fails_the_load_and_is_repaired_by_the_next_save():
    """A window object whose bytes were altered: the load at its boundary fails (the caller rolls
    back), the key is remembered as bad, and the next save of the prefix overwrites it (counted as
    repaired), after which the boundary is offered and loads again."""
    client = FakeStoreClient()
    n = 100
    hashes = chain_block_hashes(prompt(n, 7), B)
    rules = ReuseRules(n, B, A)
    put = StorePut(hashes[:6], list(range(6)), 96, None, [WIN0 + k for k in range(6)])
    tier = StoreTier(client, _Rows(), NS, B, window_rows=40)
    tier.submit(put)
    assert tier.flush(timeout=10)
    tier.close()
    key = _window_key(hashes[4])                     # window_first_block(96, 40) = 3: blocks 3-5
    value = bytearray(client.objects[key])
    value[70] ^= 1                                   # a payload byte
    client.objects[key] = bytes(value)
    tier = StoreTier(FakeStoreClient(objects=client.objects), _Rows(), NS, B, window_rows=40)
    try:
        assert tier.probe(hashes, rules)[0] == 96
        load = StoreLoad(None, 96, hashes[:6], list(range(100, 106)), 0, None, window_block_ids=list(range(700, 706)))
        assert not tier.load(load)
        assert tier.stats()['store_rejected_objects'] == 1
        tier.submit(put)            # (the engine computes the prefix again and saves it)
        assert tier.flush(timeout=10)
        assert tier.stats()['store_repaired_objects'] == 1 and tier.probe(hashes, rules)[0] == 96
        assert tier.load(load) and tier.cache_engine.win[704] == bytes([(WIN0 + 4) % 256] * 3)
    finally:
        tier.close()
