"""Opening the Store backend an engine config names, by its scheme.

One registry maps a scheme to how its backend is opened and how the startup line names it::

    store_backend='file:DIR'                  ─▶ 'file'      FileStore over DIR
    mooncake_master='local' | 'HOST:PORT'     ─▶ 'mooncake'  embedded services + StoreClient, or an
                                                             external master's StoreClient
    neither                                   ─▶ None        no Store

The prefix cache's Store tier is handed the :class:`OpenedStore` (the backend, the secret its
objects are keyed with, and any embedded services it must stop) and never looks at the scheme;
a new backend is one :func:`register_scheme` call, with no branch elsewhere.
"""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from typing import Callable

from .backend import StoreBackend
from .identity import resolve_secret
from .mooncake_client import StoreClient, buffer_bytes_needed
from .object_format import OBJECT_OVERHEAD

__all__ = ['OpenedStore', 'describe_store', 'open_store', 'register_scheme', 'store_scheme']

logger = logging.getLogger('lmdeploy')


@dataclass
class OpenedStore:
    """A Store backend ready for the tier.

    Attributes:
        backend: the open :class:`~.backend.StoreBackend`.
        secret: the key of every object's MAC (None: unauthenticated objects).
        services: embedded Mooncake services the tier stops on close, or None.
        description: the startup line's Store part (:func:`describe_store`).
    """
    backend: StoreBackend
    secret: bytes | None
    services: object = None
    description: str = ''

    def close(self) -> None:
        """Close the backend and stop the embedded services (the tier was not built)."""
        self.backend.close()
        if self.services is not None:
            self.services.stop()


@dataclass(frozen=True)
class _Scheme:
    open: Callable[..., OpenedStore]        # (cfg, state_bytes, kv_block_bytes) -> OpenedStore
    describe: Callable[..., str]            # (cfg) -> the startup line's Store part


_SCHEMES: dict[str, _Scheme] = {}


def register_scheme(name: str, open_fn: Callable[..., OpenedStore], describe_fn: Callable[..., str]) -> None:
    """Register how the backend of scheme ``name`` is opened (``open_fn(cfg, state_bytes,
    kv_block_bytes)``: an :class:`OpenedStore`, raising ``ValueError`` for a bad config) and named
    on the startup line (``describe_fn(cfg)``). A name registered again is replaced."""
    _SCHEMES[name] = _Scheme(open_fn, describe_fn)


def store_scheme(cfg) -> str | None:
    """The scheme of the Store an engine config (``PytorchEngineConfig``) names: ``'file'`` for
    ``store_backend='file:DIR'``, ``'mooncake'`` when ``mooncake_master`` is set, else None."""
    if (cfg.store_backend or '').startswith('file:'):
        return 'file'
    if cfg.mooncake_master:
        return 'mooncake'
    return None


def _scheme(cfg) -> _Scheme:
    name = store_scheme(cfg)
    if name is None:
        raise ValueError('no Store is configured (store_backend or mooncake_master)')
    return _SCHEMES[name]


def open_store(cfg, state_bytes: int, kv_block_bytes: int) -> OpenedStore:
    """Open the Store backend ``cfg`` names for an engine whose largest objects are a state
    snapshot of ``state_bytes`` and a KV block of ``kv_block_bytes`` (payload bytes).

    Raises:
        ValueError: no Store configured, or the scheme's config is bad (the message names the
            field: ``store_backend``, ``mooncake_local_buffer_size``, ``mooncake_metadata_server``,
            ``store_secret_file``).
        StoreUnavailableError: a Mooncake master is unreachable (the message names the address).
    """
    return _scheme(cfg).open(cfg, state_bytes, kv_block_bytes)


def describe_store(cfg) -> str:
    """The startup line's Store part for ``cfg``: ``'file Store in DIR'``, ``'embedded Mooncake
    Store'`` or ``'Mooncake Store at HOST:PORT'``; ``'no Store'`` when none is configured."""
    return _scheme(cfg).describe(cfg) if store_scheme(cfg) is not None else 'no Store'


# file:DIR ------------------------------------------------------------------------------------
def _file_folder(cfg) -> str:
    from .file_backend import parse_store_backend
    return parse_store_backend(cfg.store_backend)[1]


def _largest_object(cfg, state_bytes: int, kv_block_bytes: int) -> int:
    """Bytes of the largest value an engine puts or reads: a state snapshot or a KV block, or
    (role prefill / decode) a hand-off object holding a partial block and a state snapshot."""
    largest = max(state_bytes, kv_block_bytes)
    if getattr(cfg, 'role', 'both') != 'both':
        largest = state_bytes + kv_block_bytes
    return largest + OBJECT_OVERHEAD


def _open_file(cfg, state_bytes: int, kv_block_bytes: int) -> OpenedStore:
    from .file_backend import FileStore
    folder = _file_folder(cfg)
    secret = resolve_secret(cfg.store_secret_file)
    if secret is None:
        logger.warning('Store objects in %s are NOT authenticated: no store_secret_file and no LMDEPLOY_STORE_SECRET. '
                       'Anyone who can write that folder can put objects that change this engine\'s outputs.', folder)
    largest = _largest_object(cfg, state_bytes, kv_block_bytes)
    client = FileStore(folder, cfg.store_file_max_bytes, max_object_bytes=largest)
    return OpenedStore(client, secret, None, _describe_file(cfg))


def _describe_file(cfg) -> str:
    return f'file Store in {os.path.abspath(_file_folder(cfg))}'


# Mooncake ------------------------------------------------------------------------------------
def _open_mooncake(cfg, state_bytes: int, kv_block_bytes: int) -> OpenedStore:
    """Connect to the master ``cfg.mooncake_master`` names, starting embedded services for
    ``'local'`` (stopped again if the connection fails)."""
    largest = _largest_object(cfg, state_bytes, kv_block_bytes)
    need = buffer_bytes_needed(largest)
    # each writer's put and the engine's read take room in the buffer at once (auto: all of them)
    buffer_size = cfg.mooncake_local_buffer_size or max(64 << 20, need * (cfg.store_writers + 1))
    if buffer_size < need:
        raise ValueError(f'mooncake_local_buffer_size ({cfg.mooncake_local_buffer_size} bytes) must be at least '
                         f'{need} bytes: the largest Store object of this model is {largest} bytes (state snapshot '
                         f'{state_bytes} or KV block {kv_block_bytes}, or both in a hand-off, plus '
                         f'the {OBJECT_OVERHEAD}-byte header and MAC), rounded up to Mooncake\'s allocation size')
    master, metadata = cfg.mooncake_master, cfg.mooncake_metadata_server
    if master != 'local' and metadata is None:
        raise ValueError('mooncake_metadata_server is required with an external mooncake_master '
                         '(e.g. http://HOST:PORT/metadata of the Store\'s HTTP metadata server)')
    secret = resolve_secret(cfg.store_secret_file)       # a bad secret file fails before anything starts
    if secret is None and master == 'local':
        secret = secrets.token_hex(32).encode()   # embedded services die with this engine: a per-run secret
    services = None
    if master == 'local':
        from .services import MooncakeServices
        services = MooncakeServices(segment_size=cfg.mooncake_embedded_segment_size)
        services.start()
        master, metadata = services.master_address, services.metadata_server
    try:
        client = StoreClient.connect(master, metadata, protocol=cfg.mooncake_protocol,
                                     segment_size=cfg.mooncake_segment_size,
                                     local_buffer_size=buffer_size, max_transfers=buffer_size // need)
    except BaseException:
        if services is not None:
            services.stop()
        raise
    # warned only once the Store is reached: before an unreachable master's fatal error, the
    # warning was the line a user read first, and it is not what stopped the server
    if secret is None:
        logger.warning('Store objects are NOT authenticated: no store_secret_file and no LMDEPLOY_STORE_SECRET. '
                       'Anyone who can reach the Mooncake master %s can put objects that change this engine\'s '
                       'outputs. Give every engine sharing the Store the same secret.', master)
    return OpenedStore(client, secret, services, _describe_mooncake(cfg))


def _describe_mooncake(cfg) -> str:
    if cfg.mooncake_master == 'local':
        return 'embedded Mooncake Store'
    return f'Mooncake Store at {cfg.mooncake_master}'


register_scheme('file', _open_file, _describe_file)
register_scheme('mooncake', _open_mooncake, _describe_mooncake)
