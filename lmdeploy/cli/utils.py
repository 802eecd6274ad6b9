"""Command-line flags generated from pydantic config models.

Every field of a config model (``PytorchEngineConfig``, ``GenerationConfig``) becomes the flag
``--field-name``, derived from the field itself so a new field gets a flag with no
CLI change:

    bool              → ``--flag`` / ``--no-flag`` (argparse.BooleanOptionalAction)
    Literal[a, b]     → ``choices=(a, b)``
    int | None, ...   → an optional value of the inner type (absent = the field's default)
    list[X]           → zero or more values of X
    a nested model    → no generated flag: the command adds its own flags for it (e.g.
                        ``--speculative-algorithm`` for ``speculative_config``) and passes the
                        nested value to :func:`model_from_args`

Invariant: a flag not given on the command line is absent from the parsed namespace
(``argparse.SUPPRESS``), so the model's own default applies and the model validates the whole
configuration; the CLI never duplicates a default or a range check.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from typing import Literal, Union

from pydantic import BaseModel, ValidationError

__all__ = ['add_model_args', 'model_from_args', 'is_nested_model', 'flag_name', 'field_flag', 'add_log_level_arg',
           'LOG_LEVELS', 'int_at_least', 'port_number', 'api_key', 'check_creatable_dir']

LOG_LEVELS = ('DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')


def flag_name(field: str) -> str:
    """``prefill_save_last_only`` → ``--prefill-save-last-only``."""
    return '--' + field.replace('_', '-')


def field_flag(command: argparse.ArgumentParser, path: str, args: argparse.Namespace | None = None) -> str | None:
    """The flag of ``command`` that sets the config field ``path``, as the user typed it, for an
    error message about that field; ``None`` when no flag sets it (a positional, an unknown name).

    A plain field's flag is the option whose ``dest`` is ``path`` (``block_size`` ->
    ``--block-size``). A nested model's field (``speculative_config.method``) is set by the flags
    the command registered as ``command.nested_field_flags``: a function of the parsed ``args``
    returning ``{dotted path: flag}`` (the speculative flags, or ``--speculative-config`` when
    only the JSON flag was given); ``args=None`` gives its answer for an empty command line.
    """
    nested = getattr(command, 'nested_field_flags', None)
    if nested is not None and '.' in path:
        return nested(args if args is not None else argparse.Namespace()).get(path)
    return next((o for a in command._actions if a.dest == path for o in a.option_strings if o.startswith('--')),
                None)


def _unwrap_optional(ann):
    if typing.get_origin(ann) in (Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f'no flag type for the union {ann}')
    return ann


def _default_text(field) -> str:
    default = field.default_factory() if field.default_factory is not None else field.default
    return 'None' if default is None else str(default)


def _flag_kwargs(name: str, field) -> dict:
    ann = _unwrap_optional(field.annotation)
    help_text = (field.description or name).replace('%', '%%') + f' (default: {_default_text(field)})'
    kwargs = {'dest': name, 'default': argparse.SUPPRESS, 'help': help_text}
    if ann is bool:
        kwargs['action'] = argparse.BooleanOptionalAction
    elif typing.get_origin(ann) is Literal:
        choices = typing.get_args(ann)
        kwargs.update(type=type(choices[0]), choices=choices)
    elif typing.get_origin(ann) is list:
        (item,) = typing.get_args(ann)
        kwargs.update(type=_unwrap_optional(item), nargs='*', metavar=name.upper())
    elif ann in (int, float, str):
        kwargs.update(type=ann, metavar=name.upper())
    elif typing.get_origin(ann) is dict and typing.get_args(ann)[0] is int:
        kwargs.update(type=_int_keyed_json, metavar='JSON')
        kwargs['help'] += ", as a JSON object, e.g. '{\"50256\": -100}'"
    else:
        raise TypeError(f'no flag type for field {name!r} of type {field.annotation}')
    return kwargs


def _int_keyed_json(text: str) -> dict:
    """A JSON object whose keys are integers written as strings (``'{"7": 1.5}'`` -> ``{7: 1.5}``)."""
    try:
        obj = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f'not JSON: {err}') from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and k.strip().lstrip('-').isdigit() for k in obj):
        raise argparse.ArgumentTypeError(f'a JSON object with integer keys, e.g. \'{{"7": 1.5}}\', got {text!r}')
    return {int(k): v for k, v in obj.items()}


def add_model_args(parser: argparse.ArgumentParser, model_cls: type[BaseModel], title: str,
                   group_by_prefix: dict[str, str] | None = None) -> None:
    """Add one flag per field of ``model_cls`` to ``parser``.

    Args:
        parser: the (sub)command parser.
        model_cls: a pydantic model whose fields have int/float/str/bool/Literal/list types,
            optionally ``| None``.
        title: heading of the flag group in ``--help``.
        group_by_prefix: ``{field_prefix: title}``; fields starting with a prefix go into a
            separate group (e.g. the Mooncake Store flags).

    Raises:
        TypeError: a field type with no flag mapping.
        argparse.ArgumentError: a field's flag collides with an existing one.
    """
    groups = {None: parser.add_argument_group(title)}
    for prefix, sub_title in (group_by_prefix or {}).items():
        groups[prefix] = parser.add_argument_group(sub_title)
    for name, field in model_cls.model_fields.items():
        if is_nested_model(field):
            continue
        prefix = next((p for p in (group_by_prefix or {}) if name.startswith(p)), None)
        groups[prefix].add_argument(flag_name(name), **_flag_kwargs(name, field))


def is_nested_model(field) -> bool:
    """The field holds another pydantic model (its flags are added by the command itself)."""
    try:
        ann = _unwrap_optional(field.annotation)
    except TypeError:
        return False
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def model_from_args(args: argparse.Namespace, model_cls: type[BaseModel], flag_names: dict[str, str] | None = None,
                    **nested):
    """Build ``model_cls`` from the flags given on the command line (others keep their defaults).

    ``nested`` gives values of nested-model fields (see :func:`is_nested_model`) the command
    collected from its own flags; ``flag_names`` maps their dotted field paths
    (``speculative_config.method``) to those flags for error messages.

    Raises:
        ValueError: the model rejects the values; the message names each field and its flag (a
            check across fields: the flags of the fields its message names).
    """
    values = {name: getattr(args, name) for name in model_cls.model_fields if hasattr(args, name)}
    values.update({name: value for name, value in nested.items() if value is not None})
    try:
        return model_cls(**values)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = '.'.join(str(p) for p in e['loc'])
            # a validator's ValueError: its own message, without pydantic's 'Value error, ' prefix
            err_ = e.get('ctx', {}).get('error') if e['type'] == 'value_error' else None
            message = str(err_) if err_ is not None else e['msg']
            # a nested field no flag of its own sets (an unknown key of a JSON flag's object):
            # the flag of the field it is in
            flag = (flag_names or {}).get(field) or flag_name(field.split('.', 1)[0])
            # a nested model's own validator (loc = the nested field): name the flags of the
            # sub-fields its message mentions, which are what the user typed
            subs = [f for path, f in (flag_names or {}).items() if field and path.startswith(field + '.')
                    and re.search(rf'\b{re.escape(path.rsplit(".", 1)[1])}\b', message)]
            if subs:
                flag = ', '.join(dict.fromkeys(subs))
            where = f'{field} ({flag}): ' if field else _mentioned_flags(model_cls, message)
            lines.append(where + message)
        raise ValueError('; '.join(lines)) from None


def _mentioned_flags(model_cls: type[BaseModel], message: str) -> str:
    """``'--a-field, --b-field: '``: the flags of the fields of ``model_cls`` that a whole-model
    validator's ``message`` names (``prefill_save_alignment (100) must be a positive multiple of
    block_size (64)``), in the order it names them, since its error has no field of its own and
    a command-line user typed flags; ``''`` when it names none."""
    found = []
    for name, field in model_cls.model_fields.items():
        match = None if is_nested_model(field) else re.search(rf'\b{re.escape(name)}\b', message)
        if match is not None:
            found.append((match.start(), flag_name(name)))
    return ', '.join(flag for _, flag in sorted(found)) + ': ' if found else ''


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` (default INFO) for the ``lmdeploy`` logger and the HTTP server."""
    parser.add_argument('--log-level', type=str.upper, choices=LOG_LEVELS, default='INFO',
                        help='log level (default: INFO)')


def int_at_least(minimum: int):
    """argparse type of an integer flag with a lower bound: ``int_at_least(1)`` for a count.

    Raises (from the returned function):
        argparse.ArgumentTypeError: not an integer, or below ``minimum`` (argparse names the flag).
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f'must be an integer, got {text!r}') from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f'must be >= {minimum}, got {value}')
        return value
    parse.__name__ = f'int >= {minimum}'
    return parse


def port_number(text: str) -> int:
    """argparse type of a TCP port flag: an integer 0-65535 (0 = let the system or the service
    pick one where the flag allows it).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range (argparse names the flag).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be a port number, got {text!r}') from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f'must be a port number 0-65535, got {value}')
    return value


def api_key(text: str) -> str:
    """argparse type of ``--api-keys``: a non-empty token without whitespace (an empty key would
    silently turn authentication off).

    Raises:
        argparse.ArgumentTypeError: empty, or containing whitespace.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError('an API key must not be empty (omit --api-keys to serve without '
                                         'authentication)')
    if any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError('an API key must not contain whitespace')
    return text


def check_creatable_dir(path, what: str) -> None:
    """Refuse a folder flag's ``path`` that cannot be a folder, creating nothing (a refused command
    line leaves nothing behind): one that exists and is not a directory, or whose nearest
    existing parent is not a directory or not writable. ``what`` names it in the message, e.g.
    ``'log_dir (--log-dir)'``.

    Raises:
        ValueError: ``what``, the path and the reason.
    """
    from pathlib import Path
    path = Path(path)
    what = f'{what} {str(path)!r}'
    if path.exists():
        if not path.is_dir():
            raise ValueError(f'{what} exists and is not a directory')
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f'{what} cannot be created: {str(parent)!r} is not a directory')
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f'{what} cannot be created: {str(parent)!r} is not writable')
