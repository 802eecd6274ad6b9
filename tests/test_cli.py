"""The `lmdeploy` command line: flags generated from the config models, sub-commands, and the
interactive chat driven through stdin of a real subprocess."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from lmdeploy.cli.entrypoint import build_parser, main
from lmdeploy.cli.utils import add_model_args, flag_name, model_from_args
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.serve.openai.api_server import default_model_name

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(['serve', 'api_server', '/models/tiny', *flags])


def test_every_engine_field_has_its_kebab_case_flag():
    from lmdeploy.cli import serve
    api = serve.add_parser(argparse.ArgumentParser().add_subparsers())
    options = {opt for action in api._actions for opt in action.option_strings}
    for name in PytorchEngineConfig.model_fields:
        assert flag_name(name) in options, name
    assert '--prefill-save-last-only' in options and '--no-prefill-save-last-only' in options
    assert '--mooncake-master' in options and '--store-queue-size' in options


def test_no_flags_gives_the_default_config_and_server_defaults():
    args = serve_args()
    assert model_from_args(args, PytorchEngineConfig) == PytorchEngineConfig()
    assert (args.server_name, args.server_port, args.api_keys, args.model_name, args.log_level) == \
        ('0.0.0.0', 23333, None, None, 'INFO')
    assert args.model_path == '/models/tiny'


def test_flags_set_engine_fields_with_their_types():
    args = serve_args('--block-size', '16', '--prefill-save-alignment', '64', '--enable-prefix-caching',
                      '--prefill-save-last-only', '--session-len', '100', '--cache-max-entry-count', '0.25',
                      '--dtype', 'float32', '--mooncake-master', 'local', '--mooncake-protocol', 'tcp',
                      '--api-keys', 'k1', 'k2', '--server-port', '8000', '--log-level', 'debug')
    config = model_from_args(args, PytorchEngineConfig)
    assert config == PytorchEngineConfig(block_size=16, prefill_save_alignment=64, enable_prefix_caching=True,
                                         prefill_save_last_only=True, session_len=100, cache_max_entry_count=0.25,
                                         dtype='float32', mooncake_master='local', mooncake_protocol='tcp')
    assert (args.api_keys, args.server_port, args.log_level) == (['k1', 'k2'], 8000, 'DEBUG')
    assert model_from_args(serve_args('--no-enable-prefix-caching'), PytorchEngineConfig).enable_prefix_caching \
        is False


@pytest.mark.parametrize('flags,shown', [(['--dtype', 'int8'], '--dtype'), (['--block-size', 'x'], '--block-size'),
                                         (['--mooncake-protocol', 'udp'], '--mooncake-protocol'),
                                         (['--enable-prefix-caching', 'yes'], 'unrecognized arguments: yes'),
                                         (['--server-port', '99999'], '--server-port'),
                                         (['--server-port', '-5'], '--server-port'),
                                         (['--server-port', 'http'], '--server-port'),
                                         (['--api-keys', ''], '--api-keys'),
                                         (['--api-keys', 'k1', ' '], '--api-keys'),
                                         (['--api-keys', 'a b'], '--api-keys'),
                                         (['--model-name', ''], '--model-name: must not be empty'),
                                         (['--model-name', '  '], '--model-name: must not be empty'),
                                         (['--allowed-media-domains', 'http://x.org'], '--allowed-media-domains'),
                                         (['--allowed-media-domains', 'x.org:443'], '--allowed-media-domains'),
                                         (['--allowed-media-domains', 'x.org/p'], '--allowed-media-domains')])
def test_bad_flag_value_exits_2(flags, shown, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_args(*flags)
    assert exc.value.code == 2
    assert shown in capsys.readouterr().err


@pytest.mark.parametrize('command', [['serve', 'api_server', '/m'], ['serve', 'store'], ['chat', '/m'],
                                     ['make-tiny-model', '/out']])
def test_an_unknown_flag_is_reported_by_the_command_in_two_lines(command, capsys):
    """The error and where the flags are listed; not the command's whole usage first (about 45
    lines for serve api_server, which scrolled the "did you mean" away)."""
    with pytest.raises(SystemExit) as exc:
        main([*command, '--bogus', '1'])
    err = capsys.readouterr().err
    prog = 'lmdeploy ' + ' '.join(c for c in command if not c.startswith('/'))
    assert exc.value.code == 2
    assert err == f'{prog}: error: unrecognized arguments: --bogus 1\nsee `{prog} --help`\n'


@pytest.mark.parametrize('command, known', [(['serve', 'api_server'], ['--prefill-save-last', '--tp=2']),
                                            (['chat'], ['--temperature=-0.5']),
                                            (['make-tiny-model'], ['--arch', 'qwen3'])])
def test_an_unknown_flag_is_reported_also_when_the_path_is_missing(command, known, capsys):
    """argparse stops at the first error: a mistyped flag next to a missing path went unreported.
    Known flags (also a unique abbreviation, as argparse accepts) and negative numbers are not
    reported."""
    with pytest.raises(SystemExit) as exc:
        main([*command, *known, '--bogus', '--prefil-save-last-only=1'])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert 'the following arguments are required' in err
    hint = ' (did you mean --prefill-save-last-only?)' if command != ['make-tiny-model'] else ''
    assert err.splitlines()[0].endswith('unrecognized arguments: --bogus --prefil-save-last-only=1' + hint), err


@pytest.mark.parametrize('command, typo, meant', [
    (['serve', 'api_server', '/m'], '--enable-prefix-cachng', '--enable-prefix-caching'),
    (['serve', 'api_server', '/m'], '--blok-size=16', '--block-size'),
    (['serve', 'store'], '--segmnt-size', '--segment-size'),
    (['chat', '/m'], '--max-new-tokes', '--max-new-tokens'),
    (['chat', '/m'], '--temprature', '--temperature'),
    (['serve', 'api_server'], '--decode-save-lst', '--decode-save-last')])
def test_a_mistyped_flag_says_which_flag_was_meant(command, typo, meant, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, typo, '--qqqq'])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f'{typo} (did you mean {meant}?)' in err, err
    assert '--qqqq (did you mean' not in err and '--qqqq' in err      # nothing close: no suggestion


def test_native_logs_live_under_the_cache_root_not_the_temporary_folder(tmp_path, monkeypatch):
    from lmdeploy.cli.serve import native_log_path
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    assert native_log_path() == str(tmp_path / 'cache' / 'logs' / f'mooncake-{os.getpid()}.log')
    assert (tmp_path / 'cache' / 'logs').is_dir()


def test_media_url_flags_reach_the_server_policy():
    args = serve_args('--allowed-media-domains', 'Images.Example.COM.', 'cdn.example.com', '--allow-private-media-urls')
    assert args.allowed_media_domains == ['images.example.com', 'cdn.example.com'] and args.allow_private_media_urls
    defaults = serve_args()
    assert list(defaults.allowed_media_domains) == [] and not defaults.allow_private_media_urls


def test_server_name_that_does_not_resolve_says_so():
    from lmdeploy.serve.openai.api_server import check_port_free
    with pytest.raises(ValueError,
                       match=r"server_name \(--server-name\) 'no-such-host.invalid' is not an address or a name"):
        check_port_free('no-such-host.invalid', 0)
    with pytest.raises(ValueError, match='is not an address of this machine'):
        check_port_free('192.0.2.1', 0)          # TEST-NET-1: never assigned to this machine


def test_server_config_errors_name_the_python_argument_and_the_flag():
    # run_server and ResponseStoreLimits are called from Python as well as from the CLI
    from lmdeploy.serve.openai.api_server import check_port_free
    from lmdeploy.serve.openai.response_store import ResponseStoreLimits
    with pytest.raises(ValueError, match=r'server_port \(--server-port\) must be a port number 0-65535, got 70000'):
        check_port_free('127.0.0.1', 70000)
    for field, flag, value in (('max_entries', 'max-entries', -1), ('max_bytes', 'max-bytes', -1), ('ttl', 'ttl', 0)):
        with pytest.raises(ValueError, match=rf'^{field} \(--response-store-{flag}\) must be'):
            ResponseStoreLimits(**{field: value})


def test_bad_config_names_the_field_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', '/nonexistent', '--block-size', '64', '--prefill-save-alignment', '96'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'prefill_save_alignment' in err and '96' in err
    assert 'Value error' not in err       # pydantic's prefix of a validator's ValueError is not shown
    with pytest.raises(SystemExit):
        main(['serve', 'api_server', '/nonexistent', '--mooncake-segment-size', '100'])
    err = capsys.readouterr().err
    assert 'mooncake_segment_size (--mooncake-segment-size): mooncake_segment_size must be' in err, err
    with pytest.raises(SystemExit):
        main(['serve', 'api_server', '/nonexistent', '--block-size', '0'])
    assert 'block_size (--block-size)' in capsys.readouterr().err


def test_serve_store_with_a_host_it_cannot_bind_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'store', '--host', '256.1.1.1'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "host (--host) '256.1.1.1' cannot be bound" in err and 'Traceback' not in err, err


def test_serve_store_with_a_log_dir_it_cannot_create_exits_2_naming_it(tmp_path, capsys):
    a_file = tmp_path / 'f'
    a_file.write_text('')
    for log_dir, says in [(a_file, 'exists and is not a directory'),
                          (a_file / 'sub', f"cannot be created: '{a_file}' is not a directory")]:
        with pytest.raises(SystemExit) as exc:
            main(['serve', 'store', '--host', '127.0.0.1', '--log-dir', str(log_dir)])
        assert exc.value.code == 2
        assert capsys.readouterr().err == f"lmdeploy: error: log_dir (--log-dir) '{log_dir}' {says}\n"
    assert sorted(os.listdir(tmp_path)) == ['f']        # nothing was created


@pytest.mark.parametrize('flag', ['--master-port', '--metadata-port', '--metrics-port'])
def test_serve_store_port_flags_refuse_non_ports_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'store', flag, '70000'])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize('flag', ['--master-port', '--metadata-port', '--metrics-port'])
def test_serve_store_refuses_a_port_another_process_listens_on(flag, capsys, tmp_path):
    """A fixed port someone else listens on is refused before anything starts (it used to pass
    the readiness check, since the other process accepts connections, and the command said
    'ready' while pointing at the other process's service)."""
    import socket
    with socket.socket() as other:
        other.bind(('127.0.0.1', 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(['serve', 'store', flag, str(port), '--log-dir', str(tmp_path / 'logs')])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    field = flag[2:].replace('-', '_')
    assert f'{field}={port}' in err and 'already in use' in err and 'Traceback' not in err, err
    assert not (tmp_path / 'logs').exists()          # nothing was started


def test_external_master_without_metadata_server_is_refused_before_loading(capsys, monkeypatch):
    """The config itself refuses it (exit 2 naming the field), so no weights are read first."""
    from lmdeploy.pytorch.models import loader
    monkeypatch.setattr(loader, 'weight_files', lambda *a, **k: pytest.fail('weights were read'))
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', '/nonexistent', '--enable-prefix-caching', '--mooncake-master', '127.0.0.1:5'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'mooncake_metadata_server' in err and 'Traceback' not in err, err


def test_an_unknown_key_of_the_speculative_json_names_the_json_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', '/nonexistent', '--speculative-config', '{"method": "ngram", "bogus": 1}'])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ('lmdeploy: error: speculative_config.bogus (--speculative-config): Extra '
                                       'inputs are not permitted\n')


def test_a_speculative_config_check_names_the_flags_the_user_typed(capsys):
    """A check across two speculative fields names their flags, not the JSON flag."""
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', '/nonexistent', '--speculative-algorithm', 'ngram', '--speculative-ngram-min', '5'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert '--speculative-ngram-min' in err and '--speculative-config' not in err, err


@pytest.mark.parametrize('flags, line', [
    (['--prefill-save-alignment', '100'], '--prefill-save-alignment, --block-size: prefill_save_alignment (100) '
                                          'must be a positive multiple of block_size (64)'),
    (['--block-size', '48'], '--prefill-save-alignment, --block-size: prefill_save_alignment (1024) must be a '
                             'positive multiple of block_size (48)'),
    (['--store-backend', 'file:/s', '--mooncake-master', 'local'],
     "--store-backend, --mooncake-master: store_backend='file:/s' and mooncake_master='local' name two Stores: "
     'give one of them'),
])
def test_a_check_across_engine_fields_names_the_flags(flags, line, capsys):
    """A check across fields (no field of its own) names the flags of the fields its message
    names, in its order, before any model file is read: the command line's words, not only the
    config's."""
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', '/nonexistent', *flags])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f'lmdeploy: error: {line}\n'


@pytest.mark.parametrize('flags, names', [
    (['--num-gpu-blocks', str(2 ** 40)], ['num_gpu_blocks']),
    (['--max-batch-size', str(10 ** 9)], ['max_batch_size', 'num_state_slots']),
])
def test_caches_that_cannot_fit_in_memory_name_the_fields(tiny_qwen3_next, flags, names, capsys):
    """Asking for more cache than the machine has is a configuration error naming the fields
    (exit 2), not an allocator traceback."""
    with pytest.raises(SystemExit) as exc:
        main(['chat', tiny_qwen3_next, '--device-type', 'cpu', *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names) and 'Traceback' not in err, err


def test_cuda_device_without_cuda_names_the_field(tiny_qwen3, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip('this machine has CUDA')
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', tiny_qwen3, '--server-name', '127.0.0.1', '--server-port', '0',
              '--device-type', 'cuda'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'device_type (--device-type) is cuda' in err and 'Traceback' not in err, err


def test_an_unusable_file_store_folder_names_the_flag(tiny_qwen3_next, tmp_path, capsys):
    """A check the engine makes once the model is loaded knows only its config's field names:
    the command line adds the flag the user typed (here a `file:` Store folder that is a file)."""
    not_a_folder = tmp_path / 'store'
    not_a_folder.write_text('')
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', tiny_qwen3_next, '--server-name', '127.0.0.1', '--server-port', '0',
              '--enable-prefix-caching', '--store-backend', f'file:{not_a_folder}'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmdeploy: error: store_backend (--store-backend) folder '{not_a_folder}' cannot be used: "
                          '[Errno 20] Not a directory'), err
    assert 'Traceback' not in err


@pytest.mark.parametrize('message, shown', [
    ("store_backend folder '/x' cannot be used", "store_backend (--store-backend) folder '/x' cannot be used"),
    ('enable_prefix_caching is needed', 'enable_prefix_caching (--enable-prefix-caching) is needed'),
    ('device_type (--device-type) is cuda', 'device_type (--device-type) is cuda'),   # names it already
    ('block_size must be 16 (--block-size)', 'block_size must be 16 (--block-size)'),
    ('speculative_config (--speculative-ngram-min): 5 > 4', 'speculative_config (--speculative-ngram-min): 5 > 4'),
    ("model_path '/m' is not a model directory", "model_path '/m' is not a model directory"),   # positional
    ('--a, --b: a and b disagree', '--a, --b: a and b disagree'),
    ('no field here', 'no field here'),
    ('master_port=5: in use', 'master_port=5: in use'),
    ('block_size: must be > 0', 'block_size (--block-size): must be > 0'),
    ("role='prefill' hands prompts off", "role='prefill' (--role) hands prompts off"),
    ('speculative_config.method=mtp needs an MTP head',
     'speculative_config.method=mtp (--speculative-algorithm) needs an MTP head'),
    ('speculative_config.method=mtp: not split; use tp=1',
     'speculative_config.method=mtp (--speculative-algorithm): not split; use tp=1'),
    ('speculative_config.num_speculative_tokens is 3', 'speculative_config.num_speculative_tokens '
     '(--speculative-num-draft-tokens) is 3'),
    ('speculative_config.nothing=1 is odd', 'speculative_config.nothing=1 is odd'),
    ('', ''),
])
def test_an_error_starting_with_a_field_gets_its_flag(message, shown):
    from lmdeploy.cli.entrypoint import with_leading_flag
    assert with_leading_flag(_api_server_parser(), message) == shown


def _api_server_parser() -> argparse.ArgumentParser:
    command = build_parser()._subparsers._group_actions[0].choices['serve']
    return command._subparsers._group_actions[0].choices['api_server']


@pytest.mark.parametrize('typed', [(), ('--speculative-config', '{"method": "mtp"}')])
@pytest.mark.parametrize('shape', ['{} needs a model with an MTP head', '{}: not split', '{}', '{} (7) is too big'])
def test_every_engine_field_error_names_the_flag_the_user_typed(typed, shape):
    """Over every engine config field and every speculative field (as ``field`` or
    ``field=value`` at the start of an engine check's message): the message gets the flag that
    sets it, the one typed for a speculative field (its own flag, or the JSON flag when only that
    was given), exactly once."""
    from lmdeploy.cli.entrypoint import with_leading_flag
    from lmdeploy.cli.serve import SPECULATIVE_FLAGS
    from lmdeploy.messages import SpeculativeConfig
    command = _api_server_parser()
    args = command.parse_args(['/m', *typed])
    expected = {name: flag_name(name) for name in PytorchEngineConfig.model_fields if name != 'speculative_config'}
    by_field = {field: flag for flag, field in SPECULATIVE_FLAGS.items()}
    assert set(by_field) == set(SpeculativeConfig.model_fields)
    for field, flag in by_field.items():
        expected[f'speculative_config.{field}'] = '--speculative-config' if typed else flag_name(flag)
    for path, flag in expected.items():
        for lead in (path, f'{path}=x', f"{path}='a b'"):
            message = shape.format(lead)
            shown = with_leading_flag(command, message, args)
            if lead == path and shape.endswith('(7) is too big'):      # the value goes with the flag
                assert shown == f'{lead} ({flag} 7) is too big', (message, shown)
            else:
                assert shown == f'{lead} ({flag}){message[len(lead):]}', (message, shown)
            assert with_leading_flag(command, shown, args) == shown     # named once


def test_mtp_on_a_model_without_an_mtp_head_names_the_flag(tiny_qwen3, capsys):
    """The refusal comes from the model registry (which knows speculative_config.method); a
    command-line user typed --speculative-algorithm, or --speculative-config as JSON."""
    for typed, flag in ((['--speculative-algorithm', 'mtp'], '--speculative-algorithm'),
                        (['--speculative-config', '{"method": "qwen3_next_mtp"}'], '--speculative-config')):
        with pytest.raises(SystemExit) as exc:
            main(['chat', tiny_qwen3, '--device-type', 'cpu', *typed])
        assert exc.value.code == 2
        assert capsys.readouterr().err == (
            f'lmdeploy: error: speculative_config.method=mtp ({flag}) needs a model with an MTP head (glm5_next, '
            "glm5_next_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next), got 'qwen3'\n")


def test_missing_model_directory_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(['serve', 'api_server', str(tmp_path / 'nothing')])
    assert exc.value.code == 2
    assert 'config.json' in capsys.readouterr().err


def test_flags_follow_new_model_fields():
    class Toy(BaseModel):
        count_max: int | None = Field(None, ge=1, description='100% of it')
        use_fast: bool = True
        mode: Literal['a', 'b'] = 'a'
        words: list[str] = Field(default_factory=list)
        ratio: float = 0.5

    parser = argparse.ArgumentParser()
    add_model_args(parser, Toy, 'toy')
    assert model_from_args(parser.parse_args([]), Toy) == Toy()
    args = parser.parse_args(['--count-max', '3', '--no-use-fast', '--mode', 'b', '--words', 'x', 'y',
                              '--ratio', '2'])
    assert model_from_args(args, Toy) == Toy(count_max=3, use_fast=False, mode='b', words=['x', 'y'], ratio=2.0)
    with pytest.raises(ValueError, match=r'count_max \(--count-max\)'):
        model_from_args(parser.parse_args(['--count-max', '0']), Toy)
    assert '100%' in parser.format_help()


def test_chat_has_generation_flags():
    args = build_parser().parse_args(['chat', '/m', '--max-new-tokens', '7', '--stop-words', 'a', 'b',
                                      '--ignore-eos', '--random-seed', '3', '--block-size', '16',
                                      '--prefill-save-alignment', '64'])
    assert model_from_args(args, GenerationConfig) == GenerationConfig(max_new_tokens=7, stop_words=['a', 'b'],
                                                                       ignore_eos=True, random_seed=3)
    assert model_from_args(args, PytorchEngineConfig).block_size == 16


def test_default_model_name_is_the_directory_basename():
    assert default_model_name('/data/models/Qwen3-Next-80B/') == 'Qwen3-Next-80B'
    assert default_model_name('tiny') == 'tiny'


def test_make_tiny_model_subcommand(tmp_path, capsys):
    out = str(tmp_path / 'm')
    assert main(['make-tiny-model', out, '--arch', 'qwen3']) == 0
    assert capsys.readouterr().out.strip() == out
    with open(os.path.join(out, 'config.json')) as f:
        assert json.load(f)['model_type'] == 'qwen3'
    with pytest.raises(SystemExit) as exc:        # an MTP head only exists for qwen3_next
        main(['make-tiny-model', str(tmp_path / 'v'), '--arch', 'qwen3_5', '--mtp'])
    assert exc.value.code == 2 and '--mtp' in capsys.readouterr().err


def test_make_tiny_model_into_a_path_it_cannot_write_exits_2_naming_it(tmp_path, capsys):
    """An out_dir that is a file, or lies under one, is a one-line error naming out_dir (it was
    a FileExistsError / NotADirectoryError traceback)."""
    a_file = tmp_path / 'f'
    a_file.write_text('')
    for out, says in [(a_file, 'exists and is not a directory'),
                      (a_file / 'sub', 'cannot be written: [Errno 20] Not a directory')]:
        with pytest.raises(SystemExit) as exc:
            main(['make-tiny-model', str(out), '--arch', 'qwen3'])
        assert exc.value.code == 2
        assert capsys.readouterr().err.startswith(f"lmdeploy: error: out_dir '{out}' {says}")


def test_chat_subprocess_streams_replies_with_history(tiny_qwen3):
    from lmdeploy.serve.pipeline import Pipeline
    gen = GenerationConfig(max_new_tokens=6)
    engine = PytorchEngineConfig(session_len=512, enable_prefix_caching=True, block_size=16,
                                 prefill_save_alignment=64)
    history, replies = [{'role': 'system', 'content': 'Be brief.'}], []
    with Pipeline(tiny_qwen3, engine) as pipe:
        for line in ('Where is the library?', 'And the bridge?'):
            history.append({'role': 'user', 'content': line})
            replies.append(pipe(history, gen).text)
            history.append({'role': 'assistant', 'content': replies[-1]})
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONIOENCODING='utf-8')
    proc = subprocess.run([sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'chat', tiny_qwen3,
                           '--system', 'Be brief.', '--max-new-tokens', '6', '--session-len', '512',
                           '--enable-prefix-caching', '--block-size', '16', '--prefill-save-alignment', '64',
                           '--log-level', 'WARNING'],
                          input=b'Where is the library?\n\nAnd the bridge?\nexit\nnever read\n', capture_output=True,
                          cwd=REPO_ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors='replace')
    # bytes, not text mode: a reply may contain '\r', which universal newlines would rewrite
    assert proc.stdout.decode() == f'>>> {replies[0]}\n>>> >>> {replies[1]}\n>>> \n'
    assert replies[0] != replies[1]


def test_port_in_use_exits_2_before_loading_the_model(tmp_path, capsys):
    import socket
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            # the model directory does not exist: the port check must come first
            main(['serve', 'api_server', str(tmp_path / 'not-loaded'), '--server-name', '127.0.0.1',
                  '--server-port', str(port)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f'127.0.0.1:{port}' in err and '--server-port' in err and 'config.json' not in err


def test_serve_store_prints_the_api_server_flags_and_stops_on_sigterm(tmp_path):
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, MC_TCP_BIND_ADDRESS='127.0.0.1')
    log = tmp_path / 'store.out'
    with open(log, 'w') as out:
        from lmdeploy.pytorch.store.services import free_ports
        master_port, metadata_port = free_ports('127.0.0.1', 2)
        proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'serve', 'store',
                                 '--segment-size', str(32 << 20), '--log-dir', str(tmp_path / 'logs'),
                                 '--master-port', str(master_port), '--metadata-port', str(metadata_port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    try:
        deadline = time.time() + 60
        while 'metadata_server:' not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        text = log.read_text()
        assert f'metadata_server: http://127.0.0.1:{metadata_port}/metadata' in text, text
        master = text.split('mooncake_master: ')[1].split()[0]
        assert master == f'127.0.0.1:{master_port}'      # the ports asked for
        assert f'--mooncake-master {master} --mooncake-metadata-server http://127.0.0.1:' in text
        assert str(tmp_path / 'logs') in text and (tmp_path / 'logs' / 'master.log').exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert 'Mooncake Store stopped' in log.read_text()


def test_the_mooncake_log_is_routed_only_when_a_store_client_will_run(tiny_qwen3, tiny_qwen3_next):
    from lmdeploy.cli.serve import _uses_store
    from lmdeploy.messages import PytorchEngineConfig
    on = PytorchEngineConfig(enable_prefix_caching=True, mooncake_master='local')
    assert _uses_store(tiny_qwen3_next, on)
    assert not _uses_store(tiny_qwen3, on)                    # no recurrent state: no Store tier
    assert not _uses_store(tiny_qwen3_next, PytorchEngineConfig(mooncake_master='local'))   # caching off


@pytest.mark.parametrize('arch', ['qwen3', 'lfm2', 'mamba2', 'falcon_h1', 'nemotron_h', 'qwen3_5', 'granitemoe_swa',
                                  'olmo_hybrid', 'zamba2', 'lara_mini', 'lfm3'])
def test_the_store_client_is_predicted_for_every_family_with_state(arch, tmp_path):
    """Every family whose cache specs hold a state entry (short-conv, Mamba-2 alone, hybrid
    layers, composite vision-language configs) or a sliding-window layer starts a Store client;
    global attention alone does not (the engine decides by the specs, so the prediction does too)."""
    from lmdeploy.cli.serve import _uses_store
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.tools.make_tiny_model import build_config
    build_config(arch, vocab_size=64, eos_token_id=2, pad_token_id=0).to_json_file(str(tmp_path / 'config.json'))
    on = PytorchEngineConfig(enable_prefix_caching=True, mooncake_master='local')
    assert _uses_store(str(tmp_path), on) == (arch != 'qwen3')


def test_native_stderr_goes_to_the_log_file_and_python_stderr_stays(tmp_path):
    """What native code writes to fd 2 (the Mooncake client's glog lines) lands in the file;
    Python's logging and messages stay on the terminal, after one line saying where."""
    log = tmp_path / 'native.log'
    code = ('import logging, os, sys\n'
            'from lmdeploy.cli.serve import route_native_logs\n'
            f'route_native_logs({str(log)!r})\n'
            "os.write(2, b'E1201 transfer_metadata_plugin.cpp:292] metadata not found\\n')\n"
            "logging.basicConfig(stream=sys.stderr); logging.getLogger('x').warning('python says hi')\n")
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f'Mooncake client logs: {log}' in proc.stderr and 'python says hi' in proc.stderr
    assert 'metadata not found' not in proc.stderr
    assert 'metadata not found' in log.read_text() and 'python says hi' not in log.read_text()


def test_api_keys_help_names_every_protected_path():
    """``--api-keys`` help lists the paths that need a key (as a ``/prefix/*`` or the path itself)
    and the ones that stay open, read from the app's routes."""
    import types

    from lmdeploy.cli import serve
    from lmdeploy.serve.openai.api_server import create_app
    api = serve.add_parser(argparse.ArgumentParser().add_subparsers())
    help_text = next(a.help for a in api._actions if '--api-keys' in a.option_strings)
    pipe = types.SimpleNamespace(tokenizer=types.SimpleNamespace(chat_template=''), loop=None)
    app = create_app(pipe, 'm', ['k'], protect_metrics=False)
    for route in app.routes:
        if not getattr(route, 'methods', None) or not route.path.startswith('/'):
            continue
        protected = bool(getattr(route, 'dependencies', None))
        top = '/' + route.path.split('/')[1] + '/*'        # /v1/chat/completions -> /v1/*
        named = route.path in help_text or (route.path.count('/') > 1 and top in help_text)
        assert named, (route.path, help_text)
        if not protected:
            assert route.path in help_text.split('need one')[1], (route.path, help_text)


def test_logit_bias_flag_takes_a_json_object_with_integer_keys(capsys):
    args = build_parser().parse_args(['chat', '/m', '--logit-bias', '{"7": 1.5, "50": -100}'])
    assert args.logit_bias == {7: 1.5, 50: -100}
    for bad in ('{"a": 1}', '[1, 2]', 'not json'):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(['chat', '/m', '--logit-bias', bad])
        assert exc.value.code == 2 and '--logit-bias' in capsys.readouterr().err
