"""The KV event stream on the network, in vLLM's wire format (``--kv-events-endpoint``).

What is announced is decided by :class:`~lmdeploy.pytorch.prefix_cache.kv_events.KVEventTracker`
(only restorable prefixes); this module only sends it. Once per engine step the engine hands the
step's events to :meth:`KVEventPublisher.flush`, which queues one batch for a background thread
that owns the sockets::

    PUB    (kv_events_endpoint, bound)   multipart [topic, seq, payload] per batch
                                         seq: 8-byte big-endian, 0, 1, 2, ... per publisher
                                         payload: msgpack [ts, [event, ...], data_parallel_rank]
                                         event: {"type": "BlockStored", "block_hashes",
                                                 "parent_block_hash", "token_ids", "block_size",
                                                 "lora_id", "medium", "lora_name"}
                                              | {"type": "BlockRemoved", "block_hashes", "medium"}
                                              | {"type": "AllBlocksCleared"}
    ROUTER (kv_events_replay_endpoint)   a client sends [b"", start seq (8-byte big-endian)]
                                         (a REQ or DEALER socket) and gets one [b"", seq, payload]
                                         per buffered batch with seq >= start, then
                                         [b"", seq -1 (8 bytes, signed), b""]

This is the stream of vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``: sockets,
seq frames, replay; event fields and ``type`` tags of its msgspec structs; ``ts`` in seconds
since the epoch) in the encoding vllm-router's ``kv_aware`` policy decodes: the batch an array,
each event a map (it refuses a map batch, and events encoded as arrays, the form of older vLLM
releases). The first batch (seq 0) is ``[AllBlocksCleared]``: a router that reconnects to a
restarted engine drops what the previous process announced. The last ``buffer_steps`` batches
are kept for replay, so a restarted router asks from seq 0 and rebuilds the whole view while
the buffer still holds it. Events are never dropped by the engine thread: the queue is
unbounded, and a subscriber slower than the PUB socket's high-water mark loses batches (then
asks for them by seq).

``pyzmq`` and ``msgpack`` are imported only when the feature is on.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from ..prefix_cache.kv_events import AllBlocksCleared, HostEventTracker, KVEventTracker

__all__ = ['KVEventPublisher', 'encode_batch', 'start_publisher', 'END_SEQ']

logger = logging.getLogger('lmdeploy')

END_SEQ = (-1).to_bytes(8, 'big', signed=True)   # the replay's last frame


def encode_batch(events: list, ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    """One batch's payload: msgpack of ``[ts, [event.to_wire(), ...], data_parallel_rank]``.

    Args:
        events: :mod:`~lmdeploy.pytorch.prefix_cache.kv_events` events, in order.
        ts: seconds since the epoch (default: now).
        data_parallel_rank: the engine's data-parallel rank (0: no data parallelism).
    """
    import msgpack
    return msgpack.packb([time.time() if ts is None else ts, [e.to_wire() for e in events], data_parallel_rank],
                         use_bin_type=True)


def _import_zmq():
    try:
        import msgpack  # noqa: F401
        import zmq
    except ImportError as e:      # named, not a bare traceback from deep in the engine
        raise ImportError(f'kv_events_endpoint needs pyzmq and msgpack (pip install pyzmq msgpack): {e}') from e
    return zmq


class KVEventPublisher:
    """Sends a tracker's events on a ZMQ PUB socket, with a replay ROUTER socket.

    Args:
        trackers: where the events come from (drained by :meth:`flush`, in this order: events of
            one tracker keep their order; trackers announce different media).
        endpoint: ``tcp://HOST:PORT`` to bind the PUB socket to.
        replay_endpoint: ``tcp://HOST:PORT`` to bind the ROUTER socket to, or None (no replay).
        buffer_steps: batches kept for replay.
        topic: the first frame of every message.

    Raises:
        ImportError: pyzmq or msgpack is not installed.
        OSError: an endpoint cannot be bound (e.g. the port is in use); the message names the field.
    """

    HWM = 100_000         # messages the PUB socket queues per subscriber before dropping

    def __init__(self, trackers: list, endpoint: str, replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, topic: str = ''):
        zmq = _import_zmq()
        self.trackers = list(trackers)
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.HWM)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint is not None else None
        for sock, ep, name in ((self._pub, endpoint, 'kv_events_endpoint'),
                               (self._replay, replay_endpoint, 'kv_events_replay_endpoint')):
            if sock is None:
                continue
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)        # a bracketed IPv6 host binds too
            try:
                sock.bind(ep)
            except zmq.ZMQError as e:
                self._close_sockets()
                raise OSError(f'{name}: cannot bind {ep!r}: {e}') from e
        self.num_batches = 0      # batches queued so far (the next one's seq)
        self._queue.put([AllBlocksCleared()])
        self.num_batches += 1
        self._thread = threading.Thread(target=self._run, name='kv-events', daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Queue the trackers' events since the last flush as one batch (nothing if none).
        Called by the engine thread once per step; never blocks."""
        events = [e for tracker in self.trackers for e in tracker.take()]
        if events:
            self._queue.put(events)
            self.num_batches += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            this, seq = seq, seq + 1
            try:
                payload = encode_batch(events)
                self._buffer.append((this, payload))
                self._pub.send_multipart([self._topic, this.to_bytes(8, 'big'), payload])
            except Exception:       # a bad batch must not stop the stream (its seq stays a gap)
                logger.exception('kv events: batch %d not sent', this)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning('kv events: malformed replay request (%d frames)', len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], 'big', signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b'', seq.to_bytes(8, 'big'), payload])
        self._replay.send_multipart([client, b'', END_SEQ, b''])


def start_publisher(config, local_tier, host_tier=None) -> KVEventPublisher:
    """The engine's publisher for ``config.kv_events_endpoint`` (and its replay endpoint), fed by
    a tracker attached to ``local_tier`` (announcing checkpointed prefixes when the tier is hybrid)
    and, when there is one, a tracker of ``host_tier`` (medium ``"CPU"``).

    Raises:
        ImportError: pyzmq or msgpack is not installed.
        OSError: an endpoint cannot be bound.
    """
    trackers = [KVEventTracker(local_tier.block_size, local_tier.is_hybrid).attach(local_tier)]
    if host_tier is not None:
        trackers.append(HostEventTracker(local_tier.block_size).attach(host_tier))
    publisher = KVEventPublisher(trackers, config.kv_events_endpoint, config.kv_events_replay_endpoint)
    logger.info('kv events: publishing on %s%s', config.kv_events_endpoint,
                f' (replay on {config.kv_events_replay_endpoint})' if config.kv_events_replay_endpoint else '')
    return publisher
