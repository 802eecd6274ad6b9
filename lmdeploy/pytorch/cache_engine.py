"""Cache engine: the memory behind KV blocks and recurrent-state slots, laid out from the
model's layer cache specs alone (no branch on the model type).

Two byte buffers, one row per block / per slot, with typed per-layer views into them::

    kv_buf    [num_blocks, block_row]  row = L0.k | L0.v | L3.k | L3.v ...  (paged specs)
    state_buf [num_slots,  slot_row]   row = L0.conv | L0.recurrent | L1.conv ... (state specs)

(the row layout is :class:`~lmdeploy.pytorch.cache_specs.CacheRowLayout`, the same one the Store
byte accounting uses).

A model of global and sliding-window layers whose window layers have their own block tables
(:func:`~lmdeploy.pytorch.cache_specs.paged_groups`, split) keeps those layers' rows in a third
buffer, of as many rows as their pool has blocks::

    kv_buf        [num_blocks,        global row]   row = L0.k | L0.v | L4.k | L4.v ...
    window_kv_buf [num_window_blocks, window row]   row = L1.k | L1.v | L2.k | L2.v ...

The Store and the host tier read and write both: a KV object (entry) is a ``kv_buf`` row (the
global layers' rows when split) and a window object a ``window_kv_buf`` row
(:meth:`CacheEngine.read_window_blocks`).

Because a block's (or a slot's) bytes for every layer sit in one row, one copy moves a whole
block or a whole recurrent state (all state layers at once): the checkpoint save and
restore op (:func:`~lmdeploy.pytorch.kernels.state_copy.copy_state_slots`) and the Store
payloads are plain row copies. Payload bytes exclude the row padding: a state payload is
``S = state_bytes`` and a KV payload ``K_blk = kv_block_bytes``.

With one memory budget a checkpoint lives in ``rows_per_state`` KV block rows instead of a
state row: a *state reference* is then either a state-buffer row (an ``int``) or the tuple of
block rows holding a checkpoint, and a save or restore copies the state row's bytes into or out
of those rows in order (the last one partly)::

    state_buf[slot] = | chunk 0 | chunk 1 | ... | chunk m-1 (partial) |
                          ▼          ▼                 ▼
    kv_buf rows       (r0)       (r1)      ...     (r_{m-1})
"""
from __future__ import annotations

from typing import Sequence

import torch

from .cache_specs import CacheRowLayout, LayerCacheSpec
from .kernels.state_copy import copy_state_slots

__all__ = ['CacheEngine', 'StateRef', 'rows_per_state']

StateRef = int | tuple    # a state-buffer row, or the KV block rows holding a checkpoint


def rows_per_state(state_row_bytes: int, block_row_bytes: int) -> int:
    """KV block rows one state row needs (``ceil(state / block)``); 0 without state.

    Raises:
        ValueError: the model has state but no KV block bytes (no full-attention layer), so
            checkpoints cannot live in block rows.
    """
    if state_row_bytes == 0:
        return 0
    if block_row_bytes == 0:
        raise ValueError('checkpoints in KV block rows need a model with full-attention layers')
    return -(-state_row_bytes // block_row_bytes)


class CacheEngine:
    """Allocates and addresses the KV blocks and state slots of one model.

    Args:
        specs: one :class:`LayerCacheSpec` per cache entry (usually one per decoder layer; a
            layer with both paged and state tensors declares two entries).
        block_size: tokens per block.
        num_blocks: KV blocks to allocate.
        num_slots: state slots (runtime + checkpoint) to allocate; 0 when no layer has state.
        device: where the buffers live.
        window_entries: the cache entries whose rows live in ``window_kv_buf`` (a mixed model's
            sliding-window group with tables of its own); empty: every paged entry is in ``kv_buf``.
        num_window_blocks: rows of ``window_kv_buf`` (the window group's pool).

    Attributes:
        kv_caches: per layer, the views of its paged tensors (``[num_blocks, block_size,
            *shape]`` each, in the spec's tensor order: ``(k, v)`` for full attention; for a
            window entry ``[num_window_blocks, ...]``), or None.
        state_caches: per layer, the views of its state tensors (``[num_slots, *shape]`` each:
            ``(conv, recurrent)`` for Gated DeltaNet), or None.
    """

    def __init__(self, specs: Sequence[LayerCacheSpec], block_size: int, num_blocks: int, num_slots: int,
                 device: torch.device | str = 'cpu', window_entries: Sequence[int] = (), num_window_blocks: int = 0):
        self.specs = list(specs)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        window_entries = tuple(window_entries)
        rest = [i for i in range(len(self.specs)) if i not in window_entries] if window_entries else None
        self._kv_layout = CacheRowLayout(self.specs, True, block_size, only=rest)
        self._state_layout = CacheRowLayout(self.specs, False)
        self.has_state = bool(self._state_layout.entries)
        self.num_slots = num_slots if self.has_state else 0
        # KV rows are written before they are read (attention reads only positions < kv_len), so
        # they need no zeroing; untouched pages then cost no resident memory on CPU.
        self.kv_buf = torch.empty(num_blocks, self._kv_layout.row_bytes, dtype=torch.uint8, device=self.device)
        self.state_buf = torch.zeros(self.num_slots, self._state_layout.row_bytes, dtype=torch.uint8,
                                     device=self.device)
        self.kv_caches = [None] * len(self.specs)
        self.state_caches = [None] * len(self.specs)
        for i, views in self._kv_layout.views(self.kv_buf).items():
            self.kv_caches[i] = views
        self.num_window_blocks = num_window_blocks if window_entries else 0
        self._window_layout = window_layout = CacheRowLayout(self.specs, True, block_size, only=window_entries)
        self.window_kv_buf = torch.empty(self.num_window_blocks, window_layout.row_bytes, dtype=torch.uint8,
                                         device=self.device)
        if window_entries:
            for i, views in window_layout.views(self.window_kv_buf).items():
                self.kv_caches[i] = views
        for i, views in self._state_layout.views(self.state_buf).items():
            self.state_caches[i] = views

    @staticmethod
    def bytes_per_block(specs: Sequence[LayerCacheSpec], block_size: int) -> int:
        """Bytes one KV block row takes (including alignment padding)."""
        return CacheRowLayout(specs, True, block_size).row_bytes

    @staticmethod
    def group_bytes_per_block(specs: Sequence[LayerCacheSpec], block_size: int, entries: Sequence[int]) -> int:
        """Bytes one block row of the paged group of cache ``entries`` takes (padding included)."""
        return CacheRowLayout(specs, True, block_size, only=tuple(entries)).row_bytes

    @staticmethod
    def row_bytes(specs: Sequence[LayerCacheSpec], block_size: int,
                  groups: Sequence[Sequence[int]] = ()) -> tuple[int, int, tuple[int, ...]]:
        """What one row of each cache takes, padding included (bytes): a state slot (0 without
        state), a KV block of every paged layer, and a block of each paged group in ``groups``
        (each given by its cache entries)."""
        slot = CacheRowLayout(specs, False)
        layouts = [CacheRowLayout(specs, True, block_size)]
        layouts += [CacheRowLayout(specs, True, block_size, only=tuple(g)) for g in groups]
        rows = [layout.row_bytes for layout in layouts]
        return slot.row_bytes if slot.entries else 0, rows[0], tuple(rows[1:])

    @staticmethod
    def bytes_per_slot(specs: Sequence[LayerCacheSpec]) -> int:
        """Bytes one state slot row takes (including alignment padding); 0 without state."""
        layout = CacheRowLayout(specs, False)
        return layout.row_bytes if layout.entries else 0

    @property
    def object_specs(self) -> list[LayerCacheSpec]:
        """The layer specs that describe a Store payload's layout (they join the Store namespace)."""
        return self.specs

    @property
    def kv_block_bytes(self) -> int:
        """K_blk: payload bytes of one KV block over all full-attention layers."""
        return self._kv_layout.payload_bytes

    @property
    def window_block_bytes(self) -> int:
        """K_win: payload bytes of one block row of the sliding-window group with a pool of its
        own (``window_kv_buf``); 0 without one."""
        return self._window_layout.payload_bytes if self.num_window_blocks else 0

    @property
    def state_bytes(self) -> int:
        """S: payload bytes of one recurrent-state snapshot over all linear-attention layers."""
        return self._state_layout.payload_bytes

    # state slots --------------------------------------------------------------------
    def copy_states(self, src: Sequence[StateRef], dst: Sequence[StateRef]) -> None:
        """Copy whole states ``src[i] → dst[i]`` for every linear-attention layer: state rows
        to state rows in one op, state rows to and from block-row checkpoints in one gather or
        scatter each (a checkpoint never copies to another checkpoint)."""
        if not src:
            return
        rows = [(s, d) for s, d in zip(src, dst) if isinstance(s, int) and isinstance(d, int)]
        saves = [(s, d) for s, d in zip(src, dst) if isinstance(s, int) and not isinstance(d, int)]
        loads = [(s, d) for s, d in zip(src, dst) if not isinstance(s, int) and isinstance(d, int)]
        if len(rows) + len(saves) + len(loads) != len(src):
            raise ValueError('a checkpoint in block rows copies only to or from a state row')
        if rows:
            idx = torch.tensor(list(zip(*rows)), dtype=torch.int64, device=self.device)
            copy_state_slots(self.state_buf, idx[0], idx[1])
        if saves:
            slots, blocks = zip(*saves)
            self._state_rows_to_blocks(list(slots), list(blocks))
        if loads:
            blocks, slots = zip(*loads)
            self._blocks_to_state_rows(list(blocks), list(slots))

    def _split(self, blocks) -> tuple[torch.Tensor, int, int]:
        """(block rows ``[n, m]`` on the device, full chunks, bytes of the last partial chunk)."""
        chunk = self.kv_buf.shape[1]
        full, rem = divmod(self.state_buf.shape[1], chunk)
        idx = torch.tensor([list(b) for b in blocks], dtype=torch.int64, device=self.device)
        if idx.shape[1] < full + (rem > 0):
            raise ValueError(f'a checkpoint needs {full + (rem > 0)} block rows, got {idx.shape[1]}')
        return idx, full, rem

    def _state_rows_to_blocks(self, slots: list[int], blocks: list) -> None:
        idx, full, rem = self._split(blocks)
        chunk = self.kv_buf.shape[1]
        data = self.state_buf[torch.tensor(slots, dtype=torch.int64, device=self.device)]
        if full:
            self.kv_buf[idx[:, :full].reshape(-1)] = data[:, :full * chunk].reshape(-1, chunk)
        if rem:
            self.kv_buf[idx[:, full], :rem] = data[:, full * chunk:]

    def _blocks_to_state_rows(self, blocks: list, slots: list[int]) -> None:
        idx, full, rem = self._split(blocks)
        chunk = self.kv_buf.shape[1]
        rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        n = len(slots)
        if full:
            self.state_buf[rows, :full * chunk] = self.kv_buf[idx[:, :full].reshape(-1)].reshape(n, full * chunk)
        if rem:
            self.state_buf[rows, full * chunk:] = self.kv_buf[idx[:, full], :rem]

    def read_state(self, slot: StateRef) -> torch.Tensor:
        """A CPU copy of the state payload at ``slot`` (a state row or a checkpoint's block
        rows), ``[S]`` uint8."""
        if isinstance(slot, int):
            return self.state_buf[slot, :self.state_bytes].to('cpu', copy=True)
        chunk = self.kv_buf.shape[1]
        idx = torch.tensor(list(slot), dtype=torch.int64, device=self.device)
        return self.kv_buf[idx].reshape(-1)[:self.state_bytes].to('cpu', copy=True) if chunk else \
            torch.empty(0, dtype=torch.uint8)

    def write_state(self, slot: int, payload: torch.Tensor) -> None:
        """Overwrite state row ``slot`` with a ``[S]`` uint8 payload."""
        self.state_buf[slot, :self.state_bytes].copy_(payload.to(self.device))

    # kv blocks ----------------------------------------------------------------------
    def read_kv_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """CPU copies of the blocks' payloads, ``[len(block_ids), K_blk]`` uint8."""
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return self.kv_buf[idx, :self.kv_block_bytes].to('cpu', copy=True)

    def write_kv_block(self, block_id: int, payload: torch.Tensor) -> None:
        """Overwrite block ``block_id`` with a ``[K_blk]`` uint8 payload."""
        self.kv_buf[block_id, :self.kv_block_bytes].copy_(payload.to(self.device))

    def read_window_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """CPU copies of window-pool blocks' payloads, ``[len(block_ids), K_win]`` uint8."""
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return self.window_kv_buf[idx, :self.window_block_bytes].to('cpu', copy=True)

    def write_window_block(self, block_id: int, payload: torch.Tensor) -> None:
        """Overwrite window-pool block ``block_id`` with a ``[K_win]`` uint8 payload."""
        self.window_kv_buf[block_id, :self.window_block_bytes].copy_(payload.to(self.device))
