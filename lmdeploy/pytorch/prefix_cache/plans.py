"""What the prefix cache decides, as plain values the engine executes.

The scheduler and the tiers only *plan*: which blocks a sequence shares, which checkpoint or
Store prefix it restores, which states are saved where. The engine executes the plans (tensor
copies, Store gets and puts) in :meth:`~lmdeploy.pytorch.engine.engine.Engine.step`, so every
copy and every network operation is visible in one place, and a fake tier can record plans in
scheduler tests without tensors or a Store.

Lifecycle of one admission and one save::

    PrefixMatch ──pin──▶ (allocate) ──commit──▶ CheckpointRestore | StoreLoad   (before the forward)
    chunk end b is a save point ──▶ CheckpointSave + StorePut                    (after the forward)
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ['PrefixMatch', 'CheckpointRestore', 'StoreLoad', 'LoadPlan', 'CheckpointSave', 'StateSnapshot', 'StorePut',
           'HandoffPut', 'SavePlan']


@dataclass
class PrefixMatch:
    """What the cache tiers hold for one sequence now (metadata only; nothing pinned yet).

    Attributes:
        nodes: verified local trie nodes of the longest cached prefix of full blocks.
        cached_tokens: tokens the admission starts from (0: cold).
        source: ``'local'``, ``'store'`` or None (cold).
        checkpoint_slot: the local checkpoint restored (``source == 'local'`` on a hybrid model).
        num_shared_blocks: leading ``nodes`` whose blocks the sequence attaches read-only.
        matched_tokens: tokens whose full-attention blocks are cached locally (capped so one
            token is left to compute); ``matched_tokens - cached_tokens`` lacked a checkpoint.
        lease: the pin on ``checkpoint_slot`` once the admission pinned it (a
            :class:`~.pins.PinLease`), handed on to the :class:`CheckpointRestore`.
        first_block: leading blocks the restore does not need (out of every sliding window
            after ``cached_tokens``: :func:`~lmdeploy.pytorch.cache_specs.window_first_block`);
            neither attached nor loaded, the sequence's table holds ``FREED_BLOCK`` there.
        window_first: the first block of the window group's table a local restore attaches
            (a mixed model with window rows: the window of ``cached_tokens``); the entries before
            it are ``FREED_BLOCK``.
        window_blocks: the window-pool blocks of blocks ``[window_first, cached_tokens / B)`` the
            restore attaches read-only (pinned with the match); empty without window rows.
    """
    nodes: list = field(default_factory=list)
    cached_tokens: int = 0
    source: str | None = None
    checkpoint_slot: int | None = None
    num_shared_blocks: int = 0
    matched_tokens: int = 0
    lease: object = None
    first_block: int = 0
    window_first: int = 0
    window_blocks: list = field(default_factory=list)


@dataclass
class CheckpointRestore:
    """Copy checkpoint slot ``src`` into the runtime slot ``dst`` of ``seq`` (before its forward);
    ``lease`` pins ``src`` until the copy ran."""
    seq: object
    src: int
    dst: int
    lease: object = None


@dataclass
class StoreLoad:
    """Load prefix ``[0, boundary)`` of ``seq`` from the Store: KV objects of blocks
    ``[first_block, boundary / B)`` into ``block_ids[first_block:]`` and the state object into
    runtime slot ``slot``. ``hashes`` are the chained hashes of the prefix's blocks;
    ``matched_tokens`` is the admission's local match (for the hit counters). With ``handoff``
    (the hash of a hand-off object, :mod:`~lmdeploy.pytorch.paging.handoff`), ``boundary`` is
    unaligned: KV objects cover blocks below ``floor_B(boundary)``, and the hand-off object
    holds the partial block at ``floor_B(boundary)`` and the state. ``window_block_ids``: the
    sequence's window-group table (a Store with window objects writes the window rows of the
    boundary's window into it), or None."""
    seq: object
    boundary: int
    hashes: list[bytes]
    block_ids: list[int]
    first_block: int
    slot: int
    matched_tokens: int = 0
    handoff: bytes | None = None     # a prefill engine's hand-off object (unaligned boundary): its hash
    window_block_ids: list[int] | None = None


@dataclass
class LoadPlan:
    """The restores one step runs before its forward: from device checkpoints, from the host
    tier (:class:`StoreLoad` values read from host memory), and from the Store."""
    restores: list[CheckpointRestore] = field(default_factory=list)
    store_loads: list[StoreLoad] = field(default_factory=list)
    host_loads: list[StoreLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.restores or self.store_loads or self.host_loads)


@dataclass
class CheckpointSave:
    """Copy runtime slot ``src`` into the (pinned, unpublished) checkpoint slot ``dst``, then
    publish it on trie ``node`` — the state of ``seq`` after exactly ``boundary`` tokens.
    ``lease`` pins ``dst`` until the copy ran; ``reason`` (why it is saved) and ``continuation``
    (the request continued a cached prefix) are what the eviction policy learns of it."""
    seq: object
    src: int
    dst: int
    node: object
    boundary: int
    lease: object = None
    reason: str = 'prefill'
    continuation: bool = False


@dataclass
class StateSnapshot:
    """Copy runtime slot ``src`` into ``seq``'s staging checkpoint slot ``dst``: the state after
    ``boundary`` tokens, a block boundary reached while decoding. The last one becomes the
    turn-end checkpoint when the request finishes (``decode_save_last``)."""
    seq: object
    src: int
    dst: int
    boundary: int


@dataclass
class StorePut:
    """Put prefix ``[0, boundary)``: the state in slot ``slot`` (runtime or checkpoint; None for a
    model without state: an empty state object) and the KV blocks ``block_ids`` (one per hash in
    ``hashes``) that the Store does not hold yet (with sliding windows, only those from
    :func:`~lmdeploy.pytorch.cache_specs.window_first_block` on: the Store tier picks them).
    ``window_block_ids``: the window-group table's entries of those blocks (a model whose window
    layers keep a pool of their own; the Store tier puts the rows of the boundary's window), or None."""
    hashes: list[bytes]
    block_ids: list[int]
    boundary: int
    slot: int | None
    window_block_ids: list[int] | None = None


@dataclass
class HandoffPut:
    """A prefill engine's hand-off at ``boundary`` = h tokens (unaligned): the KV blocks
    ``block_ids`` of the full blocks below h (one per hash in ``hashes``) that the Store does not
    hold yet, then one hand-off object (hash ``handoff_hash``) holding the partial block
    ``tail_block`` (tokens ``[floor_B(h), h)``; None when h is a multiple of B) and the state in
    ``slot``. ``handoff`` (a :class:`~lmdeploy.pytorch.paging.handoff.Handoff`) learns the outcome."""
    hashes: list[bytes]
    block_ids: list[int]
    boundary: int
    tail_block: int | None
    handoff_hash: bytes
    slot: int
    handoff: object


@dataclass
class SavePlan:
    """The saves one step runs after its forward (or when a request finishes)."""
    checkpoints: list[CheckpointSave] = field(default_factory=list)
    snapshots: list[StateSnapshot] = field(default_factory=list)
    store_puts: list[StorePut] = field(default_factory=list)
