"""Multimodal inputs of a request: where each image sits in the prompt and what identifies it.

An image enters the prompt as a run of placeholder tokens (all the same id); the tokens alone
therefore say nothing about *which* image it is. Each image carries a content hash, and that
hash joins the chained block hash of the block holding the image's first token::

    tokens   [ text ... | <img> <img> <img> ... <img> | text ... ]
    blocks   [  block 0  ][  block 1 (span starts)  ][  block 2  ]
    hash     h0 = H(root, tok0)
             h1 = H(h0, tok1, image key)   <- image identity enters here
             h2 = H(h1, tok2)              <- and, by chaining, every later block

So the prefix cache and the Store share cached blocks up to the block before an image, never
past it, unless the image is the same; Store keys are built from the same hashes. The span
rule (docs/en/advance/prefix_caching.md) keeps checkpoints and chunk ends out of a span.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ['MultimodalInput', 'tensor_content_hash', 'block_extra_keys']


def tensor_content_hash(*tensors: torch.Tensor) -> bytes:
    """A 16-byte blake2b digest of tensors' dtypes, shapes and bytes (e.g. an image's
    preprocessed ``pixel_values`` and its ``image_grid_thw``): equal digests mean the model sees
    the same input, whatever file or URL it came from."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f'{t.dtype}{tuple(t.shape)}'.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b'')
    return h.digest()


@dataclass(frozen=True, eq=False)
class MultimodalInput:
    """One image of a request.

    Attributes:
        start: first token (absolute position in the prompt) of the image's placeholder run.
        end: one past its last token; ``[start, end)`` is the span no chunk end or checkpoint
            may split.
        content_hash: identity of the image content (:func:`tensor_content_hash`).
        data: what the model's encoder reads, e.g. ``{'pixel_values': float [patches, dim],
            'image_grid_thw': int64 [1, 3]}``; None in planning-only tests.
        modality: ``'image'``.
    """
    start: int
    end: int
    content_hash: bytes
    data: dict[str, Any] | None = field(default=None, repr=False)
    modality: str = 'image'

    def __post_init__(self):
        if not 0 <= self.start < self.end:
            raise ValueError(f'a multimodal span must satisfy 0 <= start < end, got [{self.start}, {self.end})')
        if not self.content_hash:
            raise ValueError('a multimodal input needs a non-empty content_hash')

    @property
    def span(self) -> tuple[int, int]:
        """``(start, end)``."""
        return self.start, self.end


def block_extra_keys(inputs: Sequence[MultimodalInput], num_blocks: int, block_size: int) -> list[bytes] | None:
    """Per-block extra bytes for :func:`~lmdeploy.pytorch.prefix_cache.block_trie.chain_block_hashes`.

    Block ``i`` gets, for each input whose span starts in it, the span's offset in the block,
    its length and its content hash (in prompt order); other blocks get ``b''``. Chaining then
    carries the image identity into every later block.

    Returns:
        ``num_blocks`` byte strings, or None when no input starts in those blocks.
    """
    keys = [b''] * num_blocks
    for mm in sorted(inputs, key=lambda m: m.start):
        i = mm.start // block_size
        if i < num_blocks:
            keys[i] += struct.pack('<II', mm.start - i * block_size, mm.end - mm.start) + mm.content_hash
    return keys if any(keys) else None
