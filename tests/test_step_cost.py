"""The engine's own per-step work around the forward (issue 45): a decode step costs its bytes.

- the sampler's all-greedy path (:func:`greedy_tokens`, one ``max`` reduction) picks, for any
  logits (ties, NaN, ±inf, float32 / bfloat16 / float16), exactly the token of the full path
  (:func:`target_distribution` of a greedy request); a mixed batch samples every row as that row
  alone would (seeded sampling, penalties, logprobs, ``min_tokens`` beside plain greedy rows);
- an all-greedy batch dispatches one torch op in the sampler, and a decode step of the engine
  one torch op outside the worker's forward (the old path ran five: row gather, ``nan_to_num``,
  ``argmax``, the index tensor, the row iterator; each costs tens of microseconds on a CPU whose
  caches the forward has just flushed);
- the scheduler's decode shortcut (:meth:`Scheduler._decode_chunk`) schedules exactly what the
  general path schedules, over random request streams on small pools (preemption, recompute
  plans, drafts, a sliding-window table), and it is taken for every steady decode step.
"""
from __future__ import annotations

import collections

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from engine_utils import assert_idle, make_engine, random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.config import SchedulerConfig
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.sequence import Sequence
from lmdeploy.pytorch.prefix_cache.null_cache import NullPrefixCache
from lmdeploy.pytorch.sampling.sampler import greedy_tokens, sample, target_distribution

INF, NAN = float('inf'), float('nan')


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (``ops``: name → count)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- the sampler
def _logits(data, rows: int, vocab: int) -> torch.Tensor:
    """Random small-integer logits (so ties are common) with NaN, +inf and -inf sprinkled in,
    and sometimes a whole row of NaN or of -inf."""
    values = data.draw(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, NAN, INF, -INF]),
                                min_size=rows * vocab, max_size=rows * vocab))
    out = torch.tensor(values).view(rows, vocab)
    for r in range(rows):
        special = data.draw(st.sampled_from([None, None, NAN, -INF]))
        if special is not None:
            out[r] = special
    return out


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 40), dtype=st.sampled_from(['float32', 'bfloat16', 'float16']),
       data=st.data())
def test_greedy_tokens_are_the_full_paths_tokens(rows, vocab, dtype, data):
    logits = _logits(data, rows, vocab).to(getattr(torch, dtype))
    seq = Sequence([0], GenerationConfig())
    want = [target_distribution(row, seq)[0] for row in logits.float()]
    assert greedy_tokens(logits) == want
    tokens, logprobs = sample(logits, [seq] * rows)
    assert tokens == want and logprobs == [None] * rows


_KINDS = {      # GenerationConfig fields of each kind of row in a mixed batch
    'plain': {},
    'logprobs': dict(logprobs=2),
    'sampled': dict(do_sample=True, temperature=0.8, top_k=5, top_p=0.9),
    'penalised': dict(repetition_penalty=1.3, presence_penalty=0.5),
    'min_tokens': dict(min_tokens=3),
    'biased': dict(logit_bias={1: 5.0}),
}


@settings(max_examples=80, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(_KINDS)), min_size=1, max_size=6), seed=st.integers(0, 2 ** 31 - 1),
       data=st.data())
def test_a_mixed_batch_samples_each_row_as_alone(kinds, seed, data):
    vocab = 12
    logits = _logits(data, len(kinds), vocab) if data.draw(st.booleans()) else \
        torch.randn(len(kinds), vocab, generator=torch.Generator().manual_seed(seed))

    def seqs():     # fresh sequences (their own seeded generators), eos 2, one generated token
        out = []
        for i, kind in enumerate(kinds):
            seq = Sequence([3, 4, 1], GenerationConfig(random_seed=seed + i, **_KINDS[kind]),
                           eos_token_ids=frozenset({2}))
            seq.token_ids.append(4)
            out.append(seq)
        return out

    tokens, logprobs = sample(logits.clone(), seqs())
    alone = [sample(logits[i:i + 1].clone(), [s]) for i, s in enumerate(seqs())]
    assert tokens == [t for (t,), _ in alone]
    assert logprobs == [lp for _, (lp,) in alone]
    assert [lp is not None for lp in logprobs] == [k == 'logprobs' for k in kinds]


def test_an_all_greedy_batch_costs_one_reduction():
    """Regression: the all-greedy batch ran five torch ops (and iterated its rows); now one."""
    for rows in (1, 16):
        logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(rows))
        seqs = [Sequence([0], GenerationConfig(max_new_tokens=9)) for _ in range(rows)]
        with OpCounter() as counter:
            tokens, _ = sample(logits, seqs)
        assert dict(counter.ops) == {'aten.max.dim': 1}
        assert tokens == logits.argmax(-1).tolist()


def test_a_decode_step_dispatches_one_op_outside_the_forward(tiny_qwen3_next):
    """Three greedy requests decoding on the tiny Qwen3-Next: a decode step's torch work outside
    the worker's forward is the sampler's one reduction (the forward is replaced by fixed logits
    so that only the engine's own ops are counted); the requests still finish, the engine idles."""
    engine = make_engine(tiny_qwen3_next, max_batch_size=4, enable_prefix_caching=False)
    seqs = [engine.add_request(random_prompt(20 + i, seed=i), GenerationConfig(max_new_tokens=8, ignore_eos=True))
            for i in range(3)]
    engine.step()                   # the prompts (one prefill forward)
    worker, forward = engine.executor.worker, engine.executor.worker.forward
    fixed = torch.randn(3, engine.vocab_size, generator=torch.Generator().manual_seed(0))
    want = fixed.argmax(-1).tolist()
    worker.forward = lambda batch: (fixed, None, None)
    try:
        for _ in range(3):
            with OpCounter() as counter:
                outputs = engine.step()
            assert dict(counter.ops) == {'aten.max.dim': 1}
            assert [o.new_token_ids for o in outputs] == [[t] for t in want]
    finally:
        worker.forward = forward
    while engine.has_work:
        engine.step()
    assert [s.num_generated for s in seqs] == [8, 8, 8]
    assert_idle(engine)


# ---------------------------------------------------------------- the scheduler's decode shortcut
class _General(Scheduler):
    """The scheduler without its decode shortcut: every running sequence takes the general path."""

    def _decode_chunk(self, seq):
        return None


class _Counting(Scheduler):
    """The scheduler, counting the sequences its decode shortcut scheduled."""
    shortcuts = 0

    def _decode_chunk(self, seq):
        chunk = super()._decode_chunk(seq)
        self.shortcuts += chunk is not None
        return chunk


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=5), chunk=st.sampled_from([1, 8, 16, 40]),
       spare=st.integers(0, 12), batch=st.integers(1, 4), window=st.sampled_from([None, 20]),
       drafts=st.booleans(), data=st.data())
def test_the_decode_shortcut_schedules_what_the_general_path_does(lengths, chunk, spare, batch, window, drafts, data):
    """Two schedulers, one without the shortcut, run the same request stream in lock step (new
    tokens appended, random drafts proposed and rejected, finished requests released; a pool
    that may be short, so sequences are preempted and recompute their replies): every step they
    schedule the same chunks with the same drafts, and hold the same blocks."""
    B = 16
    generated = [data.draw(st.integers(1, 12)) for _ in lengths]
    draft_plan = [data.draw(st.lists(st.integers(0, 3), min_size=80, max_size=80)) if drafts else [0] * 80
                  for _ in lengths]
    blocks = -(-(max(lengths) + 12 + 3) // B) + spare
    cfg = SchedulerConfig.from_engine_config(PytorchEngineConfig(block_size=B, max_prefill_token_num=chunk,
                                                                 max_batch_size=batch))
    runs = []
    for cls in (_General, _Counting):
        sched = cls(cfg, BlockManager(blocks), None, NullPrefixCache(), window=window)
        seqs = [Sequence(random_prompt(n, seed=i), GenerationConfig(max_new_tokens=g))
                for i, (n, g) in enumerate(zip(lengths, generated))]
        for seq in seqs:
            sched.add(seq)
        runs.append((sched, seqs, []))
    for step in range(2_000):
        if not runs[0][0].has_work:
            break
        views = []
        for sched, seqs, log in runs:
            index = {id(s): i for i, s in enumerate(seqs)}
            out = sched.schedule()
            view = [(index[id(c.seq)], c.start, c.end, c.drafts) for c in out.chunks]
            views.append((view, [list(s.block_ids) for s in seqs], sched.block_manager.num_free))
            sched.computed(out)
            for c in out.chunks:
                seq = c.seq
                seq.draft_ids = []
                if c.sample:
                    seq.token_ids.append(5)
                    if seq.num_generated >= seq.gen_config.max_new_tokens:
                        sched.finish(seq, 'length')
                    else:       # drafts for the next step (never accepted here)
                        seq.draft_ids = [6] * draft_plan[index[id(seq)]][step % 80]
        assert views[0] == views[1], step
    assert not runs[0][0].has_work and not runs[1][0].has_work
    for sched, seqs, _ in runs:
        assert [s.num_generated for s in seqs] == generated
        assert sched.block_manager.num_free == blocks
    if not drafts and sum(generated) > 2 * len(lengths):
        assert runs[1][0].shortcuts > 0


def test_steady_decode_takes_the_shortcut_for_every_sequence():
    """Four sequences past their prompts, blocks in hand: every one is scheduled by the shortcut
    (no block reservation, no plan lookup), one token each; at a block boundary the general path
    allocates the next block."""
    B = 16
    cfg = SchedulerConfig.from_engine_config(PytorchEngineConfig(block_size=B, max_batch_size=4))
    sched = _Counting(cfg, BlockManager(64), None, NullPrefixCache())
    seqs = [Sequence(random_prompt(10 + i, seed=i), GenerationConfig()) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()           # the prompts
    assert [(c.start, c.end) for c in out.chunks] == [(0, 10), (0, 11), (0, 12), (0, 13)]
    sched.computed(out)
    for seq in seqs:
        seq.token_ids.append(5)
    out = sched.schedule()
    assert sched.shortcuts == 4 and [(c.start, c.end) for c in out.chunks] == [(10, 11), (11, 12), (12, 13), (13, 14)]
    sched.computed(out)
    for seq in seqs:
        seq.token_ids.extend([5] * (16 - seq.num_tokens + 1))   # 17 tokens: the next one needs block 1
        seq.num_computed_tokens = 16
    out = sched.schedule()
    assert sched.shortcuts == 4 and [len(s.block_ids) for s in seqs] == [2, 2, 2, 2]
    assert [(c.start, c.end) for c in out.chunks] == [(16, 17)] * 4
