"""``lmdeploy serve store [flags]``: run a Mooncake Store on this machine until interrupted.

Starts one ``mooncake_master``, an HTTP metadata server and a segment owner that holds the
Store's memory (:class:`~lmdeploy.pytorch.store.services.MooncakeServices`), all on ``--host``
(default 127.0.0.1), and prints the two flags an api_server needs to use it::

    --mooncake-master 127.0.0.1:PORT --mooncake-metadata-server http://127.0.0.1:PORT/metadata

Unlike ``--mooncake-master local`` (services embedded in one api_server, gone with it), this
Store outlives the servers that use it, so a second server can restore what a first one saved.
Servers sharing it should share a secret too (``--store-secret-file``, the same file for all):
without one, anything that can reach the master can write objects the servers accept. The
services' logs go to ``--log-dir`` (printed); they are noisy by design (glog prints "metadata
not found" on every healthy start). SIGINT / SIGTERM stop the services.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .utils import check_creatable_dir, port_number

__all__ = ['add_parser', 'run_store']


def add_parser(servers) -> argparse.ArgumentParser:
    """Add ``store`` to the ``serve`` sub-command's ``servers``; returns its parser."""
    parser = servers.add_parser(
        'store', help='a Mooncake Store (master + memory segment) for api_servers to share',
        description='Run mooncake_master, a metadata server and the Store memory on HOST until interrupted; prints the '
        '--mooncake-master / --mooncake-metadata-server flags for `lmdeploy serve api_server`.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--host', default='127.0.0.1', help='address the services bind to and advertise')
    parser.add_argument('--segment-size', type=int, default=256 << 20, metavar='BYTES',
                        help='memory the Store holds, in bytes (at least 16 MiB)')
    parser.add_argument('--log-dir', default=None,
                        help='folder for the services\' logs; unset: a new temporary folder, kept')
    parser.add_argument('--master-port', type=port_number, default=0, metavar='PORT',
                        help='mooncake_master RPC port (what --mooncake-master points at); 0 = a free port')
    parser.add_argument('--metadata-port', type=port_number, default=0, metavar='PORT',
                        help='metadata server port (what --mooncake-metadata-server points at); 0 = a free port')
    parser.add_argument('--metrics-port', type=port_number, default=0, metavar='PORT',
                        help='mooncake_master metrics port; 0 = a free port')
    parser.set_defaults(func=run_store)
    return parser


def run_store(args: argparse.Namespace) -> int:
    """Start the services, print how to use them, wait for SIGINT/SIGTERM, stop them.

    Returns:
        0 after a signal stopped the services.

    Raises:
        ValueError: ``--segment-size`` below 16 MiB, a ``--host`` this machine cannot bind, a
            fixed port already in use, or a ``--log-dir`` that cannot be created (names the
            flag's field).

    A Mooncake binary that is missing or a service that does not start is reported on stderr
    (quoting its log) with exit code 1.
    """
    import tempfile

    from ..pytorch.store.services import MooncakeServices
    if args.log_dir:    # checked before any service starts: a file, a path under one, no permission
        check_creatable_dir(args.log_dir, 'log_dir (--log-dir)')
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='lmdeploy-store-')
    os.environ.setdefault('MC_TCP_BIND_ADDRESS', args.host)
    services = MooncakeServices(args.segment_size, host=args.host, log_dir=log_dir, keep_logs=True,
                                master_port=args.master_port, metadata_port=args.metadata_port,
                                metrics_port=args.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        services.start()
    except RuntimeError as err:
        print(f'lmdeploy: error: the Mooncake Store did not start: {err}', file=sys.stderr)
        return 1
    try:
        print(f'Mooncake Store ready ({args.segment_size >> 20} MiB on {args.host}); service logs in {log_dir}')
        print(f'mooncake_master: {services.master_address}')
        print(f'metadata_server: {services.metadata_server}')
        print(f'use: lmdeploy serve api_server MODEL --enable-prefix-caching --mooncake-master '
              f'{services.master_address} --mooncake-metadata-server {services.metadata_server}')
        print('and give every server the same --store-secret-file (e.g. `openssl rand -hex 32 > FILE`), '
              'so that they accept only objects written by each other', flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        services.stop()
        print('Mooncake Store stopped', file=sys.stderr)
    return 0
