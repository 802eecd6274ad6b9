"""FP8 block-quantized checkpoints (``quant_method: fp8``, e4m3, 128 x 128 inverse scales).

- the tiny FP8 checkpoints ``make-tiny-model --fp8`` writes hold real e4m3 values and float32
  inverse scales (a dimension that is not a multiple of 128 included) and load to transformers'
  own dequantized model: logits <= 1e-4 in fp32, greedy equal, for Qwen3-Next and Qwen3.5-MoE;
- block-wise dequantization equals the block definition for any shape and block (hypothesis),
  ragged last blocks included, and transformers' ``_dequantize_fp8_weight``;
- the Triton block-scaled FP8 GEMM equals the torch fallback under ``TRITON_INTERPRET=1``;
- FP8 weights kept in memory (the CUDA path, here with the torch fallback) give the logits of
  the model dequantized at load;
- a corrupt scale shape, an FP8 tensor without a scale, a scale without a weight: ValueError
  naming the tensor; other quantization methods: ValueError naming the method and what is supported;
- the Store namespace covers the quantization: the scales are weight-file bytes.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from engine_utils import TOL, engine_prompt_logits, hf_greedy, hf_prompt_logits, make_engine, random_prompt
from lmdeploy import GenerationConfig
from lmdeploy.pytorch.kernels.fp8 import dequantize_fp8_blocks, fp8_block_linear_torch
from lmdeploy.pytorch.models.loader import load_config, load_model
from lmdeploy.pytorch.models.quantization import parse_quantization_config
from lmdeploy.tools.fp8_checkpoint import FP8_MAX, quantize_fp8_blocks
from lmdeploy.tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Qwen3-Next with linear_value_head_dim 8: every matrix is at most one 128-block tall or wide, or
# a multiple of 128 (see test_transformers_grid_dequantization_differs_on_multi_block_ragged_dims)
ARCHS = {'qwen3_next': dict(linear_value_head_dim=8), 'qwen3_5_moe_text': {}, 'qwen3_5_moe': {}}


@pytest.fixture(scope='module')
def fp8_models(tmp_path_factory):
    """arch -> (FP8 checkpoint path, transformers float32 model loaded from it: dequantized)."""
    import transformers
    out = {}
    for arch, overrides in ARCHS.items():
        path = make_tiny_model(str(tmp_path_factory.mktemp(f'fp8_{arch}')), arch=arch, fp8=True, **overrides)
        cls = transformers.Qwen3_5MoeForConditionalGeneration if arch == 'qwen3_5_moe' \
            else transformers.AutoModelForCausalLM
        out[arch] = path, cls.from_pretrained(path, dtype=torch.float32).eval()
    return out


def test_the_checkpoint_is_really_fp8(fp8_models):
    path, _ = fp8_models['qwen3_5_moe_text']
    tensors = load_file(os.path.join(path, 'model.safetensors'))
    quantized = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert quantized and all(f'{n[:-len(".weight")]}.weight_scale_inv' in tensors for n in quantized)
    assert any('.mlp.experts.' in n for n in quantized) and any(n.startswith('mtp.') for n in quantized)
    assert any(s % 128 for n in quantized for s in tensors[n].shape)        # ragged blocks
    for n in quantized:
        scale = tensors[f'{n[:-len(".weight")]}.weight_scale_inv']
        assert scale.dtype == torch.float32 and scale.shape == tuple(-(-s // 128) for s in tensors[n].shape)
        assert tensors[n].float().abs().max().item() == FP8_MAX       # each block's amax maps to 448
    assert tensors['lm_head.weight'].dtype == torch.float32                # modules_to_not_convert
    assert all(tensors[n].dtype == torch.float32 for n in tensors if n.endswith('mlp.gate.weight'))
    quant = json.load(open(os.path.join(path, 'config.json')))['quantization_config']
    assert quant['quant_method'] == 'fp8' and quant['fmt'] == 'e4m3' and quant['weight_block_size'] == [128, 128]


@pytest.mark.parametrize('arch', list(ARCHS))
def test_fp8_checkpoint_matches_transformers_dequantized_model(fp8_models, arch):
    path, hf = fp8_models[arch]
    ours = load_model(path, dtype='float32', progress=False).model
    ids = random_prompt(120, seed=7)
    got, forwards = engine_prompt_logits(make_engine(path, max_prefill_token_num=32, block_size=16), ids)
    ref = hf_prompt_logits(hf, ids)
    assert forwards == 4
    assert (got - ref).abs().max().item() <= TOL
    gen = GenerationConfig(max_new_tokens=10)
    assert make_engine(path, block_size=16, max_prefill_token_num=32).generate(ids, gen).output_ids == \
        hf_greedy(hf, ids, 10)
    # the weights really are the checkpoint's dequantized values, not its float source
    name = next(n for n, _ in ours.named_parameters() if n.endswith('self_attn.o_proj.weight'))
    ckpt = load_file(os.path.join(path, 'model.safetensors'))
    key = next(k for k in ckpt if k.endswith(name.split('model.', 1)[1]))
    deq = dequantize_fp8_blocks(ckpt[key], ckpt[key[:-len('.weight')] + '.weight_scale_inv'], (128, 128),
                                torch.float32)
    assert torch.equal(dict(ours.named_parameters())[name], deq)


def test_kept_fp8_weights_give_the_logits_of_the_dequantized_model(fp8_models):
    """The CUDA layout (plain projections keep FP8 weights, the fp8_block_linear kernel) on
    CPU with the torch fallback: same logits as dequantizing everything at load."""
    path, _ = fp8_models['qwen3_5_moe_text']
    kept = load_model(path, dtype='float32', progress=False, keep_fp8=True).model
    fp8_params = [n for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert any(n.endswith('o_proj.weight') for n in fp8_params) and any('out_proj' in n for n in fp8_params)
    eng = make_engine(path)
    deq = eng.model
    from model_harness import ModelHarness
    ids = random_prompt(50, seed=3)
    outs = []
    for model in (kept, deq):
        h = ModelHarness(model, type(model).cache_specs(load_config(path), torch.float32))
        outs.append(h.run_chunks(h.add_sequence(), ids, 20))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5     # float32 rounding of two GEMM forms


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), lead=st.sampled_from([(), (3,)]),
       block=st.sampled_from([(128, 128), (64, 32), (16, 48)]), seed=st.integers(0, 2**16))
def test_dequantization_is_the_block_definition_ragged_blocks_included(n, k, lead, block, seed):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    w = torch.randn(*lead, n, k, generator=torch.Generator().manual_seed(seed)) * 3
    q, s = quantize_fp8_blocks(w, block)
    want = torch.empty(*lead, n, k)
    for i in range(0, n, block[0]):
        for j in range(0, k, block[1]):
            want[..., i:i + block[0], j:j + block[1]] = q[..., i:i + block[0], j:j + block[1]].float() * \
                s[..., i // block[0], j // block[1], None, None]
    got = dequantize_fp8_blocks(q, s, block, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(got, _dequantize_fp8_weight(q, s, list(block), torch.float32))
    # the quantization is faithful: e4m3 has 3 mantissa bits, relative error <= 2^-4 of the block amax
    assert (got - w).abs().max().item() <= w.abs().max().item() / 16 + 1e-6


def test_transformers_grid_dequantization_differs_on_multi_block_ragged_dims():
    """transformers' load-time ``Fp8Dequantize`` derives the block from the scale grid
    (``rows // scale_rows``): right when a dimension is one partial block or a multiple of the
    block, wrong for e.g. 192 = 128 + 64 rows (it uses 96-row blocks). The engine follows the
    format (128-row blocks, the last one ragged), as the quantizer and transformers' GPU path do;
    the tests against transformers therefore use shapes where both agree."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    deq = Fp8Dequantize(None)._dequantize_one
    for n, k, same in ((64, 100, True), (256, 64, True), (192, 64, False)):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
        q, s = quantize_fp8_blocks(w)
        assert torch.equal(deq(q, s, torch.float32), dequantize_fp8_blocks(q, s, (128, 128), torch.float32)) == same


_TRITON_SCRIPT = '''
import torch
from lmdeploy.pytorch.kernels.fp8 import fp8_block_linear_torch, fp8_block_linear_triton
from lmdeploy.tools.fp8_checkpoint import quantize_fp8_blocks
checked = 0
for M, N, K, block, bias, dtype in [(1, 200, 192, (128, 128), False, torch.float32),
                                    (5, 64, 300, (128, 128), True, torch.float32),
                                    (33, 256, 128, (128, 128), False, torch.float32),
                                    (17, 70, 90, (64, 32), True, torch.float32),
                                    (4, 130, 260, (128, 128), True, torch.float16)]:
    g = torch.Generator().manual_seed(M * N)
    q, s = quantize_fp8_blocks(torch.randn(N, K, generator=g), block)
    x = torch.randn(2, M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    got = fp8_block_linear_triton(x, q, s, block, b)
    want = fp8_block_linear_torch(x.float(), q, s, block, None if b is None else b.float())
    assert got.shape == (2, M, N) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    checked += 1
print('checked', checked)
'''


def test_triton_fp8_gemm_matches_the_torch_fallback_under_interpreter():
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=f'{ROOT}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    proc = subprocess.run([sys.executable, '-c', _TRITON_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ['checked', '5']


def test_torch_fallback_is_the_dequantized_product():
    g = torch.Generator().manual_seed(0)
    q, s = quantize_fp8_blocks(torch.randn(150, 140, generator=g))
    x = torch.randn(3, 140, generator=g)
    assert torch.equal(fp8_block_linear_torch(x, q, s, (128, 128)),
                       torch.nn.functional.linear(x, dequantize_fp8_blocks(q, s, (128, 128), torch.float32)))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst, load_file(os.path.join(dst, 'model.safetensors'))


def test_corrupt_fp8_tensors_are_value_errors_naming_the_tensor(fp8_models, tmp_path):
    path, _ = fp8_models['qwen3_5_moe_text']
    ckpt = load_file(os.path.join(path, 'model.safetensors'))
    name = next(n for n in ckpt if n.endswith('self_attn.o_proj.weight_scale_inv'))
    cases = {
        'shape': ({name: torch.ones(2, 2)}, (), rf'{name}: FP8 scale shape \(2, 2\)'),
        'no_scale': ({}, (name,), rf'{name[:-len("_scale_inv")]}: an FP8 .* without'),
        'no_weight': ({}, (name[:-len('_scale_inv')],), rf'{name}: an FP8 scale without its weight'),
    }
    for case, (replace, drop, message) in cases.items():
        dst = tmp_path / case
        shutil.copytree(path, dst)
        tensors = {k: v for k, v in {**ckpt, **replace}.items() if k not in drop}
        save_file(tensors, str(dst / 'model.safetensors'), metadata={'format': 'pt'})
        with pytest.raises(ValueError, match=message):
            load_model(str(dst), dtype='float32', progress=False)


@pytest.mark.parametrize('quant, field', [
    (dict(quant_method='awq', bits=4, group_size=128), "quant_method='awq'"),
    (dict(quant_method='gptq', bits=4), "quant_method='gptq'"),
    (dict(quant_method='compressed-tensors', config_groups={}), "quant_method='compressed-tensors'"),
    (dict(quant_method='bitsandbytes', load_in_4bit=True), "quant_method='bitsandbytes'"),
    (dict(quant_method='fp8', fmt='e5m2', weight_block_size=[128, 128]), "fmt='e5m2'"),
    (dict(quant_method='fp8', activation_scheme='static', weight_block_size=[128, 128]), "activation_scheme='static'"),
    (dict(quant_method='fp8', weight_block_size=None), 'weight_block_size=None'),
    (dict(quant_method='fp8', weight_block_size=[128]), 'weight_block_size=[128]'),
])
def test_other_quantization_is_refused_naming_the_method_and_what_is_supported(quant, field):
    from types import SimpleNamespace
    with pytest.raises(ValueError, match='quantization_config.' + field.replace('[', r'\[').replace(']', r'\]')) as err:
        parse_quantization_config(SimpleNamespace(quantization_config=quant))
    assert "supported: quant_method 'fp8'" in str(err.value)


def test_an_awq_checkpoint_is_refused_at_load(tiny_qwen3_5_moe_text, tmp_path):
    dst = tmp_path / 'awq'
    shutil.copytree(tiny_qwen3_5_moe_text, dst)
    config = json.loads((dst / 'config.json').read_text())
    config['quantization_config'] = dict(quant_method='awq', bits=4, group_size=128, zero_point=True)
    (dst / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='awq' is not supported; supported: quant_method 'fp8'"):
        make_engine(str(dst))


def test_store_namespace_covers_the_scales(fp8_models, tmp_path):
    """model_identity digests every weight file (scales included) and config.json (with its
    quantization_config): a checkpoint whose only change is one scale gets another namespace."""
    from lmdeploy.pytorch.store.identity import model_identity
    path, _ = fp8_models['qwen3_5_moe_text']
    dst = tmp_path / 'scaled'
    shutil.copytree(path, dst)
    tensors = load_file(str(dst / 'model.safetensors'))
    name = next(n for n in tensors if n.endswith('weight_scale_inv'))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(dst / 'model.safetensors'), metadata={'format': 'pt'})
    a, b = model_identity(path, cache_dir=tmp_path / 'digests'), model_identity(dst, cache_dir=tmp_path / 'digests')
    assert a['config'] == b['config'] and a['config']['quantization_config']['quant_method'] == 'fp8'
    assert a['weights'] != b['weights']


def test_make_tiny_model_cli_writes_fp8(tmp_path):
    from lmdeploy.cli.entrypoint import main
    out = tmp_path / 'cli'
    assert main(['make-tiny-model', str(out), '--arch', 'qwen3_5_moe_text', '--fp8']) == 0
    assert json.loads((out / 'config.json').read_text())['quantization_config']['quant_method'] == 'fp8'
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(str(out / 'model.safetensors')).values())


def test_tp2_on_an_fp8_checkpoint_equals_tp1(fp8_models):
    """Each rank dequantizes a quantized weight read whole, then takes its slice: TP2 logits
    within the TP tolerance of TP1 and greedy tokens equal."""
    from test_tensor_parallel import PROMPTS, TP_TOL, engine
    path, _ = fp8_models['qwen3_5_moe_text']
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    ref = engine(path)
    ref_logits, _ = engine_prompt_logits(ref, PROMPTS[1])
    ref_out = [ref.generate(p, gen).output_ids for p in PROMPTS]
    ref.close()
    eng = engine(path, tp=2)
    try:
        logits, _ = engine_prompt_logits(eng, PROMPTS[1])
        assert (logits - ref_logits).abs().max().item() <= TP_TOL
        assert [eng.generate(p, gen).output_ids for p in PROMPTS] == ref_out
    finally:
        eng.close()
