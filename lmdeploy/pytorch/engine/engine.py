"""The engine: one model, its caches, the scheduler, and the step loop.

``Engine.step`` is the whole request path; every tensor copy and every Store operation is in
it, and nowhere in the scheduler::

    probe Store    existence queries for newly waiting requests        (prefix_cache.probe)
    schedule       chunks + restores to run                            (scheduler.schedule)
    execute loads  checkpoint → runtime slot copies; Store gets        (cache_engine, store.load)
    forward        one flat forward over every chunk, sample           (model_runner.forward)
    speculate      snapshot / accept / roll back drafts, draft via MTP   (spec_decode, when configured)
    execute saves  runtime slot → checkpoint copies, then publish      (scheduler.computed, cache_engine)
    submit puts    Store payloads copied out, put by the Store worker  (store.submit)
    hand off       (role prefill) a request that reached its hand-off point: put, finish  (store.submit_handoff)
    update         append tokens, stop conditions (stop strings on the decoded text), finish

Requests are checked and made into sequences before they reach the engine
(:class:`~lmdeploy.pytorch.engine.requests.RequestFactory`, :attr:`Engine.requests`); the engine
queues them (:meth:`Engine.add`) and steps.

:class:`Engine` is synchronous and single-threaded (tests drive it step by step);
:class:`~lmdeploy.pytorch.engine.engine_loop.EngineLoop` runs it on a background thread for
the pipeline and the HTTP server.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ...messages import GenerationConfig, PytorchEngineConfig
from ..cache_specs import SlidingWindowSpec, has_state, kv_bytes_per_block, kv_window, paged_groups, uses_store
from ..config import CacheConfig, SchedulerConfig
from ..kernels.cpu_native import native_library
from ..paging.block_manager import BlockManager
from ..paging.handoff import Handoff, handoff_point
from ..paging.sequence import SeqStatus, Sequence
from ..prefix_cache.coordinator import PrefixCache
from ..prefix_cache.eviction import make_policy
from ..prefix_cache.local_tier import LocalTier
from ..prefix_cache.null_cache import NullPrefixCache
from ..prefix_cache.plans import SavePlan
from ..prefix_cache.state_cache import StateCache
from ..spec_decode.strategy import DecodingStrategy, strategy_for
from .cache_sizing import size_caches
from .cuda_graph import decode_graphs_kind
from .executor import make_executor
from .host_allocator import tune_host_allocator
from .model_runner import ModelRunner
from .requests import RequestFactory
from .scheduler import Scheduler, SchedulerOutput

__all__ = ['Engine', 'StepOutput']

logger = logging.getLogger('lmdeploy')

@dataclass
class StepOutput:
    """What one step produced for one sequence."""
    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list | None = None    # one sampler.TokenLogprob per new token, when the request asked
    prompt_logprobs: list | None = None   # with the first token: one TokenLogprob per prompt token after the first


def _eos_ids(model_path: str, config) -> frozenset[int]:
    ids = set()
    for src in (config, _generation_config(model_path)):
        value = getattr(src, 'eos_token_id', None) if src is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


def _generation_config(model_path: str):
    """The model directory's ``generation_config.json`` (None when it has none).

    Raises:
        ValueError: the file is there but ``transformers`` cannot load it (not JSON, not an
            object); the message names the directory, the file and the reason.
    """
    if not os.path.isfile(os.path.join(model_path, 'generation_config.json')):
        return None
    from transformers import GenerationConfig as HFGenerationConfig
    try:
        return HFGenerationConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, TypeError, AttributeError) as err:
        # transformers answers a broken file with an OSError that would reach the command line
        # as a traceback
        raise ValueError(f'model_path {model_path!r}: generation_config.json cannot be loaded: {err}') from None


class Engine:
    """Serves one model from a local Hugging Face directory.

    Args:
        model_path: the model directory.
        config: engine configuration (defaults if None).
        strategy: the decoding strategy; its ℓ and r reach every sequence's prefill plan
            (default: the one of ``config.speculative_config``'s method, else autoregressive).

    Raises:
        ValueError: bad path, unsupported model type, ``device_type`` cuda without a CUDA device,
            or a cache too small for one block.
    """
    kv_events = None    # the KV event publisher (kv_events_endpoint), flushed once per step; None: off

    def __init__(self, model_path: str, config: PytorchEngineConfig | None = None,
                 strategy: DecodingStrategy | None = None):
        self.config = config = config or PytorchEngineConfig()
        spec_config = config.speculative_config
        self.strategy = strategy or strategy_for(spec_config)
        device = config.device_type
        if device == 'auto':
            device = 'cuda' if torch.cuda.is_available() else 'cpu'
        elif device == 'cuda' and not torch.cuda.is_available():
            raise ValueError(f'device_type is cuda, but this torch ({torch.__version__}) sees no CUDA device; use '
                             f'device_type=cpu or device_type=auto')
        self.device = torch.device(device)
        self.model_path = model_path
        use_mtp = spec_config is not None and spec_config.method == 'mtp'
        # one worker per rank (tp=1: rank 0's, in this process); the MTP head, when drafting
        # with it, is loaded by every worker (its part on each rank)
        self.executor = make_executor(model_path, config.dtype, self.device, config.tp, mtp=use_mtp)
        worker = self.executor.worker
        self.model, self.hf_config, self.dtype = worker.model, worker.hf_config, worker.dtype
        self.specs = worker.specs     # rank 0's heads (with the MTP layer's KV when drafting with it)
        self.mtp = worker.mtp
        if self.device.type == 'cpu':
            # after the weights are loaded, so that they keep their own mappings and the heap
            # only recycles the steps' activations
            tune_host_allocator()
            native_library()   # build the native decode kernels now, not in the first request
        self.is_hybrid = has_state(self.specs)
        text_config = self.hf_config.get_text_config()   # a vision-language config keeps these in text_config
        self.session_len = config.session_len or int(getattr(text_config, 'max_position_embeddings', 32768))
        # what set session_len, for the message that refuses a prompt too long for it
        session_len_source = 'session_len' if config.session_len else 'max_position_embeddings'
        self.vocab_size = int(text_config.vocab_size)
        self.eos_token_ids = _eos_ids(model_path, self.hf_config)
        self.cache_config = cc = CacheConfig.from_engine_config(config)
        # block tables per paged group: a mixed model's sliding layers get a table and a pool of
        # their own, giving back the blocks out of their window, unless drafts roll computed tokens
        # back; with prefixes cached, only where the local tier keeps their window rows
        free_windows = spec_config is None
        groups = paged_groups(self.specs, split=free_windows and self._window_rows_kept(cc))
        # a stateless mixed model keeping window rows with caching on: zero-byte checkpoints
        # (markers) keep them, as a hybrid's checkpoints do (prefix_cache/local_tier.py)
        markers = len(groups) > 1 and cc.enable_prefix_caching and not self.is_hybrid
        self.paged_groups = groups
        sizes = size_caches(self.specs, self.is_hybrid, cc, self.device, config.max_batch_size, self.session_len,
                            speculative=spec_config is not None, groups=groups,
                            chunk_tokens=config.max_prefill_token_num)
        window = groups[0].window if groups and free_windows else None
        if sizes.capped and window and sizes.num_blocks >= -(-(window - 1 + config.max_prefill_token_num)
                                                               // cc.block_size) + 1:
            # every paged layer slides: a sequence holds at most its window and one chunk's blocks
            # (Scheduler._free_out_of_window), so its length is not bounded by the cache
            logger.info('session_len %d exceeds the KV cache (%d blocks x %d tokens); kept: a sequence holds only '
                        'the blocks of its %d-token sliding window', self.session_len, sizes.num_blocks,
                        cc.block_size, window)
        elif sizes.capped:
            # a sequence longer than the whole cache could never be (re)admitted and would spin
            # forever in the waiting queue; cap it so such prompts are rejected and outputs end
            # with finish_reason 'length' instead
            logger.warning('session_len %d exceeds the KV cache (%d blocks x %d tokens); using %d',
                           self.session_len, sizes.num_blocks, cc.block_size, sizes.session_len)
            self.session_len = sizes.session_len
            session_len_source = f'kv_cache:{sizes.num_blocks}'
        num_blocks, num_runtime, block_rows = sizes.num_blocks, sizes.num_runtime, sizes.checkpoints_in_block_rows
        # admission: every request is checked (once) and made into a sequence there
        self.requests = RequestFactory(model_path, self.model, self.hf_config.model_type, self.vocab_size,
                                       self.session_len, session_len_source, cc.block_size, self.eos_token_ids,
                                       self.strategy, has_mtp=self.mtp is not None)
        window_entries = groups[1].entries if len(groups) > 1 else ()
        graphs = decode_graphs_kind(self.device, config)
        # a CUDA graph's padding rows write one KV block and one state slot beyond those the
        # block manager and the state cache hand out (engine/cuda_graph.py)
        scratch = int(graphs == 'cuda')
        num_slots = sizes.num_slots + scratch if sizes.num_slots and self.is_hybrid else sizes.num_slots
        self.cache_engine = self.executor.start(cc.block_size, num_blocks + scratch, num_slots, window_entries,
                                                sizes.num_window_blocks)
        # a block table row is at most the session's blocks wide
        max_blocks = -(-self.session_len // cc.block_size)
        if graphs == 'cpu':     # pure decode steps replay recorded forwards (engine/decode_graph.py)
            worker.enable_decode_graphs(max_blocks)
        elif graphs == 'cuda':  # pure decode steps replay a CUDA graph per batch bucket
            worker.enable_cuda_graphs(max_blocks, config.max_batch_size, num_slots - 1 if self.is_hybrid else None,
                                      num_blocks)
        self.model_runner = ModelRunner(self.executor, self.cache_engine)
        self.block_manager = BlockManager(num_blocks)
        # the sliding-window group's own pool (a mixed model), or None
        self.window_pool = BlockManager(sizes.num_window_blocks) if window_entries else None
        # bytes of one window-pool block (every head's, as kv_block_bytes counts): the ledger's cached bytes
        self._window_row_bytes = kv_bytes_per_block([self.cache_engine.object_specs[i] for i in window_entries],
                                                    cc.block_size)
        policy = make_policy(cc.cache_eviction)
        if block_rows:
            self.state_cache = StateCache(num_runtime, cc.num_checkpoint_slots, block_manager=self.block_manager,
                                          rows_per_checkpoint=self.cache_engine.rows_per_state, policy=policy)
        elif markers:       # marker slots: ids without rows (no runtime slot, nothing copied)
            self.state_cache = StateCache(0, cc.fixed_checkpoint_slots, policy=policy)
        else:
            self.state_cache = (StateCache(num_runtime, sizes.num_checkpoint_slots, policy=policy) if self.is_hybrid
                                else None)
        for name in ('prefill_save_last_only', 'decode_save_last', 'save_junction'):
            if getattr(config, name) and not cc.enable_prefix_caching:
                logger.warning('%s has no effect without enable_prefix_caching (--enable-prefix-caching)', name)
        if config.prefill_save_last_only and not self.is_hybrid and not markers:
            logger.info('prefill_save_last_only is ignored: %s has no recurrent state to checkpoint',
                        self.hf_config.model_type)
        self.store = self._build_store()
        if config.role != 'both' and (self.store is None or not self.is_hybrid):
            if self.store is not None:
                self.store.close()
            self.executor.close()
            why = ('no Store is configured (store_backend="file:DIR" or mooncake_master="HOST:PORT")'
                   if self.is_hybrid else
                   f'{self.hf_config.model_type} does not hand off (a model with recurrent state is required)')
            raise ValueError(f'role={config.role!r} hands prompts off through the Store tier, but {why}')
        self._handed_off: list[Sequence] = []     # prefill role: prompts with nothing to compute (h = 0)
        # with caching off a NullPrefixCache answers every question: no caller branches on it
        self.prefix_cache: PrefixCache | NullPrefixCache = NullPrefixCache()
        if cc.enable_prefix_caching:
            local = LocalTier(self.block_manager, cc.block_size, self.state_cache,
                              state_bytes=self.cache_engine.state_bytes, block_bytes=self.cache_engine.kv_block_bytes,
                              window_pool=self.window_pool, window=groups[1].window if window_entries else None,
                              markers=markers)
            host = None
            if config.host_cache_bytes and (self.is_hybrid or markers):     # (markers: an empty state entry)
                from ..prefix_cache.host_tier import HostTier
                host = HostTier(self.cache_engine, config.host_cache_bytes, cc.block_size, self.cache_engine.state_bytes,
                                self.cache_engine.kv_block_bytes,
                                getattr(self.cache_engine, 'window_block_bytes', 0) if window_entries else 0,
                                groups[1].window if window_entries else None, has_state=self.is_hybrid)
            turn_end = cc.decode_save_last
            if turn_end and not self.model.decode_state_equals_prefill:
                logger.warning('decode_save_last is ignored: %s computes generated tokens differently from prompt '
                               'tokens, so a turn-end checkpoint would not equal a recomputed prefix',
                               self.hf_config.model_type)
                turn_end = False
            self.prefix_cache = PrefixCache(local, self.store, block_size=cc.block_size,
                                            alignment=cc.prefill_save_alignment, decode_save_last=turn_end,
                                            host=host, window=kv_window(self.specs))
            if config.kv_events_endpoint:
                from .kv_event_publisher import start_publisher
                self.kv_events = start_publisher(config, local, host)
        # (the scheduler takes runtime slots from a state cache: markers have none)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config), self.block_manager,
                                   self.state_cache if self.is_hybrid else None,
                                   self.prefix_cache, window=window, window_pool=self.window_pool,
                                   pool_window=groups[1].window if window_entries else None)
        self.spec = None
        if spec_config is not None:
            from ..spec_decode.decoder import SpecDecoder
            turn_end = self.prefix_cache.decode_save_last
            self.spec = SpecDecoder(spec_config, self.model_runner, sizes.scratch_base, self._finish_reason, self.mtp,
                                    self.session_len, block_align=cc.block_size if turn_end else None)

    def _window_rows_kept(self, cc: CacheConfig) -> bool:
        """Whether a mixed model's window layers may keep a pool of their own: always with prefix
        caching off; with it on, when the local tier can keep their window rows (for a model with
        recurrent state, the windows of its checkpoints; without state, of its markers, zero-byte
        checkpoints). A host tier or Store keeps them too (global rows in KV entries, window rows
        in window entries of each boundary's window, and a state entry, empty without state),
        except under tensor parallelism or a prefill/decode role (full-head payloads and hand-off
        objects hold one row of every paged layer): then one shared table keeps every block, said
        once in the log."""
        if not cc.enable_prefix_caching:
            return True
        sliding = [s for s in self.specs if isinstance(s, SlidingWindowSpec)]
        if not sliding or len(sliding) == len([s for s in self.specs if s.paged]):
            return True         # nothing to split (no window layer, or every paged layer slides)
        from ..store.open_backend import store_scheme
        if ((store_scheme(self.config) is not None or self.config.host_cache_bytes)
                and (self.config.tp > 1 or self.config.role != 'both')):
            logger.info('%s with prefix caching: its sliding-window layers keep every block (one shared table), '
                        'since a Store or host tier is configured with tp > 1 or a prefill/decode role (its payloads '
                        'there hold every layer\'s rows per block)', self.hf_config.model_type)
            return False
        return True

    def _build_store(self):
        from ..store.open_backend import open_store, store_scheme
        scheme = store_scheme(self.config)
        if scheme is None:
            return None
        if not self.config.enable_prefix_caching:
            logger.warning('the Store tier is not used: %s needs enable_prefix_caching (--enable-prefix-caching)',
                           f'store_backend={self.config.store_backend!r}' if scheme == 'file'
                           else f'mooncake_master={self.config.mooncake_master!r}')
            return None
        if not uses_store(self.specs):
            logger.info('the Mooncake Store tier is not used: %s has no recurrent-state checkpoints and no '
                        'sliding-window layers (its prefixes are reused locally)', self.hf_config.model_type)
            return None
        from ..prefix_cache.store_tier import build_store_tier
        # (the largest object: a KV block of the global layers, or a window object)
        opened = open_store(self.config, self.cache_engine.state_bytes,
                            max(self.cache_engine.kv_block_bytes, getattr(self.cache_engine, 'window_block_bytes', 0)))
        return build_store_tier(self, opened)

    # requests ---------------------------------------------------------------------------
    @staticmethod
    def release(seq: Sequence) -> None:
        """Free what a sequence holds outside the caches (its grammar matcher); idempotent."""
        if seq.guide is not None:
            seq.guide.close()

    def add(self, seq: Sequence) -> None:
        """Queue a sequence made by :attr:`requests`; it runs on the following steps. On an
        engine with ``role`` prefill or decode the sequence gets its
        :class:`~lmdeploy.pytorch.paging.handoff.Handoff`; a prefill engine's prompt with
        nothing before its hand-off point (h = 0) ends with ``'handoff'`` at the next step."""
        role = self.config.role
        if role != 'both':
            seq.handoff = Handoff(role, handoff_point(seq.num_prompt_tokens, seq.token_lookahead,
                                                      seq.multimodal_spans))
            if role == 'prefill' and seq.handoff.point == 0:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, 'handoff'
                seq.handoff.resolve(True)     # nothing to put: the decode engine computes the prompt
                self._handed_off.append(seq)
                return
        self.scheduler.add(seq)

    def add_request(self, token_ids: list[int], gen_config: GenerationConfig | None = None,
                    **kwargs) -> Sequence:
        """Check a request (:meth:`RequestFactory.check <.requests.RequestFactory.check>`, keyword
        arguments as there) and queue its sequence; it runs on the following steps.

        Raises:
            RequestError: a bad field (a ValueError naming it).
        """
        seq = self.requests.sequence(self.requests.check(token_ids, gen_config, **kwargs))
        self.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` now and free its resources."""
        if not seq.is_finished:
            self.scheduler.abort(seq)
            seq.finish_reason = 'abort'
        self.release(seq)
        self._flush_kv_events()      # blocks it cached, announced now even if no step follows

    def finish_early(self, seq: Sequence, reason: str = 'stop') -> None:
        """End ``seq`` now as a *completed* request (the caller found a stop string in its text,
        or it ended a reply after its first tool call): unlike :meth:`abort`, the turn's end
        is booked as when the engine itself stops it — its turn-end checkpoint is published and
        put to the Store, so the next turn and other instances reuse it. Tokens
        generated past the caller's cut stay in the cache under their own hashes (a next turn
        without them simply matches less). A sequence that has not generated yet is aborted.
        """
        if seq.is_finished:
            return
        if seq.num_generated == 0 or seq not in self.scheduler.running:
            self.abort(seq)
            return
        self._execute_saves(self.scheduler.finish(seq, reason))
        self.release(seq)
        self._flush_kv_events()      # its turn-end checkpoint, announced now even if no step follows

    @property
    def has_work(self) -> bool:
        """Some sequence is waiting or running in the scheduler, or a hand-off with nothing to
        compute waits for the next step to report it."""
        return self.scheduler.has_work or bool(self._handed_off)

    # the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one forward over the scheduled chunks; returns per-sequence progress."""
        handed, self._handed_off = [StepOutput(s, [], 'handoff') for s in self._handed_off], []
        self.prefix_cache.probe(self.scheduler.waiting)
        sched = self.scheduler.schedule()
        self._execute_loads(sched)
        if not sched.chunks:
            self._flush_kv_events()
            return handed
        if self.spec is not None:
            self.spec.before_forward(sched)
        next_tokens = self.model_runner.forward(sched)
        if self.spec is not None:
            self.spec.after_forward(sched, next_tokens)
        saves = self.scheduler.computed(sched)
        self._execute_saves(saves)
        handed += self._hand_off(sched)
        outputs = self._update(sched, next_tokens)
        if self.spec is not None:
            self.spec.propose(sched, next_tokens)
        self._flush_kv_events()
        return handed + outputs

    def _hand_off(self, sched: SchedulerOutput) -> list[StepOutput]:
        """(role prefill) Each sequence whose forward ended at its hand-off point: submit its
        hand-off put (payloads copied out now, before its blocks are released) and finish it with
        ``'handoff'`` (no token sampled); ``seq.handoff.wait()`` tells when the Store holds it."""
        out = []
        for chunk in sched.chunks:
            seq, handoff = chunk.seq, chunk.seq.handoff
            if handoff is None or handoff.role != 'prefill' or chunk.end != handoff.point or seq.is_finished:
                continue
            put = self.prefix_cache.plan_handoff(seq)
            handoff.key = self.store.handoff_key(put.handoff_hash)
            self.store.submit_handoff(put)
            self._execute_saves(self.scheduler.finish(seq, 'handoff'))
            self.release(seq)
            out.append(StepOutput(seq, [], 'handoff'))
        return out

    def _flush_kv_events(self) -> None:
        """Send this step's prefix-cache events as one batch (kv_events_endpoint)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def _execute_loads(self, sched: SchedulerOutput) -> None:
        """Run the restores of admitted sequences before the forward: checkpoint → runtime slot
        copies, then Store loads (each verified; a failed one is rolled back by the scheduler,
        a good one is also kept as a local checkpoint)."""
        loads = sched.loads
        if not loads:
            return
        cache = self.prefix_cache
        self._copy_states([r.src for r in loads.restores], [r.dst for r in loads.restores],
                          lambda ok: cache.loads_done(loads, ok))
        kept = []       # (runtime slot, node, lease of the checkpoint slot to keep the restore in)
        # promotions from host memory first, then Store loads: (plans, tier that reads, booking)
        tiers = [(loads.host_loads, cache.host, cache.host_loaded) if loads.host_loads else None,
                 (loads.store_loads, self.store, cache.store_loaded) if loads.store_loads else None]
        try:
            for plans, tier, booked in filter(None, tiers):
                for load in plans:
                    ok = tier.load(load)
                    keep = booked(load, ok)
                    if not ok:
                        self.scheduler.rollback(load.seq, sched)
                    elif keep is not None:
                        kept.append((load.slot, *keep))
        except BaseException:
            for _, node, lease in kept:      # a load raised: the kept copies never run
                cache.restored_kept(node, lease, False)
            raise
        self._copy_states([k[0] for k in kept], [k[2].slot for k in kept],
                          lambda ok: [cache.restored_kept(node, lease, ok) for _, node, lease in kept])

    def _execute_saves(self, saves: SavePlan) -> None:
        """Run the saves planned after the forward: runtime → checkpoint slot copies (published
        only once copied), then the Store puts (payloads copied out now, put in the background)."""
        copies = saves.checkpoints + saves.snapshots
        if copies:
            self._copy_states([c.src for c in copies], [c.dst for c in copies],
                              lambda ok: self.prefix_cache.saves_done(saves, ok))
        for put in saves.store_puts:
            self.store.submit(put)

    def _copy_states(self, src: list[int], dst: list[int], done) -> None:
        """Run a batch of state-slot copies, then ``done(copied)``: pins are released and
        checkpoints published (or, if the copy raised, released unpublished) either way."""
        if not src:
            done(True)
            return
        sc = self.scheduler.state_cache
        if sc is not None:       # a checkpoint in block rows is copied by its rows
            src, dst = [sc.locate(s) for s in src], [sc.locate(d) for d in dst]
        copied = False
        try:
            self.cache_engine.copy_states(src, dst)
            copied = True
        finally:
            done(copied)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` stops after ``token`` (already appended), or None. A stop string is
        checked on the decoded output in this same step (so no forward runs past it, and it
        wins over ``max_new_tokens`` on the same token); ``seq.num_kept_tokens`` then marks
        the tokens wholly before it."""
        cfg = seq.gen_config
        if seq.guide is not None and seq.guide.done:      # the grammar is complete (or was left)
            return 'stop'
        if token in cfg.stop_token_ids or (not cfg.ignore_eos and token in seq.eos_token_ids):
            return 'stop'
        if seq.stop_strings is not None and seq.stop_strings.feed(token):
            seq.num_kept_tokens = seq.num_prompt_tokens + seq.stop_strings.kept_tokens
            return 'stop'
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= cfg.max_new_tokens or num_tokens >= self.session_len:
            return 'length'
        return None

    def _update(self, sched, next_tokens: dict[int, list[int]]) -> list[StepOutput]:
        outputs, logprobs = [], self.model_runner.last_logprobs
        for chunk in sched.chunks:
            seq = chunk.seq
            tokens = next_tokens.get(seq.seq_id)
            if tokens is None:
                continue
            out = StepOutput(seq, list(tokens))
            if chunk.drafts:     # verified drafts: appended and checked by the speculative decoder
                out.finish_reason = self.spec.finished.get(seq.seq_id)
            else:
                (token,) = tokens
                seq.token_ids.append(token)
                if seq.guide is not None:
                    seq.guide.accept(token)
                if logprobs and seq.seq_id in logprobs:
                    out.logprobs = [logprobs[seq.seq_id]]
                out.finish_reason = self._finish_reason(seq, token)
            if seq.gen_config.prompt_logprobs is not None and seq.num_generated == len(out.new_token_ids):
                out.prompt_logprobs = list(seq.prompt_logprobs)      # the request's first output
            if out.finish_reason:
                self._execute_saves(self.scheduler.finish(seq, out.finish_reason))
                self.release(seq)
            outputs.append(out)
        return outputs

    def generate(self, token_ids: list[int], gen_config: GenerationConfig | None = None, **kwargs) -> Sequence:
        """Run one request to completion (blocking); returns the finished sequence."""
        seq = self.add_request(token_ids, gen_config, **kwargs)
        if seq.gen_config.max_new_tokens == 0:
            self.abort(seq)
            seq.finish_reason = 'length'
            return seq
        while not seq.is_finished:
            self.step()
        return seq

    # introspection ------------------------------------------------------------------------
    def ledger(self) -> dict[str, int]:
        """Resource counters; the ``*_in_use``, pinned, in-flight, running and waiting ones return
        to 0 (and free ones to their totals) when no request is in flight."""
        bm = self.block_manager
        cached = self.prefix_cache.num_cached_blocks
        sc, wp = self.state_cache, self.window_pool
        ckpt_rows = sc.num_checkpoint_rows if sc else 0
        return {
            'blocks_total': bm.num_blocks,
            'blocks_free': bm.num_free,
            'blocks_cached': cached,
            'blocks_in_use': bm.num_blocks - bm.num_free - cached - ckpt_rows,
            'checkpoint_rows': ckpt_rows,
            # the sliding-window group's own pool (0, 0 and 0 without one), and its blocks the
            # prefix cache holds (window rows a restore reads)
            'window_blocks_total': wp.num_blocks if wp else 0,
            'window_blocks_free': wp.num_free if wp else 0,
            'window_blocks_cached': self.prefix_cache.num_window_blocks,
            # bytes the prefix cache holds per tier (payload bytes: cached KV blocks and checkpoints)
            'device_cache_bytes': cached * self.cache_engine.kv_block_bytes
            + self.prefix_cache.num_window_blocks * self._window_row_bytes
            + (sc.num_published * self.cache_engine.state_bytes if sc else 0),
            'host_cache_bytes': getattr(getattr(self.prefix_cache, 'host', None), 'bytes_held', 0),
            'runtime_slots_free': sc.num_free_runtime if sc else 0,
            'runtime_slots_total': sc.num_runtime_slots if sc else 0,
            'checkpoints_pinned': sc.num_pinned if sc else 0,
            'checkpoints_published': sc.num_published if sc else 0,
            'store_inflight': self.store.num_inflight if self.store is not None else 0,
            'store_queue_depth': self.store.queue_depth if self.store is not None else 0,
            'requests_running': len(self.scheduler.running),
            'requests_waiting': len(self.scheduler.waiting),
            'grammar_matchers': self.requests.num_grammar_matchers,
        }

    def stats(self) -> dict:
        """Cumulative counters: prefix-cache queried/hit tokens, checkpoints saved and skipped by
        reason, turn-end and junction checkpoints saved (``turn_end_checkpoints_saved``,
        ``junction_checkpoints_saved``), tokens whose blocks matched without a state checkpoint,
        the Store tier's put bytes/objects by kind, failures, rejected objects, hit tokens and
        objects a save found already stored (``store_existing_objects``), and (speculative
        decoding) draft tokens proposed / accepted. Every key but the speculative-decoding ones
        is present whatever is enabled (0 for a disabled tier), so one reader fits every config."""
        from ..prefix_cache.host_tier import zero_host_counters
        from ..prefix_cache.store_tier import zero_store_counters     # (the Store tier is imported lazily)
        out = {**zero_store_counters(), **zero_host_counters(), **self.prefix_cache.stats()}
        if self.spec is not None:
            out.update(self.spec.stats())
        return out

    def is_idle(self) -> bool:
        """No sequence holds a block, a runtime slot, a pin or an in-flight Store operation."""
        led = self.ledger()
        return (led['blocks_in_use'] == 0 and led['runtime_slots_free'] == led['runtime_slots_total']
                and led['window_blocks_free'] + led['window_blocks_cached'] == led['window_blocks_total']
                and led['checkpoints_pinned'] == 0 and led['store_inflight'] == 0 and not self.has_work
                and led['grammar_matchers'] == 0)

    def close(self) -> None:
        """Stop the Store worker (flushing queued saves), then the tensor-parallel workers (and
        the KV event publisher)."""
        try:
            if self.store is not None:
                self.store.close()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()
                self.kv_events = None
            self.executor.close()
