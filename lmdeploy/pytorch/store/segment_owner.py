"""The segment-owning process of :class:`~.services.MooncakeServices`: the memory objects live in.

Usage (started by :class:`~.services.MooncakeServices`, or by hand for shared services)::

    MC_TCP_BIND_ADDRESS=HOST python3 -m lmdeploy.pytorch.store.segment_owner \\
        --host HOST --metadata http://HOST:8080/metadata --master HOST:50051 \\
        --segment-size 8589934592 [--ready FILE]

Why not ``mooncake_client``: Mooncake 0.3.13's transfer engine binds its handshake and data
ports to every interface, with no setting to change that. In this process, on a loopback
``HOST`` (or master), those listeners are pinned to the loopback interface right after setup
(:mod:`.listeners`); the process exits with code 3 and the reason if they cannot be.

The process writes ``--ready`` (if given) once the segment is mounted, and runs until
SIGTERM/SIGINT.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

__all__ = ['main']


def main(argv: list[str] | None = None) -> int:
    """Run the segment owner (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(prog='python3 -m lmdeploy.pytorch.store.segment_owner',
                                     description='Own a Mooncake Store memory segment.')
    parser.add_argument('--host', required=True, help='address every port binds to and advertises')
    parser.add_argument('--metadata', required=True, help='metadata server URL, http://HOST:PORT/metadata')
    parser.add_argument('--master', required=True, help='mooncake_master RPC address HOST:PORT')
    parser.add_argument('--segment-size', type=int, required=True, help='bytes of memory to contribute (>= 16 MiB)')
    parser.add_argument('--ready', default=None, help='file to create once the segment is mounted')
    args = parser.parse_args(argv)

    from .listeners import ExposedPortError, is_loopback, listening_fds, pin_new_listeners
    from .metadata_server import set_process_name
    set_process_name('mooncake_owner')
    host = args.host
    os.environ.setdefault('MC_TCP_BIND_ADDRESS', host)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    before = listening_fds()
    rc = store.setup(host, args.metadata, args.segment_size, 1 << 20, 'tcp', '', args.master)
    if rc != 0:
        print(f'segment owner: Mooncake setup against {args.master} failed with code {rc}', file=sys.stderr)
        return 1
    if is_loopback(os.environ['MC_TCP_BIND_ADDRESS']) or is_loopback(args.master.rpartition(':')[0]):
        try:
            pinned = pin_new_listeners(before, 'segment owner')
        except ExposedPortError as err:
            print(f'segment owner: {err}', file=sys.stderr)
            return 3
        print('segment owner: transfer ports pinned to loopback: ' +
              ', '.join(f'{item.ip}:{item.port}' for item in pinned), flush=True)
    if args.ready:
        with open(args.ready, 'w') as f:
            f.write(str(os.getpid()))
    while not stop.wait(1.0):
        pass
    store.close()
    return 0


if __name__ == '__main__':
    sys.exit(main())
