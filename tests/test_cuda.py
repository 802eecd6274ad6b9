"""CUDA: the kernels the registry picks on a GPU equal the torch implementations, and the engine on
a GPU equals the CPU engine, transformers, and itself with the prefix cache on (Qwen3, Qwen3-Next,
Granite-4.0-H, granitemoe_swa, Inkling).

Every test here skips without CUDA (``scripts/gpu_check.sh`` runs them on a GPU machine).
Tolerances: the Triton and torch kernels compute in float32 with the same formulas, so they
agree to 1e-5 per element (1e-4 on logits, as on CPU). ``fla-core``'s chunked kernels, when
installed, multiply in TF32 inside their chunks (10-bit mantissa), which moves a float32 logit
by up to ~1e-3 on these tiny models; with fla the bounds are 5e-3 and say so in the message.
"""
from __future__ import annotations

import importlib.util
import inspect
import warnings

import pytest
import torch

from lmdeploy import GenerationConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')

FLA = importlib.util.find_spec('fla') is not None
# see the module docstring: fla's chunk kernels multiply in TF32
LOGIT_TOL = 5e-3 if FLA else 1e-4
KERNEL_TOL = 5e-3 if FLA else 1e-5


def _varlen_batch(lengths: list[int], history: list[bool], num_slots: int, seed: int):
    """cu_seqlens, seq_ids, slots, has_history of a mixed batch (lengths 1 = decode rows)."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lengths).cumsum(0)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    slots = torch.randperm(num_slots, generator=gen)[:len(lengths)]
    return cu, seq_ids, slots, torch.tensor(history)


def test_registry_picks_the_cuda_implementations():
    from lmdeploy.pytorch.kernels import get_kernel, triton_available
    from lmdeploy.pytorch.kernels.attention_triton import paged_decode_attention_triton
    from lmdeploy.pytorch.kernels.state_copy import copy_state_slots_triton
    from lmdeploy.pytorch.kernels.window_attention_triton import (paged_window_attention_triton,
                                                                  relative_bias_attention_triton)
    if triton_available():
        assert get_kernel('copy_state_slots', 'cuda') is copy_state_slots_triton
        assert get_kernel('paged_decode_attention', 'cuda') is paged_decode_attention_triton
        assert get_kernel('paged_window_attention', 'cuda') is paged_window_attention_triton
        assert get_kernel('relative_bias_attention', 'cuda') is relative_bias_attention_triton
    from lmdeploy.pytorch.kernels.moe import limited_swiglu_experts_cuda, relu2_experts_cuda
    assert get_kernel('relu2_experts', 'cuda') is relu2_experts_cuda
    assert get_kernel('limited_swiglu_experts', 'cuda') is limited_swiglu_experts_cuda
    for op in ('rms_norm', 'gated_rms_norm', 'moe_experts', 'paged_attention', 'gated_delta_rule_varlen',
               'causal_conv1d_varlen', 'swiglu_experts', 'kda_varlen', 'kda_decode_step', 'chunk_kda'):
        get_kernel(op, 'cuda')     # every op the models use has an implementation on CUDA


def test_state_copy_triton_equals_torch():
    from lmdeploy.pytorch.kernels.state_copy import copy_state_slots_torch, copy_state_slots_triton
    pytest.importorskip('triton')
    for num_slots, slot_bytes, pairs in [(2, 16, 1), (9, 17600, 4), (64, 1 << 20, 20)]:
        gen = torch.Generator().manual_seed(num_slots)
        buf = torch.randint(0, 256, (num_slots, slot_bytes), dtype=torch.uint8, generator=gen).cuda()
        perm = torch.randperm(num_slots, generator=gen)
        src, dst = perm[:pairs].cuda(), perm[pairs:2 * pairs].cuda()
        ref = buf.clone()
        copy_state_slots_torch(ref, src, dst)
        copy_state_slots_triton(buf, src, dst)
        assert torch.equal(buf, ref)


@pytest.mark.parametrize('H, Hkv, D, block', [(4, 2, 64, 16), (8, 1, 128, 64), (6, 6, 32, 8)])
def test_paged_decode_attention_triton_equals_torch(H, Hkv, D, block):
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels.attention import paged_decode_attention
    from lmdeploy.pytorch.kernels.attention_triton import paged_decode_attention_triton
    gen = torch.Generator().manual_seed(H * D)
    lens = [1, 7, 300, 64]
    W = -(-max(lens) // block)
    nb = len(lens) * W + 2
    k_cache, v_cache = (torch.randn(nb, block, Hkv, D, generator=gen).cuda() for _ in range(2))
    table = torch.randperm(nb, generator=gen)[:len(lens) * W].view(len(lens), W).cuda()
    q = torch.randn(len(lens), H, D, generator=gen).cuda()
    kv = torch.tensor(lens).cuda()
    ref = paged_decode_attention(q, k_cache, v_cache, table, kv, D ** -0.5)
    out = paged_decode_attention_triton(q, k_cache, v_cache, table, kv, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _window_step_on_cuda(seqs, window, gqa, sinks, block_size, seed, Hkv, D, dtype):
    """tests/test_window_attention_batched.py's step (NaN outside every window), on the GPU in
    ``dtype``: ``(q, k, v, k_cache, v_cache, ctx, sink)``."""
    from test_window_attention_batched import _step
    from lmdeploy.pytorch.model_inputs import StepContext
    q, k, v, kc, vc, ctx, sink = _step(seqs, window, gqa, sinks, block_size, seed, Hkv=Hkv, D=D)
    q, k, v, kc, vc = (t.to('cuda', dtype) for t in (q, k, v, kc, vc))
    ctx = StepContext(input_ids=ctx.input_ids.cuda(), positions=ctx.positions.cuda(), q_seqlens=ctx.q_seqlens,
                      q_start_loc=ctx.q_start_loc, kv_seqlens=ctx.kv_seqlens,
                      block_tables=[t.cuda() for t in ctx.block_tables], state_slots=ctx.state_slots,
                      kv_caches=[(kc, vc)], state_caches=[None], block_size=block_size)
    return q, k, v, kc, vc, ctx, None if sink is None else sink.cuda()


@pytest.mark.parametrize('seqs, window, gqa, sinks, block, Hkv, D', [
    ([(h, 1) for h in (0, 3, 127, 128, 129, 300, 1000, 64)], 128, 4, True, 16, 2, 64),      # decode
    ([(h, 1) for h in (5, 700, 64)], None, 8, False, 64, 1, 128),
    ([(37, 300), (0, 1), (500, 1), (13, 90)], 128, 2, True, 16, 4, 64),                    # prefill mid-block
    ([(900, 200), (2, 1)], 1, 1, True, 64, 2, 128),
    ([(0, 257), (70, 33)], 4096, 6, False, 32, 1, 80)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_paged_window_attention_triton_equals_torch(seqs, window, gqa, sinks, block, Hkv, D, dtype):
    """The Triton kernel against the per-sequence torch reference on the GPU, model-sized heads
    and blocks: float32 within 1e-5 (both float32, summed in another order); bfloat16 caches
    within half a bfloat16 ulp of the float32 result plus that (the kernel rounds its float32
    result to the nearest bfloat16 once; Triton's interpreter truncates instead, a whole ulp,
    which is why this bound is checked here and not under the interpreter)."""
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels import window_attention as wa
    from lmdeploy.pytorch.kernels.attention import fill_kv_cache
    from lmdeploy.pytorch.kernels.window_attention_triton import paged_window_attention_triton
    q, k, v, kc, vc, ctx, sink = _window_step_on_cuda(seqs, window, gqa, sinks, block, 3, Hkv, D, dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    fill_kv_cache(k, v, ref_kc, ref_vc, ctx)
    got = paged_window_attention_triton(q, k, v, kc, vc, ctx, D ** -0.5, window, sink)
    assert not got.isnan().any()
    assert torch.equal(kc.nan_to_num(), ref_kc.nan_to_num()) and torch.equal(vc.nan_to_num(), ref_vc.nan_to_num())
    ref = wa.paged_window_attention_reference(q.float(), k.float(), v.float(), ref_kc.float(), ref_vc.float(), ctx,
                                              D ** -0.5, window, sink)
    rtol = 0 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), ref, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize('seqs, window, gqa, block, E, with_tau', [
    ([(h, 1) for h in (0, 3, 127, 128, 300, 64)], 128, 4, 16, 128, False),       # decode, E = window
    ([(37, 300), (0, 1), (900, 1)], None, 2, 64, 256, True),                    # global, log-scaled
    ([(13, 90), (200, 40)], 64, 1, 16, 64, False)])
def test_relative_bias_attention_triton_equals_inklings_torch_path(seqs, window, gqa, block, E, with_tau):
    """Inkling's relative bias inside the kernel against its per-sequence torch loop on the GPU
    (float32, head_dim 64, d_rel 32): within 1e-5, as the plain kernel."""
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels.attention import fill_kv_cache
    from lmdeploy.pytorch.kernels.window_attention_triton import relative_bias_attention_triton
    from lmdeploy.pytorch.models.inkling import tiled_attention
    q, k, v, kc, vc, ctx, _ = _window_step_on_cuda(seqs, window, gqa, False, block, 5, 2, 64, torch.float32)
    gen = torch.Generator().manual_seed(6)
    rel = torch.randn(q.shape[0], q.shape[1], 32, generator=gen).cuda() * 0.2
    proj = torch.randn(32, E, generator=gen).cuda() * 0.2
    tau = (1 + torch.rand(q.shape[0], generator=gen)).cuda() if with_tau else None
    ref_kc, ref_vc = kc.clone(), vc.clone()
    fill_kv_cache(k, v, ref_kc, ref_vc, ctx)
    ref = torch.full_like(q, float('nan'))
    tiled_attention(q, rel, proj, ref_kc, ref_vc, ctx, 1 / 64, window, tau, ref, list(range(len(seqs))))
    got = relative_bias_attention_triton(q, k, v, rel, proj, kc, vc, ctx, 1 / 64, window, tau)
    assert not got.isnan().any() and not ref.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_gated_delta_rule_varlen_cuda_equals_cpu():
    """A mixed batch (decode rows, a short and a long prefill, with and without history): the
    CUDA choice of the registry against the CPU torch implementation, outputs and states."""
    from lmdeploy.pytorch.kernels import get_kernel
    from lmdeploy.pytorch.kernels.gated_delta_rule import gated_delta_rule_varlen
    lengths, history = [1, 1, 37, 200], [True, True, False, True]
    H, dk, dv, S = 4, 32, 64, 8
    cu, _, slots, has_history = _varlen_batch(lengths, history, S, seed=1)
    gen = torch.Generator().manual_seed(2)
    T = sum(lengths)
    q, k = (torch.randn(T, H, dk, generator=gen) for _ in range(2))
    v = torch.randn(T, H, dv, generator=gen)
    g = -torch.rand(T, H, generator=gen)
    beta = torch.rand(T, H, generator=gen)
    cache = torch.randn(S, H, dk, dv, generator=gen) * 0.1
    cpu_cache = cache.clone()
    ref = gated_delta_rule_varlen(q, k, v, g, beta, cpu_cache, cu, slots, has_history)
    gpu_cache = cache.cuda()
    args = [t.cuda() for t in (q, k, v, g, beta)]
    out = get_kernel('gated_delta_rule_varlen', 'cuda')(*args, gpu_cache, cu.cuda(), slots.cuda(), has_history.cuda())
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=KERNEL_TOL, rtol=KERNEL_TOL,
                               msg=lambda m: f'{m} (fla installed: {FLA}, TF32 inside its chunks)')
    torch.testing.assert_close(gpu_cache.cpu(), cpu_cache, atol=KERNEL_TOL, rtol=KERNEL_TOL)


def test_kda_varlen_cuda_equals_cpu():
    """Kimi Delta Attention over a mixed batch (decode rows through ``kda_decode_step``, prefills
    through ``chunk_kda``; fla's kernels when fla-core >= 0.6 is installed) against the CPU torch
    implementation, outputs and states."""
    from lmdeploy.pytorch.kernels import get_kernel
    from lmdeploy.pytorch.kernels import kimi_delta_attention as kda
    if kda._fla_kda_installed():
        assert get_kernel('chunk_kda', 'cuda') is kda.chunk_kda_fla
        assert get_kernel('kda_decode_step', 'cuda') is kda.kda_decode_step_fla
    lengths, history = [1, 1, 45, 130, 1], [True, True, False, True, False]
    H, dk, dv, S = 4, 32, 64, 8
    cu, _, slots, has_history = _varlen_batch(lengths, history, S, seed=5)
    gen = torch.Generator().manual_seed(6)
    T = sum(lengths)
    q, k = (torch.randn(T, H, dk, generator=gen) for _ in range(2))
    v = torch.randn(T, H, dv, generator=gen)
    g = -torch.rand(T, H, dk, generator=gen) * 2.0
    beta = torch.rand(T, H, generator=gen)
    cache = torch.randn(S, H, dk, dv, generator=gen) * 0.1
    cpu_cache, gpu_cache = cache.clone(), cache.cuda()
    ref = kda.kda_varlen(q, k, v, g, beta, cpu_cache, cu, slots, has_history)
    out = get_kernel('kda_varlen', 'cuda')(*[t.cuda() for t in (q, k, v, g, beta)], gpu_cache, cu.cuda(),
                                           slots.cuda(), has_history.cuda())
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=KERNEL_TOL, rtol=KERNEL_TOL,
                               msg=lambda m: f'{m} (fla installed: {FLA}, TF32 inside its chunks)')
    torch.testing.assert_close(gpu_cache.cpu(), cpu_cache, atol=KERNEL_TOL, rtol=KERNEL_TOL)


def test_causal_conv1d_varlen_cuda_equals_cpu():
    from lmdeploy.pytorch.kernels import get_kernel
    from lmdeploy.pytorch.kernels.causal_conv1d import causal_conv1d_varlen
    lengths, history = [1, 9, 1, 120], [True, False, True, True]
    C, K, S = 96, 4, 6
    cu, seq_ids, slots, has_history = _varlen_batch(lengths, history, S, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(lengths), C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    cache = torch.randn(S, C, K - 1, generator=gen)
    cpu_cache, gpu_cache = cache.clone(), cache.cuda()
    ref = causal_conv1d_varlen(x, w, None, cpu_cache, cu, seq_ids, slots, has_history)
    out = get_kernel('causal_conv1d_varlen', 'cuda')(x.cuda(), w.cuda(), None, gpu_cache, cu.cuda(), seq_ids.cuda(),
                                                     slots.cuda(), has_history.cuda())
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu_cache.cpu(), cpu_cache, atol=1e-5, rtol=1e-5)


def test_mamba2_ssd_varlen_cuda_equals_cpu():
    """Decode rows (the Triton ``ssd_step``) and prefills of one, several and a partial SSD chunk
    with and without history (the Triton ``ssd_chunk_scan``) against the CPU torch path."""
    from lmdeploy.pytorch.kernels import get_kernel, triton_available
    from lmdeploy.pytorch.kernels.mamba2 import mamba2_ssd_varlen
    from lmdeploy.pytorch.kernels.mamba2_triton import ssd_chunk_scan_triton, ssd_step_triton
    if triton_available():
        assert get_kernel('ssd_step', 'cuda') is ssd_step_triton
        assert get_kernel('ssd_chunk_scan', 'cuda') is ssd_chunk_scan_triton
    lengths, history = [1, 1, 37, 150, 1], [True, False, False, True, True]
    H, P, G, Dn, S = 8, 64, 2, 128, 8
    cu, _, slots, has_history = _varlen_batch(lengths, history, S, seed=6)
    gen = torch.Generator().manual_seed(7)
    T = sum(lengths)
    x = torch.randn(T, H, P, generator=gen)
    dt = torch.rand(T, H, generator=gen) * 0.2 + 0.01
    A = -torch.rand(H, generator=gen) * 4
    B, C = (torch.randn(T, G, Dn, generator=gen) for _ in range(2))
    D = torch.randn(H, generator=gen)
    cache = torch.randn(S, H, P, Dn, generator=gen) * 0.1
    cpu_cache, gpu_cache = cache.clone(), cache.cuda()
    ref = mamba2_ssd_varlen(x, dt, A, B, C, D, cpu_cache, cu, slots, has_history, 64)
    out = get_kernel('mamba2_ssd_varlen', 'cuda')(*(t.cuda() for t in (x, dt, A, B, C, D)), gpu_cache, cu.cuda(),
                                                  slots.cuda(), has_history.cuda(), 64)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gpu_cache.cpu(), cpu_cache, atol=1e-5, rtol=1e-5)


def test_moe_experts_cuda_equals_cpu():
    from lmdeploy.pytorch.kernels import get_kernel
    from lmdeploy.pytorch.kernels.moe import moe_experts_sorted
    gen = torch.Generator().manual_seed(5)
    T, H, I, E, k = 33, 64, 48, 8, 2
    x = torch.randn(T, H, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
    ref = moe_experts_sorted(x, index, weights, gate_up, down)
    out = get_kernel('moe_experts', 'cuda')(*(t.cuda() for t in (x, index, weights, gate_up, down)))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('op', ['relu2_experts', 'limited_swiglu_experts'])
def test_gathered_expert_layers_capture_and_replay_on_cuda(op):
    """The CUDA relu^2 and limited-SwiGLU expert layers of a decode-sized batch (the gathered form:
    nothing read on the host) captured in a CUDA graph: each replay on new inputs and routing
    (expert ids repeated across tokens) equals an eager call bit for bit and the CPU loop to
    1e-4 (float32 products in another order, as test_moe_experts_cuda_equals_cpu)."""
    from lmdeploy.pytorch.kernels import get_kernel
    from lmdeploy.pytorch.kernels.moe import gathered_applies, limited_swiglu_experts_loop, relu2_experts_loop
    T, D, I, E, k = 8, 64, 48, 8, 2
    relu2 = op == 'relu2_experts'
    loop, extra = (relu2_experts_loop, ()) if relu2 else (limited_swiglu_experts_loop, ('clipped', 0.5))
    kernel = get_kernel(op, 'cuda')
    assert gathered_applies(T, k, E)
    gen = torch.Generator().manual_seed(6)
    w1 = torch.randn(E, I if relu2 else 2 * I, D, generator=gen) * 3 * D ** -0.5
    w2 = torch.randn(E, D, I, generator=gen) * I ** -0.5

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(T, D, generator=g), torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]),
                torch.rand(T, k, generator=g))

    static = [t.cuda() for t in step(0)]
    W1, W2 = w1.cuda(), w2.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            kernel(*static, W1, W2, *extra)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(*static, W1, W2, *extra)
    for seed in (1, 2, 3):
        inputs = step(seed)
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kernel(*static, W1, W2, *extra)), seed
        torch.testing.assert_close(out.cpu(), loop(*inputs, w1, w2, *extra), atol=1e-4, rtol=1e-4)


def _engine(path, device, **fields):
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    fields.setdefault('num_gpu_blocks', 256)
    return Engine(path, PytorchEngineConfig(device_type=device, dtype='float32', **fields))


@pytest.fixture(scope='module')
def engines():
    """``engines(path, device, **fields)``: one engine per model, device and config for the module
    (an idle engine serves the next test as a new one would; building one costs seconds on a GPU)."""
    made = {}

    def get(path, device, **fields):
        key = (path, device, tuple(sorted(fields.items())))
        if key not in made:
            made[key] = _engine(path, device, **fields)
        return made[key]
    return get


@pytest.mark.parametrize('model', ['tiny_qwen3_next', 'tiny_qwen3'])
def test_engine_on_cuda_equals_transformers_and_the_cpu_engine(model, request, engines):
    """Prompt logits in 128-token chunks vs transformers; greedy tokens vs the CPU engine (the
    130-token prompt prefills in two chunks)."""
    from engine_utils import engine_prompt_logits, hf_prompt_logits, load_hf, random_prompt
    path = request.getfixturevalue(model)
    prompt = random_prompt(300, seed=7)
    on_gpu, on_cpu = engines(path, 'cuda', max_prefill_token_num=128), engines(path, 'cpu')
    logits, _ = engine_prompt_logits(on_gpu, prompt)
    ref = hf_prompt_logits(load_hf(path), prompt)
    err = (logits.float().cpu() - ref).abs().max().item()
    assert err <= LOGIT_TOL, f'max |logit diff| {err} vs transformers (fla installed: {FLA})'
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for p in [random_prompt(n, seed=n) for n in (5, 64, 130)]:
        assert on_gpu.generate(p, gen).token_ids == on_cpu.generate(p, gen).token_ids


def test_engine_on_cuda_prefix_cache_restore_equals_cold(tiny_qwen3_next, engines):
    """Checkpoints saved and restored on the GPU (Triton state copies) give the cold output."""
    from engine_utils import random_prompt
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    prompt = random_prompt(200, seed=11)
    cold = engines(tiny_qwen3_next, 'cuda', max_prefill_token_num=128).generate(prompt, gen).token_ids
    cached = _engine(tiny_qwen3_next, 'cuda', enable_prefix_caching=True, block_size=16,
                     prefill_save_alignment=64, max_prefill_token_num=64)
    first = cached.generate(prompt, gen)
    second = cached.generate(prompt, gen)
    assert first.token_ids == second.token_ids == cold
    assert second.num_cached_tokens >= 192     # restored from the checkpoint at 192 (64-aligned)


def transformers_granite_norm_is_grouped() -> bool:
    """Whether the installed transformers normalises Granite-4.0-H's gated RMSNorm per B/C group
    (``mamba_d_inner / mamba_n_groups`` channels), as mamba_ssm and the engine do: from
    transformers 5.23 on. Before, it normalised over all of ``d_inner`` at once, which differs
    whenever ``mamba_n_groups > 1`` (the tiny model has 2; published checkpoints have 1): 0.15 on
    the tiny model's logits with 5.17."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
    return 'group_size' in inspect.signature(granite.GraniteMoeHybridRMSNormGated.__init__).parameters


def test_granite_engine_on_cuda_equals_the_cpu_engine_and_transformers(tmp_path, engines):
    """Granite-4.0-H on the GPU: the Triton SSD scan in prefill chunks (32 tokens, SSD chunk 24),
    the Triton SSD step in decode; prompt logits vs the CPU engine (the CUDA kernels against the
    torch / native ones, float32) and vs transformers, greedy tokens vs the CPU engine.

    Where transformers predates the grouped norm (see
    :func:`transformers_granite_norm_is_grouped`) its reference is not the model the engine
    serves: the comparison with it is left out, with a warning, and the CPU engine (checked
    against a current transformers by tests/test_granitemoehybrid.py) is the reference."""
    from engine_utils import engine_prompt_logits, hf_prompt_logits, load_hf, random_prompt
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / 'tiny_granite'), arch='granitemoehybrid', seed=0)
    prompt = random_prompt(300, seed=7)
    on_gpu, on_cpu = (engines(path, device, max_prefill_token_num=32) for device in ('cuda', 'cpu'))
    logits = engine_prompt_logits(on_gpu, prompt)[0].float().cpu()
    err = (logits - engine_prompt_logits(on_cpu, prompt)[0].float()).abs().max().item()
    assert err <= 1e-4, f'max |logit diff| {err} vs the CPU engine'
    if transformers_granite_norm_is_grouped():
        err = (logits - hf_prompt_logits(load_hf(path), prompt)).abs().max().item()
        assert err <= LOGIT_TOL, f'max |logit diff| {err} vs transformers'
    else:
        import transformers
        warnings.warn(f'transformers {transformers.__version__} normalises Granite-4.0-H\'s gated RMSNorm over all '
                      'B/C groups at once (fixed in 5.23): compared with the CPU engine only')
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for p in [random_prompt(n, seed=n) for n in (5, 64, 130)]:
        assert on_gpu.generate(p, gen).token_ids == on_cpu.generate(p, gen).token_ids


@pytest.mark.parametrize('arch', ['granitemoe_swa', 'inkling_text'])
def test_window_engine_on_cuda_equals_the_cpu_engine_and_transformers(arch, tmp_path, engines):
    """granitemoe_swa (global and sliding layers with sinks) and Inkling (relative bias, log-scaled
    global layers) on the GPU, every attention layer through the Triton window kernel: prompt
    logits of 300 tokens in 32-token chunks whose ends fall inside the windows (16-token blocks)
    within 1e-4 of transformers and of the CPU engine (the torch attention), greedy tokens equal to
    the CPU engine's."""
    from engine_utils import engine_prompt_logits, hf_prompt_logits, load_hf, random_prompt
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path / f'tiny_{arch}'), arch=arch, seed=0)
    prompt = random_prompt(300, seed=7)
    on_gpu, on_cpu = (engines(path, device, block_size=16, max_prefill_token_num=32) for device in ('cuda', 'cpu'))
    logits = engine_prompt_logits(on_gpu, prompt)[0].float().cpu()
    err = (logits - engine_prompt_logits(on_cpu, prompt)[0].float()).abs().max().item()
    assert err <= 1e-4, f'max |logit diff| {err} vs the CPU engine'
    err = (logits - hf_prompt_logits(load_hf(path), prompt)).abs().max().item()
    assert err <= 1e-4, f'max |logit diff| {err} vs transformers'
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for p in [random_prompt(n, seed=n) for n in (5, 64, 130)]:
        assert on_gpu.generate(p, gen).token_ids == on_cpu.generate(p, gen).token_ids


@pytest.mark.parametrize('dtype, tol', [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fp8_gemm_triton_equals_torch(dtype, tol):
    """The block-scaled FP8 GEMM on the GPU against the dequantize-then-F.linear fallback; float32
    operands are multiplied at full precision there (Triton's default for them is TF32, ~1e-3)."""
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels.fp8 import fp8_block_linear_torch, fp8_block_linear_triton
    from lmdeploy.tools.fp8_checkpoint import quantize_fp8_blocks
    gen = torch.Generator().manual_seed(3)
    q, s = quantize_fp8_blocks(torch.randn(384, 640, generator=gen), (128, 128))
    x = torch.randn(37, 640, generator=gen).to(dtype).cuda()
    b = torch.randn(384, generator=gen).to(dtype).cuda()
    got = fp8_block_linear_triton(x, q.cuda(), s.cuda(), (128, 128), b)
    want = fp8_block_linear_torch(x.float(), q.cuda(), s.cuda(), (128, 128), b.float())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


# --- CUDA decode graphs (engine/cuda_graph.py) ------------------------------------------------------
# Nemotron-H with dense MLPs, and with its relu^2 experts (the tiny model's default), which like
# Ling 3's (bailing_hybrid) limited experts capture in their gathered form (8 experts, top-2: up
# to 8 tokens); GLM-5.3-Flash (glm5_next) as well, its DSA layers in their torch form's fixed shapes
_DENSE_NEMOTRON = dict(layers_block_type=['linear_attention', 'mlp', 'full_attention', 'linear_attention', 'mlp'])


@pytest.mark.parametrize('arch, overrides', [('qwen3_next', {}), ('qwen3_5_moe_text', {}), ('kimi_linear', {}),
                                             ('nemotron_h', _DENSE_NEMOTRON), ('nemotron_h', {}),
                                             ('bailing_hybrid', {}), ('glm5_next', {})])
def test_cuda_graph_engine_replay_equals_eager(arch, overrides, family_paths):
    """30 decode steps at batch 1, 3 (bucket 4: one padding row) and 8 through the worker of a
    CUDA engine with graphs on, against the same steps with them off (same tokens fed to both:
    the eager step's greedy choices). Exact buckets replay the eager kernels on the same values:
    bit for bit. A padded batch runs its GEMMs over 4 rows instead of 3, and cuBLAS may round a
    row differently with the row count: held to LOGIT_TOL, the bound this file holds the GPU to
    the CPU with. Each batch captures its bucket once and replays every step."""
    from lmdeploy.pytorch.engine.cuda_graph import CudaGraphCache
    from lmdeploy.pytorch.model_inputs import StepBatch
    engine = _engine(family_paths(arch, overrides), 'cuda', block_size=4, max_batch_size=8, num_gpu_blocks=96)
    worker = engine.executor.worker
    ce, graphs = worker.cache_engine, worker.decode_graphs
    assert isinstance(graphs, CudaGraphCache) and graphs.buckets == [1, 2, 4, 8]
    for B in (1, 3, 8):
        ce.kv_buf.zero_()
        ce.state_buf.zero_()
        start = (ce.kv_buf.clone(), ce.state_buf.clone())
        tokens = [[(7 * i + 3) % 50 for i in range(B)]]
        runs = {}
        for mode in ('eager', 'graph'):
            worker.decode_graphs = graphs if mode == 'graph' else None
            ce.kv_buf.copy_(start[0])
            ce.state_buf.copy_(start[1])
            before = graphs.counters()
            out = []
            for step in range(30):
                kv = [5 + step + i for i in range(B)]
                batch = StepBatch(input_ids=tokens[step], positions=[k - 1 for k in kv], q_seqlens=[1] * B,
                                  q_start_loc=list(range(B)), kv_seqlens=kv,
                                  block_tables=[list(range(12 * i, 12 * i + -(-k // 4))) for i, k in enumerate(kv)],
                                  state_slots=list(range(B)), sample_rows=list(range(B)))
                logits = worker.forward(batch)[0].float().cpu()
                out.append(logits)
                if mode == 'eager':
                    tokens.append(logits.argmax(-1).tolist())
            runs[mode] = out
            after = graphs.counters()
            if mode == 'graph':
                assert after['replays'] - before['replays'] == 30 and after['refusals'] == 0, after
                assert after['captures'] - before['captures'] == 1, after
        for step, (g, e) in enumerate(zip(runs['graph'], runs['eager'])):
            if B in graphs.buckets:
                assert torch.equal(g, e), f'{arch} batch {B} step {step}: max |diff| {(g - e).abs().max().item()}'
            else:
                err = (g - e).abs().max().item()
                assert err <= LOGIT_TOL, f'{arch} batch {B} (padded) step {step}: max |diff| {err}'
    worker.decode_graphs = graphs
    assert graphs.counters()['bytes'] > 0


def test_cuda_graph_engine_generate_equals_eager_mode(tiny_qwen3_next, engines):
    """Whole requests through the engine: graphs on gives the eager_mode engine's tokens."""
    from engine_utils import random_prompt
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    with_graphs = engines(tiny_qwen3_next, 'cuda', max_batch_size=8)
    eager = engines(tiny_qwen3_next, 'cuda', max_batch_size=8, eager_mode=True)
    assert eager.executor.worker.decode_graphs is None
    for n in (5, 64):
        p = random_prompt(n, seed=n)
        assert with_graphs.generate(p, gen).token_ids == eager.generate(p, gen).token_ids
    assert with_graphs.executor.worker.decode_graphs.counters()['replays'] >= 2 * 14
