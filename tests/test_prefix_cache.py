"""Local prefix cache with recurrent-state checkpoints, default save policy (issue 4).

Every test drives a real tiny model greedily and checks, against an engine with caching off:
identical output ids, the exact cached tokens and save points (recomputed with
``plan_prefill``), checkpoint contents equal to a cold prefill, eviction and slot exhaustion,
and the idle ledger after everything ends (including aborts).

Geometry: B = 16 tokens per block, A = 64, P = 128 tokens per prefill chunk.
"""
from __future__ import annotations

import pytest
import torch

from engine_utils import random_prompt as prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.prefill_plan import plan_prefill

B, A, P = 16, 64, 128
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)
_REFERENCE: dict[tuple, list[int]] = {}






def engine(path: str, **fields) -> Engine:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A,
               max_prefill_token_num=P, enable_prefix_caching=True, num_gpu_blocks=256,
               num_checkpoint_slots=16, max_batch_size=8)
    cfg.update(fields)
    return Engine(path, PytorchEngineConfig(**cfg))


def reference(path: str, ids: list[int], gen: GenerationConfig = GEN) -> list[int]:
    """Greedy output with caching off (memoized: the same prompt is asked for by several tests)."""
    key = (path, tuple(ids), gen.max_new_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = engine(path, enable_prefix_caching=False).generate(ids, gen).output_ids
    return _REFERENCE[key]


def assert_idle(eng: Engine) -> None:
    """Idle ledger: no block in use, every runtime slot free, no pin; every published checkpoint
    hangs on exactly one trie node and every cached block is referenced by its node only."""
    led = eng.ledger()
    assert eng.is_idle(), led
    assert led['blocks_in_use'] == 0 and led['checkpoints_pinned'] == 0
    assert led['runtime_slots_free'] == led['runtime_slots_total']
    assert led['blocks_free'] + led['blocks_cached'] == led['blocks_total']
    nodes = eng.prefix_cache.cached_nodes()     # none with caching off
    assert len(nodes) == led['blocks_cached']
    assert all(eng.block_manager.refcount[n.block_id] == 1 for n in nodes)
    on_nodes = sorted(n.checkpoint_slot for n in nodes if n.checkpoint_slot is not None)
    published = sorted(eng.state_cache._published) if eng.state_cache is not None else []
    assert on_nodes == published
    assert led['checkpoints_published'] == len(published)


def expected_plan(eng: Engine, seq):
    """The plan the scheduler must have used, recomputed from n and the observed hit."""
    cfg = eng.config
    return plan_prefill(seq.num_prompt_tokens, seq.num_cached_tokens, cfg.max_prefill_token_num, B,
                        cfg.prefill_save_alignment, cfg.prefill_save_last_only)


def converse(eng: Engine, first: list[int], user_turns: list[list[int]]):
    """An append-only conversation: each turn = previous prompt + reply + new user text."""
    ids, seqs = list(first), []
    for user in [[]] + user_turns:
        ids = ids + (seqs[-1].output_ids if seqs else []) + user
        seqs.append(eng.generate(ids, GEN))
    return seqs


# ------------------------------------------------------------------ identical output, exact hits
def test_five_turn_conversation_reuses_every_earlier_checkpoint(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    seqs = converse(eng, prompt(150, 1), [prompt(70, 10 + t) for t in range(4)])
    saved: list[int] = []
    for seq in seqs:
        ids = seq.token_ids[:seq.num_prompt_tokens]
        assert seq.output_ids == reference(tiny_qwen3_next, ids)
        # every earlier save point is a prefix of this turn: the deepest one is restored
        assert seq.num_cached_tokens == max(saved, default=0)
        plan = expected_plan(eng, seq)
        assert seq.stats.plans == [plan]
        assert seq.stats.save_points == plan.save_points
        assert seq.stats.prefill_forwards == plan.num_chunks
        saved += seq.stats.save_points
    assert [s.num_prompt_tokens for s in seqs] == [150, 226, 302, 378, 454]
    assert [s.num_cached_tokens for s in seqs] == [0, 128, 192, 256, 320]
    assert [s.stats.save_points for s in seqs] == [[128], [192], [256], [320], [448]]
    stats = eng.stats()
    assert stats['checkpoints_saved'] == 5 and stats['checkpoints_skipped'] == {}
    assert stats['prefix_cache_hit_tokens'] == 128 + 192 + 256 + 320
    assert_idle(eng)


def test_branching_conversations_share_the_checkpoint_below_the_fork(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    shared = prompt(200, 2)
    a, b = shared + prompt(80, 3), shared + prompt(80, 4)
    first = eng.generate(a, GEN)
    assert first.stats.save_points == [128, 256]
    second = eng.generate(b, GEN)
    # blocks [0, 192) match (block 12 straddles the fork); the deepest checkpoint there is 128
    assert second.num_cached_tokens == 128
    assert second.stats.save_points == [256]          # its own branch's boundary
    again_a, again_b = eng.generate(a, GEN), eng.generate(b, GEN)
    assert again_a.num_cached_tokens == again_b.num_cached_tokens == 256
    for seq, ids in ((first, a), (second, b), (again_a, a), (again_b, b)):
        assert seq.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


def test_same_prompt_twice_restores_the_last_save_point(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    ids = prompt(200, 5)
    cold, warm = eng.generate(ids, GEN), eng.generate(ids, GEN)
    assert cold.stats.save_points == [128, 192] and cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 192 and warm.stats.save_points == []
    assert warm.stats.plans[0].chunk_ends == [200] and warm.stats.prefill_forwards == 1
    assert cold.output_ids == warm.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


@pytest.mark.parametrize('n, saves', [(A, []), (A + 1, [A]), (2 * A + 1, [2 * A])])
def test_prompts_at_alignment_edges(tiny_qwen3_next, n, saves):
    # n = A: rule 2 (b <= n - 1) leaves no boundary; A + 1: boundary A; 2A + 1 with P = 2A: 2A
    eng = engine(tiny_qwen3_next)
    ids = prompt(n, 6)
    cold, warm = eng.generate(ids, GEN), eng.generate(ids, GEN)
    assert cold.stats.save_points == saves
    assert warm.num_cached_tokens == max(saves, default=0)
    assert cold.output_ids == warm.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


def test_eight_concurrent_requests_sharing_a_system_prompt(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    system = prompt(150, 7)
    prompts = [system + prompt(20, 100 + i) for i in range(8)]
    seqs = [eng.add_request(p, GEN) for p in prompts]
    while eng.has_work:
        eng.step()
    for seq, ids in zip(seqs, prompts):
        assert seq.output_ids == reference(tiny_qwen3_next, ids)
    # the step budget (P tokens) admits one first chunk per step: request 0 saves 128 in step
    # one, every later request restores it
    assert [s.num_cached_tokens for s in seqs] == [0] + [128] * 7
    assert [s.stats.save_points for s in seqs] == [[128]] + [[]] * 7
    assert_idle(eng)


def test_concurrent_saves_of_one_prefix_publish_one_checkpoint(tiny_qwen3_next):
    # Two requests admitted in the same step (first chunks of 64 fit the budget together) reach
    # the same boundary in the same forward: one saves, the other counts 'exists'. Publishing
    # both on one node would leave an orphaned checkpoint slot.
    eng = engine(tiny_qwen3_next)
    system = prompt(A, 8)
    prompts = [system + [500 + i] for i in range(4)]
    seqs = [eng.add_request(p, GEN) for p in prompts]
    while eng.has_work:
        eng.step()
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 64, 64]
    assert [s.stats.save_points for s in seqs] == [[64], [], [], []]
    assert seqs[1].stats.skipped == {'exists': 1}
    assert eng.ledger()['checkpoints_published'] == 1
    for seq, ids in zip(seqs, prompts):
        assert seq.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


def test_restore_picks_a_boundary_reusable_for_the_restoring_request(tiny_qwen3_next):
    # the reusability rules hold for the request that restores, not only for the one that saved: checkpoints
    # at 128 and 192 exist, yet a span over 192 (or, with lookahead 1, starting at 192) or a
    # recompute block past it rules 192 out
    eng = engine(tiny_qwen3_next)
    ids = prompt(200, 5)
    assert eng.generate(ids, GEN).stats.save_points == [128, 192]
    cases = [(dict(multimodal_spans=((150, 199),)), 128),
             (dict(multimodal_spans=((192, 199),)), 192),                   # starts at b: legal
             (dict(multimodal_spans=((192, 199),), token_lookahead=1), 128),  # s < b + ℓ < e
             (dict(token_lookahead=8), 192),                               # 8 tokens remain
             (dict(token_lookahead=9), 128)]
    for kwargs, hit in cases:
        seq = eng.generate(ids, GEN, **kwargs)
        assert (seq.num_cached_tokens, seq.stats.save_points) == (hit, []), kwargs
        assert seq.output_ids == reference(tiny_qwen3_next, ids)
    # n = 144, r = 1: 128 + 16 > floor_16(143) = 128 although block [128, 144) is cached
    short = eng.generate(ids[:144], GEN, recompute_blocks=1)
    assert short.num_cached_tokens == 0 and short.stats.save_points == [64]
    assert short.output_ids == reference(tiny_qwen3_next, ids[:144])
    assert_idle(eng)


def test_admission_that_cannot_get_its_first_chunk_holds_nothing():
    """Scheduler + tiers only (no model): match → pin → can-allocate fails and rolls back, with
    nothing evicted; once blocks free up the same admission commits and plans its restore."""
    from lmdeploy.pytorch.config import SchedulerConfig
    from lmdeploy.pytorch.paging.sequence import SeqStatus, Sequence
    from lmdeploy.pytorch.paging.block_manager import BlockManager
    from lmdeploy.pytorch.engine.scheduler import Scheduler
    from lmdeploy.pytorch.prefix_cache import LocalTier, PrefixCache
    from lmdeploy.pytorch.prefix_cache.state_cache import StateCache
    cfg = PytorchEngineConfig(block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
                              enable_prefix_caching=True, num_gpu_blocks=12)
    bm, sc = BlockManager(12), StateCache(2, 2)
    cache = PrefixCache(LocalTier(bm, B, sc), block_size=B, alignment=A)
    sched = Scheduler(SchedulerConfig.from_engine_config(cfg), bm, sc, cache)
    cached_ids = prompt(128, 11)
    blocks = bm.allocate(8)
    nodes = cache.local.trie.insert(cached_ids, blocks, 8)
    bm.free_all(blocks)
    ckpt = sc.alloc_checkpoint()
    sc.publish(ckpt, nodes[-1])                        # checkpoint at 128
    others = bm.allocate(4)                            # every other block is in use
    seq = Sequence(cached_ids + prompt(116, 12), GEN)  # n = 244: restore 128, first chunk to 192
    sched.add(seq)
    out = sched.schedule()
    assert out.chunks == [] and list(sched.waiting) == [seq] and seq.status is SeqStatus.WAITING
    assert bm.refcount == [1] * 12 and sc.num_pinned == 0 and sc.num_free_runtime == 2
    assert cache.local.trie.num_nodes == 8 and nodes[-1].checkpoint_slot == ckpt     # nothing evicted
    assert (seq.block_ids, seq.state_slot, seq.num_computed_tokens) == ([], None, 0)
    bm.free_all(others)
    out = sched.schedule()
    [chunk] = out.chunks
    assert (chunk.start, chunk.end) == (128, 192)
    [restore] = out.loads.restores
    assert (restore.src, restore.dst) == (ckpt, 0) and out.loads.store_loads == []
    assert seq.block_ids[:8] == blocks and bm.refcount[:8] == [2] * 8 and sc.is_pinned(ckpt)
    cache.loads_done(out.loads, True)
    assert sc.num_pinned == 0


# ------------------------------------------------------------------ checkpoint contents
def _linear_layers(eng: Engine) -> list[int]:
    return [i for i, c in enumerate(eng.cache_engine.state_caches) if c is not None]


def _slot_state(eng: Engine, slot: int) -> list[torch.Tensor]:
    """Conv ``[C, K-1]`` and recurrent ``[H, dk, dv]`` state of every linear layer in ``slot``."""
    return [t[slot].clone() for i in _linear_layers(eng) for t in eng.cache_engine.state_caches[i]]


def test_restored_checkpoint_equals_a_cold_prefill_of_that_many_tokens(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    restored: list[tuple[int, list[torch.Tensor]]] = []
    copy = eng.cache_engine.copy_states

    def recording_copy(src, dst):
        copy(src, dst)
        for d in dst:
            if d < eng.state_cache.num_runtime_slots:        # checkpoint → runtime: a restore
                restored.append((d, _slot_state(eng, d)))

    eng.cache_engine.copy_states = recording_copy
    seqs = converse(eng, prompt(150, 9), [prompt(70, 20), prompt(70, 21)])
    assert [s.num_cached_tokens for s in seqs] == [0, 128, 192]
    assert len(restored) == 2
    assert len(_linear_layers(eng)) == 3 and len(restored[0][1]) == 6
    for saver, seq, (_, state) in zip(seqs, seqs[1:], restored):
        b = seq.num_cached_tokens
        cold = engine(tiny_qwen3_next, enable_prefix_caching=False)
        # the cold prefill of the prompt that saved b: with caching off its forwards end where
        # they ended with caching on (the chunk grid depends on the prompt alone), b among them,
        # so the kernels add in the same order
        prompt_ids = saver.token_ids[:saver.num_prompt_tokens]
        probe = cold.add_request(prompt_ids, GenerationConfig(max_new_tokens=2, ignore_eos=True))
        while probe.num_computed_tokens < b:
            cold.step()
        assert probe.num_computed_tokens == b
        expected = _slot_state(cold, probe.state_slot)
        assert all(torch.equal(x, y) for x, y in zip(state, expected))
        assert any(x.abs().max() > 0 for x in expected)
        cold.abort(probe)


# ------------------------------------------------------------------ small caches
def test_small_kv_cache_evicts_and_still_matches(tiny_qwen3_next):
    # 24 blocks = 384 tokens: two alternating conversations (prompts 150, 226, 302 tokens)
    # cannot both stay cached, so each turn evicts the other conversation's LRU leaves
    eng = engine(tiny_qwen3_next, num_gpu_blocks=24)
    convs = [(prompt(150, 30), [prompt(70, 31), prompt(70, 32)]),
             (prompt(150, 40), [prompt(70, 41), prompt(70, 42)])]
    ids = [list(c[0]) for c in convs]
    seqs = []
    for turn in range(3):
        for k, (_, users) in enumerate(convs):
            seq = eng.generate(ids[k], GEN)
            assert seq.output_ids == reference(tiny_qwen3_next, ids[k])
            seqs.append(seq)
            assert_idle(eng)
            if turn < 2:
                ids[k] = ids[k] + seq.output_ids + users[turn]
    assert [s.stats.save_points for s in seqs] == [[128], [128], [192], [192], [256], [128, 256]]
    # A's turn 3 finds 128, not its 192: B's turn 2 evicted A's five least recently used blocks
    # [144, 224) and, with the node ending at 192, its checkpoint; A's turn 3 then evicted all of B
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 128, 128, 128, 0]
    assert eng.stats()['checkpoints_saved'] == 7 and eng.ledger()['checkpoints_published'] == 2


def test_preemption_under_block_pressure_keeps_outputs(tiny_qwen3_next):
    # 20 blocks: a decoding request crossing into a new block preempts the newest one, which is
    # re-admitted later from its own checkpoint at 128 (prompt + generated tokens recomputed)
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    eng = engine(tiny_qwen3_next, num_gpu_blocks=20)
    prompts = [prompt(150, 50 + i) for i in range(4)]
    seqs = [eng.add_request(p, gen) for p in prompts]
    while eng.has_work:
        eng.step()
    assert [len(s.stats.plans) for s in seqs] == [1, 2, 2, 2]
    assert [s.stats.plans[-1].cached_tokens for s in seqs[1:]] == [128, 128, 128]
    for seq, ids in zip(seqs, prompts):
        assert seq.output_ids == reference(tiny_qwen3_next, ids, gen)
    assert_idle(eng)


def test_no_checkpoint_slots_skips_every_save_and_counts_it(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next, num_checkpoint_slots=0)
    seqs = converse(eng, prompt(150, 60), [prompt(70, 61), prompt(70, 62)])
    for seq in seqs:
        assert seq.output_ids == reference(tiny_qwen3_next, seq.token_ids[:seq.num_prompt_tokens])
        assert seq.num_cached_tokens == 0 and seq.stats.save_points == []
        assert seq.stats.skipped == {'no_free_slot': len(expected_plan(eng, seq).save_points)}
    assert eng.stats()['checkpoints_skipped'] == {'no_free_slot': 1 + 2 + 2}   # 128 | 128,192 | 128,256
    assert_idle(eng)


def test_one_checkpoint_slot_keeps_the_latest_save(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next, num_checkpoint_slots=1)
    seqs = converse(eng, prompt(200, 70), [prompt(70, 71), prompt(70, 72)])
    # turn 1 saves 128 then 192 (evicting 128); each later turn restores the previous last save
    assert [s.stats.save_points for s in seqs] == [[128, 192], [256], [320]]
    assert [s.num_cached_tokens for s in seqs] == [0, 192, 256]
    for seq in seqs:
        assert seq.output_ids == reference(tiny_qwen3_next, seq.token_ids[:seq.num_prompt_tokens])
    assert_idle(eng)
    # two first chunks in one forward want the single slot: one save is skipped, none fails
    prompts = [prompt(A + 1, 73), prompt(A + 1, 74)]
    pair = [eng.add_request(p, GEN) for p in prompts]
    while eng.has_work:
        eng.step()
    assert [s.stats.save_points for s in pair] == [[64], []]
    assert pair[1].stats.skipped == {'no_free_slot': 1}
    for seq, ids in zip(pair, prompts):
        assert seq.output_ids == reference(tiny_qwen3_next, ids)
    assert_idle(eng)


# ------------------------------------------------------------------ aborts
def test_aborts_in_waiting_prefill_and_decode_return_to_idle(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    ids = prompt(300, 80)
    in_prefill = eng.add_request(ids, GEN)
    eng.step()                                          # chunk [0, 128) ran and was saved
    assert in_prefill.num_computed_tokens == 128 and in_prefill.stats.save_points == [128]
    eng.abort(in_prefill)
    assert_idle(eng)
    # the aborted prefill left its computed blocks and checkpoint for the next identical request
    again = eng.generate(ids, GEN)
    assert again.num_cached_tokens == 128 and again.output_ids == reference(tiny_qwen3_next, ids)

    other, decode_gen = prompt(100, 81), GenerationConfig(max_new_tokens=20, ignore_eos=True)
    in_decode = eng.add_request(other, decode_gen)
    neighbour = eng.add_request(prompt(90, 82), GEN)
    while in_decode.num_generated < 3:
        eng.step()
    assert in_decode.is_prefill is False and not neighbour.is_finished
    eng.abort(in_decode)
    while eng.has_work:
        eng.step()
    assert in_decode.finish_reason == 'abort'
    assert in_decode.output_ids == reference(tiny_qwen3_next, other, decode_gen)[:3]
    assert neighbour.output_ids == reference(tiny_qwen3_next, prompt(90, 82))
    assert_idle(eng)

    never_ran = eng.add_request(prompt(90, 83), GEN)
    eng.abort(never_ran)
    assert never_ran.finish_reason == 'abort' and never_ran.num_generated == 0
    assert_idle(eng)


# ------------------------------------------------------------------ full attention only
def test_full_attention_reuses_every_matched_block_but_the_last_token(tiny_qwen3):
    eng = engine(tiny_qwen3)
    for n, hit in ((100, 96), (96, 80)):   # (n - 1) rounded down to whole blocks
        ids = prompt(n, 90 + n)
        cold, warm = eng.generate(ids, GEN), eng.generate(ids, GEN)
        assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, hit)
        assert warm.stats.save_points == [] and warm.stats.plans[0].chunk_ends == [n]
        assert cold.output_ids == warm.output_ids == reference(tiny_qwen3, ids)
    seqs = converse(eng, prompt(150, 91), [prompt(30, 92), prompt(30, 93)])
    # blocks computed by the previous turn (prompt + reply - 1 tokens) are all reused
    assert [s.num_cached_tokens for s in seqs] == [0, 144, 176]
    for seq in seqs:
        assert seq.output_ids == reference(tiny_qwen3, seq.token_ids[:seq.num_prompt_tokens])
    assert eng.ledger()['runtime_slots_total'] == 0
    assert_idle(eng)


def test_a_failed_save_copy_publishes_nothing_and_leaves_no_pin(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next)
    real = eng.cache_engine.copy_states
    calls = []

    def failing_save_copy(src, dst):
        if src and all(s < eng.state_cache.num_runtime_slots for s in src):   # runtime → checkpoint
            calls.append(list(dst))
            raise RuntimeError('injected copy failure')
        return real(src, dst)
    eng.cache_engine.copy_states = failing_save_copy
    seq = eng.add_request(prompt(100, seed=31), GEN)
    with pytest.raises(RuntimeError, match='injected'):
        while not seq.is_finished:
            eng.step()
    assert calls                                              # the save at 64 was attempted
    assert eng.state_cache.num_published == 0 and eng.state_cache.num_pinned == 0
    assert seq.stats.skipped['copy_failed'] == 1 and seq.stats.save_points == []
    eng.abort(seq)
    assert eng.is_idle()
