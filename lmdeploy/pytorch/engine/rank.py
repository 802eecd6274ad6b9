"""What every tensor-parallel rank holds and does: its weight shard, its cache engine (its
slice of every KV block and state slot), and the handful of commands rank 0 broadcasts.

A step's inputs travel as one :class:`StepBatch` of plain integers (no tensors, no
sequences), broadcast once per step — except a Qwen3.5 step whose batch holds images: rank 0
runs the vision tower and adds its output and the M-RoPE positions
(:class:`~lmdeploy.pytorch.models.qwen3_5.ImageInputs`, CPU tensors) to the batch. Every rank
builds the same
:class:`~lmdeploy.pytorch.model_inputs.StepContext` from it and runs its shard of the forward.
The collectives inside the sharded layers keep the ranks in lock step, and the vocab-parallel
``lm_head`` leaves the full logits on every rank; only rank 0 samples.

With the Qwen3-Next MTP head (speculative decoding) each rank also holds its shard of the head
and keeps its own last forward's hidden states; :meth:`RankRuntime.mtp_step` runs a draft step
from an :class:`~lmdeploy.pytorch.spec_decode.mtp.MTPBatch` of integers, so no hidden state
crosses ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache_engine import CacheEngine
from ..model_inputs import StepContext
from ..distributed.loading import load_model_shard
from ..distributed.sharding import TPLayout

__all__ = ['StepBatch', 'RankRuntime']


@dataclass
class StepBatch:
    """One forward's inputs, as plain lists (see :class:`StepContext` for their meaning).

    Attributes:
        input_ids, positions: flat token ids and positions, ``T`` each.
        q_seqlens, q_start_loc, kv_seqlens, state_slots: one entry per sequence.
        block_tables: one list of block ids per sequence.
        sample_rows: flat rows whose logits are needed (each sampled chunk's last token, and
            with speculative decoding the positions of its drafts before it).
        all_logits: also compute the logits of every row (tests).
        images: only for a step of a model with images whose batch holds an image (Qwen3.5):
            rank 0's :class:`~lmdeploy.pytorch.models.qwen3_5.ImageInputs` on the CPU —
            M-RoPE positions int64 ``[3, T]``, image rows int64 ``[R]`` and the vision tower's
            ``[R, hidden]`` output in the model dtype; ``None`` otherwise (plain integers only).
    """
    input_ids: list[int]
    positions: list[int]
    q_seqlens: list[int]
    q_start_loc: list[int]
    kv_seqlens: list[int]
    block_tables: list[list[int]]
    state_slots: list[int]
    sample_rows: list[int]
    all_logits: bool = False
    images: object = None


class RankRuntime:
    """One rank's model shard and caches, and the commands it executes.

    Args:
        model_path: the model directory.
        dtype: ``PytorchEngineConfig.dtype``.
        device: this rank's device.
        rank, size: this rank and the TP size.
        mtp: also load this rank's shard of the Qwen3-Next MTP head (``mtp.*``); its KV spec
            (this rank's KV heads) is appended to :attr:`specs`, the full-head one to
            :attr:`full_specs`.

    Attributes:
        specs: this rank's layer cache specs (its heads).
        full_specs: the single-process specs (the Store payload layout).

    Raises:
        ValueError: see :func:`~lmdeploy.pytorch.distributed.loading.load_model_shard` and
            :func:`~lmdeploy.pytorch.spec_decode.mtp.load_mtp`.
    """

    def __init__(self, model_path: str, dtype: str, device: torch.device, rank: int, size: int, mtp: bool = False):
        self.rank, self.size, self.device = rank, size, device
        self.model, self.hf_config, self.local_config, self.dtype = load_model_shard(model_path, dtype, device,
                                                                                     rank, size)
        self.specs = list(self.model.cache_specs(self.local_config, self.dtype))
        self.full_specs = list(type(self.model).cache_specs(self.hf_config, self.dtype))
        self.mtp = self.drafter = None
        self.last_hidden: torch.Tensor | None = None    # [T, hidden] of the last forward (MTP only)
        if mtp:
            from ..spec_decode.mtp import MTPDrafter, load_mtp, mtp_cache_spec
            self.mtp = load_mtp(model_path, self.hf_config, self.dtype, device, layout=TPLayout(self.hf_config,
                                                                                                 rank, size))
            self.drafter = MTPDrafter(self.model, self.mtp)
            self.specs.append(mtp_cache_spec(self.local_config, self.dtype))
            self.full_specs.append(mtp_cache_spec(self.hf_config, self.dtype))
        self.cache_engine: CacheEngine | None = None

    # commands (rank 0 calls them locally and broadcasts them to the workers) ------------------
    def build_caches(self, block_size: int, num_blocks: int, num_slots: int) -> tuple[int, int]:
        """Allocate this rank's caches; returns its ``(K_blk, S)`` payload bytes."""
        self.cache_engine = CacheEngine(self.specs, block_size, num_blocks, num_slots, self.device)
        return self.cache_engine.kv_block_bytes, self.cache_engine.state_bytes

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run this rank's shard of the forward.

        Returns:
            ``(logits [len(sample_rows), vocab] float32 or None, all logits [T, vocab] or None)``,
            identical on every rank.
        """
        ce, dev = self.cache_engine, self.device
        ctx = StepContext(input_ids=torch.tensor(batch.input_ids, dtype=torch.long, device=dev),
                          positions=torch.tensor(batch.positions, dtype=torch.long, device=dev),
                          q_seqlens=batch.q_seqlens, q_start_loc=batch.q_start_loc, kv_seqlens=batch.kv_seqlens,
                          block_tables=[torch.tensor(t, dtype=torch.long, device=dev) for t in batch.block_tables],
                          state_slots=batch.state_slots, kv_caches=ce.kv_caches, state_caches=ce.state_caches,
                          block_size=ce.block_size)
        if batch.images is not None:      # every rank: the same image rows and positions as rank 0
            hidden = self.model.forward_images(ctx, batch.images)
        else:
            hidden = self.model(ctx)
        if self.mtp is not None:
            self.last_hidden = hidden
        all_logits = self.model.compute_logits(hidden).cpu() if batch.all_logits else None
        logits = None
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(batch.sample_rows, device=hidden.device)])
        return logits, all_logits

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
