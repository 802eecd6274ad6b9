"""Decode graphs on the CPU: record a decode step's forward once, replay it without Python.

Why: a batch-1 decode step of a small model spends a quarter of its time in Python around the
kernels (module calls, wrapper checks, ctypes argument conversion, ~140 ``torch.empty`` and a
few dozen small torch ops per step), not in them. The CUDA-graph idea applies on every device:
a decode step with the same batch layout runs the same kernels on the same buffers every time,
so the kernel sequence can be recorded once, over static input tensors, and replayed.

What a graph is::

    key = (B, first slot lo of a slot range | None, the range in order, torch threads)
    static inputs (owned, fixed addresses; filled in place each step from the StepBatch lists):
        input_ids [B]  positions [B]  kv_seqlens_t [B]  kv_positions [B]  slots [B]
        kv_write_index = (blocks [B], offsets [B])   block_table [B, Wmax]   (int64)
        order [B] (slots one range out of order: the permutation sorting them)
        cu_seqlens [B + 1]  seq_ids [B]  has_history [B]   (constant for the key)
    recording: the forward's native kernel calls (ctypes function, Python int/float arguments,
        pointers included) and torch compute ops (aten op, tensor arguments), in order; every
        tensor the recorded forward created is held, so its memory stays where it was
    output: the forward's ``hidden [B, hidden_size]`` (a tensor the recording writes)

``Wmax`` (the most blocks one sequence can hold) fixes the block table's row stride, so the
addresses and sizes a kernel receives never change between steps. The
:class:`~lmdeploy.pytorch.model_inputs.StepContext` a recorded forward reads has its cached index
properties pre-filled with the static tensors (a ``cached_property`` lives in the instance
``__dict__``), and its per-step Python lists (``kv_seqlens``, ``state_slots``, ``block_tables``,
``prompt_lens``) are :class:`_PerStepList`: reading one during a recording refuses the key, as a
value baked from it would be stale on the next step.

Recording is an ordinary eager forward (its result is the step's result) under two hooks: a
proxy in place of the native library (:data:`~lmdeploy.pytorch.kernels.cpu_native._LIB`, through
which every native kernel is called) and a ``TorchDispatchMode`` that sees each aten op. A key
is **refused** for good (eager forwards from then on, one DEBUG line naming the reason) when its
forward does something a replay cannot repeat: a tensor made from Python data (``lift_fresh``),
tensor data read into Python (``_local_scalar_dense``, ``is_nonzero``, ``equal``, ``tolist``),
a random op, an op whose output shape depends on data, a collective, a tensor argument that is
neither persistent (parameters, buffers, caches, module tensors), nor made by the recording,
nor a static input, or a native pointer into memory none of those own. A refusal never stops
the forward: the recorded step still completes eagerly, so its result stays exact.

**Stability check**: a key is recorded on two decode steps (both real steps) and the two
recordings are compared with every tensor and pointer written as (which tensor: persistent
index, static input or the n-th tensor the recording made; offset, shape, strides): any
difference (e.g. a Python int derived from the step's lengths baked into an argument) refuses
the key. A key's first step runs eagerly without hooks, so that module tensors a layer builds
lazily on its first decode step exist before the recordings; replay starts with its fourth.

**Replay**: fill the static inputs, then run the entries in order: native calls with their
recorded arguments (an ``int`` result must equal the recorded one, else the kernel refused
the data and :class:`ValueError` is raised, as its wrapper would), in-place torch ops as
recorded, out-of-place ones into their recorded outputs (the op's ``.out`` overload, else a
copy); views and ``empty`` need nothing. The logits and sampling stay outside the graph.

Graphs are CPU only (tp=1, pure decode steps, no images or window tables): a CUDA device keeps
its eager forwards. :class:`StaticDecodeInputs` holds nothing CPU-specific, so a CUDA-graph
capture can later take the same static context.
"""
from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..kernels import cpu_native
from ..model_inputs import StepBatch, StepContext
from .graph_cache import GraphCache

__all__ = ['DecodeGraphCache', 'StaticDecodeInputs', 'decode_graph_key', 'MAX_GRAPHS']

logger = logging.getLogger('lmdeploy')

# graphs kept per worker (least recently used dropped): one per batch size and slot layout a
# server meets (the state slots' first row is part of the key, as the state kernels address it)
MAX_GRAPHS = 16

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_aten = torch.ops.aten
# ops that read tensor data into Python or make a tensor from Python data: a replay cannot redo them
_READS_DATA = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
               _aten.lift_fresh.default, _aten.lift_fresh_copy.default, _aten.lift.default,
               _aten.resolve_conj.default, _aten.resolve_neg.default, _aten.item.default}
# outputs with undefined contents: nothing to redo
_UNINITIALISED = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                  _aten.new_empty.default, _aten.new_empty_strided.default}
_REFUSED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
# advanced indexing is tagged with a data-dependent shape for its boolean masks; integer indices
# give a shape known from theirs
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}


def _refused_op(func, args) -> bool:
    """Whether a replay cannot repeat ``func`` on ``args``."""
    if func in _READS_DATA:
        return True
    if func in _INDEXING:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return any(tag in func.tags for tag in _REFUSED_TAGS)


class _Refusal(Exception):
    """Raised inside the graph cache only (never out of it): why a key cannot be replayed."""


def decode_graph_key(batch: StepBatch) -> tuple | None:
    """The graph key of a step, or ``None`` when no graph may run it.

    A step qualifies when it is a pure decode step (one new token per sequence, each with a
    non-empty history), holds no images, wants no logits beyond the sampled ones and has no
    sliding-window tables of its own. Its state slots may be anything: ``lo .. lo + B - 1`` in
    order (the state kernels update that slice of the caches in place), that range out of order
    (the same, through the permutation :attr:`StaticDecodeInputs.order` sorting them), or no
    range (gathered and scattered back), as :func:`~lmdeploy.pytorch.model_inputs.slot_range`
    says; each is a graph of its own.

    Returns:
        ``(B, lo, in_order, torch threads)`` (``lo`` None and ``in_order`` True when the slots are
        no range), or ``None``.
    """
    B = len(batch.q_seqlens)
    if (not B or batch.images is not None or batch.all_logits or batch.prompt_rows or batch.window_block_tables
            or any(q != 1 for q in batch.q_seqlens) or any(kv < 2 for kv in batch.kv_seqlens)
            or batch.sample_rows != list(range(B))):
        return None
    slots = batch.state_slots
    lo = min(slots)
    if slots == list(range(lo, lo + B)):
        return B, lo, True, torch.get_num_threads()
    if sorted(slots) == list(range(lo, lo + B)):
        return B, lo, False, torch.get_num_threads()
    return B, None, True, torch.get_num_threads()


class _PerStepList(list):
    """A per-step list of a recorded step's context (its values are this step's): reading an
    element during a recording refuses the key (``len`` is the batch size, part of the key)."""

    def __init__(self, values, on_read):
        super().__init__(values)
        self._on_read = on_read

    def _read(self):
        self._on_read(f'the forward read StepContext.{self._name} in Python')

    def __iter__(self):
        self._read()
        return super().__iter__()

    def __getitem__(self, i):
        self._read()
        return super().__getitem__(i)

    def named(self, name: str) -> '_PerStepList':
        self._name = name
        return self


class StaticDecodeInputs:
    """The static input tensors of one decode graph (batch ``B``), filled in place each step.

    Args:
        batch_size: ``B``, sequences per step.
        max_blocks: ``Wmax``, the most KV blocks one sequence can hold (``ceil(session_len /
            block_size)``): the width of :attr:`block_table`.
        block_size: tokens per KV block.
        device: where the tensors live.

    Attributes:
        ids: int64 ``[8, B]``, one buffer whose rows are ``input_ids``, ``positions``,
            ``kv_seqlens_t``, ``kv_positions``, ``slots``, ``blocks`` and ``offsets`` (the K/V
            write index: block id and offset in it) and ``order`` (the permutation sorting the
            slots); one copy fills them all.
        block_table: int64 ``[B, Wmax]``; entries past a sequence's blocks are 0 (never read:
            every kernel masks positions ``>= kv_seqlen``).
        cu_seqlens, seq_ids, has_history: ``arange(B + 1)``, ``arange(B)``, all ``True``.
    """

    def __init__(self, batch_size: int, max_blocks: int, block_size: int, device: torch.device):
        B = batch_size
        self.batch_size, self.max_blocks, self.block_size = B, max_blocks, block_size
        self.ids = torch.zeros(8, B, dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.kv_seqlens_t, self.kv_positions, self.slots, self.blocks,
         self.offsets, self.order) = self.ids.unbind(0)
        self.block_table = torch.zeros(B, max_blocks, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.arange(B + 1, dtype=torch.int64, device=device)
        self.seq_ids = torch.arange(B, dtype=torch.int64, device=device)
        self.has_history = torch.ones(B, dtype=torch.bool, device=device)
        self._tables: list[list[int]] = [[] for _ in range(B)]    # the block ids each row holds

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each static tensor by name (the recording's names for them)."""
        return {'ids': self.ids, 'block_table': self.block_table, 'cu_seqlens': self.cu_seqlens,
                'seq_ids': self.seq_ids, 'has_history': self.has_history}

    def fits(self, batch: StepBatch) -> bool:
        """Every block table of ``batch`` fits in :attr:`max_blocks`."""
        return all(len(t) <= self.max_blocks for t in batch.block_tables)

    def fill(self, batch: StepBatch) -> None:
        """Write ``batch`` (a decode step of ``B`` sequences that :meth:`fits`) into the static
        tensors: one copy for the per-sequence integers, one per block-table row whose blocks
        changed."""
        bs = self.block_size
        pos = [kv - 1 for kv in batch.kv_seqlens]
        tables = batch.block_tables
        blocks = [t[p // bs] for t, p in zip(tables, pos)]
        slots = batch.state_slots
        order = sorted(range(len(slots)), key=slots.__getitem__)     # = torch.argsort: the slots are distinct
        self.ids.copy_(torch.tensor([batch.input_ids, batch.positions, batch.kv_seqlens, pos, slots, blocks,
                                     [p % bs for p in pos], order], dtype=torch.int64))
        for i, t in enumerate(tables):
            last = self._tables[i]
            if t != last:
                row = self.block_table[i]
                if t:
                    row[:len(t)] = torch.tensor(t, dtype=torch.int64)
                if len(t) < len(last):
                    row[len(t):len(last)] = 0
                self._tables[i] = list(t)

    def context(self, batch: StepBatch, kv_caches, state_caches, lo: int | None, in_order: bool,
                on_read) -> StepContext:
        """The :class:`StepContext` of a recorded step: the static tensors in place of the per-step
        ones, its cached index properties pre-filled (``slot_span``: ``(lo, None)`` for slots
        ``lo ..`` in order, ``(lo, order)`` for that range out of order, None for no range),
        and ``batch``'s per-step lists as :class:`_PerStepList` (``on_read(reason)`` is called
        when one is read)."""
        B = self.batch_size
        ctx = StepContext(input_ids=self.input_ids, positions=self.positions, q_seqlens=[1] * B,
                          q_start_loc=list(range(B)),
                          kv_seqlens=_PerStepList(batch.kv_seqlens, on_read).named('kv_seqlens'),
                          block_tables=_PerStepList([torch.tensor(t, dtype=torch.int64) for t in batch.block_tables],
                                                    on_read).named('block_tables'),
                          state_slots=_PerStepList(batch.state_slots, on_read).named('state_slots'),
                          kv_caches=kv_caches, state_caches=state_caches, block_size=self.block_size,
                          prompt_lens=_PerStepList(batch.prompt_lens, on_read).named('prompt_lens'))
        span = None if lo is None else (lo, None if in_order else self.order)
        ctx.__dict__.update(cu_seqlens=self.cu_seqlens, seq_ids=self.seq_ids, slots=self.slots,
                            has_history=self.has_history, slot_span=span,
                            kv_seqlens_t=self.kv_seqlens_t, block_table=self.block_table,
                            kv_positions=self.kv_positions, kv_write_index=(self.blocks, self.offsets),
                            # the native attention does not read the gather index; the torch form
                            # builds it from the static block table when given None
                            kv_gather_index=None)
        return ctx


class _Memory:
    """Which tensor owns an address: storages as ``[start, end)`` intervals, each with a tag
    (``('p', i)`` persistent, ``('s', name)`` static input, ``('c', i)`` made by the recording)."""

    def __init__(self):
        self.starts: list[int] = []
        self.spans: dict[int, tuple[int, tuple]] = {}

    def add(self, t: torch.Tensor, tag: tuple) -> bool:
        """Register ``t``'s storage under ``tag`` unless already known; True when added."""
        st = t.untyped_storage()
        start = st.data_ptr()
        if start in self.spans or not start:
            return False
        self.spans[start] = (start + st.nbytes(), tag)
        bisect.insort(self.starts, start)
        return True

    def tag_of(self, t: torch.Tensor) -> tuple | None:
        """``t``'s storage tag, or None when unknown (a zero-byte storage: ``('z',)``)."""
        start = t.untyped_storage().data_ptr()
        if not start:
            return ('z',)
        span = self.spans.get(start)
        return None if span is None else span[1]

    def locate(self, ptr: int) -> tuple | None:
        """``(tag, byte offset)`` of address ``ptr``, or None when no known storage holds it."""
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            return None
        start = self.starts[i]
        end, tag = self.spans[start]
        return (tag, ptr - start) if ptr < end else None


def _persistent_tensors(model: torch.nn.Module, kv_caches, state_caches) -> list[torch.Tensor]:
    """Tensors that outlive every step: parameters, buffers, tensors held as module attributes,
    and the caches."""
    out = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
    for group in (kv_caches, state_caches):
        for entry in group or ():
            out.extend(x for x in tree_flatten(entry)[0] if isinstance(x, torch.Tensor))
    return out


class _NativeRecorder:
    """Stands in for the native library during a recording: each ``lm_*`` call is executed and
    recorded as ``(name, args, result)`` (arguments are already Python ints, floats or None).
    Calls from other threads (the library is one per process) pass through unrecorded."""

    def __init__(self, lib, entries: list):
        self._lib, self._entries, self._thread = lib, entries, threading.get_ident()

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith('lm_'):
            return fn
        entries, thread = self._entries, self._thread

        def call(*args):
            result = fn(*args)
            if threading.get_ident() == thread:
                entries.append(('native', name, args, result))
            return result
        return call


class _Recording(TorchDispatchMode):
    """One recorded forward: the aten ops (and, through :class:`_NativeRecorder`, the native
    calls) in order, with every tensor made during it held."""

    def __init__(self, memory: _Memory):
        super().__init__()
        self.memory = memory
        self.entries: list[tuple] = []
        self.held: list[torch.Tensor] = []
        self.refusal: str | None = None

    def refuse(self, reason: str) -> None:
        """Mark the recording unusable (the first reason is kept, with the innermost line of the
        package outside this module that led to it); the forward goes on."""
        if self.refusal is None:
            here = [f for f in traceback.extract_stack()[:-1]
                    if f'{os.sep}lmdeploy{os.sep}' in f.filename and f.filename != __file__]
            self.refusal = reason + (f' at {os.path.relpath(here[-1].filename, _PACKAGE)}:{here[-1].lineno}'
                                     if here else '')

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _refused_op(func, args):
            self.refuse(f'op {func}')
        elif func.namespace not in ('aten', 'prims'):
            self.refuse(f'op {func} (not an aten op)')
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        for x in inputs:
            if self.memory.tag_of(x) is None:
                self.refuse(f'op {func} reads a tensor that is neither persistent, a static input, nor made '
                            f'during the recording')
        result = func(*args, **kwargs)
        outputs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
        fresh = False
        for x in outputs:
            if self.memory.add(x, ('c', len(self.held))):
                self.held.append(x)
                fresh = True
        self.entries.append(('aten', func, args, kwargs, result, fresh))
        return result


def _normalise(value, memory: _Memory):
    """A recording value with every tensor written as ``(tag, offset, shape, strides, dtype)``."""
    if isinstance(value, torch.Tensor):
        return ('T', memory.tag_of(value), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_normalise(v, memory) for v in value)
    if isinstance(value, dict):
        return {k: _normalise(v, memory) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return 'nan'
    return value


def _signature(rec: _Recording) -> list:
    """The recording with tensors and native pointers written as (owner, offset): equal for two
    steps of the same key exactly when the replay of one would redo the other."""
    argtypes = cpu_native._ARGTYPES
    out = []
    for e in rec.entries:
        if e[0] == 'native':
            _, name, args, result = e
            kinds = argtypes[name][0].split()
            norm = []
            for kind, a in zip(kinds, args):
                if kind == 'p' and a:      # (0 or None: a null pointer, e.g. an empty tensor's)
                    where = rec.memory.locate(a)
                    if where is None:
                        raise _Refusal(f'{name} takes a pointer into memory no tensor of the step owns')
                    norm.append(where)
                else:
                    norm.append(a)
            out.append((name, tuple(norm), result))
        else:
            _, func, args, kwargs, result, fresh = e
            out.append((func, _normalise(args, rec.memory), _normalise(kwargs, rec.memory),
                        _normalise(result, rec.memory), fresh))
    return out


def _out_overload(func):
    """``func``'s ``.out`` overload when it takes the same arguments plus one ``out`` tensor,
    else None."""
    out_fn = getattr(func.overloadpacket, 'out', None)
    if out_fn is None:
        return None
    args, out_args = func._schema.arguments, out_fn._schema.arguments
    if len(out_args) != len(args) + 1 or out_args[-1].name != 'out':
        return None
    if any(a.name != b.name or str(a.type) != str(b.type) for a, b in zip(args, out_args)):
        return None
    return out_fn


#: aten ops a replay runs through the native library's ``lm_binary_f32`` (its op code) when both
#: operands and the output are float32, contiguous and of one shape: the residual and expert sums
#: and the output gates. Measured on a 2-core AVX2 host, batch 1 (99M Qwen3-Next-shaped model):
#: torch's add right after a product took 55-65 us (its dispatch's code and data missed in every
#: cache the product had just streamed weights through), the native call a few.
_NATIVE_BINARY = {_aten.add.Tensor: 0, _aten.add_.Tensor: 0, _aten.mul.Tensor: 1, _aten.mul_.Tensor: 1}
#: elements: larger sums keep torch's threaded loop
NATIVE_BINARY_MAX = 1 << 16


def _native_binary(func, args: tuple, kwargs: dict, out, lib) -> tuple | None:
    """The replay step ``(lm_binary_f32, (a, b, out pointers, n, op), None, None)`` that redoes
    the recorded ``out = args[0] + args[1]`` (or ``*``; ``out`` is ``args[0]`` for the in-place
    forms) bit for bit, or None when ``func`` is not one of :data:`_NATIVE_BINARY`, an alpha other
    than 1 is given, an operand is a scalar, broadcast, strided, of another dtype or device, the
    size is 0 or above :data:`NATIVE_BINARY_MAX`, an operand partly overlaps ``out``, or ``lib``
    (an earlier build) lacks the entry point."""
    op = _NATIVE_BINARY.get(func)
    if op is None or len(args) != 2 or not isinstance(out, torch.Tensor) \
            or any(k != 'alpha' or v != 1 for k, v in kwargs.items()):
        return None
    a, b = args
    tensors = (a, b, out)
    if not all(isinstance(t, torch.Tensor) and t.device.type == 'cpu' and t.dtype == torch.float32
               and t.is_contiguous() and t.shape == out.shape for t in tensors):
        return None
    n = out.numel()
    if not 0 < n <= NATIVE_BINARY_MAX:
        return None
    lo, hi = out.data_ptr(), out.data_ptr() + 4 * n
    if any(t.data_ptr() != lo and t.data_ptr() < hi and lo < t.data_ptr() + 4 * n for t in (a, b)):
        return None
    fn = getattr(lib, 'lm_binary_f32', None)
    if fn is None:
        return None
    return fn, (a.data_ptr(), b.data_ptr(), lo, n, op), None, None


def _replay_steps(rec: _Recording, lib) -> list:
    """The callables that redo ``rec`` in order (views, aliases and ``empty`` dropped; same-shape
    float32 adds and products as :func:`_native_binary` steps)."""
    steps = []
    for e in rec.entries:
        if e[0] == 'native':
            _, name, args, result = e
            steps.append((getattr(lib, name), args, result, None))
            continue
        _, func, args, kwargs, result, fresh = e
        native = _native_binary(func, args, kwargs, args[0] if func._schema.is_mutable else result, lib) \
            if func._schema.is_mutable or fresh else None
        if native is not None:
            steps.append(native)
        elif func._schema.is_mutable:
            steps.append((func, args, kwargs, None))
        elif fresh and func not in _UNINITIALISED:
            outs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
            out_fn = _out_overload(func) if isinstance(result, torch.Tensor) else None
            if out_fn is not None:
                steps.append((out_fn, args, dict(kwargs, out=result), None))
            else:
                steps.append((func, args, kwargs, outs))
    return steps


class _Graph:
    """One key's static inputs and recording. State: ``'new'`` (its first step runs eagerly),
    ``'first'`` (the next steps are recorded; :attr:`signature` holds the first recording's),
    ``'ready'`` (replayed) or ``'refused'`` (eager for good)."""

    def __init__(self, inputs: StaticDecodeInputs):
        self.inputs = inputs
        self.state = 'new'
        self.signature = None
        self.steps: list = []
        self.held: list[torch.Tensor] = []     # the recording's tensors (``made`` of them), then persistent ones
        self.made = 0
        self.output: torch.Tensor | None = None

    def held_bytes(self) -> int:
        """Bytes the graph adds: the tensors its recording made and its static inputs (the
        persistent tensors it also holds are the model's and the caches')."""
        seen, total = set(), 0
        for t in self.held[:self.made] + list(self.inputs.tensors().values()):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total


class DecodeGraphCache(GraphCache):
    """A worker's decode graphs, one per :func:`decode_graph_key`, least recently used dropped
    beyond ``max_graphs``.

    Args:
        model: the worker's model (its forward is recorded and replayed).
        max_blocks: the most KV blocks one sequence can hold (the static block table's width).
        max_graphs: graphs kept (refused keys count too, so they stay refused).

    Attributes:
        captures: recorded forwards (two per replayed key, after one plain eager step).
        replays: steps run by replay.
        refusals: keys refused (they run eagerly from then on).
        evictions: graphs dropped for the bound.
    """

    def __init__(self, model: torch.nn.Module, max_blocks: int, max_graphs: int = MAX_GRAPHS):
        super().__init__(max_graphs)
        self.model, self.max_blocks = model, max_blocks

    def calls_per_replay(self) -> list[tuple[int, int]]:
        """``(native kernel calls, torch ops)`` one replay of each ready graph makes (the calls a
        replayed step still pays for; views and ``empty`` are not replayed), in cache order."""
        out = []
        for graph in self.graphs.values():
            if graph.state == 'ready':
                native = sum(1 for step in graph.steps if not isinstance(step[2], dict))
                out.append((native, len(graph.steps) - native))
        return out

    def forward(self, batch: StepBatch, kv_caches, state_caches, block_size: int) -> torch.Tensor | None:
        """The model's ``hidden [B, hidden_size]`` for ``batch`` by a graph (recording or
        replaying it), or ``None`` when the step must run eagerly (no key, a refused key, a
        block table wider than the graphs', or no native library). The returned tensor is the
        graph's: the next step of the key overwrites it.

        Raises:
            ValueError: a native kernel refused the step's data during a replay (as its wrapper
                would in an eager step).
        """
        key = decode_graph_key(batch)
        lib = cpu_native.native_library()
        if key is None or lib is None:
            return None
        self._bind_caches(kv_caches, state_caches)
        graph = self._graph_for(
            key, lambda: _Graph(StaticDecodeInputs(key[0], self.max_blocks, block_size, torch.device('cpu'))))
        if graph.state == 'refused' or not graph.inputs.fits(batch):
            return None
        if graph.state == 'new':    # the key's first step runs eagerly: lazily built module tensors
            graph.state = 'first'   # (e.g. a layer's index columns) exist before the recordings
            return None
        graph.inputs.fill(batch)
        if graph.state == 'ready':
            self.replays += 1
            return self._replay(graph)
        return self._record(graph, key, batch, kv_caches, state_caches, lib)

    def _record(self, graph: _Graph, key: tuple, batch: StepBatch, kv_caches, state_caches, lib) -> torch.Tensor:
        """Run the step eagerly under the recording hooks; keep the recording when it is the
        key's second and matches the first, refuse the key on any refusal or difference."""
        memory = _Memory()
        persistent = _persistent_tensors(self.model, kv_caches, state_caches)
        for i, t in enumerate(persistent):
            memory.add(t, ('p', i))
        for name, t in graph.inputs.tensors().items():
            memory.add(t, ('s', name))
        rec = _Recording(memory)
        ctx = graph.inputs.context(batch, kv_caches, state_caches, key[1], key[2], rec.refuse)
        self.captures += 1
        cpu_native._LIB = _NativeRecorder(lib, rec.entries)
        try:
            with rec:
                hidden = self.model(ctx)
        finally:
            cpu_native._LIB = lib
        try:
            if rec.refusal is not None:
                raise _Refusal(rec.refusal)
            if not isinstance(hidden, torch.Tensor) or memory.tag_of(hidden) is None:
                raise _Refusal('the forward returned no tensor of the recording')
            signature = _signature(rec)
            if graph.signature is None:
                graph.signature = signature
                return hidden
            if signature != graph.signature:
                raise _Refusal('two decode steps recorded different kernels or arguments')
        except _Refusal as why:
            graph.state, graph.signature = 'refused', None
            self.refusals += 1
            logger.debug('decode graph for batch %d, slots from %s%s refused: %s', key[0], key[1],
                         '' if key[2] else ' out of order', why)
            return hidden
        # the persistent tensors are held too: a module that replaces a tensor it built lazily must
        # not free memory the recorded pointers address
        graph.steps, graph.held, graph.output = _replay_steps(rec, lib), rec.held + persistent, hidden
        graph.made, graph.state, graph.signature = len(rec.held), 'ready', None
        return hidden

    @staticmethod
    def _replay(graph: _Graph) -> torch.Tensor:
        for fn, args, extra, check in graph.steps:
            if isinstance(extra, dict):         # aten: kwargs, then outputs to copy into (or None)
                result = fn(*args, **extra)
                if check is not None:
                    for out, r in zip(check, tree_flatten(result)[0]):
                        out.copy_(r)
            else:                               # native: its recorded result
                result = fn(*args)
                if result != extra:
                    raise ValueError(f'native kernel {fn.__name__} refused the decode step\'s data (status '
                                     f'{result}; recorded {extra})')
        return graph.output

