"""The shared harness of the model-family test files (Mamba, Mamba-2, Jamba, Bamba, Falcon-H1,
Ling 3, MiniMax-01, Lara-4-Mini, LFM3, OLMo Hybrid, Zamba2, Kimi-Linear, Nemotron-H): the
conformance checks every family runs against transformers on its tiny checkpoint, continuous
batching equal to each request alone, a new engine restoring a prefix from a
``file:`` Store, a transformers model with seeded random weights written as a checkpoint under
other switches, a copy of the tiny checkpoint with other tensors or config fields, TP2 = TP1
with its split count and a refused head count, and the config audit's checks.

A family's file keeps a module fixture ``tiny`` (its ``(checkpoint path, transformers float32
reference)`` from :func:`engine_utils.tiny_checkpoint_and_reference`, or ``tiny =
tiny_fixture(arch)``) and subclasses :class:`FamilyConformance`; everything specific to the
family stays in its file.
"""
from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from engine_utils import (StepRecorder, check_four_turn_chat_under_every_cache_policy,
                          check_greedy_equals_transformers_cold_chunked_and_after_restore,
                          check_prompt_logits_match_transformers, load_hf, make_engine, random_prompt, run_alone,
                          run_staggered, tiny_checkpoint_and_reference)
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.models.config_audit import CHECKED, FIELDS, check_config

# (prompt tokens, prefill chunk): one short prompt, long ones cold and in chunks of 32 tokens
LOGITS_CASES = ((5, 8192), (150, 32), (700, 32), (300, 8192))


def tiny_fixture(arch: str, load=load_hf):
    """The module fixture ``tiny`` of a family's file, assigned as ``tiny = tiny_fixture(arch)``:
    ``(checkpoint path in the published layout, transformers float32 reference)`` of
    ``make_tiny_model(arch, seed=0)``, made once per module."""
    @pytest.fixture(scope='module', name='tiny')
    def tiny(tmp_path_factory):
        return tiny_checkpoint_and_reference(tmp_path_factory, arch, load)
    return tiny


def published_config_and_names(path: str) -> tuple[dict, set[str]]:
    """The checkpoint at ``path`` as written: its ``config.json`` (a plain dict, not a transformers
    config, so published field spellings show) and the tensor names of its ``model.safetensors``."""
    from safetensors import safe_open
    config = json.loads((Path(path) / 'config.json').read_text())
    with safe_open(str(Path(path) / 'model.safetensors'), framework='pt') as f:
        return config, set(f.keys())


def tiny_cache_specs(path: str, model_type: str, dtype: torch.dtype):
    """``(config, specs)``: the transformers config of the checkpoint at ``path`` and the layer
    cache specs ``model_type``'s class declares for it in ``dtype``."""
    from transformers import AutoConfig

    from lmdeploy.pytorch.models import get_model_class
    config = AutoConfig.from_pretrained(path)
    return config, get_model_class(model_type).cache_specs(config, dtype)


class FamilyConformance:
    """The checks every family's tiny checkpoint passes (uses the module's ``tiny`` fixture):
    logits <= 1e-4 of transformers' in fp32 at every prompt position for each of
    ``logits_cases`` (prompt tokens, prefill chunk), greedy tokens equal transformers' cold,
    chunked and after a local prefix-cache restore, and a 4-turn chat identical with the prefix
    cache off / on / last-only / turn-end."""
    logits_cases: tuple[tuple[int, int], ...] = LOGITS_CASES

    def pytest_generate_tests(self, metafunc):
        if 'logits_case' in metafunc.fixturenames:
            metafunc.parametrize('logits_case', self.logits_cases, ids=[f'{n}-{c}' for n, c in self.logits_cases])

    def test_prompt_logits_match_transformers_cold_and_chunked(self, tiny, logits_case):
        check_prompt_logits_match_transformers(*tiny, *logits_case)

    def test_greedy_equals_transformers_cold_chunked_and_after_prefix_cache_restore(self, tiny):
        check_greedy_equals_transformers_cold_chunked_and_after_restore(*tiny)

    def test_four_turn_chat_is_identical_under_every_cache_policy(self, tiny):
        check_four_turn_chat_under_every_cache_policy(tiny[0])


def check_continuous_batching_equals_each_request_alone(path: str) -> StepRecorder:
    """Four requests (9, 45, 17 and 70 prompt tokens, 6 new tokens each) added two steps apart
    to one engine (block size 16, 32-token prefill chunks) while the others run decode what each
    decodes alone. Returns the recorder of the staggered engine's forwards (which ran mixed
    prefill + decode forwards, how many sequences together)."""
    prompts = [random_prompt(n, seed=70 + n) for n in (9, 45, 17, 70)]
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    alone = run_alone(make_engine(path, block_size=16), prompts, gen)
    engine = make_engine(path, block_size=16, max_prefill_token_num=32)
    rec = StepRecorder(engine)
    together = run_staggered(engine, prompts, gen, every=2)
    assert [s.output_ids for s in together] == alone
    return rec


def check_a_new_engine_restores_from_a_file_store(path: str, tmp_path: Path, seed: int, put_objects: dict) -> None:
    """A writer engine prefills a 300-token prompt (64-token chunks, checkpoints every 64 tokens,
    a ``file:`` Store) and puts exactly ``put_objects`` (``{'state': n, 'kv': m}``); a new engine
    with an empty local cache restores 256 tokens from the Store, and both decode what a cold
    engine decodes."""
    ids = random_prompt(300, seed=seed)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    fields = dict(block_size=16, prefill_save_alignment=64, max_prefill_token_num=64, enable_prefix_caching=True,
                  store_backend=f'file:{tmp_path / "store"}')
    writer = make_engine(path, **fields)
    first = writer.generate(ids, gen)
    assert writer.store.flush(timeout=30)
    assert writer.stats()['store_put_objects'] == put_objects
    writer.close()
    reader = make_engine(path, **fields)
    try:
        again = reader.generate(ids, gen)
        assert again.num_cached_tokens == again.stats.store_hit_tokens == 256
    finally:
        reader.close()
    cold = make_engine(path, max_prefill_token_num=64).generate(ids, gen).output_ids
    assert first.output_ids == again.output_ids == cold


def check_store_put_bytes_against_mooncake(path: str, mooncake_services, last_only: bool, max_turns: int,
                                           seed: int) -> None:
    """Two seed scenarios scaled by 1/16 against the real Mooncake Store (``mooncake_services``,
    the session's): the engine's put bytes and objects equal ``simulate()`` fed the engine's S and
    K_blk, and ``sizes_from_config`` of the checkpoint's config.json gives those same S and K_blk
    (specs alone, no model branch); ``check_store_put_bytes_equal_the_simulator``
    (tests/test_benchmark_store_bytes.py) with ``max_turns`` and ``seed``."""
    from test_benchmark_store_bytes import check_store_put_bytes_equal_the_simulator
    store = dict(mooncake_master=mooncake_services.master_address,
                 mooncake_metadata_server=mooncake_services.metadata_server)
    check_store_put_bytes_equal_the_simulator(path, last_only, store, max_turns=max_turns, seed=seed)


def check_tp2_equals_tp1_and_refusal(path: str, split: int, refuse: dict, match: str) -> list:
    """Over 2 ranks each split tensor of the checkpoint at ``path`` tiles its axis once and there
    are ``split`` of them; a TP2 engine's logits and staggered greedy tokens equal TP1's; the
    config with ``refuse`` set (e.g. ``{'num_key_value_heads': 1}``) is refused by a tp = 2
    ``TPLayout`` with a ValueError matching ``match``. Returns the two ranks' layouts."""
    from lmdeploy.pytorch.distributed.sharding import TPLayout
    from test_tensor_parallel import check_tp2_equals_tp1, check_tp_slices_tile_every_split_tensor
    config, layouts, got = check_tp_slices_tile_every_split_tensor(path)
    assert got == split
    check_tp2_equals_tp1(path)
    for k, v in refuse.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=match):
        TPLayout(config, 0, 2)
    return layouts


def _save_tensors(tensors: dict, path: Path) -> None:
    """``tensors`` (name -> tensor) as ``path``; each is copied first because safetensors refuses
    tensors that share memory (tied embeddings, a block reused by several layers)."""
    from safetensors.torch import save_file
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(path), metadata={'format': 'pt'})


def rewrite_checkpoint(src: str, dst: Path, tensors: dict | None = None, config: dict | None = None) -> str:
    """A copy of the checkpoint folder ``src`` at ``dst`` whose ``model.safetensors`` holds
    ``tensors`` (name -> tensor; unchanged when None) and whose ``config.json`` has the fields of
    ``config`` set (others kept as written). Returns ``str(dst)``."""
    shutil.copytree(src, dst)
    if tensors is not None:
        _save_tensors(tensors, dst / 'model.safetensors')
    if config:
        written = json.loads((dst / 'config.json').read_text())
        written.update(config)
        (dst / 'config.json').write_text(json.dumps(written))
    return str(dst)


def hf_model(cls, config, seed: int):
    """``cls(config)`` in float32 eval mode with seeded random weights (``make_tiny_model``'s
    ``_randomize``), leaving the global torch RNG as it was."""
    from lmdeploy.tools.make_tiny_model import _randomize
    torch_state = torch.random.get_rng_state()
    hf = cls(config).float().eval()
    torch.random.set_rng_state(torch_state)
    _randomize(hf, seed)
    return hf


def write_checkpoint(src: str, path: Path, hf, config, rename: Callable[[str], str | None] = lambda k: k,
                     drop_config: tuple[str, ...] = ()) -> dict:
    """Write ``hf``'s weights as a checkpoint at ``path`` with the tokenizer files of ``src``.

    Args:
        rename: a state-dict name → its name in the checkpoint, or None to leave it out (e.g.
            ``lm_head.weight`` of tied embeddings).
        drop_config: ``config`` fields left out of ``config.json`` (a default JSON cannot hold,
            such as an infinite ``time_step_limit``).

    Returns:
        The state dict written (checkpoint names).
    """
    shutil.copytree(src, path)
    sd = {}
    for k, v in hf.state_dict().items():
        k = rename(k)
        if k is not None:
            sd[k] = v
    _save_tensors(sd, path / 'model.safetensors')
    cfg = config.to_diff_dict()
    cfg['architectures'] = [type(hf).__name__]
    for key in drop_config:
        cfg.pop(key, None)
    json.dump(cfg, open(path / 'config.json', 'w'))
    return sd


def untied(k: str) -> str | None:
    """:func:`write_checkpoint`'s ``rename`` for tied embeddings: every name but ``lm_head.weight``."""
    return None if k == 'lm_head.weight' else k


def check_refused_field(config, change: dict, field: str, model_type: str | None = None,
                        checked: set[str] = frozenset()) -> None:
    """``config`` (a transformers config, or a checkpoint path to load it from) with ``change``
    set is refused by the config audit with a ValueError naming ``field``; with ``model_type``,
    every field the audit checks for it is one of ``checked`` (a new check must come with its
    refusal test)."""
    if isinstance(config, (str, Path)):
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(config)
    for k, v in change.items():
        object.__setattr__(config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)
    if model_type is not None:
        assert {f for f, how in FIELDS[model_type].items() if how == CHECKED} <= checked


def check_audit_lists_every_field_transformers_reads(model_type: str, module: str | None = None) -> None:
    """Every ``config.X`` (or ``getattr(config, 'X')``) in transformers' modeling source of the
    family (``transformers.models.{model_type}.modeling_{model_type}`` unless ``module``) is in
    the audit's :data:`FIELDS` of ``model_type``."""
    source = inspect.getsource(importlib.import_module(
        module or f'transformers.models.{model_type}.modeling_{model_type}'))
    read = set(re.findall(r'config\.(\w+)', source)) | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)',
                                                                       source))
    assert read and not read - set(FIELDS[model_type]), sorted(read - set(FIELDS[model_type]))
