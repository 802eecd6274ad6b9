"""Keep Mooncake's listening sockets on the loopback interface (Linux).

Mooncake 0.3.13's transfer engine, which every Store client (an engine, a segment owner) runs
in-process, opens two listeners it offers no bind setting for: the handshake port on
``0.0.0.0`` and the TCP data port on ``::`` (dual stack). ``MC_TCP_BIND_ADDRESS`` only sets
the address they are *advertised* under. The data port reads and writes the process's
registered memory for whoever connects, so on a loopback setup it must not be reachable from
the network.

This module finds the listening sockets a process opened during a call (:func:`listening_fds`
before and after) and pins the wildcard ones to the loopback interface with
``SO_BINDTODEVICE`` (:func:`pin_to_loopback`): the kernel then accepts connections to them only
from this machine (``ss -ltn`` shows ``0.0.0.0%lo:PORT``). Since Linux 5.7 an unprivileged
process may do this to a socket not yet bound to a device. Where that fails the caller refuses
to run unless the operator allowed exposed ports explicitly (:data:`ALLOW_EXPOSED_ENV`).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

__all__ = ['ALLOW_EXPOSED_ENV', 'Listener', 'ExposedPortError', 'is_loopback', 'listening_fds', 'pin_new_listeners',
           'pin_to_loopback']

ALLOW_EXPOSED_ENV = 'LMDEPLOY_STORE_ALLOW_EXPOSED_PORTS'
_LISTEN = '0A'          # TCP_LISTEN in /proc/net/tcp


class ExposedPortError(RuntimeError):
    """A Mooncake port would listen beyond loopback on a setup meant to stay on loopback."""


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket of this process: ``fd``, local ``ip`` (``'0.0.0.0'``/``'::'``
    for a wildcard) and ``port``."""
    fd: int
    ip: str
    port: int

    @property
    def wildcard(self) -> bool:
        """The socket listens on every interface (``0.0.0.0`` or ``::``)."""
        return ipaddress.ip_address(self.ip).is_unspecified


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and any loopback IP (127.0.0.0/8, ::1)."""
    if host == 'localhost':
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _proc_listeners(path: str, v6: bool) -> dict[int, tuple[str, int]]:
    """inode -> (ip, port) of the LISTEN sockets in ``/proc/self/net/tcp[6]``."""
    out = {}
    try:
        with open(path) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != _LISTEN:
                    continue
                hex_ip, hex_port = fields[1].split(':')
                raw = bytes.fromhex(hex_ip)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b''.join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(raw)
                if v6 and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped
                out[int(fields[9])] = (str(ip), int(hex_port, 16))
    except FileNotFoundError:
        pass
    return out


def listening_fds() -> list[Listener]:
    """The listening TCP sockets this process holds an fd of (Linux ``/proc``; empty elsewhere)."""
    table = {**_proc_listeners('/proc/self/net/tcp', False), **_proc_listeners('/proc/self/net/tcp6', True)}
    found = []
    try:
        names = os.listdir('/proc/self/fd')
    except FileNotFoundError:
        return []
    for name in names:
        try:
            target = os.readlink(f'/proc/self/fd/{name}')
        except OSError:
            continue
        if target.startswith('socket:['):
            inode = int(target[8:-1])
            if inode in table:
                found.append(Listener(int(name), *table[inode]))
    return sorted(found, key=lambda item: item.fd)


def pin_to_loopback(fd: int) -> None:
    """Restrict the listening socket ``fd`` to the loopback interface (``SO_BINDTODEVICE``).

    Raises:
        OSError: the kernel refused (before Linux 5.7 this needs CAP_NET_RAW), or not Linux.
    """
    if not hasattr(socket, 'SO_BINDTODEVICE'):
        raise OSError('SO_BINDTODEVICE is not available on this platform')
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b'lo')
    finally:
        sock.close()        # closes only the duplicate; the owner's fd keeps listening


def pin_new_listeners(before: list[Listener], what: str) -> list[Listener]:
    """Pin every wildcard listener not in ``before`` to loopback; return the ones pinned.

    Raises:
        ExposedPortError: a port could not be pinned and ``LMDEPLOY_STORE_ALLOW_EXPOSED_PORTS``
            is not ``1`` (the message names the ports and the variable).
    """
    old = {(item.fd, item.ip, item.port) for item in before}
    pinned, failed = [], []
    for item in listening_fds():
        if (item.fd, item.ip, item.port) in old or not item.wildcard:
            continue
        try:
            pin_to_loopback(item.fd)
            pinned.append(item)
        except OSError as err:
            failed.append(f'{item.ip}:{item.port} ({err})')
    if failed and os.environ.get(ALLOW_EXPOSED_ENV) != '1':
        raise ExposedPortError(f'{what}: Mooncake listens on {", ".join(failed)} on every interface and the port '
                               f'could not be pinned to loopback; anyone on the network could read or write this '
                               f'process\'s Store memory. Set {ALLOW_EXPOSED_ENV}=1 to run anyway (firewall the '
                               f'ports yourself).')
    return pinned
