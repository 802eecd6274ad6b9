"""Checkpoint pins have one owner (``prefix_cache/pins.py``): a property test drives the real
scheduler and prefix cache (no model: copies are simulated) through random interleavings of
admission, restore (local checkpoint and Store), save, turn-end staging, finish, abort,
preemption, and errors (copies, Store loads and forwards that fail or raise; a step that raises
fails every request, as the engine loop does), and checks after every step that

* no checkpoint slot is evicted or released while pinned;
* every pin is a lease of the one :class:`CheckpointPins` (the state cache's pin counts equal
  the held leases), held only by a running request's staging slots between steps;
* no path ever leaves a lease behind (nothing reclaimed), and once every request has left,
  pin counts are back to zero.

Geometry: B = 4 tokens per block, A = 8 — small, so random prompts cross many save points.
"""
from __future__ import annotations

import ast
import pathlib
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.config import SchedulerConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.sequence import Sequence
from lmdeploy.pytorch.prefix_cache.coordinator import PrefixCache
from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
from lmdeploy.pytorch.prefix_cache.eviction import make_policy
from lmdeploy.pytorch.prefix_cache.pins import CheckpointPins
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache

B, A = 4, 8
ROOT = pathlib.Path(__file__).resolve().parents[1]


class InjectedFailure(RuntimeError):
    """An error the harness injects (a failed copy, Store load or forward)."""


class FakeStore:
    """Remembers which prefixes were put (by their block hashes); a load fails (False) or
    raises at ``fail_rate`` each."""

    def __init__(self, rng: random.Random, fail_rate: float):
        self.rng, self.fail_rate, self.states, self.hits = rng, fail_rate, set(), 0

    def depth(self, hashes, rules, *, shared_blocks=0, above=0, below=None):
        return next((b for b in rules.restore_candidates(above, len(hashes))
                     if (below is None or b < below) and tuple(hashes[:b // B]) in self.states), 0)

    def load(self, load) -> bool:
        r = self.rng.random()
        if r < self.fail_rate / 4:
            raise InjectedFailure('store load')
        return r >= self.fail_rate

    def record_hit(self, tokens: int) -> None:
        self.hits += 1

    def submit(self, put) -> None:
        self.states.add(tuple(put.hashes))

    def stats(self) -> dict:
        return {}


class FakeCopies:
    """The cache engine's state copies: raise at ``fail_rate`` (Engine._copy_states then
    reports the copy as not done and re-raises)."""

    def __init__(self, rng: random.Random, fail_rate: float):
        self.rng, self.fail_rate, self.copies = rng, fail_rate, 0

    def copy_states(self, src, dst) -> None:
        if self.rng.random() < self.fail_rate:
            raise InjectedFailure('copy')
        self.copies += len(src)


class GuardedStateCache(StateCache):
    """A StateCache that fails the test if a pinned checkpoint is ever evicted or released
    (LRU eviction in ``alloc_checkpoint`` and trie eviction both go through release)."""

    def release_checkpoint(self, slot: int, evicted: bool = False) -> None:
        assert not self.is_pinned(slot), f'checkpoint slot {slot} released while pinned'
        super().release_checkpoint(slot, evicted)


class Harness:
    """Scheduler + prefix cache of one engine, stepped through the engine's own load / save
    execution (``Engine._execute_loads`` / ``_execute_saves`` on a model-free engine: copies and
    Store are fakes that fail); a step that raises fails every request, as the engine loop does."""

    def __init__(self, rng: random.Random, num_blocks: int, runtime: int, ckpt: int, decode_save_last: bool,
                 store: bool, fail_rate: float, rows: int = 0, eviction: str = 'lru'):
        self.rng, self.fail_rate = rng, fail_rate
        self.bm = BlockManager(num_blocks)
        if rows:        # one memory budget: each checkpoint takes `rows` KV block rows, `ckpt` at most
            self.sc = GuardedStateCache(runtime, ckpt, block_manager=self.bm, rows_per_checkpoint=rows,
                                        policy=make_policy(eviction))
        else:
            self.sc = GuardedStateCache(runtime, ckpt, policy=make_policy(eviction))
        self.store = FakeStore(rng, fail_rate) if store else None
        local = LocalTier(self.bm, B, self.sc)
        self.cache = PrefixCache(local, self.store, block_size=B, alignment=A, decode_save_last=decode_save_last)
        self.pins: CheckpointPins = local.pins
        self.sched = Scheduler(SchedulerConfig(B, runtime, 16, A, False), self.bm, self.sc, self.cache)
        eng = self.eng = Engine.__new__(Engine)        # only what the load / save execution uses
        eng.prefix_cache, eng.scheduler, eng.store = self.cache, self.sched, self.store
        eng.cache_engine = FakeCopies(rng, fail_rate)
        self.live: list[Sequence] = []
        self.errors = 0

    def step(self) -> None:
        try:
            self._step()
        except InjectedFailure:             # what EngineLoop does when a step raises
            self.errors += 1
            for seq in self.live:
                if not seq.is_finished:
                    self.eng.abort(seq)

    def _step(self) -> None:
        eng, sched = self.eng, self.sched
        self.cache.probe(sched.waiting)
        out = sched.schedule()
        eng._execute_loads(out)
        if not out.chunks:
            return
        if self.rng.random() < self.fail_rate / 4:
            raise InjectedFailure('forward')
        eng._execute_saves(sched.computed(out))
        for chunk in out.chunks:
            seq = chunk.seq
            if chunk.end < seq.num_tokens:
                continue                          # a prefill chunk short of the last token
            seq.token_ids.append(self.rng.randrange(100))
            if seq.num_generated >= seq.gen_config.max_new_tokens:
                eng._execute_saves(sched.finish(seq, 'length'))

    def check_between_steps(self) -> None:
        held = self.pins.held()
        assert Counter(lease.slot for lease in held) == Counter(
            {s: n for s, n in self.sc._pins.items()}), 'a pin was taken outside CheckpointPins'
        assert all(lease.purpose == 'staging' for lease in held), held
        running = {s.seq_id for s in self.sched.running}
        assert all(lease.owner in running for lease in held), (held, running)
        assert self.pins.num_reclaimed == 0, 'a path left a lease behind'


def _prompt(rng: random.Random, shared: list[list[int]]) -> list[int]:
    """A prompt that often extends an earlier one (so local and Store restores happen)."""
    if shared and rng.random() < 0.7:
        base = rng.choice(shared)
        ids = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(100) for _ in range(rng.randrange(1, 24))]
    else:
        ids = [rng.randrange(100) for _ in range(rng.randrange(2, 48))]
    shared.append(ids)
    return ids


def run_interleaving(seed: int, num_blocks: int, runtime: int, ckpt: int, decode_save_last: bool, store: bool,
                     fail_rate: float, steps: int = 60, rows: int = 0, eviction: str = 'lru') -> Harness:
    rng = random.Random(seed)
    h = Harness(rng, num_blocks, runtime, ckpt, decode_save_last, store, fail_rate, rows, eviction)
    shared: list[list[int]] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.45:
            stop = ['x'] if rng.random() < 0.3 else []
            gen = GenerationConfig(max_new_tokens=rng.randrange(1, 12), ignore_eos=True, stop_words=stop)
            seq = Sequence(_prompt(rng, shared), gen)
            if stop:
                seq.stop_strings = object()     # two staging slots, as with stop strings
            h.sched.add(seq)
            h.live.append(seq)
        elif r < 0.6 and h.live:
            seq = rng.choice(h.live)
            if not seq.is_finished:
                h.sched.abort(seq)
        h.step()
        h.check_between_steps()
    for seq in h.live:                              # drain: abort what is left
        if not seq.is_finished:
            h.sched.abort(seq)
    assert not h.sched.has_work
    assert h.pins.num_held == 0 and h.sc.num_pinned == 0, h.pins.held()
    assert h.pins.num_reclaimed == 0
    # every block row is free, cached, or held by a published checkpoint (none leaked)
    assert h.bm.num_free + h.cache.num_cached_blocks + h.sc.num_checkpoint_rows == num_blocks
    assert h.sc.num_allocated == h.sc.num_published
    return h


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), num_blocks=st.integers(12, 40), runtime=st.integers(1, 4),
       ckpt=st.integers(1, 6), decode_save_last=st.booleans(), store=st.booleans(),
       fail_rate=st.sampled_from([0.0, 0.2, 0.5]), rows=st.sampled_from([0, 0, 1, 3]),
       eviction=st.sampled_from(['reuse', 'lru']))
def test_random_interleavings_return_every_pin_and_never_evict_a_pinned_checkpoint(
        seed, num_blocks, runtime, ckpt, decode_save_last, store, fail_rate, rows, eviction):
    """With fixed checkpoint slots or checkpoints in KV block rows (one memory budget), under
    either eviction policy."""
    run_interleaving(seed, num_blocks, runtime, ckpt, decode_save_last, store, fail_rate, rows=rows,
                     eviction=eviction)


def test_the_interleavings_reach_every_pin_purpose_and_preemption():
    """The property above is not vacuous: over fixed seeds every kind of pin is taken,
    requests are preempted, restores come from both tiers, and steps fail."""
    taken, preempted, restored, errors = Counter(), 0, Counter(), 0
    for seed in range(30):
        rng_cfg = random.Random(seed)
        h = None
        orig_take = CheckpointPins.take

        def take(self, slot, purpose, owner=None, _orig=orig_take):
            taken[purpose] += 1
            return _orig(self, slot, purpose, owner)

        CheckpointPins.take = take
        try:
            h = run_interleaving(seed, rng_cfg.randrange(14, 24), 3, 3, seed % 2 == 0, True, 0.2)
        finally:
            CheckpointPins.take = orig_take
        for seq in h.live:
            preempted += max(0, len(seq.stats.plans) - 1)
        restored['store'] += h.store.hits
        errors += h.errors
    assert set(taken) == {'restore_source', 'save_target', 'store_keep', 'staging'}, taken
    assert preempted > 0 and restored['store'] > 0 and errors > 0, (preempted, restored, errors)


def test_only_the_pin_owner_changes_pin_counts():
    """Outside pins.py, nothing in the package calls StateCache.pin / unpin."""
    offenders = []
    for path in (ROOT / 'lmdeploy').rglob('*.py'):
        if path.name in ('pins.py', 'state_cache.py'):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ('pin', 'unpin')
                    and 'state_cache' in ast.unparse(node.func.value)):
                offenders.append(f'{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}')
    assert not offenders, offenders


def test_a_lease_is_released_exactly_once():
    sc = StateCache(1, 2)
    pins = CheckpointPins(sc)
    slot = sc.alloc_checkpoint()
    with pins.take(slot, 'save_target', owner=7) as lease:
        assert sc.is_pinned(slot) and pins.num_held == 1
    assert lease.released and not sc.is_pinned(slot)
    with pytest.raises(RuntimeError, match='released twice'):
        lease.release()
    lease = pins.take(slot, 'staging', owner=7)
    lease.release()
    with lease:                                 # leaving the block does not release it again
        pass
    assert sc.num_pinned == 0
    pins.take(slot, 'staging', owner=8)
    assert pins.release_owner(8) == 1 and pins.num_reclaimed == 1 and sc.num_pinned == 0
    with pytest.raises(ValueError, match='purpose'):
        pins.take(slot, 'whatever')


def test_a_store_load_that_raises_releases_the_kept_restores_of_its_step():
    """Two Store restores in one step: the first is kept as a local checkpoint (pinned while
    its copy is pending), the second load raises. The step's error path releases the first's
    pin itself; the requests then fail (aborted), and nothing is left to reclaim."""
    h = Harness(random.Random(0), num_blocks=40, runtime=3, ckpt=4, decode_save_last=False, store=True,
                fail_rate=0.0)
    first = [7 + i % 50 for i in range(33)]
    seq = Sequence(first, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    h.sched.add(seq)
    h.live.append(seq)
    while not seq.is_finished:
        h.step()
    assert h.store.states, 'the first request put its prefix'
    h.cache.evict(10 ** 6)                 # the local tier forgets it: the next restores come from the Store
    assert h.cache.num_cached_blocks == 0
    calls = []

    def load(load):
        calls.append(load.seq.seq_id)
        if len(calls) == 2:
            raise InjectedFailure('second store load')
        return True
    h.store.load = load
    twins = [Sequence(first + [60 + k], GenerationConfig(max_new_tokens=1, ignore_eos=True)) for k in range(2)]
    for s in twins:
        h.sched.add(s)
        h.live.append(s)
    taken = h.pins.num_taken
    h.step()
    assert len(calls) == 2 and h.errors == 1
    assert h.pins.num_taken > taken, 'the first restore was kept (a store_keep pin was taken)'
    assert all(s.is_finished for s in twins)
    assert h.pins.num_held == 0 and h.sc.num_pinned == 0 and h.pins.num_reclaimed == 0
