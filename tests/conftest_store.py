"""Pytest plugin (loaded by tests/conftest.py): the real Mooncake Store services on 127.0.0.1.

``mooncake_services`` starts one ``mooncake_master`` + metadata server + segment owner for
the whole session and stops them at its end. Tests sharing it must use keys unique to the test
(e.g. :func:`unique_namespace`). Tests skip only when the ``mooncake_master`` binary is absent.
"""
import os
import uuid

import pytest

os.environ.setdefault('MC_TCP_BIND_ADDRESS', '127.0.0.1')   # before any Mooncake object exists


def unique_namespace() -> str:
    """A fresh 32-hex-digit namespace, so that tests never see each other's objects."""
    return uuid.uuid4().hex


def _require_mooncake() -> None:
    from lmdeploy.pytorch.store.services import find_binary
    if find_binary('mooncake_master') is None:
        pytest.skip('mooncake_master binary not found: pip install -r requirements/store.txt')


@pytest.fixture(scope='session')
def mooncake_services():
    """Running :class:`MooncakeServices` (128 MiB segment) shared by the session."""
    _require_mooncake()
    from lmdeploy.pytorch.store.services import MooncakeServices
    services = MooncakeServices(segment_size=128 << 20).start()
    yield services
    services.stop()


@pytest.fixture(scope='session')
def mooncake_store(mooncake_services):
    """A :class:`StoreClient` of this process (segment 0) connected to ``mooncake_services``."""
    from lmdeploy.pytorch.store.mooncake_client import StoreClient
    client = StoreClient.connect(mooncake_services.master_address, mooncake_services.metadata_server,
                                 local_buffer_size=16 << 20)
    yield client
    client.close()
