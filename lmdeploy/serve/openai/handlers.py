"""The request handlers shared by every endpoint: API keys, the model name, prompt encoding,
per-choice generation configs, chat planning (template, tools, images, constraints), and the
small endpoints (models, health, metrics, ledger).

Chat-template rendering, tokenization and request checks run in worker threads (the ``_plan_*``
and ``_jobs`` methods say "worker thread"), so one huge prompt never stalls other clients or
``/health``. The chat and completions endpoints are in :mod:`.chat_route` and
:mod:`.completions_route`; :class:`~.api_server.Server` joins them.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ...messages import GenerationConfig
from ...metrics import ServerMetrics
from ...pytorch.engine.requests import CheckedRequest, RequestError
from ..images import ImageFetchLimits, chat_part, fetch_http_images
from .chat_output import ChatOutput, TokenTexts
from .defaults import DEFAULT_SHUTDOWN_TIMEOUT
from .errors import APIError, located_error
from .generation import shutting_down
from .lifecycle import Drain
from .protocol import ChatCompletionRequest, DecodedInts, ModelCard, ModelList, NamedToolChoice
from .reasoning_parser import get_reasoning_parser
from .structured import from_response_format, from_tool_choice, grammar_tool_format
from .tool_parser import detect_tool_format, get_tool_parser

__all__ = ['ServerBase', 'MessageNames', 'served_names', 'current_tenant', 'tenant_of']


@dataclass(frozen=True)
class MessageNames:
    """How the client of a chat request names its messages and image parts, for errors.

    ``/v1/responses`` and ``/v1/messages`` are translated into chat messages; an error about a
    chat message must name the field the client sent, not the chat one.

    Args:
        param: the request field holding the messages (``messages``; Responses: ``input``).
        images: the client's name of image parts (``image_url parts``; Responses:
            ``input_image parts``; Messages: ``image blocks``).
        parts: ``(chat message index, chat part index) -> the client's location`` of each image
            part (e.g. ``input[2].content[1]``); a part not in it is named in chat terms.
        tool_schemas: per chat tool, the client's location of its parameters schema (Responses:
            ``tools[i].parameters``; Messages: ``tools[i].input_schema``); a tool past its end is
            named in chat terms (``tools[i].function.parameters``).
    """
    param: str = 'messages'
    images: str = 'image_url parts'
    parts: Mapping[tuple[int, int], str] = field(default_factory=dict)
    tool_schemas: tuple[str, ...] = ()

    def where(self, i: int, j: int) -> str:
        """The client's location of part ``j`` of chat message ``i``."""
        return self.parts.get((i, j)) or chat_part(i, j)

    def tool_schema(self, i: int) -> str:
        """The client's location of chat tool ``i``'s parameters schema."""
        return self.tool_schemas[i] if i < len(self.tool_schemas) else f'tools[{i}].function.parameters'


_CHAT_NAMES = MessageNames()


def served_names(model_name: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The served model names, in order, without repeats.

    Raises:
        ValueError: no name, or an empty or non-string one (names ``model_name``).
    """
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name or ())
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f'model_name (--model-name): one or more non-empty names, got {model_name!r}')
    return tuple(dict.fromkeys(names))

# The tenant (a digest of the API key) of the request being handled: set by ServerBase.check_key
# (a FastAPI dependency, run in the request's task before its handler); worker threads started
# with run_in_threadpool see it too (anyio copies the context into them). None without keys.
_TENANT: ContextVar[str | None] = ContextVar('lmdeploy_tenant', default=None)


def tenant_of(key: str) -> str:
    """The tenant id of an API key: 32 hex digits of a SHA-256 digest, so neither stored entries
    nor cache salts hold the key itself."""
    return hashlib.sha256(b'lmdeploy/tenant\0' + key.encode('utf-8')).hexdigest()[:32]


def current_tenant() -> str | None:
    """The tenant of the request being handled (:func:`tenant_of` its key); None without keys."""
    return _TENANT.get()


def _refused(err: RequestError, param: str, structured_param: str) -> APIError:
    """The 400 of a field the engine refused: ``param`` names the prompt (``messages``, ``prompt``,
    ``input``), ``structured_param`` the grammar's source (``response_format`` or ``tools``); the
    images are part of the messages."""
    if err.field in ('prompt', 'multimodal', 'shared_head_tokens'):
        return APIError(400, f'{param}: {err}', param=param, code='invalid_value')
    if err.field == 'structured_output':
        # the engine names its own field (structured_output.json_schema: ...); the client sent
        # structured_param, so only the reason follows it
        reason = re.sub(r'^structured_output(?:\.\w+)?: ', '', str(err))
        return APIError(400, f'{structured_param}: {reason}', param=structured_param, code='invalid_value')
    return APIError(400, str(err), param=err.field, code='invalid_value')     # the message starts with its name


def _resolve_parser(choice: str, template: str, marker: str, default: str) -> str | None:
    """``auto`` → ``default`` when the chat template mentions ``marker``; ``none`` → None."""
    if choice == 'none':
        return None
    if choice == 'auto':
        return default if marker in (template or '') else None
    return choice


@dataclass
class ChatPlan:
    """What the worker thread prepared for a chat request: its checked engine requests, one per
    choice (with the prompt's images and its shared head: tokens of the rendered system messages
    and tools, :func:`~lmdeploy.serve.pipeline.shared_head_tokens`), and per-choice output parsers."""
    jobs: list[CheckedRequest]
    outputs: list[ChatOutput]


class ServerBase:
    """Request handlers bound to one pipeline (the endpoints' shared part).

    Args:
        pipe: the pipeline.
        model_name: the served name, or several (a list): a request may name any of them as
            ``model``; replies name the first (:attr:`model_name`).
        api_keys: accepted bearer tokens (empty: no authentication).
        tool_call_parser: ``auto`` (``qwen_xml`` when the chat template writes ``<function=NAME>``
            calls, else ``hermes`` when it mentions ``<tool_call>``), ``none``, or a registered
            parser name.
        reasoning_parser: ``auto`` (``think`` when the chat template mentions ``<think>``),
            ``none``, or a registered parser name.
        shutdown_timeout: seconds in-flight requests may run after SIGTERM.
        share_prefix_cache_across_keys: with API keys, let requests of different keys share cached
            prefixes (default False: each key's requests are cache-salted with its tenant id, so
            ``cached_tokens`` never tells one key what another sent).
    """

    def __init__(self, pipe, model_name: str | list[str], api_keys: list[str] | None, tool_call_parser: str = 'auto',
                 reasoning_parser: str = 'auto', shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
                 share_prefix_cache_across_keys: bool = False):
        self.pipe = pipe
        self.share_prefix_cache_across_keys = share_prefix_cache_across_keys
        self.model_names = served_names(model_name)
        self.model_name = self.model_names[0]
        self.api_keys = [k for k in (api_keys or []) if k]
        self.metrics = ServerMetrics(lambda: pipe.stats(timeout=30), lambda: pipe.ledger(timeout=30))
        template = getattr(pipe.tokenizer, 'chat_template', None) or ''
        template = template if isinstance(template, str) else json.dumps(template)
        self.tool_parser_name = _resolve_parser(tool_call_parser, template, '<tool_call>',
                                                detect_tool_format(template) or 'hermes')
        self.reasoning_parser_name = _resolve_parser(reasoning_parser, template, '<think>', 'think')
        if self.tool_parser_name:           # an unknown name fails now, not at the first request
            get_tool_parser(self.tool_parser_name)
        if self.reasoning_parser_name:
            get_reasoning_parser(self.reasoning_parser_name)
        self.texts = TokenTexts(pipe.tokenizer)
        self.drain = Drain(shutdown_timeout)
        self.image_fetch = ImageFetchLimits()     # http(s) image_url parts: size and time limits

    # request checks ---------------------------------------------------------------------
    async def check_key(self, request: Request) -> None:
        """FastAPI dependency: 503 once shutting down; 401 unless the bearer token is one of the
        keys (when keys are set); then the request's tenant (:func:`current_tenant`) is its key's.
        (async: the tenant is set in the request's own task, where its handler runs.)"""
        if self.drain.draining:
            raise shutting_down()
        if not self.api_keys:
            return
        anthropic = request.headers.get('x-api-key')        # Anthropic clients send the key this way
        key = self._matched_key(request.headers.get('authorization', ''))
        if key is None and anthropic:
            key = self._matched_key('Bearer ' + anthropic)
        if key is None:
            raise APIError(401, 'missing or invalid API key: send "Authorization: Bearer <key>" (or "x-api-key: '
                           '<key>")', code='invalid_api_key')
        _TENANT.set(tenant_of(key))

    def key_valid(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (always True without
        keys); compared in constant time."""
        return not self.api_keys or self._matched_key(authorization) is not None

    def _matched_key(self, authorization: str) -> str | None:
        """The key an ``Authorization`` header value carries, or None; every key is compared (in
        constant time), so timing tells nothing of which one matched."""
        scheme, _, token = authorization.partition(' ')
        token = token.strip().encode()
        found = None
        for k in self.api_keys:
            if hmac.compare_digest(token, k.encode()) and scheme.lower() == 'bearer':
                found = k
        return found

    def cache_salt(self, salt: str | None) -> str | None:
        """The engine ``cache_salt`` of a request that sent ``salt`` (None: none): with API keys
        (and without ``share_prefix_cache_across_keys``) the tenant's id enters it, so requests of
        different keys never share a cached block (locally or in the Store); same key, same
        salt, same prefix: shared as before."""
        tenant = current_tenant()
        if tenant is None or self.share_prefix_cache_across_keys:
            return salt
        if salt is None:
            return f'tenant:{tenant}'
        # a digest keeps the combined salt within the engine's length bound whatever the client sent
        return 'tenant:' + hashlib.sha256(f'{tenant}\0{salt}'.encode('utf-8')).hexdigest()

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            served = ', '.join(repr(n) for n in self.model_names)
            raise APIError(404, f'the model {name!r} does not exist; this server serves {served} (start it with '
                           '--model-name NAME [NAME ...] to serve more names)', param='model', code='model_not_found')

    def _encode(self, prompt, param: str) -> list[int]:
        """Raw token ids of a completions prompt (worker thread)."""
        if type(prompt) is DecodedInts:     # a non-empty int array (large-body decoder, validation):
            return list(prompt)             # no Python pass over a million ids contending for the GIL
        try:
            return self.pipe.encode(prompt, do_preprocess=False)
        except Exception as err:   # ValueError, or the tokenizer refusing the text
            raise APIError(400, f'{param}: {err}', param=param, code='invalid_value') from err

    def _jobs(self, req, prompts_ids: list[list[int]], max_new: int | None, param: str, logprobs: int | None,
              structured=None, structured_param: str = 'response_format', prompt_logprobs: int | None = None,
              multimodal: tuple = (), shared_head: int | None = None) -> list[CheckedRequest]:
        """One checked :class:`~lmdeploy.pytorch.engine.requests.CheckedRequest` per choice (worker
        thread), prompt-major; 400 naming the field the engine refuses. Each prompt is checked
        once: its ``n`` choices differ only in their seed. ``max_new`` is clamped to what the
        session has left after the prompt. ``structured``: the
        :class:`~lmdeploy.messages.StructuredOutput` of the request (an invalid schema is a 400
        naming ``structured_param``). ``multimodal``, ``shared_head``: the (one) chat prompt's
        images and shared head."""
        session_len = self.pipe.session_len
        bias = req.token_bias()
        jobs = []
        for ids in prompts_ids:
            room = max(0, session_len - len(ids))
            try:
                cfg = GenerationConfig(
                    max_new_tokens=room if max_new is None else min(max_new, room),
                    do_sample=bool(req.temperature), temperature=req.temperature if req.temperature else 1.0,
                    top_p=req.top_p, top_k=max(req.top_k, 0), repetition_penalty=req.repetition_penalty,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=bias,
                    stop_words=req.stop_words(), ignore_eos=req.ignore_eos, logprobs=logprobs,
                    min_tokens=req.min_tokens, structured_output=structured, cache_salt=self.cache_salt(req.cache_salt),
                    prompt_logprobs=prompt_logprobs)
                request = self.pipe.check(ids, cfg, multimodal, shared_head)
            except RequestError as err:
                raise _refused(err, param, structured_param) from err
            except ValidationError as err:      # an option GenerationConfig refuses: named by its field
                field = str(err.errors()[0]['loc'][0]) if err.errors() and err.errors()[0]['loc'] else 'messages'
                raise APIError(400, str(err), param=field, code='invalid_value') from err
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % (1 << 64)   # torch's 64-bit seed space
                jobs.append(request.choice(seed))
        return jobs

    def plan_chat(self, req: ChatCompletionRequest, names: MessageNames = _CHAT_NAMES) -> ChatPlan:
        """Render, tokenize and check a chat request (worker thread).

        Args:
            names: how the client names the messages and image parts (a translated request).

        Raises:
            APIError: 400 for a request the chat path refuses (an image part to a model without
                image support names the part by ``names``; a tool's parameters schema that
                constrained decoding cannot use names that schema by ``names``, whatever
                ``tool_choice`` says).
        """
        self._check_tool_schemas(req, names)
        use_tools = bool(req.tools) and req.tool_choice != 'none'
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
        parser = get_tool_parser(self.tool_parser_name, tools) if use_tools and self.tool_parser_name else None
        prefix = ''
        structured, structured_param = self._structured(req.response_format), 'response_format'
        forced = use_tools and (req.tool_choice == 'required' or isinstance(req.tool_choice, NamedToolChoice))
        tool_format = grammar_tool_format(self.tool_parser_name) if forced else None
        if forced and structured is not None:
            raise APIError(400, 'response_format: cannot be combined with a tool_choice that forces a call',
                           param='response_format', code='invalid_value')
        if tool_format is not None:       # the grammar writes the call; its parser reads it back
            parser = get_tool_parser(self.tool_parser_name or 'hermes')
        if parser is not None and req.tool_choice == 'required':
            prefix = parser.forced_prefix(None)
        elif parser is not None and isinstance(req.tool_choice, NamedToolChoice):
            prefix = parser.forced_prefix(req.tool_choice.function.name)
        if tool_format is not None:
            # the opening goes into the prompt (it re-tokenizes as the history will); the grammar
            # continues after it
            structured = from_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format)
            structured = structured.model_copy(update={'prefix': prefix})
            structured_param = 'tools'
            self._check_grammar(structured, 'tools')     # before the tools are rendered into the prompt
        messages = [m.for_template() for m in req.messages]
        if self.tool_parser_name:       # history calls as this format's template wants them
            history = parser or get_tool_parser(self.tool_parser_name)
            messages = [history.history_message(m) for m in messages]
        images = ()
        try:
            if any(m.has_images() for m in req.messages):
                if not self.pipe.accepts_images:
                    i, j = next((i, j) for i, m in enumerate(req.messages) if m.has_images()
                                for j, p in enumerate(m.content) if p.type == 'image_url')
                    raise APIError(400, f'{names.where(i, j)}: model {self.model_name!r} does not accept '
                                   f'{names.images}', param=names.where(i, j), code='invalid_value')
                text, pil = self.pipe.render_with_images(fetch_http_images(messages, self.image_fetch, names.where),
                                                         tools, req.chat_template_kwargs, names.where)
                wheres = [names.where(i, j) for i, m in enumerate(messages)
                          if isinstance(m.get('content'), list)
                          for j, p in enumerate(m['content']) if p.get('type') == 'image_url']
                ids, images = self.pipe.expand_images(text + prefix, pil, wheres)
            else:
                text = self.pipe.render(messages, tools, req.chat_template_kwargs)
                if structured is not None and text.rstrip().endswith('<think>'):
                    # the template opened a reasoning block: close it empty, so that the grammar's
                    # output is the reply itself (constrained replies have no reasoning)
                    text += '\n\n</think>\n\n'
                ids = self.pipe.tokenize(text + prefix)
        except ValueError as err:
            raise located_error(str(err), names.param) from err
        # where every session of this agent still sends the same tokens (system prompt + tools)
        shared_head = self.pipe.shared_head(messages, ids, tools, req.chat_template_kwargs)
        reasoning = None
        if self.reasoning_parser_name and req.separate_reasoning:
            reasoning = get_reasoning_parser(self.reasoning_parser_name)
        # the prompt ends inside an open <think>: also when reasoning is not split out (the
        # tool-call parser must skip it either way)
        started = not prefix and text.rstrip().endswith('<think>')
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        jobs = self._jobs(req, [ids], req.max_new(), 'messages', logprobs, structured, structured_param,
                          req.prompt_logprobs, images, shared_head)
        outputs = [ChatOutput(reasoning, started, parser, prefix, req.parallel_tool_calls) for _ in jobs]
        return ChatPlan(jobs, outputs)

    @staticmethod
    def _structured(response_format):
        """The engine constraint of a ``response_format`` (None for text); 400 naming it."""
        try:
            structured = from_response_format(response_format)
        except ValueError as err:
            raise APIError(400, f'response_format: {err}', param='response_format', code='invalid_value') from err
        return ServerBase._check_grammar(structured, 'response_format')

    def _check_tool_schemas(self, req: ChatCompletionRequest, names: MessageNames) -> None:
        """A 400 naming the first tool whose parameters the server's constrained decoding could
        not use (:func:`~lmdeploy.pytorch.engine.guided.check_tool_parameters`, in the tool-call
        format a forced call of this server would take)."""
        if not req.tools:
            return
        from ...pytorch.engine.guided import check_tool_parameters
        tool_format = grammar_tool_format(self.tool_parser_name)
        for i, tool in enumerate(req.tools):
            try:
                check_tool_parameters(tool.function.parameters, tool_format)
            except ValueError as err:
                where = names.tool_schema(i)
                raise APIError(400, f'{where}: {err}', param=where, code='invalid_value') from err

    @staticmethod
    def _check_grammar(structured, param: str):
        """``structured`` when its grammar is within the size limits
        (:func:`~lmdeploy.pytorch.engine.guided.check_grammar_limits`), else a 400 naming ``param``;
        checked before any rendering, tokenizing or compiling."""
        if structured is not None:
            from ...pytorch.engine.guided import check_grammar_limits
            try:
                check_grammar_limits(structured)
            except ValueError as err:
                raise APIError(400, f'{param}: {err}', param=param, code='invalid_value') from err
        return structured

    # endpoints ------------------------------------------------------------------------------
    def _card(self, name: str) -> ModelCard:
        root = os.path.basename(os.path.normpath(getattr(self.pipe, 'model_path', '') or '')) or self.model_name
        return ModelCard(id=name, root=root, max_model_len=self.pipe.session_len)

    async def models(self) -> dict:
        """``GET /v1/models``: one card per served name, the first first."""
        return ModelList(data=[self._card(name) for name in self.model_names]).model_dump()

    async def model(self, model_id: str) -> dict:
        """``GET /v1/models/{model_id}``: the card of a served name, or 404 naming the id."""
        self.check_model(model_id)
        return self._card(model_id).model_dump()
    async def health(self):
        if self.drain.draining:
            raise shutting_down()
        return {'status': 'ok'}

    def prometheus(self) -> Response:
        # a plain def: FastAPI runs it in a worker thread, since reading engine stats waits for a step
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def ledger(self) -> dict:
        return await run_in_threadpool(self.pipe.ledger)
