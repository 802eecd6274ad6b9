"""Which cached checkpoint goes first: pluggable, pure eviction policies.

The local tier holds two kinds of entries: KV blocks (nodes of the block trie) and recurrent-state
checkpoints (published on trie nodes). For a hybrid model a KV block is worth nothing on its own:
a prefix is restorable only up to a checkpoint, so a block with no checkpoint at or below it in
the trie (a *dead* block) cannot make any restore deeper. The tier therefore always evicts dead
blocks first (least recently used first), and asks the policy only which **checkpoint** goes
next; evicting a checkpoint turns the blocks only it made usable into dead blocks, which go next::

    need room ─▶ dead KV leaf left? ──yes──▶ evict it (LRU)
                      │ no
                      ▼
                 policy.select(checkpoints) ─▶ release it; its exclusive blocks become dead

A policy is a small object with one pure scoring function of an entry's statistics
(:class:`CheckpointStats`); it never touches the trie. Lower scores go first.

* :class:`LRUPolicy` (``cache_eviction='lru'``): the least recently used checkpoint.
* :class:`ReuseAwarePolicy` (``cache_eviction='reuse'``, the default): GreedyDual-Size-Frequency
  (L. Cherkasova, "Improving WWW proxies performance with Greedy-Dual-Size-Frequency caching
  policy", HP Labs HPL-98-69, 1998) with the cost of an entry taken as the prefill it saves, as
  Marconi does for hybrid models (R. Pan et al., "Marconi: Prefix Caching for the Era of Hybrid
  LLMs", MLSys 2025: utility = recency + FLOP efficiency). The score is fixed when the entry is
  published or consumed::

      score = L + E[further hits] · tokens_saved / bytes_held

  ``L`` is the score of the last victim (so entries not used for a while age relative to new
  ones), ``tokens_saved`` the prefill tokens a hit skips beyond the next shallower checkpoint on
  its path, ``bytes_held`` the checkpoint plus the KV blocks only it makes usable, and
  ``E[further hits] = p / (1 - p)``, where ``p`` is the chance of one more hit the policy has
  measured for checkpoints of the same class (why it was saved, whether its request continued an
  earlier prefix, how many earlier requests reached its exact prefix, whether a deeper checkpoint
  is below it, and the length of its prefix on a log scale) with as many hits so far; a length
  class is smoothed towards the rate of its class without the length, so a length seen rarely
  borrows what its class measured.
  ``bytes_held`` changes when another checkpoint starts or stops sharing the blocks: the tier
  reweighs the nearest checkpoint above one published or evicted (:meth:`EvictionPolicy.reweigh`),
  so an interior chunk-end checkpoint with a deeper one below it weighs only its state, and its
  reuse (only by a request that leaves the deeper one's path in between) is learned apart.
  A never-used checkpoint of a class rarely reused (a prefix the client never sends again) thus
  scores near ``L`` and goes before proven ones, in the spirit of Marconi's admission rule.
* :class:`OfflineOptimalPolicy` (``'optimal'``, benchmarks only): Belady's rule, evict the
  checkpoint used farthest in the future, given an oracle of future uses.

Scores are fixed between uses, so the victim comes from a min-heap with lazy invalidation in
O(log N) (:meth:`EvictionPolicy.select`); :meth:`EvictionPolicy.victim` is the same rule as a
scan, the reference the heap is tested against.

Only the checkpoint a hit consumes is touched (its hit count and recency); the other nodes a
match walks are only counted as reached.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

__all__ = ['CheckpointStats', 'EvictionPolicy', 'LRUPolicy', 'ReuseAwarePolicy', 'OfflineOptimalPolicy',
           'make_policy', 'EVICTION_POLICIES', 'SAVE_REASONS']

EVICTION_POLICIES = ('reuse', 'lru')

# why a checkpoint was saved (the `reason` of CheckpointStats; also the label of the
# lmdeploy_checkpoints_saved_by_reason series)
SAVE_REASONS = ('prefill', 'prefill_last', 'shared_head', 'junction', 'turn_end', 'restored')


@dataclass
class CheckpointStats:
    """What a policy knows of one published checkpoint.

    Attributes:
        slot: the checkpoint's slot id.
        boundary: tokens of the prefix it restores.
        tokens_saved: prefill tokens a hit on it skips beyond the next shallower checkpoint on its
            path (``boundary`` when there is none).
        nbytes: bytes evicting it frees: the state plus the KV blocks only it makes usable.
        reason: why it was saved (one of :data:`SAVE_REASONS`).
        continuation: the request that saved it continued an earlier prefix (a cache hit or a
            chat with history), evidence that its conversation goes on.
        hits: restores that consumed it.
        reached: requests whose match walked through its node (consumed or not).
        last_use: logical time of the last publish or hit (a counter, not seconds).
        score: the policy's score, fixed at the last publish or hit.
        cls: the class the policy filed it under at publish (its own business).
        key: an identity of its prefix the benchmark's oracle understands (opaque here).
        entry: the sequence number of its current heap entry (older entries are stale; -1: none).
        aged: the policy's age term when it was last scored (GreedyDual's ``L``; 0 for others).
        covered: a deeper checkpoint is published below it (a hit on it needs a request that
            leaves the deeper one's path in between).
    """
    slot: int
    boundary: int
    tokens_saved: int
    nbytes: int
    reason: str = 'prefill'
    continuation: bool = False
    hits: int = 0
    reached: int = 0
    last_use: int = 0
    score: float = 0.0
    key: object = None
    cls: tuple | None = None
    entry: int = -1
    aged: float = 0.0
    covered: bool = False


class EvictionPolicy:
    """Base class: scores checkpoints; the lowest score is evicted first.

    Scores are fixed when an entry is published or used, so the policy keeps them in a min-heap
    with lazy invalidation: :meth:`rescore` pushes a new entry (the older ones of the same
    checkpoint go stale), and :meth:`select` skips stale entries and pinned checkpoints. Choosing
    a victim costs O((stale + pinned) log N) instead of a scan of every checkpoint; stale entries
    are dropped in bulk once they outnumber live ones (amortized O(log N) per rescore).
    :meth:`victim` is the same rule as a scan (the reference :meth:`select` must agree with).
    """

    name = 'base'

    def __init__(self):
        self._heap: list[tuple] = []
        self._seq = itertools.count()

    def rescore(self, stats: CheckpointStats, clock: int) -> None:
        """Recompute ``stats.score`` after a publish or a hit at logical time ``clock``."""
        stats.last_use = clock
        stats.score = self.score(stats, clock)
        self._push(stats)

    def _push(self, stats: CheckpointStats) -> None:
        stats.entry = next(self._seq)
        heapq.heappush(self._heap, (stats.score, stats.last_use, stats.slot, stats.entry, stats))

    def score(self, stats: CheckpointStats, clock: int) -> float:
        raise NotImplementedError

    def reweigh(self, stats: CheckpointStats, nbytes: int, covered: bool) -> None:
        """The bytes evicting ``stats`` would free changed to ``nbytes`` and whether a deeper
        checkpoint is below it to ``covered`` (one was published or evicted on its path), without
        a use: recency and age are kept. The scores of this base class depend on neither."""
        stats.nbytes, stats.covered = nbytes, covered

    def victim(self, candidates: Iterable[CheckpointStats], clock: int) -> CheckpointStats | None:
        """The candidate to evict now (None when there is none), by a scan: O(len(candidates))."""
        return min(candidates, key=lambda s: (s.score, s.last_use, s.slot), default=None)

    def select(self, live: Mapping[int, CheckpointStats], pinned: Callable[[int], bool],
               clock: int) -> CheckpointStats | None:
        """The checkpoint to evict now among ``live`` (slot -> statistics of every published
        checkpoint) that are not ``pinned(slot)``; the same choice as :meth:`victim` over them,
        in O((stale + pinned) log N). Entries of checkpoints no longer in ``live`` are dropped."""
        heap, aside, choice = self._heap, [], None
        if len(heap) > 2 * len(live) + 64:       # mostly stale: rebuild from the live entries
            heap[:] = [e for e in heap if live.get(e[2]) is e[4] and e[4].entry == e[3]]
            heapq.heapify(heap)
        while heap:
            entry = heap[0]
            stats = entry[4]
            if live.get(entry[2]) is not stats or stats.entry != entry[3]:
                heapq.heappop(heap)       # a rescored or released checkpoint's old entry
                continue
            if pinned(entry[2]):
                aside.append(heapq.heappop(heap))
                continue
            choice = stats
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return choice

    def released(self, stats: CheckpointStats, evicted: bool) -> None:
        """``stats``' checkpoint left the cache (``evicted``: chosen to make room)."""
        if evicted:
            self.evicted(stats)

    def evicted(self, stats: CheckpointStats) -> None:
        """``stats`` was just evicted (a policy may age the others from it)."""

    def published(self, stats: CheckpointStats) -> None:
        """``stats`` was just published (before its first score)."""

    def hit(self, stats: CheckpointStats) -> None:
        """A restore just consumed ``stats`` (``stats.hits`` already counts it)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first: the score is the time of the last publish or hit."""

    name = 'lru'

    def score(self, stats: CheckpointStats, clock: int) -> float:
        return float(stats.last_use)


class ReuseAwarePolicy(EvictionPolicy):
    """GreedyDual-Size-Frequency over prefill saved per byte held (module docstring), weighted by
    the expected number of further hits, learned online.

    A checkpoint falls, when it is published, into a class: why it was saved, whether the request
    that saved it continued an earlier prefix, and how many earlier requests reached its exact
    prefix (0, 1, 2 or more). For each class and each number of hits so far (0, 1, 2, 3 or more)
    the policy counts the checkpoints that got there and those of them that were hit once more;
    ``p``, their ratio (smoothed towards a prior: per save reason for unused checkpoints, 1/2 for
    used ones), estimates the chance of one more hit, and ``p / (1 - p)`` (the mean of a
    geometric number of further hits) is the evidence the score weighs the prefill by::

        score = L + p / (1 - p) · tokens_saved / bytes_held

    So a never-used checkpoint of a class that is rarely reused (a branch nobody came back to)
    scores near 0 and cannot displace a proven one, whose evidence grows with what hits predicted
    further hits on this traffic; which signals predict reuse (a shared head, a continued
    conversation, a regenerate, a branch, a hit) is measured, not fixed.

    The class also holds the prefix length on a log scale and whether a deeper checkpoint is
    below (:meth:`reuse_class`); a length class is smoothed towards its class without the length.

    Args:
        smoothing: pseudo-counts of the prior in each coarse class's estimate.
        fine_smoothing: pseudo-counts of the coarse estimate in each length class's (more than
            ``smoothing``: a length class has a few times fewer samples than its coarse class).
    """

    name = 'reuse'
    # prior chance that a never-used checkpoint is used (before its class has data), per save
    # reason: where a prefix is likely to be sent again
    PRIOR = {'prefill': 0.2, 'prefill_last': 0.4, 'shared_head': 0.9, 'junction': 0.8, 'turn_end': 0.5,
             'restored': 0.6}
    USED_PRIOR = 0.5            # prior chance of one more hit of a used checkpoint
    MAX_HITS = 3                # hits counted apart (more fall into the last bucket)
    COARSE = 4                  # fields of the coarse class (reason, continuation, reached, covered)

    def __init__(self, smoothing: float = 4.0, fine_smoothing: float = 16.0):
        super().__init__()
        self.smoothing, self.fine_smoothing = smoothing, fine_smoothing
        self.inflation = 0.0      # L: the score of the last victim
        self._reached: dict[tuple, int] = {}     # (class, hits) -> checkpoints that got there
        self._again: dict[tuple, int] = {}       # (class, hits) -> of them, hit once more

    @staticmethod
    def reuse_class(stats: CheckpointStats) -> tuple:
        """The class a checkpoint's reuse is learned in: the coarse class (save reason,
        continuation, earlier requests that reached its prefix: 0, 1, 2 or more, and whether it
        is covered by a deeper checkpoint) plus the length of the prefix it restores on a log
        scale (``boundary.bit_length()``, a doubling of tokens per step). How often a prefix of a
        given length is sent again can differ a lot between lengths (on the Mooncake trace an
        interior checkpoint at 8K tokens was hit 2 times in 632, one at 32K-64K 31 in 235), and
        the rate of each length is measured, not assumed."""
        return (stats.reason, stats.continuation, min(stats.reached, 2), stats.covered,
                max(stats.boundary, 1).bit_length())

    def _bucket(self, cls: tuple, hits: int) -> tuple:
        return cls, min(hits, self.MAX_HITS)

    def _count(self, table: dict, cls: tuple, hits: int, delta: int = 1) -> None:
        # the fine class and its coarse parent (the class without the length) both count
        for c in (cls, cls[:self.COARSE]):
            b = self._bucket(c, hits)
            table[b] = table.get(b, 0) + delta

    def p_again(self, cls: tuple, hits: int) -> float:
        """Smoothed chance that a checkpoint of class ``cls`` with ``hits`` hits is hit again (< 1).

        Estimated hierarchically: the coarse class's rate is smoothed towards the prior (per save
        reason for unused checkpoints, 1/2 for used ones), and a fine class's rate towards its
        coarse class's, so a length not seen yet starts from what its reason has measured. A
        ``cls`` of :attr:`COARSE` fields or fewer gets the coarse estimate."""
        prior = self.PRIOR.get(cls[0], 0.3) if hits == 0 else self.USED_PRIOR
        chain = (cls[:self.COARSE], cls) if len(cls) > self.COARSE else (cls,)
        p = prior
        for level, c in enumerate(chain):
            b = self._bucket(c, hits)
            m = self.fine_smoothing if level else self.smoothing
            p = (self._again.get(b, 0) + m * p) / (self._reached.get(b, 0) + m)
        return p

    def reuse_rate(self, cls: tuple) -> float:
        """Smoothed share of the class's checkpoints that were hit at least once."""
        return self.p_again(cls, 0)

    def published(self, stats: CheckpointStats) -> None:
        stats.cls = self.reuse_class(stats)
        self._count(self._reached, stats.cls, 0)

    def hit(self, stats: CheckpointStats) -> None:
        if stats.cls is None:
            return
        self._count(self._again, stats.cls, stats.hits - 1)
        self._count(self._reached, stats.cls, stats.hits)

    def evidence(self, stats: CheckpointStats) -> float:
        """Expected further hits of the entry (> 0)."""
        cls = stats.cls if stats.cls is not None else self.reuse_class(stats)
        p = self.p_again(cls, stats.hits)
        return p / (1.0 - p)

    def value(self, stats: CheckpointStats) -> float:
        """Expected further prefill tokens saved per byte held."""
        return self.evidence(stats) * max(stats.tokens_saved, 1) / max(stats.nbytes, 1)

    def score(self, stats: CheckpointStats, clock: int) -> float:
        return self.inflation + self.value(stats)

    def rescore(self, stats: CheckpointStats, clock: int) -> None:
        stats.aged = self.inflation
        super().rescore(stats, clock)

    def reweigh(self, stats: CheckpointStats, nbytes: int, covered: bool) -> None:
        """New bytes, same age: ``score = aged + value``, the age of its last use kept (a shared
        block is no reason to look recently used). The first time a checkpoint is ``covered`` it is
        filed under the covered class for good (its count at its present hits moves there): an
        interior checkpoint's reuse is learned apart from a request's last one's, and a
        checkpoint whose deeper one was evicted again is still counted where it was covered."""
        stats.nbytes = nbytes
        if covered and not stats.covered and stats.cls is not None and not stats.cls[3]:
            new = self.reuse_class(dataclasses.replace(stats, covered=covered))
            self._count(self._reached, stats.cls, stats.hits, -1)
            self._count(self._reached, new, stats.hits)
            stats.cls = new
        stats.covered = covered
        stats.score = stats.aged + self.value(stats)
        self._push(stats)

    def evicted(self, stats: CheckpointStats) -> None:
        self.inflation = max(self.inflation, stats.score)


class OfflineOptimalPolicy(EvictionPolicy):
    """Belady's offline optimum: evict the checkpoint whose next use is farthest away.

    Args:
        next_use: ``next_use(key, clock) -> float``, the logical time of the next request that
            will restore from the prefix ``key`` after ``clock`` (``inf``: never). Benchmarks build
            it from a whole trace; an engine serving live traffic cannot.
    """

    name = 'optimal'

    def __init__(self, next_use: Callable[[object, int], float]):
        super().__init__()
        self.next_use = next_use
        self._by_key: dict[object, CheckpointStats] = {}

    def score(self, stats: CheckpointStats, clock: int) -> float:
        return -self.next_use(stats.key, clock)

    def published(self, stats: CheckpointStats) -> None:
        self._by_key[stats.key] = stats

    def evicted(self, stats: CheckpointStats) -> None:
        if self._by_key.get(stats.key) is stats:
            del self._by_key[stats.key]

    def refresh(self, keys: Iterable[object], clock: int) -> None:
        """The next use of each prefix in ``keys`` moved (time passed one of its uses): rescore
        their checkpoints without touching their recency. The heap of :meth:`select` is exact only
        if the oracle's owner calls this for every prefix whose next use it passed."""
        for key in keys:
            stats = self._by_key.get(key)
            if stats is not None:
                stats.score = self.score(stats, clock)
                self._push(stats)

    def victim(self, candidates: Iterable[CheckpointStats], clock: int) -> CheckpointStats | None:
        # the next use moves as time passes: score every candidate now
        return min(candidates, key=lambda s: (-self.next_use(s.key, clock), s.last_use, s.slot), default=None)


def make_policy(name: str) -> EvictionPolicy:
    """The policy named by ``cache_eviction``.

    Raises:
        ValueError: an unknown name (the message lists :data:`EVICTION_POLICIES`).
    """
    if name == 'lru':
        return LRUPolicy()
    if name == 'reuse':
        return ReuseAwarePolicy()
    raise ValueError(f'cache_eviction must be one of {list(EVICTION_POLICIES)}, got {name!r}')
