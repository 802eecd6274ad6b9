"""Configuration values are taken as given or refused by field name, never silently converted.

Every True/False, integer and number field of ``PytorchEngineConfig``, ``SpeculativeConfig`` and
``GenerationConfig`` is tried with the values pydantic's lax mode would convert (``True`` for 1,
``'10'`` for 10, ``'yes'`` for True); the Store addresses are checked when the config is built,
not after the weights load.
"""
import logging
import subprocess
import sys
import types
import typing

import pytest

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.messages import SpeculativeConfig

MODELS = [PytorchEngineConfig, SpeculativeConfig, GenerationConfig]
REQUIRED = {SpeculativeConfig: dict(method='ngram')}


def _admitted(annotation) -> set:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {t for a in typing.get_args(annotation) for t in _admitted(a)}
    if typing.get_origin(annotation) is typing.Annotated:
        return _admitted(typing.get_args(annotation)[0])
    return {annotation}


def _fields(kind):
    for model in MODELS:
        for name, info in model.model_fields.items():
            admitted = _admitted(info.annotation)
            if kind == 'bool' and bool in admitted or \
                    kind == 'number' and admitted & {int, float} and bool not in admitted:
                yield model, name


@pytest.mark.parametrize('model, name', list(_fields('bool')), ids=lambda x: getattr(x, '__name__', x))
@pytest.mark.parametrize('value', [1, 0, 'yes', 'true', 'False', None, 1.0])
def test_a_true_false_field_takes_only_true_or_false(model, name, value):
    if value is None and type(None) in _admitted(model.model_fields[name].annotation):
        return
    with pytest.raises(ValueError, match=name):
        model(**REQUIRED.get(model, {}), **{name: value})
    cfg = model(**REQUIRED.get(model, {}))
    with pytest.raises(ValueError, match=name):          # assignment is validated too
        setattr(cfg, name, value)
    assert getattr(model(**REQUIRED.get(model, {}), **{name: True}), name) is True


@pytest.mark.parametrize('model, name', list(_fields('number')), ids=lambda x: getattr(x, '__name__', x))
@pytest.mark.parametrize('value', [True, False, '10', '0.5', b'1'])
def test_a_number_field_takes_no_bool_and_no_string(model, name, value):
    with pytest.raises(ValueError, match=name):
        model(**REQUIRED.get(model, {}), **{name: value})
    cfg = model(**REQUIRED.get(model, {}))
    with pytest.raises(ValueError, match=name):
        setattr(cfg, name, value)


def test_float_fields_still_take_integers_and_defaults_still_validate():
    assert PytorchEngineConfig(cache_max_entry_count=1).cache_max_entry_count == 1.0
    assert GenerationConfig(temperature=0, top_p=1, repetition_penalty=2).temperature == 0.0
    for model in MODELS:
        model(**REQUIRED.get(model, {}))
    assert PytorchEngineConfig(speculative_config=dict(method='ngram', num_speculative_tokens=2)).speculative_config


@pytest.mark.parametrize('value', [[True], ['3'], [1, False]])
def test_stop_token_ids_take_integers_only(value):
    with pytest.raises(ValueError, match='stop_token_ids'):
        GenerationConfig(stop_token_ids=value)


@pytest.mark.parametrize('value', [1e-300, 0.001, 101, 1e300])
def test_repetition_penalty_outside_the_api_range_is_refused(value):
    """Beyond 0.01-100 the penalised logits overflow float32 (the API server's range too)."""
    with pytest.raises(ValueError, match='repetition_penalty'):
        GenerationConfig(repetition_penalty=value)
    assert GenerationConfig(repetition_penalty=0.01).repetition_penalty == 0.01
    assert GenerationConfig(repetition_penalty=100).repetition_penalty == 100


@pytest.mark.parametrize('master', ['127.0.0.1:notaport', 'LOCAL', 'Local', '127.0.0.1', ':50051', '127.0.0.1:0',
                                    '127.0.0.1:65536', 'host:-1', '', 'http://127.0.0.1:50051', 'tcp://h:1',
                                    ' 127.0.0.1:50051', 'a b:50051', '::1:50051', '[nope]:50051',
                                    '127.0.0.1:\uff15\uff10', 'h/x:50051'])
def test_a_malformed_mooncake_master_is_refused_by_name(master):
    with pytest.raises(ValueError, match='mooncake_master'):
        PytorchEngineConfig(mooncake_master=master, mooncake_metadata_server='http://127.0.0.1:8080/metadata')


@pytest.mark.parametrize('url', ['127.0.0.1:24101/metadata', 'not a url', 'http://:80/metadata', 'ftp://h:1/x',
                                 'http://h:99999/metadata', 'localhost', '127.0.0.1', '', 'http://127.0.0.1:8080',
                                 'http://127.0.0.1:8080/', 'http://127.0.0.1:8080/metadata ', 'etcd://h',
                                 'etcd://h:2379/x', 'p2phandshake'])
def test_a_malformed_metadata_server_is_refused_by_name_before_any_connection(url):
    with pytest.raises(ValueError, match='mooncake_metadata_server') as err:
        PytorchEngineConfig(mooncake_master='127.0.0.1:50051', mooncake_metadata_server=url)
    if url == '127.0.0.1:24101/metadata':
        assert 'did you mean http://127.0.0.1:24101/metadata' in str(err.value)


@pytest.mark.parametrize('master, url', [
    ('127.0.0.1:50051', 'http://127.0.0.1:8080/metadata'), ('[::1]:50051', 'https://meta.example:443/metadata'),
    ('store-host:50051', 'etcd://etcd-host:2379'), ('store-host:50051', '127.0.0.1:2379'),
    ('store-host:50051', 'redis://redis-host:6379'), ('store-host:50051', 'P2PHANDSHAKE'), ('local', None)])
def test_store_addresses_mooncake_accepts_are_kept(master, url):
    cfg = PytorchEngineConfig(mooncake_master=master, mooncake_metadata_server=url)
    assert (cfg.mooncake_master, cfg.mooncake_metadata_server) == (master, url)


def test_a_metadata_scheme_in_upper_case_is_written_in_lower_case():
    # Mooncake's native client aborts the process on an unknown (upper-case) scheme
    cfg = PytorchEngineConfig(mooncake_master='h:1', mooncake_metadata_server='HTTP://127.0.0.1:8080/metadata')
    assert cfg.mooncake_metadata_server == 'http://127.0.0.1:8080/metadata'
    cfg = PytorchEngineConfig(mooncake_master='h:1', mooncake_metadata_server='Etcd://h:2379')
    assert cfg.mooncake_metadata_server == 'etcd://h:2379'


def test_numpy_scalars_of_the_fields_own_kind_are_taken():
    import numpy as np
    cfg = PytorchEngineConfig(enable_prefix_caching=np.bool_(True), max_batch_size=np.int64(3),
                              cache_max_entry_count=np.float32(0.5))
    assert cfg.enable_prefix_caching is True and cfg.max_batch_size == 3 and cfg.cache_max_entry_count == 0.5
    for fields, name in ((dict(max_new_tokens=2.0), 'max_new_tokens'), (dict(top_k=np.float64(2)), 'top_k'),
                         (dict(ignore_eos=np.int64(1)), 'ignore_eos')):
        with pytest.raises(ValueError, match=name):
            GenerationConfig(**fields)


def test_log_level_shows_info_lines_in_a_program_without_logging_configured(tiny_qwen3):
    """``pipeline(..., log_level='INFO')`` in a fresh program prints the engine's INFO lines on
    stderr (Python alone would show only warnings); a program that configured logging itself
    gets no second handler."""
    code = ('import logging, sys\n'
            'from lmdeploy import pipeline, PytorchEngineConfig\n'
            'if sys.argv[1] == "configured": logging.basicConfig(level="INFO", format="ROOT %(message)s")\n'
            'cfg = PytorchEngineConfig(device_type="cpu", num_gpu_blocks=16, block_size=16)\n'
            f'p = pipeline({tiny_qwen3!r}, backend_config=cfg, log_level="INFO")\n'
            'logging.getLogger("lmdeploy").info("marker line")\n'
            'p.close()\n')
    for mode in ('fresh', 'configured'):
        proc = subprocess.run([sys.executable, '-c', code, mode], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if 'marker line' in line]
        assert len(lines) == 1, proc.stderr
        assert (' INFO lmdeploy: marker line' in lines[0]) if mode == 'fresh' else lines[0] == 'ROOT marker line'


def test_every_registered_model_owns_its_config_audit():
    """Config checks dispatch through the model registry: each model class declares the fields
    transformers reads (``config_fields``) and its ``check_config``, so adding a family touches
    no shared ladder."""
    from lmdeploy.pytorch.models import MODEL_REGISTRY, get_model_class
    from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, IMPLEMENTED, INERT
    assert set(FIELDS) == set(MODEL_REGISTRY)
    for model_type in MODEL_REGISTRY:
        cls = get_model_class(model_type)
        assert callable(cls.check_config), model_type
        assert FIELDS[model_type] is cls.config_fields
        assert set(cls.config_fields.values()) <= {CHECKED, IMPLEMENTED, INERT}, model_type
    source = open(__import__('lmdeploy.pytorch.models.config_audit', fromlist=['x']).__file__).read()
    assert 'model_type ==' not in source and 'model_type in' not in source
