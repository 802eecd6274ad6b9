"""Layer cache specs: what each decoder layer caches, declared as data.

A model declares a list of specs, one *cache entry* each; its modules address their caches by
entry index (``StepContext.kv_caches[i]`` / ``state_caches[i]``). Usually entry ``i`` is decoder
layer ``i``; a layer that keeps both per-token and per-sequence tensors (Falcon-H1: attention
and Mamba-2 side by side) declares two entries, one of each placement. A spec is a list of named
tensors and one placement:

- **paged** (``spec.paged``): each tensor is stored *per token*, in paged blocks of
  ``block_size`` tokens — full-attention K and V, an MLA latent, an indexer's keys. A tensor of
  per-token shape ``s`` is ``[num_blocks, block_size, *s]`` in the cache.
- **state** (not paged): each tensor is one fixed-size value *per sequence*, stored in state
  slots — a conv state, a delta-rule or SSM state. A tensor of shape ``s`` is
  ``[num_slots, *s]`` in the cache.

Each tensor also says how it splits under tensor parallelism (``tp_split``: which of the
rank's ranges — KV heads, conv channels, value heads — cuts its axis ``tp_axis``; ``None``:
every rank holds all of it, e.g. a latent shared by all heads).

The cache engine, the Store payload layout, checkpoint copies and the Store byte simulator
all read these specs and nothing else; :class:`CacheRowLayout` is the one place the bytes of a
block row and of a state row are laid out, so ``K_blk`` (:func:`kv_bytes_per_block`) and ``S``
(:func:`state_bytes_per_slot`) are computed once, here::

    KV block row   L0.k | L0.v | L3.k | L3.v | ...      (paged specs, in layer order)
    state row      L0.conv | L0.recurrent | L1.conv ...  (state specs, in layer order)

:class:`FullAttentionSpec` and :class:`LinearAttentionSpec` are the two kinds the Qwen3 /
Qwen3-Next / Qwen3.5 families use; a new kind is a :class:`PagedSpec` or :class:`StateSpec`
with its own tensors, declared in the model file. :class:`SlidingWindowSpec` is a full-attention
layer whose queries read only the last ``window`` positions: its bytes are the same, and
:func:`kv_window` tells the scheduler when every paged layer slides, so that a sequence may give
back the blocks no window reaches any more.

Block tables are per *paged group* (:func:`paged_groups`): the global layers (any paged kind
that is not a :class:`SlidingWindowSpec`) form one group, the sliding-window layers another,
each with its own pool of block rows and its own table per sequence (the engine splits them when
no prefix tier indexes the blocks and no draft rolls tokens back; otherwise one group holds every
paged layer). A window group's table gives back the blocks out of its window as the sequence
advances, so its memory is bounded by the window; the global group keeps every block::

    tokens        0 ............................................... n
    global table  |b0|b1|b2|b3|b4|b5|b6|b7|b8|b9|      every block
    window table  |--|--|--|--|--|--|--|w7|w8|w9|      FREED_BLOCK, then the last ceil(W/B)+1

The window rule of the prefix cache: a sequence resumed after ``b`` tokens reads, in a model
whose paged layers all slide with windows up to ``W``, only positions ``>= b - W + 1``, so only
the blocks from :func:`window_first_block` up to ``b / B`` must exist (locally or in the Store)
for ``b`` to be restorable; the blocks before it are neither restored nor put::

    block   0     1     2     3     4            (B = 16, W = 24, b = 80)
          |.....|.....|.....|#####|#####|b         first block = (80 - 24 + 1) // 16 = 3:
                               ^ 57 = b - W + 1      blocks 3 and 4 are needed, 0-2 are not
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ['CacheTensor', 'LayerCacheSpec', 'PagedSpec', 'StateSpec', 'FullAttentionSpec', 'LinearAttentionSpec',
           'SlidingWindowSpec', 'PagedGroup', 'paged_groups', 'kv_window', 'window_first_block', 'uses_store',
           'CacheRowLayout', 'kv_bytes_per_block',
           'state_bytes_per_slot',
           'has_state', 'dtype_nbytes']

_ALIGN = 16      # bytes: every row starts (and ends) on this boundary


def dtype_nbytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class CacheTensor:
    """One cached tensor of a layer.

    Attributes:
        name: what it holds (``'k'``, ``'v'``, ``'conv'``, ``'recurrent'``, ...).
        shape: per token (paged specs) or per sequence (state specs), this rank's sizes.
        dtype: storage dtype.
        tp_split: the tensor-parallel range family that cuts axis ``tp_axis`` of ``shape``
            (``'kv_heads'``, ``'conv_channels'``, ``'v_heads'``: see
            :meth:`~lmdeploy.pytorch.distributed.sharding.TPLayout.cache_ranges`), or None when
            every rank holds the whole tensor.
        tp_axis: the axis of ``shape`` that ``tp_split`` cuts.
    """
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_split: str | None = None
    tp_axis: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of one value (one token's, or one sequence's)."""
        return _numel(self.shape) * dtype_nbytes(self.dtype)


class LayerCacheSpec:
    """What one layer caches: :meth:`tensors`, all paged (per token) or all per sequence."""

    paged: bool

    def tensors(self) -> tuple[CacheTensor, ...]:
        raise NotImplementedError

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of this layer's paged tensors for ``block_size`` tokens (0 for a state spec)."""
        return block_size * sum(t.nbytes for t in self.tensors()) if self.paged else 0

    def bytes_per_slot(self) -> int:
        """Bytes of this layer's state for one sequence (0 for a paged spec)."""
        return 0 if self.paged else sum(t.nbytes for t in self.tensors())


@dataclass(frozen=True)
class _ListedSpec(LayerCacheSpec):
    """A layer of any kind that lists its tensors (``cached``)."""
    cached: tuple[CacheTensor, ...]

    def tensors(self) -> tuple[CacheTensor, ...]:
        return self.cached


@dataclass(frozen=True)
class PagedSpec(_ListedSpec):
    """A layer whose tensors are per token, in paged blocks (any kind: give its tensors)."""
    paged = True


@dataclass(frozen=True)
class StateSpec(_ListedSpec):
    """A layer whose tensors are one value per sequence, in state slots (any kind)."""
    paged = False


@dataclass(frozen=True)
class FullAttentionSpec(LayerCacheSpec):
    """A full-attention layer: K and V per token in paged blocks, ``[num_kv_heads, head_dim]``
    each per token, split by KV head under tensor parallelism.

    Attributes:
        num_kv_heads: key/value heads on this rank.
        head_dim: channels per head.
        dtype: storage dtype of K and V.
    """
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    paged = True

    def tensors(self) -> tuple[CacheTensor, ...]:
        shape = (self.num_kv_heads, self.head_dim)
        return CacheTensor('k', shape, self.dtype, 'kv_heads'), CacheTensor('v', shape, self.dtype, 'kv_heads')


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A sliding-window attention layer: K and V per token like :class:`FullAttentionSpec`, but a
    query at position ``p`` reads only positions ``p - window + 1 .. p``, so the K/V of positions
    before ``n - window`` is never read again once a sequence has ``n`` tokens.

    Attributes:
        window: keys per query, itself included (``sliding_window`` of the config), >= 1.
    """
    window: int = 0

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f'sliding_window must be >= 1, got {self.window}')


def kv_window(specs: Sequence[LayerCacheSpec]) -> int | None:
    """Tokens before a boundary whose K/V a resumed sequence reads: None when some paged layer
    reads all earlier tokens (full attention), else the largest sliding window (0 without paged
    layers)."""
    paged = [s for s in specs if s.paged]
    if any(not isinstance(s, SlidingWindowSpec) for s in paged):
        return None
    return max((s.window for s in paged), default=0)


@dataclass(frozen=True)
class PagedGroup:
    """Cache entries that share one block table per sequence and one pool of block rows.

    Attributes:
        entries: the cache-entry indices (into the model's spec list) of the group's layers.
        window: the group's sliding window in tokens (the largest of its layers': a block out of
            it is out of every one), or None when some layer of the group reads every earlier
            token (its table keeps every block).
    """
    entries: tuple[int, ...]
    window: int | None


def paged_groups(specs: Sequence[LayerCacheSpec], split: bool = True) -> list[PagedGroup]:
    """The model's paged entries grouped by block table, the group the prefix cache indexes
    first: with ``split``, the global layers (every paged spec that is not a
    :class:`SlidingWindowSpec`) then the sliding-window layers, each group present only when it
    has layers; without ``split``, one group of every paged entry whose window is
    :func:`kv_window` (None as soon as one layer is global). ``[]`` without paged layers."""
    paged = [i for i, s in enumerate(specs) if s.paged]
    if not paged:
        return []
    sliding = tuple(i for i in paged if isinstance(specs[i], SlidingWindowSpec))
    rest = tuple(i for i in paged if i not in sliding)
    if not split or not sliding or not rest:
        return [PagedGroup(tuple(paged), kv_window(specs))]
    return [PagedGroup(rest, None), PagedGroup(sliding, max(specs[i].window for i in sliding))]


def window_first_block(boundary: int, window: int | None, block_size: int) -> int:
    """Index of the first block a sequence resumed after ``boundary`` tokens reads: a query at
    position ``p >= boundary`` reads positions ``> p - window``, so block ``j`` is never read
    once ``(j + 1) * block_size <= boundary - window + 1``. 0 when ``window`` is None or 0
    (some paged layer reads every earlier token, or nothing is paged).

    Args:
        boundary: tokens computed (b), >= 0.
        window: :func:`kv_window` of the model (tokens), or None.
        block_size: B, tokens per block.
    """
    if not window:
        return 0
    return max(0, boundary - window + 1) // block_size


def uses_store(specs: Sequence[LayerCacheSpec]) -> bool:
    """Whether the Store tier serves the model: it keeps per-sequence state (hybrids), or some
    paged layer slides (its prefix objects then hold only the window's blocks, see
    :func:`window_first_block`). A model of global attention alone reuses prefixes locally only."""
    return has_state(specs) or any(isinstance(s, SlidingWindowSpec) for s in specs)


@dataclass(frozen=True)
class LinearAttentionSpec(LayerCacheSpec):
    """A Gated DeltaNet layer: a conv state and a delta-rule state per sequence.

    Attributes:
        conv_shape: causal conv1d state ``(conv_dim, kernel_size - 1)``; its channels are the
            q | k | v channels, split as the rank's conv1d weight rows.
        conv_dtype: dtype of the conv state (the activation dtype).
        recurrent_shape: delta-rule state ``(num_v_heads, k_head_dim, v_head_dim)``, split by
            value head.
        recurrent_dtype: dtype of the recurrent state (float32: it accumulates over the
            whole sequence, so low precision would drift).
    """
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent_shape: tuple[int, ...]
    recurrent_dtype: torch.dtype = torch.float32
    paged = False

    def tensors(self) -> tuple[CacheTensor, ...]:
        return (CacheTensor('conv', tuple(self.conv_shape), self.conv_dtype, 'conv_channels'),
                CacheTensor('recurrent', tuple(self.recurrent_shape), self.recurrent_dtype, 'v_heads'))


class CacheRowLayout:
    """Byte offsets of typed tensors packed into one row (a KV block row or a state slot row).

    Each tensor starts at a multiple of its element size; the row is padded to 16 bytes.
    ``payload_bytes`` (the row without its end padding) is what a Store object of the row
    holds: ``K_blk`` for a block row, ``S`` for a state row.

    Args:
        specs: the model's layer specs (this rank's).
        paged: lay out the paged tensors (a block row of ``block_size`` tokens) or the state
            tensors (a slot row).
        block_size: tokens per block (paged rows only).
        only: lay out only these cache entries (one paged group's row: :func:`paged_groups`);
            None: every entry of the placement.

    Attributes:
        entries: ``(layer index, CacheTensor, byte offset, row shape)`` in row order; the row
            shape is ``(block_size, *shape)`` for a paged tensor, ``shape`` for a state one.
    """

    def __init__(self, specs: Sequence[LayerCacheSpec], paged: bool, block_size: int = 0,
                 only: Sequence[int] | None = None):
        self.entries: list[tuple[int, CacheTensor, int, tuple[int, ...]]] = []
        self.payload_bytes = 0
        for i, spec in enumerate(specs):
            if spec.paged != paged or (only is not None and i not in only):
                continue
            for t in spec.tensors():
                shape = (block_size, *t.shape) if paged else tuple(t.shape)
                offset = _round_up(self.payload_bytes, dtype_nbytes(t.dtype))
                self.entries.append((i, t, offset, shape))
                self.payload_bytes = offset + _numel(shape) * dtype_nbytes(t.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, padding included (at least 16)."""
        return max(_round_up(self.payload_bytes, _ALIGN), _ALIGN)

    def views(self, buf: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
        """``{layer index: typed views}`` into ``buf`` (``[rows, row_bytes]`` uint8): each view
        is ``[rows, *row shape]`` of its tensor's dtype, in the spec's tensor order."""
        out: dict[int, list[torch.Tensor]] = {}
        for i, t, offset, shape in self.entries:
            nbytes = _numel(shape) * dtype_nbytes(t.dtype)
            out.setdefault(i, []).append(buf[:, offset:offset + nbytes].view(t.dtype).view(buf.shape[0], *shape))
        return {i: tuple(v) for i, v in out.items()}


def kv_bytes_per_block(specs: Sequence[LayerCacheSpec], block_size: int) -> int:
    """``K_blk``: payload bytes of one block over every paged layer (this rank)."""
    return CacheRowLayout(specs, True, block_size).payload_bytes


def state_bytes_per_slot(specs: Sequence[LayerCacheSpec]) -> int:
    """``S``: payload bytes of one sequence's state over every state layer (this rank)."""
    return CacheRowLayout(specs, False).payload_bytes


def has_state(specs: Sequence[LayerCacheSpec]) -> bool:
    """Some layer keeps a per-sequence state (a hybrid model: prefixes need state checkpoints)."""
    return any(not s.paged for s in specs)
