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
import shlex
import sys

from .utils import field_flag

__all__ = ['build_parser', 'cli_message', 'main']


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


# a field's value as a message writes it: quoted (spaces or punctuation), or a bare word that is
# not a JSON value (``{...}`` / ``[...]``, left as written) and stops at punctuation of the sentence
_VALUE = r'\'[^\']*\'|"[^"]*"|(?![{\[])[^\s:;,()]+'


def with_leading_flag(command: argparse.ArgumentParser, message: str, args: argparse.Namespace | None = None) -> str:
    """``message`` with the flag of the field it starts with added after the field's name (and
    value), as a command-line user typed the flag: ``store_backend folder '/x' cannot be used``
    (an engine check run once the model is loaded, which knows only its config's field names)
    becomes ``store_backend (--store-backend) folder '/x' cannot be used``, and
    ``speculative_config.method=mtp needs ...`` becomes ``speculative_config.method=mtp
    (--speculative-algorithm) needs ...``: a nested field gets the flag ``args`` gave it (see
    :func:`lmdeploy.cli.utils.field_flag`). A field followed by its value in parentheses takes
    the flag into them, as typed: ``tp (2): ...`` becomes ``tp (--tp 2): ...``. Unchanged when
    the message names that flag (or flags in parentheses right after the name) already, or does
    not start with a field of one of ``command``'s optional flags (a positional such as
    ``model_path`` has no flag to add), or its value runs on past the sentence's punctuation
    (``host:port``, ``a,b``, JSON): the ``field=value`` rewrite of :func:`cli_message` takes it."""
    # a field (dotted for a nested one) as a word of the sentence, optionally with ``=value``
    # (a colon ends it only before a space or the end: ``host:port`` is never cut at its colon)
    match = re.match(rf'([A-Za-z_]\w*(?:\.\w+)*)(=(?:{_VALUE}))?(?= |:(?:\s|$)|$)', message)
    if match is None or re.match(r' \(--', message[match.end():]):     # flags named after it already
        return message
    flag = field_flag(command, match.group(1), args)
    if flag is None or re.search(rf'{re.escape(flag)}(?![\w-])', message):
        return message
    value = re.match(r' \(([^()\s]+)\)', message[match.end():]) if match.group(2) is None else None
    if value is not None:       # ``tp (4): ...``: the value the flag was given goes with it
        return f'{match.group(0)} ({flag} {value.group(1)}){message[match.end() + value.end():]}'
    return f'{match.group(0)} ({flag}){message[match.end():]}'


# ``field=value`` inside a sentence (not a URL's query or a path); a dotted field for a nested
# model's, a quoted value when it has spaces or punctuation
_FIELD_VALUE = re.compile(rf'(?<![\w.\-/?&])([A-Za-z_]\w*(?:\.\w+)*)=({_VALUE})')


def _opaque_spans(message: str) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of ``message`` no rewrite may touch: a quoted string
    (``'...'`` or ``"..."`` opened after a non-word character, so an apostrophe in ``model's``
    opens none) and a bracketed JSON value (``{...}`` / ``[...]``, nested brackets included).
    Inside them a field's name is text the user wrote or a value (a model name, a path, a JSON
    key), not a flag to type."""
    spans, i = [], 0
    while i < len(message):
        c = message[i]
        end = -1
        if c in '{[':
            depth = 0
            for j in range(i, len(message)):
                depth += (message[j] in '{[') - (message[j] in '}]')
                if depth == 0:
                    end = j + 1
                    break
            else:
                end = len(message)      # unclosed: the rest of the message is the value
        elif c in '\'"' and (i == 0 or not (message[i - 1].isalnum() or message[i - 1] == '_')):
            close = message.find(c, i + 1)
            end = -1 if close < 0 else close + 1
        if end > 0:
            spans.append((i, end))
            i = end
        else:
            i += 1
    return spans


def _in_spans(pos: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= pos < b for a, b in spans)


def cli_message(command: argparse.ArgumentParser, message: str, args: argparse.Namespace | None = None) -> str:
    """A configuration error in a command-line user's words: what the user typed is flags, so
    the message names them, while the same error raised to a Python caller names the config
    fields (``tp=1``). Three rewrites, all only for fields one of ``command``'s flags sets:

    * the field the message starts with gets its flag (:func:`with_leading_flag`);
    * every other ``field=value`` (a value to use, or one the check compared) reads as the command
      line to type, ``--flag value`` (a boolean field's ``True`` / ``False``: ``--flag`` /
      ``--no-flag``): ``...; use tp=1`` becomes ``...; use --tp 1``. A field whose flag the
      message already lists in its leading ``--a, --b: `` (a check across fields, see
      :func:`lmdeploy.cli.utils.model_from_args`) keeps the field's form, and so does a nested
      field that only a JSON flag sets (``--speculative-config``);
    * a field named bare whose flag the message does not name yet gets it after its first
      mention, ``max_batch_size (--max-batch-size)`` (only names with an underscore: ``tp`` or
      ``role`` may be a word of the sentence).

    Text inside quotes or a JSON value (``{...}``, ``[...]``) is left as written, and so is a value
    that is JSON (``speculative_config={...}``): a field's name there is a key, a model name or
    prose the user wrote, not a flag to type (:func:`_opaque_spans`).

    ``args`` are the parsed flags (the speculative fields' flag is the one the user typed).
    """
    message = with_leading_flag(command, message, args)
    prefix = re.match(r'--[\w-]+(?:, --[\w-]+)*: ', message)
    listed = set(prefix.group(0)[:-2].split(', ')) if prefix else set()
    actions = command._option_string_actions

    opaque = _opaque_spans(message)

    def rewrite(match: re.Match) -> str:
        if message.startswith(' (--', match.end()) or _in_spans(match.start(), opaque):
            return match.group(0)       # the subject, with its flag after it; or inside a value
        flag = field_flag(command, match.group(1), args)
        action = actions.get(flag)
        if flag is None or flag in listed or action is None or action.metavar == 'JSON':
            return match.group(0)
        value = match.group(2)
        if value[0] in '\'"':
            value = value[1:-1]
        if isinstance(action, argparse.BooleanOptionalAction) and value in ('True', 'False'):
            return flag if value == 'True' else '--no-' + flag[2:]
        return f'{flag} {shlex.quote(value)}'

    message = _FIELD_VALUE.sub(rewrite, message)

    def name_flag(match: re.Match) -> str:
        flag = field_flag(command, match.group(1), args)
        if flag is None or re.search(rf'{re.escape(flag)}(?![\w-])', message[:match.start()] + message[match.end():]):
            return match.group(0)
        return f'{match.group(1)} ({flag})'

    # a field named bare (``lower max_batch_size``) gets its flag once, as the subject does; only
    # names with an underscore, so that a prose word that is also a field (``tp``, ``role``) stays
    # as written
    for name in sorted({m.group(1) for m in _BARE_FIELD.finditer(message)}):
        opaque = _opaque_spans(message)
        first = next((m for m in re.finditer(rf'(?<![\w.\-/?&=])({re.escape(name)})(?![\w.=-]| \(--)', message)
                      if not _in_spans(m.start(), opaque)), None)
        if first is not None:
            message = message[:first.start()] + name_flag(first) + message[first.end():]
    return message


_BARE_FIELD = re.compile(r'(?<![\w.\-/?&=])([a-z]\w*_\w*(?:\.\w+)*)(?![\w.=-]| \(--)')


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
        message = cli_message(getattr(args, '_command_parser', parser), str(err), args)
        parser.exit(2, f'lmdeploy: error: {message}\n')
    except StoreUnavailableError as err:
        parser.exit(1, f'lmdeploy: error: {err}\n')
    except KeyboardInterrupt:
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == '__main__':
    sys.exit(main())
