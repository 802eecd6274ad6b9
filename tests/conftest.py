"""Shared fixtures: tiny models made once per session with the project's maker, and the real
Mooncake Store services (tests/conftest_store.py)."""
import os

import pytest

import torch

os.environ.setdefault('MC_TCP_BIND_ADDRESS', '127.0.0.1')   # every Mooncake process stays on loopback
# The tiny models run many small ops: on a 2-core machine shared with server subprocesses, one
# intra-op thread per process is 10-20x faster than two contending ones.
os.environ.setdefault('OMP_NUM_THREADS', '1')
torch.set_num_threads(1)

# transformers' reference is its torch code even where fla-core / mamba_ssm / causal_conv1d are
# installed (they would otherwise take CPU or CUDA inputs): before any test imports a modeling module
from hf_reference import use_torch_reference  # noqa: E402

use_torch_reference()

pytest_plugins = ['conftest_store']


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'timing: bounds a wall-clock latency (a health probe, a shutdown): scripts/run_tests.sh runs '
        'these after the parallel run, in one process with nothing beside them')


@pytest.fixture(scope='session')
def tiny_qwen3(tmp_path_factory) -> str:
    """Path of a tiny full-attention Qwen3 checkpoint (float32)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_qwen3')), arch='qwen3', seed=0)


@pytest.fixture(scope='session')
def tiny_qwen3_next(tmp_path_factory) -> str:
    """Path of a tiny hybrid Qwen3-Next checkpoint (float32)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_qwen3_next')), arch='qwen3_next', seed=0)


@pytest.fixture(scope='session')
def tiny_qwen3_5(tmp_path_factory) -> str:
    """Path of a tiny vision-language Qwen3.5 checkpoint (float32; hybrid text stack, tiny vision
    tower, image special tokens in the tokenizer)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_qwen3_5')), arch='qwen3_5', seed=0)


@pytest.fixture(scope='session')
def tiny_qwen3_5_moe(tmp_path_factory) -> str:
    """Path of a tiny vision-language Qwen3.5-MoE checkpoint (float32; experts stored per expert,
    an ``mtp.*`` head)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_qwen3_5_moe')), arch='qwen3_5_moe', seed=0)


@pytest.fixture(scope='session')
def tiny_qwen3_5_moe_text(tmp_path_factory) -> str:
    """Path of a tiny text-only Qwen3.5-MoE checkpoint (float32; experts per expert, ``mtp.*`` head)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp('tiny_qwen3_5_moe_text')), arch='qwen3_5_moe_text', seed=0)


@pytest.fixture(scope='module')
def family_paths(tmp_path_factory):
    """``path(arch, overrides)``: the path of a tiny ``arch`` checkpoint (seed 0, ``overrides``
    passed to the maker), made on first use and reused within the module (keyed by the arch
    and the override names)."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    made = {}

    def path(arch: str, overrides: dict) -> str:
        key = (arch, tuple(sorted(overrides)))
        if key not in made:
            made[key] = make_tiny_model(str(tmp_path_factory.mktemp(f'family_{arch}')), arch=arch, seed=0, **overrides)
        return made[key]
    return path
