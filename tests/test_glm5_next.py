"""GLM-5.3-Flash (``glm5_next``) served exactly like transformers on a tiny random model (8
index heads, pools of 8, top 64 tokens, so prompts past ~70 tokens are sparse): logits <= 1e-4
in fp32 at every position (5-700 tokens, cold and in 32-token chunks) and the same indexer
selection chunked as in one forward (chunk 2's indexer reads chunk 1's cached ``index_keys``);
greedy tokens equal cold, chunked and after a local prefix-cache restore; a 4-turn chat
identical under every cache policy; a new engine's Store restore (in a fresh process, with and
without an image: tests/test_store_fresh_process.py); Store put bytes equal the simulator from
the specs alone, at TP1 and TP2; TP2 = TP1 with the latent and the indexer keys replicated and
stored once; the cache specs and refused config fields."""
import json
import os

import pytest
import torch

from engine_utils import (TOL, check_four_turn_chat_under_every_cache_policy,
                          check_greedy_equals_transformers_cold_chunked_and_after_restore,
                          check_prompt_logits_match_transformers,
                          engine_prompt_logits, hf_prompt_logits, make_engine, random_prompt,
                          tiny_checkpoint_and_reference)
from family_harness import check_a_new_engine_restores_from_a_file_store
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.cache_specs import PagedSpec, StateSpec, kv_bytes_per_block
from lmdeploy.pytorch.models import get_model_class
from lmdeploy.pytorch.models.config_audit import check_config
from lmdeploy.pytorch.models.glm5_next_layers import DSAIndexer


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(checkpoint path in the published layout, transformers float32 reference)."""
    from transformers import Glm5NextForConditionalGeneration
    return tiny_checkpoint_and_reference(
        tmp_path_factory, 'glm5_next',
        load=lambda path: Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval())


class _Selections:
    """Records every indexer selection: ``rows[layer id][position] = visible key positions``."""

    def __init__(self, monkeypatch):
        self.rows = {}
        original = DSAIndexer.select

        def select(indexer, hidden, q_resid, entries, history):
            mask = original(indexer, hidden, q_resid, entries, history)
            for j, row in enumerate(mask):
                self.rows.setdefault(id(indexer), {})[history + j] = tuple(row.nonzero().flatten().tolist())
            return mask
        monkeypatch.setattr(DSAIndexer, 'select', select)


@pytest.mark.parametrize('n, chunk', [(5, 8192), (150, 32), (700, 32), (300, 8192)])
def test_prompt_logits_match_transformers_cold_and_chunked(tiny, n, chunk):
    check_prompt_logits_match_transformers(*tiny, n, chunk)


def test_chunked_prefill_selects_the_same_keys_as_one_forward(tiny, monkeypatch):
    """Per position the indexer keeps the same keys in 32-token chunks (re-pooling the cached
    keys of earlier chunks) as in one forward; past index_topk + a pool the selection is
    strictly sparser than causal attention, so the sparse path is what is compared."""
    path, _ = tiny
    ids = random_prompt(400, seed=41)
    full, chunked = _Selections(monkeypatch), None
    engine_prompt_logits(make_engine(path, block_size=16), ids)
    full_rows = list(full.rows.values())
    chunked = _Selections(monkeypatch)
    engine_prompt_logits(make_engine(path, block_size=16, max_prefill_token_num=32), ids)
    chunked_rows = list(chunked.rows.values())
    assert len(full_rows) == len(chunked_rows) == 1      # one 'full' indexer layer (layer 2 shares it)
    assert full_rows[0] == chunked_rows[0] and len(full_rows[0]) == 400
    sizes = [len(full_rows[0][p]) for p in range(400)]
    assert sizes[:64] == list(range(1, 65))                # all pools fit the budget: causal
    assert max(sizes[80:]) <= 64 + 7 < min(p + 1 for p in range(80, 400))


def test_greedy_equals_transformers_cold_chunked_and_after_prefix_cache_restore(tiny):
    check_greedy_equals_transformers_cold_chunked_and_after_restore(*tiny)


def test_four_turn_chat_is_identical_under_every_cache_policy(tiny):
    check_four_turn_chat_under_every_cache_policy(tiny[0])


def test_cache_specs_add_the_indexer_keys_beside_the_latent(tiny):
    """KDA: Kimi's four-tensor state; a 'full' DSA layer: latent + index_keys per token; the
    'shared' DSA layer: the latent only (no indexer); all DSA tensors replicated under TP."""
    path, _ = tiny
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    specs = get_model_class('glm5_next').cache_specs(config, torch.float32)
    assert [type(s) for s in specs] == [StateSpec, PagedSpec, PagedSpec, StateSpec]
    assert [(t.name, t.shape, t.tp_split) for t in specs[1].tensors()] == [
        ('latent', (text.kv_lora_rank,), None), ('index_keys', (2 * text.index_head_dim,), None)]
    assert [t.name for t in specs[2].tensors()] == ['latent']
    assert kv_bytes_per_block(specs, 16) == 16 * 4 * (2 * text.kv_lora_rank + 2 * text.index_head_dim)


@pytest.mark.parametrize('change, field', [
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(layer_types=['full_attention'] * 4), 'layer_types'),
    (dict(indexer_types=['full', 'shared', 'full', 'full']), 'indexer_types'),
    (dict(qk_rope_head_dim=8), 'qk_rope_head_dim'),
    (dict(topk_group=5), 'topk_group'),
])
def test_refused_fields_name_themselves(tiny, change, field):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny[0])
    for k, v in change.items():
        setattr(config.text_config, k, v)
    with pytest.raises(ValueError, match=field):
        check_config(config)


def test_a_new_engine_restores_from_the_store(tiny, tmp_path):
    """A writer engine saves a 300-token prompt (KDA checkpoints + latent and indexer-key blocks) to
    a ``file:`` Store; a new engine with an empty local cache restores 256 tokens from it and
    decodes what an engine with caching off decodes (the same in a fresh process:
    tests/test_store_fresh_process.py)."""
    check_a_new_engine_restores_from_a_file_store(tiny[0], tmp_path, seed=883_000, put_objects={'state': 4, 'kv': 16})


@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_store_put_bytes_equal_the_simulator_to_the_byte(tiny, mooncake_services, last_only):
    """Two seed scenarios scaled by 1/16 against the real Store: put bytes equal ``simulate()``
    fed the engine's S and K_blk, and ``sizes_from_config`` of config.json (specs alone, the
    indexer keys included) gives those same S and K_blk."""
    from test_benchmark_store_bytes import SCALE, bench, check_store_put_bytes_equal_the_simulator
    store = dict(mooncake_master=mooncake_services.master_address,
                 mooncake_metadata_server=mooncake_services.metadata_server)
    config, _, K = check_store_put_bytes_equal_the_simulator(tiny[0], last_only, store, max_turns=3, seed=880_000)
    text, block_size = config['text_config'], bench.Geometry.from_scale(SCALE).block_size
    assert K == block_size * 4 * (2 * text['kv_lora_rank'] + 2 * text['index_head_dim'])


def test_tp2_logits_and_greedy_tokens_equal_tp1_and_the_store_holds_dsa_tensors_once(tiny):
    """KDA split by head, DSA by query head with the latent and the indexer keys replicated:
    TP2 = TP1; a TP2 engine's K_blk is one rank's (stored and charged once), S the ranks' sum,
    as the simulator computes them from the specs."""
    from test_store_engine import sim
    from test_tensor_parallel import check_tp2_equals_tp1
    path, _ = tiny

    def store_sizes_are_the_simulators(eng):
        sizes = sim.sizes_from_config(json.load(open(os.path.join(path, 'config.json'))), tp=2,
                                      block_size=eng.cache_engine.block_size)
        S, K = sizes.charged
        assert (S, K) == (eng.cache_engine.state_bytes, eng.cache_engine.kv_block_bytes)
        assert S == 2 * sizes.state_bytes and K == sizes.kv_block_bytes
    check_tp2_equals_tp1(path, then=store_sizes_are_the_simulators)


def test_tp2_store_put_bytes_equal_the_simulator_with_the_dsa_tensors_once(tiny, mooncake_services):
    """A TP2 writer's Store objects: S the sum of the ranks' KDA state, K_blk one rank's latent +
    indexer-key blocks (replicated, stored and charged once); put bytes equal the simulator's
    and a TP1 reader restores the prefix and decodes the same tokens."""
    from tp_utils import check_store_across_tp_sizes
    check_store_across_tp_sizes(tiny[0], mooncake_services, writer_tp=2, reader_tp=1, seed=8821, kv_replicated=True)


def test_audit_lists_every_field_transformers_reads_for_glm5_next():
    import inspect
    import re

    import transformers.models.glm5_next.modeling_glm5_next as modeling

    from lmdeploy.pytorch.models.config_audit import FIELDS
    source = inspect.getsource(modeling)
    read = (set(re.findall(r'config\.(\w+)', source))
            | set(re.findall(r'getattr\(\s*(?:self\.)?config,\s*["\'](\w+)', source))) - {'get_text_config'}
    assert read and not read - set(FIELDS['glm5_next']), sorted(read - set(FIELDS['glm5_next']))
    assert set(FIELDS['glm5_next_text']) <= set(FIELDS['glm5_next'])


def test_fp8_checkpoint_matches_transformers_dequantized_model(tmp_path):
    """``make_tiny_model(fp8=True)``: e4m3 KDA projections, attention outputs, dense and expert
    MLPs with 128 x 128 inverse scales load to transformers' dequantized model (<= 1e-4)."""
    from safetensors.torch import load_file
    from transformers import Glm5NextForConditionalGeneration

    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / 'fp8'), arch='glm5_next', seed=0, fp8=True)
    tensors = load_file(os.path.join(path, 'model.safetensors'))
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert any('.mlp.experts.' in n for n in fp8) and any('.self_attn.q_proj.' in n for n in fp8)
    hf = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_prompt(150, seed=7)
    got, _ = engine_prompt_logits(make_engine(path, max_prefill_token_num=32, block_size=16), ids)
    ref = hf_prompt_logits(hf, ids)
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _image_prompt(config, before, grid, after, seed, text_seed=0):
    """Token ids with one image of ``grid`` (t, h, w) patches between ``before`` and ``after``
    text tokens, its MultimodalInput and the transformers inputs."""
    from lmdeploy.pytorch.multimodal import MultimodalInput, tensor_content_hash
    v = config.vision_config
    px = torch.randn(grid[0] * grid[1] * grid[2], v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                     generator=torch.Generator().manual_seed(seed))
    thw = torch.tensor([grid])
    n = grid[0] * grid[1] * grid[2] // v.spatial_merge_size ** 2
    ids = random_prompt(before, text_seed) + [config.image_start_token_id]
    mm = MultimodalInput(len(ids), len(ids) + n, tensor_content_hash(px, thw),
                         dict(pixel_values=px, image_grid_thw=thw))
    ids += [config.image_token_id] * n + [config.image_end_token_id] + random_prompt(after, text_seed + 1)
    return ids, mm, dict(input_ids=torch.tensor([ids]), pixel_values=px, image_grid_thw=thw)


def test_one_image_matches_transformers_cold_chunked_and_after_a_restore(tiny):
    """The vision tower + merger replace the image tokens' embeddings: logits <= 1e-4 cold and
    in 32-token chunks (no chunk ends inside the image), greedy equal cold and after a
    prefix-cache restore past the image; another image changes the output."""
    from engine_utils import StepRecorder
    path, hf = tiny
    ids, mm, hf_in = _image_prompt(hf.config, 20, (1, 8, 12), 60, seed=5)
    with torch.no_grad():
        ref = hf(**hf_in).logits[0].float()
        expected = hf.generate(**hf_in, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    for chunk in (8192, 32):
        eng = make_engine(path, block_size=16, max_prefill_token_num=chunk)
        rec = StepRecorder(eng, keep_logits=True)
        seq = eng.generate(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True), multimodal=(mm,))
        got = rec.prompt_logits(seq)
        assert (got - ref).abs().max().item() <= TOL and torch.equal(got.argmax(-1), ref.argmax(-1))
        assert all(not mm.start < e < mm.end for s in rec.steps for _, _, e, _ in s.chunks)
    gen = GenerationConfig(max_new_tokens=8)
    eng = make_engine(path, block_size=16, max_prefill_token_num=64, prefill_save_alignment=16,
                      enable_prefix_caching=True, num_checkpoint_slots=8)
    first = eng.generate(ids, gen, multimodal=(mm,))
    again = eng.generate(ids, gen, multimodal=(mm,))
    assert first.output_ids == again.output_ids == expected and again.num_cached_tokens > mm.end
    other_ids, other, _ = _image_prompt(hf.config, 20, (1, 8, 12), 60, seed=6)
    assert other_ids == ids and other.content_hash != mm.content_hash     # same tokens, another image
    miss = eng.generate(other_ids, gen, multimodal=(other,))
    assert miss.num_cached_tokens <= mm.start


def test_a_flat_text_only_checkpoint_loads_without_a_vision_tower(tiny, tmp_path):
    """config.json with the text fields at the top level (model_type glm5_next) and weights
    under ``model.*`` without ``model.visual.*``: the same text logits, and images refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lmdeploy.pytorch.multimodal import MultimodalInput
    src, hf = tiny
    path = tmp_path / 'flat'
    shutil.copytree(src, path)
    cfg = json.load(open(path / 'config.json'))
    text = cfg.pop('text_config')
    cfg.pop('vision_config')
    cfg.update(text, model_type='glm5_next')
    json.dump(cfg, open(path / 'config.json', 'w'))
    tensors = load_file(str(path / 'model.safetensors'))
    save_file({k.replace('model.language_model.', 'model.'): v for k, v in tensors.items()
               if not k.startswith('model.visual.')}, str(path / 'model.safetensors'), metadata={'format': 'pt'})
    ids = random_prompt(90, seed=9)
    eng = make_engine(str(path), block_size=16)
    got, _ = engine_prompt_logits(eng, ids)
    assert eng.model.visual is None and (got - hf_prompt_logits(hf, ids)).abs().max().item() <= TOL
    image = MultimodalInput(3, 7, b'x' * 16, dict(pixel_values=torch.zeros(16, 384),
                                                  image_grid_thw=torch.tensor([[1, 4, 4]])))
    with pytest.raises(ValueError):
        eng.generate(ids, GenerationConfig(max_new_tokens=1), multimodal=(image,))


def test_tied_indexer_scores_select_the_earliest_pools_in_any_chunking(tiny, tmp_path, monkeypatch):
    """A checkpoint whose indexer weights_proj is zero scores every pool 0: torch.topk picked
    among the tie by a rule depending on the row length, so the kept pools, and the logits (by up
    to 0.63), depended on the prefill chunk size. Ties now go to the earliest pools: every
    position past index_topk keeps pools 0..7 (tokens 0-63) and the tokens of its incomplete pool."""
    import shutil

    from safetensors.torch import load_file, save_file
    path, _ = tiny
    degenerate = tmp_path / 'zero_indexer'
    shutil.copytree(path, degenerate)
    weights = degenerate / 'model.safetensors'
    tensors = load_file(weights)
    zeroed = [name for name in tensors if name.endswith('indexer.weights_proj.weight')]
    assert zeroed
    tensors.update({name: torch.zeros_like(tensors[name]) for name in zeroed})
    save_file(tensors, weights, metadata={'format': 'pt'})
    ids = random_prompt(300, seed=43)
    full = _Selections(monkeypatch)
    one_forward, _ = engine_prompt_logits(make_engine(str(degenerate), block_size=16), ids)
    (full_rows,) = full.rows.values()                   # one 'full' indexer layer (layer 2 shares it)
    chunked = _Selections(monkeypatch)
    in_chunks, forwards = engine_prompt_logits(make_engine(str(degenerate), block_size=16, max_prefill_token_num=32),
                                               ids)
    (chunked_rows,) = chunked.rows.values()
    assert forwards == 10
    assert full_rows == chunked_rows
    for p in range(72, 300):
        assert full_rows[p] == tuple(range(64)) + tuple(range(p + 1 - (p + 1) % 8, p + 1)), p
    assert (one_forward - in_chunks).abs().max().item() <= TOL


def test_top_pools_breaks_ties_by_the_lower_index_and_otherwise_equals_topk():
    from lmdeploy.pytorch.models.glm5_next_layers import top_pools
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 33, 100):
        for k in {0, 1, min(8, n), n}:
            tied = torch.randint(0, 3, (16, n), generator=gen).float()      # many exact ties
            got = top_pools(tied, k)
            for row, picks in zip(tied.tolist(), got.tolist()):
                assert picks == sorted(range(n), key=lambda i: (-row[i], i))[:k]
            distinct = torch.randn(16, n, generator=gen)
            assert torch.equal(top_pools(distinct, k), distinct.topk(k, dim=-1).indices)
