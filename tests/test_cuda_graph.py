"""CUDA decode graphs (lmdeploy/pytorch/engine/cuda_graph.py) without a GPU: batch buckets,
padding rows on the scratch block and slot, the static inputs of padded batches, the padding
property on the CPU for every family a graph would cover, and the engine wiring with a CPU
stand-in for the capture boundary (its "replay" re-runs the forward on the static inputs), a
capture that raises, a forward that reads per-step lists, and ``eager_mode``. The GPU tests are
in tests/test_cuda.py."""
from __future__ import annotations

import logging
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engine_utils import make_engine, run_schedule
from lmdeploy.pytorch.engine import cuda_graph
from lmdeploy.pytorch.engine import engine as engine_module
from lmdeploy.pytorch.engine.cuda_graph import (MAX_CUDA_GRAPHS, MAX_GRAPH_BATCH, CudaGraphCache, batch_buckets,
                                                 bucket_for, cuda_graph_key, decode_graphs_kind, pad_batch)
from lmdeploy.pytorch.engine.decode_graph import StaticDecodeInputs
from lmdeploy.pytorch.model_inputs import StepBatch


class _StandInGraph:
    """A captured forward whose replay re-runs it (on the static inputs) into the captured output."""

    def replay(self):
        self.output.copy_(self.fn())


class StandIn:
    """The capture boundary on the CPU: the warm-up and the capture run the forward eagerly."""

    def __init__(self, device=None, fail: bool = False):
        self.fail, self.warmups = fail, 0

    def new_graph(self):
        return _StandInGraph()

    def warmup(self, fn, runs):
        for _ in range(runs):
            self.warmups += 1
            fn()

    def capture(self, graph, fn):
        if self.fail:
            raise RuntimeError('operation not permitted when stream is capturing\nsecond line')
        graph.fn, graph.output = fn, fn()
        return graph.output

    def reserved_bytes(self):
        return 0

    def synchronize(self):
        pass


def _decode_batch(B: int, step: int = 0, slots=None) -> StepBatch:
    """A decode step of ``B`` sequences (block size 4): sequence ``i`` holds ``7 + step + i``
    tokens in blocks ``8i ..``, state slot ``slots[i]`` (default ``i``)."""
    kv = [7 + step + i for i in range(B)]
    return StepBatch(input_ids=[(3 * step + i) % 32 for i in range(B)], positions=[k - 1 for k in kv],
                     q_seqlens=[1] * B, q_start_loc=list(range(B)), kv_seqlens=kv,
                     block_tables=[list(range(i * 8, i * 8 + -(-k // 4))) for i, k in enumerate(kv)],
                     state_slots=list(range(B)) if slots is None else list(slots), sample_rows=list(range(B)))


# --- pure parts ------------------------------------------------------------------------------------
def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(43) == [1, 2, 4, 8, 16, 24, 32, 40, 43]
    with pytest.raises(ValueError, match='max_batch'):
        batch_buckets(0)
    assert batch_buckets(1000) == batch_buckets(MAX_GRAPH_BATCH) and len(batch_buckets(1000)) == 35 <= MAX_CUDA_GRAPHS
    for max_batch in range(1, 300):     # every batch gets the smallest bucket that holds it
        buckets = batch_buckets(max_batch)
        top = min(max_batch, MAX_GRAPH_BATCH)
        assert buckets == sorted(set(buckets)) and buckets[-1] == top
        for B in range(1, top + 1):
            b = bucket_for(B, buckets)
            assert b >= B and not any(B <= x < b for x in buckets)
        assert bucket_for(top + 1, buckets) is None     # a larger batch runs eagerly


def test_keys_share_the_cpu_graphs_boundaries():
    buckets = batch_buckets(8)
    batch = _decode_batch(3)
    assert cuda_graph_key(batch, buckets) == (4, False)
    assert cuda_graph_key(_decode_batch(3, slots=[9, 2, 5]), buckets) == (4, False)   # slots do not matter
    assert cuda_graph_key(replace(batch, prompt_lens=[5, 6, 7]), buckets) == (4, True)  # as an engine's step
    assert cuda_graph_key(_decode_batch(8), buckets) == (8, False)
    assert cuda_graph_key(_decode_batch(8), [1, 2, 4]) is None                   # past the largest bucket
    assert cuda_graph_key(replace(batch, q_seqlens=[2, 1, 1]), buckets) is None   # a prefill chunk
    assert cuda_graph_key(replace(batch, kv_seqlens=[1, 8, 9]), buckets) is None  # no history
    assert cuda_graph_key(replace(batch, all_logits=True), buckets) is None
    assert cuda_graph_key(replace(batch, window_block_tables=[[0]] * 3), buckets) is None


def test_padded_batch_and_its_static_inputs():
    """Padding rows: token 0 at position 0, one key on the scratch block, the scratch slot; the
    real rows' static inputs are the unpadded batch's, whatever the batch held before."""
    batch = _decode_batch(3, step=5, slots=[4, 1, 2])
    padded = pad_batch(batch, 4, scratch_slot=9, scratch_block=63)
    assert padded.input_ids == batch.input_ids + [0] and padded.positions == batch.positions + [0]
    assert padded.kv_seqlens == batch.kv_seqlens + [1] and padded.block_tables[3] == [63]
    assert padded.state_slots == [4, 1, 2, 9] and padded.sample_rows == [0, 1, 2, 3]
    assert pad_batch(batch, 4, None, 63).state_slots == [4, 1, 2, -1]               # no state
    assert pad_batch(batch, 3, 9, 63) == replace(batch, state_slots=[4, 1, 2])      # nothing to pad
    with pytest.raises(ValueError, match='bucket 2'):
        pad_batch(batch, 2, 9, 63)
    rng = random.Random(0)
    inputs = StaticDecodeInputs(8, max_blocks=12, block_size=4, device=torch.device('cpu'))
    for _ in range(60):                 # random batches of 1-8 rows in the bucket of 8, one after another
        B = rng.randint(1, 8)
        kv = [rng.randint(2, 48) for _ in range(B)]
        tables = [rng.sample(range(60), -(-k // 4)) for k in kv]
        slots = rng.sample(range(9), B)
        batch = StepBatch(input_ids=[rng.randrange(32) for _ in kv], positions=[k - 1 for k in kv], q_seqlens=[1] * B,
                          q_start_loc=list(range(B)), kv_seqlens=kv, block_tables=tables, state_slots=slots,
                          sample_rows=list(range(B)))
        inputs.fill(pad_batch(batch, 8, 9, 63))
        pad = 8 - B
        assert inputs.input_ids.tolist() == batch.input_ids + [0] * pad
        assert inputs.kv_seqlens_t.tolist() == kv + [1] * pad
        assert inputs.slots.tolist() == slots + [9] * pad
        assert inputs.blocks.tolist() == [t[(k - 1) // 4] for t, k in zip(tables, kv)] + [63] * pad
        assert inputs.offsets.tolist() == [(k - 1) % 4 for k in kv] + [0] * pad
        assert inputs.block_table.tolist() == [t + [0] * (12 - len(t)) for t in tables] + [[63] + [0] * 11] * pad


# --- the padding property on the CPU -------------------------------------------------------------------
DENSE_NEMOTRON = dict(layers_block_type=['linear_attention', 'mlp', 'full_attention', 'linear_attention', 'mlp'])
# every family whose decode forward a graph takes (the others read per-step lists: Qwen3.5 with
# images, granitemoe_swa, Zamba2, Lara-mini, LFM3, Inkling). Nemotron-3's relu^2 experts and the
# limited experts of Ling (bailing_hybrid) and GLM-5 (whose DSA decode step reads no list) are not
# here: on the CPU their per-expert products round with the rows routed to them, padding included;
# CUDA captures them in their gathered form
# (test_expert_layers_that_read_their_routing_capture_with_the_cuda_kernel below)
FAMILIES = [('qwen3_next', {}), ('qwen3_5_moe_text', {}), ('kimi_linear', {}), ('nemotron_h', DENSE_NEMOTRON),
            ('granitemoehybrid', {}), ('qwen3', {}), ('lfm2', {}), ('lfm2_moe', {}), ('bamba', {}), ('mamba2', {}),
            ('falcon_h1', {}), ('mamba', {}), ('falcon_mamba', {}), ('jamba', {}), ('minimax', {}),
            ('olmo_hybrid', {})]


@pytest.mark.parametrize('arch, overrides', FAMILIES)
def test_padding_rows_leave_real_rows_alone(family_paths, arch, overrides):
    """Three decode steps of 3 sequences padded to a bucket of 8 (eager, on the CPU): whatever
    the padding rows hold (their tokens, garbage in the scratch block and slot, even NaN bit
    patterns), the real rows' logits and every cache row outside the scratch ones are bit for
    bit the same, and equal to the unpadded step's up to float32 rounding."""
    engine = make_engine(family_paths(arch, overrides), block_size=4, max_batch_size=8, num_gpu_blocks=64,
                         eager_mode=True)
    worker = engine.executor.worker
    ce = worker.cache_engine
    has_state = ce.state_buf.shape[0] > 0
    scratch_slot, scratch_block = (ce.state_buf.shape[0] - 1 if has_state else None), ce.kv_buf.shape[0] - 1
    gen = torch.Generator().manual_seed(1)
    ce.kv_buf.zero_()
    ce.state_buf.zero_()
    for step in range(3):
        batch = _decode_batch(3, step, slots=[2, 0, 1])
        start = (ce.kv_buf.clone(), ce.state_buf.clone())
        runs = {}
        for name in ('unpadded', 'zero padding', 'garbage padding', 'continue'):
            ce.kv_buf.copy_(start[0])
            ce.state_buf.copy_(start[1])
            run = batch if name in ('unpadded', 'continue') else pad_batch(batch, 8, scratch_slot, scratch_block)
            if name == 'garbage padding':
                run = replace(run, input_ids=batch.input_ids + [5, 31, 7, 1, 0])
                ce.kv_buf[scratch_block] = torch.randint(0, 256, ce.kv_buf[scratch_block].shape, generator=gen,
                                                         dtype=torch.uint8)
                if has_state:
                    ce.state_buf[scratch_slot] = torch.randint(0, 256, ce.state_buf[scratch_slot].shape,
                                                               generator=gen, dtype=torch.uint8)
            logits = worker.forward(run)[0][:3].clone()
            runs[name] = (logits, ce.kv_buf[:scratch_block].clone(),
                          ce.state_buf[:scratch_slot].clone() if has_state else None)
        zero, garbage, unpadded = runs['zero padding'], runs['garbage padding'], runs['unpadded']
        assert torch.equal(zero[0], garbage[0]) and torch.equal(zero[1], garbage[1])
        assert not has_state or torch.equal(zero[2], garbage[2])
        # blocks and slots no real row owns are untouched by the padded step
        owned = {b for t in batch.block_tables for b in t}
        others = [b for b in range(scratch_block) if b not in owned]
        assert torch.equal(zero[1][others], start[0][others])
        if has_state:
            assert torch.equal(zero[2][3:], start[1][3:scratch_slot])
        # against the unpadded step: float32 GEMMs (MKL here, cuBLAS on a GPU) round a row
        # differently with the row count (batched products over 3 and 8 rows: 1e-7-level
        # differences measured); 1e-5 of the logits' scale is two orders above that
        scale = max(1.0, float(unpadded[0].abs().max()))
        assert torch.allclose(zero[0], unpadded[0], rtol=0, atol=1e-5 * scale), (zero[0] - unpadded[0]).abs().max()
        # the unpadded step is the one the next step builds on (the caches as it left them)


# --- the engine with the stand-in --------------------------------------------------------------------
# (arrival step, prompt tokens, new tokens): batch 1, then 3 (bucket 4, one padding row), 2, 1
SCHEDULE = ((0, 5, 30), (3, 6, 20), (4, 3, 25))
# its 30 decode steps: 19 in bucket 4 (the batch of 3: one capture, 18 replays), 11 in buckets 1 and 2
# (two captures, 9 replays); with bucket 4 refused only those 9 replay
REPLAYS_WITHOUT_BUCKET_4 = 9


def _decode(path: str, kind: str | None, monkeypatch, backend=StandIn) -> tuple[list, list[list[int]], object]:
    """Per-step sampled logits, every sequence's tokens and the engine of SCHEDULE with the
    decode graphs ``kind`` (None: eager)."""
    monkeypatch.setattr(engine_module, 'decode_graphs_kind', lambda device, config: kind)
    monkeypatch.setattr(cuda_graph, 'CudaBackend', backend)
    engine = make_engine(path, block_size=4, max_batch_size=4, num_gpu_blocks=96)
    logits, tokens = run_schedule(engine, SCHEDULE)
    return logits, tokens, engine


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize('arch', ['qwen3_next', 'qwen3'])
def test_engine_replays_padded_buckets_equal_to_eager(family_paths, monkeypatch, arch):
    path = family_paths(arch, {})
    eager_logits, eager_tokens, eager = _decode(path, None, monkeypatch)
    logits, tokens, engine = _decode(path, 'cuda', monkeypatch)
    assert tokens == eager_tokens and _same(logits, eager_logits)
    graphs = engine.executor.worker.decode_graphs
    assert isinstance(graphs, CudaGraphCache) and graphs.buckets == [1, 2, 4]
    # one scratch block and one scratch slot beyond the eager engine's caches, never handed out
    assert engine.cache_engine.kv_buf.shape[0] == eager.cache_engine.kv_buf.shape[0] + 1 == 97
    slots = engine.cache_engine.state_buf.shape[0]
    if arch == 'qwen3':     # no state: no scratch slot, padding rows' slot -1 as every row's
        assert slots == 0 and (graphs.scratch_block, graphs.scratch_slot) == (96, None)
    else:
        assert slots == eager.cache_engine.state_buf.shape[0] + 1
        assert (graphs.scratch_block, graphs.scratch_slot) == (96, slots - 1)
    assert engine.block_manager.num_blocks == 96
    # buckets 1, 4 (batch 3) and 2 captured once each; every decode step after that replayed
    counters = graphs.counters()
    assert {k: counters[k] for k in ('captures', 'replays', 'refusals', 'evictions', 'graphs')} == \
        dict(captures=3, replays=27, refusals=0, evictions=0, graphs=3)
    assert graphs.calls_per_replay() == [(0, 0)] * 3


def test_capture_that_raises_runs_eagerly_for_good(family_paths, monkeypatch, caplog):
    path = family_paths('qwen3_next', {})
    eager_logits, eager_tokens, _ = _decode(path, None, monkeypatch)
    with caplog.at_level(logging.WARNING, logger='lmdeploy'):
        logits, tokens, engine = _decode(path, 'cuda', monkeypatch, backend=lambda device: StandIn(fail=True))
    assert tokens == eager_tokens and _same(logits, eager_logits)
    counters = engine.executor.worker.decode_graphs.counters()
    assert (counters['captures'], counters['refusals'], counters['replays']) == (3, 3, 0)
    warnings = [r.getMessage() for r in caplog.records if 'CUDA decode graph capture' in r.getMessage()]
    assert warnings == [f'CUDA decode graph capture for batch bucket {b} failed; it runs eagerly: RuntimeError: '
                        f'operation not permitted when stream is capturing' for b in (1, 4, 2)]


class _ReadsLengths(torch.nn.Module):
    """A forward that reads a per-step list in Python (a value a graph would bake in)."""

    def forward(self, ctx):
        return ctx.input_ids[:, None].float() * max(ctx.kv_seqlens)


def test_forward_reading_per_step_lists_is_refused(caplog):
    graphs = CudaGraphCache(_ReadsLengths(), max_blocks=8, max_batch=4, scratch_slot=9, scratch_block=63,
                            device=torch.device('cpu'), backend=StandIn())
    kv_caches, state_caches = [], []
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        for step in range(3):
            assert graphs.forward(_decode_batch(3, step), kv_caches, state_caches, 4) is None
    assert {k: v for k, v in graphs.counters().items() if k != 'bytes'} == \
        dict(captures=1, replays=0, refusals=1, evictions=0, graphs=1)
    assert graphs.backend.warmups == 2          # refused after the warm-up: never captured
    assert any('bucket 4 refused (runs eagerly): the forward read StepContext.kv_seqlens' in r.getMessage()
               for r in caplog.records)


class _BranchesOnPromptLens(torch.nn.Module):
    """A forward that branches on whether the step carries ``prompt_lens`` without reading one
    (as ``StepContext.prompt_token_mask`` does): nothing a graph refuses."""

    def forward(self, ctx):
        return ctx.input_ids[:, None].float() + (100.0 if ctx.prompt_lens else 0.0)


def test_the_capture_takes_the_steps_branch_on_prompt_lens():
    """The capture ran on a padding batch without ``prompt_lens`` while every engine step
    carries them: a forward branching on their presence replayed the other branch (each row
    100 off its eager value). The batch captured now carries them exactly when the step does."""
    model = _BranchesOnPromptLens()
    graphs = CudaGraphCache(model, max_blocks=8, max_batch=4, scratch_slot=9, scratch_block=63,
                            device=torch.device('cpu'), backend=StandIn())
    kv_caches, state_caches = [], []
    for step in range(3):
        for lens in ([], [9, 9, 9]):
            batch = replace(_decode_batch(3, step), prompt_lens=lens)
            eager = model(batch.context(torch.device('cpu'), kv_caches, state_caches, 4))
            assert torch.equal(graphs.forward(batch, kv_caches, state_caches, 4), eager), (step, lens)
    assert graphs.counters()['captures'] == 2 and graphs.replays == 6


def test_which_graphs_an_engine_runs():
    cfg = SimpleNamespace(eager_mode=False, tp=1, speculative_config=None)
    assert decode_graphs_kind(torch.device('cuda'), cfg) == 'cuda'
    assert decode_graphs_kind(torch.device('cpu'), cfg) == 'cpu'
    assert decode_graphs_kind(torch.device('meta'), cfg) is None
    assert decode_graphs_kind(torch.device('cuda'), replace_ns(cfg, eager_mode=True)) is None
    assert decode_graphs_kind(torch.device('cuda'), replace_ns(cfg, tp=2)) is None
    assert decode_graphs_kind(torch.device('cuda'), replace_ns(cfg, speculative_config=object())) is None


def replace_ns(ns: SimpleNamespace, **fields) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(ns), **fields})


def test_eager_mode_engine_has_no_graphs_and_no_scratch_rows(family_paths):
    engine = make_engine(family_paths('qwen3_next', {}), block_size=4, max_batch_size=4, num_gpu_blocks=96,
                         eager_mode=True)
    assert engine.executor.worker.decode_graphs is None
    assert engine.cache_engine.kv_buf.shape[0] == 96


def test_sorted_moe_counts_rows_without_bincount(monkeypatch):
    """The MoE layer CUDA runs (``moe_experts_sorted``) counts rows per expert without
    ``torch.bincount``, which on CUDA reads the largest index back to the host: a capture would
    fail and every MoE family would run eagerly. Same result as the per-token form."""
    from lmdeploy.pytorch.kernels.moe import moe_experts_one_token, moe_experts_sorted

    def refused(*args, **kwargs):
        raise AssertionError('torch.bincount synchronises on CUDA')
    gen = torch.Generator().manual_seed(0)
    E, H, I, T, k = 6, 16, 8, 5, 2
    x, gate_up, down = torch.randn(T, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen), \
        torch.randn(E, H, I, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    monkeypatch.setattr(torch, 'bincount', refused)
    out = moe_experts_sorted(x, index, weights, gate_up, down)
    expected = torch.cat([moe_experts_one_token(x[t:t + 1], index[t:t + 1], weights[t:t + 1], gate_up, down)
                          for t in range(T)])
    assert torch.equal(out, expected)


# --- the expert layers that read their routing on the host, on the CPU ---------------------------------
class _CaptureRefusesHostReads(StandIn):
    """The stand-in whose capture raises as a CUDA stream capture does when the forward reads a
    tensor's data on the host (tests/host_reads.py); the warm-up, as on a GPU, may."""

    def capture(self, graph, fn):
        from host_reads import HostReads
        with HostReads() as reads:
            output = super().capture(graph, fn)
        if reads.seen:
            raise RuntimeError(f'operation not permitted when stream is capturing ({reads.seen[0]})')
        return output


# the two families and their expert layers' kernel ops (tiny models: 8 experts, top-2)
_EXPERT_FAMILIES = {'nemotron_h': 'relu2_experts', 'bailing_hybrid': 'limited_swiglu_experts'}


@pytest.mark.parametrize('arch', sorted(_EXPERT_FAMILIES))
def test_expert_layers_that_read_their_routing_capture_with_the_cuda_kernel(family_paths, monkeypatch, arch):
    """A Nemotron-H MoE (relu^2 experts) and a Ling 3 (bailing_hybrid, limited SwiGLU experts)
    decode through the CUDA graph cache with the expert kernel CUDA picks forced on the CPU (the
    rest of the forward is the CPU's, whose decode graphs replay these families): with the loop
    (what CUDA ran before: ``bincount(...).tolist()``) every bucket's capture reads the routing
    on the host and is refused (every step eager: logits equal bit for bit); with the registry's
    CUDA kernel a bucket is refused exactly when its pairs are too many for the gathered form
    (none at the default limit; with the limit lowered to 2 tokens' pairs, bucket 4) and every
    step after a capture replays. Tokens equal the eager run's; logits to 1e-5 of their scale:
    for these families a replayed step differs from the eager one by 1e-6-level float32 rounding even with the CPU's
    native expert kernel (measured: the static-input forward takes other kernel paths than an
    eager step outside the expert layer), while a wrong expert or weight moves them by O(1e-1)."""
    from lmdeploy.pytorch.kernels import get_kernel, moe
    from lmdeploy.pytorch.models import nemotron_h
    from lmdeploy.pytorch.models.blocks import moe as moe_blocks
    op = _EXPERT_FAMILIES[arch]
    path = family_paths(arch, {})
    config = make_engine(path, block_size=4, max_batch_size=4, num_gpu_blocks=96,
                         eager_mode=True).model_runner.model.config
    E = config.n_routed_experts if arch == 'nemotron_h' else config.num_experts
    k = config.num_experts_per_tok if arch == 'nemotron_h' else config.num_experts_per_token
    buckets = (1, 4, 2)     # SCHEDULE's batches 1, 3, 2, 1
    arms = (('loop', getattr(moe, f'{op}_loop'), moe.GATHER_PAIRS_PER_EXPERT),
            ('cuda', get_kernel(op, 'cuda'), moe.GATHER_PAIRS_PER_EXPERT),
            ('cuda, gathered up to 2 tokens', get_kernel(op, 'cuda'), 2 * k / E))
    for name, kernel, pairs_per_expert in arms:
        def forced(kernel_name, device='cpu', kernel=kernel):
            return kernel if kernel_name == op else get_kernel(kernel_name, device)
        for module in (nemotron_h, moe_blocks):
            monkeypatch.setattr(module, 'get_kernel', forced)
        monkeypatch.setattr(moe, 'GATHER_PAIRS_PER_EXPERT', pairs_per_expert)
        eager_logits, eager_tokens, _ = _decode(path, None, monkeypatch)
        logits, tokens, engine = _decode(path, 'cuda', monkeypatch, backend=lambda device: _CaptureRefusesHostReads())
        assert tokens == eager_tokens, name
        assert len(logits) == len(eager_logits)
        for step, (got, want) in enumerate(zip(logits, eager_logits)):
            assert (got is None) == (want is None), (name, step)
            if got is not None and name == 'loop':       # every step eager in both runs
                assert torch.equal(got, want), (name, step, (got - want).abs().max())
            elif got is not None:
                scale = max(1.0, want.abs().max().item())
                assert torch.allclose(got, want, rtol=0, atol=1e-5 * scale), (name, step, (got - want).abs().max())
        counters = engine.executor.worker.decode_graphs.counters()
        refused = len(buckets) if name == 'loop' else sum(not moe.gathered_applies(b, k, E) for b in buckets)
        assert refused == {'loop': 3, 'cuda': 0}.get(name, 1), (name, refused)      # bucket 4 alone: 8 pairs > 4
        assert (counters['captures'], counters['refusals']) == (len(buckets), refused), (name, counters)
        assert counters['replays'] == {0: 27, 1: REPLAYS_WITHOUT_BUCKET_4}.get(refused, 0), (name, counters)
