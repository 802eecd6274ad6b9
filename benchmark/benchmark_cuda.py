"""Kernel and decode-throughput benchmark for a GPU (scripts/gpu_check.sh runs it), also runnable on
CPU with tiny sizes (the test suite does, to keep it working).

Two parts, one JSON file:

- ``kernels``: each op the models call, timed as the registry picks it on the device and, where
  the registry's choice is not already the torch form, the torch form on the same inputs
  (median of ``--repeats`` timed calls after a warm-up; CUDA times with events after a
  synchronise), in milliseconds per call;
- ``decode``: ``Engine`` decode throughput (tokens/s) of ``--batches`` concurrent requests of
  ``--prompt-len`` prompt tokens and ``--decode-tokens`` new tokens on a random model of
  ``--preset`` (benchmark_throughput.py's presets), beside ``transformers`` ``generate`` with
  the same weights, batch and device (``ratio`` = ours / theirs); with ``--eager-mode`` also the
  engine with ``eager_mode=True`` (no CUDA / CPU decode graphs: ``graph_speedup`` = graphs on / off).

    python3 benchmark/benchmark_cuda.py --device cuda --preset 99m --out benchmark/results/cuda.json

Each setup phase prints its seconds and each kernel case its first call's (``first_call_s``): on a
fresh machine that is mostly Triton compiling and tuning.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _timer(device: torch.device, fn, repeats: int) -> float:
    """Median milliseconds of one ``fn()`` call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == 'cuda':
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 4)


def _phase(what: str, since: float) -> None:
    """Print how long a setup phase took (seconds since ``since``, a ``time.perf_counter()``): on a
    fresh GPU machine most of a run is Triton compiling and tuning in the first calls."""
    print(f'{what}: {time.perf_counter() - since:.1f} s', flush=True)


def kernel_cases(device: torch.device, scale: int) -> dict:
    """``{case: (registry fn thunk, torch fn thunk or None)}`` on ``device``; ``scale`` 1 = tiny."""
    from lmdeploy.pytorch.kernels import get_kernel
    from lmdeploy.pytorch.kernels.attention import paged_decode_attention
    from lmdeploy.pytorch.kernels.causal_conv1d import causal_conv1d_varlen
    from lmdeploy.pytorch.kernels.gated_delta_rule import gated_delta_rule_varlen
    from lmdeploy.pytorch.kernels.moe import moe_experts_sorted
    from lmdeploy.pytorch.kernels.norm import rms_norm_torch
    from lmdeploy.pytorch.kernels.state_copy import copy_state_slots_torch
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    N, H, Hkv, D, B = 16, 8 * scale, 2 * scale, 128, 64
    ctx = 512 * scale
    W = ctx // B
    k_cache, v_cache = rnd(N * W + 1, B, Hkv, D), rnd(N * W + 1, B, Hkv, D)
    table = torch.arange(N * W, device=device).view(N, W)
    lens = torch.full((N,), ctx, device=device)
    q = rnd(N, H, D)
    cases = {'paged_decode_attention': (
        lambda: get_kernel('paged_decode_attention', device)(q, k_cache, v_cache, table, lens, D ** -0.5),
        lambda: paged_decode_attention(q, k_cache, v_cache, table, lens, D ** -0.5))}

    slots = 64
    buf = torch.zeros(slots, (1 << 20) * scale, dtype=torch.uint8, device=device)
    src, dst = torch.arange(16, device=device), torch.arange(16, 32, device=device)
    cases['copy_state_slots'] = (lambda: get_kernel('copy_state_slots', device)(buf, src, dst),
                                 lambda: copy_state_slots_torch(buf, src, dst))

    Hv, dk, dv = 8 * scale, 128, 128
    state = rnd(N, Hv, dk, dv) * 0.1
    ids = torch.arange(N, device=device)
    hist = torch.ones(N, dtype=torch.bool, device=device)
    cu_dec = torch.arange(N + 1, device=device)
    qd, kd, vd = rnd(N, Hv, dk), rnd(N, Hv, dk), rnd(N, Hv, dv)
    gd, bd = -rnd(N, Hv).abs(), rnd(N, Hv).sigmoid()
    cases['gated_delta_rule_decode'] = (
        lambda: get_kernel('gated_delta_rule_varlen', device)(qd, kd, vd, gd, bd, state, cu_dec, ids, hist),
        lambda: gated_delta_rule_varlen(qd, kd, vd, gd, bd, state, cu_dec, ids, hist))
    L = 256 * scale
    qp, kp, vp = rnd(L, Hv, dk), rnd(L, Hv, dk), rnd(L, Hv, dv)
    gp, bp = -rnd(L, Hv).abs() * 0.1, rnd(L, Hv).sigmoid()
    cu_pre = torch.tensor([0, L], device=device)
    one, no_hist = torch.tensor([0], device=device), torch.tensor([False], device=device)
    cases['gated_delta_rule_prefill'] = (
        lambda: get_kernel('gated_delta_rule_varlen', device)(qp, kp, vp, gp, bp, state, cu_pre, one, no_hist),
        lambda: gated_delta_rule_varlen(qp, kp, vp, gp, bp, state, cu_pre, one, no_hist))

    C, K = 2048 * scale, 4
    conv_cache, w = rnd(N, C, K - 1), rnd(C, K)
    xc = rnd(N, C)
    cases['causal_conv1d_decode'] = (
        lambda: get_kernel('causal_conv1d_varlen', device)(xc, w, None, conv_cache, cu_dec, ids, ids, hist),
        lambda: causal_conv1d_varlen(xc, w, None, conv_cache, cu_dec, ids, ids, hist))

    T, Hd, I, E, k = N, 512 * scale, 256 * scale, 16, 2
    xm = rnd(T, Hd)
    index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(device)
    weights = rnd(T, k).softmax(-1)
    gate_up, down = rnd(E, 2 * I, Hd) * 0.05, rnd(E, Hd, I) * 0.05
    cases['moe_experts_batch16'] = (
        lambda: get_kernel('moe_experts', device)(xm, index, weights, gate_up, down),
        lambda: moe_experts_sorted(xm, index, weights, gate_up, down))

    xn, wn = rnd(N, Hd), rnd(Hd)
    cases['rms_norm'] = (lambda: get_kernel('rms_norm', device)(xn, wn, 1e-6, True),
                         lambda: rms_norm_torch(xn, wn, 1e-6, True))
    return cases


def bench_kernels(device: torch.device, scale: int, repeats: int) -> dict:
    """``{case: {'impl', 'registry_ms', 'first_call_s'[, 'torch_ms']}}`` for :func:`kernel_cases`:
    the registry's implementation (its dotted name), the median ms of ``repeats`` timed calls, the
    seconds of its first call (compiling), and the torch form's median ms where it differs."""
    from lmdeploy.pytorch.kernels import get_kernel
    names = {'gated_delta_rule_decode': 'gated_delta_rule_varlen', 'gated_delta_rule_prefill': 'gated_delta_rule_varlen',
             'causal_conv1d_decode': 'causal_conv1d_varlen', 'moe_experts_batch16': 'moe_experts'}
    out = {}
    for case, (chosen, plain) in kernel_cases(device, scale).items():
        op = names.get(case, case)
        impl = get_kernel(op, device)
        t = time.perf_counter()
        chosen()            # the first call compiles / tunes: its time is reported apart
        if device.type == 'cuda':
            torch.cuda.synchronize()
        first_s = round(time.perf_counter() - t, 2)
        row = {'impl': f'{impl.__module__}.{impl.__name__}', 'registry_ms': _timer(device, chosen, repeats),
               'first_call_s': first_s}
        if plain is not None:
            row['torch_ms'] = _timer(device, plain, repeats)
        out[case] = row
        print(case, row, flush=True)
    return out


def _engine_tok_s(engine, prompts: list[list[int]], new_tokens: int, device: torch.device, label: str) -> float:
    """Decode tokens per second of ``prompts`` run at once through ``engine`` (after a short warm-up)."""
    from lmdeploy import GenerationConfig
    t = time.perf_counter()
    engine.generate(prompts[0][:8], GenerationConfig(max_new_tokens=2, ignore_eos=True))   # warm-up
    if device.type == 'cuda':
        torch.cuda.synchronize()
    _phase(f'{label} warm-up (batch {len(prompts)})', t)
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    seqs = [engine.add_request(p, gen) for p in prompts]
    while not all(s.is_finished for s in seqs):
        engine.step()
    if device.type == 'cuda':
        torch.cuda.synchronize()
    return len(prompts) * new_tokens / (time.perf_counter() - t)


def bench_decode(model: str, device: torch.device, batches: list[int], prompt_len: int, new_tokens: int,
                 dtype: str, eager_ab: bool = False) -> dict:
    """``{batch: {'engine_tok_s', 'transformers_tok_s', 'ratio'}}``: decode tokens per second of
    ``batch`` concurrent requests (``prompt_len`` prompt tokens, ``new_tokens`` new ones) through
    the engine and through transformers' ``generate``, after one short warm-up each. With
    ``eager_ab`` also ``'engine_eager_tok_s'`` (the engine with ``eager_mode=True``: no decode
    graphs), ``'graph_speedup'`` (ours over it) and ``'graph_counters'`` (the graph cache's
    captures, replays, refusals and bytes after the batch)."""
    from transformers import AutoModelForCausalLM

    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine

    def build(eager: bool):
        return Engine(model, PytorchEngineConfig(device_type=device.type, dtype=dtype, max_batch_size=max(batches),
                                                 session_len=prompt_len + new_tokens + 8,
                                                 num_gpu_blocks=max(batches) * 4 + 8, eager_mode=eager))
    t = time.perf_counter()
    engine = build(False)
    eager_engine = build(True) if eager_ab else None
    _phase('engine built' + (' (and an eager_mode one)' if eager_ab else ''), t)
    t = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    _phase('transformers loaded', t)
    results = {}
    for batch in batches:
        prompts = [[3 + (7 * i + 31 * j) % 900 for i in range(prompt_len)] for j in range(batch)]
        ours = _engine_tok_s(engine, prompts, new_tokens, device, 'engine')
        row = {'engine_tok_s': round(ours, 1)}
        if eager_engine is not None:
            eager = _engine_tok_s(eager_engine, prompts, new_tokens, device, 'eager_mode engine')
            graphs = engine.executor.worker.decode_graphs
            row.update(engine_eager_tok_s=round(eager, 1), graph_speedup=round(ours / eager, 3),
                       graph_counters=graphs.counters() if graphs is not None else None)
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            t = time.perf_counter()
            hf.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False)
            if device.type == 'cuda':
                torch.cuda.synchronize()
            _phase(f'transformers warm-up (batch {batch})', t)
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            if device.type == 'cuda':
                torch.cuda.synchronize()
        theirs = batch * new_tokens / (time.perf_counter() - t)
        results[str(batch)] = dict(row, transformers_tok_s=round(theirs, 1), ratio=round(ours / theirs, 3))
        print('decode batch', batch, results[str(batch)], flush=True)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    from benchmark_throughput import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument('--device', default='cuda', choices=('cuda', 'cpu'))
    p.add_argument('--preset', default='99m', choices=sorted(PRESETS), help='model of the decode part')
    p.add_argument('--model', help='model directory (default: a random model of --preset)')
    p.add_argument('--dtype', default='bfloat16', choices=('float32', 'bfloat16'), help='decode part dtype')
    p.add_argument('--batches', default='1,16')
    p.add_argument('--prompt-len', type=int, default=128)
    p.add_argument('--decode-tokens', type=int, default=64)
    p.add_argument('--repeats', type=int, default=20, help='timed calls per kernel case')
    p.add_argument('--kernel-scale', type=int, default=4, help='kernel case sizes (1 = tiny)')
    p.add_argument('--skip-decode', action='store_true')
    p.add_argument('--eager-mode', action='store_true',
                   help='decode A/B: also time an eager_mode engine (no decode graphs) and report\n'
                        'engine_eager_tok_s, graph_speedup and the graph counters per batch')
    p.add_argument('--out', default='benchmark/results/cuda.json')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        print('benchmark_cuda: --device cuda but torch sees no CUDA device', file=sys.stderr)
        return 2
    result = {'device': torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu', 'torch': torch.__version__,
              'args': vars(args), 'kernels': bench_kernels(device, args.kernel_scale, args.repeats)}
    if not args.skip_decode:
        from benchmark_throughput import PRESETS

        from lmdeploy.tools.make_tiny_model import make_tiny_model
        t = time.perf_counter()
        model = args.model or make_tiny_model(os.path.join(tempfile.mkdtemp(prefix='bench_cuda_'), args.preset),
                                              arch='qwen3_next', seed=0, **PRESETS[args.preset])
        _phase(f'model {args.model or args.preset} ready', t)
        result['decode'] = bench_decode(model, device, [int(b) for b in args.batches.split(',')], args.prompt_len,
                                        args.decode_tokens, args.dtype, eager_ab=args.eager_mode)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
