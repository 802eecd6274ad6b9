"""The bookkeeping a worker's decode-graph caches share: keyed graphs in least-recently-used
order, bounded, with counters, dropped whole when the caches they address change.

:class:`~.decode_graph.DecodeGraphCache` (CPU recordings) and :class:`~.cuda_graph.CudaGraphCache`
(CUDA graphs) differ in their keys, in what a graph is and in how one is made and run; what they
keep around the graphs is this class.
"""
from __future__ import annotations

import collections
from typing import Callable

__all__ = ['GraphCache']


class GraphCache:
    """Keyed graphs, least recently used dropped beyond ``max_graphs``.

    Args:
        max_graphs: graphs kept (refused keys count too, so they stay refused).

    Attributes:
        graphs: ``OrderedDict`` key -> graph, least recently used first.
        captures: graphs recorded or captured (as the subclass counts them).
        replays: steps run by replay.
        refusals: keys refused (they run eagerly from then on).
        evictions: graphs dropped for the bound.
    """

    def __init__(self, max_graphs: int):
        self.max_graphs = max_graphs
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.captures = self.replays = self.refusals = self.evictions = 0
        self._caches = None

    def clear(self) -> None:
        """Drop every graph (the caches were rebuilt or the weights changed)."""
        self.graphs.clear()
        self._caches = None

    def counters(self) -> dict[str, int]:
        """``{'captures', 'replays', 'refusals', 'evictions', 'graphs'}``."""
        return dict(captures=self.captures, replays=self.replays, refusals=self.refusals,
                    evictions=self.evictions, graphs=len(self.graphs))

    def _bind_caches(self, kv_caches, state_caches) -> None:
        """Drop every graph when ``kv_caches`` or ``state_caches`` is not the object the graphs
        were made on (compared by identity), then remember these."""
        if self._caches is None or self._caches[0] is not kv_caches or self._caches[1] is not state_caches:
            self.clear()
            self._caches = (kv_caches, state_caches)

    def _graph_for(self, key, make: Callable[[], object]):
        """The graph of ``key``, marked most recently used; a new one from ``make()`` when none is
        kept (then the least recently used graph is dropped if the cache holds more than
        ``max_graphs``, counted in :attr:`evictions`)."""
        graph = self.graphs.get(key)
        if graph is None:
            graph = make()
            self.graphs[key] = graph
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
                self.evictions += 1
        else:
            self.graphs.move_to_end(key)
        return graph
