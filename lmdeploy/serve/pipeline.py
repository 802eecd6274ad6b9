"""The user-facing pipeline: prompts in, responses out.

It owns the tokenizer (chat template, incremental detokenization, stop strings) and an
:class:`~lmdeploy.pytorch.engine.engine_loop.EngineLoop`. Accepted prompts: a string, an
OpenAI-style message list (``[{"role": ..., "content": ...}]``, rendered with the model's chat
template; for models with images, content may hold image parts: :mod:`lmdeploy.serve.images`),
or a list of token ids; or a list of any of those for a batch.

A plain string is a user message and goes through the chat template too, unless the call
passes ``do_preprocess=False`` (then the string is tokenized as is: a raw continuation).
Token-id lists are never changed. Rendering a message list equals
``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True, **kwargs)``
token for token (``developer`` messages are rendered as ``system``).

A message-list prompt also tells the engine where its *shared head* ends
(:func:`shared_head_tokens`): the rendered system/developer messages and tool definitions that
every session of the same agent sends before its first user words. The engine ends a prefill
forward and saves a checkpoint at the head's last reusable boundary, so a new session restores
the head even with ``prefill_save_last_only`` (whose only other checkpoint lies past the point
where sessions diverge).
"""
from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

from ..messages import GenerationConfig, PytorchEngineConfig, Response
from ..pytorch.engine.engine import Engine
from ..pytorch.engine.engine_loop import EngineLoop, RequestHandle
from ..pytorch.engine.requests import CheckedRequest
from ..pytorch.engine.stop_strings import Detokenizer as _Detokenizer
from .images import ImageInputs, chat_part, extract_images, has_images

__all__ = ['Pipeline', 'ChatSession', 'render_chat', 'shared_head_tokens', 'engine_summary', 'store_summary']


# transformers resolves its names lazily on first use (``_LazyModule``); two threads doing that
# first use at once can see a half-imported module ("cannot import name 'AutoTokenizer'": 8 of 8
# concurrent builds failed). Pipelines therefore take this lock for what resolves transformers
# modules: the first imports, the model's config class and its tokenizer class.
_TRANSFORMERS_LOCK = threading.Lock()
HANDOFF_TIMEOUT_S = 60.0    # most seconds a prefill server waits for a hand-off's Store puts


def _load_transformers(model_path: str):
    """``AutoTokenizer``, after importing under :data:`_TRANSFORMERS_LOCK` the transformers names
    (and the model type's configuration module) that building an engine resolves."""
    with _TRANSFORMERS_LOCK:
        import transformers.modeling_rope_utils  # noqa: F401  (the engine's RoPE functions)
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: F401
        try:
            AutoConfig.from_pretrained(model_path, local_files_only=True)   # imports its config module
        except Exception:   # noqa: BLE001 - a bad directory: the engine names the problem
            pass
    return AutoTokenizer


def _is_single(prompt) -> bool:
    """A single prompt: a string, a message list, or a token-id list."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, (list, tuple)):
        return not prompt or isinstance(prompt[0], (dict, int))
    return False


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None, allow_images: bool = False) -> str:
    """The prompt text of a conversation, ending with the assistant's generation prompt.

    Equal to ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
    tokenize=False, **chat_template_kwargs)`` with ``developer`` messages given as ``system``.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: OpenAI-style messages (``content`` a string, text parts or None; assistant
            ``tool_calls``; tool ``tool_call_id`` / ``name``).
        tools: OpenAI ``tools`` entries handed to the template, or None.
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
        allow_images: accept ``{"type": "image"}`` parts (placeholders left by
            :func:`~lmdeploy.serve.images.extract_images`; the template renders them).

    Raises:
        ValueError: an empty list, a message that is not a dict, a role that is not a non-empty
            string, no chat template, or the template rejecting the conversation (an unknown
            role among others; its message is kept), or leaving out the text of a message whose
            role is not one of OpenAI's (``messages[i].role: ...``).
    """
    if not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    msgs = []
    for m in messages:
        # other roles are the template's to render or refuse (custom roles of fine-tuned templates)
        if not isinstance(m.get('role'), str) or not m['role']:
            raise ValueError(f'a message role must be a non-empty string, got {m.get("role")!r}')
        content = m.get('content')
        if isinstance(content, list):
            if not all(isinstance(p, dict) and (p.get('type') == 'text' and isinstance(p.get('text'), str)
                                                or allow_images and p.get('type') == 'image') for p in content):
                raise ValueError('message content parts must be {"type": "text", "text": str}'
                                 + ('' if allow_images else ' (this model does not accept images)'))
        elif content is not None and not isinstance(content, str):
            raise ValueError('message content must be a string, a list of text parts or null')
        msgs.append(dict(m, role='system') if m['role'] == 'developer' else m)
    if not getattr(tokenizer, 'chat_template', None):
        raise ValueError('this model has no chat template; send a raw prompt instead')
    def render(conversation: list[dict]) -> str:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False, **(chat_template_kwargs or {}))

    try:
        text = render(msgs)
    except Exception as err:     # jinja2 TemplateError / raise_exception in the template
        raise ValueError(f'the chat template rejected the conversation: {err}') from err
    _check_custom_roles_rendered(msgs, text, render)
    return text


# the roles of OpenAI's chat API; a template renders them or refuses them itself
_OPENAI_ROLES = frozenset({'system', 'developer', 'user', 'assistant', 'tool', 'function'})


def _check_custom_roles_rendered(messages: list[dict], text: str, render: Callable[[list[dict]], str]) -> None:
    """Refuse a message of a role outside OpenAI's that the chat template left out: many
    templates (Qwen3's among them) skip a role they do not know without an error, so a mistyped
    role (``"usr"``) was served as if its message had not been sent.

    "Left out" is decided by rendering the conversation with the message's text emptied
    (``render``, the chat template as it rendered ``text``): the same prompt means the template
    ignored its text. Not by searching ``text`` for the message's text, which refuses a role the
    template does render but transforms (``| tojson`` escapes quotes and newlines). A message
    without text, or one whose emptied form the template raises on, is never refused. Costs one
    render per such message.

    Raises:
        ValueError: ``messages[i].role: ...`` naming the role the template dropped.
    """
    for i, m in enumerate(messages):
        if m['role'] in _OPENAI_ROLES:
            continue
        content = m.get('content')
        parts = [content] if isinstance(content, str) else [
            p['text'] for p in content or () if isinstance(p, dict) and p.get('type') == 'text']
        if not any(p.strip() for p in parts):
            continue
        try:
            # its text emptied, not the message removed: a conversation of that message alone
            # stays one a template accepts
            without = render(messages[:i] + [dict(m, content='')] + messages[i + 1:])
        except Exception:       # noqa: BLE001 -- the template needs the message: it did not skip it
            continue
        if without == text:
            raise ValueError(f'messages[{i}].role: the chat template does not render role {m["role"]!r} (it '
                             f'left the message out); use one of user, assistant, system, developer, tool')


def shared_head_tokens(tokenizer, tokenize, messages: list[dict], token_ids: list[int],
                       tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> int | None:
    """Tokens of a chat prompt's shared head: its leading system/developer messages and tool
    definitions as the chat template renders them, up to where the first user or assistant
    message begins. Every session of one agent sends the same head, so a checkpoint there is
    reusable across sessions.

    Found by rendering only the head (the leading system/developer messages and ``tools``, no
    generation prompt) with ``tokenizer.apply_chat_template``, tokenizing it with ``tokenize``
    and taking the length of its common token prefix with ``token_ids`` (the full prompt's ids):
    robust to templates that append text after the last message or tokenize across the seam.
    A template that refuses a conversation without a user message (some raise "no user query")
    is asked again with an empty user message appended; its header then counts as head, which
    every session whose first message is a user message shares too.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tokenize: ``str -> list[int]``, tokenizing as the full prompt was (no special tokens added).
        messages: the request's OpenAI-style messages (as given to :func:`render_chat`).
        token_ids: the full prompt's token ids.
        tools: the ``tools`` handed to the template, or None.
        chat_template_kwargs: the extra template variables of the request.

    Returns:
        The head's length in tokens, or None when there is no head (no leading system message
        and no tools), nothing follows it, or the template cannot render it.
    """
    lead = []
    for m in messages:
        if not isinstance(m, dict) or m.get('role') not in ('system', 'developer'):
            break
        lead.append(dict(m, role='system'))
    if not lead and not tools or len(lead) == len(messages):
        return None
    text = None
    for head in (lead, lead + [{'role': 'user', 'content': ''}]):
        try:
            text = tokenizer.apply_chat_template(head, tools=tools or None, add_generation_prompt=False,
                                                 tokenize=False, **(chat_template_kwargs or {}))
            break
        except Exception:       # jinja2 TemplateError / raise_exception: try the next form
            continue
    if not text:
        return None
    head_ids = tokenize(text)
    k = 0
    for a, b in zip(head_ids, token_ids):
        if a != b:
            break
        k += 1
    return k or None


_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer.model', 'vocab.json', 'spiece.model', 'vocab.txt')


def _as_config(value, cls, name: str):
    """``value`` as a ``cls`` instance: None = the defaults, a dict = its fields (validated).

    Raises:
        ValueError: an invalid field (named), or a value of another type (names ``name``).
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise ValueError(f'{name} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__}')


@dataclass
class ChatSession:
    """A multi-turn conversation kept by :meth:`Pipeline.chat`.

    Attributes:
        messages: the OpenAI-style history: an optional system message first (``system`` of
            :meth:`Pipeline.chat`), then user and assistant turns alternating.
        response: the last turn's :class:`Response` (None before the first turn).
    """
    messages: list[dict] = field(default_factory=list)
    response: Response | None = None


class Pipeline:
    """Serve ``model_path`` with the PyTorch engine.

    Args:
        model_path: local Hugging Face model directory.
        backend_config: engine configuration (a :class:`PytorchEngineConfig` or a dict of its
            fields; every ``gen_config`` argument below likewise takes a
            :class:`GenerationConfig` or a dict).

    Pipelines may be built from several threads at once.

    Raises:
        ValueError: bad path / unsupported model / bad config (names the field) / a model file
            (config.json, generation_config.json, the tokenizer's) that cannot be loaded (names it).
    """

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | dict | None = None):
        auto_tokenizer = _load_transformers(model_path)     # thread-safe: see _TRANSFORMERS_LOCK
        self.backend_config = _as_config(backend_config, PytorchEngineConfig, 'backend_config')
        self.engine = Engine(model_path, self.backend_config)   # checks the path and the model type first
        if not any(os.path.exists(os.path.join(model_path, f)) for f in _TOKENIZER_FILES):
            # transformers would build an empty tokenizer, and every prompt would then fail
            self.engine.close()
            raise ValueError(f'{model_path} has no tokenizer files (one of {list(_TOKENIZER_FILES)}); copy them '
                             f'from the original checkpoint')
        try:
            with _TRANSFORMERS_LOCK:        # resolves (imports) the tokenizer class
                self.tokenizer = auto_tokenizer.from_pretrained(model_path, local_files_only=True)
        except Exception as err:    # noqa: BLE001 - the tokenizers library raises a bare Exception for a broken file
            self.engine.close()
            raise ValueError(f'model_path {model_path!r}: the tokenizer files (tokenizer.json, tokenizer_config.json, '
                             f'...) cannot be loaded: {type(err).__name__}: {err}') from None
        self.engine.requests.tokenizer = self.tokenizer      # the engine ends replies at stop strings itself
        self.model_path = model_path
        self.loop = EngineLoop(self.engine)
        self._images: ImageInputs | None = None      # the image processor, loaded on first use

    # input -----------------------------------------------------------------------------
    @property
    def session_len(self) -> int:
        """Tokens one sequence may hold (prompt and reply); a prompt must be shorter."""
        return self.engine.session_len

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer defines a chat template."""
        return bool(getattr(self.tokenizer, 'chat_template', None))

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               chat_template_kwargs: dict | None = None) -> str:
        """The prompt text of a conversation (see :func:`render_chat`)."""
        return render_chat(self.tokenizer, messages, tools, chat_template_kwargs)

    def shared_head(self, prompt, token_ids: list[int], tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> int | None:
        """The shared head's length (tokens) of a message-list ``prompt`` whose full ids are
        ``token_ids`` (:func:`shared_head_tokens`); None for strings, token ids, or a model
        without a chat template."""
        if not (isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt)) \
                or not self.has_chat_template:
            return None
        return shared_head_tokens(self.tokenizer, lambda text: self.tokenize(text, check_length=False), list(prompt),
                                  token_ids, tools, chat_template_kwargs)

    def tokenize(self, text: str, check_length: bool = True) -> list[int]:
        """Token ids of ``text`` as is (no special tokens added), as ``apply_chat_template``
        tokenizes its rendered text.

        The Rust tokenizer's batch call is used because it releases the GIL while it works,
        so other threads (the server's event loop) keep running during a long prompt; a prompt
        over the session length is refused before its ids are copied into Python. Its fast
        variant (``encode_batch_fast``, same ids, no character offsets) is preferred: freeing
        the offsets and token strings of a 2.7M-token encoding held the GIL for 0.17 s (7 ms
        without them), stalling the event loop once per refused long prompt.

        Raises:
            ValueError: with ``check_length``, ``session_len`` tokens or more (both numbers given).
        """
        backend = getattr(self.tokenizer, 'backend_tokenizer', None)
        if backend is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            num = len(ids)
        else:
            encode = getattr(backend, 'encode_batch_fast', None) or backend.encode_batch   # (tokenizers < 0.21)
            enc = encode([text], add_special_tokens=False)[0]
            num, ids = len(enc), None
        limit = self.engine.session_len
        if check_length and num >= limit:
            raise ValueError(self.engine.requests.prompt_too_long(num))
        return list(enc.ids if ids is None else ids)

    @property
    def accepts_images(self) -> bool:
        """Whether the model takes image content parts."""
        return self.engine.model.supports_images

    def render_with_images(self, messages: list[dict], tools: list[dict] | None = None,
                           chat_template_kwargs: dict | None = None,
                           where: Callable[[int, int], str] = chat_part) -> tuple[str, list]:
        """The prompt text of a conversation with image parts (each rendered as the template's
        placeholder) and its images (PIL, in order).

        Args:
            where: the name of part ``j`` of message ``i`` in errors (default
                ``messages[i].content[j]``).

        Raises:
            ValueError: as :func:`render_chat`; the model does not accept images; an image part
                that cannot be loaded (naming it by ``where``).
        """
        if not self.accepts_images:
            raise ValueError(f'model_type {self.engine.hf_config.model_type!r} does not accept images')
        messages, images = extract_images(list(messages), where)
        return render_chat(self.tokenizer, messages, tools, chat_template_kwargs, allow_images=True), images

    def expand_images(self, text: str, images: list, wheres: list[str] | None = None) -> tuple[list[int], tuple]:
        """Token ids of a rendered prompt with each image placeholder expanded to its image's
        token run, and the images as ``MultimodalInput``s (:class:`~lmdeploy.serve.images.ImageInputs`;
        ``wheres`` names each image's part in errors)."""
        if self._images is None:
            with _TRANSFORMERS_LOCK:    # server worker threads may get their first images at once
                if self._images is None:
                    self._images = ImageInputs(self.model_path, self.engine.hf_config)
        return self._images.expand(self.tokenize(text), images, wheres)

    def encode_with_images(self, prompt, do_preprocess: bool = True) -> tuple[list[int], tuple]:
        """Token ids of one prompt and its images (``MultimodalInput``s, empty without images).

        Image parts (see :mod:`lmdeploy.serve.images`) are loaded, rendered as the template's
        placeholder and expanded to each image's token run.

        Raises:
            ValueError: as :meth:`encode` and :meth:`render_with_images`.
        """
        if not has_images(prompt):
            return self.encode(prompt, do_preprocess), ()
        return self.expand_images(*self.render_with_images(prompt))

    def encode(self, prompt, do_preprocess: bool = True) -> list[int]:
        """Token ids of one prompt (text only: :meth:`encode_with_images` takes image parts).

        Args:
            prompt: a string, a message list or a token-id list.
            do_preprocess: render a string as a user message with the chat template (when the
                model has one); False tokenizes it as a raw continuation.

        Raises:
            ValueError: an empty prompt, a malformed message list or an unknown role.
        """
        if isinstance(prompt, str):
            if do_preprocess and self.has_chat_template and prompt:
                ids = self.tokenize(self.render([{'role': 'user', 'content': prompt}]))
            else:
                ids = self.tokenize(prompt)
        elif prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif prompt and all(isinstance(m, dict) for m in prompt):
            if has_images(prompt):
                raise ValueError('a prompt with image parts needs encode_with_images')
            ids = self.tokenize(self.render(list(prompt)))
        else:
            raise ValueError('prompt must be a non-empty string, message list or token-id list')
        if not ids:
            raise ValueError('the prompt is empty: at least 1 token is required')
        return ids

    def check(self, token_ids: list[int], gen_config: GenerationConfig | dict | None = None, multimodal: tuple = (),
              shared_head_tokens: int | None = None) -> CheckedRequest:
        """Check every field of an encoded request once (the engine's
        :meth:`~lmdeploy.pytorch.engine.requests.RequestFactory.check`); the checked
        :class:`~lmdeploy.pytorch.engine.requests.CheckedRequest` to pass to :meth:`generate` (its
        choices: :meth:`CheckedRequest.choice <lmdeploy.pytorch.engine.requests.CheckedRequest.choice>`).

        Raises:
            RequestError: a ValueError naming the refused field.
        """
        return self.engine.requests.check(token_ids, _as_config(gen_config, GenerationConfig, 'gen_config'),
                                          multimodal=tuple(multimodal), shared_head_tokens=shared_head_tokens)

    def _request(self, prompt, gen_config: GenerationConfig, do_preprocess: bool = True, multimodal: tuple = (),
                 shared_head_tokens: int | None = None) -> CheckedRequest:
        """Encode one prompt and check it. ``multimodal``: the images of a token-id prompt already
        expanded by :meth:`encode_with_images`. ``shared_head_tokens``: the head length of a
        token-id prompt rendered from a chat (:func:`shared_head_tokens`); a message-list
        prompt's is found here."""
        if isinstance(prompt, CheckedRequest):
            return prompt
        if multimodal:
            if not (prompt and all(isinstance(t, int) for t in prompt)):
                raise ValueError('multimodal inputs go with a token-id prompt')
            ids, images = list(prompt), tuple(multimodal)
        else:
            ids, images = self.encode_with_images(prompt, do_preprocess)
        if shared_head_tokens is None:
            shared_head_tokens = self.shared_head(prompt, ids)
        return self.check(ids, gen_config, images, shared_head_tokens)

    def submit(self, prompt, gen_config: GenerationConfig | dict | None = None, loop=None,
               do_preprocess: bool = True, multimodal: tuple = (),
               shared_head_tokens: int | None = None) -> RequestHandle:
        """Encode, check and queue one prompt (or queue a checked :class:`CheckedRequest`, whose own
        options are used); returns its handle. Arguments as :meth:`generate`."""
        gen_config = _as_config(gen_config, GenerationConfig, 'gen_config')
        return self.loop.submit(self._request(prompt, gen_config, do_preprocess, multimodal, shared_head_tokens),
                                loop=loop)

    # sync API --------------------------------------------------------------------------
    def __call__(self, prompts, gen_config: GenerationConfig | dict | None = None, do_preprocess: bool = True):
        """Generate to completion. ``do_preprocess=False``: strings are raw continuations.

        Returns:
            A :class:`Response` for a single prompt, a list for a list of prompts.
        """
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)
        final: dict[int, Response] = {}
        for r in self.stream_infer(batch, gen_config, do_preprocess):
            acc = final.setdefault(r.index, Response(index=r.index))
            acc.text += r.text
            acc.token_ids += r.token_ids
            if r.logprobs is not None:
                acc.logprobs = (acc.logprobs or []) + r.logprobs
            if r.prompt_logprobs is not None:
                acc.prompt_logprobs = r.prompt_logprobs
            acc.input_token_len, acc.generate_token_len = r.input_token_len, r.generate_token_len
            acc.cached_tokens, acc.finish_reason = r.cached_tokens, r.finish_reason or acc.finish_reason
            if r.stop_token_id is not None:
                acc.stop_token_id = r.stop_token_id
        results = [final[i] for i in range(len(batch))]
        return results[0] if single else results

    def stream_infer(self, prompts, gen_config: GenerationConfig | dict | None = None,
                     do_preprocess: bool = True) -> Iterator[Response]:
        """Yield :class:`Response` deltas (``index`` = the prompt's position) as tokens arrive.
        ``do_preprocess=False``: strings are raw continuations."""
        gen_config = _as_config(gen_config, GenerationConfig, 'gen_config')
        batch = [prompts] if _is_single(prompts) else list(prompts)
        # check every prompt before queueing any, so a bad one does not leave the others
        # running unattended in the engine
        requests = [self._request(p, gen_config, do_preprocess) for p in batch]
        handles = [self.loop.submit(r) for r in requests]
        detoks = [_Detokenizer(self.tokenizer, gen_config.stop_words) for _ in batch]
        live = set(range(len(batch)))
        try:
            while live:
                for i in sorted(live):
                    out = handles[i].get()
                    resp = self._delta(out, detoks[i], gen_config, i)
                    if detoks[i].stopped and out.finish_reason is None:
                        self.loop.finish(handles[i])     # a completed turn: cached and put to the Store
                        resp.finish_reason = 'stop'
                    if resp.finish_reason is not None:
                        live.discard(i)
                    yield resp
        finally:
            for i in live:
                self.loop.abort(handles[i])

    async def generate(self, prompt, gen_config: GenerationConfig | dict | None = None,
                       do_preprocess: bool = True, multimodal: tuple = (),
                       stop_at=None, shared_head_tokens: int | None = None) -> AsyncIterator[Response]:
        """Async generator of :class:`Response` deltas for one prompt (used by the server, which
        passes a :class:`CheckedRequest` it encoded and checked off the event loop: :meth:`check`; its
        options are then the request's own, and ``gen_config`` and the encoding arguments are
        not used).

        ``stop_at``: None, or a function of the reply's text so far returning None or how many
        characters to keep: the reply then ends there with ``'stop'`` as a completed turn (like
        a stop string; e.g. just after the first tool call). Cancelling the consumer aborts the
        request in the engine.
        """
        if isinstance(prompt, CheckedRequest):
            gen_config = prompt.gen_config
        else:
            gen_config = _as_config(gen_config, GenerationConfig, 'gen_config')
        handle = self.submit(prompt, gen_config, loop=asyncio.get_running_loop(), do_preprocess=do_preprocess,
                             multimodal=multimodal, shared_head_tokens=shared_head_tokens)
        detok = _Detokenizer(self.tokenizer, gen_config.stop_words)
        finished = False
        text = ''
        try:
            while True:
                out = await handle.aget()
                resp = self._delta(out, detok, gen_config, 0)
                if stop_at is not None and resp.text:
                    text += resp.text
                    keep = stop_at(text)
                    if keep is not None:        # the caller's end of the reply: cut the text there
                        resp.text = resp.text[:len(resp.text) - (len(text) - keep)]
                        resp.finish_reason = 'stop'
                if resp.finish_reason is not None and out.finish_reason is None:
                    # ended here (a stop string, or stop_at): a completed turn for the engine,
                    # cached and put to the Store like one it ended itself
                    self.loop.finish(handle)
                if resp.finish_reason == 'handoff':
                    await self._handed_off(handle, resp)
                if resp.finish_reason is not None:
                    finished = True
                yield resp
                if finished:
                    return
        finally:
            if not finished:
                self.loop.abort(handle)

    @staticmethod
    async def _handed_off(handle, resp: Response) -> None:
        """(role prefill) Wait, off the event loop, until the Store holds the request's hand-off
        (at most :data:`HANDOFF_TIMEOUT_S`): then ``resp.handoff_id`` is its key; if the put
        failed or timed out the response becomes an ``'error'`` (a decode engine would compute
        the prompt itself, but the caller must not be told it was handed off)."""
        handoff = handle.seq.handoff
        if await asyncio.to_thread(handoff.wait, HANDOFF_TIMEOUT_S):
            resp.handoff_id = handoff.key
        else:
            resp.finish_reason = 'error'

    def _delta(self, out, detok: _Detokenizer, gen_config: GenerationConfig, index: int) -> Response:
        ids, logprobs, stop_token = out.token_ids, out.logprobs, None
        if out.finish_reason == 'stop' and ids and (ids[-1] in gen_config.stop_token_ids or (
                not gen_config.ignore_eos and ids[-1] in self.engine.eos_token_ids)):
            # the stop token ends the text; it is not part of it (ignore_eos only turns off EOS;
            # stop_token_ids still stop, see Engine._update)
            stop_token, ids = ids[-1], ids[:-1]
            logprobs = logprobs[:len(ids)] if logprobs is not None else None
        text = '' if detok.stopped else detok.add(ids, final=out.finish_reason is not None)
        # a stop string found in the last delta ends the text even when the engine also hit
        # max_new_tokens on that token, so the request stopped, not ran out of length
        reason = 'stop' if detok.stopped else out.finish_reason
        return Response(text=text, token_ids=list(ids), input_token_len=out.num_prompt_tokens,
                        generate_token_len=out.num_generated, finish_reason=reason,
                        cached_tokens=out.cached_tokens, index=index,
                        logprobs=None if logprobs is None else list(logprobs),
                        prompt_logprobs=getattr(out, 'prompt_logprobs', None), stop_token_id=stop_token)

    def chat(self, prompt: str, session: ChatSession | None = None, gen_config: GenerationConfig | dict | None = None,
             system: str | None = None) -> ChatSession:
        """One turn of a multi-turn conversation: append ``prompt`` as a user message, generate
        the reply from the whole history (so, with prefix caching, the previous turns' prefix
        is reused), and append the reply.

        Args:
            prompt: the user's message (may be empty: the chat template still renders the turn).
            session: the conversation so far (a new one if None).
            gen_config: sampling options.
            system: system message of a new session.

        Returns:
            The session, with the reply in ``session.response``.

        Raises:
            ValueError: a history too long for ``session_len``.
        """
        if session is None:
            session = ChatSession([{'role': 'system', 'content': system}] if system else [])
        messages = session.messages + [{'role': 'user', 'content': prompt}]
        response = self(messages, gen_config)
        session.messages = messages + [{'role': 'assistant', 'content': response.text}]
        session.response = response
        return session

    def ledger(self, timeout: float = 60.0) -> dict[str, int]:
        """The engine's resource ledger, read on the engine thread (TimeoutError after ``timeout``
        seconds)."""
        return self.loop.call(lambda engine: engine.ledger(), timeout=timeout)

    def stats(self, timeout: float = 60.0) -> dict[str, int]:
        """The engine's cumulative counters (:meth:`~lmdeploy.pytorch.engine.engine.Engine.stats`:
        prefix-cache hit tokens, checkpoints saved, Store bytes and operations, speculative
        decoding ...), read on the engine thread (TimeoutError after ``timeout`` seconds)."""
        return self.loop.call(lambda engine: engine.stats(), timeout=timeout)

    def on_engine_failure(self, callback) -> None:
        """Call ``callback(error)`` (on the engine thread) when a step fails for good (e.g. a
        tensor-parallel worker died): the requests in flight ended with ``'error'`` and the
        engine no longer serves."""
        self.loop.on_fatal = callback

    def summary(self) -> str:
        """One line on what the engine sized (:func:`engine_summary`)."""
        return engine_summary(self.engine)

    def close(self) -> None:
        """Stop the engine thread and Store workers."""
        self.loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def engine_summary(engine) -> str:
    """One line on what an engine sized: KV blocks, state slots, and the Store backend really in
    use (its folder for ``file:DIR``, the master's address for an external Mooncake master)."""
    cfg = engine.config
    parts = [f'{engine.block_manager.num_blocks} KV blocks x {cfg.block_size} tokens on {engine.device}']
    if engine.cache_engine.num_slots:
        parts.append(f'{engine.cache_engine.num_slots} state slots')
    parts.append(store_summary(cfg, engine.store is not None))
    return ', '.join(parts)


def store_summary(cfg, in_use: bool) -> str:
    """The Store part of the startup line for an engine config (``PytorchEngineConfig``):
    ``'no Store'`` when ``in_use`` is False (none configured, or the engine did not use it),
    ``'file Store in DIR'``, ``'embedded Mooncake Store'`` or ``'Mooncake Store at HOST:PORT'``."""
    from ..pytorch.store.open_backend import describe_store
    return describe_store(cfg) if in_use else 'no Store'
