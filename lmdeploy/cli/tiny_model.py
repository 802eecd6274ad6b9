"""``lmdeploy make-tiny-model OUT_DIR``: write a tiny seeded checkpoint (for tests and the quick
start). The arguments are checked before torch is imported; the writer,
:mod:`lmdeploy.tools.make_tiny_model`, is imported only when a checkpoint is written."""
from __future__ import annotations

import argparse

from ..tools.tiny_args import add_arguments, check_args

__all__ = ['add_parser', 'main']


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `make-tiny-model` sub-command to an argparse `subparsers`; sets `func=main`."""
    parser = subparsers.add_parser('make-tiny-model', help='write a tiny random checkpoint for tests',
                                   description='Write a tiny, seeded, random Hugging Face checkpoint (config, '
                                   'safetensors weights, a trained BPE tokenizer) into OUT_DIR.')
    add_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> str:
    """Run the command for parsed `args`; prints and returns the written directory.

    Raises:
        ValueError: see :func:`~lmdeploy.tools.tiny_args.check_args`; or ``out_dir`` cannot be
            created or written (an OSError's reason: a path under a file, no permission, a full
            disk).
    """
    check_args(args)
    from ..tools.make_tiny_model import write_from_args        # torch: only when a checkpoint is written
    try:
        return write_from_args(args)
    except OSError as err:      # the command line answers a ValueError in one line, not a traceback
        raise ValueError(f'out_dir {args.out_dir!r} cannot be written: {err}') from None
