"""The local prefix cache: a trie of full KV blocks keyed by chained block hashes.

One node per cached full block. A node's key is the chained hash of all tokens from the
start of the sequence through its block (plus optional extra keys such as multimodal content
hashes), and the node also keeps the block's own token ids so that every hit is verified
token by token — a hash alone never decides a hit::

    root ─ [t0..t63] ─ [t64..t127] ─ [t128..t191]        depth = blocks from the root
                     └ [u64..u127]  (a branch)            boundary of a node = depth·B

Ownership: the trie owns topology and LRU order; the :class:`BlockManager` owns reference
counts (a cached node holds one reference on its block); the :class:`StateCache` owns
checkpoint slots, which the trie only points at (``node.checkpoint_slot``).

Invariant: every node that no sequence references can be evicted. Two rules keep it:

* a running sequence that recomputes a block the trie already holds *adopts* the node when
  only the cache references the node's block (the node takes the sequence's block, the old
  copy is freed at once), so a repeated prompt never doubles its blocks;
* eviction takes least recently used unreferenced leaves first, and when none is left it
  removes an unreferenced interior node with its whole subtree (descendants a sequence still
  references stay with that sequence and leave the trie; the sequence re-inserts them).

So the number of blocks eviction can free is known exactly, without evicting
(:attr:`BlockTrie.num_evictable_blocks`), which admission relies on to never evict for a
request it then cannot admit.

Window rows (a model of global and sliding-window layers whose window layers have a pool of their
own, ``window_pool``): a node may also hold the window group's block of the same tokens
(``node.window_block``, -1: none), with one reference of its own in that pool. Which nodes keep
one is the local tier's rule (:class:`~.local_tier.LocalTier`, the nodes a restore at a published
checkpoint reads); the trie only holds and drops them, and frees a node's window block with it.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from typing import Sequence

from ..paging.block_manager import BlockManager
from .state_cache import StateCache

__all__ = ['BlockTrie', 'TrieNode', 'chain_block_hashes', 'salted_root', 'root_path']

_ROOT_HASH = b'\x00' * 16
_CLOCK = itertools.count(1)


def salted_root(salt: str | None) -> bytes:
    """``hash_{-1}`` of a chain: all zeros without a salt, else a 16-byte digest of the salt
    (domain-separated, so no salt equals "no salt")."""
    if not salt:
        return _ROOT_HASH
    return hashlib.blake2b(b'lmdeploy/cache_salt\0' + salt.encode('utf-8'), digest_size=16).digest()


def chain_block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
                       extra_keys: Sequence[bytes] | None = None, prefix: Sequence[bytes] = (),
                       salt: str | None = None) -> list[bytes]:
    """Chained 16-byte hashes of the full blocks of ``token_ids``.

    ``hash_i = blake2b(hash_{i-1} ‖ token ids of block i as little-endian uint32 ‖ extra_keys[i])``
    with ``hash_{-1}`` = :func:`salted_root` of ``salt``, so equal hashes imply (up to
    collisions, which callers rule out by comparing tokens) equal prefixes under the same salt,
    and a request's ``cache_salt`` changes its first block's hash and so every later one (local
    trie keys and Store keys alike).

    Args:
        token_ids: the tokens (ids in ``[0, 2**32)``).
        block_size: tokens per block.
        num_blocks: hash only this many leading blocks (default: every full block).
        extra_keys: per-block extra bytes (e.g. multimodal content hashes), or None.
        prefix: hashes of the leading blocks from an earlier call on the same tokens; hashing
            continues after them, so a growing sequence costs O(new blocks), not O(all blocks).
        salt: the request's ``cache_salt`` (None or empty: unsalted).

    Returns:
        One digest per full block, in order (``prefix`` included, cut to ``num_blocks``).
    """
    full = len(token_ids) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    hashes = list(prefix[:n])
    prev = hashes[-1] if hashes else salted_root(salt)
    first = len(hashes)
    if first >= n:
        return hashes
    # one pack of every new block, then a view per block: a struct call per block cost as much
    # as the hash itself (the same bytes either way)
    data = memoryview(struct.pack(f'<{(n - first) * block_size}I', *token_ids[first * block_size:n * block_size]))
    step = 4 * block_size
    blake2b = hashlib.blake2b
    for j, i in enumerate(range(first, n)):
        h = blake2b(prev, digest_size=16)
        h.update(data[j * step:(j + 1) * step])
        if extra_keys is not None and extra_keys[i]:
            h.update(extra_keys[i])
        prev = h.digest()
        hashes.append(prev)
    return hashes


class TrieNode:
    """One cached full block."""
    __slots__ = ('parent', 'children', 'key', 'tokens', 'block_id', 'depth', 'last_access', 'checkpoint_slot',
                 'ckpts_below', 'window_block')

    def __init__(self, parent, key: bytes, tokens: tuple, block_id: int, depth: int):
        self.parent = parent
        self.children: dict[bytes, TrieNode] = {}
        self.key = key
        self.tokens = tokens
        self.block_id = block_id
        self.depth = depth
        self.last_access = next(_CLOCK)
        self.checkpoint_slot: int | None = None
        self.ckpts_below = 0      # published checkpoints in this node's subtree, itself included
        self.window_block = -1    # the window group's block of the same tokens (its own pool), -1: none


def root_path(node) -> list:
    """The trie nodes from the root's child down to ``node`` (the blocks of the prefix ``node``
    ends, in token order; the root itself, a node without a parent, is not a block): ``[]`` for
    the root or None. O(depth)."""
    path = []
    while node is not None and node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


class BlockTrie:
    """Prefix cache over full blocks.

    Args:
        block_manager: owner of block reference counts (the trie takes one per node).
        block_size: tokens per block (B).
        state_cache: owner of checkpoint slots (hybrid models), or None.
        window_pool: the window group's own pool (window rows, see the module docstring), or None.
    """

    def __init__(self, block_manager: BlockManager, block_size: int, state_cache: StateCache | None = None,
                 window_pool: BlockManager | None = None):
        self.block_manager = block_manager
        self.window_pool = window_pool
        # nodes holding a window block, by id (what window eviction and the ledger count)
        self.window_nodes: dict[int, TrieNode] = {}
        self.block_size = block_size
        self.state_cache = state_cache
        self.root = TrieNode(None, _ROOT_HASH, (), -1, 0)
        self.num_nodes = 0
        self.num_evicted = 0      # nodes (KV blocks) evicted so far
        # Leaves as (last_access, depth, tiebreak, node), lazily invalidated: an entry is stale when
        # its node is gone, got children, or was touched again (a newer entry exists). Eviction
        # then costs O(k log N + blocked leaves) instead of a walk of the whole trie.
        self._leaves: list[tuple[int, int, int, TrieNode]] = []
        # Entries an eviction found blocked (referenced, pinned, or live under ``dead_only``), in
        # key order, kept out of the heap: the next eviction merges them with it instead of
        # popping and pushing every blocked leaf again (which made each call O(blocked log N)).
        self._parked: list[tuple[int, int, int, TrieNode]] = []
        # Entries a ``dead_only`` eviction found live (a leaf's ``ckpts_below`` counts only its own
        # checkpoint), unordered: later ``dead_only`` calls skip them without a look, since they
        # stay blocked until that checkpoint is released, and a release re-offers the leaf
        # (``_revived``, from :meth:`checkpoint_counted`); a full eviction merges them back. Without
        # this, every ``dead_only`` call re-read every live leaf older than its victims (most of a
        # replay's eviction time when a checkpoint per prompt is kept).
        self._parked_live: list[tuple[int, int, int, TrieNode]] = []
        self._revived: list[TrieNode] = []
        self._tiebreak = itertools.count()
        if state_cache is not None:
            state_cache.listeners.append(self)
        # observers told of every node made (``block_cached(node)``) and removed
        # (``block_dropped(node)``), e.g. the KV event tracker (kv_events.py)
        self.listeners: list = []

    def match(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> list[TrieNode]:
        """Nodes of the longest cached prefix of full blocks, root excluded, verified token by
        token; each matched node is touched (LRU)."""
        B = self.block_size
        if hashes is None:
            hashes = chain_block_hashes(token_ids, B)
        nodes, node, clock = [], self.root, _CLOCK
        for i, h in enumerate(hashes):
            child = node.children.get(h)
            if child is None or child.tokens != tuple(token_ids[i * B:(i + 1) * B]):
                break
            node = child
            node.last_access = next(clock)
            nodes.append(node)
        if nodes and not nodes[-1].children:
            self._push_leaf(nodes[-1])
        return nodes

    def _push_leaf(self, node: TrieNode) -> None:
        heapq.heappush(self._leaves, (node.last_access, node.depth, next(self._tiebreak), node))
        if len(self._leaves) + len(self._parked) + len(self._parked_live) > 4 * self.num_nodes + 64:
            # drop stale entries now and then
            self._leaves = [e for e in self._leaves if self._is_current(e)]
            heapq.heapify(self._leaves)
            self._parked = [e for e in self._parked if self._is_current(e)]
            self._parked_live = [e for e in self._parked_live if self._is_current(e)]

    def checkpoint_counted(self, node: TrieNode, delta: int) -> None:
        """A :class:`StateCache` listener: ``node``'s ``ckpts_below`` changed by ``delta``. A leaf
        whose last checkpoint went is dead now, so it is offered to the next eviction again (its
        parked live entry is no longer read by ``dead_only`` calls)."""
        if delta < 0 and not node.ckpts_below and not node.children:
            self._revived.append(node)
            if len(self._revived) > 2 * self.num_nodes + 64:
                # no eviction for a long while (a roomy cache): keep only the current leaves,
                # once each, so the list stays within the trie's size
                seen: set[int] = set()
                self._revived = [n for n in self._revived if n.parent is not None and not n.children
                                 and not n.ckpts_below and not (id(n) in seen or seen.add(id(n)))]

    @staticmethod
    def _is_current(entry) -> bool:
        node = entry[-1]
        return node.parent is not None and not node.children and entry[0] == node.last_access

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], num_blocks: int,
               hashes: Sequence[bytes] | None = None) -> list[TrieNode]:
        """Make sure nodes exist for the first ``num_blocks`` full blocks of a sequence,
        touching every node on the path (LRU).

        A block already cached under the same prefix keeps its existing node (the sequence's
        copy stays private to it); a new node takes a reference on the sequence's block.

        Returns:
            The nodes along the path: ``num_blocks`` of them, fewer if a hash collision with
            different tokens stopped the walk.
        """
        if hashes is None:
            hashes = chain_block_hashes(token_ids, self.block_size, num_blocks)
        nodes: list[TrieNode] = []
        self._descend(self.root, token_ids, block_ids, num_blocks, hashes, nodes)
        return nodes

    def extend(self, node: TrieNode | None, token_ids: Sequence[int], block_ids: Sequence[int], num_blocks: int,
               hashes: Sequence[bytes]) -> TrieNode:
        """Continue a running sequence's path from ``node``, the deepest node it cached before
        (from the root if None or since evicted), so caching a new block costs O(new blocks)
        instead of a walk from the root. Nodes above ``node`` are not touched: the sequence
        references them, so they are not evictable meanwhile.

        Returns:
            The deepest node of the path (depth ``num_blocks`` unless a hash collision stopped it).
        """
        if node is None or node.parent is None:      # an evicted node has no parent
            node = self.root
        return self._descend(node, token_ids, block_ids, num_blocks, hashes, None, adopt=True)

    def _descend(self, node: TrieNode, token_ids, block_ids, num_blocks: int, hashes, out: list | None,
                 adopt: bool = False) -> TrieNode:
        # the per-block loop of every insert: names are bound once outside it (it runs for every
        # block of every prompt, which is most of a trace replay's time)
        B, bm, clock, listeners = self.block_size, self.block_manager, _CLOCK, self.listeners
        refcount = bm.refcount
        for i in range(node.depth, num_blocks):
            h = hashes[i]
            bid = block_ids[i]
            child = node.children.get(h)
            if child is None:
                if bid < 0:
                    break       # the sequence freed this block (out of its sliding window): nothing to cache
                child = TrieNode(node, h, tuple(token_ids[i * B:(i + 1) * B]), bid, i + 1)
                bm.cache(bid)
                node.children[h] = child
                self.num_nodes += 1
                for listener in listeners:
                    listener.block_cached(child)
            elif bid == child.block_id:
                # the sequence's own block is the node's: the tokens are equal without comparing
                # them (a node holds a reference on its block, so the block was never reused
                # meanwhile, and a sequence's tokens are append-only); a walk over a prompt's
                # shared or already cached blocks costs a lookup per block, not a 64-token compare
                pass
            elif child.tokens != tuple(token_ids[i * B:(i + 1) * B]):
                # a hash collision with different tokens keeps the old node; a freed block
                # (bid < 0) whose tokens the cache does not hold stops the path as well
                break
            elif adopt and 0 <= bid != child.block_id and refcount[child.block_id] == 1:
                # a running sequence recomputed a block only the cache holds: the node takes the
                # sequence's copy and the old one is freed, so no unreferenced duplicate remains
                # above blocks the sequence references
                bm.cache(bid)
                bm.uncache(child.block_id)
                child.block_id = bid
            child.last_access = next(clock)
            if out is not None:
                out.append(child)
            node = child
        if node is not self.root and not node.children:
            self._push_leaf(node)
        return node

    def _holds(self, node: TrieNode) -> bool:
        """``node`` is in this trie (a state cache could, in principle, be shared). O(depth)."""
        while node.parent is not None:
            node = node.parent
        return node is self.root

    def _unreferenced(self, node: TrieNode) -> bool:
        return self.block_manager.refcount[node.block_id] == 1

    def _pinned(self, node: TrieNode) -> bool:
        slot = node.checkpoint_slot
        return slot is not None and self.state_cache is not None and self.state_cache.is_pinned(slot)

    def _evictable(self, node: TrieNode) -> bool:
        return not node.children and self._unreferenced(node) and not self._pinned(node)

    def evict(self, num_blocks: int, dead_only: bool = False) -> int:
        """Free up to ``num_blocks`` blocks.

        With ``dead_only``, only *dead* leaves go (no published checkpoint at or below them:
        no restore of a hybrid model can use them), least recently used first, and nothing else.

        Otherwise: first least recently used unreferenced leaves (a parent becomes a candidate, at its own
        last-use time, as soon as its last child goes, so an old chain goes child then parent
        before newer leaves); leaves that cannot go now are kept as candidates. If that is not
        enough, unreferenced interior nodes go, least recently used first, each with its whole
        subtree (see the module docstring).

        Cost: O(k log N) for k blocks freed, plus the leaves it finds blocked; a leaf a
        ``dead_only`` call found live is not read again by later ``dead_only`` calls until its
        checkpoint is released.

        Returns:
            Blocks returned to the free list.
        """
        freed, blocked, live = 0, [], []
        if self._revived:
            # a leaf whose checkpoint was released since: a fresh entry at the same key (its live
            # entry, if parked, is a duplicate that decides nothing: a node's key is unique)
            for node in self._revived:
                if node.parent is not None and not node.children and not node.ckpts_below and self._holds(node):
                    self._push_leaf(node)
            self._revived = []
        if not dead_only and self._parked_live:
            self._parked.extend(self._parked_live)
            self._parked.sort()
            self._parked_live = []
        leaves, parked, self._parked = self._leaves, self._parked, []
        j, num_parked, nxt = 0, len(parked), None
        while freed < num_blocks:
            # candidates in key order: the parked entries merged with the heap (keys are unique:
            # the tiebreak differs, so a node is never compared)
            if nxt is not None:
                entry, nxt = nxt, None
            elif j < num_parked and (not leaves or parked[j] < leaves[0]):
                entry = parked[j]
                j += 1
            elif leaves:
                entry = heapq.heappop(leaves)
            else:
                break
            if not self._is_current(entry):
                continue
            leaf = entry[-1]
            if dead_only and leaf.ckpts_below:
                live.append(entry)
                continue
            if not self._evictable(leaf):
                blocked.append(entry)
                continue
            parent = leaf.parent
            freed += self._remove(leaf)
            if parent is not self.root and not parent.children:
                entry = (parent.last_access, parent.depth, next(self._tiebreak), parent)
                if (freed < num_blocks and (not leaves or entry < leaves[0])
                        and (j >= num_parked or entry < parked[j])):
                    # the parent is the next candidate (an old chain goes child then parent):
                    # taken at once instead of pushed and popped again, in the same order
                    nxt = entry
                else:
                    self._push_leaf(parent)
                    leaves = self._leaves       # a compaction may have replaced the heap
        # what is still blocked, plus the parked entries not reached, in key order (a parent pushed
        # during the loop may sort before an entry blocked earlier; the sort is linear then)
        blocked.extend(parked[j:])
        blocked.extend(self._parked)        # parked by a compaction during the loop (none, normally)
        blocked.sort()
        self._parked = blocked
        self._parked_live.extend(live)      # in no order: only a full eviction reads them, sorted then
        if freed < num_blocks and not dead_only:
            freed += self._evict_subtrees(num_blocks - freed)
        return freed

    def _evict_subtrees(self, num_blocks: int) -> int:
        """Remove unreferenced interior nodes (and their subtrees), LRU first, until
        ``num_blocks`` blocks are free. O(N log N) over the trie: only reached once no
        unreferenced leaf is left. A subtree holding a pinned checkpoint stays."""
        guarded = set()             # nodes with a pinned checkpoint in their subtree
        for node in (self.state_cache.pinned_nodes() if self.state_cache is not None else []):
            while node is not None and node is not self.root:
                guarded.add(id(node))
                node = node.parent
        tops = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children and self._unreferenced(node) and id(node) not in guarded:
                tops.append(node)
            else:
                stack.extend(node.children.values())
        tops.sort(key=lambda n: n.last_access)
        freed = 0
        for node in tops:
            if freed >= num_blocks:
                break
            parent = node.parent
            for n in reversed(self._subtree(node)):       # children before their parent
                freed += self._remove(n)
            if parent is not self.root and not parent.children:
                self._push_leaf(parent)
        return freed

    @staticmethod
    def _subtree(node: TrieNode) -> list[TrieNode]:
        """``node`` and its descendants, parents before children."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _remove(self, node: TrieNode) -> int:
        """Drop ``node`` (its checkpoint too); returns the block rows that went to the free list
        (its block, and a block-row checkpoint's rows)."""
        before = self.block_manager.num_free
        self.num_evicted += 1
        if node.checkpoint_slot is not None and self.state_cache is not None:
            self.state_cache.release_checkpoint(node.checkpoint_slot, evicted=True)
        del node.parent.children[node.key]
        node.parent = None
        self.num_nodes -= 1
        self.block_manager.uncache(node.block_id)
        self.drop_window(node)
        for listener in self.listeners:
            listener.block_dropped(node)
        return self.block_manager.num_free - before

    def hold_window_block(self, node: TrieNode, block: int) -> None:
        """``node`` holds window-pool ``block`` (the window group's block of its tokens), taking
        a reference of its own; no-op when it holds one already or ``block`` < 0 (freed). The
        choice of which nodes hold which blocks is the local tier's
        (:meth:`~.local_tier.LocalTier.keep_window`)."""
        if node.window_block < 0 <= block and node.parent is not None:
            self.window_pool.incref(block)
            node.window_block = block
            self.window_nodes[id(node)] = node

    def drop_window(self, node: TrieNode) -> None:
        """``node`` gives back its window block (no-op without one)."""
        if node.window_block >= 0:
            self.window_pool.decref(node.window_block)
            node.window_block = -1
            del self.window_nodes[id(node)]

    def iter_nodes(self):
        """All nodes except the root (depth-first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks :meth:`evict` could free now: cached blocks no sequence references, less
        those on the path to a pinned checkpoint, in O(pins · depth) rather than a walk of the
        trie. Exact, by the invariant of the module docstring."""
        count = self.block_manager.num_cached_unshared
        if self.state_cache is None:
            return count
        kept = set()
        for node in self.state_cache.pinned_nodes():
            while node is not None and node is not self.root and id(node) not in kept:
                kept.add(id(node))
                count -= self._unreferenced(node)
                node = node.parent
        return count
