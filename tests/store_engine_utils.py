"""Engines and checks shared by tests/test_store_engine.py and tests/test_store_engine_faults.py:
the Store-backed engine factory (B = 16, A = 64, P = 64, a 1 MiB local buffer), the caching-off
reference outputs, Store keys of a prefix and the check that every block and state object of a
prefix is in the Store.
"""
from __future__ import annotations

import pytest

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
from lmdeploy.pytorch.store.mooncake_client import StoreClient
from lmdeploy.pytorch.store.object_format import object_key
from lmdeploy.pytorch.store.services import MooncakeServices


B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)
BUFFER = 1 << 20            # local transfer buffer per engine: the tiny model's objects are < 20 KiB
SMALL_SEGMENT = 16 << 20    # the smallest segment Mooncake 0.3.13 accepts


def store_config(services: MooncakeServices, **fields) -> dict:
    cfg = dict(device_type='cpu', dtype='float32', block_size=B, prefill_save_alignment=A, max_prefill_token_num=P,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=32, max_batch_size=4,
               mooncake_master=services.master_address, mooncake_metadata_server=services.metadata_server,
               mooncake_local_buffer_size=BUFFER)
    cfg.update(fields)
    return cfg


@pytest.fixture
def make_engine(tiny_qwen3_next, mooncake_services):
    """Factory of Store-backed engines (shared services unless ``services=`` is given); every
    engine made is closed at teardown."""
    made = []

    def make(services: MooncakeServices | None = None, **fields) -> Engine:
        eng = Engine(tiny_qwen3_next, PytorchEngineConfig(**store_config(services or mooncake_services, **fields)))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


@pytest.fixture(scope='module')
def cold(tiny_qwen3_next):
    """Greedy output ids with caching (and the Store) off, memoized per prompt."""
    eng = Engine(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                                      max_prefill_token_num=P))
    memo: dict[tuple, list[int]] = {}

    def run(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            memo[tuple(ids)] = eng.generate(ids, GEN).output_ids
        return memo[tuple(ids)]

    return run


def cold_conversation(cold, user_turns: list[list[int]]) -> list[list[int]]:
    """Reply ids of each turn of an append-only conversation, caching off."""
    ids, replies = [], []
    for user in user_turns:
        ids = ids + user
        replies.append(cold(ids))
        ids = ids + replies[-1]
    return replies


def key(eng: Engine, kind: str, ids: list[int], num_tokens: int) -> str:
    """Store key of the ``kind`` object of prefix ``ids[:num_tokens]`` (a block multiple)."""
    return object_key(eng.store.ns_hex, kind, chain_block_hashes(ids, B, num_tokens // B)[-1].hex())


def assert_prefix_complete(eng: Engine, client: StoreClient, ids: list[int], boundaries) -> None:
    """Every stored state object has all of its KV objects stored (the state is put after its blocks)."""
    for b in boundaries:
        if client.exists(key(eng, 'state', ids, b)):
            assert all(client.exists(key(eng, 'kv', ids, e)) for e in range(B, b + 1, B)), b
