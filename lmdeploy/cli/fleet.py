"""``lmdeploy serve fleet MODEL_PATH --replicas N [flags]``: N api_servers, one Store, one router.

Takes every ``api_server`` flag (:func:`lmdeploy.cli.serve.add_server_args`) and passes them on
to each replica, except ``--server-name`` / ``--server-port``, which are the router's address;
replicas listen on 127.0.0.1 at ``--server-port + 1 ...`` (or ``--replica-ports``). Prefix
caching is on unless ``--no-enable-prefix-caching`` is given.

The Store every replica shares: the one the flags name (``--store-backend file:DIR``, or
``--mooncake-master HOST:PORT`` with ``--mooncake-metadata-server``), or, with
``--mooncake-master local``, one Mooncake Store the fleet starts for all replicas (its segment
sized by ``--mooncake-embedded-segment-size``, default 512 MiB); with no Store
flag, a ``file:`` Store in a new temporary folder, removed at exit. A Store the fleet makes gets
a fresh secret file shared by the replicas. The process runs :class:`lmdeploy.serve.fleet.Fleet`
until SIGINT / SIGTERM, then stops the router, the replicas (gracefully) and the Store it made.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from .utils import check_creatable_dir, int_at_least, port_number

__all__ = ['add_parser', 'run_fleet', 'replica_flags']

# destinations of the fleet's own arguments (not passed to replicas)
FLEET_DESTS = ('model_path', 'server_name', 'server_port', 'replicas', 'router', 'router_policy', 'router_args',
               'replica_ports', 'fleet_log_dir', 'func', '_command_parser', 'command', 'server')


def add_parser(servers, add_server_args) -> argparse.ArgumentParser:
    """Add ``fleet`` to the ``serve`` sub-command's ``servers``; returns its parser.

    ``add_server_args(parser)`` adds every ``api_server`` flag (``serve`` hands its own in, so
    this module does not import it back)."""
    from ..serve.fleet import ROUTERS
    parser = servers.add_parser(
        'fleet', help='N api_server replicas sharing one Store behind a router',
        description='Start --replicas api_servers of MODEL_PATH on one Store and a router in front of them '
        '(conversation affinity with the cache_aware policy); every api_server flag is passed to the replicas. '
        '--server-name/--server-port are the router\'s address.')
    add_server_args(parser)
    group = parser.add_argument_group('fleet')
    group.add_argument('--replicas', type=int_at_least(1), default=2, metavar='N',
                       help='api_server replicas to start (default: 2)')
    group.add_argument('--router', choices=sorted(ROUTERS), default='smg',
                       help='the router program (default: smg, installed by pip install "lmdeploy[fleet]")')
    group.add_argument('--router-policy', default=None, metavar='POLICY',
                       help='the router\'s policy: cache_aware (default; routes a request to the replica whose '
                       'earlier requests share its longest prefix, so a conversation stays on one replica while '
                       'load is balanced) or round_robin, or the router\'s others (smg: '
                       + ', '.join(ROUTERS['smg'].policies[2:]) + ')')
    group.add_argument('--router-args', type=shlex.split, default=[], metavar='"FLAGS"',
                       help='more router flags, as one quoted string (e.g. "--cache-threshold 0.5")')
    group.add_argument('--replica-ports', type=port_number, nargs='+', default=None, metavar='PORT',
                       help='the replicas\' ports (default: --server-port + 1 ... + N)')
    group.add_argument('--fleet-log-dir', default=None, metavar='DIR',
                       help='folder of the replicas\' and router\'s logs (default: a new temporary folder, removed '
                       'when the fleet stops cleanly, kept when a process failed or a replica died)')
    parser.set_defaults(func=run_fleet)
    return parser


def replica_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The ``api_server`` flags that reproduce ``args`` (parsed by ``parser``), without the
    fleet's own arguments: every flag given or differing from its default, in ``parser``'s
    order. Parsing the result gives back the same values (tests/test_fleet.py checks it)."""
    out = []
    for action in parser._actions:
        if action.dest in FLEET_DESTS or not action.option_strings or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = next(o for o in action.option_strings if o.startswith('--'))
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else '--no-' + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif action.nargs in ('+', '*'):
            out += [flag, *map(_text, value)]
        else:
            out += [flag, _text(value)]
    return out


def _text(value) -> str:
    if isinstance(value, dict):
        import json
        return json.dumps(value)
    return str(value)



def run_fleet(args: argparse.Namespace) -> int:
    """Start the fleet for parsed ``args``, serve until SIGINT / SIGTERM, stop it.

    Returns:
        0 after a signal stopped the fleet; 1 when a process did not start or the router exited.

    Raises:
        ValueError: an unknown router policy, a router that is not installed, a port in use, or
            a ``--fleet-log-dir`` that cannot be a folder (the message names the field).
    """
    from ..serve.fleet import Fleet, SharedStore
    parser = args._command_parser
    if not hasattr(args, 'enable_prefix_caching'):
        args.enable_prefix_caching = True
    log_dir = Path(args.fleet_log_dir) if args.fleet_log_dir else None
    if log_dir is not None:
        check_creatable_dir(log_dir, 'fleet_log_dir (--fleet-log-dir)')
    fleet = Fleet(args.model_path, [], replicas=args.replicas, host=args.server_name, port=args.server_port,
                  replica_ports=args.replica_ports, router=args.router, policy=args.router_policy,
                  router_args=args.router_args, log_dir=str(log_dir) if log_dir else None,
                  api_key=args.api_keys[0] if args.api_keys else None)
    store = None      # made after every check passed, so a refused command line leaves no folder behind
    if getattr(args, 'store_backend', None) is None and getattr(args, 'mooncake_master', None) in (None, 'local'):
        import tempfile
        kind = 'mooncake' if getattr(args, 'mooncake_master', None) == 'local' else 'file'
        # --mooncake-embedded-segment-size sizes the one Store the fleet starts (not each replica's)
        segment = vars(args).pop('mooncake_embedded_segment_size', 512 << 20)
        store = SharedStore(kind, Path(tempfile.mkdtemp(prefix='lmdeploy-fleet-store-')), segment_size=segment)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)   # SIGTERM stops like Ctrl-C
    code, started = 0, False
    try:
        if store is not None:
            try:
                fields = store.open()
            except RuntimeError as err:
                print(f'lmdeploy: error: the shared Store did not start: {err}', file=sys.stderr)
                code = 1
                return code
            for name, value in fields.items():
                setattr(args, name, value)
            store_text = store.describe()
        else:
            store_text = (f'file Store in {args.store_backend[5:]}' if str(args.store_backend).startswith('file:')
                          else f'Mooncake Store at {args.mooncake_master}')
        fleet.flags = replica_flags(args, parser)
        print(f'starting {args.replicas} replicas of {args.model_path} ({store_text}); logs in {fleet.log_dir}',
              flush=True)
        t0 = time.monotonic()
        try:
            fleet.start()
        except RuntimeError as err:
            print(f'lmdeploy: error: the fleet did not start: {err}', file=sys.stderr)
            code = 1
            return code
        started = True
        print(f'fleet ready in {time.monotonic() - t0:.0f} s: {args.router} ({fleet.policy}) at {fleet.url} '
              f'in front of {", ".join(fleet.replica_urls)}', flush=True)
        while True:
            message = fleet.poll()
            if message:
                print(f'lmdeploy: error: {message}', file=sys.stderr)
                code = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)      # a second SIGTERM must not cut the cleanup short
        fleet.stop()
        if store is not None:
            store.close()
        signal.signal(signal.SIGTERM, previous)
        if code == 0 and started and log_dir is None and not any(r.reported for r in fleet.replicas):
            # a clean stop leaves nothing in the temporary folder; logs of a failure (a replica
            # that died included) are kept
            import shutil
            shutil.rmtree(fleet.log_dir, ignore_errors=True)
        print('fleet stopped', file=sys.stderr, flush=True)
    return code
