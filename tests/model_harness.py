"""A minimal stand-in for the engine's cache engine and runner, for model-level tests.

Allocates caches from a model's layer specs and turns "these sequences get these new tokens"
into :class:`StepContext` forwards:

- paged tensors ``[num_blocks, block_size, *shape]`` (K and V, a latent, ...), filled with NaN so
  a read of a never-written position poisons the logits;
- state slots as strided views into ONE shared byte buffer ``[num_slots, slot_bytes]`` (each
  slot row contiguous, the tensors as a whole not), filled with 0xFF bytes (NaN), so a layer
  that trusts a fresh sequence's slot, or writes a slot in a way that breaks on views, fails;
- blocks and slots are handed out in a scrambled order so ids are not 0, 1, 2, ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmdeploy.pytorch.cache_specs import dtype_nbytes
from lmdeploy.pytorch.model_inputs import StepContext

_ALIGN = 64  # bytes; keeps every view's storage offset a multiple of its element size


@dataclass
class _Seq:
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class ModelHarness:
    """Run a model (``forward(ctx)``, ``compute_logits``) over sequences with paged/slot caches.

    Args:
        model: an engine model instance.
        specs: its ``cache_specs(config, dtype)``.
        num_blocks: KV blocks per full-attention layer.
        block_size: tokens per block.
        num_slots: state slots.
    """

    def __init__(self, model, specs, num_blocks: int = 128, block_size: int = 16, num_slots: int = 4):
        self.model = model
        self.block_size = block_size
        self.kv_caches, self.state_caches = [], []
        offsets, slot_bytes = [], 0
        for spec in specs:   # any spec kind: only its tensors and placement are read
            if not spec.paged:
                layer_offsets = []
                for t in spec.tensors():
                    layer_offsets.append(slot_bytes)
                    slot_bytes += -(-_numel(t.shape) * dtype_nbytes(t.dtype) // _ALIGN) * _ALIGN
                offsets.append(layer_offsets)
            else:
                offsets.append(None)
        self.state_buffer = torch.full((num_slots, max(slot_bytes, _ALIGN)), 0xFF, dtype=torch.uint8)
        for spec, layer_offsets in zip(specs, offsets):
            if spec.paged:
                self.kv_caches.append(tuple(torch.full((num_blocks, block_size, *t.shape), float('nan'), dtype=t.dtype)
                                            for t in spec.tensors()))
                self.state_caches.append(None)
            else:
                views = []
                for t, off in zip(spec.tensors(), layer_offsets):
                    nbytes = _numel(t.shape) * dtype_nbytes(t.dtype)
                    views.append(self.state_buffer[:, off:off + nbytes].view(t.dtype).view(num_slots, *t.shape))
                self.kv_caches.append(None)
                self.state_caches.append(tuple(views))
        gen = torch.Generator().manual_seed(1234)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.free_slots = torch.randperm(num_slots, generator=gen).tolist()
        self.seqs: dict[int, _Seq] = {}
        self._next_id = 0

    def add_sequence(self) -> int:
        """Admit a new empty sequence; returns its id. Raises IndexError with no free slot."""
        seq_id = self._next_id
        self._next_id += 1
        self.seqs[seq_id] = _Seq(slot=self.free_slots.pop())
        return seq_id

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks and slot (their contents are left as they are)."""
        seq = self.seqs.pop(seq_id)
        self.free_blocks.extend(seq.blocks)
        self.free_slots.append(seq.slot)

    @torch.no_grad()
    def step(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward over ``[(seq_id, new token ids), ...]``.

        Returns per entry the float32 logits ``[len(new tokens), vocab]`` of its new tokens.
        """
        ids, positions, q_lens, starts, kv_lens, tables, slots = [], [], [], [], [], [], []
        for seq_id, tokens in batch:
            seq = self.seqs[seq_id]
            n = len(tokens)
            starts.append(len(ids))
            ids.extend(int(t) for t in tokens)
            positions.extend(range(seq.num_tokens, seq.num_tokens + n))
            seq.num_tokens += n
            while len(seq.blocks) * self.block_size < seq.num_tokens:
                seq.blocks.append(self.free_blocks.pop())
            q_lens.append(n)
            kv_lens.append(seq.num_tokens)
            tables.append(torch.tensor(seq.blocks, dtype=torch.int64))
            slots.append(seq.slot)
        ctx = StepContext(input_ids=torch.tensor(ids, dtype=torch.int64),
                          positions=torch.tensor(positions, dtype=torch.int64), q_seqlens=q_lens,
                          q_start_loc=starts, kv_seqlens=kv_lens, block_tables=tables, state_slots=slots,
                          kv_caches=self.kv_caches, state_caches=self.state_caches, block_size=self.block_size)
        logits = self.model.compute_logits(self.model.forward(ctx))
        return [logits[ctx.seq_slice(i)] for i in range(len(batch))]

    def run_chunks(self, seq_id: int, tokens: list[int], chunk: int) -> torch.Tensor:
        """Feed ``tokens`` to one sequence ``chunk`` tokens per forward; concatenated logits."""
        outs = [self.step([(seq_id, tokens[i:i + chunk])])[0] for i in range(0, len(tokens), chunk)]
        return torch.cat(outs)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def randomize_hybrid_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite a ``transformers`` hybrid model's parameters in place with seeded values whose
    scale keeps activations O(1) through a few layers: ``A_log`` so that ``exp(A_log)`` lies in
    [1, 16), ``dt_bias`` in [-4.5, 0), norms near their init, other weights N(0, 0.2²).
    Returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('A_log'):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
            elif name.endswith('dt_bias'):
                p.copy_(torch.empty(p.shape).uniform_(-4.5, 0.0, generator=gen))
            elif 'norm' in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def check_random_model_in_random_chunks_then_decode(data, hf_class, arch: str, config, max_prompt: int,
                                                    tol: float) -> None:
    """A ``transformers`` ``hf_class(config)`` randomised with a drawn seed, its weights loaded
    into the engine's ``arch`` model: a drawn 5-``max_prompt``-token prompt prefilled in drawn
    1-40-token chunks, then 3 decode steps (B=8) give logits within ``tol`` of transformers' at
    every position. ``data`` is hypothesis' ``st.data()``; the draws are seed, prompt length,
    chunk, in that order."""
    from hypothesis import strategies as st

    from lmdeploy.pytorch.models import get_model_class
    from lmdeploy.tools.make_tiny_model import _randomize
    seed = data.draw(st.integers(0, 1000))
    torch_state = torch.random.get_rng_state()
    hf = hf_class(config).float().eval()
    torch.random.set_rng_state(torch_state)
    _randomize(hf, seed)
    ours = get_model_class(arch)(config).eval()
    ours.load_weights(hf.state_dict().items())
    n = data.draw(st.integers(5, max_prompt))
    ids = torch.randint(0, 64, (n + 3,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    h = ModelHarness(ours, type(ours).cache_specs(config, torch.float32), num_blocks=32, block_size=8)
    seq = h.add_sequence()
    chunk = data.draw(st.integers(1, 40))
    got = torch.cat([h.run_chunks(seq, ids[:n], chunk)] + [h.step([(seq, [t])])[0] for t in ids[n:]])
    assert (got - ref).abs().max().item() <= tol
