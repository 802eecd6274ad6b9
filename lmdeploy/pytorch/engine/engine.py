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
    update         append tokens, stop conditions (stop strings on the decoded text), finish

:class:`Engine` is synchronous and single-threaded (tests drive it step by step);
:class:`~lmdeploy.pytorch.engine.engine_loop.EngineLoop` runs it on a background thread for
the pipeline and the HTTP server.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import torch

from ...messages import GenerationConfig, PytorchEngineConfig
from ..cache_engine import CacheEngine, rows_per_state
from ..cache_specs import has_state
from ..config import DEFAULT_CHECKPOINT_SLOTS, CacheConfig, SchedulerConfig
from ..kernels.cpu_native import native_library
from ..paging.block_manager import BlockManager
from ..paging.sequence import Sequence
from ..prefix_cache.coordinator import PrefixCache
from ..prefix_cache.eviction import make_policy
from ..prefix_cache.local_tier import LocalTier
from ..prefix_cache.null_cache import NullPrefixCache
from ..prefix_cache.plans import SavePlan
from ..prefix_cache.state_cache import StateCache
from ..spec_decode.strategy import DecodingStrategy, strategy_for
from .cache_sizing import check_cache_fits, derive_num_blocks
from .executor import make_executor
from .host_allocator import tune_host_allocator
from .model_runner import ModelRunner
from .scheduler import Scheduler, SchedulerOutput
from .stop_strings import Detokenizer

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
    if not os.path.isfile(os.path.join(model_path, 'generation_config.json')):
        return None
    from transformers import GenerationConfig as HFGenerationConfig
    return HFGenerationConfig.from_pretrained(model_path, local_files_only=True)


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

    def __init__(self, model_path: str, config: PytorchEngineConfig | None = None,
                 strategy: DecodingStrategy | None = None):
        self.config = config = config or PytorchEngineConfig()
        spec_config = config.speculative_config
        self.strategy = strategy or strategy_for(spec_config)
        device = config.device_type
        if device == 'auto':
            device = 'cuda' if torch.cuda.is_available() else 'cpu'
        elif device == 'cuda' and not torch.cuda.is_available():
            raise ValueError(f'device_type (--device-type) is cuda, but this torch ({torch.__version__}) sees no '
                             f'CUDA device; use cpu or auto')
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
        self._session_len_source = 'session_len' if config.session_len else 'max_position_embeddings'
        self.vocab_size = int(text_config.vocab_size)
        self.eos_token_ids = _eos_ids(model_path, self.hf_config)
        self._grammar = None      # constrained decoding, built with the first guided request
        self.tokenizer = None       # decodes outputs for stop strings (the pipeline sets its own; else loaded)
        self._tokenizer_lock = threading.Lock()
        self.cache_config = cc = CacheConfig.from_engine_config(config)
        num_runtime = cc.num_state_slots or config.max_batch_size
        keeps_checkpoints = self.is_hybrid and cc.enable_prefix_caching
        # one memory budget: checkpoints take KV block rows (unless num_gpu_blocks fixes the pool)
        block_rows = keeps_checkpoints and cc.checkpoints_in_block_rows
        num_ckpt = cc.fixed_checkpoint_slots if (keeps_checkpoints and not block_rows) else 0
        num_slots = num_runtime + num_ckpt if self.is_hybrid else 0
        # speculative decoding on a hybrid model: one scratch slot per runtime slot (rollback)
        scratch_base = num_slots if (self.is_hybrid and spec_config is not None) else None
        if scratch_base is not None:
            num_slots += num_runtime
        rows = rows_per_state(CacheEngine.bytes_per_slot(self.specs), CacheEngine.bytes_per_block(self.specs,
                                                                                               cc.block_size))
        extra = (cc.num_checkpoint_slots if cc.num_checkpoint_slots is not None else
                 DEFAULT_CHECKPOINT_SLOTS) * rows if block_rows else 0
        num_blocks = cc.num_gpu_blocks or derive_num_blocks(self.specs, cc, num_slots, self.device,
                                                            config.max_batch_size, self.session_len, extra)
        capacity = num_blocks * cc.block_size
        if self.session_len > capacity:
            # a sequence longer than the whole cache could never be (re)admitted and would spin
            # forever in the waiting queue; cap it so such prompts are rejected and outputs end
            # with finish_reason 'length' instead
            logger.warning('session_len %d exceeds the KV cache (%d blocks x %d tokens); using %d',
                           self.session_len, num_blocks, cc.block_size, capacity)
            self.session_len = capacity
            self._session_len_source = f'kv_cache:{num_blocks}'
        check_cache_fits(self.specs, cc, num_blocks, num_slots, self.device)
        self.cache_engine = self.executor.start(cc.block_size, num_blocks, num_slots)
        self.model_runner = ModelRunner(self.executor, self.cache_engine)
        self.block_manager = BlockManager(num_blocks)
        policy = make_policy(cc.cache_eviction)
        if block_rows:
            self.state_cache = StateCache(num_runtime, cc.num_checkpoint_slots, block_manager=self.block_manager,
                                          rows_per_checkpoint=self.cache_engine.rows_per_state, policy=policy)
        else:
            self.state_cache = StateCache(num_runtime, num_ckpt, policy=policy) if self.is_hybrid else None
        for name in ('prefill_save_last_only', 'decode_save_last', 'save_junction'):
            if getattr(config, name) and not cc.enable_prefix_caching:
                logger.warning('%s has no effect without enable_prefix_caching (--enable-prefix-caching)', name)
        if config.prefill_save_last_only and not self.is_hybrid:
            logger.info('prefill_save_last_only is ignored: %s has no recurrent state to checkpoint',
                        self.hf_config.model_type)
        self.store = self._build_store()
        # with caching off a NullPrefixCache answers every question: no caller branches on it
        self.prefix_cache: PrefixCache | NullPrefixCache = NullPrefixCache()
        if cc.enable_prefix_caching:
            local = LocalTier(self.block_manager, cc.block_size, self.state_cache,
                              state_bytes=self.cache_engine.state_bytes, block_bytes=self.cache_engine.kv_block_bytes)
            host = None
            if config.host_cache_bytes and self.is_hybrid:
                from ..prefix_cache.host_tier import HostTier
                host = HostTier(self.cache_engine, config.host_cache_bytes, cc.block_size, self.cache_engine.state_bytes,
                                self.cache_engine.kv_block_bytes)
            self.prefix_cache = PrefixCache(local, self.store, block_size=cc.block_size,
                                            alignment=cc.prefill_save_alignment, decode_save_last=cc.decode_save_last,
                                            host=host)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config), self.block_manager, self.state_cache,
                                   self.prefix_cache)
        self.spec = None
        if spec_config is not None:
            from ..spec_decode.decoder import SpecDecoder
            turn_end = self.prefix_cache.decode_save_last
            self.spec = SpecDecoder(spec_config, self.model_runner, scratch_base, self._finish_reason, self.mtp,
                                    self.session_len, block_align=cc.block_size if turn_end else None)

    def _build_store(self):
        uses_file = (self.config.store_backend or '').startswith('file:')
        if not self.config.mooncake_master and not uses_file:
            return None
        if not self.config.enable_prefix_caching:
            logger.warning('the Store tier is not used: %s needs enable_prefix_caching (--enable-prefix-caching)',
                           f'store_backend={self.config.store_backend!r}' if uses_file
                           else f'mooncake_master={self.config.mooncake_master!r}')
            return None
        if not self.is_hybrid:
            logger.info('the Mooncake Store tier is not used: %s has no recurrent-state checkpoints to save',
                        self.hf_config.model_type)
            return None
        from ..prefix_cache.store_tier import build_store_tier
        return build_store_tier(self)

    def prompt_too_long(self, num_tokens: int) -> str:
        """The message refusing a prompt of ``num_tokens`` (``>= session_len``) tokens: both
        numbers, what set ``session_len`` and the flag that raises it (``--session-len``; its
        default is the model's ``max_position_embeddings``, e.g. 32768 for the tiny models, less
        than an agent CLI's first prompt; or the KV cache, when it holds fewer tokens)."""
        text = (f'the prompt has {num_tokens} tokens, which does not fit session_len={self.session_len} '
                f'(at most {self.session_len - 1} prompt tokens); ')
        source = self._session_len_source
        if source == 'max_position_embeddings':
            return text + ('session_len defaults to max_position_embeddings of the model\'s config.json; start the '
                           'server with a larger --session-len (session_len), e.g. --session-len '
                           f'{_next_power_of_two(num_tokens)}')
        if source == 'session_len':
            return text + ('start the server with a larger --session-len (session_len), e.g. --session-len '
                           f'{_next_power_of_two(num_tokens)}')
        blocks = int(source.split(':')[1])
        return text + (f'the KV cache holds only {blocks} blocks x {self.config.block_size} tokens: give it more '
                       'with --num-gpu-blocks (num_gpu_blocks) or --cache-max-entry-count (cache_max_entry_count)')

    # requests ---------------------------------------------------------------------------
    def validate(self, token_ids: list[int], gen_config: GenerationConfig) -> None:
        """Reject a request the engine cannot serve.

        Raises:
            ValueError: empty prompt, a prompt of ``session_len`` tokens or more (the message
                gives both numbers), or a token id (of the prompt, ``stop_token_ids`` or
                ``logit_bias``) outside ``[0, vocab_size)``.
        """
        if not token_ids:
            raise ValueError('the prompt is empty: at least 1 token is required')
        if len(token_ids) >= self.session_len:
            raise ValueError(self.prompt_too_long(len(token_ids)))
        bad = [t for t in token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f'token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})')
        bad = [t for t in gen_config.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f'stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})')
        bad = [t for t in gen_config.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f'logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})')
        if gen_config.structured_output is not None:
            try:
                spec = gen_config.structured_output
                if spec.prefix:
                    self.grammar().guide(spec).close()     # also checks the prefix
                else:
                    self.grammar().compile(spec)
            except ValueError as err:
                raise ValueError(f'structured_output.{err}') from None

    def grammar(self):
        """The :class:`~.guided.GrammarBackend` of this model's tokenizer (built on first use)."""
        if self._grammar is None:
            from transformers import AutoTokenizer
            from .guided import GrammarBackend
            tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            self._grammar = GrammarBackend(tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar

    def make_sequence(self, token_ids: list[int], gen_config: GenerationConfig | None = None,
                      multimodal_spans: tuple[tuple[int, int], ...] = (), token_lookahead: int | None = None,
                      recompute_blocks: int | None = None, multimodal: tuple = (),
                      shared_head_tokens: int | None = None) -> Sequence:
        """A validated :class:`Sequence` for a request (not yet queued).

        ``token_lookahead`` / ``recompute_blocks`` default to the engine's decoding strategy.
        ``multimodal``: the prompt's images (:class:`~lmdeploy.pytorch.multimodal.MultimodalInput`).
        ``shared_head_tokens``: tokens of the prompt's shared head (a chat request's system prompt
        and tools, see :attr:`Sequence.shared_head_tokens`), or None; a hybrid model ends a
        prefill forward and, with prefix caching, saves a checkpoint at its last reusable boundary.

        Raises:
            ValueError: see :meth:`validate`; ``shared_head_tokens`` not None nor an int >= 0.
        """
        gen_config = gen_config or GenerationConfig()
        self.validate(token_ids, gen_config)
        lookahead = self.strategy.token_lookahead if token_lookahead is None else token_lookahead
        recompute = self.strategy.recompute_blocks if recompute_blocks is None else recompute_blocks
        if any(m.data is not None for m in multimodal) and not self.model.supports_images:
            # spans and content hashes alone only steer planning and cache keys; pixels need an encoder
            raise ValueError(f'model_type {self.hf_config.model_type!r} does not accept images in this engine')
        if any(m.end > len(token_ids) for m in multimodal):
            raise ValueError(f'a multimodal span ends past the prompt of {len(token_ids)} tokens')
        if any(m.data is not None for m in multimodal):
            if self.mtp is not None:
                raise ValueError('images are not supported with MTP speculative decoding '
                                 '(speculative_config.method=mtp)')
            self.model.check_multimodal(token_ids, multimodal)
        if shared_head_tokens is not None and (isinstance(shared_head_tokens, bool)
                                               or not isinstance(shared_head_tokens, int) or shared_head_tokens < 0):
            raise ValueError(f'shared_head_tokens must be None or an int >= 0, got {shared_head_tokens!r}')
        seq = Sequence([int(t) for t in token_ids], gen_config, tuple(multimodal_spans), lookahead, recompute,
                       self.eos_token_ids, tuple(multimodal))
        seq.shared_head_tokens = shared_head_tokens
        if gen_config.structured_output is not None:
            try:
                seq.guide = self.grammar().guide(gen_config.structured_output)
            except ValueError as err:
                raise ValueError(f'structured_output.{err}') from None
        if any(gen_config.stop_words):
            seq.stop_strings = Detokenizer(self._output_tokenizer(), gen_config.stop_words)
        return seq

    def _output_tokenizer(self):
        """The tokenizer that decodes outputs for stop strings: the one set by the caller (the
        pipeline's), else the model directory's, loaded once."""
        with self._tokenizer_lock:
            if self.tokenizer is None:
                from transformers import AutoTokenizer
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            return self.tokenizer

    @staticmethod
    def release(seq: Sequence) -> None:
        """Free what a sequence holds outside the caches (its grammar matcher); idempotent."""
        if seq.guide is not None:
            seq.guide.close()

    def add_request(self, token_ids: list[int], gen_config: GenerationConfig | None = None,
                    **kwargs) -> Sequence:
        """Queue a request; it runs on the following steps. Arguments as :meth:`make_sequence`.

        Raises:
            ValueError: see :meth:`validate`.
        """
        seq = self.make_sequence(token_ids, gen_config, **kwargs)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` now and free its resources."""
        if not seq.is_finished:
            self.scheduler.abort(seq)
            seq.finish_reason = 'abort'
        self.release(seq)

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

    @property
    def has_work(self) -> bool:
        """Some sequence is waiting or running in the scheduler."""
        return self.scheduler.has_work

    # the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one forward over the scheduled chunks; returns per-sequence progress."""
        self.prefix_cache.probe(self.scheduler.waiting)
        sched = self.scheduler.schedule()
        self._execute_loads(sched)
        if not sched.chunks:
            return []
        if self.spec is not None:
            self.spec.before_forward(sched)
        next_tokens = self.model_runner.forward(sched)
        if self.spec is not None:
            self.spec.after_forward(sched, next_tokens)
        saves = self.scheduler.computed(sched)
        self._execute_saves(saves)
        outputs = self._update(sched, next_tokens)
        if self.spec is not None:
            self.spec.propose(sched, next_tokens)
        return outputs

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
        if not cfg.ignore_eos and (token in seq.eos_token_ids or token in cfg.stop_token_ids):
            return 'stop'
        if token in cfg.stop_token_ids:
            return 'stop'
        if seq.stop_strings is not None and seq.stop_strings.feed(token):
            seq.num_kept_tokens = seq.num_prompt_tokens + seq.stop_strings.kept_tokens
            return 'stop'
        if seq.num_generated >= cfg.max_new_tokens or seq.num_tokens >= self.session_len:
            return 'length'
        return None

    def _update(self, sched, next_tokens: dict[int, list[int]]) -> list[StepOutput]:
        outputs = []
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
                if seq.seq_id in self.model_runner.last_logprobs:
                    out.logprobs = [self.model_runner.last_logprobs[seq.seq_id]]
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
        sc = self.state_cache
        ckpt_rows = sc.num_checkpoint_rows if sc else 0
        return {
            'blocks_total': bm.num_blocks,
            'blocks_free': bm.num_free,
            'blocks_cached': cached,
            'blocks_in_use': bm.num_blocks - bm.num_free - cached - ckpt_rows,
            'checkpoint_rows': ckpt_rows,
            # bytes the prefix cache holds per tier (payload bytes: cached KV blocks and checkpoints)
            'device_cache_bytes': cached * self.cache_engine.kv_block_bytes
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
            'grammar_matchers': self._grammar.num_live if self._grammar is not None else 0,
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
                and led['checkpoints_pinned'] == 0 and led['store_inflight'] == 0 and not self.has_work
                and led['grammar_matchers'] == 0)

    def close(self) -> None:
        """Stop the Store worker (flushing queued saves), then the tensor-parallel workers."""
        try:
            if self.store is not None:
                self.store.close()
        finally:
            self.executor.close()


def _next_power_of_two(n: int) -> int:
    """The smallest power of two above ``n`` (a session length that fits an ``n``-token prompt)."""
    return 1 << n.bit_length()
