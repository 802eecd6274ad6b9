"""Throughput of the engine against ``transformers`` (and llama.cpp when present), same weights,
same process, side by side.

What is measured (each configuration ``--repeats`` times; min / median / max reported):

- ``decode`` at batch N: the engine steps N requests (prompt ``--prompt-len``,
  ``--decode-tokens`` new, greedy, ``ignore_eos``) to completion; transformers runs
  ``generate`` on the N prompts at once ("batched") and, for N > 1, one after another
  ("one-at-a-time").
- ``prefill`` at length L: the engine's time to first token of one L-token request against one
  transformers forward over L tokens (last-position logits only).

For each: wall seconds, tokens/s, tokens per CPU-second (process CPU time, all threads) and
peak RSS growth during the run (the kernel's high-water mark, reset at the start of each run, on
Linux; elsewhere a 2 ms sampler thread; the models and the engine's caches are
allocated before, so the growth is the run's working memory). Greedy decode outputs are checked
equal to ``transformers``' (fp32); where they differ, the first differing token and transformers'
logit margin there are reported, next to a precision block that puts such near-ties in scale
(:func:`logit_precision`: the engine's logits and transformers' own incremental ``generate``,
alone and batched, against transformers' full forward). The op profile counts the torch ops
(dispatcher calls) of one batch-N decode step: one ``Engine.step`` (plus its native CPU kernel
calls, each counted as one op) against the difference between HF ``generate`` of ``k + 1`` and
``k`` new tokens. Beside it: the median wall time of a pure-decode engine step, the bytes such a
step must move (:mod:`step_bytes`: weights, touched experts, state, KV) and, after a GEMV
bandwidth measurement of this machine (``--bandwidth-mb``; torch's GEMV and the native product,
each on a matrix in ordinary pages (4 KiB unless THP is ``always``) and on one in huge pages as
the engine's CPU weights are held, all reported, the fastest used), the step time that
bandwidth allows and the engine's fraction of it.

``--dtype bfloat16`` runs both systems in bf16 (the precision of published checkpoints): the
speeds compare like for like, but greedy outputs are not expected to be token-equal (both round
at different points; the documented bf16 bound is on logits, see ``docs/en/supported_models.md``),
so only ``greedy_equal_to_hf`` is reported, without the divergence report and the float32
precision block.

Both systems share the process, so they share its allocator: a CPU engine raises glibc
``malloc``'s mmap and trim thresholds when it is created (see ``docs/en/supported_models.md``,
"Running on CPU"), and transformers runs with the same settings.

Usage (CPU; a Qwen3-Next-shaped random model made on the fly)::

    python3 benchmark/benchmark_throughput.py --preset small --threads 2 \\
        --batches 1,4,16 --prefill 1024,2048,4096 --repeats 2
    # the full run of issue 16 (about 7 minutes on 2 quiet cores):
    python3 benchmark/benchmark_throughput.py --preset 99m --threads 2 \\
        --batches 1,4,16,32 --prefill 1024,2048,4096,8192,16384 --repeats 3
    # any registered family: its make-tiny-model checkpoint with the widths x4 (hidden 256)
    python3 benchmark/benchmark_throughput.py --arch bamba --batches 1,16 --prefill 1024 \\
        --skip-one-at-a-time --bandwidth-mb 0

llama.cpp: pass ``--gguf MODEL.gguf`` (the same weights converted with llama.cpp's
``convert_hf_to_gguf.py``, ``--outtype f32`` for the float32 comparison) and have
``llama-batched-bench`` on ``PATH`` (or ``--llama-batched-bench PATH``); otherwise it is skipped
with a note. Each repeat then also runs llama.cpp right after the two systems, as a third system
(``llama_cpp`` in the rows): at batch N, ``-npl N -npp <prompt-len> -ntg <decode-tokens - 1>``,
the same forward passes as the engine's (one prefill, then one decode step per further token),
timed by llama.cpp itself (model loading excluded), tokens/s counted the same way (N x
``--decode-tokens`` over prefill plus decode); at prefill length L, ``-npl 1 -npp L -ntg 1`` and
the prompt-processing seconds. Its CPU time and memory are not separable from its model loading,
so they are not reported. Results: ``<out>.json``, ``<out>.png`` and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_bytes import decode_step_bytes, measure_gemv_bandwidths  # noqa: E402
from throughput_measure import LlamaCpp, PeakRSS, count_ops, measure, summarize  # noqa: E402,F401

PRESETS = {
    # fast enough to run on a shared 2-core machine
    'small': dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                  shared_expert_intermediate_size=256, intermediate_size=512),
    # Qwen3-Next proportions (3 Gated DeltaNet layers per attention layer). The name is historical:
    # it holds 249M parameters in all, 201M of them in the 16 experts per layer (~1.0 GB in fp32)
    '99m': dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                linear_value_head_dim=128, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, intermediate_size=2048),
}

# ``--arch``: the widths of a family's ``tiny_config`` (hidden, MLP / expert, per-head and latent
# sizes) that ``--width-scale`` multiplies. Head, expert and layer counts, state sizes, conv widths
# and sliding windows stay, so every width-derived size (``head_dim = hidden / heads``, Mamba's
# ``d_inner = expand * hidden`` = heads x head size) stays consistent.
WIDTH_FIELDS = ('hidden_size', 'intermediate_size', 'shared_intermediate_size', 'moe_intermediate_size',
                'head_dim', 'mamba_d_head', 'linear_key_head_dim', 'linear_value_head_dim', 'kv_lora_rank',
                'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')


def arch_overrides(arch: str, width_scale: int) -> dict:
    """Config overrides of the ``--arch`` model: each of :data:`WIDTH_FIELDS` that the family's
    ``tiny_config`` sets, times ``width_scale``; ``make_tiny_model`` supplies the rest.

    Raises:
        ValueError: ``width_scale`` < 1 or ``arch`` is not a tiny-model family (names the field).
    """
    from lmdeploy.tools.tiny_args import ARCHS
    if width_scale < 1:
        raise ValueError(f'width_scale must be >= 1, got {width_scale}')
    if arch not in ARCHS:
        raise ValueError(f'arch must be one of {", ".join(ARCHS)}, got {arch!r}')
    from lmdeploy.pytorch.models import get_model_class
    tiny = get_model_class(arch).tiny_config
    return {k: v * width_scale for k, v in tiny.items() if k in WIDTH_FIELDS and isinstance(v, int)}


# --- the two systems ------------------------------------------------------------------------
def make_engine(model_path: str, max_batch: int, max_len: int, dtype: str = 'float32'):
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    blocks = max_batch * (-(-max_len // 64)) + 8
    cfg = PytorchEngineConfig(device_type='cpu', dtype=dtype, max_batch_size=max_batch, session_len=max_len + 1,
                              num_gpu_blocks=blocks)
    return Engine(model_path, cfg)


def ab_arguments(doc: str, batches: str) -> argparse.ArgumentParser:
    """The arguments of the in-engine A/B scripts (``ab_bcast_rows.py``, ``ab_replay_binary.py``):
    ``--model``, ``--batches`` (default ``batches``), ``--rounds``, ``--prompt-len``, ``--threads``
    and ``--out``; each script adds its own."""
    p = argparse.ArgumentParser(description=doc.split('\n')[0])
    p.add_argument('--model', required=True, help='model directory')
    p.add_argument('--batches', default=batches, help=f'decode batch sizes, comma-separated (default {batches})')
    p.add_argument('--rounds', type=int, default=9, help='alternations of the two modes (default 9)')
    p.add_argument('--prompt-len', type=int, default=32, help='prompt tokens per sequence (default 32)')
    p.add_argument('--threads', type=int, default=2, help='torch threads (default 2)')
    p.add_argument('--out', help='write the results as JSON here')
    return p


def write_ab_results(args: argparse.Namespace, res: dict) -> None:
    """Write ``{'args', 'results'}`` as JSON to ``args.out`` (when given) and say so."""
    if args.out:
        with open(args.out, 'w') as fh:
            json.dump({'args': vars(args), 'results': res}, fh, indent=1)
        print(f'wrote {args.out}')


def engine_generate(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from lmdeploy import GenerationConfig
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, gen) for p in prompts]
    while not all(s.is_finished for s in seqs):
        engine.step()
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    # eos_token_id=None: never stop early and never mask EOS, like the engine's ignore_eos
    # (min_new_tokens would instead forbid EOS and change the greedy choice when it is the argmax).
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f'transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}')
    return out[:, ids.shape[1]:].tolist()


@torch.inference_mode()
def greedy_divergences(hf, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]) -> list[dict]:
    """Where greedy outputs differ, the first differing token of each sequence and how close the
    choice was: transformers' logits (one forward over the prompt and the common prefix) of its
    token minus ours. A margin at float32 rounding level (well under the 1e-4 logit tolerance) is a
    near-tie that the two systems' different summation orders broke differently, not an error.

    For a mixture-of-experts model the same forward also gives ``router_margin``: the smallest gap,
    over every layer and token of that forward, between the routing probability of the last expert
    a token picks (its k-th) and the best one it does not (its (k+1)-th). A gap at rounding level
    (~1e-6) is a routing near-tie: float32 rounding picks another expert there, which moves the
    logits by O(1), so a large logit margin with a tiny router margin is still a near-tie."""
    out = []
    k = getattr(hf.config, 'num_experts_per_tok', None)
    for i, (p, a, b) in enumerate(zip(prompts, ours, theirs)):
        if a == b:
            continue
        j = next(t for t in range(min(len(a), len(b))) if a[t] != b[t])
        kwargs = {'output_router_logits': True} if k else {}
        res = hf(input_ids=torch.tensor([p + a[:j]]), **kwargs)
        logits = res.logits[0, -1].float()
        row = dict(seq=i, token=j, engine=a[j], hf=b[j], hf_margin=float(logits[b[j]] - logits[a[j]]))
        routers = [r for r in (getattr(res, 'router_logits', None) or ()) if r is not None]
        if routers:
            gaps = []
            for r in routers:
                top = r.float().reshape(-1, r.shape[-1]).softmax(-1).topk(k + 1, dim=-1).values
                gaps.append(float((top[:, k - 1] - top[:, k]).min()))
            row['router_margin'] = min(gaps)
        out.append(row)
    return out


@torch.inference_mode()
def logit_precision(engine, hf, prompts: list[list[int]], new_tokens: int) -> dict:
    """The float32 logit differences that decide near-ties, all against transformers' full forward
    over prompt + generated tokens (batch 1, teacher-forced):

    - ``engine_batch1``: the engine's logits of each of its greedy tokens, one request at a time;
    - ``hf_incremental_batch1`` / ``hf_incremental_batchN``: transformers' own ``generate``
      (KV cache, one token per step), alone and with all ``prompts`` batched.

    Returns max abs differences (logit units) and the largest logit magnitude seen.
    """
    from lmdeploy import GenerationConfig
    out = dict(max_abs_logit=0.0)

    def full(ids):
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
        out['max_abs_logit'] = max(out['max_abs_logit'], float(logits.abs().max()))
        return logits

    worst = 0.0
    for p in prompts[:2]:
        seq = engine.add_request(p, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
        rows = []
        while not seq.is_finished:
            engine.step()
            if engine.model_runner.last_logits is not None and len(rows) < seq.num_generated:
                rows.append(engine.model_runner.last_logits[0].float())
        ref = full(seq.token_ids)[len(p) - 1:len(p) - 1 + len(rows)]
        worst = max(worst, float((torch.stack(rows) - ref).abs().max()))
    out['engine_batch1'] = worst
    for name, batch in (('hf_incremental_batch1', prompts[:1]), (f'hf_incremental_batch{len(prompts)}', prompts)):
        ids = torch.tensor(batch)
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        worst = 0.0
        for i in range(len(batch)):
            ref = full(gen.sequences[i].tolist())[len(batch[i]) - 1:len(batch[i]) - 1 + new_tokens]
            worst = max(worst, float((torch.stack([s[i].float() for s in gen.logits]) - ref).abs().max()))
        out[name] = worst
    return out


@torch.inference_mode()
def hf_prefill(hf, prompt: list[int]) -> None:
    hf(input_ids=torch.tensor([prompt]), logits_to_keep=1)


#: pure-decode steps whose median is a batch's step time in the op profile
TIMED_STEPS = 24
#: tokens a sequence of the op profile generates beyond its prompt (prompt, warm-up, counted and
#: timed steps, and a margin): the engine's session length must hold them
OP_PROFILE_TOKENS = TIMED_STEPS + 8


def engine_decode_step_ops(engine, prompts: list[list[int]], timed_steps: int = TIMED_STEPS,
                           clock=None) -> tuple[int, int, float]:
    """``(torch ops, native kernel calls, seconds)`` of pure-decode ``Engine.step`` calls with
    ``len(prompts)`` running sequences (native: :data:`lmdeploy.pytorch.kernels.cpu_native.CALLS`):
    the counts of one step, and the median time of the ``timed_steps`` steps after it by
    ``clock`` (default ``time.perf_counter``, wall time; ``time.process_time`` counts only this
    process's CPU seconds, which a loaded machine's other processes do not add to).

    Raises:
        RuntimeError: a sequence ended before the timed steps did (the engine's session length is
            shorter than a prompt plus ``timed_steps + 8`` tokens): the later steps would have timed
            an idle engine."""
    import time
    clock = clock or time.perf_counter
    from lmdeploy import GenerationConfig
    from lmdeploy.pytorch.kernels.cpu_native import CALLS
    seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=timed_steps + 8, ignore_eos=True))
            for p in prompts]
    while any(s.num_generated == 0 for s in seqs):
        engine.step()
    for _ in range(4):     # a decode graph's key: one eager step, two recorded ones, then replays
        engine.step()
    worker = getattr(engine.model_runner.executor, 'worker', None)     # tp=1: the engine process's worker
    graphs = getattr(worker, 'decode_graphs', None)
    replays = graphs.replays if graphs is not None else 0
    before = sum(CALLS.values())
    n = count_ops(engine.step)
    native = sum(CALLS.values()) - before
    if graphs is not None and graphs.replays > replays:   # a replay calls the recorded kernels directly
        native += max(c for c, _ in graphs.calls_per_replay())
    times = []
    for _ in range(timed_steps):
        t = clock()
        engine.step()
        times.append(clock() - t)
    if any(s.is_finished for s in seqs):
        raise RuntimeError(f'a sequence ended before the {timed_steps} timed decode steps did: the session length '
                           f'must hold its prompt and {timed_steps + 8} more tokens')
    while not all(s.is_finished for s in seqs):
        engine.step()
    return n, native, sorted(times)[len(times) // 2]


# --- driver ---------------------------------------------------------------------------------
def prepare_model(args) -> str:
    if args.model:
        return args.model
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    if args.arch:
        out = args.save_model or os.path.join(tempfile.mkdtemp(prefix='bench_tp_'),
                                              f'{args.arch}_x{args.width_scale}')
        return make_tiny_model(out, arch=args.arch, seed=0, **arch_overrides(args.arch, args.width_scale))
    out = args.save_model or os.path.join(tempfile.mkdtemp(prefix='bench_tp_'), args.preset)
    return make_tiny_model(out, arch='qwen3_next', seed=0, **PRESETS[args.preset])


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    model_path = prepare_model(args)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype), local_files_only=True).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    batches = [int(b) for b in args.batches.split(',') if b]
    prefill = [int(p) for p in args.prefill.split(',') if p]
    max_len = max(prefill + [args.prompt_len + max(args.decode_tokens, OP_PROFILE_TOKENS) + 8])
    engine = make_engine(model_path, max(batches), max_len, args.dtype)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return torch.randint(3, vocab, (n, length), generator=gen).tolist()

    results = dict(model=model_path, arch=args.arch, params=n_params, dtype=args.dtype, threads=args.threads, repeats=args.repeats,
                   decode_tokens=args.decode_tokens, prompt_len=args.prompt_len, decode=[], prefill=[], ops=[])
    engine_generate(engine, prompts(1, 8), 2)   # warm-up (first-call costs of both)
    hf_generate(hf, prompts(1, 8), 2)
    llama = LlamaCpp(args.llama_batched_bench, args.gguf, args.threads)
    for batch in batches:
        row = dict(batch=batch)
        runs = {'engine': [], 'hf_batched': [], 'hf_one_at_a_time': [], 'llama_cpp': []}
        equal, divergences = True, []
        tokens = batch * args.decode_tokens
        for _ in range(args.repeats):
            ps = prompts(batch, args.prompt_len)
            e = measure(lambda: engine_generate(engine, ps, args.decode_tokens), tokens)
            h = measure(lambda: hf_generate(hf, ps, args.decode_tokens), tokens)
            ours, theirs = e.pop('result'), h.pop('result')
            if ours != theirs:
                equal = False
                if args.dtype == 'float32':   # in bf16 divergence is expected (see --dtype)
                    divergences += greedy_divergences(hf, ps, ours, theirs)
            runs['engine'].append(e)
            runs['hf_batched'].append(h)
            if batch > 1 and not args.skip_one_at_a_time:
                o = measure(lambda: [hf_generate(hf, [p], args.decode_tokens)[0] for p in ps], tokens)
                o.pop('result')
                runs['hf_one_at_a_time'].append(o)
            if (lc := llama.decode(batch, args.prompt_len, args.decode_tokens)) is not None:
                runs['llama_cpp'].append(lc)
        row.update({k: summarize(v) for k, v in runs.items() if v and len(v) == args.repeats})
        row['greedy_equal_to_hf'] = equal
        if divergences:
            row['greedy_divergences'] = divergences
        results['decode'].append(row)
        print_row('decode', batch, row, flush=True)
    for length in prefill:
        row = dict(tokens=length)
        runs = {'engine': [], 'hf_forward': [], 'llama_cpp': []}
        for _ in range(args.repeats):
            (p,) = prompts(1, length)
            e = measure(lambda: engine_generate(engine, [p], 1), length)
            h = measure(lambda: hf_prefill(hf, p), length)
            for r in (e, h):
                r.pop('result')
            runs['engine'].append(e)
            runs['hf_forward'].append(h)
            if (lc := llama.prefill(length)) is not None:
                runs['llama_cpp'].append(lc)
        row.update({k: summarize(v) for k, v in runs.items() if v and len(v) == args.repeats})
        results['prefill'].append(row)
        print_row('prefill', length, row, flush=True)
    gemvs = {}
    if args.bandwidth_mb:      # in ordinary pages and in huge pages, as the engine's CPU weights are held
        gemvs = {pages: measure_gemv_bandwidths(args.threads, args.bandwidth_mb, huge_pages=pages == 'huge')
                 for pages in ('plain', 'huge')}
    bandwidth = max((g.best for g in gemvs.values()), default=None)
    results['gemv_bandwidth_gb_s'] = bandwidth and bandwidth / 1e9
    if gemvs:
        torch_bw = max(g.torch for g in gemvs.values())
        native_bw = max((g.native for g in gemvs.values() if g.native is not None), default=None)
        results['gemv_bandwidth_torch_gb_s'] = torch_bw / 1e9
        results['gemv_bandwidth_native_gb_s'] = native_bw and native_bw / 1e9
        for pages, g in gemvs.items():
            results[f'gemv_bandwidth_{pages}_pages_gb_s'] = g.best / 1e9
        native = 'not built' if native_bw is None else f'{native_bw / 1e9:.1f} GB/s'
        print(f'GEMV read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads; torch.mv '
              f'{torch_bw / 1e9:.1f} GB/s, native product {native}; best in ordinary pages '
              f'{gemvs["plain"].best / 1e9:.1f}, in huge pages {gemvs["huge"].best / 1e9:.1f})', flush=True)
    with open(os.path.join(model_path, 'config.json')) as f:
        config = json.load(f)
    for batch in batches:
        ps = prompts(batch, args.prompt_len)
        k = 3
        hf_ops = count_ops(lambda: hf_generate(hf, ps, k + 1)) - count_ops(lambda: hf_generate(hf, ps, k))
        torch_ops, native_calls, step_s = engine_decode_step_ops(engine, ps)
        # the engine's count includes its native kernel calls: each replaces several torch ops
        row = dict(batch=batch, engine=torch_ops + native_calls, engine_native=native_calls, hf=hf_ops,
                   engine_step_s=step_s)
        # bytes at the context of the timed steps (the prompt plus the first few tokens)
        need = decode_step_bytes(hf, config, batch, args.prompt_len + 4)
        row['step_bytes'] = dict(dense=need.dense, experts=need.experts, state=need.state, kv=need.kv,
                                 total=need.total)
        line = (f'decode step, batch {batch}: {torch_ops + native_calls} ops ({native_calls} of them native '
                f'kernel calls; hf {hf_ops}), {step_s * 1e3:.2f} ms, must move {need.total / 1e6:.1f} MB')
        if bandwidth:
            row['limit_step_s'] = need.total / bandwidth
            row['fraction_of_limit'] = row['limit_step_s'] / step_s
            line += (f' = {row["limit_step_s"] * 1e3:.2f} ms at the GEMV bandwidth: engine at '
                     f'{row["fraction_of_limit"]:.0%} of the limit')
        results['ops'].append(row)
        print(line, flush=True)
    if args.dtype == 'float32':
        precision = logit_precision(engine, hf, prompts(max(batches), args.prompt_len), 16)
        results['precision'] = precision
        print('float32 max |logit difference| vs transformers full forward (teacher-forced): '
              + ', '.join(f'{k} {v:.1e}' for k, v in precision.items() if k != 'max_abs_logit')
              + f' (logits up to {precision["max_abs_logit"]:.1f})', flush=True)
    results['llama_cpp'] = llama.info()
    if llama.note:
        print(f'llama.cpp skipped: {llama.note}', flush=True)
    return results


def print_row(kind, key, row, flush=False):
    others = [k for k in row if isinstance(row[k], dict) and k != 'engine']
    eng = row['engine']['tok_s']['median']
    parts = [f'{kind} {key:>6}: engine {eng:9.1f} tok/s (peak +{row["engine"]["peak_mb"]["max"]:.0f} MB)']
    for k in others:
        o = row[k]['tok_s']['median']
        peak = f', peak +{row[k]["peak_mb"]["max"]:.0f} MB' if row[k]['peak_mb'] else ''
        parts.append(f'{k} {o:9.1f} tok/s (x{eng / o:.2f}{peak})')
    if 'greedy_equal_to_hf' in row:
        parts.append(f'greedy equal: {row["greedy_equal_to_hf"]}')
        if row.get('greedy_divergences'):
            worst = max(abs(d['hf_margin']) for d in row['greedy_divergences'])
            routers = [d['router_margin'] for d in row['greedy_divergences'] if 'router_margin' in d]
            tie = f'; smallest routing margin {min(routers):.1e}' if routers else ''
            parts.append(f'({len(row["greedy_divergences"])} sequences diverge; largest transformers logit '
                         f'margin at the first differing token {worst:.1e}{tie})')
    print(' | '.join(parts), flush=flush)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, key, label in ((axes[0], 'decode', 'batch', 'concurrent requests'),
                                 (axes[1], 'prefill', 'tokens', 'prompt tokens')):
        rows = results[kind]
        xs = [str(r[key]) for r in rows]
        systems = list(dict.fromkeys(k for r in rows for k in r if isinstance(r[k], dict)))
        width = 0.8 / max(len(systems), 1)
        for j, system in enumerate(systems):
            meds = [r[system]['tok_s']['median'] if system in r else 0 for r in rows]
            lo = [m - r[system]['tok_s']['min'] if system in r else 0 for m, r in zip(meds, rows)]
            hi = [r[system]['tok_s']['max'] - m if system in r else 0 for m, r in zip(meds, rows)]
            ax.bar([i + j * width for i in range(len(xs))], meds, width, yerr=[lo, hi], label=system, capsize=2)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(xs))], xs)
        ax.set_xlabel(label)
        ax.set_ylabel('tokens/s (median, min-max bars)')
        ax.set_title(kind)
        ax.legend(fontsize=8)
    shape = results.get('arch') or 'qwen3_next'
    fig.suptitle(f'{results["params"] / 1e6:.0f}M-param {shape}-shaped model, {results.get("dtype", "float32")}, '
                 f'{results["threads"]} threads')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description='Throughput of the engine against transformers (and llama.cpp when '
                                'present) on the same weights, side by side in one run.')
    p.add_argument('--model', help='model directory (default: a random model of --preset made in a temp dir)')
    p.add_argument('--preset', choices=sorted(PRESETS), default='small',
                   help='geometry of the random Qwen3-Next-shaped model made when --model is not given '
                        '(default: small; 99m is the 249M-parameter model of the recorded runs)')
    p.add_argument('--arch', help='instead of --preset: a random model of this registered family (make-tiny-model '
                   '--arch), its tiny_config with the widths times --width-scale')
    p.add_argument('--save-model', metavar='DIR', help='make the --preset / --arch model in DIR and keep it '
                   '(default: a temp dir); then e.g. benchmark/make_gguf.py converts it for llama.cpp')
    p.add_argument('--width-scale', type=int, default=4, help='--arch: multiplier of the tiny_config widths '
                   '(hidden, MLP, head sizes; default 4: hidden 64 -> 256)')
    p.add_argument('--threads', type=int, default=2, help='torch (and llama.cpp) threads (default: 2)')
    p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                   help='weights and activations of both systems; bfloat16 outputs are not expected to be '
                        'token-equal to transformers (no divergence report, no float32 precision block)')
    p.add_argument('--batches', default='1,4,16', help='concurrent requests of each decode measurement, '
                   'comma-separated (default: 1,4,16)')
    p.add_argument('--prefill', default='1024,2048,4096', help='prompt lengths (tokens) of the prefill '
                   'measurements, comma-separated; empty for none (default: 1024,2048,4096)')
    p.add_argument('--prompt-len', type=int, default=32, help='prompt tokens of each decode request (default: 32)')
    p.add_argument('--decode-tokens', type=int, default=32, help='new tokens of each decode request (default: 32)')
    p.add_argument('--repeats', type=int, default=2, help='runs of each measurement (min / median / max; '
                   'default: 2)')
    p.add_argument('--skip-one-at-a-time', action='store_true', help='skip HF one-request-at-a-time runs')
    p.add_argument('--llama-batched-bench', '--llama-bench', dest='llama_batched_bench',
                   help="path of llama.cpp's llama-batched-bench (default: from PATH)")
    p.add_argument('--gguf', help='the same weights as GGUF for llama.cpp (benchmark/make_gguf.py)')
    p.add_argument('--bandwidth-mb', type=int, default=512,
                   help='matrix size (MB) of the GEMV bandwidth measurement that the bytes a decode step must '
                        'move are set against; 0 skips it (default: 512)')
    p.add_argument('--out', default='benchmark/results/throughput',
                   help='results path prefix: <out>.json and <out>.png (default: benchmark/results/throughput)')
    args = p.parse_args(argv)
    if args.arch and args.model:
        p.error('--arch and --model are exclusive')
    if args.arch:
        try:
            arch_overrides(args.arch, args.width_scale)
        except ValueError as err:
            p.error(str(err))
    results = run(args)
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out + '.json', 'w') as f:
        json.dump(results, f, indent=1)
    plot(results, args.out + '.png')
    print(f'wrote {args.out}.json and {args.out}.png', file=sys.stderr)


if __name__ == '__main__':
    main()
