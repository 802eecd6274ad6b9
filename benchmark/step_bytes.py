"""What a decode step must move through memory, and how fast this machine can move it.

A decode step of a batch of ``B`` sequences is memory-bound on CPU and GPU alike: every dense
weight is read once per step whatever ``B`` is, each routed expert is read when at least one of
the ``B`` tokens picks it, and every sequence reads its recurrent state (and writes it back) and
its KV cache. :func:`decode_step_bytes` counts those bytes from the model's own parameters and
the engine's cache specs; :func:`measure_gemv_bandwidths` measures the rate at which this machine
streams a read-only matrix-vector product (the access pattern of a decode GEMV), with torch's GEMV
and with the engine's native product; the faster of the two is taken as the machine's rate. Their
quotient is the step time at that rate, so a measured step time reads as a fraction of the limit
(``benchmark_throughput.py`` prints it per batch beside the ratios).

The expert term is an expectation: with ``E`` routed experts per layer and ``k`` picked per token,
``B`` tokens routed independently and uniformly touch ``E * (1 - (1 - k/E) ** B)`` distinct
experts per layer (``k`` exactly at ``B = 1``). Real routers are not uniform, which makes the
true number of touched experts (and so the bytes) no larger than this at ``B > 1``: the limit
printed is then a slight under-estimate of the achievable speed, never an over-estimate.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

__all__ = ['StepBytes', 'GemvBandwidth', 'decode_step_bytes', 'measure_gemv_bandwidth', 'measure_gemv_bandwidths']

_EXPERT_COUNT_FIELDS = ('num_experts', 'n_routed_experts', 'num_local_experts')


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step of ``batch`` sequences moves (all in bytes).

    ``dense``: every weight read once a step (attention and linear-attention projections, norms,
    shared experts, routers, the LM head; the embedding table only as ``batch`` rows unless it is
    tied to the LM head). ``experts``: the expected routed-expert bytes touched (module doc).
    ``state``: recurrent/conv state read and written back, all sequences. ``kv``: KV cache read
    (``context`` tokens a sequence) plus one token written, all sequences.
    """
    batch: int
    dense: int
    experts: int
    state: int
    kv: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.state + self.kv


def _routed_expert_params(model: torch.nn.Module) -> int:
    """Bytes of the routed (not shared) expert weights of ``model``: parameters under an
    ``experts`` module, fused (``[E, ...]``) or one module per expert."""
    total = 0
    for name, p in model.named_parameters():
        parts = name.split('.')
        if 'experts' in parts and not any('shared' in s for s in parts):
            total += p.numel() * p.element_size()
    return total


def decode_step_bytes(model: torch.nn.Module, config: dict, batch: int, context: int,
                      block_size: int = 64) -> StepBytes:
    """The bytes one decode step must move for ``batch`` sequences of ``context`` tokens each.

    Args:
        model: the ``transformers`` model of the checkpoint (its parameters, in the dtype the step
            runs in, are the weights read).
        config: the checkpoint's ``config.json`` as a dict (for the engine's cache specs, read
            through ``store_presets.sizes_from_config``, and the expert counts).
        batch: sequences in the step (>= 1).
        context: tokens already cached per sequence (KV read per full-attention layer).
        block_size: KV block size (tokens) the per-token KV bytes are taken from.

    Raises:
        ValueError: ``batch < 1`` or ``context < 0``; a MoE config without ``num_experts_per_tok``.
    """
    if batch < 1:
        raise ValueError(f'batch must be >= 1, got {batch}')
    if context < 0:
        raise ValueError(f'context must be >= 0, got {context}')
    from store_presets import sizes_from_config
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    emb_bytes = emb.numel() * emb.element_size()
    # named_parameters() lists a tied weight once: it is the LM head's full read then
    dense = params if tied else params - emb_bytes + batch * emb.shape[1] * emb.element_size()
    routed = _routed_expert_params(model)
    experts = 0
    if routed:
        text = config.get('text_config', config)
        n = next((text[f] for f in _EXPERT_COUNT_FIELDS if text.get(f)), None)
        # (Ling's published config.json spells it num_experts_per_token)
        k = text.get('num_experts_per_tok') or text.get('num_experts_per_token')
        if not n or not k:
            raise ValueError('a MoE config needs num_experts (or n_routed_experts / num_local_experts) and '
                             'num_experts_per_tok')
        experts = round(routed * (1.0 - (1.0 - k / n) ** batch))
        dense -= routed
    dtype = str(next(model.parameters()).dtype).replace('torch.', '')
    sizes = sizes_from_config({**config, 'dtype': dtype}, block_size=block_size)
    state = 2 * batch * sizes.state_bytes
    kv = batch * (context + 1) * sizes.kv_block_bytes // block_size
    return StepBytes(batch, dense, experts, state, kv)


@dataclass(frozen=True)
class GemvBandwidth:
    """Read bandwidth of a decode-shaped matrix-vector product, bytes/second, by implementation.

    ``torch``: ``torch.mv`` (MKL on CPU). ``native``: the engine's native few-row product
    (:func:`lmdeploy.pytorch.kernels.cpu_native.matmul_rows`, one input row), ``None`` when the
    native library is not built (no compiler, ``LMDEPLOY_CPU_KERNELS=0``) or off CPU.
    """
    torch: float
    native: float | None

    @property
    def best(self) -> float:
        """The faster of the two: what this machine can stream, the rate a step's limit uses."""
        return max(self.torch, self.native or 0.0)


def measure_gemv_bandwidths(threads: int | None = None, megabytes: int = 512, repeats: int = 5,
                            huge_pages: bool = False) -> GemvBandwidth:
    """This machine's read bandwidth for a decode-shaped matrix-vector product, with torch's GEMV
    and with the engine's native product, bytes/second each.

    Times a float32 ``[rows, 4096]`` matrix of ``megabytes`` MB (far beyond the last-level cache,
    so every byte comes from memory) times one vector on ``threads`` torch threads (default: the
    current setting), once with ``torch.mv`` and once with the native product, alternating, and
    reports the matrix bytes over the best of ``repeats`` runs of each. The two differ by host:
    on the 2-core AMD EPYC benchmark machine MKL's GEMV reads ~17-22 GB/s where the native
    kernel reads ~30 GB/s, so a limit from torch alone is pessimistic there.

    With ``huge_pages`` the matrix lives in a :class:`~lmdeploy.pytorch.host_memory.HugePageArena`
    (2 MiB aligned, advised ``MADV_HUGEPAGE`` before it is filled), as the engine's CPU weights do;
    without, in an ordinary allocation (4 KiB pages unless THP is ``always``).

    Raises:
        ValueError: ``megabytes`` or ``repeats`` < 1.
    """
    if megabytes < 1 or repeats < 1:
        raise ValueError('megabytes and repeats must be >= 1')
    from lmdeploy.pytorch.kernels.cpu_native import matmul_rows
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cols = 4096
        rows = max(1, megabytes * 2 ** 20 // (cols * 4))
        if huge_pages:
            from lmdeploy.pytorch.host_memory import HugePageArena
            w = HugePageArena(rows * cols * 4).take((rows, cols), torch.float32)
            w.uniform_()          # what torch.rand does, in place
        else:
            w = torch.rand(rows, cols)
        x = torch.rand(cols)
        with torch.inference_mode():
            ways = {'torch': lambda: torch.mv(w, x)}
            if matmul_rows(x[None], w) is not None:      # also the first touch / page faults
                ways['native'] = lambda: matmul_rows(x[None], w)
            torch.mv(w, x)
            best = dict.fromkeys(ways, float('inf'))
            for _ in range(repeats):
                for name, fn in ways.items():
                    t = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t)
        size = rows * cols * 4
        return GemvBandwidth(size / best['torch'], size / best['native'] if 'native' in best else None)
    finally:
        torch.set_num_threads(old)


def measure_gemv_bandwidth(threads: int | None = None, megabytes: int = 512, repeats: int = 5) -> float:
    """The best read bandwidth of :func:`measure_gemv_bandwidths` (torch's GEMV or the native
    product, whichever streams faster), bytes/second; same arguments and errors."""
    return measure_gemv_bandwidths(threads, megabytes, repeats).best
