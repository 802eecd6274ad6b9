"""MooncakeServices when a port it picked free is taken by another process before a service binds
it: readiness asks whether the listener is the service's own process (``listens_on``), and the
start is made again on new ports."""
import logging
import os
import socket
import subprocess
import sys

import pytest

from lmdeploy.pytorch.store import services as services_mod
from lmdeploy.pytorch.store.services import PORT_ATTEMPTS, MooncakeServices, find_binary, listens_on

needs_mooncake = pytest.mark.skipif(find_binary('mooncake_master') is None,
                                    reason='mooncake_master binary not found: pip install -r requirements/store.txt')


def _listener():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(('127.0.0.1', 0))
    s.listen()
    return s


def test_listens_on_tells_the_listening_process_from_another():
    """The process holding a listening socket is told apart from one that does not hold it, and
    from a port nobody listens on (Linux /proc; None where it cannot tell)."""
    other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])
    try:
        with _listener() as s:
            port = s.getsockname()[1]
            mine = listens_on(os.getpid(), port)
            if mine is None:
                pytest.skip('/proc cannot tell socket owners here')
            assert mine is True
            assert listens_on(other.pid, port) is False
        free = socket.socket()
        free.bind(('127.0.0.1', 0))
        port = free.getsockname()[1]
        free.close()
        assert listens_on(os.getpid(), port) is False
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize('slot', [0, 1], ids=['master_rpc_port', 'metadata_port'])
@needs_mooncake
def test_a_picked_port_taken_before_the_service_binds_it_is_picked_again(monkeypatch, caplog, slot):
    """The first three ports handed out include one another process already listens on (the
    master's RPC port or the metadata server's): the services still start, on ports that are
    theirs, and a warning names the taken port."""
    real = services_mod.free_ports
    taken = _listener()
    taken_port = taken.getsockname()[1]
    calls = []

    def racing_free_ports(host, count):
        ports = real(host, count)
        if count == 3:
            calls.append(count)
            if len(calls) == 1:     # the first start's pick: one port is lost to the race
                ports[slot] = taken_port
        return ports

    monkeypatch.setattr(services_mod, 'free_ports', racing_free_ports)
    caplog.set_level(logging.WARNING, logger=services_mod.__name__)
    try:
        with MooncakeServices(segment_size=16 << 20, start_timeout_s=20.0) as svc:
            ports = (svc.rpc_port, svc.metadata_port)
            assert taken_port not in ports
            assert listens_on(svc._master.pid, svc.rpc_port) in (True, None)
            assert listens_on(svc._metadata.pid, svc.metadata_port) in (True, None)
            assert len(calls) == 2
        assert any(str(taken_port) in r.getMessage() and 'taken by another process' in r.getMessage()
                   for r in caplog.records)
    finally:
        taken.close()


@needs_mooncake
def test_a_start_that_loses_every_pick_raises_after_the_last_attempt(monkeypatch):
    """Another process holds the master's port at every pick: the start is made PORT_ATTEMPTS
    times and then raises the service's own error (its exit, with its log), nothing left running."""
    real = services_mod.free_ports
    taken = _listener()
    picks = []

    def always_taken(host, count):
        ports = real(host, count)
        if count == 3:
            picks.append(1)
            ports[0] = taken.getsockname()[1]
        return ports

    monkeypatch.setattr(services_mod, 'free_ports', always_taken)
    svc = MooncakeServices(segment_size=16 << 20, start_timeout_s=20.0)
    try:
        with pytest.raises(RuntimeError, match='mooncake_master'):
            svc.start()
        assert len(picks) == PORT_ATTEMPTS
        assert svc._master is None and svc._metadata is None and svc._client is None
    finally:
        svc.stop()
        taken.close()
