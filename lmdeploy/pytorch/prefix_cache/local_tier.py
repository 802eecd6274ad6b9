"""The local tier of the prefix cache: the block trie plus the checkpoint slots.

It owns the node ↔ checkpoint-slot links, the checkpoint pins (:attr:`LocalTier.pins`, the one
:class:`~.pins.CheckpointPins` of the engine: every pin is a lease carried by the plan that needs
it), and where each running sequence's path in the trie has reached. It answers the tier questions
for this process's memory:

* :meth:`LocalTier.match` — how deep a prefix is cached (full blocks, verified token by token)
  and the deepest checkpoint that may seed this input; metadata only;
* :meth:`LocalTier.depth` — the tier protocol's hash-only form of that question (nothing touched);
* :meth:`LocalTier.pin` / :meth:`LocalTier.unpin` — attach the shared blocks and pin the
  checkpoint for an admission (and undo it: the one rollback path);
* :meth:`LocalTier.extend` / :meth:`LocalTier.plan_checkpoint` — cache new full blocks of a
  running sequence and plan a checkpoint save at a save point;
* :meth:`LocalTier.release` — cache a leaving sequence's computed blocks;
* :meth:`LocalTier.evict` — free block rows: dead KV blocks first, then the eviction policy's
  checkpoints (:mod:`.eviction`), then (when nothing else is left) live blocks, LRU.

A checkpoint's bytes held (its state plus the blocks only it makes usable) change when one is
published or evicted below it on its path; the tier then reweighs the nearest one above
(:meth:`EvictionPolicy.reweigh <.eviction.EvictionPolicy.reweigh>`), O(depth). Checkpoints on
sibling branches or below keep the weight of their last publish or reweigh (an approximation).

With one memory budget (:attr:`StateCache.uses_block_rows`) checkpoints take KV block rows, so
a checkpoint evicted frees rows for blocks and an admission counts them as evictable.

Shared blocks are attached read-only: a sequence writes only blocks after its shared prefix.

Window rows (a model of global and sliding-window layers whose window layers keep a pool of their
own, ``window_pool``; window W, block size B): the trie stays keyed by the global group's blocks,
and a node keeps the window group's block of its tokens only while a restore may read it. The
reusable boundaries of such a model (it has recurrent state) are its published checkpoints, so the
rule is: a node at depth m keeps its window block while some published (or planned) checkpoint at
depth d >= m on its subtree has ``window_first_block(d·B) < m``, i.e. the node is one of the at most
``ceil((W - 1) / B)`` blocks that checkpoint's window reads::

    global   |g0|g1|g2|g3|g4|g5|g6|g7|g8|g9|       every block, as without windows
    window   |  |  |w2|w3|  |  |  |w7|w8|  |       checkpoints at depths 4 and 9, W <= 2·B
                     └─ckpt 4      └─ckpt 9

A save keeps them (the sequence still holds its window when the forward ending at b is planned),
releasing a checkpoint gives back those no other checkpoint reads, and evicting a node gives back
its window block with it. A match offers a checkpoint only when every window block it reads is
present; a pin references them with the checkpoint. When the window pool runs short, checkpoints
go (the eviction policy's order) until their window blocks free enough
(:meth:`LocalTier.evict_window`). A restore from the host tier or the Store loads its window's rows
into fresh window-pool blocks of the sequence, and keeping it locally (:meth:`LocalTier.cache_restored`)
keeps them as the nodes' window rows, as a save does.

Markers (``markers=True``: a mixed model *without* recurrent state, e.g. ``granitemoe_swa`` with
global layers): the same rule, with zero-byte checkpoints. Such a model could restore at any block
boundary whose window blocks are held, but keeping every window block would make its window
layers' memory grow with the sequence, so it publishes a **marker** (a checkpoint slot with no
state bytes and no copy) where a hybrid model would publish a checkpoint: at the save points of
its turn's plan and at its prompt's last full block boundary that leaves a token to compute
(:meth:`LocalTier.save_marker`). A marker keeps the window blocks its window reads, exactly as a
checkpoint does, so the window rows, their release, ``evict_window``, pins and the ledger work
unchanged; a host or Store restore becomes a marker at once (:meth:`LocalTier.restored_marker`, the
markers' form of :meth:`LocalTier.cache_restored`: nothing to copy), keeping the window rows the load wrote.
A match then offers the deepest block boundary ``b`` on the matched path whose window
blocks (depths ``(window_first_block(b), b / B]``) are all held, a marker's boundary or not
(:meth:`LocalTier.match`); a boundary whose window reads a missing block is never offered::

    global   |g0|g1|g2|g3|g4|g5|g6|g7|g8|g9|       every block
    window   |  |  |w2|w3|  |  |  |w7|w8|  |       markers at depths 4 and 9, W <= 2·B
    offered at depth 4 or 9 (and 3 or 8 if W <= B): the deepest whose window is held
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..cache_specs import window_first_block
from ..paging.block_manager import BlockManager
from ..paging.prefill_plan import ReuseRules
from .block_trie import BlockTrie, TrieNode
from .eviction import CheckpointStats
from .pins import CheckpointPins, PinLease
from .plans import CheckpointSave, PrefixMatch
from .state_cache import StateCache

__all__ = ['LocalTier']


@dataclass
class _Path:
    """How far a running sequence's blocks are in the trie."""
    node: TrieNode | None = None
    num_blocks: int = 0


class LocalTier:
    """Block trie + checkpoint slots of one engine.

    Args:
        block_manager: the KV block pool (reference counts).
        block_size: B, tokens per block.
        state_cache: the state slots (hybrid models), or None for full-attention-only models,
            which then get a state cache with no slots: nothing is checkpointed, on the same code path.
        state_bytes: S, bytes of one checkpoint (what the policy weighs a checkpoint by).
        block_bytes: K_blk, bytes of one KV block.
        window_pool: the window group's own pool (window rows: see the module docstring), or None.
        window: that group's sliding window (tokens); required with ``window_pool``.
        markers: the model has no recurrent state and ``state_cache`` holds its markers
            (zero-byte checkpoints: slots without rows, see the module docstring); needs
            ``window_pool``.

    Raises:
        ValueError: ``window_pool`` without a ``window``, or without checkpoints (recurrent state
            or markers: a model without them has no reusable boundary to keep window rows for);
            ``markers`` without ``window_pool`` or ``state_cache``.
    """

    def __init__(self, block_manager: BlockManager, block_size: int, state_cache: StateCache | None,
                 state_bytes: int = 1, block_bytes: int = 1, window_pool: BlockManager | None = None,
                 window: int | None = None, markers: bool = False):
        if window_pool is not None and (not window or state_cache is None):
            raise ValueError('window_pool needs a window (tokens) and checkpoints (a model with recurrent state, '
                             'or markers)')
        if markers and (window_pool is None or state_cache is None):
            raise ValueError('markers need a window_pool and a state_cache holding them')
        # zero-byte checkpoints of a model without state (module docstring): they keep window rows
        self.markers = markers
        self.window_pool = window_pool
        self.window = window if window_pool is not None else None
        # planned checkpoint saves (by destination slot) whose window blocks are kept: not
        # published yet, so not seen through ``ckpts_below``
        self._window_pending: dict[int, TrieNode] = {}
        # markers' turn-end staging (decode_save_last): per running sequence, the latest block
        # boundaries its forwards passed, whose window blocks are kept for a turn-end marker
        self._window_staged: dict[int, list[TrieNode]] = {}
        self.block_manager = block_manager
        self.block_size = block_size
        # the model has recurrent state: a prefix is restorable only where a checkpoint holds it
        self.is_hybrid = state_cache is not None and not markers
        self.state_cache = state_cache if state_cache is not None else StateCache(0, 0)
        self.state_bytes, self.block_bytes = max(state_bytes, 1), max(block_bytes, 1)
        # how many admitted requests reached each prefix (chained hash at an alignment boundary),
        # remembered beyond eviction (bounded, oldest forgotten): evidence of reuse for a
        # checkpoint saved there later
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self.trie = BlockTrie(block_manager, block_size, self.state_cache, window_pool)
        self.pins = CheckpointPins(self.state_cache)
        self._paths: dict[int, _Path] = {}
        if window_pool is not None:
            self.state_cache.listeners.append(self)     # a released checkpoint gives back its window

    # admission ---------------------------------------------------------------------------
    def match(self, seq, hashes: list[bytes], rules: ReuseRules) -> PrefixMatch:
        """The longest verified prefix of full blocks and the deepest restorable checkpoint on it.

        Hybrid models restore at a node whose checkpoint boundary is restorable for ``rules``;
        full-attention models reuse any matched full block, leaving at least one token to compute;
        with markers, the deepest such block boundary whose window blocks are all held (no
        checkpoint slot to restore: ``checkpoint_slot`` stays None).
        """
        B, n = self.block_size, seq.num_tokens
        nodes = self.trie.match(seq.token_ids, hashes)
        matched = min(len(nodes), (n - 1) // B) * B
        if self.markers:
            b = self._deepest_window_ready(nodes, matched // B) * B
            return PrefixMatch(nodes, b, 'local' if b else None, None, b // B, matched)
        if not self.is_hybrid:
            return PrefixMatch(nodes, matched, 'local' if matched else None, None, matched // B, matched)
        for node in reversed(nodes):
            b = node.depth * B
            if node.checkpoint_slot is not None and rules.restorable(b, len(nodes)) and self.window_ready(node):
                return PrefixMatch(nodes, b, 'local', node.checkpoint_slot, node.depth, matched)
        return PrefixMatch(nodes, 0, None, None, 0, matched)

    def depth(self, hashes: list[bytes], rules: ReuseRules, *, shared_blocks: int = 0, above: int = 0,
              below: int | None = None) -> int:
        """The tier protocol's hash-only question (:class:`~.tier.PrefixTier`): the deepest
        boundary ``b`` (tokens), ``above < b`` (and ``b < below`` when given), that this tier could
        restore under ``rules``: its full blocks ``[0, b/B + r)`` are cached under ``hashes`` and,
        for a hybrid model, the node at ``b`` holds a checkpoint (a full-attention model: any
        block boundary, leaving one token to compute; with markers, the deepest of those whose
        window blocks are all held); 0 if none.

        Metadata only: nothing is touched (LRU order and reach counts stay), nothing is pinned,
        and tokens are not compared (:meth:`match` verifies them before an admission uses a hit).
        ``shared_blocks`` is accepted for the protocol: every block this tier counts is its own.
        """
        B, node, nodes = self.block_size, self.trie.root, []
        for h in hashes:
            node = node.children.get(h)
            if node is None:
                break
            nodes.append(node)
        if not self.is_hybrid:
            b = min(len(nodes), (rules.num_tokens - 1) // B) * B
            if below is not None:
                b = min(b, (below - 1) // B * B)
            if self.markers:
                b = self._deepest_window_ready(nodes, b // B) * B
            return b if b > above else 0
        for b in rules.restore_candidates(above, len(nodes)):
            node = nodes[b // B - 1]
            if (below is None or b < below) and node.checkpoint_slot is not None and self.window_ready(node):
                return b
        return 0

    def pin(self, match: PrefixMatch) -> None:
        """Reference the shared blocks and pin the checkpoint of ``match`` (so eviction can take
        neither while the admission allocates); the pin's lease is ``match.lease``, handed on to
        the restore by :meth:`PrefixCache.plan_load`."""
        for node in match.nodes[match.first_block:match.num_shared_blocks]:
            self.block_manager.incref(node.block_id)
        if match.checkpoint_slot is not None:
            match.lease = self.pins.take(match.checkpoint_slot, 'restore_source')
        elif self.markers and match.source == 'local':
            # (no state to copy: the pin keeps a marker restored from out of this admission's
            # own window eviction; PrefixCache.plan_load releases it at commit)
            slot = match.nodes[match.num_shared_blocks - 1].checkpoint_slot
            if slot is not None:
                match.lease = self.pins.take(slot, 'restore_source')
        if self.window_pool is not None and match.source == 'local' and match.cached_tokens:
            reads = self._window_reads(match.nodes[match.num_shared_blocks - 1])
            match.window_first = match.num_shared_blocks - len(reads)
            match.window_blocks = [n.window_block for n in reads]
            for block in match.window_blocks:
                self.window_pool.incref(block)

    SEEN_CAPACITY = 1 << 18     # prefixes whose reach counts are remembered

    def record_use(self, match: PrefixMatch, hashes: list[bytes] = (), alignment: int = 0) -> bool:
        """An admission committed: the checkpoint it restores counts a hit, and every other
        checkpoint its match walked through counts as reached (evidence of a shared prefix); no
        other node is touched. ``hashes`` (the request's block hashes) at every ``alignment``
        boundary count as reached in the remembered history.

        Returns:
            Whether the request continues a prefix reached before (its first aligned prefix was
            seen by an earlier request, even if the cache evicted it since).
        """
        if not self.is_hybrid and not self.markers:     # no checkpoint to credit, no reuse evidence to keep
            return False
        hit = match.checkpoint_slot
        if self.markers and match.source == 'local' and match.cached_tokens:
            hit = match.nodes[match.num_shared_blocks - 1].checkpoint_slot      # a marker restored, if any
        continued = False
        step = alignment // self.block_size if alignment else 0
        for i in range(step - 1, len(hashes), step) if step else ():
            h = hashes[i]
            count = self._seen.pop(h, 0)
            continued = continued or (i == step - 1 and count > 0)
            self._seen[h] = count + 1
        while len(self._seen) > self.SEEN_CAPACITY:
            self._seen.popitem(last=False)
        for node in match.nodes:
            slot = node.checkpoint_slot
            if slot is None:
                continue
            if slot == hit:
                self.state_cache.touch(slot, hit=True)
            else:
                stats = self.state_cache.stats.get(slot)
                if stats is not None:
                    stats.reached += 1
                    self.state_cache.touch(slot)
        return continued

    def unpin(self, match: PrefixMatch) -> None:
        """Undo :meth:`pin` (an admission that did not commit)."""
        for node in match.nodes[match.first_block:match.num_shared_blocks]:
            self.block_manager.decref(node.block_id)
        if match.lease is not None:
            match.lease.release()
            match.lease = None
        for block in match.window_blocks:
            self.window_pool.decref(block)
        match.window_first, match.window_blocks = 0, []

    # running sequences -------------------------------------------------------------------
    def extend(self, seq, hashes: list[bytes], num_blocks: int) -> TrieNode | None:
        """Cache the first ``num_blocks`` full blocks of running ``seq`` (O(new blocks)).

        Returns:
            The node at depth ``num_blocks`` (also below blocks already cached: a turn end cut
            back by a stop string), or None when a hash collision stopped the path.
        """
        path = self._paths.setdefault(seq.seq_id, _Path())
        if num_blocks > path.num_blocks or path.node is None or path.node.parent is None:
            path.node = self.trie.extend(path.node, seq.token_ids, seq.block_ids, num_blocks, hashes)
            path.num_blocks = num_blocks
        node = path.node
        while node is not None and node.depth > num_blocks:     # a shallower boundary of the path
            node = node.parent
        return node if node is not None and node.depth == num_blocks else None

    def needs_extend(self, seq, num_blocks: int) -> bool:
        """Whether ``seq`` has full blocks beyond those already in the trie."""
        path = self._paths.get(seq.seq_id)
        return path is None or num_blocks > path.num_blocks

    def plan_checkpoint(self, seq, node: TrieNode | None, boundary: int, taken: set, reason: str = 'prefill',
                        continuation: bool = False) -> CheckpointSave | str:
        """Plan the save of ``seq``'s state after ``boundary`` tokens on ``node``.

        Returns:
            A :class:`CheckpointSave` (its slot allocated and pinned), or the reason it is
            skipped: ``'hash_collision'`` (no node), ``'exists'`` (the node has a checkpoint, or
            another save of this step targets it), ``'no_free_slot'``.
        """
        if node is None:
            return 'hash_collision'
        if node.checkpoint_slot is not None or id(node) in taken:
            return 'exists'
        dst = self.alloc_checkpoint()
        if dst is None:
            return 'no_free_slot'
        if self.window_pool is not None:
            self._window_pending[dst] = node
            self.keep_window(seq, node)
        return CheckpointSave(seq, seq.state_slot, dst, node, boundary, self.pins.take(dst, 'save_target', seq.seq_id),
                              reason, continuation)

    def save_marker(self, seq, node: TrieNode | None, boundary: int, reason: str = 'prefill',
                    continuation: bool = False) -> CheckpointStats | str:
        """Publish a marker (a zero-byte checkpoint, module docstring) of ``seq`` after ``boundary``
        tokens on ``node`` now: there is no state to copy, and the forward that computed the
        blocks below ``boundary`` has run. It keeps the window blocks its window reads, which
        ``seq`` still holds (``boundary`` is past the start of the chunk that just ran).

        Returns:
            The published marker's :class:`~.eviction.CheckpointStats`, or the reason it is
            skipped: ``'hash_collision'`` (no node), ``'exists'`` (the node has a marker),
            ``'no_free_slot'`` (none free and every marker pinned, or ``num_checkpoint_slots`` 0),
            ``'window_gone'`` (a window block it reads is neither held by ``seq`` nor cached).

        Raises:
            RuntimeError: this tier keeps no markers.
        """
        if not self.markers:
            raise RuntimeError('save_marker: this tier keeps no markers (a model with state saves checkpoints)')
        if node is None:
            return 'hash_collision'
        if node.checkpoint_slot is not None:
            return 'exists'
        slot = self.alloc_checkpoint()
        if slot is None:
            return 'no_free_slot'
        if not self.keep_window(seq, node):
            self.state_cache.release_checkpoint(slot)
            return 'window_gone'
        stats = self.checkpoint_stats(node, boundary, reason, continuation)
        if not self.publish_checkpoint(slot, node, stats):      # (checked above: cannot happen)
            return 'exists'
        return stats

    def alloc_checkpoint(self) -> int | None:
        """A checkpoint slot, evicting first when the slots or rows are short (None: nothing
        left to evict, every checkpoint pinned, or no checkpoint slots at all)."""
        sc = self.state_cache
        if sc.uses_block_rows and not sc.at_capacity() and self.block_manager.num_free < sc.rows_per_checkpoint:
            self.evict(sc.rows_per_checkpoint - self.block_manager.num_free, protect_checkpoints=True)
        return sc.alloc_checkpoint()

    def checkpoint_stats(self, node: TrieNode, boundary: int, reason: str, continuation: bool = False,
                         key=None) -> CheckpointStats:
        """What the eviction policy weighs a checkpoint about to be published on ``node`` by:
        the tokens it saves beyond the next shallower checkpoint on its path, and its bytes plus
        those of the blocks only it will make usable (O(depth))."""
        below, n = 0, node.parent
        while n is not None and n.parent is not None:
            if n.checkpoint_slot is not None:
                below = n.depth * self.block_size
                break
            n = n.parent
        exclusive = self._exclusive_blocks(node, 0)
        return CheckpointStats(-1, boundary, boundary - below, self.state_bytes + exclusive * self.block_bytes,
                               reason, continuation, reached=max(self._seen.get(node.key, 0) - 1, 0),
                               key=node.key if key is None else key, covered=node.ckpts_below > 0)

    def checkpoint_done(self, save: CheckpointSave, copied: bool) -> None:
        """Publish a planned checkpoint whose copy ran; release it unpublished if it did not (or
        its node has a checkpoint already / left the trie)."""
        save.lease.release()
        self._window_pending.pop(save.dst, None)
        stats = self.checkpoint_stats(save.node, save.boundary, save.reason, save.continuation) if copied else None
        self.publish_checkpoint(save.dst, save.node, stats)

    def publish_checkpoint(self, slot: int, node: TrieNode, stats: CheckpointStats | None) -> bool:
        """Publish checkpoint ``slot`` on ``node`` with its eviction ``stats``, or release it
        unpublished when ``stats`` is None (its copy did not run) or ``node`` cannot take it (it
        holds another checkpoint or left the trie). Returns whether it was published."""
        self._window_pending.pop(slot, None)
        if stats is not None and self.state_cache.publish(slot, node, stats):
            self._reweigh_above(node)
            return True
        self.state_cache.release_checkpoint(slot)
        self._trim_window(node)      # window blocks kept for it that nothing else reads
        return False

    # window rows -------------------------------------------------------------------------
    def _deepest_window_ready(self, nodes: list[TrieNode], limit: int) -> int:
        """The deepest depth ``d <= limit`` on the path ``nodes`` (depths 1, 2, ...) whose window
        blocks, depths ``(window_first_block(d·B), d]``, are all held; 0 if none. One pass:
        ``run`` counts the held window blocks ending at depth d, and d is ready when they reach
        back to its window's first block (O(limit))."""
        B, W = self.block_size, self.window
        best = run = 0
        for d in range(1, limit + 1):
            run = run + 1 if nodes[d - 1].window_block >= 0 else 0
            if run >= d - window_first_block(d * B, W, B):
                best = d
        return best

    def _window_reads(self, node: TrieNode) -> list[TrieNode]:
        """The nodes whose window blocks a restore at ``node``'s boundary b reads: depths
        ``(window_first_block(b), b / B]`` on its path, shallowest first (O(W / B))."""
        first = window_first_block(node.depth * self.block_size, self.window, self.block_size)
        out, n = [], node
        while n is not None and n.parent is not None and n.depth > first:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def window_ready(self, node: TrieNode) -> bool:
        """Whether every window block a restore at ``node`` reads is held (always, without
        window rows)."""
        return self.window_pool is None or all(n.window_block >= 0 for n in self._window_reads(node))

    def keep_window(self, seq, node: TrieNode | None) -> bool:
        """The nodes a restore at ``node`` reads keep ``seq``'s window blocks of their tokens (a
        node holding one already keeps its own). All or nothing: when ``seq`` gave back a block
        a node lacks (a turn-end boundary its decode passed), nothing is kept, since the restore
        could never be offered. Returns whether every window block is held now."""
        if self.window_pool is None or node is None:
            return True
        table, reads = seq.window_block_ids, self._window_reads(node)
        if any(n.window_block < 0 and (n.depth > len(table) or table[n.depth - 1] < 0) for n in reads):
            return False
        for n in reads:
            self.trie.hold_window_block(n, table[n.depth - 1])
        return True

    def _window_needed(self, m: TrieNode) -> bool:
        """Whether a published or planned checkpoint reads ``m``'s window block: one on ``m``'s
        subtree whose window reaches back to ``m`` (a walk pruned by ``ckpts_below`` and by depth)."""
        B, W, index = self.block_size, self.window, m.depth - 1
        stack = [m]
        while stack:
            n = stack.pop()
            if window_first_block(n.depth * B, W, B) > index:
                continue        # n's window, and every deeper one's, starts after m
            if n.checkpoint_slot is not None:
                return True
            stack.extend(c for c in n.children.values() if c.ckpts_below)
        for p in self._planned_nodes():
            if p.depth >= m.depth and window_first_block(p.depth * B, W, B) <= index:
                while p is not None and p.depth > m.depth:
                    p = p.parent
                if p is m:
                    return True
        return False

    def _planned_nodes(self) -> list[TrieNode]:
        """Nodes whose window blocks are kept for a checkpoint not published yet: planned saves
        and markers' turn-end staging."""
        out = list(self._window_pending.values())
        for nodes in self._window_staged.values():
            out.extend(nodes)
        return out

    def stage_window(self, seq, node: TrieNode | None, keep: int = 1) -> bool:
        """Markers' turn-end staging (``decode_save_last``): ``node``, a block boundary the forward
        of ``seq`` just passed, keeps the window blocks a restore there reads, as a planned
        checkpoint does, so a turn-end marker can be published there when ``seq`` finishes
        (:meth:`save_marker`); only the latest ``keep`` staged nodes of ``seq`` stay (2 for a
        request with stop strings: its turn may end one block earlier), older ones give back the
        rows nothing else reads. Returns whether ``node`` is staged now."""
        if not self.markers or node is None:
            return False
        staged = self._window_staged.setdefault(seq.seq_id, [])
        if any(n is node for n in staged):
            return True
        if not self.keep_window(seq, node):
            return False
        staged.append(node)
        while len(staged) > keep:
            self._trim_window(staged.pop(0))
        return True

    def staged_boundaries(self, seq) -> list[int]:
        """The boundaries (tokens) :meth:`stage_window` keeps for ``seq``."""
        return [n.depth * self.block_size for n in self._window_staged.get(seq.seq_id, ())]

    def drop_staged(self, seq) -> None:
        """``seq`` leaves: its staged nodes give back the window blocks nothing else reads."""
        for node in self._window_staged.pop(seq.seq_id, ()):
            self._trim_window(node)

    def _trim_window(self, node: TrieNode) -> None:
        """Give back the window blocks a restore at ``node`` read that no checkpoint reads now."""
        if self.window_pool is None:
            return
        for m in self._window_reads(node):
            if m.window_block >= 0 and not self._window_needed(m):
                self.trie.drop_window(m)

    def checkpoint_counted(self, node: TrieNode, delta: int) -> None:
        """A :class:`StateCache` listener: a checkpoint released from ``node`` gives back the
        window blocks only it read."""
        if delta < 0:
            self._trim_window(node)

    @property
    def num_window_blocks(self) -> int:
        """Window-pool blocks the trie holds (0 without window rows)."""
        return len(self.trie.window_nodes)

    @property
    def num_evictable_window_blocks(self) -> int:
        """Window-pool blocks that releasing every unpinned checkpoint frees (exact): those only
        the trie references, less those a pinned or planned checkpoint reads. O(window nodes)."""
        if self.window_pool is None:
            return 0
        guarded = set()
        for node in list(self.state_cache.pinned_nodes()) + self._planned_nodes():
            guarded.update(id(n) for n in self._window_reads(node))
        refcount = self.window_pool.refcount
        return sum(1 for key, n in self.trie.window_nodes.items() if refcount[n.window_block] == 1
                   and key not in guarded)

    def evict_window(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` window-pool blocks: checkpoints go, in the eviction policy's
        order, until the window blocks only they read free enough. Returns the blocks freed."""
        pool = self.window_pool
        if pool is None:
            return 0
        start = pool.num_free
        while pool.num_free - start < num_blocks and self._evict_checkpoint():
            pass
        if pool.num_free - start < num_blocks:
            # (defensive: a window block no checkpoint reads is normally given back at once)
            for node in [n for n in self.trie.window_nodes.values() if not self._window_needed(n)]:
                self.trie.drop_window(node)
        return pool.num_free - start

    def _reweigh_above(self, node: TrieNode) -> None:
        """The checkpoints on ``node``'s path changed below the nearest one above it (one was
        published or evicted at ``node``): the blocks that nearest one alone makes usable
        changed, so tell the policy its bytes held now (O(depth)). A checkpoint with a deeper one
        below it frees only its own state when evicted, which is what it then weighs."""
        sc, n = self.state_cache, node.parent
        while n is not None and n.parent is not None and n.checkpoint_slot is None:
            n = n.parent
        stats = sc.stats.get(n.checkpoint_slot) if n is not None and n.parent is not None else None
        if stats is None:
            return
        nbytes, covered = self.state_bytes + self._exclusive_blocks(n, 1) * self.block_bytes, n.ckpts_below > 1
        if nbytes != stats.nbytes or covered != stats.covered:
            sc.policy.reweigh(stats, nbytes, covered)

    @staticmethod
    def _exclusive_blocks(node: TrieNode, own: int) -> int:
        """The blocks of ``node``'s path that only a checkpoint at ``node`` makes usable: ``node``
        and its ancestors up to the first whose subtree holds another checkpoint (``ckpts_below >
        own``; ``own`` is 1 when ``node``'s checkpoint is published, 0 before). ``ckpts_below``
        never shrinks going up, so these are the path's nodes without another one below them."""
        count, n = 0, node
        while n is not None and n.parent is not None and n.ckpts_below <= own:
            count += 1
            n = n.parent
        return count

    def release_checkpoint(self, slot: int) -> None:
        """Return an unpinned checkpoint ``slot`` (published or not) to the free slots or rows."""
        self.state_cache.release_checkpoint(slot)

    def checkpoint_ref(self, slot: int) -> int | tuple[int, ...]:
        """Where checkpoint ``slot``'s bytes are (a state-buffer row, or its KV block rows)."""
        return self.state_cache.locate(slot)

    def take_pin(self, slot: int, purpose: str, owner: int | None = None) -> PinLease:
        """Pin checkpoint ``slot`` for ``purpose`` (owned by sequence ``owner``); see :mod:`.pins`."""
        return self.pins.take(slot, purpose, owner)

    def release_pins(self, owner: int) -> int:
        """Release every pin sequence ``owner`` still holds (it is leaving); returns how many."""
        return self.pins.release_owner(owner)

    def on_checkpoint_evicted(self, keep) -> None:
        """Call ``keep(node, state_ref)`` for each published checkpoint eviction takes, while its
        memory still holds it (the host tier's demotion); None: nothing is kept."""
        self.state_cache.on_evict = keep

    def add_listener(self, listener, checkpoints: bool = True) -> None:
        """Tell ``listener`` what this tier caches: the trie's ``block_cached(node)`` /
        ``block_dropped(node)`` and, with ``checkpoints``, the state cache's checkpoint hooks (the
        KV event tracker, :mod:`.kv_events`)."""
        self.trie.listeners.append(listener)
        if checkpoints:
            self.state_cache.listeners.append(listener)

    def cache_restored(self, seq, hashes: list[bytes], boundary: int) -> tuple[TrieNode, PinLease] | None:
        """Keep a Store restore locally: insert its blocks and reserve a pinned checkpoint slot
        for the restored state; returns ``(node, lease)`` (``lease.slot``: the slot to copy into
        and publish), or None. With window rows the trie's nodes keep the window blocks the load
        wrote (the sequence's window-group table), as for a planned checkpoint save.

        Raises:
            RuntimeError: this tier keeps markers (a model without state keeps a restore with
                :meth:`restored_marker`: there is no state to copy).
        """
        if self.markers:
            raise RuntimeError('cache_restored: a model without state keeps a restore as a marker (restored_marker)')
        nodes = self.trie.insert(seq.token_ids, seq.block_ids, boundary // self.block_size, hashes)
        if len(nodes) != boundary // self.block_size or nodes[-1].checkpoint_slot is not None:
            return None
        dst = self.alloc_checkpoint()
        if dst is None:
            return None
        if self.window_pool is not None:
            self._window_pending[dst] = nodes[-1]
            self.keep_window(seq, nodes[-1])
        return nodes[-1], self.pins.take(dst, 'store_keep', seq.seq_id)

    def restored_marker(self, seq, hashes: list[bytes], boundary: int) -> CheckpointStats | str:
        """Keep a host or Store restore of a model without state locally: insert its ``boundary /
        B`` blocks into the trie and publish a marker at ``boundary`` now, as :meth:`cache_restored`
        keeps a hybrid's restore as a checkpoint. Nothing is copied: the load wrote the global rows
        into ``seq``'s blocks and the rows of ``boundary``'s window into fresh window-pool blocks of
        ``seq``'s window table, which the marker keeps as its window rows (:meth:`keep_window`), so
        they are given back and evicted as a saved marker's are.

        Returns:
            The published marker's :class:`~.eviction.CheckpointStats` (reason ``'restored'``), or
            why none was: ``'hash_collision'`` (the blocks did not all enter the trie), ``'exists'``
            (a marker is there already: it keeps the loaded window rows it lacked), or
            :meth:`save_marker`'s other reasons.

        Raises:
            RuntimeError: this tier keeps no markers.
        """
        if not self.markers:
            raise RuntimeError('restored_marker: this tier keeps no markers (a model with state keeps a checkpoint)')
        nodes = self.trie.insert(seq.token_ids, seq.block_ids, boundary // self.block_size, hashes)
        if len(nodes) != boundary // self.block_size or not nodes:
            return 'hash_collision'
        if nodes[-1].checkpoint_slot is not None:
            # a marker whose window rows went missing (so no local restore was offered): the rows
            # the load wrote make it restorable again
            self.keep_window(seq, nodes[-1])
            return 'exists'
        return self.save_marker(seq, nodes[-1], boundary, 'restored')

    def release(self, seq, hashes: list[bytes], num_computed_blocks: int) -> None:
        """``seq`` leaves (finish, abort, preemption): cache its computed full blocks first."""
        self._paths.pop(seq.seq_id, None)
        if num_computed_blocks:
            self.trie.insert(seq.token_ids, seq.block_ids, num_computed_blocks, hashes)

    def forget(self, seq) -> None:
        """Drop ``seq``'s path without caching anything (its blocks hold no valid data)."""
        self._paths.pop(seq.seq_id, None)

    # capacity ----------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """KV blocks held by the trie (referenced by running sequences or not)."""
        return self.trie.num_nodes

    def cached_nodes(self) -> list[TrieNode]:
        """Every node of the trie (introspection, tests)."""
        return list(self.trie.iter_nodes())

    @property
    def num_evictable_blocks(self) -> int:
        """Block rows :meth:`evict` can free now (exact): cached blocks no sequence references
        (less those on the path to a pinned checkpoint) and, with one memory budget, the rows of
        every unpinned checkpoint."""
        return self.trie.num_evictable_blocks + self.state_cache.num_evictable_rows

    @property
    def dead_first(self) -> bool:
        """Evict blocks no checkpoint makes usable before any checkpoint (every policy but LRU,
        which keeps today's order for comparison)."""
        return self.state_cache.policy.name != 'lru'

    def evict(self, num_blocks: int, protect_checkpoints: bool = False) -> int:
        """Free up to ``num_blocks`` block rows held by the cache alone; returns how many.

        Hybrid models: dead blocks first, then (one memory budget) the policy's checkpoints, each
        followed by the blocks it alone made usable; what is still short comes from live blocks,
        least recently used first (their checkpoints go with them). ``protect_checkpoints``:
        stop before live blocks (a save making room for itself must not evict the prefix it
        saves on).
        """
        bm, sc = self.block_manager, self.state_cache
        start = bm.num_free

        def short() -> int:
            return num_blocks - (bm.num_free - start)

        rows = sc.uses_block_rows
        if self.dead_first:
            self.trie.evict(num_blocks, dead_only=True)
            while rows and short() > 0 and self._evict_checkpoint():
                if short() > 0:
                    self.trie.evict(short(), dead_only=True)
            if short() > 0 and not protect_checkpoints:
                self.trie.evict(short())
        else:       # LRU: blocks as before, then the least recently used checkpoints
            if not protect_checkpoints:
                self.trie.evict(num_blocks)
            while rows and short() > 0 and self._evict_checkpoint():
                pass
        return bm.num_free - start

    def _evict_checkpoint(self) -> bool:
        """Release the policy's victim among unpinned checkpoints; False when there is none."""
        victim = self.state_cache.victim()
        if victim is None:
            return False
        node = self.state_cache.node_of(victim)
        self.state_cache.release_checkpoint(victim, evicted=True)
        if node is not None:
            self._reweigh_above(node)
        return True

    @property
    def num_evictions(self) -> dict[str, int]:
        """Entries evicted so far, by kind (``checkpoint``, ``kv``)."""
        return {'checkpoint': self.state_cache.num_evicted, 'kv': self.trie.num_evicted}
