"""User-facing configuration and response types.

``PytorchEngineConfig`` and ``GenerationConfig`` are pydantic models: a bad value raises a
``ValueError`` (pydantic's ``ValidationError`` subclasses it) whose message names the field.
Every engine field has a CLI flag of the same name in kebab case.
"""
from __future__ import annotations

import ipaddress
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ['PytorchEngineConfig', 'SpeculativeConfig', 'GenerationConfig', 'StructuredOutput', 'ToolSchema', 'Response']

MOONCAKE_MIN_SEGMENT = 16 << 20   # bytes; Mooncake 0.3.13 refuses a smaller memory segment


def _scalar_types(annotation) -> set:
    """The plain types a field annotation admits (``int | None`` -> {int, NoneType})."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {t for a in typing.get_args(annotation) for t in _scalar_types(a)}
    if typing.get_origin(annotation) is Annotated:
        return _scalar_types(typing.get_args(annotation)[0])
    return {annotation}


def _no_lax_scalar(model: type[BaseModel], value, name: str):
    """Refuse what pydantic's lax mode would silently convert for a bool, int or float field:
    a bool field takes only True/False (numpy's bool too; not 1, 'yes'), an integer field no
    bool, float or string (2.0 is not taken for 2), a number field no bool and no string."""
    admitted = _scalar_types(model.model_fields[name].annotation)
    if value is None or not admitted & {bool, int, float}:
        return value
    numpy_bool = type(value).__module__ == 'numpy' and type(value).__name__ in ('bool_', 'bool')
    if bool in admitted:
        if not isinstance(value, bool) and not numpy_bool:
            raise ValueError(f'{name} takes True or False, got {value!r}')
        return bool(value)
    if isinstance(value, (bool, str, bytes)) or numpy_bool or float not in admitted and isinstance(value, float):
        kind = 'an integer' if float not in admitted else 'a number'
        raise ValueError(f'{name} takes {kind}, got {value!r}')
    return value


def split_host_port(value: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``'host:port'`` (an IPv6 host in brackets), or None when malformed:
    a scheme, a path, spaces, an empty host, a port outside 1-65535 or an unbracketed IPv6."""
    host, sep, port = value.rpartition(':')
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith('[') and host.endswith(']'):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
        return host[1:-1], int(port)
    if not host or not host.isascii() or any(c in host for c in ':/@[] \t\r\n'):
        return None
    return host, int(port)


METHOD_ALIASES = {'qwen3_next_mtp': 'mtp'}   # speculative_config.method alias -> canonical name


class SpeculativeConfig(BaseModel):
    """Speculative decoding (docs/en/advance/spec_decoding.md).

    Each decode step the target model scores the last token plus ``num_speculative_tokens``
    drafted tokens in one forward and keeps the longest prefix it agrees with, plus one token of
    its own; outputs are those of plain decoding (greedy: token for token; sampling: the same
    distribution).
    """
    model_config = ConfigDict(extra='forbid', validate_assignment=True)

    method: Literal['mtp', 'qwen3_next_mtp', 'ngram'] = Field(
        description='Draft source: mtp = the checkpoint\'s own multi-token-prediction head (Qwen3-Next / '
        'Qwen3.5-MoE mtp.*, GLM-5.3-Flash NextN layer; qwen3_next_mtp is accepted as an alias and read back as '
        'mtp) or ngram = n-gram prompt lookup in the sequence\'s own tokens.')
    num_speculative_tokens: int = Field(3, ge=1, le=16, description='Draft tokens K verified per decode step.')
    ngram_min: int = Field(1, ge=1, description='Shortest suffix n-gram looked up (method ngram).')
    ngram_max: int = Field(4, ge=1, description='Longest suffix n-gram looked up (method ngram); the longest '
                           'match wins.')

    @field_validator('*', mode='before')
    @classmethod
    def _strict_scalars(cls, v, info: ValidationInfo):
        return _no_lax_scalar(cls, v, info.field_name)

    @field_validator('method', mode='after')
    @classmethod
    def _canonical_method(cls, v: str) -> str:
        # one name inside the engine: the older qwen3_next_mtp is an alias of mtp (every family's own head)
        return METHOD_ALIASES.get(v, v)

    @model_validator(mode='after')
    def _ngram_range(self):
        if self.ngram_min > self.ngram_max:
            raise ValueError(f'ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})')
        return self


class PytorchEngineConfig(BaseModel):
    """Engine configuration (terms and defaults: docs/en/advance/prefix_caching.md).

    Units: token counts are tokens, sizes are bytes.
    """
    model_config = ConfigDict(extra='forbid', validate_assignment=True)

    dtype: Literal['auto', 'float32', 'float16', 'bfloat16'] = Field(
        'auto', description='Weight/activation dtype; auto = the checkpoint\'s torch_dtype.')
    device_type: Literal['auto', 'cpu', 'cuda'] = Field('auto', description='auto = cuda if available, else cpu.')
    session_len: int | None = Field(None, ge=1, description='Longest sequence (prompt + output) in tokens; '
                                    'default: the model\'s max_position_embeddings.')
    tp: int = Field(1, ge=1, description='Tensor-parallel size: the model is split over this many processes (one '
                    'per GPU on CUDA, gloo on CPU); rank 0 is the engine process (docs/en/advance/parallelism.md).')
    max_batch_size: int = Field(16, ge=1, description='Most sequences running at once.')
    block_size: int = Field(64, ge=1, description='Tokens per KV block (B); the prefix-cache identity unit.')
    cache_max_entry_count: float = Field(0.8, gt=0, le=1, description='Fraction of free device memory (CUDA) or '
                                         'of a 4 GiB budget (CPU) given to KV blocks and state slots.')
    num_gpu_blocks: int = Field(0, ge=0, description='Explicit number of KV blocks; 0 = derive from '
                                'cache_max_entry_count.')
    max_prefill_token_num: int = Field(8192, ge=1, description='Most tokens one prefill chunk may hold (P).')
    enable_prefix_caching: bool = Field(False, description='Reuse cached prefixes (local block trie).')
    prefill_save_alignment: int = Field(1024, ge=1, description='Checkpoint boundaries are multiples of this (A); '
                                        'a positive multiple of block_size.')
    prefill_save_last_only: bool = Field(False, description='Save one checkpoint per input turn, at the last '
                                         'reusable aligned boundary (hybrid models, and the markers of global + '
                                         'sliding-window models without state).')
    decode_save_last: bool = Field(False, description='When a request finishes, save one more checkpoint at the '
                                   'last block boundary of prompt + reply (hybrid models, or a marker of a global + '
                                   'sliding-window model without state; prefix caching on), so the next turn of a '
                                   'conversation restores past the reply.')
    save_junction: bool = Field(False, description='When a request\'s blocks match the cache deeper than its '
                                'restorable checkpoint (a branch point), save one checkpoint at the deepest '
                                'aligned boundary before the branch point (hybrid models, prefix caching on).')
    num_state_slots: int = Field(0, ge=0, description='Runtime recurrent-state slots; 0 = max_batch_size.')
    num_checkpoint_slots: int | None = Field(None, ge=0, description='Most recurrent-state checkpoints the prefix '
                                             'cache holds (hybrid models); None = as many as the memory budget '
                                             'allows (checkpoints and KV blocks share it), or 64 with an explicit '
                                             'num_gpu_blocks. A save with none free is skipped and counted.')
    cache_bytes: int = Field(0, ge=0, description='Explicit byte budget of the caches (KV blocks, checkpoints and '
                             'runtime state slots); 0 = cache_max_entry_count of free memory.')
    host_cache_bytes: int = Field(0, ge=0, description='Bytes of host memory for checkpoints and KV blocks the '
                                  'device cache evicts (hybrid models, prefix caching on); promoted back on a '
                                  'hit before the Store is asked. 0 = no host tier.')
    cache_eviction: Literal['reuse', 'lru'] = Field('reuse', description='Which cached checkpoint goes first under '
                                                    'memory pressure: "reuse" (prefill saved per byte held, weighted '
                                                    'by evidence of reuse; blocks no checkpoint makes usable go '
                                                    'first) or "lru" (least recently used).')
    mooncake_master: str | None = Field(None, description='Mooncake master "host:port", or "local" to start an '
                                        'embedded master and segment; None disables the Store.')
    mooncake_metadata_server: str | None = Field(None, description='Mooncake metadata server URL, e.g. '
                                                 'http://HOST:PORT/metadata of the Store\'s HTTP metadata server '
                                                 '(lmdeploy.pytorch.store.metadata_server); required with an '
                                                 'external master.')
    mooncake_protocol: Literal['tcp', 'rdma'] = Field('tcp', description='Mooncake transfer protocol.')
    mooncake_segment_size: int = Field(0, ge=0, description='Bytes of memory this engine contributes to the '
                                       'Store: 0 (another process owns the segment) or at least 16 MiB.')
    mooncake_local_buffer_size: int = Field(0, ge=0, description='Bytes of the local transfer buffer; it must '
                                            'carry the largest Store object (checked at engine startup). 0 = auto: '
                                            'the larger of 64 MiB and what the largest object needs.')
    mooncake_embedded_segment_size: int = Field(512 << 20, ge=MOONCAKE_MIN_SEGMENT, description='Bytes of the '
                                                'segment the embedded mode (mooncake_master="local") starts '
                                                '(at least 16 MiB).')
    store_backend: str | None = Field(None, description='Where Store objects live: "mooncake" (the default: '
                                      'the Mooncake Store named by mooncake_master) or "file:DIR" (a local folder '
                                      'that keeps checkpoints across restarts without a Mooncake master; '
                                      'atomic writes, LRU eviction beyond store_file_max_bytes).')
    store_file_max_bytes: int = Field(32 << 30, ge=0, description='Most bytes of objects a "file:DIR" Store '
                                      'backend keeps; the least recently used are removed beyond it. 0 = no '
                                      'limit.')
    store_queue_size: int = Field(64, ge=1, description='Bounded queue of pending Store saves; a save that finds '
                                  'it full is dropped and counted (store_dropped_puts), never waited for.')
    store_writers: int = Field(4, ge=1, le=64, description='Threads putting Store objects in parallel.')
    store_timeout_s: float = Field(0.5, gt=0, le=60, allow_inf_nan=False, description='Deadline in seconds of '
                                   'each Store call the engine thread makes (existence queries; an object read '
                                   'gets 1 s more per 100 MB): a call past it is a miss, and the engine skips the '
                                   'Store until a background check finds it answering again (every 5 s).')
    store_namespace: str | None = Field(None, min_length=1, max_length=256, pattern=r'^[\x21-\x7e]+$',
                                        description='Operator-managed model identity for the Store namespace '
                                        '(printable ASCII, no spaces); replaces hashing config.json and every '
                                        'weight byte. Dtype, block size, layer layout and the secret still join '
                                        'the namespace (the TP size never does: objects hold all heads). None = derive it from the model files.')
    store_secret_file: str | None = Field(None, description='File holding the Store secret (at least 16 bytes) that '
                                          'keys every object\'s HMAC; default: the LMDEPLOY_STORE_SECRET variable; '
                                          'none: objects are unauthenticated (mooncake_master="local" then makes a '
                                          'per-run secret).')
    kv_events_endpoint: str | None = Field(None, description='tcp://HOST:PORT to bind a ZMQ PUB socket to that '
                                           'publishes, in vLLM\'s KV event format, the prefixes this engine can '
                                           'restore (for KV-aware routers; prefix caching on; HOST * = every '
                                           'interface). None = no events.')
    kv_events_replay_endpoint: str | None = Field(None, description='tcp://HOST:PORT to bind the replay ROUTER '
                                                  'socket to: a router that (re)starts asks for the buffered '
                                                  'event batches from a sequence number on (needs '
                                                  'kv_events_endpoint). None = no replay.')
    role: Literal['both', 'prefill', 'decode'] = Field('both', description='Prefill/decode disaggregation: '
                                                       '"prefill" computes each prompt up to its hand-off point '
                                                       'and puts it through the Store (no token is sampled); '
                                                       '"decode" restores a hand-off from the Store and decodes; '
                                                       '"both" serves colocated (docs/en/advance/'
                                                       'pd_disaggregation.md). prefill/decode need a Store and '
                                                       'enable_prefix_caching.')
    eager_mode: bool = Field(False, description='Run every forward eagerly: no decode graphs (on the CPU at tp=1 '
                             'a pure decode step of a batch layout seen before replays its recorded kernels '
                             'instead of running the model\'s Python; the results are bit for bit the same; on '
                             'CUDA at tp=1 it replays the CUDA graph captured for its batch bucket, padding rows '
                             'included: not yet validated on a GPU).')
    speculative_config: SpeculativeConfig | None = Field(None, description='Speculative decoding; None = off. '
                                                         'CLI: --speculative-algorithm, '
                                                         '--speculative-num-draft-tokens.')

    @field_validator('*', mode='before')
    @classmethod
    def _strict_scalars(cls, v, info: ValidationInfo):
        return _no_lax_scalar(cls, v, info.field_name)

    @field_validator('mooncake_master')
    @classmethod
    def _master_address(cls, v: str | None) -> str | None:
        if v is None or v == 'local':
            return v
        if split_host_port(v) is None:
            raise ValueError(f'mooncake_master must be "host:port" (no scheme; port 1-65535; an IPv6 host in '
                             f'brackets) or "local" (lower case: start an embedded Store), got {v!r}')
        return v

    @field_validator('mooncake_metadata_server')
    @classmethod
    def _metadata_url(cls, v: str | None) -> str | None:
        # what Mooncake's transfer engine accepts: an HTTP metadata server, etcd (with or without
        # the scheme), redis, or peer-to-peer handshake. Anything else it retries for ~30 s before
        # failing with a bare code, or (an upper-case scheme) aborts the process, so it is refused
        # here; a scheme is taken in any case and written in lower case.
        if v is None or v == 'P2PHANDSHAKE':
            return v
        scheme, sep, rest = v.partition('://')
        scheme = scheme.lower() if sep else ''
        ok = v.isascii() and not any(c.isspace() for c in v)
        if ok and scheme in ('http', 'https'):
            url = urlsplit(f'{scheme}://{rest}')
            try:
                ok = bool(url.hostname) and (url.port is None or 0 < url.port < 65536) and url.path not in ('', '/')
            except ValueError:
                ok = False
        elif ok and scheme in ('etcd', 'redis'):
            ok = split_host_port(rest) is not None
        elif ok and not sep:
            ok = split_host_port(v) is not None                       # a bare etcd endpoint
        else:
            ok = False
        if not ok:
            head = v.split('/', 1)[0]
            hint = f' (did you mean http://{v}?)' if not sep and '/' in v and split_host_port(head) else ''
            raise ValueError(f'mooncake_metadata_server must be the URL of the Store\'s HTTP metadata server, '
                             f'http://HOST:PORT/metadata with its path (`lmdeploy serve store` prints it), or '
                             f'etcd://HOST:PORT, redis://HOST:PORT, a bare etcd HOST:PORT or P2PHANDSHAKE; got '
                             f'{v!r}{hint}')
        return f'{scheme}://{rest}' if sep else v

    @field_validator('kv_events_endpoint', 'kv_events_replay_endpoint')
    @classmethod
    def _zmq_tcp_endpoint(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        scheme, sep, rest = v.partition('://')
        if scheme != 'tcp' or not sep or split_host_port(rest) is None:
            raise ValueError(f'{info.field_name} must be tcp://HOST:PORT (HOST an address of this machine or *; '
                             f'port 1-65535), got {v!r}')
        return v

    @model_validator(mode='after')
    def _kv_events_wiring(self):
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError('kv_events_replay_endpoint needs kv_events_endpoint (the stream it replays)')
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise ValueError('kv_events_endpoint needs enable_prefix_caching: without a prefix cache no prefix '
                             'is restorable, so there is nothing to announce')
        if self.kv_events_replay_endpoint is not None and self.kv_events_replay_endpoint == self.kv_events_endpoint:
            raise ValueError(f'kv_events_replay_endpoint must differ from kv_events_endpoint '
                             f'({self.kv_events_endpoint!r}): two sockets cannot bind one port')
        return self

    @field_validator('mooncake_segment_size')
    @classmethod
    def _segment_zero_or_large(cls, v: int) -> int:
        # Mooncake 0.3.13 refuses a segment below 16 MiB (setup returns -600)
        if 0 < v < MOONCAKE_MIN_SEGMENT:
            raise ValueError(f'mooncake_segment_size must be 0 or at least {MOONCAKE_MIN_SEGMENT} bytes (16 MiB), '
                             f'got {v}')
        return v

    @model_validator(mode='after')
    def _alignment_multiple_of_block(self):
        if self.prefill_save_alignment % self.block_size != 0:
            raise ValueError(f'prefill_save_alignment ({self.prefill_save_alignment}) must be a positive multiple '
                             f'of block_size ({self.block_size})')
        return self

    @field_validator('store_backend')
    @classmethod
    def _store_backend_form(cls, value):
        if value is None or value == 'mooncake' or (value.startswith('file:') and value[5:].strip()):
            return value
        raise ValueError(f'store_backend must be "mooncake" or "file:DIR" (a folder), got {value!r}')

    @model_validator(mode='after')
    def _file_store_excludes_mooncake(self):
        if self.store_backend and self.store_backend.startswith('file:') and self.mooncake_master is not None:
            raise ValueError(f'store_backend={self.store_backend!r} and mooncake_master={self.mooncake_master!r} '
                             f'name two Stores: give one of them')
        return self

    @model_validator(mode='after')
    def _role_needs_a_store(self):
        if self.role != 'both' and not (self.store_backend or self.mooncake_master):
            raise ValueError(f'role={self.role!r} hands prompts off through the Store: give store_backend '
                             f'(e.g. file:DIR shared by both engines) or mooncake_master')
        if self.role != 'both' and not self.enable_prefix_caching:
            raise ValueError(f'role={self.role!r} needs enable_prefix_caching')
        return self

    @model_validator(mode='after')
    def _external_master_needs_metadata(self):
        # checked here, before any weight is loaded, not when the engine connects
        if self.mooncake_master not in (None, 'local') and self.mooncake_metadata_server is None:
            raise ValueError(f'mooncake_metadata_server is required with an external mooncake_master '
                             f'({self.mooncake_master!r}): the URL of the Store\'s HTTP metadata server, e.g. '
                             f'http://HOST:PORT/metadata (`lmdeploy serve store` prints both)')
        return self


class ToolSchema(BaseModel):
    """One function a constrained tool call may name (:class:`StructuredOutput`)."""
    model_config = ConfigDict(extra='forbid')

    name: str = Field(min_length=1, description='The function\'s name, written into the call.')
    parameters: dict | None = Field(None, description='JSON schema of its arguments; None = any JSON object.')


class StructuredOutput(BaseModel):
    """What the reply must be; the engine masks every token that would leave it (constrained
    decoding, docs/en/api_server.md "Structured output").

    ``type``:
        ``json_object``  any JSON object;
        ``json_schema``  a JSON document valid against ``json_schema``;
        ``tool_calls``   one or more tool calls in ``tool_format`` (``hermes``:
                         ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``;
                         ``qwen_xml``: ``<tool_call>\n<function=NAME>\n<parameter=KEY>...``),
                         each naming one of ``tools`` with arguments valid against its
                         parameters; at most one call when ``parallel_tool_calls`` is False.

    The reply ends (``'stop'``) when the grammar is complete. An invalid schema is a ValueError
    when the request is validated (:meth:`Engine.validate`).
    """
    model_config = ConfigDict(extra='forbid')

    type: Literal['json_object', 'json_schema', 'tool_calls']
    json_schema: dict | None = Field(None, description='The schema (type json_schema).')
    strict: bool = Field(True, description='json_schema: objects take only the properties the schema lists '
                         'unless it says otherwise (additionalProperties).')
    tools: list[ToolSchema] = Field(default_factory=list, description='type tool_calls: the callable functions '
                                    '(one for a named tool_choice).')
    tool_format: str = Field('hermes', description='type tool_calls: the call syntax (a name registered in '
                             'lmdeploy.pytorch.engine.guided.TOOL_CALL_FORMATS).')
    parallel_tool_calls: bool = Field(True, description='type tool_calls: False = exactly one call.')
    prefix: str = Field('', description='Text at the end of the prompt that the constrained reply continues '
                        '(e.g. a forced tool call\'s opening the server wrote into the prompt); the grammar '
                        'starts after it. It must be a prefix of what the grammar admits.')

    @model_validator(mode='after')
    def _fields_of_type(self):
        if self.type == 'json_schema' and self.json_schema is None:
            raise ValueError('structured_output of type json_schema needs json_schema')
        if self.type == 'tool_calls' and not self.tools:
            raise ValueError('structured_output of type tool_calls needs at least one entry in tools')
        return self


class GenerationConfig(BaseModel):
    """Per-request sampling and stopping options."""
    model_config = ConfigDict(extra='forbid', validate_assignment=True)

    max_new_tokens: int = Field(512, ge=0, description='Most tokens to generate.')
    do_sample: bool = Field(False, description='Sample; False = greedy.')
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description='Softmax temperature; 0 = greedy.')
    top_p: float = Field(1.0, gt=0, le=1, description='Nucleus sampling mass.')
    top_k: int = Field(0, ge=0, le=(1 << 31) - 1, description='Keep the k most likely tokens; 0 = all.')
    repetition_penalty: float = Field(1.0, ge=0.01, le=100, allow_inf_nan=False, description='CTRL-style penalty '
                                      'on seen tokens (0.01-100, the API server\'s range; 1.0 = off): beyond it the '
                                      'scaled logits overflow float32.')
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False, description='Subtracted from the '
                                    'logit of every token the reply has generated so far (OpenAI\'s definition; '
                                    '-2 to 2, 0 = off).')
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False, description='Times the number of '
                                     'times a token was generated in the reply so far, subtracted from its logit '
                                     '(OpenAI\'s definition; -2 to 2, 0 = off).')
    logit_bias: dict[int, float] = Field(default_factory=dict, description='Token id -> bias added to its logit '
                                         'before sampling or argmax (-100 to 100; OpenAI\'s logit_bias: -100 in '
                                         'effect bans a token, 100 forces it). Ids inside the vocabulary.')
    stop_words: list[str] = Field(default_factory=list, description='Stop strings; the text ends before them.')
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, description='Extra token ids '
                                                              'that end generation (inside the vocabulary).')
    ignore_eos: bool = Field(False, description='Do not stop at the model\'s EOS tokens.')
    random_seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1, description='Per-request sampling seed '
                                    '(same seed, same output); -2^63 to 2^64-1, the range of torch\'s generator.')
    logprobs: int | None = Field(None, ge=0, le=20, description='Return each generated token\'s log-probability '
                                 'and this many most likely alternatives (0-20); None = off.')
    min_tokens: int = Field(0, ge=0, description='EOS and stop_token_ids are masked until this many tokens were '
                            'generated (a grammar that can only end wins over it).')
    structured_output: StructuredOutput | None = Field(None, description='Constrain the reply to a JSON schema, '
                                                       'any JSON object or tool calls (grammar-masked decoding; '
                                                       'decodes without speculative drafts).')
    cache_salt: str | None = Field(None, min_length=1, max_length=1024, description='Enters the hash of the '
                                   'prompt\'s first block: requests with another salt (or none) never share a '
                                   'cached block, locally or in the Store.')
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description='Return the log-probability of every '
                                        'prompt token after the first, and this many most likely alternatives '
                                        '(0-20); the prompt is recomputed (no prefix-cache hit); None = off.')

    @field_validator('*', mode='before')
    @classmethod
    def _strict_scalars(cls, v, info: ValidationInfo):
        # True would pass as 1 and 'yes' as True (pydantic's lax mode): a field takes its own type
        if info.field_name == 'stop_token_ids' and isinstance(v, list) and any(isinstance(t, (bool, str)) for t in v):
            raise ValueError(f'stop_token_ids takes integers, got {v!r}')
        return _no_lax_scalar(cls, v, info.field_name)

    @field_validator('logit_bias', mode='before')
    @classmethod
    def _bias_entries(cls, v):
        if isinstance(v, dict):
            for token, bias in v.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f'logit_bias keys are token ids (integers >= 0), got {token!r}')
                if isinstance(bias, (bool, str)) or not isinstance(bias, (int, float)) \
                        or not -100 <= bias <= 100:          # (NaN fails the comparison too)
                    raise ValueError(f'logit_bias values are numbers from -100 to 100, got {bias!r} for {token}')
        return v

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return not self.do_sample or self.temperature == 0 or self.top_k == 1


@dataclass
class Response:
    """One request's result (or a streaming delta).

    Attributes:
        text: generated text (the delta when streaming).
        token_ids: generated token ids (the delta when streaming).
        input_token_len: prompt tokens.
        generate_token_len: generated tokens so far.
        finish_reason: ``'stop'``, ``'length'``, ``'abort'``, ``'error'`` (an engine step failed; the
            engine logged it and keeps serving), or None while running.
        cached_tokens: prompt tokens served from the prefix cache or the Store.
        index: the prompt's position in a batch call.
        logprobs: one :class:`~lmdeploy.pytorch.sampling.sampler.TokenLogprob` per token of
            ``token_ids`` when ``GenerationConfig.logprobs`` was set, else None.
        prompt_logprobs: with ``GenerationConfig.prompt_logprobs``, one ``TokenLogprob`` per
            prompt token after the first (in the first delta when streaming), else None.
        stop_token_id: the end-of-sequence or stop token that ended the reply (it is not in
            ``token_ids``), else None.
        handoff_id: on a ``role='prefill'`` engine, the Store key of the request's hand-off once
            the Store holds it (``finish_reason`` ``'handoff'``; docs/en/advance/pd_disaggregation.md),
            else None.
    """
    text: str = ''
    token_ids: list[int] = field(default_factory=list)
    input_token_len: int = 0
    generate_token_len: int = 0
    finish_reason: str | None = None
    cached_tokens: int = 0
    index: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_token_id: int | None = None
    handoff_id: str | None = None
