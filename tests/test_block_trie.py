"""Prefix-cache bookkeeping without a model: block reference counts and free-list order
(BlockManager), chained hashes, token verification and LRU eviction of leaves (BlockTrie),
and runtime/checkpoint slots with pins and LRU (StateCache). Exact ids throughout."""
import pytest

from lmdeploy.pytorch.paging.block_manager import BlockManager, OutOfBlocks
from lmdeploy.pytorch.prefix_cache.block_trie import BlockTrie, chain_block_hashes
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache

B = 4


def tokens(*blocks: int) -> list[int]:
    """One block of B tokens per argument, filled with that value (block 7 → [7, 7, 7, 7])."""
    return [t for b in blocks for t in [b] * B]


def _trie(num_blocks: int = 8, runtime: int = 2, ckpt: int = 4):
    bm = BlockManager(num_blocks)
    sc = StateCache(runtime, ckpt)
    return bm, sc, BlockTrie(bm, B, sc)


def _cache(bm: BlockManager, trie: BlockTrie, toks: list[int]) -> list[int]:
    """What a finishing sequence does: allocate, insert its full blocks, drop its references."""
    blocks = bm.allocate(len(toks) // B)
    trie.insert(toks, blocks, len(blocks))
    bm.free_all(blocks)
    return blocks


# ------------------------------------------------------------------ BlockManager
def test_block_manager_allocates_lowest_ids_and_reuses_freed_blocks_last():
    bm = BlockManager(4)
    assert bm.allocate(2) == [0, 1]
    assert bm.refcount == [1, 1, 0, 0]
    bm.free_all([1, 0])
    assert bm.allocate(3) == [2, 3, 1]    # free list is FIFO: 2, 3, then the freed 1, 0
    assert bm.num_free == 1


def test_block_manager_refcount_frees_at_zero_only():
    bm = BlockManager(2)
    [b] = bm.allocate(1)
    bm.incref(b)
    bm.decref(b)
    assert bm.refcount[b] == 1 and bm.num_free == 1
    bm.decref(b)
    assert bm.refcount[b] == 0 and bm.num_free == 2


def test_block_manager_out_of_blocks_takes_nothing():
    bm = BlockManager(3)
    bm.allocate(2)
    with pytest.raises(OutOfBlocks):
        bm.allocate(2)
    assert bm.num_free == 1 and bm.allocate(1) == [2]


def test_block_manager_rejects_empty_pool():
    with pytest.raises(ValueError, match='num_blocks'):
        BlockManager(0)


# ------------------------------------------------------------------ hashes
def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = chain_block_hashes(tokens(1, 2, 3) + [9], B)
    assert len(a) == 3 and all(len(h) == 16 for h in a)
    b = chain_block_hashes(tokens(5, 2, 3), B)
    # same block contents after a different first block: every later hash differs
    assert all(x != y for x, y in zip(a, b))
    assert chain_block_hashes(tokens(1, 2, 3, 4), B)[:3] == a
    assert chain_block_hashes(tokens(1, 2, 3), B, num_blocks=2) == a[:2]


def test_block_hashes_continue_from_a_prefix_and_hash_uint32_little_endian_tokens():
    import hashlib
    ids = tokens(1, 2, 3, 4) + [7]
    full = chain_block_hashes(ids, B)
    for k in range(5):
        assert chain_block_hashes(ids, B, prefix=full[:k]) == full
    assert chain_block_hashes(ids, B, num_blocks=2, prefix=full) == full[:2]
    first = b''.join(t.to_bytes(4, 'little') for t in ids[:B])
    assert full[0] == hashlib.blake2b(b'\x00' * 16 + first, digest_size=16).digest()


def test_block_hashes_include_extra_keys():
    plain = chain_block_hashes(tokens(1, 2), B)
    assert chain_block_hashes(tokens(1, 2), B, extra_keys=[b'', b'']) == plain
    with_image = chain_block_hashes(tokens(1, 2), B, extra_keys=[b'', b'img'])
    assert with_image[0] == plain[0] and with_image[1] != plain[1]


# ------------------------------------------------------------------ BlockTrie
def test_insert_takes_one_reference_per_new_node_and_match_returns_the_path():
    bm, _, trie = _trie()
    toks = tokens(1, 2, 3) + [9, 9]
    blocks = bm.allocate(4)               # 3 full blocks + a partial one
    nodes = trie.insert(toks, blocks, 3)
    assert [n.block_id for n in nodes] == [0, 1, 2]
    assert [n.depth for n in nodes] == [1, 2, 3]
    assert bm.refcount == [2, 2, 2, 1, 0, 0, 0, 0]
    assert trie.match(toks) == nodes
    assert [n.block_id for n in trie.match(tokens(1, 2, 7))] == [0, 1]
    assert trie.match(tokens(2, 1)) == []


def test_insert_keeps_the_existing_node_and_the_second_copy_stays_private():
    bm, _, trie = _trie()
    first = bm.allocate(2)
    trie.insert(tokens(1, 2), first, 2)
    second = bm.allocate(2)                # [2, 3]: an identical prefix computed concurrently
    nodes = trie.insert(tokens(1, 2), second, 2)
    assert [n.block_id for n in nodes] == [0, 1]
    assert trie.num_nodes == 2
    assert bm.refcount[:4] == [2, 2, 1, 1]
    bm.free_all(second)
    assert bm.refcount[2:4] == [0, 0]


def test_match_verifies_tokens_not_just_hashes():
    bm, _, trie = _trie()
    blocks = bm.allocate(2)
    forged = chain_block_hashes(tokens(1, 2), B)
    trie.insert(tokens(1, 2), blocks, 2)
    # a request whose hashes collide with the cached ones but whose second block differs
    assert [n.block_id for n in trie.match(tokens(1, 3), forged)] == [0]
    # an insert that collides keeps the cached node and stops there
    other = bm.allocate(2)
    assert [n.block_id for n in trie.insert(tokens(1, 3), other, 2, forged)] == [0]
    assert trie.num_nodes == 2


def test_evict_frees_least_recently_used_leaves_first():
    bm, _, trie = _trie(num_blocks=6)
    _cache(bm, trie, tokens(1))                     # block 0
    _cache(bm, trie, tokens(2))                     # block 1
    _cache(bm, trie, tokens(3))                     # block 2
    trie.match(tokens(1))                           # 1 is now the most recently used
    assert trie.evict(2) == 2
    assert [n.block_id for n in trie.iter_nodes()] == [0]
    assert list(bm._free)[-2:] == [1, 2]            # freed in LRU order


def test_evict_follows_lru_through_a_parent_that_becomes_a_leaf():
    bm, _, trie = _trie(num_blocks=6)
    _cache(bm, trie, tokens(1, 2))                  # blocks 0 → 1, used first
    _cache(bm, trie, tokens(3))                     # block 2, used last
    # the old chain's child, then its parent (older than block 2), go before block 2
    assert trie.evict(2) == 2
    assert [n.block_id for n in trie.iter_nodes()] == [2]
    assert list(bm._free)[-2:] == [1, 0]


def test_evict_skips_blocks_sequences_reference_and_inner_nodes():
    bm, _, trie = _trie(num_blocks=6)
    _cache(bm, trie, tokens(1, 2))                  # blocks 0 → 1
    held = bm.allocate(1)                           # block 2, still held by a running sequence
    trie.insert(tokens(3), held, 1)
    assert trie.evict(6) == 2                       # 1 then 0; block 2 has refcount 2
    assert [n.block_id for n in trie.iter_nodes()] == [2]
    assert bm.refcount[2] == 2


def test_an_eviction_does_not_pop_and_push_back_the_leaves_it_cannot_take(monkeypatch):
    """Leaves no eviction can take (here 40 referenced by a running sequence, all older than the
    evictable ones) are parked in key order, not popped and pushed back by every call: 20 calls of
    one block each push no blocked entry again, and take the LRU evictable leaves in order (the old
    loop pushed all 40 back at every call)."""
    import heapq as real_heapq

    from lmdeploy.pytorch.prefix_cache import block_trie
    bm, _, trie = _trie(num_blocks=64)
    held = bm.allocate(40)
    for i, b in enumerate(held):                    # 40 leaves a sequence still references
        trie.insert(tokens(100 + i), [b], 1)
    free = [_cache(bm, trie, tokens(200 + i))[0] for i in range(20)]
    pushes, push = [], real_heapq.heappush
    monkeypatch.setattr(block_trie.heapq, 'heappush', lambda heap, entry: (pushes.append(entry), push(heap, entry))[1])
    order = []
    for _ in range(20):
        before = set(bm._free)
        assert trie.evict(1) == 1
        order += [b for b in bm._free if b not in before]
    assert order == free and pushes == []
    assert trie.num_nodes == 40 and trie.evict(1) == 0


def test_the_pool_never_evicts_and_an_explicit_eviction_frees_the_lru_leaf():
    bm, _, trie = _trie(num_blocks=4)
    _cache(bm, trie, tokens(1, 2, 3))               # blocks 0 → 1 → 2 cached, 3 free
    assert not bm.can_allocate(2) and trie.num_nodes == 3      # asking has no side effect
    with pytest.raises(OutOfBlocks):
        bm.allocate(2)
    assert trie.evict(1) == 1                       # the leaf (block 2) goes
    assert bm.allocate(2) == [3, 2]
    assert [n.block_id for n in trie.iter_nodes()] == [0, 1]


def test_an_allocation_eviction_cannot_satisfy_evicts_nothing():
    bm, _, trie = _trie(num_blocks=4)
    _cache(bm, trie, tokens(1, 2))                  # blocks 0 → 1 cached
    held = bm.allocate(2)                           # blocks 2, 3 held by a sequence
    assert trie.num_evictable_blocks == 2
    with pytest.raises(OutOfBlocks):
        bm.allocate(3)
    assert trie.num_nodes == 2 and bm.num_free == 0  # the cache survived the failed request
    assert trie.evict(2) == 2 and bm.allocate(2) == [1, 0]
    bm.free_all(held)


def test_a_running_sequence_adopts_nodes_whose_block_only_the_cache_holds():
    bm, _, trie = _trie(num_blocks=8)
    _cache(bm, trie, tokens(1, 2, 3))               # an earlier request: blocks 0 → 1 → 2
    mine = bm.allocate(4)                           # a repeat recomputes them into 3, 4, 5 (+ 6)
    ids = tokens(1, 2, 3, 4)
    node = trie.extend(None, ids, mine, 4, chain_block_hashes(ids, B))
    assert [n.block_id for n in _path(node)] == [3, 4, 5, 6]
    assert bm.refcount[:3] == [0, 0, 0] and bm.num_free == 4      # the old copies are free now
    assert trie.num_evictable_blocks == 0                         # every node is referenced


class _NoCompare(tuple):
    """A node's tokens that fail the test when compared."""

    def __ne__(self, other):
        raise AssertionError('compared the tokens of a node that holds the sequence\'s own block')

    __eq__ = __ne__
    __hash__ = tuple.__hash__


def test_a_walk_over_the_sequences_own_cached_blocks_compares_no_tokens():
    """Re-inserting (a leaving sequence) or extending over blocks whose node holds the sequence's
    own block trusts the block: it touches each node (LRU) and compares no token, so a long
    prompt's walk costs a lookup per block; a different block under the same hash is still
    verified (the match test above)."""
    bm, _, trie = _trie(num_blocks=8)
    ids = tokens(1, 2, 3)
    mine = bm.allocate(3)
    hashes = chain_block_hashes(ids, B)
    nodes = trie.insert(ids, mine, 3, hashes)
    for n in nodes:
        n.tokens = _NoCompare(n.tokens)
    clocks = [n.last_access for n in nodes]
    again = trie.insert(ids, mine, 3, hashes)
    assert again == nodes and [n.last_access for n in again] > clocks      # touched, root first
    assert again[0].last_access < again[1].last_access < again[2].last_access
    assert trie.extend(None, ids, mine, 3, hashes) is nodes[-1]
    assert trie.num_nodes == 3 and bm.refcount[:3] == [2, 2, 2]


def test_a_shared_block_is_not_adopted_and_unreferenced_interior_nodes_stay_evictable():
    bm, _, trie = _trie(num_blocks=8)
    _cache(bm, trie, tokens(1, 2))                  # blocks 0 → 1
    bm.incref(0)                                    # another sequence reads block 0
    mine = bm.allocate(3)                           # 2, 3, 4: a recompute of the same prefix + 1
    ids = tokens(1, 2, 5)
    node = trie.extend(None, ids, mine, 3, chain_block_hashes(ids, B))
    assert [n.block_id for n in _path(node)] == [0, 3, 4]        # block 0 is shared: kept
    bm.decref(0)                                    # that reader leaves: node 0 is unreferenced,
    assert trie.num_evictable_blocks == 1           # interior, and still evictable
    assert trie.evict(1) == 1 and trie.num_nodes == 0            # with its subtree
    assert bm.refcount[3] == 1 and bm.refcount[4] == 1           # the sequence keeps its blocks
    assert trie.extend(node, ids, mine, 3, chain_block_hashes(ids, B)).depth == 3   # and re-inserts them


def _path(node):
    out = []
    while node is not None and node.depth > 0:
        out.append(node)
        node = node.parent
    return out[::-1]


def test_evictable_count_excludes_ancestors_of_referenced_or_pinned_nodes():
    bm, sc, trie = _trie(num_blocks=8, runtime=1, ckpt=1)
    _cache(bm, trie, tokens(1, 2, 3))               # chain 0 → 1 → 2
    _cache(bm, trie, tokens(1, 5))                  # branch under block 0: block 4 (3 was a copy)
    assert trie.num_evictable_blocks == 4
    [node5] = [n for n in trie.iter_nodes() if n.block_id == 4]
    slot = sc.alloc_checkpoint()
    sc.publish(slot, node5)
    sc.pin(slot)                                    # block 4 and its ancestor 0 stay
    assert trie.num_evictable_blocks == 2
    bm.incref(1)                                    # a sequence shares block 1: only 2 can go
    assert trie.num_evictable_blocks == 1
    assert trie.evict(4) == 1 and trie.num_nodes == 3


def test_evicting_a_leaf_drops_its_checkpoint_and_keeps_the_parents():
    bm, sc, trie = _trie(num_blocks=4, runtime=2, ckpt=2)
    blocks = bm.allocate(2)
    n1, n2 = trie.insert(tokens(1, 2), blocks, 2)
    bm.free_all(blocks)
    s1, s2 = sc.alloc_checkpoint(), sc.alloc_checkpoint()
    assert (s1, s2) == (2, 3)                       # checkpoint ids follow the runtime ids
    sc.publish(s1, n1)
    sc.publish(s2, n2)
    assert trie.evict(1) == 1
    assert n2.checkpoint_slot is None and n1.checkpoint_slot == 2
    assert sc.num_published == 1 and sc.num_free_checkpoints == 1
    assert sc.alloc_checkpoint() == 3


def test_a_pinned_checkpoint_keeps_its_node_from_eviction():
    bm, sc, trie = _trie(num_blocks=4, runtime=1, ckpt=1)
    blocks = bm.allocate(1)
    [node] = trie.insert(tokens(1), blocks, 1)
    bm.free_all(blocks)
    slot = sc.alloc_checkpoint()
    sc.publish(slot, node)
    sc.pin(slot)
    assert trie.evict(1) == 0 and trie.num_nodes == 1
    sc.unpin(slot)
    assert trie.evict(1) == 1 and sc.num_published == 0


def test_a_dead_only_eviction_takes_a_leaf_once_its_checkpoint_is_released():
    """A leaf parked as live by a dead-only eviction is skipped while its checkpoint stays, and
    freed by the next dead-only eviction after the release, in LRU order; releases with no
    eviction in between never grow the re-offered list past the trie's size."""
    bm, sc, trie = _trie(num_blocks=8, runtime=1, ckpt=2)
    [old] = trie.insert(tokens(1), blocks := bm.allocate(1), 1)
    bm.free_all(blocks)
    [new] = trie.insert(tokens(2), blocks := bm.allocate(1), 1)
    bm.free_all(blocks)
    slot = sc.alloc_checkpoint()
    sc.publish(slot, old)
    assert trie.evict(1, dead_only=True) == 1 and new.parent is None and old.parent is not None
    assert trie.evict(1, dead_only=True) == 0          # the live leaf is parked, not freed
    sc.release_checkpoint(slot)
    assert trie.evict(1, dead_only=True) == 1 and old.parent is None and trie.num_nodes == 0
    [leaf] = trie.insert(tokens(3), blocks := bm.allocate(1), 1)
    bm.free_all(blocks)
    for _ in range(200):
        slot = sc.alloc_checkpoint()
        sc.publish(slot, leaf)
        sc.release_checkpoint(slot)
    assert len(trie._revived) <= 2 * trie.num_nodes + 65
    assert trie.evict(1, dead_only=True) == 1 and trie.num_nodes == 0


# ------------------------------------------------------------------ StateCache
class _Node:
    checkpoint_slot = None
    parent = object()       # a node in some trie


def test_state_slots_runtime_then_checkpoint_ids():
    sc = StateCache(3, 2)
    assert sc.num_slots == 5
    assert [sc.alloc_runtime() for _ in range(4)] == [0, 1, 2, None]
    sc.free_runtime(1)
    assert sc.alloc_runtime() == 1
    assert [sc.alloc_checkpoint(), sc.alloc_checkpoint()] == [3, 4]


def test_checkpoint_alloc_evicts_the_least_recently_used_unpinned_checkpoint():
    sc = StateCache(1, 3)
    nodes = [_Node(), _Node(), _Node()]
    for node in nodes:
        sc.publish(sc.alloc_checkpoint(), node)      # slots 1, 2, 3 in this order
    sc.touch(1)                                      # LRU order now 2, 3, 1
    sc.pin(2)
    assert sc.alloc_checkpoint() == 3                # 2 is pinned: the next oldest goes
    assert nodes[2].checkpoint_slot is None and nodes[1].checkpoint_slot == 2
    sc.pin(1)
    assert sc.alloc_checkpoint() is None             # every published checkpoint is pinned
    assert sc.num_pinned == 2
    sc.unpin(1)
    sc.unpin(2)
    assert sc.num_pinned == 0 and sc.alloc_checkpoint() == 2


def test_no_checkpoint_slots_means_no_checkpoint():
    sc = StateCache(2, 0)
    assert sc.alloc_checkpoint() is None
    assert sc.num_free_checkpoints == 0


def test_a_node_is_published_once_and_only_while_in_the_trie():
    """A second slot for a node that has a checkpoint, or a slot for a node the trie dropped, is
    refused (the caller releases it): a node never points at two slots."""
    sc = StateCache(1, 3)
    node, gone = _Node(), _Node()
    gone.parent = None
    a, b, c = sc.alloc_checkpoint(), sc.alloc_checkpoint(), sc.alloc_checkpoint()
    assert sc.publish(a, node) and node.checkpoint_slot == a
    assert sc.publish(a, node)                      # the same slot again: a no-op
    assert not sc.publish(b, node) and node.checkpoint_slot == a
    assert not sc.publish(c, gone) and gone.checkpoint_slot is None
    assert sc.num_published == 1


def test_releasing_a_pinned_checkpoint_raises():
    sc = StateCache(1, 1)
    slot = sc.alloc_checkpoint()
    sc.publish(slot, _Node())
    sc.pin(slot)
    sc.pin(slot)
    sc.unpin(slot)
    with pytest.raises(RuntimeError, match='pinned'):
        sc.release_checkpoint(slot)
    sc.unpin(slot)
    sc.release_checkpoint(slot)
    assert sc.num_free_checkpoints == 1 and sc.num_published == 0


def test_extend_continues_a_path_from_its_deepest_node_and_restarts_after_eviction():
    from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
    bm, _, trie = _trie(num_blocks=8)
    toks = tokens(1, 2, 3)
    hashes = chain_block_hashes(toks, B)
    blocks = bm.allocate(3)
    first = trie.extend(None, toks, blocks, 1, hashes)
    assert (first.depth, first.block_id) == (1, blocks[0])
    deepest = trie.extend(first, toks, blocks, 3, hashes)
    assert (deepest.depth, deepest.block_id, deepest.parent.parent is first) == (3, blocks[2], True)
    assert trie.extend(deepest, toks, blocks, 3, hashes) is deepest          # nothing new: no walk
    bm.free_all(blocks)
    assert trie.evict(3) == 3 and first.parent is None                     # the whole path went
    again = bm.allocate(2)
    restarted = trie.extend(first, toks, again, 2, hashes)                  # from the root again
    assert (restarted.depth, restarted.parent.block_id, trie.num_nodes) == (2, again[0], 2)
