"""Admission cannot livelock (issue 12): every request that fits the KV pool alone finishes in
a bounded number of steps, with the tokens of a cache-off run, and the ledger returns to idle.

The regressions are the issue's failing inputs, each run with a step bound so that a livelock
fails the test instead of hanging it:

- a prompt repeated on a tight pool with no usable checkpoint (no checkpoint slots, or
  last-only with one slot and prompts X, Y, X): the repeat recomputed blocks the prefix cache
  already held into private blocks, the old copies became interior cache nodes nobody
  references and nobody may evict, and the sequence preempted itself forever;
- the same through the HTTP server (``--num-gpu-blocks 8``, the second request hung);
- a request with a Store hit whose first chunk cannot be allocated yet: it must not read its
  prefix from the Store on every step, nor evict cached blocks for an admission that fails;
- Store hit tokens of a request that is preempted and re-admitted count once.

The properties run random request streams (shared prefixes, so repeats and branches occur) on
a small pool and check after every step that no cache node is both unreferenced and
unevictable: eviction can free every block only the cache references, and the engine's count
of evictable blocks (what admission relies on) is exact.

Geometry: B = 16 tokens per block, A = 64, P = 64 tokens per prefill chunk.
"""
from __future__ import annotations

import copy
import time

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine_utils import StepRecorder, make_engine, random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from server_utils import ApiServer

B, A, P = 16, 64, 64
TIGHT = dict(block_size=B, prefill_save_alignment=A, max_prefill_token_num=P, enable_prefix_caching=True)
MAX_STEPS = 300


# engine internals ----------------------------------------------------------------------------
def _nodes(engine: Engine) -> list:
    """The local prefix cache's trie nodes (none with caching off)."""
    return engine.prefix_cache.cached_nodes()


def _store_client(engine: Engine):
    """The Store client of an engine with the Store tier (its ``get`` reads one object)."""
    return engine.store.client


def _flush(engine: Engine) -> bool:
    """Wait until the Store tier's queued saves ran."""
    return engine.store.flush(timeout=30)


def assert_cache_evictable(engine: Engine) -> None:
    """No cache node is both unreferenced and unevictable: the engine's count of evictable blocks
    equals the cache nodes only the cache references (block refcount 1; no pin outlives a step),
    and evicting everything from a copy of the cache frees exactly those blocks."""
    cache = engine.prefix_cache                 # a NullPrefixCache with caching off: no node
    refcount = engine.block_manager.refcount
    unreferenced = [n.block_id for n in _nodes(engine) if refcount[n.block_id] == 1]
    assert cache.num_evictable_blocks == len(unreferenced), (cache.num_evictable_blocks, unreferenced)
    # copies the block pool and the slots with the cache; the Store tier (if any) is shared, not copied
    pool, clone = copy.deepcopy((engine.block_manager, cache), {id(cache.store): cache.store})
    freed = clone.evict(len(unreferenced) + 1)
    left = [n.block_id for n in clone.cached_nodes() if pool.refcount[n.block_id] == 1]
    assert freed == len(unreferenced) and not left, (
        f'cache blocks {left} are referenced only by the cache but eviction cannot free them')


def run_bounded(engine: Engine, arrivals: list[tuple[int, list[int], GenerationConfig]], max_steps: int,
                check_cache: bool = True) -> list:
    """Add request ``i`` before step ``arrivals[i][0]``; step until every request finished.

    Raises:
        AssertionError: a request has not finished after ``max_steps`` steps (a livelock), or
            the cache invariant of :func:`assert_cache_evictable` broke after a step.
    """
    seqs = [None] * len(arrivals)
    for step in range(max_steps + 1):
        for i, (at, ids, gen) in enumerate(arrivals):
            if seqs[i] is None and at <= step:
                seqs[i] = engine.add_request(ids, gen)
        if all(s is not None and s.is_finished for s in seqs):
            return seqs
        if step == max_steps:
            break
        engine.step()
        if check_cache:
            assert_cache_evictable(engine)
    late = [(i, len(arrivals[i][1]), s.num_computed_tokens) for i, s in enumerate(seqs) if not s.is_finished]
    raise AssertionError(f'requests (index, prompt tokens, computed) {late} did not finish in {max_steps} steps; '
                         f'ledger {engine.ledger()}')


def assert_idle(engine: Engine) -> None:
    led = engine.ledger()
    assert led['blocks_in_use'] == 0 and led['checkpoints_pinned'] == 0, led
    assert led['runtime_slots_free'] == led['runtime_slots_total'], led
    assert engine.is_idle(), led


def _cold_engine(model: str) -> Engine:
    return make_engine(model, block_size=B, max_prefill_token_num=P, num_gpu_blocks=256)


class Cold:
    """Greedy output ids with caching off (one engine, memoized per prompt)."""

    def __init__(self, model: str):
        self.engine = _cold_engine(model)
        self.memo: dict[tuple, list[int]] = {}

    def __call__(self, ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.memo.get(tuple(ids), [])
        if len(out) < max_new_tokens:   # greedy: a shorter run is a prefix of a longer one
            out = self.engine.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)).output_ids
            self.memo[tuple(ids)] = out
        return out[:max_new_tokens]


@pytest.fixture(scope='module')
def cold_next(tiny_qwen3_next) -> Cold:
    return Cold(tiny_qwen3_next)


@pytest.fixture(scope='module')
def cold_qwen3(tiny_qwen3) -> Cold:
    return Cold(tiny_qwen3)


# the inputs ---------------------------------------------------------------------------
def test_repeated_prompt_without_checkpoint_slots_finishes(tiny_qwen3_next, cold_next):
    eng = make_engine(tiny_qwen3_next, num_gpu_blocks=22, num_checkpoint_slots=0, **TIGHT)
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    x, y = random_prompt(300, seed=1), random_prompt(120, seed=2)
    (first,) = run_bounded(eng, [(0, x, gen)], MAX_STEPS, check_cache=False)
    # the repeat, and a request queued behind it that starved while the repeat spun
    again, behind = run_bounded(eng, [(0, x, gen), (0, y, gen)], MAX_STEPS, check_cache=False)
    assert first.output_ids == again.output_ids == cold_next(x, 4)
    assert behind.output_ids == cold_next(y, 4)
    assert_idle(eng)


def test_last_only_with_one_slot_serves_x_y_x(tiny_qwen3_next, cold_next):
    eng = make_engine(tiny_qwen3_next, num_gpu_blocks=22, num_checkpoint_slots=1, prefill_save_last_only=True,
                      **TIGHT)
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    x, y = random_prompt(300, seed=3), random_prompt(200, seed=4)
    for ids in (x, y, x):
        (seq,) = run_bounded(eng, [(0, ids, gen)], MAX_STEPS, check_cache=False)
        assert seq.output_ids == cold_next(ids, 4)
        assert_idle(eng)


def test_server_answers_a_repeated_prompt_on_eight_blocks(tiny_qwen3_next, cold_next):
    # 8 blocks of 16 tokens cap a sequence at 128 tokens: 100 prompt tokens, then 28 generated
    flags = ('--block-size', str(B), '--prefill-save-alignment', str(A), '--max-prefill-token-num', '128',
             '--num-gpu-blocks', '8', '--enable-prefix-caching')
    ids = random_prompt(100, seed=5)
    with ApiServer(tiny_qwen3_next, *flags) as server:
        status, models = server.get('/v1/models')
        assert status == 200, models
        body = dict(model=models['data'][0]['id'], prompt=ids, max_tokens=100, ignore_eos=True, temperature=0)
        replies = []
        for _ in range(2):
            status, reply = server.post('/v1/completions', body, timeout=20)   # a hang fails here
            assert status == 200, reply
            replies.append(reply)
        deadline = time.monotonic() + 10
        while not (ledger := server.get('/debug/ledger')[1])['blocks_in_use'] == 0:
            assert time.monotonic() < deadline, ledger
            time.sleep(0.05)
    first, second = (r['choices'][0] for r in replies)
    assert first['text'] == second['text'] and first['finish_reason'] == second['finish_reason'] == 'length'
    assert [r['usage']['completion_tokens'] for r in replies] == [28, 28]
    assert ledger['runtime_slots_free'] == ledger['runtime_slots_total'] and ledger['checkpoints_pinned'] == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_next)
    assert first['text'] == tokenizer.decode(cold_next(ids, 28), skip_special_tokens=True)


# request streams --------------------------------------------------------------------------------
PREFIXES = [random_prompt(288, seed=10 + i) for i in range(3)]
NUM_BLOCKS = 22     # 352 tokens: every request below fits alone; a few of them rarely fit together


@st.composite
def request_streams(draw):
    """3-6 requests ``(arrival step, prefix, cut, suffix tokens, suffix seed, max_new_tokens)``:
    a shared prefix cut at a random length (often a block or checkpoint boundary) plus a random
    suffix (suffix seeds repeat too, so whole prompts repeat). Compact, so that a falsifying
    example reads well; :func:`build` makes the token ids."""
    out = []
    for _ in range(draw(st.integers(3, 6))):
        cut = draw(st.sampled_from([0, 16, 64, 100, 128, 192, 256, 288]))
        out.append((draw(st.integers(0, 12)), draw(st.integers(0, len(PREFIXES) - 1)), cut,
                    draw(st.integers(0 if cut else 1, 60)), draw(st.integers(0, 3)), draw(st.integers(1, 8))))
    return out


def build(requests) -> list[tuple[int, list[int], int]]:
    """``(arrival step, prompt ids, max_new_tokens)`` per request; prompt + output fit the pool."""
    built = []
    for at, prefix, cut, suffix, seed, new in requests:
        ids = PREFIXES[prefix][:cut] + random_prompt(suffix, seed=seed)
        built.append((at, ids[:(NUM_BLOCKS - 1) * B - new], new))
    return built


def _steps_bound(requests) -> int:
    """Generous: every request computed alone three times over (prompt chunks + decode), after
    the last arrival."""
    alone = sum(-(-(len(ids) + new) // P) + new + 2 for _, ids, new in requests)
    return max(at for at, _, _ in requests) + 3 * alone + 50


def _check_stream(engine: Engine, cold: Cold, requests) -> None:
    requests = build(requests)
    arrivals = [(at, ids, GenerationConfig(max_new_tokens=new, ignore_eos=True)) for at, ids, new in requests]
    seqs = run_bounded(engine, arrivals, _steps_bound(requests))
    for seq, (_, ids, new) in zip(seqs, requests):
        assert seq.output_ids == cold(ids, new), (len(ids), new)
    assert_idle(engine)


STREAM_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                           phases=[Phase.explicit, Phase.generate],
                           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# the inputs as streams: X then X again beside Y; X, Y, X with last-only and one slot
X_X_Y = [(0, 0, 288, 12, 0, 4), (40, 0, 288, 12, 0, 4), (40, 1, 100, 20, 1, 4)]
X_Y_X = [(0, 0, 288, 12, 0, 4), (30, 1, 192, 8, 1, 4), (60, 0, 288, 12, 0, 4)]


@STREAM_SETTINGS
@given(requests=request_streams(), last_only=st.booleans(), slots=st.integers(0, 2))
@example(requests=X_X_Y, last_only=False, slots=0)
@example(requests=X_Y_X, last_only=True, slots=1)
def test_random_streams_finish_with_cache_off_tokens_on_qwen3_next(tiny_qwen3_next, cold_next, requests,
                                                                   last_only, slots):
    eng = make_engine(tiny_qwen3_next, num_gpu_blocks=NUM_BLOCKS, num_checkpoint_slots=slots,
                      prefill_save_last_only=last_only, max_batch_size=4, **TIGHT)
    _check_stream(eng, cold_next, requests)


@STREAM_SETTINGS
@given(requests=request_streams())
@example(requests=[(7, 2, 128, 46, 0, 2), (1, 2, 192, 57, 2, 6), (9, 2, 192, 41, 0, 6), (9, 2, 0, 21, 2, 7),
                   (9, 0, 128, 7, 3, 5), (4, 1, 256, 44, 2, 4)])      # found by this test on the old admission
def test_random_streams_finish_with_cache_off_tokens_on_qwen3(tiny_qwen3, cold_qwen3, requests):
    eng = make_engine(tiny_qwen3, num_gpu_blocks=NUM_BLOCKS, max_batch_size=4, **TIGHT)
    _check_stream(eng, cold_qwen3, requests)


# the Store tier -----------------------------------------------------------------------------------
def _store_engine(model: str, services, **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
               mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
               mooncake_local_buffer_size=1 << 20, **TIGHT)
    cfg.update(fields)
    return Engine(model, PytorchEngineConfig(**cfg))


@pytest.fixture
def store_engines(tiny_qwen3_next, mooncake_services):
    """Factory of engines on the session's Store; all closed at teardown."""
    made = []

    def make(**fields) -> Engine:
        made.append(_store_engine(tiny_qwen3_next, mooncake_services, **fields))
        return made[-1]

    yield make
    for eng in made:
        eng.close()


def _count_gets(engine: Engine) -> list[str]:
    """Record the key of every object the engine reads from the Store."""
    client, keys = _store_client(engine), []
    get = client.get

    def counting_get(key):
        keys.append(key)
        return get(key)

    client.get = counting_get
    return keys


def test_waiting_store_hit_reads_the_store_once_and_keeps_cached_blocks(store_engines, cold_next):
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    x = random_prompt(150, seed=20)                 # the writer saves 64 and 128: 1 state + 8 KV objects
    writer = store_engines()
    assert writer.generate(x, gen).output_ids == cold_next(x, 6)
    assert _flush(writer)

    # 13 blocks: z leaves 2 cached blocks, r holds 5 while it decodes, 6 stay free; a restore of
    # 128 tokens needs 8 blocks and its first chunk (to 150) 2 more
    reader = store_engines(num_gpu_blocks=13, num_checkpoint_slots=0)
    z, r = random_prompt(40, seed=21), random_prompt(65, seed=22)
    run_bounded(reader, [(0, z, GenerationConfig(max_new_tokens=4, ignore_eos=True))], MAX_STEPS)
    r_gen = GenerationConfig(max_new_tokens=14, ignore_eos=True)   # 65 + 14 tokens stay in 5 blocks
    r_seq = reader.add_request(r, r_gen)
    while r_seq.num_computed_tokens < len(r):
        reader.step()
    led = reader.ledger()
    assert led['blocks_free'] == 6, led

    gets = _count_gets(reader)
    x_seq = reader.add_request(x, gen)
    waiting_gets, cached = 0, [led['blocks_cached']]
    for _ in range(MAX_STEPS):
        before = len(gets)
        reader.step()
        if x_seq.num_computed_tokens == 0 and not x_seq.is_finished:    # still not admitted
            waiting_gets += len(gets) - before
            cached.append(reader.ledger()['blocks_cached'])
        if x_seq.is_finished and r_seq.is_finished:
            break
    assert x_seq.is_finished and r_seq.is_finished
    # at most one read of the prefix (1 state + 8 KV objects) while the admission cannot complete
    assert waiting_gets <= 1 + 128 // B, f'{waiting_gets} Store reads while waiting {len(cached) - 1} steps'
    assert cached == sorted(cached), f'cached blocks dropped while the request waited: {cached}'
    assert x_seq.output_ids == cold_next(x, 6) and r_seq.output_ids == cold_next(r, 14)
    assert _flush(reader)
    assert_idle(reader)


def test_store_hit_tokens_count_once_per_preempted_request(store_engines, cold_next):
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    prompts = [random_prompt(150, seed=30 + i) for i in range(2)]
    writer = store_engines()
    for ids in prompts:
        writer.generate(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    assert _flush(writer)

    # no checkpoint slots: a re-admitted request can only restore from the Store again. Each
    # request restores 128 tokens into 8 blocks and grows to 190 tokens (12 blocks); 22 blocks
    # hold both at admission (10 each) but not both at full length: the newer one is preempted.
    reader = store_engines(num_gpu_blocks=22, num_checkpoint_slots=0)
    rec = StepRecorder(reader)
    seqs = run_bounded(reader, [(0, ids, gen) for ids in prompts], MAX_STEPS, check_cache=False)
    recomputed = set()
    ends: dict[int, int] = {}
    for step in rec.steps:
        for seq_id, start, end, _ in step.chunks:
            if start < ends.get(seq_id, 0):
                recomputed.add(seq_id)
            ends[seq_id] = end
    assert recomputed, 'no request was preempted: the test did not exercise re-admission'
    for seq, ids in zip(seqs, prompts):
        assert seq.output_ids == cold_next(ids, 40)
        assert seq.num_cached_tokens == seq.stats.store_hit_tokens == 128
    assert reader.stats()['store_hit_tokens'] == 2 * 128
    assert _flush(reader)
    assert_idle(reader)
