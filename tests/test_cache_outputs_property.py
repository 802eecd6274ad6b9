"""Greedy outputs do not depend on the prefix cache: a property over random conversations.

Hypothesis draws a few interleaved multi-turn conversations (some branch from another one's
history, some resend an earlier prompt) and serves them, one turn at a time, on an engine of
each configuration below; every reply must equal the reply of the same prompt with caching off,
and after each drawn example the resource ledger is idle (no block in use, every runtime slot
free, no pin, nothing in flight to the Store, each checkpoint's rows accounted for).

The configurations cover every save policy (each checkpoint, last only, turn end) and every
eviction policy on a budget of a few prompts (so blocks and checkpoints are evicted), the host
tier behind that budget, and a ``file:`` Store shared by two engines that take turns serving
the conversations (so the second restores what the first put). One engine per configuration
serves every example, so later examples meet what earlier ones left in the caches.

The same property holds for sliding-window models (the tiny ``granitemoe_swa``, all layers
sliding or mixed with global ones) served by two engines on one ``file:`` Store, where restores
attach and load only the blocks the window reads.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_engine import CacheEngine

from engine_utils import make_engine, random_prompt

B = 8            # tokens per block
P = 32           # tokens per prefill chunk
ROWS = 40        # block rows of the tiny budget (blocks and checkpoints share them)

# name -> (engine fields, whether two engines share a file: Store)
CONFIGS = {
    'each_reuse': (dict(cache_eviction='reuse'), False),
    'each_lru': (dict(cache_eviction='lru'), False),
    'last_only_reuse': (dict(cache_eviction='reuse', prefill_save_last_only=True), False),
    'turn_end_lru': (dict(cache_eviction='lru', decode_save_last=True), False),
    'host_reuse': (dict(cache_eviction='reuse', host_cache_bytes=1 << 24), False),
    'host_lru': (dict(cache_eviction='lru', host_cache_bytes=1 << 24), False),
    'file_store': (dict(cache_eviction='reuse', decode_save_last=True), True),
}


@st.composite
def conversations(draw):
    """A list of turns ``(conversation, user_tokens, seed, new_tokens, engine)``: conversation
    ``c`` continues its own history, or starts from another conversation's history (a branch) or
    from nothing; ``user_tokens == 0`` resends the conversation's last prompt."""
    turns, starts = [], []
    for i in range(draw(st.integers(3, 6))):
        conv = draw(st.integers(0, len(starts)))       # len(starts): a new conversation
        new = conv == len(starts)
        if new:
            starts.append(draw(st.integers(-1, len(starts) - 1)))   # -1: empty history
        user = draw(st.sampled_from([9, 16, 23, 40] if new else [0, 3, 9, 16, 23, 40]))
        turns.append((conv, user, draw(st.integers(0, 10_000)), draw(st.integers(1, 4)), draw(st.integers(0, 1))))
    return starts, turns


class Cold:
    """Greedy output ids with caching off (one engine, memoized per prompt)."""

    def __init__(self, model: str):
        self.engine = make_engine(model, block_size=B, max_prefill_token_num=P)
        self.memo: dict[tuple, list[int]] = {}

    def __call__(self, ids: list[int], new_tokens: int) -> list[int]:
        out = self.memo.get(tuple(ids), [])
        if len(out) < new_tokens:       # greedy: a shorter run is a prefix of a longer one
            out = self.engine.generate(ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)).output_ids
            self.memo[tuple(ids)] = out
        return out[:new_tokens]


@pytest.fixture(scope='module')
def served(tiny_qwen3_next, tmp_path_factory):
    """``(cold, engines, built)``: the cache-off reference, the engine(s) of a configuration
    (built on first use, closed at the end of the module), and those built so far by name."""
    cold = Cold(tiny_qwen3_next)
    row, state = CacheEngine.bytes_per_block(cold.engine.specs, B), CacheEngine.bytes_per_slot(cold.engine.specs)
    folder = tmp_path_factory.mktemp('file_store')
    built: dict[str, list] = {}

    def engines(name: str) -> list:
        if name not in built:
            fields, shared_store = CONFIGS[name]
            fields = dict(fields, block_size=B, max_prefill_token_num=P, enable_prefix_caching=True,
                          prefill_save_alignment=16, num_gpu_blocks=0, cache_bytes=2 * state + ROWS * row,
                          max_batch_size=2)
            if shared_store:
                fields['store_backend'] = f'file:{folder}'
            built[name] = [make_engine(tiny_qwen3_next, **fields) for _ in range(2 if shared_store else 1)]
            for eng in built[name]:
                assert eng.state_cache.uses_block_rows and eng.block_manager.num_blocks == ROWS
        return built[name]

    yield cold, engines, built
    for group in built.values():
        for eng in group:
            eng.close()


def assert_ledger_idle(eng) -> None:
    """Nothing is held for a request: no block in use, every runtime slot free, no pin, nothing
    queued or in flight to the Store, and checkpoint rows are exactly the published ones'."""
    if eng.store is not None:
        assert eng.store.flush()
    led = eng.ledger()
    assert led['blocks_in_use'] == 0 and led['checkpoints_pinned'] == 0, led
    assert led['runtime_slots_free'] == led['runtime_slots_total'], led
    assert led['store_inflight'] == 0 and led['store_queue_depth'] == 0, led
    assert led['requests_running'] == 0 and led['requests_waiting'] == 0, led
    assert led['checkpoint_rows'] == led['checkpoints_published'] * eng.state_cache.rows_per_checkpoint, led
    assert led['blocks_free'] + led['blocks_cached'] + led['checkpoint_rows'] == led['blocks_total'], led
    assert eng.is_idle()


@pytest.mark.parametrize('name', list(CONFIGS))
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=conversations())
def test_outputs_equal_cache_off_and_ledger_idle(served, name, drawn):
    cold, engines, _ = served
    group = engines(name)
    starts, turns = drawn
    histories: list[list[int] | None] = [None] * len(starts)
    last_prompt: list[list[int] | None] = [None] * len(starts)
    served_by = None
    for conv, user, seed, new_tokens, which in turns:
        if histories[conv] is None:     # the first turn of a conversation: its starting history
            src = starts[conv]
            histories[conv] = list(histories[src] or []) if src >= 0 else []
        if user == 0 and last_prompt[conv] is not None:
            ids = last_prompt[conv]
        else:
            ids = histories[conv] + random_prompt(max(user, 1), seed=seed)
        eng = group[which % len(group)]
        if served_by is not None and served_by is not eng:
            assert served_by.store.flush()      # what the other engine put is in the folder now
        served_by = eng
        out = eng.generate(ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)).output_ids
        assert out == cold(ids, new_tokens), (name, conv, len(ids))
        last_prompt[conv], histories[conv] = ids, ids + out
    for eng in group:
        assert_ledger_idle(eng)


# what each configuration is there to exercise: (stats key, configuration)
TIER_HITS = [('prefix_cache_evictions', name) for name in CONFIGS] + [
    ('prefix_cache_hit_tokens', name) for name in CONFIGS if name != 'file_store'] + [
    ('host_hit_tokens', 'host_lru'), ('store_hit_tokens', 'file_store')]
# (under 'reuse' the drawn conversations may never come back to what the device evicted: the
# policy evicts the checkpoints it predicts are not reused, so host hits are asked of 'lru' only)


def test_the_drawn_conversations_reached_every_tier(served):
    """Run after the property: over its examples every configuration evicted, the device tier
    served hits, the host tier promoted back what the device evicted, and each file: Store engine
    restored what the other put (so the equal outputs above covered those paths)."""
    _, _, built = served
    if len(built) < len(CONFIGS):
        pytest.skip('the property test did not run every configuration')
    for key, name in TIER_HITS:
        for eng in built[name]:
            value = eng.stats()[key]
            assert (sum(value.values()) if isinstance(value, dict) else value) > 0, (name, key, eng.stats())


# sliding-window models (window 24), two engines sharing a file: Store ------------------------------
@pytest.fixture(scope='module', params=['all_sliding', 'mixed'])
def served_window(request, tmp_path_factory):
    """``(cold, [engine, engine])`` of the tiny granitemoe_swa, both engines on one ``file:``
    Store. ``all_sliding``: every layer slides, a cache of 24 blocks (192 tokens, less than the
    longer conversations: sequences give back blocks out of their window, the cache evicts);
    ``mixed``: the tiny model's global and sliding layers, 64 blocks (every block is kept)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    sliding = request.param == 'all_sliding'
    model = make_tiny_model(str(tmp_path_factory.mktemp('tiny_swa')), arch='granitemoe_swa', seed=1,
                            **(dict(layer_types=['sliding_attention'] * 4) if sliding else {}))
    folder = tmp_path_factory.mktemp('window_store')
    fields = dict(block_size=B, max_prefill_token_num=P, enable_prefix_caching=True, prefill_save_alignment=16,
                  num_gpu_blocks=24 if sliding else 64, max_batch_size=2, store_backend=f'file:{folder}')
    group = [make_engine(model, **fields) for _ in range(2)]
    yield Cold(model), group
    for eng in group:
        eng.close()


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=conversations())
def test_window_model_outputs_equal_cache_off_across_a_shared_store(served_window, drawn):
    """The window rule under random conversations: local restores attach only the window's blocks,
    Store restores load only those, and every reply equals caching off; the ledger is idle."""
    cold, group = served_window
    starts, turns = drawn
    histories: list[list[int] | None] = [None] * len(starts)
    served_by = None
    for conv, user, seed, new_tokens, which in turns:
        if histories[conv] is None:
            src = starts[conv]
            histories[conv] = list(histories[src] or []) if src >= 0 else []
        ids = histories[conv] + random_prompt(max(user, 1), seed=seed)
        eng = group[which]
        if served_by is not None and served_by is not eng:
            assert served_by.store.flush()
        served_by = eng
        out = eng.generate(ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)).output_ids
        assert out == cold(ids, new_tokens), (conv, len(ids))
        histories[conv] = ids + out
    for eng in group:
        assert eng.store.flush()
        led = eng.ledger()
        assert led['blocks_in_use'] == 0 and led['store_inflight'] == 0 and eng.is_idle(), led
        assert led['blocks_free'] + led['blocks_cached'] == led['blocks_total'], led


def test_the_window_conversations_restored_from_the_store(served_window):
    """Run after the property: both tiers served the window model's replies above."""
    _, group = served_window
    stats = [eng.stats() for eng in group]
    assert sum(s['store_hit_tokens'] for s in stats) > 0 and sum(s['prefix_cache_hit_tokens'] for s in stats) > 0
