"""Decode throughput with and without n-gram speculative decoding, side by side, on a
repetitive (code-edit style) workload.

Workload: each request quotes a "file" (``--file-tokens`` tokens) and then starts rewriting it
from the top; the model continues the rewrite for ``--decode-tokens`` tokens. This is what
agent and code-editing traffic looks like: most of the output already appears in the context,
so prompt-lookup drafts (n-gram) are mostly right.

Model. A random checkpoint does not copy its context, so on CPU the benchmark uses a *copying*
model: the tiny Qwen3-Next of ``make-tiny-model`` (``--preset`` geometry) with its residual
branches scaled by 0.01 and ``lm_head`` a permutation of the embedding, so that it continues a
fixed chain of tokens. Every layer still runs (Gated DeltaNet states, attention, MoE): the
per-token cost is that of the real architecture; the acceptance rate is that of a model that
reproduces the quoted file exactly (an upper bound for real models). ``--model PATH`` runs a real
checkpoint instead (the "file" is then this script's own source, tokenized).

Reported per batch size N, for plain decoding and for n-gram drafts (``--draft-tokens`` K):
decode tokens/s (after every request has its first token, so prefill is excluded), draft
acceptance rate (accepted / proposed), mean tokens per verify step (accepted + 1), and whether
the outputs are identical (greedy). Results: a table on stdout and ``--out`` JSON.

Usage::

    python3 benchmark/benchmark_spec_decode.py --preset small --batches 1,8 --draft-tokens 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_throughput import PRESETS  # noqa: E402


def make_copying_model(out_dir: str, preset: str) -> tuple[str, list[int]]:
    """A tiny Qwen3-Next rewired to continue a fixed token chain; returns (path, chain)."""
    from safetensors.torch import load_file, save_file

    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(out_dir, arch='qwen3_next', seed=0, mtp=False, **PRESETS[preset])
    w = load_file(os.path.join(path, 'model.safetensors'))
    for name in w:
        if name.endswith(('o_proj.weight', 'out_proj.weight', 'down_proj.weight')):
            w[name] = w[name] * 0.01
    emb = w['model.embed_tokens.weight']
    chain = (torch.randperm(emb.shape[0] - 3, generator=torch.Generator().manual_seed(0)) + 3).tolist()
    head = torch.zeros_like(emb)
    for a, b in zip(chain, chain[1:] + chain[:1]):
        head[b] = emb[a]
    w['lm_head.weight'] = head.contiguous()
    save_file(w, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    return path, chain


def workload(chain: list[int] | None, model: str, batch: int, file_tokens: int) -> list[list[int]]:
    """``batch`` prompts: a quoted file, then the first 8 tokens of its rewrite."""
    if chain is None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model)
        text = open(__file__).read()
        ids = tok(text)['input_ids']
        files = [ids[i * 97 % max(1, len(ids) - file_tokens):][:file_tokens] for i in range(batch)]
    else:
        files = [chain[(i * 127) % (len(chain) - file_tokens):][:file_tokens] for i in range(batch)]
    return [f + f[:8] for f in files]


def run(model: str, prompts: list[list[int]], decode_tokens: int, spec: dict | None, threads: int) -> dict:
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    torch.set_num_threads(threads)
    max_len = max(len(p) for p in prompts) + decode_tokens + 16
    cfg = PytorchEngineConfig(device_type='cpu', dtype='float32', max_batch_size=len(prompts),
                              session_len=max_len + 1, num_gpu_blocks=len(prompts) * (-(-max_len // 64)) + 8,
                              speculative_config=spec)
    eng = Engine(model, cfg)
    gen = GenerationConfig(max_new_tokens=decode_tokens, ignore_eos=True)
    seqs = [eng.add_request(p, gen) for p in prompts]
    while not all(s.num_generated >= 1 for s in seqs):
        eng.step()
    first = sum(s.num_generated for s in seqs)
    start = time.perf_counter()
    steps = 0
    while not all(s.is_finished for s in seqs):
        eng.step()
        steps += 1
    wall = time.perf_counter() - start
    stats = eng.stats()
    drafted, accepted = stats.get('spec_decode_draft_tokens', 0), stats.get('spec_decode_accepted_tokens', 0)
    verify = stats.get('spec_decode_verify_steps', 0)
    decoded = sum(s.num_generated for s in seqs) - first
    return dict(decode_tok_s=decoded / wall, wall_s=wall, steps=steps, decoded_tokens=decoded,
                draft_tokens=drafted, accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else None,
                mean_tokens_per_verify_step=(accepted + verify) / verify if verify else None,
                outputs=[s.output_ids for s in seqs])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--preset', choices=sorted(PRESETS), default='small')
    p.add_argument('--model', help='a real checkpoint instead of the copying model')
    p.add_argument('--batches', default='1,8')
    p.add_argument('--file-tokens', type=int, default=256)
    p.add_argument('--decode-tokens', type=int, default=128)
    p.add_argument('--draft-tokens', type=int, default=4)
    p.add_argument('--ngram-max', type=int, default=4)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results', 'spec_decode_small.json'))
    args = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    if args.model:
        model, chain = args.model, None
    else:
        model, chain = make_copying_model(tmp.name, args.preset)
    spec = dict(method='ngram', num_speculative_tokens=args.draft_tokens, ngram_max=args.ngram_max)
    rows = []
    print(f'{"N":>3} {"plain tok/s":>12} {"ngram tok/s":>12} {"speed-up":>9} {"accept":>7} {"tok/step":>9} same')
    for n in [int(x) for x in args.batches.split(',')]:
        prompts = workload(chain, model, n, args.file_tokens)
        base = run(model, prompts, args.decode_tokens, None, args.threads)
        fast = run(model, prompts, args.decode_tokens, spec, args.threads)
        same = base.pop('outputs') == fast.pop('outputs')
        row = dict(batch=n, plain=base, ngram=fast, identical_outputs=same,
                   speedup=fast['decode_tok_s'] / base['decode_tok_s'])
        rows.append(row)
        rate = fast['acceptance_rate']
        print(f'{n:>3} {base["decode_tok_s"]:>12.1f} {fast["decode_tok_s"]:>12.1f} {row["speedup"]:>8.2f}x '
              f'{(rate or 0):>7.2f} {(fast["mean_tokens_per_verify_step"] or 0):>9.2f} {same}')
    result = dict(preset=None if args.model else args.preset, model=args.model, file_tokens=args.file_tokens,
                  decode_tokens=args.decode_tokens, draft_tokens=args.draft_tokens, threads=args.threads, rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=1)
    tmp.cleanup()
    return result


if __name__ == '__main__':
    main()
