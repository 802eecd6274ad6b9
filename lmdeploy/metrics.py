"""Prometheus metrics of the API server, all prefixed ``lmdeploy_``.

Two sources:

- engine counters, read from ``Engine.stats()`` at scrape time by :class:`EngineStatsCollector`
  (no copy of them is kept anywhere else, so they cannot drift);
- server-side measurements owned by :class:`ServerMetrics`: HTTP requests by path and status,
  finished choices by reason, prompt/generated tokens, running requests, and the TTFT / TPOT
  histograms (seconds, measured from the request's arrival at the handler).

Invariants: every app gets its own ``CollectorRegistry`` (two servers in one process never
share series); exported counters never decrease (a stats reading lower than the last one
exported is clamped, so a restarted or buggy source cannot make Prometheus see a reset).
"""
from __future__ import annotations

import threading
from operator import itemgetter
from typing import Callable, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ['EngineSeries', 'EngineStatsCollector', 'LedgerCollector', 'ServerMetrics', 'HTTPMetricsMiddleware',
           'ENGINE_SERIES', 'LEDGER_SERIES']


class EngineSeries(NamedTuple):
    """One engine counter: ``Engine.stats()[key]`` exported as ``lmdeploy_<key>_total``; with a
    ``label``, the stat is a ``{label value: count}`` dict and the values in ``always`` are
    exported (as 0) before they are first counted."""
    key: str
    doc: str
    label: str | None = None
    always: tuple[str, ...] = ()


ENGINE_SERIES = (
    EngineSeries('prefix_cache_queried_tokens', 'Prompt tokens looked up in the prefix cache.'),
    EngineSeries('prefix_cache_hit_tokens',
                 'Prompt tokens restored from the local prefix cache (Store hits: store_hit_tokens).'),
    EngineSeries('checkpoints_saved', 'Recurrent-state checkpoints saved.'),
    EngineSeries('checkpoints_saved_by_reason',
                 'Recurrent-state checkpoints published in the local prefix cache, by why they were saved.',
                 'reason', ('prefill', 'prefill_last', 'shared_head', 'junction', 'turn_end', 'restored')),
    EngineSeries('prefix_cache_evictions', 'Entries the local prefix cache evicted under memory pressure, by kind.',
                 'kind', ('checkpoint', 'kv')),
    EngineSeries('host_demotions', 'Checkpoints the device evicted that the host tier kept.'),
    EngineSeries('host_promotions', 'Prefixes restored from the host tier into the device.'),
    EngineSeries('host_evictions', 'Entries (states, KV blocks) the host tier dropped for room.'),
    EngineSeries('host_hit_tokens', 'Prompt tokens restored from the host tier.'),
    EngineSeries('checkpoints_skipped', 'State checkpoint saves skipped, by reason.', 'reason', ('no_free_slot',)),
    EngineSeries('store_put_bytes', 'Bytes put into the Mooncake Store, by object kind.', 'kind', ('state', 'kv')),
    EngineSeries('store_put_objects', 'Objects put into the Mooncake Store, by object kind.', 'kind', ('state', 'kv')),
    EngineSeries('store_get_bytes', 'Payload bytes read from the Store (objects that verified: restores and checks).'),
    EngineSeries('store_put_failures', 'Failed Mooncake Store puts.'),
    EngineSeries('store_get_failures', 'Failed or unverifiable Mooncake Store gets (counted as misses).'),
    EngineSeries('store_hit_tokens', 'Prompt tokens restored from the Mooncake Store.'),
    EngineSeries('store_rejected_objects',
                 'Store objects whose header, checksum or MAC did not verify (counted as misses).'),
    EngineSeries('store_repaired_objects', 'Half-written or rejected Store objects a save replaced.'),
    EngineSeries('store_dropped_puts',
                 'Store saves dropped because the save queue was full (a later save of the prefix retries).'),
    EngineSeries('store_handoff_put_objects', 'Prefill/decode hand-off objects a prefill engine put into the Store.'),
    EngineSeries('store_handoff_hit_tokens',
                 'Prompt tokens a decode engine restored from prefill hand-offs (also in store_hit_tokens).'),
    EngineSeries('handoff_misses',
                 'Requests a decode engine admitted without restoring their hand-off (it computed the prompt '
                 'instead).'),
    EngineSeries('shared_head_checkpoints_saved',
                 "Checkpoints saved at the end of a chat request's shared head (system prompt and tools)."),
    EngineSeries('state_miss_tokens', 'Prompt tokens whose full-attention blocks matched but had no state checkpoint.'),
    EngineSeries('spec_decode_draft_tokens', 'Speculative draft tokens verified by the target model.'),
    EngineSeries('spec_decode_accepted_tokens', 'Speculative draft tokens the target model accepted.'),
)

# TTFT spans queueing and a whole prefill; TPOT is one decode step
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class EngineStatsCollector:
    """A custom collector exporting the engine's cumulative counters at scrape time.

    Args:
        read_stats: returns the ``Engine.stats()`` dict; it must be safe to call from the
            scraping thread (the server passes a call that runs on the engine thread). Missing
            keys read as 0; keyed counters are ``{label_value: count}`` dicts.
    """

    def __init__(self, read_stats: Callable[[], dict]):
        self._read = read_stats
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def _monotonic(self, key: str, label: str, value) -> float:
        value = float(value or 0)
        with self._lock:
            value = max(value, self._last.get((key, label), 0.0))
            self._last[(key, label)] = value
        return value

    def collect(self):
        """Yield one counter family per engine series (``lmdeploy_<name>_total``)."""
        stats = self._read() or {}
        for key, doc, label, always in ENGINE_SERIES:
            value = stats.get(key)
            if label is None:
                yield CounterMetricFamily(f'lmdeploy_{key}', doc, value=self._monotonic(key, '', value))
                continue
            family = CounterMetricFamily(f'lmdeploy_{key}', doc, labels=[label])
            by_label = dict.fromkeys(always, 0)
            by_label.update(value or {})
            with self._lock:    # label values seen once keep being exported
                by_label.update({lab: 0 for (k, lab) in self._last if k == key and lab not in by_label})
            for lab in sorted(by_label):
                family.add_metric([lab], self._monotonic(key, lab, by_label[lab]))
            yield family

    def describe(self):
        """Nothing: describing would need a stats read at registration time."""
        return []


# (metric name without prefix, help, how to read it from Engine.ledger())
LEDGER_SERIES = (
    ('kv_blocks_in_use', 'KV blocks held by requests (not counting cached blocks).',
     itemgetter('blocks_in_use')),
    ('kv_blocks_free', 'KV blocks on the free list.', itemgetter('blocks_free')),
    ('kv_blocks_cached', 'KV blocks held by the local prefix cache.', itemgetter('blocks_cached')),
    ('kv_window_blocks_in_use', "KV blocks of the sliding-window layers' own pool held by requests (0 without one).",
     lambda led: led.get('window_blocks_total', 0) - led.get('window_blocks_free', 0)
     - led.get('window_blocks_cached', 0)),
    ('checkpoint_block_rows', 'KV block rows held by state checkpoints (one memory budget).',
     lambda led: led.get('checkpoint_rows', 0)),
    ('prefix_cache_device_bytes', 'Payload bytes the device tier of the prefix cache holds (KV blocks + checkpoints).',
     lambda led: led.get('device_cache_bytes', 0)),
    ('prefix_cache_host_bytes', 'Payload bytes the host tier of the prefix cache holds.',
     lambda led: led.get('host_cache_bytes', 0)),
    ('state_slots_in_use', 'Runtime recurrent-state slots held by running requests.',
     lambda led: led['runtime_slots_total'] - led['runtime_slots_free']),
    ('checkpoints_pinned', 'State checkpoint slots pinned by a copy in progress.',
     itemgetter('checkpoints_pinned')),
    ('checkpoints_published', 'State checkpoints published in the local prefix cache.',
     itemgetter('checkpoints_published')),
    ('scheduler_requests_running', 'Sequences the scheduler is running.', itemgetter('requests_running')),
    ('scheduler_requests_waiting', 'Sequences waiting for admission.', itemgetter('requests_waiting')),
    ('store_operations_inflight', 'Store save jobs queued or running.', itemgetter('store_inflight')),
    ('store_queue_depth', 'Store save jobs waiting in the queue (not yet taken by a writer).',
     itemgetter('store_queue_depth')),
)


class LedgerCollector:
    """Exports the engine's resource ledger (``Engine.ledger()``) as gauges at scrape time.

    Args:
        read_ledger: returns the ledger dict; safe to call from the scraping thread.
    """

    def __init__(self, read_ledger: Callable[[], dict]):
        self._read = read_ledger

    def collect(self):
        """Yield one gauge per :data:`LEDGER_SERIES` entry (``lmdeploy_<name>``)."""
        ledger = self._read() or {}
        for name, doc, value in LEDGER_SERIES:
            try:
                reading = float(value(ledger))
            except KeyError:
                continue
            yield GaugeMetricFamily(f'lmdeploy_{name}', doc, value=reading)

    def describe(self):
        """Nothing: describing would need a ledger read at registration time."""
        return []


class ServerMetrics:
    """The server's metrics registry: engine counters plus request-level measurements.

    Args:
        read_stats: see :class:`EngineStatsCollector`; None exports only server-side series.
        read_ledger: see :class:`LedgerCollector`; None exports no ledger gauges.
    """

    def __init__(self, read_stats: Callable[[], dict] | None = None,
                 read_ledger: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        if read_stats is not None:
            self.registry.register(EngineStatsCollector(read_stats))
        if read_ledger is not None:
            self.registry.register(LedgerCollector(read_ledger))
        r = self.registry
        self.http_requests = Counter('lmdeploy_http_requests', 'HTTP requests answered, by path and status code.',
                                     ['path', 'status'], registry=r)
        self.requests_finished = Counter('lmdeploy_requests_finished',
                                         'Generation choices finished, by finish reason (abort = client left).',
                                         ['finish_reason'], registry=r)
        self.prompt_tokens = Counter('lmdeploy_prompt_tokens', 'Prompt tokens of admitted requests.', registry=r)
        self.generation_tokens = Counter('lmdeploy_generation_tokens', 'Generated tokens sent to clients.',
                                         registry=r)
        self.requests_running = Gauge('lmdeploy_requests_running', 'Generation choices in flight.', registry=r)
        self.ttft = Histogram('lmdeploy_time_to_first_token_seconds',
                              'Seconds from request arrival to its first generated token.',
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram('lmdeploy_time_per_output_token_seconds',
                              'Mean seconds between generated tokens after the first, one sample per choice.',
                              buckets=_TPOT_BUCKETS, registry=r)

    def observe_choice(self, start: float, first: float | None, last: float | None, num_tokens: int,
                       finish_reason: str) -> None:
        """Record one finished choice (times from ``time.perf_counter()``, in seconds)."""
        self.requests_finished.labels(finish_reason).inc()
        self.generation_tokens.inc(num_tokens)
        if first is not None:
            self.ttft.observe(first - start)
            if num_tokens > 1 and last is not None:
                self.tpot.observe((last - first) / (num_tokens - 1))


class HTTPMetricsMiddleware:
    """Pure ASGI middleware counting responses by path and status (no body buffering, so
    streaming and client-disconnect detection are unaffected). Paths outside ``known_paths``
    are counted as ``other`` to keep label cardinality bounded, except paths under a prefix of
    ``path_templates`` (``{'/v1/models/': '/v1/models/{model}'}``), counted as its template."""

    def __init__(self, app, metrics: ServerMetrics, known_paths: frozenset[str],
                 path_templates: dict[str, str] | None = None):
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths
        self.path_templates = path_templates or {}

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http':
            return await self.app(scope, receive, send)
        path = scope.get('path', '')
        if path not in self.known_paths:
            path = next((label for prefix, label in self.path_templates.items()
                         if path.startswith(prefix) and len(path) > len(prefix)), 'other')

        async def counting_send(message):
            if message['type'] == 'http.response.start':
                self.metrics.http_requests.labels(path, str(message['status'])).inc()
            await send(message)
        await self.app(scope, receive, counting_send)
