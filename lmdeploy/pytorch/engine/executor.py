"""Executors: how the engine reaches the workers (:class:`~.rank.Worker`, one per rank).

The engine talks to one protocol — ``call(name, *args, gather=False)`` runs
``Worker.<name>(*args)`` on every rank and returns rank 0's result (or every rank's, in rank
order, with ``gather``), ``worker`` is rank 0's worker, ``size`` the rank count, ``close()``
stops them — with two implementations:

* :class:`LocalExecutor` (tp=1): rank 0's worker in the engine process; a call is a method call.
* :class:`MultiProcessExecutor` (tp>1): the engine process is rank 0 and holds shard 0; ranks
  ``1 .. N-1`` are worker processes (``torch.multiprocessing``, spawn) that loop on commands::

    rank 0 (engine)                                  rank r (worker process)
    ModelRunner.forward(sched)                       wait for a command
      └─ call('forward', StepBatch) ── broadcast ──▶ Worker.forward(batch)
         Worker.forward(batch)     ◀─ all-reduce / all-gather inside the layers ─▶
      sample on rank 0
    ExecutorCaches.copy_states / read_* / write_*    the same command on every rank's slice

  Every command is one object broadcast on the control channel; commands that return data
  (payload reads) gather the ranks' answers to rank 0.

:class:`ExecutorCaches` is the engine's view of every rank's caches (block and slot ids are
shared by all ranks); its payloads are in the full-head layout of a single-process engine
(:mod:`.store_layout`), so Store objects do not depend on the TP size.

Failure: a worker process that dies makes the next collective on rank 0 fail (gloo and NCCL
notice the closed connection), or is found dead before a command is sent; either way rank 0
raises :class:`WorkerDiedError` naming the rank and its exit code, the engine stops, and
:meth:`MultiProcessExecutor.close` kills the other workers. Workers ask the kernel to kill them
when their parent dies (``PR_SET_PDEATHSIG``), so no worker outlives the engine process.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..cache_engine import rows_per_state
from ..distributed.comm import destroy_group, free_port, init_group
from ..distributed.sharding import TPLayout
from ..models.loader import WholeModel, load_config
from ..store.layout import StoreLayout
from .rank import Worker

__all__ = ['LocalExecutor', 'MultiProcessExecutor', 'ExecutorCaches', 'WorkerDiedError', 'make_executor']

logger = logging.getLogger('lmdeploy')

TIMEOUT_S = 600.0       # collectives and the rendezvous; a dead worker is noticed far sooner


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited; the engine cannot continue.

    Attributes:
        rank: the worker's TP rank.
        exitcode: its exit code (negative: killed by that signal), or None if unknown.
        fatal: always True (the engine loop stops instead of retrying).
    """
    fatal = True

    def __init__(self, rank: int, exitcode: int | None, pid: int | None = None, hint: str = ''):
        self.rank, self.exitcode = rank, exitcode
        how = f'killed by signal {-exitcode}' if exitcode is not None and exitcode < 0 else f'exit code {exitcode}'
        super().__init__(f'tensor-parallel worker rank {rank} (pid {pid}) died ({how}); the engine stopped{hint}')


# why a worker exits before it joined the group, most often: the script that built the engine
# has no main guard, and the spawned worker, importing it, tries to start the engine again
_STARTUP_HINT = ('. It exited while starting: its traceback is printed above. A script that creates a '
                 'tp > 1 engine must do so under `if __name__ == "__main__":` (workers are spawned '
                 'processes that import the main module)')


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no orphans)."""
    try:
        ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _no_named_semaphores() -> None:
    """Give tqdm a thread lock in this worker instead of its default multiprocessing RLock.

    tqdm builds that RLock (a named semaphore, registered with the engine process's resource
    tracker) for any bar, even a disabled one such as the weight loader's on ranks >= 1. A worker
    leaves by ``os._exit`` (or SIGKILL with its parent), so the semaphore's finalizer never runs
    and every tp > 1 engine's exit printed "There appear to be N leaked semaphore objects". A
    worker draws no bars and shares none with another process, so a thread lock is enough.
    """
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())


def _worker_main(rank: int, size: int, port: int, model_path: str, dtype: str, device: str, mtp: bool) -> None:
    """Entry point of worker ``rank``: join the group, load the shard, run commands until 'stop'."""
    _die_with_parent()
    _no_named_semaphores()
    dev = torch.device(device, rank) if device == 'cuda' else torch.device(device)
    if dev.type == 'cuda':
        torch.cuda.set_device(dev)
    group = init_group(rank, size, port, dev, TIMEOUT_S)
    try:
        worker, error = Worker(model_path, TPLayout(load_config(model_path), rank, size), dtype, dev, mtp), None
    except Exception as err:       # reported to rank 0, which raises it
        worker, error = None, f'rank {rank}: {type(err).__name__}: {err}'
    dist.gather_object(error, None, dst=0, group=group.control)
    if worker is None:
        destroy_group()
        return
    if dev.type == 'cpu':   # as the engine does, once this rank's weights are loaded
        from .host_allocator import tune_host_allocator
        from ..kernels.cpu_native import native_library
        tune_host_allocator()
        native_library()   # load (rank 0 built it) or build the native decode kernels before serving
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group.control)
        name, args, gather = box[0]
        if name == 'stop':
            break
        result = getattr(worker, name)(*args)
        if gather:
            dist.gather_object(result, None, dst=0, group=group.control)
    # Leave without tearing the group down: a teardown racing rank 0's can abort the process
    # inside gloo; rank 0 destroys its side once every worker has exited.
    logging.shutdown()
    os._exit(0)


def make_executor(model_path: str, dtype: str, device: torch.device, size: int, mtp: bool = False):
    """The executor of a ``size``-rank engine: :class:`LocalExecutor` for 1, else
    :class:`MultiProcessExecutor` (arguments and errors as theirs)."""
    if size == 1:
        return LocalExecutor(model_path, dtype, device, mtp)
    return MultiProcessExecutor(model_path, dtype, device, size, mtp)


class _Executor:
    """What both executors share: rank 0's worker and the cache allocation on every rank."""
    size: int
    worker: Worker

    def call(self, name: str, *args, gather: bool = False):
        raise NotImplementedError

    def start(self, block_size: int, num_blocks: int, num_slots: int, window_entries: tuple[int, ...] = (),
              num_window_blocks: int = 0) -> 'ExecutorCaches':
        """Allocate every rank's caches (a window group's own rows too: see
        :meth:`~.rank.Worker.build_caches`); returns the engine's view of them."""
        rows = self.call('build_caches', block_size, num_blocks, num_slots, tuple(window_entries), num_window_blocks,
                         gather=True)
        caches = ExecutorCaches(self, block_size)
        # a checkpoint in block rows takes the same rows on every rank: as many as the rank that
        # needs the most
        caches.rows_per_state = max(rows_per_state(state, block) if state else 0 for block, state in rows)
        return caches


class LocalExecutor(_Executor):
    """tp=1: rank 0's :class:`~.rank.Worker` runs in the engine process.

    Args:
        model_path, dtype, device, mtp: as :class:`~.rank.Worker`.

    Raises:
        ValueError: as :class:`~.rank.Worker`.
    """

    def __init__(self, model_path: str, dtype: str, device: torch.device, mtp: bool = False):
        self.size = 1
        self.device = device
        self.worker = Worker(model_path, WholeModel(load_config(model_path)), dtype, device, mtp)
        self.pids: list[int] = []

    def call(self, name: str, *args, gather: bool = False):
        """Run ``Worker.<name>(*args)``; ``[result]`` when ``gather``."""
        result = getattr(self.worker, name)(*args)
        return [result] if gather else result

    def close(self) -> None:
        """Nothing to stop: the worker is this process."""


class MultiProcessExecutor(_Executor):
    """Starts the worker processes, holds rank 0's shard, and sends commands to every rank.

    Args:
        model_path: the model directory.
        dtype: ``PytorchEngineConfig.dtype``.
        device: rank 0's device (CUDA ranks use devices ``0 .. N-1``).
        size: the TP size (>= 2).
        mtp: every rank also loads its shard of the model's MTP head (speculative decoding
            method ``mtp``).

    Raises:
        ValueError: ``size`` does not divide a head or channel count (names the config field),
            ``mtp`` on a model without an MTP head that TP can split (names ``speculative_config.method``), or a
            rank failed to load its shard (the message names the rank and the cause).
        WorkerDiedError: a worker died during startup.
    """

    def __init__(self, model_path: str, dtype: str, device: torch.device, size: int, mtp: bool = False):
        self.size = size
        self.device = device
        self.dead: WorkerDiedError | None = None
        self._closed = False
        # rank 0's layout, built first: a TP size the heads do not allow fails before any spawn
        layout = TPLayout(load_config(model_path), 0, size)
        ctx = mp.get_context('spawn')
        port = free_port()
        self.procs = [ctx.Process(target=_worker_main, args=(r, size, port, model_path, dtype, device.type, mtp),
                                  name=f'lmdeploy-tp{r}', daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        try:
            self._join_group(port)
            try:
                self.worker, error = Worker(model_path, layout, dtype, device, mtp), None
            except Exception as err:
                self.worker, error = None, err
            errors = [None] * size
            self._collective(lambda: dist.gather_object(None, errors, dst=0, group=self.group.control))
            if error is not None:
                raise error
            failed = [e for e in errors if e]
            if failed:
                raise ValueError('; '.join(failed))
        except BaseException:
            self.close()
            raise
        logger.info('tensor parallel: %d ranks (pids %s)', size, [os.getpid()] + [p.pid for p in self.procs])

    def _join_group(self, port: int) -> None:
        """Rendezvous on a helper thread so a worker that dies before joining is noticed now,
        not after the rendezvous timeout."""
        box = {}

        def join():
            try:
                box['group'] = init_group(0, self.size, port, self.device, TIMEOUT_S)
            except BaseException as err:
                box['error'] = err
        t = threading.Thread(target=join, name='lmdeploy-tp-rendezvous', daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            try:
                self._check_workers(wait=0)
            except WorkerDiedError as err:
                p = self.procs[err.rank - 1]
                self.dead = WorkerDiedError(err.rank, err.exitcode, p.pid, _STARTUP_HINT)
                raise self.dead from None
        if 'error' in box:
            raise box['error']
        self.group = box['group']

    def _check_workers(self, wait: float) -> None:
        """Raise :class:`WorkerDiedError` for the first dead worker (polling up to ``wait`` s)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self.dead = WorkerDiedError(rank, p.exitcode, p.pid)
                    raise self.dead
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _collective(self, fn):
        """Run ``fn`` (a collective); a failure caused by a dead worker becomes WorkerDiedError."""
        try:
            return fn()
        except RuntimeError as err:
            self._check_workers(wait=5.0)
            raise RuntimeError(f'tensor-parallel collective failed: {err}') from err

    def call(self, name: str, *args, gather: bool = False):
        """Run ``Worker.<name>(*args)`` on every rank; returns rank 0's result, or every
        rank's result in rank order when ``gather``.

        Raises:
            WorkerDiedError: a worker is dead (this and every later call).
        """
        if self.dead is not None:
            raise self.dead
        self._check_workers(wait=0)
        self._collective(lambda: dist.broadcast_object_list([(name, args, gather)], src=0, group=self.group.control))
        result = self._collective(lambda: getattr(self.worker, name)(*args))
        if not gather:
            return result
        results = [None] * self.size
        self._collective(lambda: dist.gather_object(result, results, dst=0, group=self.group.control))
        return results

    def close(self) -> None:
        """Stop every worker (a clean 'stop' when all are alive, else kill), then leave the group."""
        if self._closed:
            return
        self._closed = True
        alive = all(p.exitcode is None for p in self.procs)
        if alive and self.dead is None and getattr(self, 'group', None) is not None and \
                getattr(self, 'worker', None) is not None:
            try:
                dist.broadcast_object_list([('stop', (), False)], src=0, group=self.group.control)
            except RuntimeError:
                pass
        for p in self.procs:
            p.join(timeout=10 if alive else 0.5)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        if getattr(self, 'group', None) is not None and self.dead is None:
            destroy_group()
        elif self.dead is not None:
            # the group is broken (a peer is gone); only drop our reference, a destroy may block
            try:
                destroy_group()
            except Exception:   # noqa: BLE001 - best effort on a broken group
                pass

    @property
    def pids(self) -> list[int]:
        """Worker process ids (rank 1 first)."""
        return [p.pid for p in self.procs]


class ExecutorCaches:
    """The engine's view of the caches of every rank: block and slot ids are shared by all
    ranks, each rank holds its heads' slice of every row (at tp=1, all of it).

    Payloads (Store objects) are in the full-head layout of a single-process engine
    (:mod:`~lmdeploy.pytorch.store.layout`): reads gather the ranks' slices and assemble them, writes split a
    payload back into slices (at tp=1 both are the rank's own bytes, unconverted).
    ``kv_block_bytes`` / ``state_bytes`` and ``object_specs`` are therefore those of the
    single-process engine whatever the TP size.

    Args:
        executor: a :class:`LocalExecutor` or :class:`MultiProcessExecutor` whose ranks built
            their caches.
        block_size: tokens per KV block.
    """

    def __init__(self, executor: _Executor, block_size: int):
        self.executor = executor
        self.local = executor.worker.cache_engine
        for name in ('specs', 'block_size', 'num_blocks', 'num_slots', 'has_state', 'device', 'kv_caches',
                     'state_caches', 'kv_buf', 'state_buf', 'num_window_blocks'):
            setattr(self, name, getattr(self.local, name))
        worker = executor.worker
        self.object_specs = worker.full_specs      # with the MTP layer's KV when the engine drafts with it
        self.rows_per_state = 0     # block rows a checkpoint takes on every rank (set by start)
        self.layout = None
        if executor.size > 1:
            self.layout = StoreLayout(worker.hf_config, executor.size, worker.specs, self.object_specs, block_size)
            self.kv_block_bytes = self.layout.kv_block_bytes     # K_blk of all heads
            self.state_bytes = self.layout.state_bytes if self.has_state else 0     # S of all heads
        else:
            self.kv_block_bytes, self.state_bytes = self.local.kv_block_bytes, self.local.state_bytes

    @property
    def window_block_bytes(self) -> int:
        """K_win: payload bytes of one window-pool block (0 without a window pool). Window objects
        are single-process only: under TP the engine keeps one shared table when a Store or host
        tier is set."""
        return self.local.window_block_bytes if self.layout is None else 0

    def _to_full(self, parts: list[torch.Tensor], kv: bool) -> torch.Tensor:
        return parts[0] if self.layout is None else self.layout.to_full(parts, kv=kv)

    def _to_ranks(self, payload: torch.Tensor, kv: bool) -> list[torch.Tensor]:
        return [payload] if self.layout is None else self.layout.to_ranks(payload, kv=kv)

    def copy_states(self, src, dst) -> None:
        """Copy whole states ``src[i] → dst[i]`` on every rank (state rows, or the block rows of
        a checkpoint: :class:`~lmdeploy.pytorch.cache_engine.StateRef`)."""
        if src:
            self.executor.call('copy_states', list(src), list(dst))

    def read_state(self, slot) -> torch.Tensor:
        """``[S]`` uint8: the state payload of ``slot`` (a state row or a checkpoint's block
        rows) over all heads."""
        parts = self.executor.call('read_state', slot, gather=True)
        return self._to_full([p[None] for p in parts], kv=False)[0]

    def write_state(self, slot: int, payload: torch.Tensor) -> None:
        """Write a ``[S]`` all-heads payload into ``slot``, each rank its slice."""
        parts = self._to_ranks(payload.reshape(1, -1), kv=False)
        self.executor.call('write_state', slot, [p[0] for p in parts])

    def read_kv_blocks(self, block_ids) -> torch.Tensor:
        """``[len(block_ids), K_blk]`` uint8: the blocks' payloads over all heads."""
        return self._to_full(self.executor.call('read_kv_blocks', list(block_ids), gather=True), kv=True)

    def write_kv_block(self, block_id: int, payload: torch.Tensor) -> None:
        """Write a ``[K_blk]`` all-heads payload into ``block_id``, each rank its slice."""
        parts = self._to_ranks(payload.reshape(1, -1), kv=True)
        self.executor.call('write_kv_block', block_id, [p[0] for p in parts])

    def read_window_blocks(self, block_ids) -> torch.Tensor:
        """``[len(block_ids), K_win]`` uint8: window-pool blocks' payloads (tp = 1 only).

        Raises:
            NotImplementedError: a tensor-parallel engine (window objects have no full-head layout yet).
        """
        if self.layout is not None:
            raise NotImplementedError('window objects under tensor parallelism')
        return self.executor.call('read_window_blocks', list(block_ids), gather=True)[0]

    def write_window_block(self, block_id: int, payload: torch.Tensor) -> None:
        """Write a ``[K_win]`` payload into window-pool block ``block_id`` (tp = 1 only).

        Raises:
            NotImplementedError: a tensor-parallel engine.
        """
        if self.layout is not None:
            raise NotImplementedError('window objects under tensor parallelism')
        self.executor.call('write_window_block', block_id, [payload])
