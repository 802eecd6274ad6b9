"""``lmdeploy chat MODEL_PATH [flags]``: an interactive conversation in the terminal.

Reads one user message per stdin line, keeps the whole conversation as history (so multi-turn
prefix caching applies with ``--enable-prefix-caching``), and streams each reply to stdout.
``exit`` or end of input quits. Output format (stable; tests rely on it)::

    >>> <reply 1>\\n>>> <reply 2>\\n>>> \\n

Diagnostics go to stderr. Flags: one per ``PytorchEngineConfig`` field and one per
``GenerationConfig`` field (``--max-new-tokens``, ``--do-sample`` ...), plus ``--system``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from ..messages import GenerationConfig
from .serve import add_engine_args, engine_config_from_args
from .utils import add_log_level_arg, add_model_args, model_from_args

__all__ = ['add_parser', 'chat', 'chat_loop', 'PROMPT']

PROMPT = '>>> '


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``chat`` sub-command to ``subparsers``."""
    parser = subparsers.add_parser('chat', help='chat with a model in the terminal',
                                   description='Chat with MODEL_PATH; "exit" or end of input quits.')
    parser.add_argument('model_path', metavar='MODEL_PATH', help='local Hugging Face model directory')
    parser.add_argument('--system', default=None, help='system prompt (default: none)')
    add_log_level_arg(parser)
    add_engine_args(parser)
    add_model_args(parser, GenerationConfig, 'generation (GenerationConfig)')
    parser.set_defaults(func=chat)
    return parser


def chat_loop(pipe, gen_config: GenerationConfig, stdin: TextIO, stdout: TextIO, stderr: TextIO,
              system: str | None = None) -> None:
    """Run the conversation until ``exit`` or end of input.

    A message the engine refuses (e.g. the history outgrew ``session_len``) is reported on
    ``stderr`` and dropped from the history; the conversation continues.
    """
    history = [{'role': 'system', 'content': system}] if system else []
    while True:
        stdout.write(PROMPT)
        stdout.flush()
        line = stdin.readline()
        text = line.rstrip('\r\n')
        if not line or text.strip() == 'exit':
            stdout.write('\n')
            stdout.flush()
            return
        if not text.strip():
            continue
        history.append({'role': 'user', 'content': text})
        reply = ''
        try:
            for r in pipe.stream_infer(history, gen_config):
                reply += r.text
                stdout.write(r.text)
                stdout.flush()
        except ValueError as err:
            history.pop()
            stderr.write(f'error: {err}\n')
            stderr.flush()
            continue
        stdout.write('\n')
        history.append({'role': 'assistant', 'content': reply})


def chat(args: argparse.Namespace) -> int:
    """Load the model and run :func:`chat_loop` on the process's stdin/stdout.

    Raises:
        ValueError: an invalid engine / generation configuration or model directory.
    """
    import logging

    from ..serve.pipeline import Pipeline
    engine_config = engine_config_from_args(args)
    if engine_config.mooncake_master and args.log_level != 'DEBUG':
        from .serve import native_log_path, route_native_logs
        route_native_logs(native_log_path())
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    gen_config = model_from_args(args, GenerationConfig)
    with Pipeline(args.model_path, engine_config) as pipe:
        sys.stderr.write(f'lmdeploy chat: {args.model_path}; type "exit" to quit\n')
        chat_loop(pipe, gen_config, sys.stdin, sys.stdout, sys.stderr, system=args.system)
    return 0
