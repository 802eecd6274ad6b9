"""A configuration error speaks to the user who made it: a Python caller set config fields and
reads them (``use tp=1``); a command-line user typed flags and reads those (``use --tp 1``), the
form ``lmdeploy.cli.entrypoint.cli_message`` gives every message ``lmdeploy`` prints. A table of
bad engine configurations, checked by the config itself and by the engine's checks once a model
is read (called directly, so nothing is loaded), walked in both forms."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from lmdeploy.cli.entrypoint import _FIELD_VALUE, build_parser, cli_message
from lmdeploy.cli.serve import engine_config_from_args
from lmdeploy.messages import PytorchEngineConfig

FLAG = re.compile(r'(?<![\w-])--[a-z][\w-]*')

# command lines the config refuses (PytorchEngineConfig's field and whole-model checks)
BAD_FLAGS = [
    ['--tp', '0'], ['--block-size', '0'], ['--block-size', '48'], ['--prefill-save-alignment', '100'],
    ['--cache-max-entry-count', '2'], ['--store-timeout-s', 'inf'], ['--store-writers', '65'],
    ['--mooncake-segment-size', '100'], ['--mooncake-master', 'http://a:1'], ['--store-backend', 'x'],
    ['--store-namespace', 'a b'], ['--mooncake-metadata-server', 'nope'],
    ['--enable-prefix-caching', '--mooncake-master', '127.0.0.1:5'],
    ['--store-backend', 'file:/s', '--mooncake-master', 'local'],
    ['--role', 'prefill'], ['--role', 'decode', '--store-backend', 'file:/s'],
    ['--kv-events-endpoint', 'tcp://127.0.0.1:5'], ['--kv-events-endpoint', 'udp://x'],
    ['--kv-events-replay-endpoint', 'tcp://127.0.0.1:5'],
    ['--enable-prefix-caching', '--kv-events-endpoint', 'tcp://127.0.0.1:5',
     '--kv-events-replay-endpoint', 'tcp://127.0.0.1:5'],
    ['--speculative-num-draft-tokens', '3'],
    ['--speculative-algorithm', 'ngram', '--speculative-ngram-min', '5'],
    ['--speculative-config', '{"method": "ngram", "bogus": 1}'],
]


def _api_server():
    serve = build_parser()._subparsers._group_actions[0].choices['serve']
    return serve._subparsers._group_actions[0].choices['api_server']


@pytest.fixture(scope='module')
def command():
    return _api_server()


def _engine_check_errors() -> list[tuple[str, str]]:
    """(name, message) of the engine's own configuration checks, raised by calling them on
    inputs they refuse."""
    import torch

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from lmdeploy.pytorch.models import loader, mtp_head_class
    errors = []

    class Unsplit:      # an MTP head the tensor-parallel layout cannot shard
        supports_tp = False

    original = loader.mtp_head_class
    loader.mtp_head_class = lambda config: Unsplit
    try:
        loader._mtp_head(SimpleNamespace(model_type='qwen3_next'), SimpleNamespace(size=2))
    except ValueError as err:
        errors.append(('mtp under tp', str(err)))
    finally:
        loader.mtp_head_class = original
    for name, call in [('tp of an unsplit model', lambda: TPLayout(SimpleNamespace(model_type='nope'), 0, 2)),
                       ('mtp without a head', lambda: mtp_head_class(SimpleNamespace(model_type='qwen3')))]:
        with pytest.raises(ValueError) as err:
            call()
        errors.append((name, str(err.value)))
    from lmdeploy.pytorch.engine import cache_sizing
    cpu = torch.device('cpu')
    for name, cfg, call in [
            ('caches beyond RAM', SimpleNamespace(num_gpu_blocks=1 << 40),
             lambda cfg: cache_sizing.check_cache_fits(1 << 20, 1 << 20, cfg, 1 << 40, 16, cpu)),
            ('state slots over the budget', SimpleNamespace(cache_bytes=1 << 20, block_size=64),
             lambda cfg: cache_sizing.derive_num_blocks(1 << 10, 1 << 20, cfg, 16, cpu, 16, 1024)),
            ('no block in the budget', SimpleNamespace(cache_bytes=0, cache_max_entry_count=1e-9, block_size=64),
             lambda cfg: cache_sizing.derive_num_blocks(1 << 20, 0, cfg, 0, cpu, 16, 1024))]:
        with pytest.raises(ValueError) as err:
            call(cfg)
        errors.append((name, str(err.value)))
    if not torch.cuda.is_available():
        from lmdeploy.pytorch.engine.engine import Engine
        with pytest.raises(ValueError) as err:
            Engine('/nonexistent', PytorchEngineConfig(device_type='cuda'))
        errors.append(('cuda without cuda', str(err.value)))
    assert len(errors) >= 3
    return errors


def _cases(command):
    for argv in BAD_FLAGS:
        args = command.parse_args(['/m', *argv])
        with pytest.raises(ValueError) as err:
            engine_config_from_args(args)
        yield argv, str(err.value), args
    for name, message in _engine_check_errors():
        yield name, message, command.parse_args(['/m'])


def test_every_config_error_names_real_flags_for_the_command_line(command):
    """Over the table: the command-line form names at least one flag, every flag it names is one
    ``lmdeploy serve api_server --help`` lists, every config field it names comes with its flag,
    and a ``field=value`` it still shows is the subject (its flag right after it) or a field of
    a check across fields whose flags lead the message."""
    help_flags = set(FLAG.findall(command.format_help()))
    fields = [f for f in PytorchEngineConfig.model_fields if f != 'speculative_config']
    for case, message, args in _cases(command):
        shown = cli_message(command, message, args)
        named = FLAG.findall(shown)
        assert named and set(named) <= help_flags, (case, shown)
        for field in fields:
            if re.search(rf'(?<![\w.]){field}\b', shown):
                assert re.search(rf'{re.escape("--" + field.replace("_", "-"))}(?![\w-])', shown), (case, field, shown)
        for match in _FIELD_VALUE.finditer(shown):
            if match.group(1) in fields:
                assert shown.startswith(' (--', match.end()) or shown.startswith('--'), (case, match.group(0), shown)
        assert cli_message(command, shown, args) == shown, case       # rewritten once


def test_the_engines_checks_name_config_fields_for_python_callers(command):
    """The same checks raised to a Python caller name the config fields and values, never a
    flag (the command line adds those)."""
    for case, message, _ in _cases(command):
        if isinstance(case, str):
            assert not FLAG.search(message), (case, message)


@pytest.mark.parametrize('message, shown', [
    ('speculative_config.method=mtp: the qwen3_next MTP head (Unsplit) is not split for tensor parallelism; use tp=1',
     'speculative_config.method=mtp (--speculative-algorithm): the qwen3_next MTP head (Unsplit) is not split for '
     'tensor parallelism; use --tp 1'),
    ("tp (2): tensor parallelism supports model_type qwen3, not 'nope'; use tp=1",
     "tp (--tp 2): tensor parallelism supports model_type qwen3, not 'nope'; use --tp 1"),
    ('device_type is cuda, but this torch (2.13.0) sees no CUDA device; use device_type=cpu or device_type=auto',
     'device_type (--device-type) is cuda, but this torch (2.13.0) sees no CUDA device; use --device-type cpu or '
     '--device-type auto'),
    ('role=\'prefill\' hands prompts off through the Store tier, but no Store is configured (store_backend="file:DIR" '
     'or mooncake_master="HOST:PORT")', "role='prefill' (--role) hands prompts off through the Store tier, but no "
     'Store is configured (--store-backend file:DIR or --mooncake-master HOST:PORT)'),
    ('x needs enable_prefix_caching=True, not save_junction=False', 'x needs --enable-prefix-caching, not '
     '--no-save-junction'),
    ("use store_backend='file:/a b'", "use --store-backend 'file:/a b'"),
    # a check across fields whose flags lead: the fields' form stays
    ("--store-backend, --mooncake-master: store_backend='file:/s' and mooncake_master='local' name two Stores",
     "--store-backend, --mooncake-master: store_backend='file:/s' and mooncake_master='local' name two Stores"),
    ('not_a_field=1 is odd', 'not_a_field=1 is odd'),
    ('4 slots (max_batch_size / num_state_slots) do not fit: lower them or set num_gpu_blocks; max_batch_size',
     '4 slots (max_batch_size (--max-batch-size) / num_state_slots (--num-state-slots)) do not fit: lower them or '
     'set num_gpu_blocks (--num-gpu-blocks); max_batch_size'),        # a bare field: its flag once
    ('the tp size and role of model_type x', 'the tp size and role of model_type x'),     # prose words stay
    ('http://h/m?tp=1&block_size=2 refused', 'http://h/m?tp=1&block_size=2 refused'),     # a URL's query
])
def test_a_value_to_use_reads_as_the_command_line_to_type(command, message, shown):
    """The MTP-under-tensor-parallelism refusal said "use tp=1" to a command-line user, who
    types --tp 1."""
    assert cli_message(command, message, command.parse_args(['/m'])) == shown


def test_the_command_line_prints_the_flag_form(tiny_qwen3, capsys):
    """End to end through ``main``: a refusal raised after the config passed prints the flags."""
    import torch

    from lmdeploy.cli.entrypoint import main
    if torch.cuda.is_available():
        pytest.skip('this machine has CUDA')
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', tiny_qwen3, '--device-type', 'cuda'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('lmdeploy: error: device_type (--device-type) is cuda, but this torch') and \
        err.endswith('use --device-type cpu or --device-type auto\n'), err


# text a message may carry that names fields but is not a field to rewrite: JSON, quoted text,
# paths, URLs, model names (each must come out as it went in)
OPAQUE = ['{"max_batch_size": 4, "tp": [1, 2]}', '[session_len=3, tp=2]', '"max_batch_size=3 or tp=1"',
          "'session_len (x)'", '/models/session_len_test', 'http://h:1/v1?session_len=3&tp=2', 'org/my_model_v2',
          'file:/data/run=1/max_batch_size', '{"method": "mtp", "num_speculative_tokens": 2}',
          '"a quoted max_batch_size"', "{'a=b': {'c': [1, {'d': 2}]}}"]
# field=value pieces the rewrite turns into flags (their values must survive, quoted or not)
FIELD_VALUES = [('tp', '2'), ('session_len', '4096'), ('model_name', 'my_model_v2'), ('max_batch_size', '8'),
                ('store_backend', '"file:/tmp/a=b"'), ('enable_prefix_caching', 'True'),
                ('mooncake_master', '127.0.0.1:5'), ('speculative_config', '{"method": "mtp"}')]
PROSE = ['use', 'and', 'the', 'needs', 'got', "model's", 'tp', 'role', 'max_batch_size', 'num_state_slots', 'or']


def test_no_rewrite_mangles_json_quotes_paths_or_values(command):
    """Over generated messages (prose, ``field=value`` pieces and opaque text in any order): every
    piece of opaque text and every value comes out verbatim, and the rewrite is a fixpoint
    (a message in flag form is left as it is). The old rewrite put flags inside JSON keys and
    quoted text (``{"max_batch_size (--max-batch-size)": 4}``, ``speculative_config={"method"
    (--speculative-config): ...}``) and named a leading ``session_len=a,b``'s flag twice."""
    import random
    rng = random.Random(20261205)
    args = command.parse_args(['/m'])
    for _ in range(400):
        pieces, opaque, values = [], [], []
        for _ in range(rng.randint(1, 7)):
            kind = rng.random()
            if kind < 0.35:
                pieces.append(rng.choice(OPAQUE))
                opaque.append(pieces[-1])
            elif kind < 0.7:
                field, value = rng.choice(FIELD_VALUES)
                pieces.append(f'{field}={value}')
                (opaque if value[0] == '{' else values).append(value.strip('"'))
            else:
                pieces.append(rng.choice(PROSE))
        message = ' '.join(pieces) + rng.choice(['', '.', '; use tp=1', ': refused'])
        shown = cli_message(command, message, args)
        at = 0
        for text in opaque:                     # verbatim, in order
            found = shown.find(text, at)
            assert found >= 0, (message, shown, text)
            at = found + len(text)
        assert all(v in shown for v in values if v != 'True'), (message, shown)
        assert cli_message(command, shown, args) == shown, (message, shown)


@pytest.mark.parametrize('message, shown', [
    ('speculative_config={"method": "mtp"} is not valid', 'speculative_config={"method": "mtp"} is not valid'),
    ('the chat template {"max_batch_size": 4} rejected', 'the chat template {"max_batch_size": 4} rejected'),
    ('session_len=a,b is not a number', '--session-len a,b is not a number'),
    ("the name model_name='my max_batch_size model' is taken",
     "the name --model-name 'my max_batch_size model' is taken"),
    ('mooncake_master=127.0.0.1:5: refused', '--mooncake-master 127.0.0.1:5: refused'),
])
def test_json_and_quoted_text_stay_as_written(command, message, shown):
    """Regressions of the property above, each from a message the old rewrite mangled."""
    assert cli_message(command, message, command.parse_args(['/m'])) == shown
