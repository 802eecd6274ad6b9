"""The user-facing pipeline: prompts in, responses out.

It owns the tokenizer (chat template, incremental detokenization, stop strings) and an
:class:`~lmdeploy.pytorch.engine.engine_loop.EngineLoop`. Accepted prompts: a string, an
OpenAI-style message list (``[{"role": ..., "content": ...}]``, rendered with the model's chat
template), or a list of token ids; or a list of any of those for a batch.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from ..pytorch.engine.engine import Engine
from ..pytorch.engine.engine_loop import EngineLoop, RequestHandle

__all__ = ['Pipeline', 'ChatSession']

VALID_ROLES = ('system', 'user', 'assistant', 'tool')


def _is_single(prompt) -> bool:
    """A single prompt: a string, a message list, or a token-id list."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, (list, tuple)):
        return not prompt or isinstance(prompt[0], (dict, int))
    return False


class _Detokenizer:
    """Turns a growing list of output ids into text deltas, holding back text that may be the
    start of a stop string or an incomplete UTF-8 character.

    Incremental: each call decodes only the tokens since the last stable point plus the tokens
    of the previous delta as context (so a token whose text depends on its neighbours decodes
    as in the full string), and searches for stop strings only in the new tail — O(delta)
    per call instead of re-decoding the whole output.
    """

    def __init__(self, tokenizer, stop_words: list[str]):
        self.tokenizer = tokenizer
        self.stop_words = [w for w in stop_words if w]
        self.hold = max((len(w) for w in self.stop_words), default=1) - 1
        self.ids: list[int] = []
        self.text = ''              # decoded text of ids[:read_offset]
        self.prefix_offset = 0      # ids[prefix_offset:read_offset]: context re-decoded each call
        self.read_offset = 0
        self.emitted = 0            # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool) -> str:
        """Append ids; return the new text that is safe to emit."""
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith('\ufffd')):
            before = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            tail_start = max(0, before - self.hold)
            for word in self.stop_words:
                pos = self.text.find(word, tail_start)
                if pos != -1:
                    self.text, final, self.stopped = self.text[:pos], True, True
        end = len(self.text)
        if not final:
            end = max(self.emitted, end - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


@dataclass
class ChatSession:
    """A multi-turn conversation kept by :meth:`Pipeline.chat`.

    Attributes:
        messages: the OpenAI-style history, user and assistant turns alternating.
        response: the last turn's :class:`Response` (None before the first turn).
    """
    messages: list[dict] = field(default_factory=list)
    response: Response | None = None


class Pipeline:
    """Serve ``model_path`` with the PyTorch engine.

    Args:
        model_path: local Hugging Face model directory.
        backend_config: engine configuration.

    Raises:
        ValueError: bad path / unsupported model / bad config.
    """

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None):
        from transformers import AutoTokenizer
        self.backend_config = backend_config or PytorchEngineConfig()
        self.engine = Engine(model_path, self.backend_config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model_path = model_path
        self.loop = EngineLoop(self.engine)

    # input -----------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """Token ids of one prompt.

        Raises:
            ValueError: an empty prompt, a malformed message list or an unknown role.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if m.get('role') not in VALID_ROLES:
                    raise ValueError(f'unknown message role {m.get("role")!r}; expected one of {VALID_ROLES}')
                if not isinstance(m.get('content', ''), str):
                    raise ValueError('message content must be a string')
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, 'keys'):
                ids = ids['input_ids']
            ids = list(ids)
        else:
            raise ValueError('prompt must be a non-empty string, message list or token-id list')
        if not ids:
            raise ValueError('the prompt is empty: at least 1 token is required')
        return ids

    def submit(self, prompt, gen_config: GenerationConfig | None = None, loop=None) -> RequestHandle:
        """Encode and queue one prompt; returns its handle."""
        return self.loop.submit(self.encode(prompt), gen_config or GenerationConfig(), loop=loop)

    # sync API --------------------------------------------------------------------------
    def __call__(self, prompts, gen_config: GenerationConfig | None = None):
        """Generate to completion.

        Returns:
            A :class:`Response` for a single prompt, a list for a list of prompts.
        """
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        final: dict[int, Response] = {}
        for r in self.stream_infer(batch, gen_config):
            acc = final.setdefault(r.index, Response(index=r.index))
            acc.text += r.text
            acc.token_ids += r.token_ids
            acc.input_token_len, acc.generate_token_len = r.input_token_len, r.generate_token_len
            acc.cached_tokens, acc.finish_reason = r.cached_tokens, r.finish_reason or acc.finish_reason
        results = [final[i] for i in range(len(batch))]
        return results[0] if single else results

    def stream_infer(self, prompts, gen_config: GenerationConfig | None = None) -> Iterator[Response]:
        """Yield :class:`Response` deltas (``index`` = the prompt's position) as tokens arrive."""
        gen_config = gen_config or GenerationConfig()
        batch = [prompts] if _is_single(prompts) else list(prompts)
        # check every prompt before queueing any, so a bad one does not leave the others
        # running unattended in the engine
        inputs = [self.encode(p) for p in batch]
        for ids in inputs:
            self.engine.validate(ids, gen_config)
        handles = [self.loop.submit(ids, gen_config) for ids in inputs]
        detoks = [_Detokenizer(self.tokenizer, gen_config.stop_words) for _ in batch]
        live = set(range(len(batch)))
        try:
            while live:
                for i in sorted(live):
                    out = handles[i].get()
                    resp = self._delta(out, detoks[i], gen_config, i)
                    if detoks[i].stopped and out.finish_reason is None:
                        self.loop.abort(handles[i])
                        resp.finish_reason = 'stop'
                    if resp.finish_reason is not None:
                        live.discard(i)
                    yield resp
        finally:
            for i in live:
                self.loop.abort(handles[i])

    async def generate(self, prompt, gen_config: GenerationConfig | None = None) -> AsyncIterator[Response]:
        """Async generator of :class:`Response` deltas for one prompt (used by the server).

        Cancelling the consumer aborts the request in the engine.
        """
        gen_config = gen_config or GenerationConfig()
        handle = self.submit(prompt, gen_config, loop=asyncio.get_running_loop())
        detok = _Detokenizer(self.tokenizer, gen_config.stop_words)
        finished = False
        try:
            while True:
                out = await handle.aget()
                resp = self._delta(out, detok, gen_config, 0)
                if detok.stopped and out.finish_reason is None:
                    self.loop.abort(handle)
                    resp.finish_reason = 'stop'
                if resp.finish_reason is not None:
                    finished = True
                yield resp
                if finished:
                    return
        finally:
            if not finished:
                self.loop.abort(handle)

    def _delta(self, out, detok: _Detokenizer, gen_config: GenerationConfig, index: int) -> Response:
        ids = out.token_ids
        if out.finish_reason == 'stop' and ids and (ids[-1] in gen_config.stop_token_ids or (
                not gen_config.ignore_eos and ids[-1] in self.engine.eos_token_ids)):
            ids = ids[:-1]          # the stop token ends the text; it is not part of it (ignore_eos
            #                         only turns off EOS; stop_token_ids still stop, see Engine._update)
        text = '' if detok.stopped else detok.add(ids, final=out.finish_reason is not None)
        # a stop string found in the last delta ends the text even when the engine also hit
        # max_new_tokens on that token, so the request stopped, not ran out of length
        reason = 'stop' if detok.stopped else out.finish_reason
        return Response(text=text, token_ids=list(ids), input_token_len=out.num_prompt_tokens,
                        generate_token_len=out.num_generated, finish_reason=reason,
                        cached_tokens=out.cached_tokens, index=index)

    def chat(self, prompt: str, session: ChatSession | None = None, gen_config: GenerationConfig | None = None,
             system: str | None = None) -> ChatSession:
        """One turn of a multi-turn conversation: append ``prompt`` as a user message, generate
        the reply from the whole history (so, with prefix caching, the previous turns' prefix
        is reused), and append the reply.

        Args:
            prompt: the user's message.
            session: the conversation so far (a new one if None).
            gen_config: sampling options.
            system: system message of a new session.

        Returns:
            The session, with the reply in ``session.response``.

        Raises:
            ValueError: an empty prompt or a history too long for ``session_len``.
        """
        if session is None:
            session = ChatSession([{'role': 'system', 'content': system}] if system else [])
        messages = session.messages + [{'role': 'user', 'content': prompt}]
        response = self(messages, gen_config)
        session.messages = messages + [{'role': 'assistant', 'content': response.text}]
        session.response = response
        return session

    def ledger(self) -> dict[str, int]:
        """The engine's resource ledger, read on the engine thread."""
        return self.loop.call(lambda engine: engine.ledger())

    def close(self) -> None:
        """Stop the engine thread and Store workers."""
        self.loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
