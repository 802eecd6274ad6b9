"""The ``lmdeploy`` console script (``lmdeploy=lmdeploy.cli.entrypoint:main``).

Sub-commands::

    lmdeploy serve api_server MODEL_PATH [flags]   OpenAI-compatible HTTP server
    lmdeploy serve store [flags]                   a Mooncake Store (master + segment) for servers to share
    lmdeploy serve fleet MODEL_PATH --replicas N   N api_servers on one Store behind a router
    lmdeploy chat MODEL_PATH [flags]               interactive terminal chat
    lmdeploy make-tiny-model OUT_DIR [--arch ...]  tiny random checkpoint for tests and demos

Each sub-command module exposes ``add_parser(subparsers)`` and sets ``func`` on its parser;
``main`` only dispatches. Exit codes: 0 success, 2 a bad command line, configuration or model
directory (argparse convention; the message names the field), 1 the Mooncake Store is
unreachable (``StoreUnavailableError``) or ``serve store`` could not start a service, 130
interrupted (SIGINT), 143 terminated (SIGTERM: the server shuts down gracefully first);
``serve store`` and ``serve fleet`` return 0 after SIGINT/SIGTERM stopped their processes (``serve
fleet``: 1 when a process did not start or its router exited).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

from .utils import field_flag

__all__ = ['build_parser', 'main']


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are two lines: the error (a "required" error also names
    the flags it does not know, since plain argparse stops at the first error, so a mistyped flag
    went unreported until the missing argument was given), then where the flags are listed.
    Plain argparse printed the whole usage first (about 45 lines for ``serve api_server``), which
    pushed the "did you mean" off the screen. Sub-command parsers inherit the class."""

    argv: list[str] = []

    def error(self, message: str):
        if message.startswith('the following arguments are required'):
            unknown = [tok for tok in self.argv if tok.startswith('-') and tok != '-' and not _is_number(tok)
                       and not self._knows(tok.split('=', 1)[0])]
            if unknown:
                message += f'; {self.unrecognized(unknown)}'
        self.exit(2, f'{self.prog}: error: {message}\nsee `{self.prog} --help`\n')

    def unrecognized(self, unknown: list[str]) -> str:
        """"unrecognized arguments: ..." naming, for each mistyped flag, the closest flag of this
        command (difflib's ratio >= 0.6 between the names without their dashes, which every
        flag shares) as "did you mean --X?"."""
        names = {o[2:]: o for o in self._option_string_actions if o.startswith('--')}
        parts = []
        for token in unknown:
            name = token.split('=', 1)[0]
            close = difflib.get_close_matches(name.lstrip('-'), names, n=1, cutoff=0.6) if name.startswith('-') else []
            parts.append(f'{token} (did you mean {names[close[0]]}?)' if close else token)
        return f'unrecognized arguments: {" ".join(parts)}'

    def _knows(self, flag: str) -> bool:
        """``flag`` is one of this parser's options, or (as argparse accepts) a unique prefix of
        a long one."""
        known = self._option_string_actions
        if flag in known:
            return True
        return (self.allow_abbrev and flag.startswith('--')
                and len({known[o] for o in known if o.startswith(flag)}) == 1)


def with_leading_flag(command: argparse.ArgumentParser, message: str, args: argparse.Namespace | None = None) -> str:
    """``message`` with the flag of the field it starts with added after the field's name (and
    value), as a command-line user typed the flag: ``store_backend folder '/x' cannot be used``
    (an engine check run once the model is loaded, which knows only its config's field names)
    becomes ``store_backend (--store-backend) folder '/x' cannot be used``, and
    ``speculative_config.method=mtp needs ...`` becomes ``speculative_config.method=mtp
    (--speculative-algorithm) needs ...``: a nested field gets the flag ``args`` gave it (see
    :func:`lmdeploy.cli.utils.field_flag`). Unchanged when the message names that flag (or flags
    in parentheses right after the name) already, or does not start with a field of one of
    ``command``'s optional flags (a positional such as ``model_path`` has no flag to add)."""
    # a field (dotted for a nested one) as a word of the sentence, optionally with ``=value``
    match = re.match(r'([A-Za-z_]\w*(?:\.\w+)*)(=(?:\'[^\']*\'|"[^"]*"|[^\s:]+))?(?=[ :]|$)', message)
    if match is None or re.match(r' \(--', message[match.end():]):     # flags named after it already
        return message
    flag = field_flag(command, match.group(1), args)
    if flag is None or re.search(rf'{re.escape(flag)}(?![\w-])', message):
        return message
    return f'{match.group(0)} ({flag}){message[match.end():]}'


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    """The full ``lmdeploy`` argument parser."""
    from .. import __version__
    from . import chat, serve, tiny_model
    parser = _Parser(prog='lmdeploy', description='Inference engine for hybrid-attention LLMs.')
    parser.add_argument('--version', action='version', version=f'lmdeploy {__version__}')
    subparsers = parser.add_subparsers(dest='command', metavar='COMMAND', required=True)
    serve.add_parser(subparsers)
    chat.add_parser(subparsers)
    tiny_model.add_parser(subparsers)
    for leaf in _command_parsers(parser):
        leaf.set_defaults(_command_parser=leaf)
    return parser


def _command_parsers(parser: argparse.ArgumentParser):
    """The parsers of the runnable commands under ``parser`` (those without sub-commands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):    # aliases share a parser
            yield from _command_parsers(child)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the sub-command, return the exit code."""
    from ..pytorch.config import cache_root
    from ..pytorch.store.mooncake_client import StoreUnavailableError
    # torch creates its compiler cache folder in the temporary folder as soon as torch._dynamo is
    # imported (transformers does); keep it with lmdeploy's own caches, so a clean stop leaves
    # /tmp as it found it
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', str(cache_root() / 'torchinductor'))
    parser = build_parser()
    _Parser.argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:     # reported with the command's own usage line, not the top-level one
        command = getattr(args, '_command_parser', parser)
        command.error(command.unrecognized(unknown))
    try:
        rc = args.func(args)
    except ValueError as err:       # configuration mistakes: say which field, no traceback
        message = with_leading_flag(getattr(args, '_command_parser', parser), str(err), args)
        parser.exit(2, f'lmdeploy: error: {message}\n')
    except StoreUnavailableError as err:
        parser.exit(1, f'lmdeploy: error: {err}\n')
    except KeyboardInterrupt:
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == '__main__':
    sys.exit(main())
