"""The local tier of the prefix cache: the block trie plus the checkpoint slots.

It owns the node ↔ checkpoint-slot links, the checkpoint pins (:attr:`LocalTier.pins`, the one
:class:`~.pins.CheckpointPins` of the engine: every pin is a lease carried by the plan that needs
it), and where each running sequence's path in the trie has reached. It answers the tier questions
for this process's memory:

* :meth:`LocalTier.match` — how deep a prefix is cached (full blocks, verified token by token)
  and the deepest checkpoint that may seed this input; metadata only;
* :meth:`LocalTier.pin` / :meth:`LocalTier.unpin` — attach the shared blocks and pin the
  checkpoint for an admission (and undo it: the one rollback path);
* :meth:`LocalTier.extend` / :meth:`LocalTier.plan_checkpoint` — cache new full blocks of a
  running sequence and plan a checkpoint save at a save point;
* :meth:`LocalTier.release` — cache a leaving sequence's computed blocks.

Shared blocks are attached read-only: a sequence writes only blocks after its shared prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..paging.block_manager import BlockManager
from ..paging.prefill_plan import ReuseRules
from .block_trie import BlockTrie, TrieNode
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
        state_cache: the state slots (hybrid models), or None for full-attention-only models.
    """

    def __init__(self, block_manager: BlockManager, block_size: int, state_cache: StateCache | None):
        self.block_manager = block_manager
        self.block_size = block_size
        self.state_cache = state_cache
        self.trie = BlockTrie(block_manager, block_size, state_cache)
        self.pins = CheckpointPins(state_cache)     # (never takes a pin without a state cache)
        self._paths: dict[int, _Path] = {}

    @property
    def is_hybrid(self) -> bool:
        """The tier has a state cache (the model has linear-attention layers)."""
        return self.state_cache is not None

    # admission ---------------------------------------------------------------------------
    def match(self, seq, hashes: list[bytes], rules: ReuseRules) -> PrefixMatch:
        """The longest verified prefix of full blocks and the deepest restorable checkpoint on it.

        Hybrid models restore at a node whose checkpoint boundary is restorable for ``rules``;
        full-attention models reuse any matched full block, leaving at least one token to compute.
        """
        B, n = self.block_size, seq.num_tokens
        nodes = self.trie.match(seq.token_ids, hashes)
        matched = min(len(nodes), (n - 1) // B) * B
        if not self.is_hybrid:
            return PrefixMatch(nodes, matched, 'local' if matched else None, None, matched // B, matched)
        for node in reversed(nodes):
            b = node.depth * B
            if node.checkpoint_slot is not None and rules.restorable(b, len(nodes)):
                return PrefixMatch(nodes, b, 'local', node.checkpoint_slot, node.depth, matched)
        return PrefixMatch(nodes, 0, None, None, 0, matched)

    def pin(self, match: PrefixMatch) -> None:
        """Reference the shared blocks and pin the checkpoint of ``match`` (so eviction can take
        neither while the admission allocates); the pin's lease is ``match.lease``, handed on to
        the restore by :meth:`PrefixCache.plan_load`."""
        for node in match.nodes[:match.num_shared_blocks]:
            self.block_manager.incref(node.block_id)
        if match.checkpoint_slot is not None:
            match.lease = self.pins.take(match.checkpoint_slot, 'restore_source')
            self.state_cache.touch(match.checkpoint_slot)

    def unpin(self, match: PrefixMatch) -> None:
        """Undo :meth:`pin` (an admission that did not commit)."""
        for node in match.nodes[:match.num_shared_blocks]:
            self.block_manager.decref(node.block_id)
        if match.lease is not None:
            match.lease.release()
            match.lease = None

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

    def plan_checkpoint(self, seq, node: TrieNode | None, boundary: int, taken: set) -> CheckpointSave | str:
        """Plan the save of ``seq``'s state after ``boundary`` tokens on ``node``.

        Returns:
            A :class:`CheckpointSave` (its slot allocated and pinned), or the reason it is
            skipped: ``'hash_collision'`` (no node), ``'exists'`` (the node has a checkpoint, or
            another save of this step targets it), ``'no_free_slot'``.
        """
        if node is None:
            return 'hash_collision'
        if node.checkpoint_slot is not None or id(node) in taken:
            if node.checkpoint_slot is not None:
                self.state_cache.touch(node.checkpoint_slot)
            return 'exists'
        dst = self.state_cache.alloc_checkpoint()
        if dst is None:
            return 'no_free_slot'
        return CheckpointSave(seq, seq.state_slot, dst, node, boundary, self.pins.take(dst, 'save_target', seq.seq_id))

    def checkpoint_done(self, save: CheckpointSave, copied: bool) -> None:
        """Publish a planned checkpoint whose copy ran; release it unpublished if it did not (or
        its node has a checkpoint already / left the trie)."""
        save.lease.release()
        if not (copied and self.state_cache.publish(save.dst, save.node)):
            self.state_cache.release_checkpoint(save.dst)

    def cache_restored(self, seq, hashes: list[bytes], boundary: int) -> tuple[TrieNode, PinLease] | None:
        """Keep a Store restore locally: insert its blocks and reserve a pinned checkpoint slot
        for the restored state; returns ``(node, lease)`` (``lease.slot``: the slot to copy into
        and publish), or None."""
        nodes = self.trie.insert(seq.token_ids, seq.block_ids, boundary // self.block_size, hashes)
        if len(nodes) != boundary // self.block_size or nodes[-1].checkpoint_slot is not None:
            return None
        dst = self.state_cache.alloc_checkpoint()
        if dst is None:
            return None
        return nodes[-1], self.pins.take(dst, 'store_keep', seq.seq_id)

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
    def num_evictable_blocks(self) -> int:
        """Blocks :meth:`evict` can free now (exact)."""
        return self.trie.num_evictable_blocks

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` cached blocks no sequence references; returns how many."""
        return self.trie.evict(num_blocks)
