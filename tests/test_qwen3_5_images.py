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


def _cached_engine(path):
    return make_engine(path, block_size=16, max_prefill_token_num=64, prefill_save_alignment=16,
                       enable_prefix_caching=True, num_checkpoint_slots=8)


def test_greedy_equals_transformers_cold_and_after_prefix_cache_restore(tiny_qwen3_5, hf_vl, image_processor):
    ids, mms, px, grid = _prompt(image_processor, hf_vl.config, _pieces(TWO))
    expected = _hf_greedy(hf_vl, ids, px, grid, 10)
    gen = GenerationConfig(max_new_tokens=10)
    cold = make_engine(tiny_qwen3_5, block_size=16, max_prefill_token_num=48).generate(ids, gen, multimodal=mms)
    eng = _cached_engine(tiny_qwen3_5)
    first = eng.generate(ids, gen, multimodal=mms)
    calls = []
    inner = eng.model.visual.forward
    eng.model.visual.forward = lambda *a: calls.append(1) or inner(*a)
    again = eng.generate(ids, gen, multimodal=mms)
    assert cold.output_ids == first.output_ids == again.output_ids == expected
    # restored past the second image's start: the suffix after it needs no encoder run
    assert again.num_cached_tokens > mms[1].start and len(calls) == 0
    # a restore that stops before the second image: logits of the suffix still match
    ref = _hf_logits(hf_vl, ids, px, grid)
    eng2 = _cached_engine(tiny_qwen3_5)
    eng2.generate(ids[:mms[1].start - 1], GenerationConfig(max_new_tokens=1), multimodal=mms[:1])
    rec = StepRecorder(eng2, keep_logits=True)
    seq = eng2.generate(ids, GenerationConfig(max_new_tokens=1, ignore_eos=True), multimodal=tuple(mms))
    n = seq.num_cached_tokens
    assert 0 < n < mms[1].start
    parts = sorted(rec.logits[seq.seq_id], key=lambda p: p[0])
    assert parts[0][0] == n
    got = torch.cat([blk for _, blk in parts])[:len(ids) - n]
    assert got.shape[0] == len(ids) - n and (got - ref[n:]).abs().max().item() <= TOL


def test_same_text_other_image_misses_past_the_image_and_changes_output(tiny_qwen3_5, hf_vl, image_processor):
    a = _prompt(image_processor, hf_vl.config, _pieces(ONE))
    b = _prompt(image_processor, hf_vl.config, _pieces([ONE[0], (40, 56, 99), ONE[2]]))
    assert a[0] == b[0] and a[1][0].content_hash != b[1][0].content_hash
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    eng = _cached_engine(tiny_qwen3_5)
    out_a = eng.generate(a[0], gen, multimodal=a[1])
    out_b = eng.generate(b[0], gen, multimodal=b[1])
    out_a2 = eng.generate(a[0], gen, multimodal=a[1])
    assert out_b.num_cached_tokens <= a[1][0].start
    assert out_a2.num_cached_tokens > a[1][0].end
    assert out_a.output_ids == out_a2.output_ids
    ref_b = _hf_logits(hf_vl, b[0], b[2], b[3])
    ref_a = _hf_logits(hf_vl, a[0], a[2], a[3])
    assert (ref_a[-1] - ref_b[-1]).abs().max() > 1e-3      # the reference itself sees the image
    assert out_a.output_ids != out_b.output_ids


def test_images_are_validated(tiny_qwen3_5, hf_vl, image_processor):
    ids, mms, _, _ = _prompt(image_processor, hf_vl.config, _pieces(ONE))
    eng = make_engine(tiny_qwen3_5, block_size=16)
    bad = MultimodalInput(mms[0].start, mms[0].end - 1, mms[0].content_hash, mms[0].data)
    with pytest.raises(ValueError, match='span of'):
        eng.requests.check(ids, multimodal=(bad,))
    shifted = MultimodalInput(mms[0].start - 1, mms[0].end - 1, mms[0].content_hash, mms[0].data)
    with pytest.raises(ValueError, match='only the image token'):
        eng.requests.check(ids, multimodal=(shifted,))


def _data_url(image):
    import base64
    import io
    buf = io.BytesIO()
    image.save(buf, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope='module')
def vl_pipe(tiny_qwen3_5):
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.pipeline import Pipeline
    pipe = Pipeline(tiny_qwen3_5, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256,
                                                      block_size=16, enable_prefix_caching=True,
                                                      prefill_save_alignment=16, num_checkpoint_slots=8))
    yield pipe
    pipe.close()


def test_pipeline_image_parts_pil_path_and_data_url(vl_pipe, hf_vl, image_processor, tmp_path):
    a, b = _image(40, 56, 7), _image(64, 40, 9)
    path = tmp_path / 'a.png'
    a.save(path)
    msgs = [{'role': 'user', 'content': [
        {'type': 'text', 'text': 'Compare'}, {'type': 'image', 'image': a}, {'type': 'text', 'text': 'and'},
        {'type': 'image_url', 'image_url': {'url': _data_url(b)}}, {'type': 'text', 'text': 'please.'}]}]
    ids, mms = vl_pipe.encode_with_images(msgs)
    assert len(mms) == 2 and all(set(ids[m.start:m.end]) == {hf_vl.config.image_token_id} for m in mms)
    assert ids[mms[0].start - 1] == hf_vl.config.vision_start_token_id == ids[mms[1].start - 1]
    assert ids[mms[0].end] == hf_vl.config.vision_end_token_id
    px = torch.cat([m.data['pixel_values'] for m in mms])
    grid = torch.cat([m.data['image_grid_thw'] for m in mms])
    ref = image_processor(images=[a, b], return_tensors='pt')
    assert torch.equal(px, ref['pixel_values']) and torch.equal(grid, ref['image_grid_thw'])
    gen = GenerationConfig(max_new_tokens=8)
    out = vl_pipe(msgs, gen)
    assert out.token_ids == _hf_greedy(hf_vl, ids, px, grid, 8)
    # the same picture as a file path and as a data URL: same content hash, so the cache hits
    for src in (str(path), _data_url(a)):
        same = [{'role': 'user', 'content': [dict(msgs[0]['content'][0]), {'type': 'image_url', 'image_url': src},
                                             *msgs[0]['content'][2:]]}]
        ids2, mms2 = vl_pipe.encode_with_images(same)
        assert ids2 == ids and mms2[0].content_hash == mms[0].content_hash
    again = vl_pipe(msgs, gen)
    assert again.token_ids == out.token_ids and again.cached_tokens > mms[1].start


def test_pipeline_rejects_bad_image_parts(vl_pipe, tiny_qwen3_next):
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.pipeline import Pipeline
    bad = [{'role': 'user', 'content': [{'type': 'text', 'text': 'x'},
                                        {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,@@'}}]}]
    with pytest.raises(ValueError, match=r'messages\[0\]\.content\[1\]'):
        vl_pipe(bad, GenerationConfig(max_new_tokens=1))
    missing = [{'role': 'user', 'content': [{'type': 'image', 'image': '/nonexistent.png'}]}]
    with pytest.raises(ValueError, match=r'messages\[0\]\.content\[0\].*not found'):
        vl_pipe(missing, GenerationConfig(max_new_tokens=1))
    with Pipeline(tiny_qwen3_next, PytorchEngineConfig(device_type='cpu', dtype='float32',
                                                       num_gpu_blocks=64)) as text_only:
        with pytest.raises(ValueError, match='does not accept images'):
            text_only([{'role': 'user', 'content': [{'type': 'image', 'image': _image(32, 32, 1)}]}])


@pytest.fixture(scope='module')
def image_http(tmp_path_factory):
    """A 127.0.0.1 HTTP server: /a.png (an image), /big (1 MiB), /slow (answers after 3 s),
    /text (not an image)."""
    import http.server
    import threading
    import time
    png = tmp_path_factory.mktemp('http') / 'a.png'
    _image(40, 56, 7).save(png)
    bodies = {'/a.png': png.read_bytes(), '/big': b'\0' * (1 << 20), '/text': b'hello'}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == '/slow':
                time.sleep(3)
            body = bodies.get(self.path, b'')
            self.send_response(200 if self.path in bodies or self.path == '/slow' else 404)
            self.send_header('Content-Length', str(len(body)))
            try:
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):      # the client gave up (/slow)
                pass

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{srv.server_address[1]}'
    srv.shutdown()


TAIL = {'type': 'text', 'text': ' in a few words, then list the colours you see in it, one per line.'}


def test_api_server_image_url_parts(vl_pipe, hf_vl, image_http):
    from starlette.testclient import TestClient
    from lmdeploy.serve.images import ImageFetchLimits
    from lmdeploy.serve.openai.api_server import create_app
    # the image server is on this machine: loopback URLs are allowed for this app only (refused by default)
    app = create_app(vl_pipe, 'tiny', image_fetch=ImageFetchLimits(max_bytes=64 << 10, timeout_s=1.0,
                                                                   allow_private=True))

    def chat(url, n=6):
        body = {'model': 'tiny', 'max_tokens': n, 'temperature': 0, 'messages': [{'role': 'user', 'content': [
            {'type': 'text', 'text': 'Describe'}, {'type': 'image_url', 'image_url': {'url': url}}, TAIL]}]}
        return client.post('/v1/chat/completions', json=body)

    with TestClient(app) as client:
        by_url, by_data = chat(image_http + '/a.png'), chat(_data_url(_image(40, 56, 7)))
        assert by_url.status_code == by_data.status_code == 200, by_url.text
        assert by_url.json()['choices'][0]['message'] == by_data.json()['choices'][0]['message']
        msgs = [{'role': 'user', 'content': [{'type': 'text', 'text': 'Describe'},
                                             {'type': 'image', 'image': _image(40, 56, 7)}, TAIL]}]
        ids, mms = vl_pipe.encode_with_images(msgs)
        expected = vl_pipe.tokenizer.decode(_hf_greedy(hf_vl, ids, mms[0].data['pixel_values'],
                                                       mms[0].data['image_grid_thw'], 6), skip_special_tokens=True)
        assert by_url.json()['choices'][0]['message']['content'] == expected
        assert by_data.json()['usage']['prompt_tokens_details']['cached_tokens'] > mms[0].start
        for url, words in [(image_http + '/big', 'over the limit'), (image_http + '/slow', 'fetch'),
                           (image_http + '/text', 'not a readable image'), (image_http + '/missing', '404'),
                           ('data:image/png;base64,@@', 'invalid base64'),
                           ('data:image/png;base64,aGVsbG8=', 'not an image format')]:
            r = chat(url)
            assert r.status_code == 400, (url, r.text)
            err = r.json()['error']
            assert err['param'] == 'messages[0].content[1]' and err['message'].startswith('messages[0].content[1]: ') \
                and words in err['message'], err
            assert 'BytesIO' not in err['message'] and ' at 0x' not in err['message'], err   # no object reprs


def test_store_restore_with_images_matches_transformers(tiny_qwen3_5, hf_vl, image_processor, mooncake_services):
    """An engine with an empty local cache restores from the Store past both images (same
    logits/greedy as transformers); a different first image gets no Store hit past its start."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    cfg = dict(device_type='cpu', dtype='float32', block_size=16, prefill_save_alignment=16,
               max_prefill_token_num=64, enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=16,
               mooncake_master=mooncake_services.master_address,
               mooncake_metadata_server=mooncake_services.metadata_server, mooncake_local_buffer_size=1 << 20)
    ids, mms, px, grid = _prompt(image_processor, hf_vl.config, _pieces(TWO))
    other = _prompt(image_processor, hf_vl.config, _pieces([TWO[0], (32, 32, 77), *TWO[2:]]))
    assert other[0] == ids
    expected = _hf_greedy(hf_vl, ids, px, grid, 8)
    gen = GenerationConfig(max_new_tokens=8)
    writer = Engine(tiny_qwen3_5, PytorchEngineConfig(**cfg))
    try:
        assert writer.generate(ids, gen, multimodal=mms).output_ids == expected
    finally:
        writer.close()
    reader = Engine(tiny_qwen3_5, PytorchEngineConfig(**cfg))
    try:
        miss = reader.generate(other[0], gen, multimodal=other[1])
        assert miss.stats.store_hit_tokens <= mms[0].start
        ref = _hf_logits(hf_vl, ids, px, grid)
        rec = StepRecorder(reader, keep_logits=True)
        seq = reader.generate(ids, gen, multimodal=mms)
        assert seq.stats.store_hit_tokens > mms[1].end and seq.output_ids == expected
        n = seq.num_cached_tokens
        got = torch.cat([blk for _, blk in sorted(rec.logits[seq.seq_id], key=lambda p: p[0])])[:len(ids) - n]
        assert (got - ref[n:]).abs().max().item() <= TOL
    finally:
        reader.close()


def test_batched_with_other_requests_equals_alone(tiny_qwen3_5, hf_vl, image_processor):
    """Image and text requests sharing forwards (prefill chunks next to decode tokens): each
    sequence's positions and image rows are its own, so outputs equal transformers alone."""
    one = _prompt(image_processor, hf_vl.config, _pieces(ONE))
    two = _prompt(image_processor, hf_vl.config, _pieces(TWO))
    text = random_prompt(70, 12)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    eng = make_engine(tiny_qwen3_5, block_size=16, max_prefill_token_num=32, max_batch_size=4)
    rec = StepRecorder(eng)
    seqs = []
    for step in range(200):
        if step == 0:
            seqs.append(eng.add_request(two[0], gen, multimodal=two[1]))
        if step == 1:
            seqs.append(eng.add_request(text, gen))
        if step == 2:
            seqs.append(eng.add_request(one[0], gen, multimodal=one[1]))
        eng.step()
        if len(seqs) == 3 and all(s.is_finished for s in seqs):
            break
    assert rec.max_concurrent() >= 2 and rec.num_mixed_steps >= 1
    alone = make_engine(tiny_qwen3_5, block_size=16)
    assert seqs[0].output_ids == alone.generate(two[0], gen, multimodal=two[1]).output_ids
    assert seqs[1].output_ids == alone.generate(text, gen).output_ids
    assert seqs[2].output_ids == alone.generate(one[0], gen, multimodal=one[1]).output_ids
    assert all(not s.encoder_cache for s in seqs)       # encoder outputs dropped once their spans were computed


_WRITER = r'''
import json, sys
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.serve.pipeline import Pipeline
model, cfg, msgs = json.loads(sys.argv[1])
with Pipeline(model, PytorchEngineConfig(**cfg)) as pipe:
    out = pipe(msgs, GenerationConfig(max_new_tokens=8))
    assert pipe.engine.store.flush(timeout=60)
    print(json.dumps(out.token_ids))
'''


def test_store_restore_with_images_in_a_fresh_process(tiny_qwen3_5, hf_vl, mooncake_services, tmp_path):
    """A writer process serves a 2-image prompt (image files) through the pipeline; this process,
    with an empty local cache, restores it from the Store past both images and decodes the
    tokens transformers decodes."""
    import json
    import os
    import subprocess
    import sys
    import uuid

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.pipeline import Pipeline
    paths = []
    for i, (h, w, seed) in enumerate([(32, 32, 8), (64, 40, 9)]):
        paths.append(str(tmp_path / f'{i}.png'))
        _image(h, w, seed).save(paths[-1])
    msgs = [{'role': 'user', 'content': [{'type': 'text', 'text': 'Look at'}, {'type': 'image', 'image': paths[0]},
                                         {'type': 'text', 'text': 'and then at'},
                                         {'type': 'image', 'image': paths[1]},
                                         {'type': 'text', 'text': 'and say what differs between the two.'}]}]
    cfg = dict(device_type='cpu', dtype='float32', block_size=16, prefill_save_alignment=16, max_prefill_token_num=64,
               enable_prefix_caching=True, num_gpu_blocks=256, num_checkpoint_slots=16,
               mooncake_master=mooncake_services.master_address,
               mooncake_metadata_server=mooncake_services.metadata_server, mooncake_local_buffer_size=1 << 20,
               store_namespace=f'images-{uuid.uuid4().hex}')      # prompts new to the shared Store
    proc = subprocess.run([sys.executable, '-c', _WRITER, json.dumps([tiny_qwen3_5, cfg, msgs])], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    with Pipeline(tiny_qwen3_5, PytorchEngineConfig(**cfg)) as pipe:
        ids, mms = pipe.encode_with_images(msgs)
        px = torch.cat([m.data['pixel_values'] for m in mms])
        grid = torch.cat([m.data['image_grid_thw'] for m in mms])
        expected = _hf_greedy(hf_vl, ids, px, grid, 8)
        out = pipe(msgs, GenerationConfig(max_new_tokens=8))
        assert pipe.engine.stats()['store_hit_tokens'] > mms[1].end
        assert out.cached_tokens > mms[1].end and out.token_ids == written == expected


@pytest.mark.parametrize('last_only', [False, True], ids=['default', 'last_only'])
def test_incremental_agent_turn_repeating_the_image_hits(tiny_qwen3_5, last_only):
    """Turn 2 = turn 1's messages (with the same image) + the reply + new text: it restores at
    turn 1's last checkpoint, past the image, under both save policies; a different image in the
    same conversation gets no hit past the image start."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.paging.prefill_plan import last_reusable
    from lmdeploy.serve.pipeline import Pipeline
    image = _data_url(_image(40, 56, 7))
    turn1 = [{'role': 'user', 'content': [{'type': 'text', 'text': 'What is in this picture?'},
                                          {'type': 'image_url', 'image_url': {'url': image}},
                                          {'type': 'text', 'text': 'Describe every part of it in detail, please.'}]}]
    cfg = PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=256, block_size=16,
                              enable_prefix_caching=True, prefill_save_alignment=16, max_prefill_token_num=32,
                              num_checkpoint_slots=8, prefill_save_last_only=last_only)
    with Pipeline(tiny_qwen3_5, cfg) as pipe:
        ids1, mms = pipe.encode_with_images(turn1)
        first = pipe(turn1, GenerationConfig(max_new_tokens=12, ignore_eos=True))
        turn2 = turn1 + [{'role': 'assistant', 'content': first.text},
                         {'role': 'user', 'content': 'And what colour is the top left corner?'}]
        ids2, _ = pipe.encode_with_images(turn2)
        assert ids2[:len(ids1)] == ids1
        # the deepest checkpoint of turn 1 (16-token boundaries, never inside the image span)
        expected = last_reusable(len(ids1), 16, 16, 0, 0, [(m.start, m.end) for m in mms])
        assert expected > mms[0].end
        second = pipe(turn2, GenerationConfig(max_new_tokens=4, ignore_eos=True))
        assert second.cached_tokens == expected
        other = [dict(turn2[0], content=[turn2[0]['content'][0],
                                         {'type': 'image_url', 'image_url': {'url': _data_url(_image(40, 56, 99))}},
                                         turn2[0]['content'][2]]), *turn2[1:]]
        assert pipe(other, GenerationConfig(max_new_tokens=4, ignore_eos=True)).cached_tokens <= mms[0].start


def test_api_server_refuses_local_image_paths(vl_pipe, tmp_path):
    """An ``image_url`` that is a local path or a ``file://`` URL is a 400 naming the part: a
    remote client must not make the server open its files (nor learn which exist); the server
    keeps serving."""
    from starlette.testclient import TestClient
    from lmdeploy.serve.openai.api_server import create_app
    png = tmp_path / 'local.png'
    _image(40, 56, 7).save(png)

    def chat(url):
        body = {'model': 'tiny', 'max_tokens': 2, 'temperature': 0, 'messages': [{'role': 'user', 'content': [
            {'type': 'text', 'text': 'Describe'}, {'type': 'image_url', 'image_url': {'url': url}}]}]}
        return client.post('/v1/chat/completions', json=body)

    with TestClient(create_app(vl_pipe, 'tiny')) as client:
        for url in [str(png), 'file://' + str(png), '/etc/hostname', str(tmp_path / 'missing.png'), 'ftp://x/a.png']:
            r = chat(url)
            assert r.status_code == 400, (url, r.text)
            err = r.json()['error']
            assert err['param'] == 'messages[0].content[1]' and err['message'].startswith('messages[0].content[1]: ') \
                and 'data: URL or an http(s) URL' in err['message'], err
        assert chat(_data_url(_image(40, 56, 7))).status_code == 200


def test_api_server_image_the_processor_refuses_names_its_part(vl_pipe):
    """An image the checkpoint's image processor refuses (aspect ratio over 200) is a 400 whose
    message names that image's part, not only the processor's complaint."""
    from starlette.testclient import TestClient
    from lmdeploy.serve.openai.api_server import create_app
    with TestClient(create_app(vl_pipe, 'tiny')) as client:
        body = {'model': 'tiny', 'max_tokens': 2, 'messages': [{'role': 'user', 'content': [
            {'type': 'image_url', 'image_url': {'url': _data_url(_image(40, 56, 7))}},
            {'type': 'text', 'text': 'and'},
            {'type': 'image_url', 'image_url': {'url': _data_url(_image(4, 1000, 8))}}]}]}
        r = client.post('/v1/chat/completions', json=body)
        assert r.status_code == 400, r.text
        err = r.json()['error']
        assert err['param'] == 'messages[0].content[2]' and err['message'].startswith('messages[0].content[2]: ') \
            and 'aspect ratio' in err['message'], err


@pytest.mark.parametrize('api', ['responses', 'messages'])
def test_api_server_image_errors_name_the_clients_own_part(vl_pipe, api):
    """Through ``/v1/responses`` and ``/v1/messages`` an image the server refuses (a local path;
    a data: URL that is not an image) is a 400 naming the part as that API's client sent it
    (``input[i].content[j]`` / ``messages[i].content[j]`` of its own request, not of the
    translated chat messages); the server keeps serving."""
    from starlette.testclient import TestClient
    from lmdeploy.serve.openai.api_server import create_app

    def post(url):
        if api == 'responses':
            return client.post('/v1/responses', json={
                'model': 'tiny', 'max_output_tokens': 2, 'store': False, 'instructions': 'S', 'input': [
                    {'role': 'user', 'content': 'hi'}, {'role': 'user', 'content': [
                        {'type': 'input_text', 'text': 'see'}, {'type': 'input_image', 'image_url': url}]}]})
        return client.post('/v1/messages', json={'model': 'tiny', 'max_tokens': 2, 'system': 'S', 'messages': [
            {'role': 'user', 'content': 'ls'},
            {'role': 'assistant', 'content': [{'type': 'tool_use', 'id': 't1', 'name': 'ls', 'input': {}}]},
            {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': 't1', 'content': 'a.txt'},
                                         {'type': 'text', 'text': 'see'},
                                         {'type': 'image', 'source': {'type': 'url', 'url': url}}]}]})

    where = 'input[1].content[1]' if api == 'responses' else 'messages[2].content[2]'
    with TestClient(create_app(vl_pipe, 'tiny')) as client:
        for url, why in [('/etc/hostname', "an image_url must be a data: URL or an http(s) URL, got '/etc/hostname'"),
                         ('data:image/png;base64,@@',
                          'cannot decode the image (invalid base64: Only base64 data is allowed)')]:
            r = post(url)
            assert r.status_code == 400, r.text
            message = f'{where}: {why}'      # the client's own part leads, once (no 'input: ' before it)
            if api == 'responses':
                assert r.json() == {'error': {'message': message, 'type': 'invalid_request_error', 'param': where,
                                              'code': 'invalid_value'}}
            else:
                assert r.json() == {'type': 'error', 'error': {'type': 'invalid_request_error', 'message': message}}
        assert post(_data_url(_image(40, 56, 7))).status_code == 200
