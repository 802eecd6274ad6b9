"""Prefill/decode disaggregation (``role='prefill'`` / ``role='decode'``) through a ``file:`` Store.

- ``handoff_point``: h = n - max(1, ℓ), moved down off any image span; 0 for a 1-token prompt.
- A prefill engine computes a prompt to h = n - 1 (its plan is the colocated grid cut at h,
  no token sampled), puts the KV blocks below floor_B(h) and one hand-off object; a decode engine
  on the same folder restores exactly h tokens, computes token n - 1 and decodes what colocated
  serving (an engine with caching off) decodes, for every hybrid family and with images.
- The decode engine reads every Store object at most once (a later turn fetches only the blocks
  its local cache lacks), and counts h tokens as restored.
- A hand-off whose object never arrived (the prefill engine died in its put) or fails to verify
  is computed by the decode engine: the cold output, never a wrong one.

Engine geometry: B = 16, A = 64, P = 64; prompts of 150 tokens (h = 149: a partial last block).
"""
from __future__ import annotations

import pytest

from engine_utils import make_engine, random_prompt
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.paging.handoff import handoff_point
from lmdeploy.pytorch.store.backend import PutResult

B, A, P = 16, 64, 64
GEN = GenerationConfig(max_new_tokens=4, ignore_eos=True)
COMMON = dict(block_size=B, prefill_save_alignment=A, max_prefill_token_num=P, enable_prefix_caching=True)


def test_handoff_point_leaves_the_last_token_and_never_splits_an_image():
    assert handoff_point(150) == 149 and handoff_point(1) == 0 and handoff_point(160) == 159
    assert handoff_point(150, token_lookahead=1) == 149 and handoff_point(150, token_lookahead=3) == 147
    assert handoff_point(150, spans=[(100, 150)]) == 100        # the last token is an image's
    assert handoff_point(150, spans=[(100, 149), (149, 150)]) == 149
    assert handoff_point(150, spans=[(120, 140), (140, 151)]) == 140    # the image before ends at 140
    assert handoff_point(150, spans=[(130, 151), (120, 135)]) == 120    # moved until it splits none
    with pytest.raises(ValueError, match='num_tokens'):
        handoff_point(0)
    # every n and span layout: h is the largest b <= n - 1 that splits no span
    for n in range(1, 40):
        for s in range(0, n):
            for e in range(s + 1, n + 2):
                h = handoff_point(n, spans=[(s, e)])
                ok = [b for b in range(n) if not s < b < e]
                assert h == max(ok), (n, s, e, h)


def test_a_role_needs_a_store_caching_and_a_hybrid_model(tiny_qwen3, tmp_path):
    with pytest.raises(ValueError, match='role'):
        PytorchEngineConfig(role='prefill', enable_prefix_caching=True)
    with pytest.raises(ValueError, match='role'):
        PytorchEngineConfig(role='decode', store_backend=f'file:{tmp_path}')
    with pytest.raises(ValueError, match='role'):
        PytorchEngineConfig(role='middle')
    with pytest.raises(ValueError, match="role='prefill' hands prompts off through the Store tier, but qwen3 does"):
        make_engine(tiny_qwen3, role='prefill', store_backend=f'file:{tmp_path}', **COMMON)


def _pair(model: str, folder):
    store = f'file:{folder}'
    return (make_engine(model, role='prefill', store_backend=store, **COMMON),
            make_engine(model, role='decode', store_backend=store, **COMMON))


def _record_gets(engine) -> list[str]:
    """Every key the engine's Store backend is asked to read, in order."""
    client, keys = engine.store.client, []
    get = client.get

    def recording_get(key, *args, **kw):
        keys.append(key)
        return get(key, *args, **kw)

    client.get = recording_get
    return keys


def _kinds(keys: list[str]) -> dict[str, int]:
    out = {}
    for k in keys:
        kind = k.split('/')[1]
        out[kind] = out.get(kind, 0) + 1
    return out


def check_handoff_equals_colocated(model: str, tmp_path, multimodal: tuple = (), ids: list[int] | None = None):
    """One prompt handed off from a prefill to a decode engine: exactly h restored, output equal
    to colocated serving (an engine with caching off), every object read once."""
    ids = ids if ids is not None else random_prompt(150, seed=3)
    kw = dict(multimodal=tuple(multimodal)) if multimodal else {}
    pre, dec = _pair(model, tmp_path / 'store')
    cold = make_engine(model, max_prefill_token_num=P)
    try:
        gets = _record_gets(dec)
        h = handoff_point(len(ids), spans=[m.span for m in multimodal])
        first = pre.generate(ids, GEN, **kw)
        assert first.finish_reason == 'handoff' and first.output_ids == [] and first.handoff.wait(30)
        assert first.stats.plans[0].chunk_ends[-1] == h and first.handoff.point == h
        assert pre.stats()['store_handoff_put_objects'] == 1
        second = dec.generate(ids, GEN, **kw)
        assert second.handoff.restored == second.stats.store_hit_tokens == second.num_cached_tokens == h
        assert second.stats.prefill_forwards == 1 and dec.stats()['store_handoff_hit_tokens'] == h
        assert second.output_ids == cold.generate(ids, GEN, **kw).output_ids
        kv_objects = h // B if dec.cache_engine.kv_block_bytes else 0
        expected = {'handoff': 1, 'kv': kv_objects} if kv_objects else {'handoff': 1}
        assert len(gets) == len(set(gets)) and _kinds(gets) == expected
    finally:
        for eng in (pre, dec, cold):
            eng.close()


# every hybrid family but Qwen3-Next (the conversation test below) and Qwen3.5 (the image test):
# KDA + MLA latent rows, KDA + DSA latent and indexer keys, Mamba-2 + KV (three families),
# short conv + KV (dense and MoE), MoE in every layer, Mamba-2 alone (nothing paged: the
# hand-off object is the state alone), lightning attention + KV (a float32 state with no conv),
# Gated DeltaNet + NoPE attention, Mamba-2 with shared attention blocks (KV entries after the
# state entries, dt clamped for prompt tokens only), Gated DeltaNet or short conv + sliding-window
# and global KV
@pytest.mark.parametrize('arch', ['kimi_linear', 'glm5_next', 'nemotron_h', 'granitemoehybrid', 'bamba', 'lfm2',
                                  'lfm2_moe', 'qwen3_5_moe_text', 'mamba2', 'minimax', 'olmo_hybrid', 'zamba2',
                                  'lara_mini', 'lfm3'])
def test_handoff_outputs_equal_colocated_for_each_cache_kind(arch, tmp_path_factory, tmp_path):
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    model = make_tiny_model(str(tmp_path_factory.mktemp(f'pd_{arch}')), arch=arch, seed=0)
    check_handoff_equals_colocated(model, tmp_path)


def test_handoff_with_an_image_equals_colocated(tiny_qwen3_5, tmp_path):
    """Qwen3.5 with one image inside the prompt: the hand-off key carries the image's content
    hash (through the block hashes), the decode engine restores past the image."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor

    from lmdeploy.pytorch.multimodal import MultimodalInput, tensor_content_hash
    config = AutoConfig.from_pretrained(tiny_qwen3_5)
    image = Image.fromarray(np.random.RandomState(7).randint(0, 256, (40, 56, 3), dtype=np.uint8))
    out = AutoImageProcessor.from_pretrained(tiny_qwen3_5)(images=[image], return_tensors='pt')
    n = int(out['image_grid_thw'].prod()) // config.vision_config.spatial_merge_size ** 2
    head = random_prompt(70, seed=1) + [config.vision_start_token_id]
    mm = MultimodalInput(len(head), len(head) + n, tensor_content_hash(out['pixel_values'], out['image_grid_thw']),
                         dict(pixel_values=out['pixel_values'], image_grid_thw=out['image_grid_thw']))
    ids = head + [config.image_token_id] * n + [config.vision_end_token_id] + random_prompt(30, seed=2)
    check_handoff_equals_colocated(tiny_qwen3_5, tmp_path, (mm, ), ids)


@pytest.fixture
def qwen3_next_pair(tiny_qwen3_next, tmp_path):
    pre, dec = _pair(tiny_qwen3_next, tmp_path / 'store')
    cold = make_engine(tiny_qwen3_next, max_prefill_token_num=P)
    yield pre, dec, lambda ids: cold.generate(ids, GEN).output_ids
    for eng in (pre, dec, cold):
        eng.close()


def test_a_conversation_hands_off_every_turn_and_fetches_no_block_twice(qwen3_next_pair):
    """Three turns (150, 40, 35 new tokens; h = 149, 192, 230): each turn's reply equals
    colocated serving, the decode engine restores exactly n - 1 tokens each turn and reads only
    the blocks its own cache lacks (each object once); a 1-token prompt has nothing to hand off."""
    pre, dec, cold = qwen3_next_pair
    gets = _record_gets(dec)
    ids, restored = [], []
    for i, n in enumerate((150, 40, 35)):
        ids = ids + random_prompt(n, seed=20 + i)
        handed = pre.generate(ids, GEN)
        assert handed.finish_reason == 'handoff' and handed.handoff.wait(30)
        seq = dec.generate(ids, GEN)
        assert seq.output_ids == cold(ids)
        restored.append(seq.handoff.restored)
        assert restored[-1] == len(ids) - 1
        ids = list(seq.token_ids)
    assert restored == [149, 193, 232] and dec.stats()['handoff_misses'] == 0
    assert len(gets) == len(set(gets)) and _kinds(gets)['handoff'] == 3
    # turn 1: blocks [0, 9); turn 2: [9, 12) (9 cached from turn 1's reply, 12 = 193 // 16); turn 3: [12, 14)
    assert _kinds(gets)['kv'] == 9 + 3 + 2
    one = pre.generate([5], GEN)
    assert one.finish_reason == 'handoff' and one.handoff.point == 0 and one.handoff.wait(1)
    assert [(o.seq, o.finish_reason) for o in pre.step()] == [(one, 'handoff')]   # the loop's output
    assert dec.generate([5], GEN).output_ids == cold([5])
    assert pre.store.flush(30) and pre.is_idle() and dec.is_idle(), (pre.ledger(), dec.ledger())


def test_a_handoff_that_never_arrived_or_is_torn_is_computed_never_wrong(qwen3_next_pair):
    """The prefill engine dies in its hand-off put (a torn value, the put never ends): its
    caller learns the hand-off failed, and a decode engine given the prompt anyway finds no
    hand-off and computes it (the cold output). A hand-off object whose bytes were altered is
    rejected (counted) and computed likewise."""
    pre, dec, cold = qwen3_next_pair
    client, put = pre.store.client, pre.store.client.put

    def dying_put(key, value, **kw):
        if '/handoff/' in key:
            client.begin_torn_write(key, value)     # what a process killed mid-put leaves
            return PutResult.FAILED
        return put(key, value, **kw)

    client.put = dying_put
    ids = random_prompt(150, seed=31)
    handed = pre.generate(ids, GEN)
    assert handed.finish_reason == 'handoff' and not handed.handoff.wait(30)
    assert pre.store.flush(30)      # (the aligned save points' puts run on other writer threads)
    seq = dec.generate(ids, GEN)
    assert seq.handoff.restored == 0 and seq.output_ids == cold(ids)
    assert seq.stats.store_hit_tokens == 128       # the aligned checkpoint the prefill engine did put
    assert dec.stats()['handoff_misses'] == 1
    # an altered hand-off object: rejected, then an aligned restore, the cold output
    client.put = put
    ids = random_prompt(150, seed=32)
    handed = pre.generate(ids, GEN)
    assert handed.handoff.wait(30)
    ns, kind, digest = handed.handoff.key.split('/')
    path = client.root / 'objects' / ns / kind / digest[:2] / digest
    assert path.is_file()
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF                # inside the payload or MAC: the checksum or MAC fails
    path.write_bytes(bytes(data))
    seq = dec.generate(ids, GEN)
    assert seq.handoff.restored == 0 and seq.output_ids == cold(ids)
    assert dec.stats()['store_rejected_objects'] == 1 and dec.stats()['handoff_misses'] == 2
