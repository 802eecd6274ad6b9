"""Qwen3.5 with images served exactly like transformers: the vision tower, the patch merger and
the M-RoPE positions of image tokens (logits <= 1e-4 in fp32 at every prompt position, greedy
tokens equal) on prompts with one and two images of different sizes, cold, across chunk ends
and after a prefix-cache restore; image identity in the cache (same image hits, a different
image changes the output and misses past the image start)."""
import numpy as np
import pytest
import torch

from engine_utils import TOL, StepRecorder, make_engine, random_prompt
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.multimodal import MultimodalInput, tensor_content_hash


@pytest.fixture(scope='module')
def hf_vl(tiny_qwen3_5):
    from transformers import Qwen3_5ForConditionalGeneration
    return Qwen3_5ForConditionalGeneration.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def image_processor(tiny_qwen3_5):
    from transformers import AutoImageProcessor
    return AutoImageProcessor.from_pretrained(tiny_qwen3_5)


def _image(h, w, seed):
    from PIL import Image
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(proc, config, pieces):
    """``pieces``: text token lists and PIL images, in order → (token ids, MultimodalInputs,
    pixel_values, image_grid_thw) with each image's pad run expanded to its token count."""
    ids, mms, px, grids = [], [], [], []
    merge = config.vision_config.spatial_merge_size
    for p in pieces:
        if isinstance(p, list):
            ids += p
            continue
        out = proc(images=[p], return_tensors='pt')
        n = int(out['image_grid_thw'].prod()) // merge ** 2
        ids.append(config.vision_start_token_id)
        mms.append(MultimodalInput(len(ids), len(ids) + n,
                                   tensor_content_hash(out['pixel_values'], out['image_grid_thw']),
                                   dict(pixel_values=out['pixel_values'], image_grid_thw=out['image_grid_thw'])))
        ids += [config.image_token_id] * n + [config.vision_end_token_id]
        px.append(out['pixel_values'])
        grids.append(out['image_grid_thw'])
    return ids, mms, torch.cat(px), torch.cat(grids)


def _hf_inputs(hf, ids, px, grid):
    ids = torch.tensor([ids])
    return dict(input_ids=ids, pixel_values=px, image_grid_thw=grid,
                mm_token_type_ids=(ids == hf.config.image_token_id).int())


@torch.no_grad()
def _hf_logits(hf, ids, px, grid):
    return hf(**_hf_inputs(hf, ids, px, grid)).logits[0].float()


@torch.no_grad()
def _hf_greedy(hf, ids, px, grid, n):
    out = hf.generate(**_hf_inputs(hf, ids, px, grid), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _engine_logits(eng, ids, mms):
    rec = StepRecorder(eng, keep_logits=True)
    seq = eng.generate(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True), multimodal=tuple(mms))
    return rec.prompt_logits(seq), seq, rec


ONE = [random_prompt(20, 1), (40, 56, 7), random_prompt(30, 2)]
TWO = [random_prompt(9, 3), (32, 32, 8), random_prompt(25, 4), (64, 40, 9), random_prompt(40, 5)]


def _pieces(spec):
    return [p if isinstance(p, list) else _image(*p) for p in spec]


@pytest.mark.parametrize('spec, chunk', [(ONE, 8192), (TWO, 8192), (TWO, 32)])
def test_image_prompt_logits_match_transformers(tiny_qwen3_5, hf_vl, image_processor, spec, chunk):
    ids, mms, px, grid = _prompt(image_processor, hf_vl.config, _pieces(spec))
    eng = make_engine(tiny_qwen3_5, block_size=16, max_prefill_token_num=chunk)
    got, seq, rec = _engine_logits(eng, ids, mms)
    ref = _hf_logits(hf_vl, ids, px, grid)
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for start, end in (m.span for m in mms):     # no forward ends strictly inside an image
        assert all(not start < e < end for s in rec.steps for _, _, e, _ in s.chunks)
