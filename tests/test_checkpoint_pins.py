"""Checkpoint pins have one owner (``prefix_cache/pins.py``): a property test drives the real
scheduler and prefix cache (no model: copies are simulated) through random interleavings of
admission, restore (local checkpoint and Store), save, turn-end staging, finish, abort,
preemption, failed copies and failed Store loads, and checks after every step that

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
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.sequence import Sequence
from lmdeploy.pytorch.prefix_cache.coordinator import PrefixCache
from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
from lmdeploy.pytorch.prefix_cache.pins import CheckpointPins
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache

B, A = 4, 8
ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeStore:
    """Remembers which prefixes were put (by their block hashes); loads fail on request."""

    def __init__(self, rng: random.Random, fail_rate: float):
        self.rng, self.fail_rate, self.states, self.hits = rng, fail_rate, set(), 0
        self.num_inflight = 0

    def probe(self, hashes, rules, below=None):
        return [b for b in rules.restore_candidates(0, len(hashes))
                if (below is None or b < below) and tuple(hashes[:b // B]) in self.states]

    def load(self, load) -> bool:
        return self.rng.random() >= self.fail_rate

    def record_hit(self, tokens: int) -> None:
        self.hits += 1

    def submit(self, put) -> None:
        self.states.add(tuple(put.hashes))

    def stats(self) -> dict:
        return {}


class GuardedStateCache(StateCache):
    """A StateCache that fails the test if a pinned checkpoint is ever evicted or released
    (LRU eviction in ``alloc_checkpoint`` and trie eviction both go through release)."""


    def release_checkpoint(self, slot: int) -> None:
        assert not self.is_pinned(slot), f'checkpoint slot {slot} released while pinned'
        super().release_checkpoint(slot)


class Harness:
    """Scheduler + prefix cache of one engine with simulated copies (what Engine.step runs)."""

    def __init__(self, rng: random.Random, num_blocks: int, runtime: int, ckpt: int, decode_save_last: bool,
                 store: bool, fail_rate: float):
        self.rng, self.fail_rate = rng, fail_rate
        self.bm = BlockManager(num_blocks)
        self.sc = GuardedStateCache(runtime, ckpt)
        self.store = FakeStore(rng, fail_rate) if store else None
        local = LocalTier(self.bm, B, self.sc)
        self.cache = PrefixCache(local, self.store, block_size=B, alignment=A, decode_save_last=decode_save_last)
        self.pins: CheckpointPins = local.pins
        self.sched = Scheduler(SchedulerConfig(B, runtime, 16, A, False), self.bm, self.sc, self.cache)
        self.live: list[Sequence] = []

    def copy(self, done) -> None:
        """A batch of state copies that fails (raises inside, like cache_engine.copy_states) at
        ``fail_rate``; ``done`` is called either way, as by Engine._copy_states."""
        done(self.rng.random() >= self.fail_rate)

    def step(self) -> None:
        cache, sched = self.cache, self.sched
        cache.probe(sched.waiting)
        out = sched.schedule()
        loads = out.loads
        if loads.restores:
            self.copy(lambda ok: cache.loads_done(loads, ok))
        kept = []
        for load in loads.store_loads:
            ok = self.store.load(load)
            keep = cache.store_loaded(load, ok)
            if not ok:
                sched.rollback(load.seq, out)
            elif keep is not None:
                kept.append(keep)
        if kept:
            self.copy(lambda ok: [cache.restored_kept(node, lease, ok) for node, lease in kept])
        if not out.chunks:
            return
        saves = sched.computed(out)
        self.execute(saves)
        for chunk in out.chunks:
            seq = chunk.seq
            if chunk.end < seq.num_tokens:
                continue                          # a prefill chunk short of the last token
            seq.token_ids.append(self.rng.randrange(100))
            if seq.num_generated >= seq.gen_config.max_new_tokens:
                self.execute(sched.finish(seq, 'length'))

    def execute(self, saves) -> None:
        if saves.checkpoints or saves.snapshots:
            self.copy(lambda ok: self.cache.saves_done(saves, ok))
        for put in saves.store_puts:
            self.store.submit(put)

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
                     fail_rate: float, steps: int = 60) -> Harness:
    rng = random.Random(seed)
    h = Harness(rng, num_blocks, runtime, ckpt, decode_save_last, store, fail_rate)
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
    return h


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), num_blocks=st.integers(12, 40), runtime=st.integers(1, 4),
       ckpt=st.integers(1, 6), decode_save_last=st.booleans(), store=st.booleans(),
       fail_rate=st.sampled_from([0.0, 0.2, 0.5]))
def test_random_interleavings_return_every_pin_and_never_evict_a_pinned_checkpoint(
        seed, num_blocks, runtime, ckpt, decode_save_last, store, fail_rate):
    run_interleaving(seed, num_blocks, runtime, ckpt, decode_save_last, store, fail_rate)


def test_the_interleavings_reach_every_pin_purpose_and_preemption():
    """The property above is not vacuous: over fixed seeds every kind of pin is taken,
    requests are preempted, restores come from both tiers, and copies fail."""
    taken, preempted, restored = Counter(), 0, Counter()
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
    assert set(taken) == {'restore_source', 'save_target', 'store_keep', 'staging'}, taken
    assert preempted > 0 and restored['store'] > 0, (preempted, restored)


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
