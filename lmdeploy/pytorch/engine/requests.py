"""CheckedRequest admission: every field of a request is checked here, once, before it reaches the engine.

::

    token ids + GenerationConfig + images ──RequestFactory.check──▶ CheckedRequest (checked, immutable)
                                                                       │ .choice(seed): n > 1
                                                                       ▼
                                          RequestFactory.sequence ──▶ Sequence ──▶ Engine.add

:meth:`RequestFactory.check` refuses a bad field with a :class:`RequestError` that names it
(``prompt``, ``stop_token_ids``, ``logit_bias``, ``structured_output``, ``multimodal``,
``shared_head_tokens``). A :class:`CheckedRequest` is only made by ``check``, so building its
:class:`~lmdeploy.pytorch.paging.sequence.Sequence` checks nothing again; the choices of one
request (``n`` > 1) differ only in their sampling seed (:meth:`CheckedRequest.choice`), which no check
reads, so they are checked once. The factory reads only state fixed when the engine was built
(vocabulary, session length, the decoding strategy): callers on any thread (the server's worker
threads) may use it while the engine thread steps.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ...messages import GenerationConfig
from ..paging.sequence import Sequence
from ..spec_decode.strategy import DecodingStrategy
from .stop_strings import Detokenizer

__all__ = ['CheckedRequest', 'RequestError', 'RequestFactory']


class RequestError(ValueError):
    """A request field the engine refuses.

    Attributes:
        field: the field's name (``prompt``, ``stop_token_ids``, ``logit_bias``,
            ``structured_output``, ``multimodal``, ``shared_head_tokens``).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed :meth:`RequestFactory.check` (not yet queued).

    Attributes:
        token_ids: the prompt's token ids, each in ``[0, vocab_size)``.
        gen_config: sampling and stopping options.
        multimodal: the prompt's images (:class:`~lmdeploy.pytorch.multimodal.MultimodalInput`).
        multimodal_spans: half-open token ranges that no chunk end or checkpoint may split.
        shared_head_tokens: tokens of the prompt's shared head, or None.
        token_lookahead: ℓ of this request's prefill plan (tokens).
        recompute_blocks: r of this request's prefill plan (blocks).
    """
    token_ids: tuple[int, ...]
    gen_config: GenerationConfig
    multimodal: tuple = ()
    multimodal_spans: tuple[tuple[int, int], ...] = ()
    shared_head_tokens: int | None = None
    token_lookahead: int = 0
    recompute_blocks: int = 0

    def choice(self, random_seed: int | None) -> CheckedRequest:
        """The same request with another sampling seed (one choice of ``n``); no check reads the
        seed, so the copy needs none."""
        return replace(self, gen_config=self.gen_config.model_copy(update={'random_seed': random_seed}))


class RequestFactory:
    """Checks requests and builds their sequences for one engine.

    Args:
        model_path: the model directory (the tokenizer for grammars and stop strings).
        model: the engine's model (``supports_images``, ``check_multimodal``).
        model_type: the config's ``model_type``, for messages.
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        session_len: a prompt must hold fewer tokens (at most ``session_len - 1``).
        session_len_source: what set ``session_len``: ``'session_len'``,
            ``'max_position_embeddings'`` or ``'kv_cache:BLOCKS'`` (for the refusal's advice).
        block_size: tokens per KV block (for the refusal's advice).
        eos_token_ids: the model's end-of-sequence ids.
        strategy: the decoding strategy: the default ℓ and r of every request.
        has_mtp: drafting with an MTP head (which takes no images).
    """

    def __init__(self, model_path: str, model, model_type: str, vocab_size: int, session_len: int,
                 session_len_source: str, block_size: int, eos_token_ids: frozenset[int],
                 strategy: DecodingStrategy, has_mtp: bool = False):
        self.model_path = model_path
        self.model = model
        self.model_type = model_type
        self.vocab_size = vocab_size
        self.session_len = session_len
        self.session_len_source = session_len_source
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.strategy = strategy
        self.has_mtp = has_mtp
        self.tokenizer = None       # decodes outputs for stop strings (the pipeline sets its own; else loaded)
        self._grammar = None        # constrained decoding, built with the first guided request
        self._lock = threading.Lock()

    @property
    def num_grammar_matchers(self) -> int:
        """Grammar matchers alive (one per guided sequence not yet released)."""
        return self._grammar.num_live if self._grammar is not None else 0

    def prompt_too_long(self, num_tokens: int) -> str:
        """The message refusing a prompt of ``num_tokens`` (``>= session_len``) tokens: both
        numbers, what set ``session_len`` and the flag that raises it (``--session-len``; its
        default is the model's ``max_position_embeddings``, e.g. 32768 for the tiny models, less
        than an agent CLI's first prompt; or the KV cache, when it holds fewer tokens)."""
        text = (f'the prompt has {num_tokens} tokens, which does not fit session_len={self.session_len} '
                f'(at most {self.session_len - 1} prompt tokens); ')
        source = self.session_len_source
        # the engine serves the server, `lmdeploy chat` and the Python pipeline alike
        hint = ('restart with a larger --session-len (session_len), e.g. --session-len '
                f'{_next_power_of_two(num_tokens)}')
        if source == 'max_position_embeddings':
            return text + ('session_len defaults to max_position_embeddings of the model\'s config.json; ' + hint)
        if source == 'session_len':
            return text + hint
        blocks = int(source.split(':')[1])
        return text + (f'the KV cache holds only {blocks} blocks x {self.block_size} tokens: give it more '
                       'with --num-gpu-blocks (num_gpu_blocks) or --cache-max-entry-count (cache_max_entry_count)')

    def grammar(self):
        """The :class:`~.guided.GrammarBackend` of this model's tokenizer (built on first use)."""
        with self._lock:
            if self._grammar is None:
                from transformers import AutoTokenizer

                from .guided import GrammarBackend
                tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
                self._grammar = GrammarBackend(tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar

    def check(self, token_ids: list[int], gen_config: GenerationConfig | None = None, *, multimodal: tuple = (),
              multimodal_spans: tuple[tuple[int, int], ...] = (), shared_head_tokens: int | None = None,
              token_lookahead: int | None = None, recompute_blocks: int | None = None) -> CheckedRequest:
        """Check every field of a request once; the checked :class:`CheckedRequest`.

        ``token_lookahead`` / ``recompute_blocks`` default to the engine's decoding strategy.
        ``shared_head_tokens``: tokens of the prompt's shared head (a chat request's system prompt
        and tools, see :attr:`Sequence.shared_head_tokens`), or None.

        The options are checked before the prompt (a request with a bad option and a bad prompt
        is refused for the option).

        Raises:
            RequestError: naming the field: ``stop_token_ids`` / ``logit_bias`` (a token id outside
                ``[0, vocab_size)``), ``structured_output`` (a grammar that does not compile, or a
                prefix it refuses), ``prompt`` (empty, ``session_len`` tokens or more — the message
                gives both numbers —, or a token id outside the vocabulary), ``multimodal`` (images
                for a model without an image encoder or with MTP drafting, a span past the
                prompt, images that do not match their placeholders), ``shared_head_tokens``
                (not None nor an int >= 0).
        """
        gen_config = gen_config or GenerationConfig()
        self._check_options(gen_config)
        ids = tuple(int(t) for t in token_ids)
        self._check_prompt(ids)
        self._check_multimodal(ids, multimodal)
        if shared_head_tokens is not None and (isinstance(shared_head_tokens, bool)
                                               or not isinstance(shared_head_tokens, int) or shared_head_tokens < 0):
            raise RequestError('shared_head_tokens',
                               f'shared_head_tokens must be None or an int >= 0, got {shared_head_tokens!r}')
        return CheckedRequest(ids, gen_config, tuple(multimodal), tuple(multimodal_spans), shared_head_tokens,
                       self.strategy.token_lookahead if token_lookahead is None else token_lookahead,
                       self.strategy.recompute_blocks if recompute_blocks is None else recompute_blocks)

    def _check_options(self, gen_config: GenerationConfig) -> None:
        for name, ids, what in (('stop_token_ids', gen_config.stop_token_ids, ''),
                                ('logit_bias', gen_config.logit_bias, 'token id ')):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(name, f'{name}: {what}{bad[0]} is outside the vocabulary [0, {self.vocab_size})')
        spec = gen_config.structured_output
        if spec is not None:
            try:
                if spec.prefix:
                    self.grammar().guide(spec).close()     # also checks the prefix
                else:
                    self.grammar().compile(spec)
            except ValueError as err:
                raise RequestError('structured_output', f'structured_output.{err}') from None

    def _check_prompt(self, ids: tuple[int, ...]) -> None:
        if not ids:
            raise RequestError('prompt', 'the prompt is empty: at least 1 token is required')
        if len(ids) >= self.session_len:
            raise RequestError('prompt', self.prompt_too_long(len(ids)))
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError('prompt', f'token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})')

    def _check_multimodal(self, ids: tuple[int, ...], multimodal: tuple) -> None:
        if not multimodal:
            return
        images = any(m.data is not None for m in multimodal)
        if images and not self.model.supports_images:
            # spans and content hashes alone only steer planning and cache keys; pixels need an encoder
            raise RequestError('multimodal', f'model_type {self.model_type!r} does not accept images in this engine')
        if any(m.end > len(ids) for m in multimodal):
            raise RequestError('multimodal', f'a multimodal span ends past the prompt of {len(ids)} tokens')
        if images:
            if self.has_mtp:
                raise RequestError('multimodal', 'images are not supported with MTP speculative decoding '
                                   '(speculative_config.method=mtp)')
            try:
                self.model.check_multimodal(list(ids), multimodal)
            except ValueError as err:
                raise RequestError('multimodal', str(err)) from None

    def sequence(self, request: CheckedRequest) -> Sequence:
        """The :class:`Sequence` of a checked request (nothing is checked again): its grammar
        matcher and stop-string detokenizer are its own."""
        cfg = request.gen_config
        seq = Sequence(list(request.token_ids), cfg, request.multimodal_spans, request.token_lookahead,
                       request.recompute_blocks, self.eos_token_ids, request.multimodal)
        seq.shared_head_tokens = request.shared_head_tokens
        if cfg.structured_output is not None:
            seq.guide = self.grammar().guide(cfg.structured_output)
        if any(cfg.stop_words):
            seq.stop_strings = Detokenizer(self._output_tokenizer(), cfg.stop_words)
        return seq

    def _output_tokenizer(self):
        """The tokenizer that decodes outputs for stop strings: the one set by the caller (the
        pipeline's), else the model directory's, loaded once."""
        with self._lock:
            if self.tokenizer is None:
                from transformers import AutoTokenizer
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            return self.tokenizer


def _next_power_of_two(n: int) -> int:
    """The smallest power of two above ``n`` (a session length that fits an ``n``-token prompt)."""
    return 1 << n.bit_length()
