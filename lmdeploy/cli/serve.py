"""``lmdeploy serve api_server MODEL_PATH [flags]``: the OpenAI-compatible HTTP server.

Flags: the server's own (``--server-name``, ``--server-port``, ``--api-keys``, ``--model-name``,
``--log-level``) plus one per ``PytorchEngineConfig`` field (same name in kebab case), generated
by :mod:`lmdeploy.cli.utils`; the ``mooncake_*`` / ``store_*`` fields form the Store group.
``lmdeploy serve store`` (:mod:`lmdeploy.cli.store`) runs a Mooncake Store for servers to share.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ..messages import PytorchEngineConfig
from . import store
from .utils import add_log_level_arg, add_model_args, model_from_args

__all__ = ['add_parser', 'api_server', 'add_engine_args', 'STORE_GROUPS']

STORE_GROUPS = {'mooncake_': 'Mooncake Store tier', 'store_': 'Mooncake Store tier (queue)'}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`PytorchEngineConfig` field."""
    add_model_args(parser, PytorchEngineConfig, 'engine (PytorchEngineConfig)', STORE_GROUPS)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` (with its ``api_server`` sub-command) to ``subparsers``; returns ``api_server``'s parser."""
    serve = subparsers.add_parser('serve', help='serve a model over HTTP')
    servers = serve.add_subparsers(dest='server', metavar='SERVER', required=True)
    parser = servers.add_parser('api_server', help='OpenAI-compatible API server',
                                description='Serve MODEL_PATH with an OpenAI-compatible API.')
    parser.add_argument('model_path', metavar='MODEL_PATH', help='local Hugging Face model directory')
    parser.add_argument('--server-name', default='0.0.0.0',
                        help='address to bind (default: 0.0.0.0, every interface: use 127.0.0.1 for this machine '
                        'only, or set --api-keys)')
    parser.add_argument('--server-port', type=int, default=23333, help='port to bind (default: 23333)')
    parser.add_argument('--api-keys', nargs='+', default=None, metavar='KEY',
                        help='accepted bearer tokens; none = no authentication (default: None)')
    parser.add_argument('--model-name', default=None,
                        help='name clients send as "model" (default: the model directory\'s basename)')
    add_log_level_arg(parser)
    add_engine_args(parser)
    parser.set_defaults(func=api_server)
    store.add_parser(servers)
    return parser


def route_native_logs(path: str) -> None:
    """Send what native libraries write to file descriptor 2 (the Mooncake client's glog lines,
    which include ERROR/WARNING lines on every healthy start) to ``path``, and keep Python's
    ``sys.stderr`` (logging, tracebacks, uvicorn) on the terminal. Prints one line saying where.
    """
    sys.stderr.flush()
    terminal = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stderr = open(terminal, 'w', buffering=1, errors='backslashreplace')
    print(f'Mooncake client logs: {path} (--log-level DEBUG prints them here)', file=sys.stderr)


def api_server(args: argparse.Namespace) -> int:
    """Run the server for parsed ``args`` until interrupted; returns the exit code.

    Raises:
        ValueError: an invalid engine configuration or model directory.
    """
    from ..serve.openai.api_server import run_server
    config = model_from_args(args, PytorchEngineConfig)
    if config.mooncake_master and args.log_level != 'DEBUG':
        route_native_logs(os.path.join(tempfile.gettempdir(), f'lmdeploy-{os.getpid()}-mooncake.log'))
    run_server(args.model_path, config, server_name=args.server_name, server_port=args.server_port,
               api_keys=args.api_keys, log_level=args.log_level, model_name=args.model_name)
    return 0
