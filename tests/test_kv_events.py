"""KV events (``--kv-events-endpoint``): a router's view built from the stream equals the prefixes
the engine can restore.

The stream is decoded here with msgpack alone, following vLLM's published schema (an event batch
is ``[ts, events, data_parallel_rank]``; each event a map tagged by ``type``: ``BlockStored``
with ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``,
``medium``; ``BlockRemoved`` with ``block_hashes``, ``medium``; ``AllBlocksCleared``), not with
the encoder's own classes. A real consumer, vllm-router's ``kv_aware`` policy, reads the same
stream in ``test_vllm_router_credits_only_restorable_prefixes`` (skipped where it is not installed).

The random workloads run the engine's real scheduler, prefix cache, block trie, state slots and
eviction on a tiny pool without a model (each copy "succeeds", as in benchmark/trace_sim.py).
"""
from __future__ import annotations

import random
import socket
import time

import msgpack
import pytest

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.config import SchedulerConfig
from lmdeploy.pytorch.engine.kv_event_publisher import KVEventPublisher, encode_batch
from lmdeploy.pytorch.engine.scheduler import Scheduler
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.sequence import Sequence
from lmdeploy.pytorch.prefix_cache.coordinator import PrefixCache
from lmdeploy.pytorch.prefix_cache.eviction import make_policy
from lmdeploy.pytorch.prefix_cache.host_tier import HostTier
from lmdeploy.pytorch.prefix_cache.kv_events import HostEventTracker, KVEventTracker, external_hash
from lmdeploy.pytorch.prefix_cache.local_tier import LocalTier
from lmdeploy.pytorch.prefix_cache.state_cache import StateCache

B, A, P = 4, 8, 16          # block size, checkpoint alignment, prefill chunk (tokens)


class RouterView:
    """What a KV-aware router knows about one engine: per medium, block hash -> (parent hash,
    tokens)."""

    def __init__(self, block_size: int = B):
        self.block_size = block_size
        self.media: dict[str, dict[int, tuple[int | None, tuple]]] = {'GPU': {}, 'CPU': {}}
        self.next_seq = 0

    @property
    def blocks(self) -> dict[int, tuple[int | None, tuple]]:
        """The device tier's blocks (medium ``GPU``)."""
        return self.media['GPU']

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f'batch {seq} arrived, expected {self.next_seq}'
        self.next_seq += 1
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank == 0
        for ev in events:
            tag = ev['type']
            if tag == 'BlockStored':
                hashes, parent, tokens, block_size, lora_id, medium = (
                    ev[k] for k in ('block_hashes', 'parent_block_hash', 'token_ids', 'block_size', 'lora_id',
                                    'medium'))
                assert block_size == self.block_size and lora_id is None
                blocks = self.media[medium]
                assert len(tokens) == block_size * len(hashes)
                assert parent is None or parent in blocks, 'a chain hangs from an unknown block'
                for i, h in enumerate(hashes):
                    assert 0 <= h < 2 ** 63
                    assert h not in blocks, 'a block announced twice'
                    blocks[h] = (parent if i == 0 else hashes[i - 1],
                                 tuple(tokens[i * block_size:(i + 1) * block_size]))
            elif tag == 'BlockRemoved':
                blocks = self.media[ev['medium']]
                for h in ev['block_hashes']:
                    assert h in blocks, 'a block withdrawn that was never announced'
                    del blocks[h]
            else:
                assert ev == {'type': 'AllBlocksCleared'}
                for blocks in self.media.values():
                    blocks.clear()

    def leaves(self, medium: str = 'GPU') -> set[int]:
        blocks = self.media[medium]
        parents = {p for p, _ in blocks.values()}
        return set(blocks) - parents


def _path(node) -> list[tuple[bytes, bytes | None, tuple]]:
    """``(key, parent key or None, tokens)`` of every block from the root to ``node``."""
    out = []
    while node.parent is not None:
        out.append((node.key, node.parent.key if node.parent.parent is not None else None, node.tokens))
        node = node.parent
    return out[::-1]


def host_restorable(host: HostTier, demoted: dict) -> dict[int, tuple[int | None, tuple]]:
    """The host tier's own answer: every block on the path of a held checkpoint whose path
    blocks are all held too (``demoted``: state key -> its path, recorded at demotion)."""
    out = {}
    for key, path in demoted.items():
        if ('state', key) in host and all(('kv', k) in host for k, _, _ in path):
            for k, parent, tokens in path:
                out[external_hash(k)] = (None if parent is None else external_hash(parent), tokens)
    return out


def restorable(local: LocalTier) -> dict[int, tuple[int | None, tuple]]:
    """The engine's own answer, from the trie walked afresh: every block on the path to a node
    holding a published checkpoint (hybrid), or every cached block (full attention)."""
    out = {}

    def add(node):
        parent = None if node.parent.parent is None else external_hash(node.parent.key)
        out[external_hash(node.key)] = (parent, node.tokens)

    for node in local.trie.iter_nodes():
        if not local.is_hybrid:
            add(node)
        elif node.checkpoint_slot is not None:
            n = node
            while n.parent is not None:
                add(n)
                n = n.parent
    return out


def _workload(rng: random.Random, num_requests: int):
    """Prompts with shared heads, multi-turn continuations and one-offs (tokens 1..999)."""
    heads = [[rng.randrange(1, 1000) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    history: list[list[int]] = []
    for _ in range(num_requests):
        r = rng.random()
        if history and r < 0.4:
            base = list(rng.choice(history))
        elif r < 0.75:
            base = list(rng.choice(heads))
        else:
            base = []
        prompt = (base + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 16))])[-56:]
        history.append(prompt)
        yield prompt, rng.randrange(1, 6)


def _replay_workload(hybrid: bool, num_requests: int, seed: int, tracker_hybrid: bool | None = None,
                     decode_save_last: bool = False, last_only: bool = False, host_bytes: int = 0):
    """Run the workload; after every step decode the step's batch into a router view and
    compare it with :func:`restorable` (and, with a host tier of ``host_bytes`` — a checkpoint
    weighs 2, a block 1 — with :func:`host_restorable`). Returns (local tier, steps with cached
    blocks no checkpoint covers, host tier or None)."""
    rng = random.Random(seed)
    concurrency, rows = 3, 40
    bm = BlockManager(rows)
    sc = (StateCache(concurrency, None, block_manager=bm, rows_per_checkpoint=2, policy=make_policy('reuse'))
          if hybrid else None)
    local = LocalTier(bm, B, sc)
    tracker = KVEventTracker(B, hybrid if tracker_hybrid is None else tracker_hybrid).attach(local)
    host, trackers, demoted = None, [tracker], {}
    if host_bytes:
        host = HostTier(None, host_bytes, B, 2, 1)
        trackers.append(HostEventTracker(B).attach(host))
    cache = PrefixCache(local, None, block_size=B, alignment=A, decode_save_last=decode_save_last, host=host)
    if host is not None:        # record each demoted checkpoint's path, for the reference answer
        sc.on_evict = lambda node, ref: (demoted.__setitem__(node.key, _path(node)), host.demote(node, ref))
    sched = Scheduler(SchedulerConfig(B, concurrency, P, A, last_only), bm, sc, cache)
    view, seq_no, uncovered_steps = RouterView(), 0, 0
    requests = _workload(rng, num_requests)
    pending = True
    in_flight = 0

    def check():
        nonlocal seq_no, uncovered_steps
        events = [e for t in trackers for e in t.take()]
        if events:
            view.apply(seq_no, encode_batch(events))
            seq_no += 1
        engine_view = restorable(local)
        assert view.blocks == engine_view
        if host is not None:
            assert view.media['CPU'] == host_restorable(host, demoted)
        if hybrid:
            nodes = {external_hash(n.key): n for n in local.trie.iter_nodes()}
            assert all(nodes[h].checkpoint_slot is not None for h in view.leaves()), \
                'an announced chain ends at a block without a checkpoint'
            uncovered_steps += len(nodes) > len(engine_view)

    while pending or sched.has_work:
        while pending and in_flight < concurrency:
            try:
                prompt, max_new = next(requests)
            except StopIteration:
                pending = False
                break
            sched.add(Sequence(prompt, GenerationConfig(max_new_tokens=max_new, ignore_eos=True)))
            in_flight += 1
        out = sched.schedule()
        for load in list(out.loads.host_loads):
            ok = host.load(load)
            keep = cache.host_loaded(load, ok)
            if not ok:
                sched.rollback(load.seq, out)
            elif keep is not None:
                cache.restored_kept(*keep, True)
        if out.loads:
            cache.loads_done(out.loads, True)
        if not out.chunks:
            check()
            continue
        cache.saves_done(sched.computed(out), True)
        for c in out.chunks:
            seq = c.seq
            if c.end < seq.num_tokens:
                continue
            seq.token_ids.append(1 + (seq.num_tokens * 7 + seq.seq_id) % 999)
            if seq.num_generated >= seq.gen_config.max_new_tokens:
                cache.saves_done(sched.finish(seq, 'length'), True)
                in_flight -= 1
        check()
    return local, uncovered_steps, host


@pytest.mark.parametrize('hybrid,decode_save_last,last_only', [(True, False, False), (True, True, True),
                                                               (False, False, False)],
                         ids=['hybrid', 'hybrid-turn-end-last-only', 'attention-only'])
def test_router_view_equals_restorable_set(hybrid, decode_save_last, last_only):
    """1,000 random requests on a 40-row pool: after every step the view built from the decoded
    stream equals the engine's restorable set (hashes, parent links and tokens), every announced
    chain ends at a checkpoint, and eviction happened (of checkpoints and of blocks)."""
    local, uncovered, _ = _replay_workload(hybrid, 1000, seed=7, decode_save_last=decode_save_last,
                                           last_only=last_only)
    ev = local.num_evictions
    assert ev['kv'] > 100
    if hybrid:
        assert ev['checkpoint'] > 50
        assert uncovered > 100      # raw attention blocks were cached: announcing them would show


def test_host_tier_view_equals_its_restorable_set():
    """With a host tier of 24 units (a checkpoint 2, a block 1) behind the same pool, 1,000 random
    requests: after every step the ``CPU`` medium of the view equals the checkpoints the host tier
    can restore on its own (state and every path block held), while it demotes, promotes and
    drops entries (least recently used first)."""
    local, _, host = _replay_workload(True, 1000, seed=11, host_bytes=24)
    counters = host.stats()
    assert counters['host_demotions'] > 100 and counters['host_promotions'] > 10
    assert counters['host_evictions'] > 100


def test_announcing_raw_attention_blocks_is_caught():
    """The check above fails for a tracker that announces every cached block of a hybrid model."""
    with pytest.raises(AssertionError):
        _replay_workload(True, 100, seed=7, tracker_hybrid=False)


def test_hybrid_events_by_hand():
    """A 9-token prompt (B=4, A=8) caches two blocks and checkpoints the second: one BlockStored
    with both; a 5-token prompt caches one block with no checkpoint: nothing; evicting the
    checkpoint withdraws both blocks."""
    bm = BlockManager(16)
    sc = StateCache(2, 4)
    local = LocalTier(bm, B, sc)
    tracker = KVEventTracker(B, True).attach(local)
    cache = PrefixCache(local, None, block_size=B, alignment=A)
    sched = Scheduler(SchedulerConfig(B, 2, P, A, False), bm, sc, cache)
    prompt = list(range(10, 19))
    for tokens in (prompt, [50, 51, 52, 53, 54]):
        _serve_alone(sched, cache, tokens)
        batch = msgpack.unpackb(encode_batch(tracker.take(), ts=1.5), raw=False)
        if tokens is prompt:
            nodes = local.trie.match(prompt)
            hashes = [external_hash(n.key) for n in nodes]
            assert batch == [1.5, [{'type': 'BlockStored', 'block_hashes': hashes, 'parent_block_hash': None,
                                    'token_ids': prompt[:8], 'block_size': B, 'lora_id': None, 'medium': 'GPU',
                                    'lora_name': None}], 0]
        else:
            assert batch == [1.5, [], 0]
    assert local.trie.num_nodes == 3 and sc.num_published == 1
    sc.release_checkpoint(nodes[1].checkpoint_slot, evicted=True)
    assert [e.to_wire() for e in tracker.take()] == [{'type': 'BlockRemoved', 'block_hashes': [hashes[1], hashes[0]],
                                                      'medium': 'GPU'}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _stream(sub, ctx, replay_endpoint: str, start: int, stop: int) -> list[tuple[int, bytes]]:
    """Batches ``start <= seq < stop`` as a router gets them: live from ``sub``, and what the
    live stream missed (a PUB socket drops what it sent before the subscription reached it) by
    replay."""
    out, nxt = [], start
    while nxt < stop:
        if not sub.poll(2000):          # nothing more will come live: replay the rest
            out += [(s, p) for s, p in _replay(ctx, replay_endpoint, nxt) if nxt <= s < stop]
            break
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b''
        seq = int.from_bytes(seq_bytes, 'big')
        if seq < nxt:
            continue
        if seq > nxt:                   # a gap: fill it from the replay buffer
            out += [(s, p) for s, p in _replay(ctx, replay_endpoint, nxt) if nxt <= s < seq]
        out.append((seq, payload))
        nxt = seq + 1
    assert [s for s, _ in out] == list(range(start, stop))
    return out


def _replay(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask a replay endpoint for the batches from ``start`` on (a DEALER, as vLLM's clients);
    ``(seq, payload)`` in order, the end marker ``(-1, b'')`` last."""
    import zmq
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b'', start.to_bytes(8, 'big')])
    frames = []
    while not frames or frames[-1][0] != -1:
        assert dealer.poll(5000), 'replay did not answer'
        empty, seq_bytes, payload = dealer.recv_multipart()
        assert empty == b''
        frames.append((int.from_bytes(seq_bytes, 'big', signed=True), payload))
    dealer.close(0)
    return frames


def test_publisher_socket_and_replay():
    """Over real sockets on 127.0.0.1: seq 0 is AllBlocksCleared, then one batch per flush with
    events; a replay from seq 1 returns the buffered batches and ends with seq -1."""
    zmq = pytest.importorskip('zmq')
    pub_ep, replay_ep = f'tcp://127.0.0.1:{_free_port()}', f'tcp://127.0.0.1:{_free_port()}'

    class Node:
        def __init__(self, key, tokens, parent):
            self.key, self.tokens, self.parent = key, tokens, parent

    root = Node(b'\0' * 16, (), None)
    tracker = KVEventTracker(B, False)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b'')
    publisher = KVEventPublisher([tracker], pub_ep, replay_ep, buffer_steps=8)
    try:
        sub.connect(pub_ep)
        time.sleep(0.2)     # usually enough for the subscription to reach PUB (else _stream replays)
        a = Node(bytes([1] * 16), (1, 2, 3, 4), root)
        b = Node(bytes([2] * 16), (5, 6, 7, 8), a)
        tracker.block_cached(a)
        tracker.block_cached(b)
        publisher.flush()
        publisher.flush()       # nothing new: no batch
        tracker.block_dropped(b)
        publisher.flush()
        got = _stream(sub, ctx, replay_ep, 1, 3)
        assert publisher.num_batches == 3
        ha, hb = external_hash(a.key), external_hash(b.key)
        assert msgpack.unpackb(got[0][1])[1] == [{'type': 'BlockStored', 'block_hashes': [ha, hb],
                                                  'parent_block_hash': None, 'token_ids': [1, 2, 3, 4, 5, 6, 7, 8],
                                                  'block_size': B, 'lora_id': None, 'medium': 'GPU',
                                                  'lora_name': None}]
        assert msgpack.unpackb(got[1][1])[1] == [{'type': 'BlockRemoved', 'block_hashes': [hb], 'medium': 'GPU'}]
        frames = _replay(ctx, replay_ep, 0)
        assert [s for s, _ in frames] == [0, 1, 2, -1]
        assert msgpack.unpackb(frames[0][1])[1] == [{'type': 'AllBlocksCleared'}]
        assert frames[1][1] == got[0][1] and frames[-1][1] == b''
    finally:
        publisher.close()
        sub.close(0)
        ctx.term()


def test_a_port_in_use_names_the_field():
    with socket.socket() as held:
        held.bind(('127.0.0.1', 0))
        held.listen()
        busy = f'tcp://127.0.0.1:{held.getsockname()[1]}'
        with pytest.raises(OSError, match='kv_events_replay_endpoint'):
            KVEventPublisher([], f'tcp://127.0.0.1:{_free_port()}', busy)
        with pytest.raises(OSError, match='kv_events_endpoint'):
            KVEventPublisher([], busy)


@pytest.mark.parametrize('field,value', [('kv_events_endpoint', 'tcp://127.0.0.1'),
                                         ('kv_events_endpoint', 'http://127.0.0.1:5557'),
                                         ('kv_events_endpoint', 'tcp://127.0.0.1:70000'),
                                         ('kv_events_replay_endpoint', 'tcp://:5558')])
def test_config_rejects_bad_endpoints(field, value):
    kwargs = {'enable_prefix_caching': True, 'kv_events_endpoint': 'tcp://127.0.0.1:5557', field: value}
    with pytest.raises(ValueError, match=field):
        PytorchEngineConfig(**kwargs)


def test_config_needs_prefix_caching_and_distinct_endpoints():
    with pytest.raises(ValueError, match='enable_prefix_caching'):
        PytorchEngineConfig(kv_events_endpoint='tcp://127.0.0.1:5557')
    with pytest.raises(ValueError, match='kv_events_endpoint'):
        PytorchEngineConfig(enable_prefix_caching=True, kv_events_replay_endpoint='tcp://127.0.0.1:5558')
    with pytest.raises(ValueError, match='kv_events_replay_endpoint'):
        PytorchEngineConfig(enable_prefix_caching=True, kv_events_endpoint='tcp://127.0.0.1:5557',
                            kv_events_replay_endpoint='tcp://127.0.0.1:5557')
    cfg = PytorchEngineConfig(enable_prefix_caching=True, kv_events_endpoint='tcp://*:5557',
                              kv_events_replay_endpoint='tcp://127.0.0.1:5558')
    assert cfg.kv_events_endpoint == 'tcp://*:5557'


@pytest.mark.parametrize('model', ['tiny_qwen3_next', 'tiny_qwen3'])
def test_engine_publishes_its_restorable_prefixes(model, request):
    """A tiny engine (Qwen3-Next with 48 blocks, 2 checkpoint slots and turn-end checkpoints;
    Qwen3 with 12 blocks) serves prompts sharing heads (Qwen3-Next: then one ended early by the
    caller): a live subscriber and a router catching up by replay from seq 0 (a restarted
    router) both end with exactly the engine's restorable set (the early end's turn-end
    checkpoint included, with no step after it); the stream carried withdrawals."""
    import zmq
    from engine_utils import make_engine, random_prompt
    hybrid = model == 'tiny_qwen3_next'

    from lmdeploy import GenerationConfig as Gen
    pub_ep, replay_ep = f'tcp://127.0.0.1:{_free_port()}', f'tcp://127.0.0.1:{_free_port()}'
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b'')
    engine = make_engine(request.getfixturevalue(model), enable_prefix_caching=True, block_size=16,
                         prefill_save_alignment=32, num_gpu_blocks=48 if hybrid else 12,
                         num_checkpoint_slots=2 if hybrid else None, decode_save_last=hybrid, kv_events_endpoint=pub_ep,
                         kv_events_replay_endpoint=replay_ep)
    try:
        sub.connect(pub_ep)
        heads = [random_prompt(40, seed) for seed in (1, 2)]
        prompts = [heads[i % 2] + random_prompt(30 + 9 * i, 10 + i) for i in range(5)]
        for p in prompts:
            engine.generate(p, Gen(max_new_tokens=2))
        local = engine.prefix_cache.local
        if hybrid:      # a turn-end checkpoint that finish_early publishes is announced with no step after it
            seq = engine.add_request(heads[0] + random_prompt(8, 99), Gen(max_new_tokens=40))
            while seq.num_computed_tokens < 66:
                engine.step()
            engine.finish_early(seq)
            assert local.trie.match(seq.token_ids)[3].checkpoint_slot is not None     # at 64
        expected = restorable(local)
        assert expected and local.num_evictions['checkpoint' if hybrid else 'kv'] > 0
        if hybrid:
            assert len(list(local.trie.iter_nodes())) > len(expected)    # raw blocks cached, not announced
        live = RouterView(16)
        for seq, payload in _stream(sub, ctx, replay_ep, 0, engine.kv_events.num_batches):
            live.apply(seq, payload)
        assert live.blocks == expected
        replayed = RouterView(16)
        frames = _replay(ctx, replay_ep, 0)
        assert frames[-1] == (-1, b'') and len(frames) == engine.kv_events.num_batches + 1
        for seq, payload in frames[:-1]:
            replayed.apply(seq, payload)
        assert replayed.blocks == expected
        removed = [ev for _, payload in frames[:-1] for ev in msgpack.unpackb(payload)[1]
                   if ev['type'] == 'BlockRemoved']
        assert removed
    finally:
        engine.close()
        sub.close(0)
        ctx.term()


# a real consumer: vllm-router's kv_aware policy -----------------------------------------------
class _FakeWorkers:
    """OpenAI-style HTTP workers on 127.0.0.1 that answer every request with a tiny completion and
    record the paths they were sent (the router only needs them healthy and answering)."""

    def __init__(self, count: int):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        body = json.dumps({'id': 'x', 'object': 'text_completion', 'model': 'tiny',
                           'data': [{'id': 'tiny', 'object': 'model'}],
                           'choices': [{'index': 0, 'text': '', 'finish_reason': 'stop'}]}).encode()
        self.hits: list[list[str]] = [[] for _ in range(count)]
        self.servers = []
        for i in range(count):
            class Handler(BaseHTTPRequestHandler):
                record = self.hits[i]

                def _answer(self):
                    size = int(self.headers.get('content-length') or 0)
                    self.rfile.read(size)
                    self.record.append(self.path)
                    self.send_response(200)
                    self.send_header('content-type', 'application/json')
                    self.send_header('content-length', str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                do_GET = do_POST = _answer

                def log_message(self, *args):
                    pass

            server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)
        self.urls = [f'http://127.0.0.1:{s.server_address[1]}' for s in self.servers]

    def close(self):
        for s in self.servers:
            s.shutdown()
            s.server_close()


def _router_binary() -> str | None:
    import shutil
    import sys
    from pathlib import Path
    local = Path(sys.executable).parent / 'vllm-router'
    return str(local) if local.exists() else shutil.which('vllm-router')


def announced_credit(local: LocalTier, tokens: list[int]) -> int:
    """Tokens a router following the stream credits ``tokens`` with: its leading full blocks
    that are announced (the restorable set), in tokens."""
    from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
    announced = restorable(local)
    n = 0
    for h in chain_block_hashes(tokens, B):
        if external_hash(h) not in announced:
            break
        n += 1
    return n * B


def _serve_alone(sched: Scheduler, cache: PrefixCache, prompt: list[int]) -> None:
    """Run one request to its first generated token (each copy "succeeds")."""
    seq = Sequence(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    sched.add(seq)
    while seq.num_computed_tokens < len(prompt):
        cache.saves_done(sched.computed(sched.schedule()), True)
    seq.token_ids.append(5)
    cache.saves_done(sched.finish(seq, 'length'), True)


def test_vllm_router_credits_only_restorable_prefixes(tmp_path):
    """vllm-router (``--policy kv_aware``) subscribed to the stream (and its replay) credits a
    hybrid engine's prompt with exactly its checkpointed prefix: 8 tokens of a 13-token prompt
    whose checkpoint is at 8 (its third cached block has no checkpoint below it), 0 for a prompt
    whose one cached block has none, and 0 again once that checkpoint is evicted. (Read from the
    router's debug log of each routing decision, ``credited_prefix_tokens``.)"""
    import re
    import subprocess
    import urllib.request

    router = _router_binary()
    if router is None:
        pytest.skip('vllm-router is not installed')
    bm = BlockManager(128)
    sc = StateCache(2, 32)
    local = LocalTier(bm, B, sc)
    tracker = KVEventTracker(B, True).attach(local)
    cache = PrefixCache(local, None, block_size=B, alignment=A)
    sched = Scheduler(SchedulerConfig(B, 2, P, A, False), bm, sc, cache)
    pub_ep, replay_ep = f'tcp://127.0.0.1:{_free_port()}', f'tcp://127.0.0.1:{_free_port()}'
    publisher = KVEventPublisher([tracker], pub_ep, replay_ep)
    workers = _FakeWorkers(2)
    port = _free_port()
    log_path = tmp_path / 'router.log'
    log = open(log_path, 'w')
    # its metrics exporter's default port (29000) may be taken by another router on this machine
    proc = subprocess.Popen([router, '--policy', 'kv_aware', '--host', '127.0.0.1', '--port', str(port),
                             '--prometheus-host', '127.0.0.1', '--prometheus-port', str(_free_port()),
                             '--worker-urls', *workers.urls,
                             '--kv-event-source', f'{workers.urls[0]}={pub_ep}',
                             '--kv-event-replay-source', f'{workers.urls[0]}={replay_ep}',
                             '--kv-event-block-size', str(B), '--kv-event-model', 'tiny', '--log-level', 'debug'],
                            stdout=log, stderr=subprocess.STDOUT)

    def text() -> str:
        return re.sub(r'\x1b\[[0-9;]*m', '', log_path.read_text())

    def wait_for(cond, what: str, timeout: float = 30.0, fail: bool = True) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            assert proc.poll() is None, f'vllm-router exited:\n{text()[-3000:]}'
            if time.monotonic() > deadline:
                assert not fail, f'{what}:\n{text()[-3000:]}'
                return False
            time.sleep(0.05)
        return True

    def router_has_applied_all():
        seqs = [int(s) for s in re.findall(r'sequence advanced.*?seq=(\d+)', text())]
        return bool(seqs) and max(seqs) >= publisher.num_batches - 1

    def credit(prompt: list[int]) -> int:
        before = len(re.findall(r'KV prefix decision', text()))
        req = urllib.request.Request(f'http://127.0.0.1:{port}/v1/completions', headers={
            'content-type': 'application/json'}, data=__import__('json').dumps(
                {'model': 'tiny', 'prompt': prompt, 'max_tokens': 1}).encode())
        urllib.request.urlopen(req, timeout=10).read()
        wait_for(lambda: len(re.findall(r'KV prefix decision', text())) > before, 'no routing decision logged')
        line = [ln for ln in text().splitlines() if 'KV prefix decision' in ln][before]
        return int(re.search(r'credited_prefix_tokens=(\d+)', line).group(1))

    try:
        wait_for(lambda: 'Router ready' in text() and 'kv_index subscriber for' in text(), 'router not ready')
        # PUB drops what it sends before a subscription arrives, and vllm-router takes the first
        # batch it sees as its start (it replays only gaps after it): serve unrelated prompts
        # until it has applied one, so it is subscribed before the batches this test is about
        for i in range(40):
            _serve_alone(sched, cache, list(range(500 + 16 * i, 509 + 16 * i)))
            publisher.flush()
            if wait_for(router_has_applied_all, '', timeout=0.5, fail=False):
                break
        p1, p2 = list(range(100, 113)), [7, 8, 9, 10, 11, 12, 13]
        for prompt in (p1, p2):
            _serve_alone(sched, cache, prompt)
        publisher.flush()
        m1, m2 = local.trie.match(p1), local.trie.match(p2)     # 3 + 1 blocks cached, one checkpoint at 8
        assert [n.checkpoint_slot is not None for n in m1 + m2] == [False, True, False, False]
        wait_for(router_has_applied_all, 'router did not apply every batch')
        q1, q2 = p1[:12] + [1, 2], p2[:4] + [3, 3, 3, 3, 3]
        assert (announced_credit(local, q1), announced_credit(local, q2)) == (8, 0)
        assert credit(q1) == 8
        assert workers.hits[0][-1] == '/v1/completions'      # routed to the engine holding the prefix
        assert credit(q2) == 0
        slot = m1[1].checkpoint_slot
        sc.release_checkpoint(slot, evicted=True)
        publisher.flush()
        wait_for(router_has_applied_all, 'router did not apply the withdrawal')
        assert announced_credit(local, q1) == 0 and credit(q1) == 0
        assert 'decode batch' not in text()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        workers.close()
        publisher.close()


def test_cli_flags_reach_the_config_and_a_bad_endpoint_exits_2(capsys):
    """``lmdeploy serve api_server --kv-events-endpoint ... --kv-events-replay-endpoint ...`` sets
    both fields; a malformed endpoint or a missing prefix cache exits 2 naming the field."""
    from lmdeploy.cli.entrypoint import build_parser, main
    from lmdeploy.cli.utils import model_from_args
    args = build_parser().parse_args(['serve', 'api_server', '/m', '--enable-prefix-caching', '--kv-events-endpoint',
                                      'tcp://*:5557', '--kv-events-replay-endpoint', 'tcp://127.0.0.1:5558'])
    cfg = model_from_args(args, PytorchEngineConfig)
    assert (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint) == ('tcp://*:5557', 'tcp://127.0.0.1:5558')
    for flags, shown in ((['--enable-prefix-caching', '--kv-events-endpoint', '127.0.0.1:5557'],
                          'kv_events_endpoint (--kv-events-endpoint)'),
                         (['--kv-events-endpoint', 'tcp://127.0.0.1:5557'], 'enable_prefix_caching')):
        with pytest.raises(SystemExit) as exc:
            main(['serve', 'api_server', '/nonexistent', *flags])
        assert exc.value.code == 2
        assert shown in capsys.readouterr().err


def test_host_tier_with_window_rows_announces_a_prefix_only_while_its_window_entries_are_held():
    """A mixed model's host tier (window rows, W = 6, B = 4): a demoted checkpoint at 16 tokens
    needs the global entries of blocks 0-3 and the window entries of blocks 2-3 only (its window);
    the prefix is announced once all are held, withdrawn when one window entry leaves, and a
    checkpoint whose device window row was already given back is not kept at all."""
    from lmdeploy.pytorch.prefix_cache.kv_events import BlockRemoved, BlockStored

    class Node:
        def __init__(self, parent, key, window_block):
            self.parent, self.key, self.block_id, self.window_block = parent, key, 0, window_block
            self.tokens = (1, 2, 3, 4)

    root = Node(None, b'r' * 16, -1)
    nodes, parent = [], root
    for i, w in enumerate([-1, -1, 12, 13]):       # only the window's blocks hold a window row
        parent = Node(parent, bytes([i]) * 16, w)
        nodes.append(parent)
    host = HostTier(None, 10**6, 4, 2, 1, window_block_bytes=1, window_rows=6)
    tracker = HostEventTracker(4).attach(host)
    host.demote(nodes[-1], 0)
    assert [h for k, h in host._entries if k == 'window'] == [nodes[2].key, nodes[3].key]
    [stored] = tracker.take()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 4
    del host._entries[('window', nodes[3].key)]
    tracker.dropped(('window', nodes[3].key))
    [removed] = tracker.take()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 4
    # a checkpoint whose window row the device gave back: nothing kept, nothing announced
    other = HostTier(None, 10**6, 4, 2, 1, window_block_bytes=1, window_rows=6)
    tracker = HostEventTracker(4).attach(other)
    nodes[3].window_block = -1
    other.demote(nodes[-1], 0)
    assert not other._entries and not tracker.take()
