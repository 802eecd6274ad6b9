"""CUDA graphs for the decode step: capture a pure decode step's forward per batch-size bucket,
replay it with one ``cudaGraphLaunch`` instead of the model's Python and its hundreds of launches.

Shares its boundaries with the CPU decode graphs (:mod:`.decode_graph`): a step qualifies exactly
when :func:`~.decode_graph.decode_graph_key` gives it a key, and its static inputs are a
:class:`~.decode_graph.StaticDecodeInputs` on the CUDA device. What differs is the key and the
padding::

    key = (bucket, P)      bucket = the smallest of 1, 2, 4, 8, 16, 24, 32, ... (+8) >= B,
                           the last one the engine's max_batch_size or MAX_GRAPH_BATCH (256),
                           the smaller (a larger batch runs eagerly); P = the step carries
                           prompt_lens (an engine's always do; a batch built by hand may not)
    rows  0 .. B-1         the step's sequences, as they are
    rows  B .. bucket-1    padding: token 0 at position 0, kv_seqlen 1, block table
                           [scratch block, 0, ...], state slot = the scratch slot (-1 for a model
                           without state), has_history False

Why padding cannot change what a real row reads or writes: every op of a decode step is row-wise
except the cache accesses, and those only touch what a row's own block table and slot name. A padded row writes
its K/V at (scratch block, 0) and its attention reads only that position (kv_seqlen 1); its
recurrent and conv states are gathered from the scratch slot, zeroed (has_history False, a tensor
mask: see ``state_varlen._gathered_step``) and scattered back to it, so however many padded rows
write it and in whatever order, no real slot is written. The scratch block and slot are one KV
block and one state slot the engine allocates beyond what its block manager and state cache hand
out (``Engine``: ``scratch_rows``). MoE routing is per row (no capacity limit), so padded rows
only add expert rows. What padding can change is rounding: a GEMM over 4 rows may round a row
differently from one over 3 (cuBLAS and MKL pick their blocking by the row count), so a padded
bucket's logits equal the unpadded eager step's up to float32 rounding, an exact bucket's bit for
bit. ``tests/test_cuda_graph.py`` checks the property on the CPU for every family a CUDA graph
would cover: whatever the padding rows hold, the real rows' logits and every cache row but the
scratch ones are bit for bit the same, and within rounding of the unpadded step's.

Capture (the documented torch recipe): the static inputs are filled with an all-padding batch
(every row on the scratch block and slot, so the warm-up writes nothing a sequence owns), the
forward runs :data:`WARMUP_RUNS` times on a side stream (Triton compiles and autotunes there, and
modules build their lazy tensors), then once under ``torch.cuda.graph(g, pool=pool)``, one memory
pool shared by every graph. Each forward gets a fresh
:class:`~lmdeploy.pytorch.model_inputs.StepContext` from the static inputs, so index tensors a
kernel memoises per step are computed inside the capture, not baked from the warm-up.

**Refusal** (the key runs eagerly for good): the forward read one of the context's per-step
Python lists (``kv_seqlens``, ``block_tables``, ``state_slots``, ``prompt_lens``: a value baked
into the graph would be stale on the next step; one INFO line), or the capture raised (e.g. an op
that synchronises with the host, such as ``.item()``, ``.tolist()`` or ``torch.bincount`` on a
CUDA tensor, which stream capture forbids; one WARNING line). A refused key never gives a wrong
result: the capture ran on scratch rows only, and the real step then runs eagerly.

**Replay**: fill the static inputs from the padded batch (two host-to-device copies plus one per
block-table row that changed), set ``has_history`` (real rows True, padding False), ``g.replay()``;
the output is the graph's ``hidden [bucket, hidden_size]``, of which rows ``:B`` are returned.

**Memory**: the graphs' activations live in the shared pool (the largest bucket's forward
dominates, the others reuse its freed blocks); :meth:`CudaGraphCache.counters` reports the pool
bytes reserved by captures (the device allocator's reserved bytes across each capture) and the
static inputs. At most :data:`MAX_CUDA_GRAPHS` graphs are kept (least recently used dropped).

What reads the step's data on the host in a CUDA decode forward (found by reading
``kernels/*`` and ``models/*`` for ``.item()``, ``.tolist()``, ``int(`` and per-sequence lists):

- ``kernels/moe.py`` ``moe_experts_sorted`` (every MoE family on CUDA): ``torch.bincount``, which
  reads the largest index back; now counted by ``index_add_`` (the same integers), so it captures.
- Nemotron-3's relu² experts and the limited experts of Ling 3 / GLM-5.3-Flash (``kernels/moe.py``:
  the per-expert loop's ``bincount().tolist()``): on CUDA a bucket of at most ``2E / k`` rows runs
  their gathered form instead (``gathered_applies``: nothing read on the host), so it captures; a
  larger bucket runs the loop, the capture raises, the bucket runs eagerly.
- sliding-window attention reading the global table (``kernels/window_attention.py``:
  ``max(ctx.kv_seqlens)``), Inkling's attention (``max(ctx.kv_seqlens)``): per-step list reads,
  refused. GLM-5's DSA layers read none in a decode step (``kernels/dsa_decode.py``: lengths and
  block tables as tensors, a fixed-shape torch form on CUDA); their prefill chunks still slice per
  sequence.
- ``kernels/state_varlen.py`` reads ``cu_seqlens`` / ``has_history`` on the host only for prefill
  chunks; a decode step masks with ``has_history`` as a tensor. ``model_inputs.slot_range`` reads
  nothing from a device tensor (CUDA always gathers states by ``slots``). The Triton paged decode
  attention's grid is ``(B, heads)`` and it reads each row's length inside the kernel.

Nothing here needs a GPU to import or to test: the capture boundary is behind
:class:`CudaBackend`, which the CPU tests replace by a stand-in whose "replay" re-runs the
forward on the static inputs.

Status: written and tested on the CPU only; not yet validated on a GPU
(``scripts/gpu_check.sh`` runs the GPU tests, ``tests/test_cuda.py``).
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from ..model_inputs import StepBatch
from .decode_graph import StaticDecodeInputs, decode_graph_key
from .graph_cache import GraphCache

__all__ = ['CudaGraphCache', 'CudaBackend', 'batch_buckets', 'bucket_for', 'cuda_graph_key', 'decode_graphs_kind',
           'pad_batch', 'MAX_CUDA_GRAPHS', 'MAX_GRAPH_BATCH', 'WARMUP_RUNS']

logger = logging.getLogger('lmdeploy')

# the largest batch a graph runs: a bigger decode step runs eagerly (its launches are amortised
# over as many rows), so the buckets (1, 2, 4, 8 and every multiple of 8 up to 256: 35) stay
# within MAX_CUDA_GRAPHS and a server never recaptures a bucket for the bound
MAX_GRAPH_BATCH = 256
MAX_CUDA_GRAPHS = 40
# eager forwards on the side stream before a capture: the first compiles and autotunes the Triton
# kernels and builds lazy module tensors, the second runs the steady state the capture records
WARMUP_RUNS = 2


def decode_graphs_kind(device: torch.device, config) -> str | None:
    """Which decode graphs an engine on ``device`` with ``config`` (a ``PytorchEngineConfig``)
    runs: ``'cpu'`` (:mod:`.decode_graph`), ``'cuda'`` (this module) or None (every forward eager:
    ``eager_mode``, tp > 1, speculative decoding, another device)."""
    if config.eager_mode or config.tp != 1 or config.speculative_config is not None:
        return None
    return device.type if device.type in ('cpu', 'cuda') else None


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, below
    ``max_batch``, and ``max_batch`` itself, ``max_batch`` at most :data:`MAX_GRAPH_BATCH`.

    Raises:
        ValueError: ``max_batch < 1``.
    """
    if max_batch < 1:
        raise ValueError(f'max_batch must be >= 1; got {max_batch}')
    max_batch = min(max_batch, MAX_GRAPH_BATCH)
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 8)) + [max_batch]


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket ``>= batch_size`` (``buckets`` sorted), or None when none is."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


def cuda_graph_key(batch: StepBatch, buckets: list[int]) -> tuple[int, bool] | None:
    """``(bucket, whether the step carries prompt_lens)`` for a step
    :func:`~.decode_graph.decode_graph_key` accepts (a pure decode step: one token per sequence,
    each with history, no images, no extra logits, no window tables) whose batch fits a bucket;
    else None. The slots do not enter the key: a CUDA step always gathers and scatters its states
    through the static ``slots`` tensor. Whether ``prompt_lens`` is empty does: the capture runs
    on a batch of padding rows, and a forward may branch on that in Python
    (``StepContext.prompt_token_mask``) without reading a value, which refuses nothing; the
    capture's batch carries them exactly when the step does, so the branch taken is the step's."""
    if decode_graph_key(batch) is None:
        return None
    bucket = bucket_for(len(batch.q_seqlens), buckets)
    return None if bucket is None else (bucket, bool(batch.prompt_lens))


def pad_batch(batch: StepBatch, bucket: int, scratch_slot: int | None, scratch_block: int) -> StepBatch:
    """``batch`` (a pure decode step of ``B`` sequences) with ``bucket - B`` padding rows appended:
    token 0 at position 0, ``kv_seqlen`` 1 (no history), block table ``[scratch_block]``, state slot
    ``scratch_slot`` (``-1`` when None: a model without state) and every row sampled.

    Raises:
        ValueError: ``bucket`` smaller than the batch.
    """
    B = len(batch.q_seqlens)
    n = bucket - B
    if n < 0:
        raise ValueError(f'bucket {bucket} is smaller than the batch ({B} sequences)')
    slot = -1 if scratch_slot is None else scratch_slot
    return StepBatch(input_ids=list(batch.input_ids) + [0] * n, positions=list(batch.positions) + [0] * n,
                     q_seqlens=[1] * bucket, q_start_loc=list(range(bucket)),
                     kv_seqlens=list(batch.kv_seqlens) + [1] * n,
                     block_tables=[list(t) for t in batch.block_tables] + [[scratch_block]] * n,
                     state_slots=list(batch.state_slots) + [slot] * n, sample_rows=list(range(bucket)),
                     prompt_lens=list(batch.prompt_lens) + [1] * n if batch.prompt_lens else [])


class CudaBackend:
    """The capture boundary on a CUDA device: new graphs, one shared pool, warm-up on a side
    stream, capture, the allocator's reserved bytes. (Tests substitute a CPU stand-in.)"""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = None

    def new_graph(self):
        """A fresh ``torch.cuda.CUDAGraph``."""
        return torch.cuda.CUDAGraph()

    def pool(self):
        """The memory pool every graph of this cache captures into (made on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def warmup(self, fn: Callable[[], object], runs: int) -> None:
        """Run ``fn`` ``runs`` times on a side stream, ordered after and before the current one
        (torch's recipe: a capture must not be the first run of its kernels)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, graph, fn: Callable[[], object]):
        """``fn()`` captured into ``graph`` (nothing runs); returns its output tensors, which the
        replays overwrite."""
        # thread_local: only this thread's unsafe CUDA calls abort the capture; the engine's other
        # threads (Store and host-tier copies on their own streams) carry on during it
        stream = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool(), capture_error_mode='thread_local'):
                return fn()
        finally:
            # torch.cuda.graph leaves its capture stream current when ending the capture raises;
            # the eager step that follows a failed capture must run where the engine's others do
            torch.cuda.set_stream(stream)

    def reserved_bytes(self) -> int:
        """Bytes the device allocator holds (pools included)."""
        return torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        """Wait for the device (after a failed capture, so an asynchronous error surfaces there)."""
        torch.cuda.synchronize(self.device)


class _Refusal(Exception):
    """Raised inside the cache only: why a key is not captured."""


class _CudaGraph:
    """One bucket's static inputs, graph and output; ``state`` ``'ready'`` or ``'refused'``."""

    def __init__(self, inputs: StaticDecodeInputs):
        self.inputs = inputs
        self.graph = None
        self.output: torch.Tensor | None = None
        self.state = 'refused'
        self.pool_bytes = 0

    def held_bytes(self) -> int:
        """Bytes the graph adds: the pool bytes its capture reserved and its static inputs."""
        return self.pool_bytes + sum(t.untyped_storage().nbytes() for t in self.inputs.tensors().values())


class CudaGraphCache(GraphCache):
    """A worker's CUDA decode graphs, one per :func:`cuda_graph_key`, least recently used dropped
    beyond ``max_graphs``.

    Args:
        model: the worker's model.
        max_blocks: the most KV blocks one sequence can hold (the static block table's width).
        max_batch: the engine's ``max_batch_size`` (the largest bucket).
        scratch_slot: a state slot no sequence is given (padding rows' states), or None for a
            model without state.
        scratch_block: a KV block no sequence is given (padding rows' K/V).
        device: the worker's CUDA device (where the static inputs live).
        max_graphs: graphs kept (refused keys count too, so they stay refused).
        backend: the capture boundary (default :class:`CudaBackend` on ``device``).

    Attributes:
        captures: keys captured (ready or refused).
        replays: steps run by replay.
        refusals: keys refused (they run eagerly from then on).
        evictions: graphs dropped for the bound.
    """

    def __init__(self, model: torch.nn.Module, max_blocks: int, max_batch: int, scratch_slot: int | None,
                 scratch_block: int, device: torch.device, max_graphs: int = MAX_CUDA_GRAPHS,
                 backend: CudaBackend | None = None):
        super().__init__(max_graphs)
        self.model, self.max_blocks, self.device = model, max_blocks, device
        self.buckets = batch_buckets(max_batch)
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.backend = backend if backend is not None else CudaBackend(device)

    def counters(self) -> dict[str, int]:
        """``{'captures', 'replays', 'refusals', 'evictions', 'graphs', 'bytes'}`` (``bytes``: what
        the kept graphs hold, :meth:`_CudaGraph.held_bytes` summed)."""
        return dict(super().counters(), bytes=sum(g.held_bytes() for g in self.graphs.values()))

    def calls_per_replay(self) -> list[tuple[int, int]]:
        """``(native kernel calls, torch ops)`` a replay makes from Python, per ready graph: none
        (one graph launch), as :meth:`.decode_graph.DecodeGraphCache.calls_per_replay` counts them."""
        return [(0, 0) for g in self.graphs.values() if g.state == 'ready']

    def forward(self, batch: StepBatch, kv_caches, state_caches, block_size: int) -> torch.Tensor | None:
        """The model's ``hidden [B, hidden_size]`` for ``batch`` by replaying its bucket's graph
        (captured on first use), or None when the step must run eagerly (no key, a refused key,
        a block table wider than the graphs'). The returned tensor is a view of the graph's output:
        the next replay of the bucket overwrites it."""
        key = cuda_graph_key(batch, self.buckets)
        if key is None:
            return None
        self._bind_caches(kv_caches, state_caches)
        graph = self._graph_for(key, lambda: self._capture(key, kv_caches, state_caches, block_size))
        if graph.state != 'ready' or not graph.inputs.fits(batch):
            return None
        B = len(batch.q_seqlens)
        graph.inputs.fill(pad_batch(batch, key[0], self.scratch_slot, self.scratch_block))
        graph.inputs.has_history[:B] = True
        graph.inputs.has_history[B:] = False
        graph.graph.replay()
        self.replays += 1
        return graph.output[:B]

    def _capture(self, key: tuple[int, bool], kv_caches, state_caches, block_size: int) -> _CudaGraph:
        """Warm up and capture the forward of an all-padding batch of ``bucket`` rows (``key``, as
        :func:`cuda_graph_key`: with ``prompt_lens`` when the key says so); the graph is
        ``'refused'`` when the forward read a per-step list or anything raised."""
        bucket, with_prompt_lens = key
        self.captures += 1
        inputs = StaticDecodeInputs(bucket, self.max_blocks, block_size, self.device)
        graph = _CudaGraph(inputs)
        empty = StepBatch(input_ids=[], positions=[], q_seqlens=[], q_start_loc=[], kv_seqlens=[], block_tables=[],
                          state_slots=[])
        dummy = pad_batch(empty, bucket, self.scratch_slot, self.scratch_block)
        if with_prompt_lens:    # a padding row's prompt is its one token (pad_batch's value)
            dummy.prompt_lens = [1] * bucket
        reads: list[str] = []

        def run():
            # a fresh context per forward: nothing a kernel memoised in the warm-up is baked in
            return self.model(inputs.context(dummy, kv_caches, state_caches, None, True, reads.append))

        before = 0
        try:
            inputs.fill(dummy)
            inputs.has_history.fill_(False)
            self.backend.warmup(run, WARMUP_RUNS)
            if reads:
                raise _Refusal(reads[0])
            before = self.backend.reserved_bytes()     # after the warm-up: its activations are not the graph's
            cuda_graph = self.backend.new_graph()
            output = self.backend.capture(cuda_graph, run)
            if reads:
                raise _Refusal(reads[0])
            if not isinstance(output, torch.Tensor) or output.shape[0] != bucket:
                raise _Refusal('the forward returned no [bucket, hidden] tensor')
        except _Refusal as why:
            self.refusals += 1
            logger.info('CUDA decode graph for batch bucket %d refused (runs eagerly): %s', bucket, why)
            return graph
        except Exception as exc:    # noqa: BLE001 -- any capture failure: this bucket runs eagerly for good
            self.refusals += 1
            try:
                self.backend.synchronize()
            except Exception:       # noqa: BLE001 -- the error is already reported below
                pass
            logger.warning('CUDA decode graph capture for batch bucket %d failed; it runs eagerly: %s: %s',
                           bucket, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else '')
            return graph
        graph.graph, graph.output, graph.state = cuda_graph, output, 'ready'
        graph.pool_bytes = max(0, self.backend.reserved_bytes() - before)
        return graph
