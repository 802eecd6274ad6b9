"""KV cache events: what a KV-aware router may know about this engine's prefix cache.

A router that routes by prefix (vllm-router's ``kv_aware`` policy and others reading vLLM's KV
event stream) keeps, per engine, a tree of the block hashes the engine announced and scores a request
by how many of its leading blocks are in that tree. :class:`KVEventTracker` makes that tree equal
the prefixes this engine can actually restore::

    announced blocks = every block on the path from the root to a restorable prefix's end

* full-attention-only models reuse any cached full block: a block is announced when the trie
  caches it and withdrawn when eviction drops it;
* hybrid models restore only at a published state checkpoint: a block is announced when the
  first checkpoint at or below it is published (the whole not-yet-announced part of the path,
  in one ``BlockStored`` whose parent is the deepest block announced before), and withdrawn when
  the last checkpoint at or below it is released (evicted, or its node left the trie). A block
  cached without a checkpoint below it is never announced: its KV alone cannot seed a restore.

So every announced chain ends at a restorable boundary, and the router's matched length never
counts a block only attention layers could reuse. (It may still count blocks past the deepest
checkpoint *below* the request's own divergence point; the engine then restores at that
checkpoint, which is what the token counts of a prefix match always meant for a hybrid model.)

The tracker is fed by the prefix cache's listener hooks (``BlockTrie.listeners``:
``block_cached`` / ``block_dropped``; ``StateCache.listeners``: ``checkpoint_counted``, called
after a node's ``ckpts_below`` changed) and drained once per engine step (:meth:`take`).

Block hashes on the wire (:func:`external_hash`): the first 8 bytes of the trie's 16-byte
chained blake2b digest (:func:`~.block_trie.chain_block_hashes`), big-endian, top bit cleared —
a non-negative integer below 2**63 that signed and unsigned 64-bit decoders both accept. Salted
requests (``cache_salt``) hash differently, as in the trie.

Medium: the tier holding the blocks, in vLLM's names: ``"GPU"`` for this engine's own cache
memory (:data:`MEDIUM_DEVICE`, also on a CPU-only engine: it names the tier, not the chip) and
``"CPU"`` for the host tier (:data:`MEDIUM_HOST`, :class:`HostEventTracker`). The Store is shared
by every engine, so no engine announces its objects.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cache_specs import window_first_block
from .block_trie import root_path

__all__ = ['KVEventTracker', 'HostEventTracker', 'BlockStored', 'BlockRemoved', 'AllBlocksCleared', 'external_hash',
           'MEDIUM_DEVICE', 'MEDIUM_HOST']

MEDIUM_DEVICE = 'GPU'
MEDIUM_HOST = 'CPU'
_MASK63 = (1 << 63) - 1


def external_hash(key: bytes) -> int:
    """The wire hash of a trie key (a 16-byte digest): its first 8 bytes as a big-endian
    integer with the top bit cleared, in ``[0, 2**63)``."""
    return int.from_bytes(key[:8], 'big') & _MASK63


@dataclass
class BlockStored:
    """Blocks that became restorable: a chain in order from the root side, ``parent_block_hash``
    the block before the first (None: the chain starts at the root); ``token_ids`` all their
    tokens (``block_size`` per block)."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_DEVICE

    def to_wire(self) -> dict:
        """vLLM's tagged map (``type`` names the event; no adapters here: both LoRA fields None)."""
        return {'type': 'BlockStored', 'block_hashes': self.block_hashes, 'parent_block_hash': self.parent_block_hash,
                'token_ids': self.token_ids, 'block_size': self.block_size, 'lora_id': None, 'medium': self.medium,
                'lora_name': None}


@dataclass
class BlockRemoved:
    """Blocks no longer restorable."""
    block_hashes: list[int]
    medium: str = MEDIUM_DEVICE

    def to_wire(self) -> dict:
        """vLLM's tagged map."""
        return {'type': 'BlockRemoved', 'block_hashes': self.block_hashes, 'medium': self.medium}


@dataclass
class AllBlocksCleared:
    """Forget everything announced before (sent once when a publisher starts: a restarted
    engine's cache is empty)."""

    def to_wire(self) -> dict:
        """vLLM's tagged map."""
        return {'type': 'AllBlocksCleared'}


class KVEventTracker:
    """Turns prefix-cache changes into :class:`BlockStored` / :class:`BlockRemoved` events.

    Args:
        block_size: B, tokens per block.
        hybrid: the model restores only at checkpoints (announce on checkpoints, not blocks).
        medium: the tier name the events carry.
    """

    def __init__(self, block_size: int, hybrid: bool, medium: str = MEDIUM_DEVICE):
        self.block_size = block_size
        self.hybrid = hybrid
        self.medium = medium
        self._pending: list = []

    def attach(self, local_tier) -> 'KVEventTracker':
        """Listen to ``local_tier``'s trie and (hybrid models) its state cache; returns self."""
        local_tier.add_listener(self, checkpoints=self.hybrid)
        return self

    def take(self) -> list:
        """The events since the last call, in order (and forget them)."""
        events, self._pending = self._pending, []
        return events

    # trie hooks -----------------------------------------------------------------------------
    def block_cached(self, node) -> None:
        """The trie made a node for a new full block."""
        if not self.hybrid:
            self._stored([node], node.parent)

    def block_dropped(self, node) -> None:
        """The trie removed ``node`` (its checkpoint, if any, was released just before)."""
        if not self.hybrid:
            self._removed([node])

    # state cache hook -----------------------------------------------------------------------
    def checkpoint_counted(self, node, delta: int) -> None:
        """A checkpoint was published on (``delta=1``) or released from (``-1``) ``node``;
        ``ckpts_below`` along its path already counts it. The nodes whose count left or reached
        zero form one segment from ``node`` up: announce or withdraw exactly that segment."""
        segment, n = [], node
        target = 1 if delta > 0 else 0
        while n is not None and n.parent is not None and n.ckpts_below == target:
            segment.append(n)
            n = n.parent
        if not segment:
            return
        if delta > 0:
            segment.reverse()
            self._stored(segment, n)
        else:
            self._removed(segment)

    # events ---------------------------------------------------------------------------------
    def _stored(self, chain: list, parent) -> None:
        parent_hash = None if parent is None or parent.parent is None else external_hash(parent.key)
        hashes = [external_hash(n.key) for n in chain]
        tokens = [t for n in chain for t in n.tokens]
        last = self._pending[-1] if self._pending else None
        # a sequence caching its blocks one by one continues the previous event's chain
        if (isinstance(last, BlockStored) and parent_hash is not None and last.block_hashes
                and last.block_hashes[-1] == parent_hash):
            last.block_hashes.extend(hashes)
            last.token_ids.extend(tokens)
            return
        self._pending.append(BlockStored(hashes, parent_hash, tokens, self.block_size, self.medium))

    def _removed(self, nodes: list) -> None:
        hashes = [external_hash(n.key) for n in nodes]
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.extend(hashes)
            return
        self._pending.append(BlockRemoved(hashes, self.medium))


class HostEventTracker:
    """The host tier's events (medium :data:`MEDIUM_HOST`): a block is announced while it lies on
    the path of a checkpoint the host tier can restore on its own — the state and the KV of every
    block of its path held in host memory — and withdrawn when the last such checkpoint stops
    being one (its state or one of its path's blocks left the tier, least recently used first).

    A host restore may also use blocks the device still shares; such a prefix is announced only
    as far as the device tier announces it (``"GPU"``), so the host medium never claims a block
    the host tier does not hold.

    Fed by the host tier's listener hooks (``HostTier.listeners``): ``demoting(node)`` before a
    demotion puts the payloads of ``node``'s path, ``held(key)`` / ``dropped(key)`` when an entry
    (``('kv' | 'state' | 'window', 16-byte hash)``) enters or leaves the tier. With window rows (the
    host tier's ``window_rows``) a checkpoint is restorable from the tier only while the window
    entries of its window are held too.

    Args:
        block_size: B, tokens per block.
    """

    def __init__(self, block_size: int, medium: str = MEDIUM_HOST):
        self.block_size = block_size
        self.medium = medium
        self._sink = KVEventTracker(block_size, hybrid=True, medium=medium)
        self._held: set[tuple[str, bytes]] = set()
        self._block: dict[bytes, tuple[bytes | None, tuple]] = {}   # block key -> (parent key, tokens)
        self._paths: dict[bytes, list[bytes]] = {}       # state key -> block keys of its path, root first
        self._users: dict[bytes, set[bytes]] = {}        # block key -> state keys whose path holds it
        self._complete: set[bytes] = set()               # state keys restorable from the tier alone
        self._count: dict[bytes, int] = {}               # block key -> complete states whose path holds it
        self._window: int | None = None                  # the host tier's window rows (tokens), or None
        self._wfirst: dict[bytes, int] = {}              # state key -> first path index whose window entry it needs

    def attach(self, host_tier) -> 'HostEventTracker':
        """Listen to ``host_tier``; returns self."""
        host_tier.listeners.append(self)
        self._window = getattr(host_tier, 'window_rows', None)
        return self

    def take(self) -> list:
        """The events since the last call, in order (and forget them)."""
        return self._sink.take()

    # host tier hooks ------------------------------------------------------------------------
    def demoting(self, node) -> None:
        """The device is demoting the checkpoint on trie ``node``: remember its path's blocks."""
        path = root_path(node)
        keys = [n.key for n in path]
        for i, n in enumerate(path):
            self._block[n.key] = (keys[i - 1] if i else None, n.tokens)
            self._users.setdefault(n.key, set()).add(node.key)
        self._paths[node.key] = keys
        self._wfirst[node.key] = (window_first_block(len(keys) * self.block_size, self._window, self.block_size)
                                  if self._window else len(keys))

    def held(self, key: tuple[str, bytes]) -> None:
        """``key`` entered the tier."""
        self._held.add(key)
        kind, h = key
        for state in ([h] if kind == 'state' else list(self._users.get(h, ()))):
            self._update(state)

    def dropped(self, key: tuple[str, bytes]) -> None:
        """``key`` left the tier."""
        self._held.discard(key)
        kind, h = key
        for state in ([h] if kind == 'state' else list(self._users.get(h, ()))):
            self._update(state)
        if kind == 'state' and h in self._paths and h not in self._complete:
            self._wfirst.pop(h, None)
            for k in self._paths.pop(h):         # the tier no longer holds this checkpoint: forget it
                users = self._users.get(k)
                if users is not None:
                    users.discard(h)
                    if not users:
                        del self._users[k]
                        self._block.pop(k, None)

    # bookkeeping ----------------------------------------------------------------------------
    def _update(self, state: bytes) -> None:
        path = self._paths.get(state)
        if path is None:
            return
        now = (('state', state) in self._held and all(('kv', k) in self._held for k in path)
               and all(('window', k) in self._held for k in path[self._wfirst.get(state, len(path)):]))
        if now == (state in self._complete):
            return
        delta = 1 if now else -1
        (self._complete.add if now else self._complete.discard)(state)
        changed = []            # blocks whose count left or reached 0: a suffix of the path
        for k in path:
            c = self._count.get(k, 0) + delta
            if c:
                self._count[k] = c
            else:
                self._count.pop(k, None)
            if c == (1 if now else 0):
                changed.append(k)
        if not changed:
            return
        nodes = [_Block(k, self._block[k]) for k in changed]
        if now:
            parent = self._block[changed[0]][0]
            self._sink._stored(nodes, None if parent is None else _Block(parent, self._block[parent]))
        else:
            self._sink._removed(nodes[::-1])


class _Block:
    """A block as the event encoder reads a trie node (``key``, ``tokens``, ``parent``)."""
    __slots__ = ('key', 'tokens', 'parent')

    def __init__(self, key: bytes, info: tuple):
        self.key, self.tokens = key, info[1]
        self.parent = True      # not the root: the encoder names this block as a parent
