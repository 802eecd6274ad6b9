"""Store payloads of a tensor-parallel engine in the TP-independent (full-head) layout.

Each rank holds a head slice of every KV block and state slot. A Store object, however, is
written in the layout a single-process engine uses: the payload of a KV block or a state
snapshot covers *every* head, each rank's slice placed at its head range::

    KV block (per full-attention layer, K then V)   [B, KV heads, head_dim]
        rank r's slice → heads kv_heads(r)          (a replicated head: any holder, same bytes)
    state (per linear-attention layer)
        conv      [conv_dim, K-1]   rank r's q | k | v channels → its three channel ranges
        recurrent [Hv, dk, dv]      rank r's value heads → value heads v_heads(r)
    a tensor the spec does not split (e.g. a latent shared by every head): stored once

Which range cuts which axis is data of the cache spec (``CacheTensor.tp_split``), not code here.

So the keys and bytes do not depend on the TP size: a TP2 engine restores what a TP1 engine
saved and the reverse, and the objects dedupe across TP sizes (the namespace needs no TP
rank or size). The Store's byte count of a TP engine is therefore the sum over ranks of the
heads each rank owns (a replicated KV head is counted once), equal to the single-process
count.

Cost: rank 0 gathers every rank's slices before a put and scatters them after a get (over
the control channel); per-rank puts from every worker are not implemented.
"""
from __future__ import annotations

import torch

from ..cache_engine import CacheEngine
from ..cache_specs import has_state, kv_bytes_per_block, state_bytes_per_slot
from ..distributed.sharding import TPLayout

__all__ = ['StoreLayout']


class StoreLayout:
    """Converts between rank payloads and full-head payloads, from the cache specs alone: each
    cached tensor says which of a rank's ranges (:meth:`TPLayout.cache_ranges`) cut which axis
    (``CacheTensor.tp_split`` / ``tp_axis``); a tensor without a split is held whole by every
    rank (the same bytes) and stored once.

    Args:
        config: the full model config.
        size: the TP size.
        local_specs: one rank's layer specs (every rank's are equal: heads split evenly).
        full_specs: the single-process specs (the Store payload layout).
        block_size: tokens per block.

    Raises:
        ValueError: a rank's ranges of a tensor do not add up to the rank's size of its axis.
    """

    def __init__(self, config, size: int, local_specs, full_specs, block_size: int):
        self.layouts = [TPLayout(config, r, size) for r in range(size)]
        self.local_specs, self.full_specs, self.block_size = list(local_specs), list(full_specs), block_size
        self.config = config
        self.is_hybrid = has_state(self.full_specs)
        for layout in self.layouts:
            for spec in self.local_specs:
                for t in spec.tensors():
                    if t.tp_split is None:
                        continue
                    covered = sum(b - a for a, b in layout.cache_ranges(t.tp_split))
                    if covered != t.shape[t.tp_axis]:
                        raise ValueError(f'cache tensor {t.name!r}: rank {layout.rank} holds {t.shape[t.tp_axis]} '
                                         f'of axis {t.tp_axis}, its {t.tp_split} ranges cover {covered}')

    def _engines(self, rows: int, kv: bool):
        n_blocks, n_slots = (rows, 0) if kv else (0, rows)
        full = CacheEngine(self.full_specs, self.block_size, n_blocks, n_slots)
        ranks = [CacheEngine(self.local_specs, self.block_size, n_blocks, n_slots) for _ in self.layouts]
        return full, ranks

    def _pairs(self, full: CacheEngine, ranks: list[CacheEngine], kv: bool):
        """Yield ``(full view, rank view)`` pairs that hold the same elements."""
        for i, spec in enumerate(self.full_specs):
            if spec.paged != kv:
                continue
            full_views = full.kv_caches[i] if kv else full.state_caches[i]
            lead = 2 if kv else 1        # [rows, block_size, *shape] or [rows, *shape]
            for layout, eng in zip(self.layouts, ranks):
                rank_views = eng.kv_caches[i] if kv else eng.state_caches[i]
                for t, f, r in zip(spec.tensors(), full_views, rank_views):
                    if t.tp_split is None:
                        yield f, r
                        continue
                    axis, start = lead + t.tp_axis, 0
                    for a, b in layout.cache_ranges(t.tp_split):
                        yield f.narrow(axis, a, b - a), r.narrow(axis, start, b - a)
                        start += b - a

    def to_full(self, rank_payloads: list[torch.Tensor], kv: bool) -> torch.Tensor:
        """Rank payloads (``[n, bytes_r]`` uint8 per rank) → full-head payloads ``[n, bytes]``."""
        n = rank_payloads[0].shape[0]
        full, ranks = self._engines(n, kv)
        for eng, payload in zip(ranks, rank_payloads):
            buf = eng.kv_buf if kv else eng.state_buf
            size = eng.kv_block_bytes if kv else eng.state_bytes
            buf[:, :size].copy_(payload)
        for dst, src in self._pairs(full, ranks, kv):
            dst.copy_(src)
        size = full.kv_block_bytes if kv else full.state_bytes
        return (full.kv_buf if kv else full.state_buf)[:, :size].clone()

    def to_ranks(self, payload: torch.Tensor, kv: bool) -> list[torch.Tensor]:
        """Full-head payloads ``[n, bytes]`` → one ``[n, bytes_r]`` uint8 tensor per rank."""
        full, ranks = self._engines(payload.shape[0], kv)
        size = full.kv_block_bytes if kv else full.state_bytes
        (full.kv_buf if kv else full.state_buf)[:, :size].copy_(payload)
        for dst, src in self._pairs(full, ranks, kv):
            src.copy_(dst)
        out = []
        for eng in ranks:
            size = eng.kv_block_bytes if kv else eng.state_bytes
            out.append((eng.kv_buf if kv else eng.state_buf)[:, :size].clone())
        return out

    @property
    def kv_block_bytes(self) -> int:
        """K_blk of the full-head layout."""
        return kv_bytes_per_block(self.full_specs, self.block_size)

    @property
    def state_bytes(self) -> int:
        """S of the full-head layout."""
        return state_bytes_per_slot(self.full_specs)
