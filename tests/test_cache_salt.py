"""cache_salt: the salt enters the first block's hash, so differently salted (or unsalted)
requests never share a cached block, locally or in the Store; the same salt shares as before."""
from __future__ import annotations

import pytest
from engine_utils import make_engine, random_prompt
from hypothesis import given, settings
from hypothesis import strategies as st

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes

B = 16
SALTS = st.one_of(st.none(), st.text(min_size=1, max_size=12))


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=B, max_size=6 * B), other=st.lists(
    st.integers(0, 2**32 - 1), max_size=6 * B), salt_a=SALTS, salt_b=SALTS, block_size=st.sampled_from([1, 4, B]))
def test_salts_never_share_a_block_hash(tokens, other, salt_a, salt_b, block_size):
    """Whatever the tokens (the same or others, any length), two different salts (None and ''
    are both "no salt") give disjoint block hashes; the same salt gives the same chain."""
    a = chain_block_hashes(tokens, block_size, salt=salt_a)
    if (salt_a or None) == (salt_b or None):
        assert chain_block_hashes(tokens, block_size, salt=salt_b) == a
        return
    for seq in (tokens, other, tokens[:len(tokens) // 2]):
        assert not set(a) & set(chain_block_hashes(seq, block_size, salt=salt_b))


def test_salt_continues_incrementally():
    """Hashing a grown sequence from its earlier hashes gives the chain of the whole."""
    tokens = list(range(5 * B))
    head = chain_block_hashes(tokens[:2 * B], B, salt='t1')
    assert chain_block_hashes(tokens, B, prefix=head, salt='t1') == chain_block_hashes(tokens, B, salt='t1')


@pytest.mark.parametrize('arch', ['tiny_qwen3', 'tiny_qwen3_next'])
def test_engine_salt_two_gets_nothing_of_salt_one(arch, request):
    model = request.getfixturevalue(arch)
    eng = make_engine(model, num_gpu_blocks=128, block_size=B, prefill_save_alignment=4 * B,
                      enable_prefix_caching=True)
    try:
        prompt = random_prompt(5 * B + 3, 7)

        def run(salt):
            return eng.generate(prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True, cache_salt=salt))
        first = run('tenant-1')
        assert first.num_cached_tokens == 0
        again = run('tenant-1')
        assert again.num_cached_tokens >= 4 * B and again.output_ids == first.output_ids
        for salt in ('tenant-2', None):
            other = run(salt)
            assert other.num_cached_tokens == 0 and other.output_ids == first.output_ids
        assert run('tenant-2').num_cached_tokens >= 4 * B      # its own prefix is cached now
        assert eng.is_idle()
    finally:
        eng.close()


def test_store_keys_differ_by_salt(tiny_qwen3_next, mooncake_services):
    """A writer saves salt A's prefix to the Store; fresh readers (empty local caches) restore it
    with salt A only: salt B and no salt find nothing."""
    def engine():
        return Engine(tiny_qwen3_next, PytorchEngineConfig(
            device_type='cpu', dtype='float32', num_gpu_blocks=128, block_size=B, prefill_save_alignment=4 * B,
            enable_prefix_caching=True, mooncake_master=mooncake_services.master_address,
            mooncake_metadata_server=mooncake_services.metadata_server, mooncake_local_buffer_size=1 << 20))
    prompt = random_prompt(5 * B + 3, 99)
    cfg = dict(max_new_tokens=3, ignore_eos=True)
    writer = engine()
    try:
        ref = writer.generate(prompt, GenerationConfig(**cfg, cache_salt='A'))
        assert writer.store.flush(timeout=30)
    finally:
        writer.close()
    for salt, hit in (('B', False), (None, False), ('A', True)):
        reader = engine()
        try:
            seq = reader.generate(prompt, GenerationConfig(**cfg, cache_salt=salt))
            assert (seq.stats.store_hit_tokens > 0) == hit, (salt, seq.stats.store_hit_tokens)
            assert seq.output_ids == ref.output_ids
        finally:
            reader.close()
