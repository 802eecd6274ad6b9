"""Checkpoint state copy: duplicate whole recurrent-state slots inside one byte buffer
(the local save of docs/en/advance/prefix_caching.md, "Hybrid models: state checkpoints").

The engine keeps all recurrent state (conv state and delta/SSM state of every
linear-attention layer) belonging to one slot in one row of a byte buffer, so saving a
checkpoint or restoring one is a row copy, whatever the layer layout::

    state_buf  uint8 [num_slots, slot_bytes]          slot_bytes % 16 == 0
      row 3  |conv L0|delta L0|conv L1|delta L1|...|   runtime slot of a sequence
      row 9  |conv L0|delta L0|conv L1|delta L1|...|   checkpoint slot  <- copy(src=3, dst=9)

Owns the op ``copy_state_slots`` (``state_buf[dst[i]] = state_buf[src[i]]`` for every pair)
with a plain-torch implementation (any device) and a Triton one (CUDA), both registered in
the kernel registry of :mod:`lmdeploy.pytorch.kernels`. Precondition of both: ``dst`` has
no duplicates and no ``dst`` is also a ``src`` (so pairs are independent and their order
does not matter); it is not checked because checking would synchronise the device.
"""
from __future__ import annotations

import torch

from . import get_kernel, once, register_kernel, triton_available

__all__ = ['copy_state_slots', 'copy_state_slots_torch', 'copy_state_slots_triton']

SLOT_ALIGN_BYTES = 16
_BLOCK_WORDS = 1024  # int64 words one Triton program copies (8 KiB)


def _validate(state_buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    if state_buf.dim() != 2 or state_buf.dtype != torch.uint8 or not state_buf.is_contiguous():
        raise ValueError(f'state_buf must be a contiguous 2-D uint8 tensor, got {tuple(state_buf.shape)} '
                         f'{state_buf.dtype}')
    if state_buf.shape[1] % SLOT_ALIGN_BYTES:
        raise ValueError(f'state_buf slot_bytes must be a multiple of {SLOT_ALIGN_BYTES}, got {state_buf.shape[1]}')
    for name, idx in (('src', src), ('dst', dst)):
        if idx.dim() != 1 or idx.dtype != torch.int64 or idx.device != state_buf.device:
            raise ValueError(f'{name} must be a 1-D int64 tensor on {state_buf.device}, got '
                             f'{tuple(idx.shape)} {idx.dtype} on {idx.device}')
    if src.numel() != dst.numel():
        raise ValueError(f'src and dst must have the same length, got {src.numel()} and {dst.numel()}')


@register_kernel('copy_state_slots', device_type='any', priority=0)
def copy_state_slots_torch(state_buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place ``state_buf[dst[i]] = state_buf[src[i]]`` in plain torch (any device).

    Args:
        state_buf: uint8 ``[num_slots, slot_bytes]``, contiguous, ``slot_bytes % 16 == 0``.
        src: int64 ``[N]`` source slot ids.
        dst: int64 ``[N]`` destination slot ids; distinct and disjoint from ``src``.

    Raises:
        ValueError: a shape, dtype or device does not match the above.
    """
    _validate(state_buf, src, dst)
    if src.numel() == 0:
        return
    state_buf.index_copy_(0, dst, state_buf.index_select(0, src))


@once
def _triton_kernel():
    """Build the Triton kernel on first use, so importing this module never needs triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows(buf_ptr, src_ptr, dst_ptr, words_per_slot, BLOCK: tl.constexpr):
        # axis 0: word chunk (the large grid axis, slots can be tens of MiB); axis 1: pair
        chunk = tl.program_id(0)
        pair = tl.program_id(1)
        src = tl.load(src_ptr + pair)  # int64, so row offsets below do not overflow
        dst = tl.load(dst_ptr + pair)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words_per_slot
        words = tl.load(buf_ptr + src * words_per_slot + offs, mask=mask)
        tl.store(buf_ptr + dst * words_per_slot + offs, words, mask=mask)

    return triton, _copy_rows


@register_kernel('copy_state_slots', device_type='cuda', priority=10, available=triton_available)
def copy_state_slots_triton(state_buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place ``state_buf[dst[i]] = state_buf[src[i]]`` with one Triton launch.

    Rows are viewed as int64 words (``slot_bytes % 16 == 0``); the grid is
    ``(ceil(words / 1024), N)``, each program copying one 1024-word chunk of one pair. Runs on
    CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``. Same arguments, precondition and
    errors as :func:`copy_state_slots_torch`.
    """
    _validate(state_buf, src, dst)
    num_pairs = src.numel()
    if num_pairs == 0:
        return
    triton, kernel = _triton_kernel()
    words = state_buf.view(torch.int64)
    words_per_slot = words.shape[1]
    grid = (triton.cdiv(words_per_slot, _BLOCK_WORDS), num_pairs)
    kernel[grid](words, src, dst, words_per_slot, BLOCK=_BLOCK_WORDS)


def copy_state_slots(state_buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy state slots ``src[i] -> dst[i]`` with the best implementation for ``state_buf``'s device.

    Triton on CUDA when triton is importable, plain torch otherwise (selected by the kernel
    registry). Shapes and errors as in :func:`copy_state_slots_torch`.
    """
    get_kernel('copy_state_slots', state_buf.device)(state_buf, src, dst)
