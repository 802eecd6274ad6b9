"""CPU decode graphs (lmdeploy/pytorch/engine/decode_graph.py): a replayed decode step gives the
eager step's logits bit for bit in every family with a native decode path, through block
boundaries and sequences joining and leaving (graphs recorded, replayed and evicted), and a
forward a replay could not repeat is refused and still gives the eager result."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_utils import make_engine, random_prompt, run_schedule
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.engine.decode_graph import NATIVE_BINARY_MAX, DecodeGraphCache, _native_binary, decode_graph_key
from lmdeploy.pytorch.kernels import cpu_native
from lmdeploy.pytorch.model_inputs import StepBatch

pytestmark = pytest.mark.skipif(cpu_native.native_library() is None, reason='graphs need the native CPU kernels')

# (arrival step, prompt tokens, new tokens): one sequence alone, two join (batch 3 for 40+ steps),
# the middle one leaves (batch 2 on state slots 0 and 2: no range), then the first is alone again;
# block size 4 puts a boundary every 4 steps
SCHEDULE = ((0, 5, 84), (12, 6, 44), (13, 3, 58))


def _decode(path: str, eager: bool) -> tuple[list, list[list[int]], dict | None]:
    """Per-step sampled logits, every sequence's tokens and the graph counters of SCHEDULE."""
    engine = make_engine(path, eager_mode=eager, block_size=4, max_batch_size=4, num_gpu_blocks=96)
    graphs = engine.executor.worker.decode_graphs
    assert (graphs is None) == eager
    if graphs is not None:
        graphs.max_graphs = 2       # keys 1, 3, 2, 1 in turn: graphs are evicted and recorded again
    logits, tokens = run_schedule(engine, SCHEDULE)
    return logits, tokens, None if graphs is None else graphs.counters()


# Nemotron-H with dense MLPs only (Nemotron-H; the tiny default has a Nemotron-3 MoE layer, whose
# relu^2 experts replay as one native call)
DENSE_NEMOTRON = dict(layers_block_type=['linear_attention', 'mlp', 'full_attention', 'linear_attention', 'mlp'])
# 81 decode steps: batch 1 (11 steps), 3 (43), 2 (13), 1 again (14, its graph evicted in between);
# each key's first step eager, the next two recorded, the rest (69) replayed
REPLAYED = dict(captures=8, replays=69, refusals=0, evictions=2, graphs=2)
# GLM-5.3-Flash replays too: its DSA layers' decode step reads the lengths and block tables as
# tensors only (the indexer's pools over the block table, a fixed [B, index_topk // pool]
# selection, attention over the selected latent rows: lmdeploy/pytorch/kernels/dsa_decode.py),
# and its image check looks at the sequences before reading any length. The first sequence grows
# to 88 cached tokens (11 pools of 8, index_topk 64 keeps 8), so its late replayed steps select
# sparsely.


@pytest.mark.parametrize('arch, overrides, expected', [
    ('qwen3_next', {}, REPLAYED), ('qwen3_5_moe_text', {}, REPLAYED), ('kimi_linear', {}, REPLAYED),
    ('nemotron_h', DENSE_NEMOTRON, REPLAYED), ('granitemoehybrid', {}, REPLAYED), ('qwen3', {}, REPLAYED),
    ('nemotron_h', {}, REPLAYED), ('bailing_hybrid', {}, REPLAYED), ('glm5_next', {}, REPLAYED)])
def test_replayed_decode_equals_eager_bit_for_bit(family_paths, arch, overrides, expected):
    path = family_paths(arch, overrides)
    eager_logits, eager_tokens, _ = _decode(path, eager=True)
    graph_logits, graph_tokens, counters = _decode(path, eager=False)
    assert graph_tokens == eager_tokens
    assert len(graph_logits) == len(eager_logits)
    for step, (g, e) in enumerate(zip(graph_logits, eager_logits)):
        assert (g is None) == (e is None), step
        assert g is None or torch.equal(g, e), (step, (g - e).abs().max().item())
    assert counters == expected


# --- refusals, on a toy model over a hand-built decode batch -----------------------------------
class _Toy(torch.nn.Module):
    """Embedding, one native product and one native RMS norm, plus a position term; ``fault``
    adds something a replay cannot repeat."""

    def __init__(self, fault: str | None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16)
        self.emb.weight.data = torch.randn(32, 16, generator=gen)
        self.w = torch.nn.Parameter(torch.randn(16, 16, generator=gen), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.rand(16, generator=gen), requires_grad=False)
        self.fault, self.calls = fault, 0

    def forward(self, ctx):
        self.calls += 1
        h = cpu_native.matmul_rows(self.emb(ctx.input_ids), self.w)
        eps = 1e-6 * self.calls if self.fault == 'baked int' else 1e-6   # a per-step value in a native call
        h = cpu_native.rms_norm_native(h, self.norm, eps, False)
        if self.fault == 'python data':
            h = h + torch.tensor([0.5])
        if self.fault == 'mask':        # a boolean mask: the output's shape depends on the data
            h = h[h[:, 0] > -1e9]
        if self.fault == 'lengths':
            h = h * len(range(ctx.kv_seqlens[0]))
        return h + ctx.positions[:, None].to(h.dtype) * 0.25


def _batches(steps: int, batch: int = 2) -> list[StepBatch]:
    """Decode batches of ``batch`` sequences at growing lengths (block size 4, state slots 0..B-1)."""
    out = []
    for s in range(steps):
        kv = [7 + s + i for i in range(batch)]
        out.append(StepBatch(input_ids=[(3 * s + i) % 32 for i in range(batch)], positions=[k - 1 for k in kv],
                             q_seqlens=[1] * batch, q_start_loc=list(range(batch)), kv_seqlens=kv,
                             block_tables=[list(range(i * 8, i * 8 + -(-k // 4))) for i, k in enumerate(kv)],
                             state_slots=list(range(batch)), sample_rows=list(range(batch))))
    return out


@pytest.mark.parametrize('fault, reason', [(None, None), ('python data', 'aten.lift_fresh'),
                                           ('baked int', 'two decode steps recorded different'),
                                           ('lengths', 'StepContext.kv_seqlens'), ('mask', 'aten.index.Tensor')])
def test_refused_forward_still_gives_the_eager_result(fault, reason, caplog):
    model, reference = _Toy(fault), _Toy(fault)
    graphs = DecodeGraphCache(model, max_blocks=8)
    kv_caches, state_caches = [], []
    with caplog.at_level(logging.DEBUG, logger='lmdeploy'), torch.inference_mode():
        for batch in _batches(7):
            assert decode_graph_key(batch) == (2, 0, True, torch.get_num_threads())
            hidden = graphs.forward(batch, kv_caches, state_caches, 4)
            if hidden is None:
                hidden = model(batch.context(torch.device('cpu'), kv_caches, state_caches, 4))
            expected = reference(batch.context(torch.device('cpu'), kv_caches, state_caches, 4))
            assert torch.equal(hidden, expected)
    counters = graphs.counters()
    if fault is None:
        # step 1 eager, steps 2-3 recorded, 4-7 replayed (the model's Python does not run)
        assert counters == dict(captures=2, replays=4, refusals=0, evictions=0, graphs=1)
        assert model.calls == 3
    else:
        assert counters['refusals'] == 1 and counters['replays'] == 0, counters
        assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_graph_keys():
    (batch,) = _batches(1)
    assert decode_graph_key(replace(batch, q_seqlens=[2, 1])) is None            # a prefill chunk
    assert decode_graph_key(replace(batch, kv_seqlens=[1, 9])) is None           # no history
    assert decode_graph_key(replace(batch, all_logits=True)) is None
    assert decode_graph_key(replace(batch, prompt_rows=[0])) is None
    threads = torch.get_num_threads()
    assert decode_graph_key(replace(batch, state_slots=[1, 0])) == (2, 0, False, threads)   # a range out of order
    assert decode_graph_key(replace(batch, state_slots=[5, 2])) == (2, None, True, threads)  # no range
    assert decode_graph_key(replace(batch, window_block_tables=[[0], [1]])) is None


def test_prefix_cache_on_equals_off_with_graphs_replaying(family_paths):
    """A 3-turn chat (12 new tokens a turn) gives the eager engine's replies with graphs on, the
    prefix cache off and on (hits on the later turns), the decode steps replayed."""
    path = family_paths('qwen3_next', {})
    users = [random_prompt(n, seed=60 + i) for i, n in enumerate((40, 30, 20))]
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    replies, hits, counters = {}, {}, {}
    for name, fields in {'eager': dict(eager_mode=True), 'graphs': {},
                         'graphs, cache on': dict(enable_prefix_caching=True)}.items():
        engine = make_engine(path, block_size=16, max_prefill_token_num=32, prefill_save_alignment=16,
                             num_checkpoint_slots=16, **fields)
        ids, replies[name], hits[name] = [], [], []
        for user in users:
            seq = engine.generate(ids + user, gen)
            replies[name].append(seq.output_ids)
            hits[name].append(seq.num_cached_tokens)
            ids = list(seq.token_ids)
        graphs = engine.executor.worker.decode_graphs
        counters[name] = None if graphs is None else graphs.counters()
    assert replies['graphs'] == replies['eager'] and replies['graphs, cache on'] == replies['eager']
    assert hits['graphs'] == [0, 0, 0] and hits['graphs, cache on'][0] == 0 and all(hits['graphs, cache on'][1:])
    assert counters['eager'] is None
    # 11 decode steps a turn, one batch-1 key: 1 eager + 2 recorded, then every step replayed
    assert counters['graphs'] == dict(captures=2, replays=30, refusals=0, evictions=0, graphs=1)
    assert counters['graphs, cache on'] == counters['graphs']


def test_slots_out_of_order_replay_equals_eager(family_paths):
    """Decode steps whose state slots are one range out of order (the state kernels then take the
    permutation sorting them, a static input of the graph) replay the eager logits bit for bit."""
    engine = make_engine(family_paths('qwen3_next', {}), block_size=4, max_batch_size=4, num_gpu_blocks=64)
    worker = engine.executor.worker
    ce, graphs = worker.cache_engine, worker.decode_graphs
    ce.kv_buf.zero_()
    ce.state_buf.zero_()
    start = (ce.kv_buf.clone(), ce.state_buf.clone())

    def run() -> list[torch.Tensor]:
        ce.kv_buf.copy_(start[0])
        ce.state_buf.copy_(start[1])
        tokens, out = [7, 11], []
        for step in range(8):
            kv = [5 + step, 9 + step]          # boundaries at 8 and 12 tokens (block size 4)
            batch = StepBatch(input_ids=tokens, positions=[k - 1 for k in kv], q_seqlens=[1, 1], q_start_loc=[0, 1],
                              kv_seqlens=kv, block_tables=[[0, 1, 2, 3], [10, 11, 12, 13, 14]],
                              state_slots=[3, 2], sample_rows=[0, 1])
            logits = worker.forward(batch)[0]
            out.append(logits.clone())
            tokens = logits.argmax(-1).tolist()
        return out

    worker.decode_graphs = None
    eager = run()
    worker.decode_graphs = graphs
    replayed = run()
    assert all(torch.equal(g, e) for g, e in zip(replayed, eager))
    assert graphs.counters() == dict(captures=2, replays=5, refusals=0, evictions=0, graphs=1)
    assert list(graphs.graphs) == [(2, 2, False, torch.get_num_threads())]


# --- same-shape float32 sums and products replayed by the native library ----------------------
_aten = torch.ops.aten
_SPECIALS = [0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, float('inf'), float('-inf'), float('nan'), 1.0, -2.5]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.sampled_from(['add', 'mul']), st.sampled_from(['out', 'in place', 'into b']),
       st.integers(0, 2 ** 31))
def test_native_binary_step_equals_torch_bit_for_bit(n, op, where, seed):
    """A replay step :func:`_native_binary` makes writes what torch's add / mul writes, bit for bit
    (NaN payloads aside), in place or not, over random values with subnormals, zeros of both signs,
    infinities, NaNs and overflowing products."""
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-40, 39, (n,), generator=gen) for _ in range(2))
    picks = torch.randint(0, 4 * len(_SPECIALS), (2, n), generator=gen)
    for t, p in zip((a, b), picks):
        hit = p < len(_SPECIALS)
        t[hit] = torch.tensor(_SPECIALS)[p[hit]]
    a, b = a.reshape(1, n), b.reshape(1, n)
    expected = a + b if op == 'add' else a * b
    lib = cpu_native.native_library()
    if where == 'in place':
        func, args, out = (_aten.add_.Tensor if op == 'add' else _aten.mul_.Tensor), (a, b), a
    else:
        func, args = (_aten.add.Tensor if op == 'add' else _aten.mul.Tensor), (a, b)
        out = b if where == 'into b' else torch.empty_like(a)
    step = _native_binary(func, args, {}, out, lib)
    assert step is not None and step[0] is lib.lm_binary_f32
    assert step[0](*step[1]) is None
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_native_binary_keeps_torch_for_what_it_does_not_redo_exactly():
    """Broadcasts, scalars, other dtypes, strided operands, an alpha, partial overlaps, sizes above
    the bound and a library without the entry point keep the torch op (None)."""
    lib = cpu_native.native_library()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    out = torch.empty(2, 8)
    add = _aten.add.Tensor
    assert _native_binary(add, (x, y), {}, out, lib) is not None
    assert _native_binary(add, (x, y), {'alpha': 1}, out, lib) is not None
    assert _native_binary(_aten.sub.Tensor, (x, y), {}, out, lib) is None
    assert _native_binary(add, (x, y), {'alpha': 2}, out, lib) is None
    assert _native_binary(add, (x, torch.randn(1, 8)), {}, out, lib) is None          # broadcast
    assert _native_binary(_aten.mul.Tensor, (x, 2.0), {}, out, lib) is None             # scalar
    assert _native_binary(add, (x.double(), y.double()), {}, out.double(), lib) is None
    assert _native_binary(add, (x.t(), y.t()), {}, out.t(), lib) is None                # strided
    assert _native_binary(add, (x, y), {}, None, lib) is None
    big = torch.empty(NATIVE_BINARY_MAX + 1)
    assert _native_binary(add, (big, big), {}, torch.empty_like(big), lib) is None
    assert _native_binary(add, (torch.empty(0), torch.empty(0)), {}, torch.empty(0), lib) is None
    base = torch.randn(17)
    assert _native_binary(add, (base[:16], y.reshape(16)), {}, base[1:], lib) is None   # partial overlap
    assert _native_binary(_aten.add_.Tensor, (base[:16], base[:16]), {}, base[:16], lib) is not None

    class _Old:     # a library built from an earlier source
        pass
    assert _native_binary(add, (x, y), {}, out, _Old()) is None


def test_a_replay_runs_the_residual_sums_natively(family_paths):
    """A ready Qwen3-Next batch-1 graph replays its same-shape sums and gates as native calls: no
    torch add or mul of float32 operands of one shape is left in it."""
    engine = make_engine(family_paths('qwen3_next', {}), block_size=4, max_batch_size=2, num_gpu_blocks=32)
    engine.generate(random_prompt(6, seed=3), GenerationConfig(max_new_tokens=8, ignore_eos=True))
    graphs = engine.executor.worker.decode_graphs
    (graph,) = [g for g in graphs.graphs.values() if g.state == 'ready']
    names = [getattr(fn, '__name__', str(fn)) for fn, *_ in graph.steps]
    assert names.count('lm_binary_f32') >= 2, names
    left = [(fn, args) for fn, args, extra, _ in graph.steps
            if isinstance(extra, dict) and fn in (_aten.add.out, _aten.mul.out, _aten.add_.Tensor, _aten.mul_.Tensor)
            and len(args) == 2 and all(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args)
            and args[0].shape == args[1].shape]
    assert not left, left


def test_a_decode_step_samples_hidden_itself_and_other_rows_are_gathered():
    """Every row in order, contiguous and aligned: ``hidden`` itself (no index tensor, no gather);
    any other selection, or a strided ``hidden``, the gathered rows."""
    from lmdeploy.pytorch.engine.rank import _rows_of
    hidden = torch.randn(4, 8)
    assert _rows_of(hidden, [0, 1, 2, 3]) is hidden
    for rows in ([0, 1, 2], [1, 2, 3], [3], [0, 2, 1, 3], [0, 1, 2, 2]):
        got = _rows_of(hidden, rows)
        assert got.data_ptr() != hidden.data_ptr() and torch.equal(got, hidden[rows])
    strided = torch.randn(8, 4).t()
    got = _rows_of(strided, [0, 1, 2, 3])
    assert got is not strided and got.is_contiguous() and torch.equal(got, strided)
