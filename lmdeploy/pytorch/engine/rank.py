"""The worker: what every rank holds and does — its weights (the whole model at tp=1, its shard
otherwise; one loader and one code path for both, the rank's layout says which), its cache
engine (its slice of every KV block and state slot), and the handful of commands the engine
sends. tp=1 is the degenerate case of the same class: the engine process
runs rank 0's worker in process, a tensor-parallel engine also starts ranks ``1 .. N-1`` as
worker processes (:mod:`.executor`), each running this class.

A step's inputs travel as one :class:`~lmdeploy.pytorch.model_inputs.StepBatch` of plain integers (no tensors, no
sequences), built by the engine's one flat-batch builder
(:meth:`~lmdeploy.pytorch.engine.model_runner.ModelRunner.step_batch`) — except a Qwen3.5 step
whose batch holds images: rank 0 runs the vision tower and adds its output and the M-RoPE
positions (:class:`~lmdeploy.pytorch.models.qwen3_5.ImageInputs`) to the batch. Every rank
builds the same :class:`~lmdeploy.pytorch.model_inputs.StepContext` from it and runs its part
of the forward. The collectives inside the sharded layers keep the ranks in lock step, and the
vocab-parallel ``lm_head`` leaves the full logits on every rank; only rank 0 samples.

With the model's MTP head (speculative decoding) each rank also holds its shard of the head
and keeps its own last forward's hidden states; :meth:`Worker.mtp_step` runs a draft step
from an :class:`~lmdeploy.pytorch.spec_decode.mtp.MTPBatch` of integers, so no hidden state
crosses ranks.
"""
from __future__ import annotations

import torch

from ..cache_engine import CacheEngine
from ..model_inputs import StepBatch
from ..models.loader import load_model
from .cuda_graph import CudaGraphCache
from .decode_graph import DecodeGraphCache

__all__ = ['Worker']


def _rows_of(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]`` ``[len(rows), H]``: ``hidden`` itself when ``rows`` are all of its rows in
    order (every decode step: no index tensor made and no gather, each of which cost tens of
    microseconds right after a decode step's products) and it is laid out as a gather's result
    would be (contiguous, 64-byte aligned: the product then rounds as it would on the copy), else
    a gather."""
    n = hidden.shape[0]
    if len(rows) == n and rows[0] == 0 and rows[-1] == n - 1 and rows == list(range(n)) \
            and hidden.is_contiguous() and hidden.data_ptr() % 64 == 0:
        return hidden
    return hidden[torch.tensor(rows, device=hidden.device)]


class Worker:
    """One rank's model (shard) and caches, and the commands it executes.

    Args:
        model_path: the model directory.
        layout: what this rank holds, the same question on every TP size:
            :class:`~lmdeploy.pytorch.models.loader.WholeModel` at tp=1, the rank's
            :class:`~lmdeploy.pytorch.distributed.sharding.TPLayout` otherwise; the one loader
            (:func:`~lmdeploy.pytorch.models.loader.load_model`) builds and reads the model under it.
        dtype: ``PytorchEngineConfig.dtype``.
        device: this rank's device.
        mtp: also load this rank's part of the model's MTP head (its class's ``mtp_head``), by
            the same loader; its cache spec (this rank's KV heads) is appended to :attr:`specs`,
            the full-head one to :attr:`full_specs`.

    Attributes:
        rank, size: the layout's rank and TP size.
        specs: this rank's layer cache specs (its heads).
        full_specs: the single-process specs (the Store payload layout); equal to ``specs``
            when ``size == 1``.
        drafter: the MTP drafter (``mtp``), else None.

    Raises:
        ValueError: see :func:`~lmdeploy.pytorch.models.loader.load_model`.
    """

    def __init__(self, model_path: str, layout, dtype: str, device: torch.device, mtp: bool = False):
        self.rank, self.size, self.device = layout.rank, layout.size, device
        loaded = load_model(model_path, layout, dtype=dtype, device=device, mtp=mtp, progress=layout.rank == 0)
        self.model, self.hf_config, self.local_config, self.dtype = (loaded.model, loaded.config,
                                                                     loaded.local_config, loaded.dtype)
        self.specs, self.full_specs = loaded.cache_specs(), loaded.cache_specs(full=True)
        self.mtp, self.drafter = loaded.mtp, None
        self.last_hidden: torch.Tensor | None = None    # [T, hidden] of the last forward (MTP only)
        if mtp:
            from ..spec_decode.mtp import MTPDrafter
            self.drafter = MTPDrafter(self.model, self.mtp)
        self.cache_engine: CacheEngine | None = None
        self.decode_graphs: DecodeGraphCache | CudaGraphCache | None = None

    def enable_cuda_graphs(self, max_blocks: int, max_batch: int, scratch_slot: int | None, scratch_block: int,
                           backend=None) -> None:
        """Run pure decode steps through CUDA graphs (:mod:`.cuda_graph`, tp=1), one per batch
        bucket up to ``max_batch``, block tables up to ``max_blocks`` wide; padding rows use
        ``scratch_slot`` / ``scratch_block``, which no sequence may be given. ``backend``: the
        capture boundary (default: CUDA on this worker's device; tests pass a CPU stand-in).
        Raises ValueError at tp > 1."""
        if self.size != 1:
            raise ValueError(f'CUDA decode graphs run at tp=1; this worker is rank {self.rank} of {self.size}')
        self.decode_graphs = CudaGraphCache(self.model, max_blocks, max_batch, scratch_slot, scratch_block,
                                            self.device, backend=backend)

    def enable_decode_graphs(self, max_blocks: int) -> None:
        """Run pure decode steps through recorded graphs (:mod:`.decode_graph`; CPU, tp=1) whose
        block tables hold up to ``max_blocks`` blocks per sequence (``ceil(session_len /
        block_size)``). Raises ValueError on another device or TP size."""
        if self.device.type != 'cpu' or self.size != 1:
            raise ValueError(f'decode graphs run on the CPU at tp=1; this worker is on {self.device}, tp={self.size}')
        self.decode_graphs = DecodeGraphCache(self.model, max_blocks)

    # commands (rank 0 runs them in process; a tensor-parallel engine broadcasts them) ----------
    def build_caches(self, block_size: int, num_blocks: int, num_slots: int, window_entries: tuple[int, ...] = (),
                     num_window_blocks: int = 0) -> tuple[int, int]:
        """Allocate this rank's caches (``window_entries`` / ``num_window_blocks``: a window
        group's own rows, see :class:`CacheEngine`); returns its ``(block row, state row)`` bytes
        (a checkpoint in block rows needs ``ceil(state row / block row)`` of them on this rank)."""
        self.cache_engine = CacheEngine(self.specs, block_size, num_blocks, num_slots, self.device,
                                        window_entries, num_window_blocks)
        if self.decode_graphs is not None:     # recorded against the old caches' addresses
            self.decode_graphs.clear()
        return self.cache_engine.kv_buf.shape[1], self.cache_engine.state_buf.shape[1]

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run this rank's shard of the forward (a pure decode step by a decode graph when
        :meth:`enable_decode_graphs` was called and one applies, bit for bit the same; by a CUDA
        graph of its batch bucket after :meth:`enable_cuda_graphs`).

        Returns:
            ``(logits [len(sample_rows), vocab] float32 or None, all logits [T, vocab] or None,
            prompt logits [len(prompt_rows), vocab] or None)``, identical on every rank.
        """
        ce = self.cache_engine
        hidden = None
        if self.decode_graphs is not None:     # a pure decode step may replay a recorded forward
            hidden = self.decode_graphs.forward(batch, ce.kv_caches, ce.state_caches, ce.block_size)
        if hidden is None:
            ctx = batch.context(self.device, ce.kv_caches, ce.state_caches, ce.block_size)
            if batch.images is not None:      # every rank: the same image rows and positions as rank 0
                hidden = self.model.forward_images(ctx, batch.images)
            else:
                hidden = self.model(ctx)
        if self.mtp is not None:
            self.last_hidden = hidden
        all_logits = self.model.compute_logits(hidden).cpu() if batch.all_logits else None
        logits = prompt_logits = None
        if batch.sample_rows:
            logits = self.model.compute_logits(_rows_of(hidden, batch.sample_rows))
        if batch.prompt_rows:
            prompt_logits = self.model.compute_logits(_rows_of(hidden, batch.prompt_rows))
        return logits, all_logits, prompt_logits

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """This rank's slice of :meth:`CacheEngine.copy_states`."""
        self.cache_engine.copy_states(src, dst)

    def read_state(self, slot: int) -> torch.Tensor:
        """This rank's ``[S_r]`` uint8 state payload of ``slot``."""
        return self.cache_engine.read_state(slot)

    def write_state(self, slot: int, payloads: list[torch.Tensor]) -> None:
        """Write ``payloads[rank]`` into ``slot``."""
        self.cache_engine.write_state(slot, payloads[self.rank])

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's ``[len(block_ids), K_blk_r]`` uint8 KV payloads."""
        return self.cache_engine.read_kv_blocks(block_ids)

    def write_kv_block(self, block_id: int, payloads: list[torch.Tensor]) -> None:
        """Write ``payloads[rank]`` into block ``block_id``."""
        self.cache_engine.write_kv_block(block_id, payloads[self.rank])

    def read_window_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's ``[len(block_ids), K_win_r]`` uint8 window-pool payloads."""
        return self.cache_engine.read_window_blocks(block_ids)

    def write_window_block(self, block_id: int, payloads: list[torch.Tensor]) -> None:
        """Write ``payloads[rank]`` into window-pool block ``block_id``."""
        self.cache_engine.write_window_block(block_id, payloads[self.rank])

    def mtp_step(self, batch) -> list[int]:
        """Run one MTP step (:class:`~lmdeploy.pytorch.spec_decode.mtp.MTPBatch`) on this rank's
        shard, over its own last forward's hidden states (first step) or its own chain state;
        writes this rank's slice of the MTP KV.

        Returns:
            ``len(batch.draft_rows)`` draft token ids, identical on every rank.

        Raises:
            RuntimeError: this rank has no MTP head (the engine was not started with it).
        """
        if self.drafter is None:
            raise RuntimeError(f'rank {self.rank}: mtp_step without an MTP head')
        ce = self.cache_engine
        return self.drafter.run(batch, self.last_hidden, ce.kv_caches, ce.block_size)
