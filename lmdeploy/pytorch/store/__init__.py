"""The Store tier, byte level (docs/en/advance/store.md).

- :mod:`.backend` — the protocol every Store backend implements (put / get / exists / remove)
  and its typed :class:`PutResult` (what the Store gained, exact with concurrent writers).
- :mod:`.object_format` — the value format (header + raw payload + HMAC, never pickled), object
  keys ``{namespace}/{kind}/{hash}`` and namespace digests. Pure, no I/O.
- :mod:`.identity` — what objects are tied to: the model identity (config + full weight hashes,
  cached), the engine's namespace, and the Store secret.
- :mod:`.mooncake_client` — :class:`StoreClient`, the Mooncake backend over ``mooncake.store``;
  only ``connect`` raises, every later failure is returned and counted.
- :mod:`.file_backend` — :class:`FileStore`, the local-folder backend (``store_backend='file:DIR'``):
  atomic writes, LRU eviction beyond a size limit shared by every process on the folder; its
  file-system primitives that hold against a hostile folder (no link followed, no blocking
  open, nothing truncated) are in :mod:`.safe_fs`.
- :mod:`.services` — :class:`MooncakeServices`, a local ``mooncake_master`` + segment owner
  (with the HTTP metadata server) for the embedded mode and the tests; every port on its host.
- :mod:`.open_backend` — the scheme registry (``file:DIR``, Mooncake) that opens the backend an
  engine config names and names it on the startup line; the Store tier is handed the result.
- :mod:`.layout` — :class:`~.layout.StoreLayout`, the TP-independent (full-head) payload layout
  a tensor-parallel engine converts its rank slices to and from (imported only with ``tp > 1``).

The engine-facing tier (what to save at a save point, how deep a stored prefix reaches) builds
on these; apart from :mod:`.layout`, nothing here knows about blocks, sequences or tensors' meaning.
"""
from .backend import PutResult, StoreBackend
from .file_backend import FileStore
from .mooncake_client import FakeStoreClient, StoreClient, StoreClientStats, StoreUnavailableError
from .identity import engine_namespace, model_identity, resolve_secret
from .object_format import (FORMAT_VERSION, HEADER_SIZE, MAC_SIZE, OBJECT_OVERHEAD, StoreObjectError, decode_object,
                            encode_object, namespace_digest, object_key)
from .services import MooncakeServices

__all__ = ['FORMAT_VERSION', 'HEADER_SIZE', 'MAC_SIZE', 'OBJECT_OVERHEAD', 'FakeStoreClient', 'FileStore',
           'MooncakeServices', 'PutResult', 'StoreBackend',
           'StoreClient', 'StoreClientStats', 'StoreObjectError', 'StoreUnavailableError', 'decode_object',
           'encode_object', 'engine_namespace', 'model_identity', 'namespace_digest', 'object_key', 'resolve_secret']
