"""Decode-step MLA attention: the non-absorbed and the absorbed formulation, timed in one run.

MLA (DeepSeek-V2, 2024) caches one latent row per token, ``[c (kv_lora_rank) | k_rope]``, shared
by every head. A decode query can read it two ways:

- **non-absorbed** (what ``lmdeploy/pytorch/models/kimi_linear.py`` does): up-project every
  cached row through ``kv_b_proj`` into per-head keys and values, then attend —
  ``L * R * H * (nope + v)`` multiply-adds per step for ``L`` cached tokens;
- **absorbed**: fold the key up-projection into the query (``q_c[h] = W_uk[h]^T q_nope[h]``,
  ``R`` values per head), score against the latent rows directly, attend over them, and
  up-project the attended latent once through the value part (``W_uv[h]``) —
  ``2 * L * H * (R + rope)`` plus ``H * R * (nope + v)`` multiply-adds, independent of ``L`` in
  the projection.

Both give the same output (checked here: the maximum difference is printed). The layer is a
Kimi-Linear-48B-A3B MLA layer (32 heads, qk_nope 128, rope 64, v 128, kv_lora_rank 512) with
``--heads`` per rank (32: TP1, 16: TP2, 4: TP8), float32 on this machine's CPU by default.

Usage: ``python benchmark/benchmark_mla.py [--heads 32] [--contexts 1024,4096,16384]
[--batch 1] [--repeats 5] [--dtype float32] [--json out.json]``. Prints per context the
best-of-``repeats`` time per decode step of each formulation (the two interleaved) and the ratio.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

NOPE, ROPE, V, R = 128, 64, 128, 512       # Kimi-Linear-48B-A3B's MLA geometry


def non_absorbed(q, latent, w_kvb, scale):
    """``q [N, H, nope + rope]``, ``latent [N, L, R + rope]``, ``w_kvb [H * (nope + v), R]`` →
    ``[N, H, v]``: keys and values up-projected from every cached row."""
    N, H = q.shape[:2]
    L = latent.shape[1]
    kv = F.linear(latent[..., :R], w_kvb).view(N, L, H, NOPE + V)
    k_nope, values = kv.split([NOPE, V], dim=-1)
    keys = torch.cat((k_nope, latent[:, :, None, R:].expand(N, L, H, ROPE)), dim=-1)
    out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), scale=scale)
    return out[:, :, 0]


def absorbed(q, latent, w_uk, w_uv, scale):
    """Same contract; ``w_uk [H, nope, R]``, ``w_uv [H, v, R]`` (the two parts of ``kv_b_proj``)."""
    q_c = torch.einsum('nhd,hdr->nhr', q[..., :NOPE], w_uk)                    # [N, H, R]
    q_full = torch.cat((q_c, q[..., NOPE:]), dim=-1)                           # [N, H, R + rope]
    scores = torch.matmul(q_full, latent.transpose(1, 2)) * scale              # [N, H, L]
    o_c = torch.matmul(scores.softmax(-1), latent[..., :R])                    # [N, H, R]
    return torch.einsum('nhr,hvr->nhv', o_c, w_uv)


def _best(fn, repeats: int) -> float:
    best = float('inf')
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(heads: int, contexts: list[int], batch: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    w_kvb = (torch.randn(heads * (NOPE + V), R, generator=gen) / R ** 0.5).to(dtype)
    w3 = w_kvb.view(heads, NOPE + V, R)
    w_uk, w_uv = w3[:, :NOPE].contiguous(), w3[:, NOPE:].contiguous()
    scale = (NOPE + ROPE) ** -0.5
    rows = []
    for L in contexts:
        q = torch.randn(batch, heads, NOPE + ROPE, generator=gen).to(dtype)
        latent = torch.randn(batch, L, R + ROPE, generator=gen).to(dtype)
        with torch.inference_mode():
            a, b = non_absorbed(q, latent, w_kvb, scale), absorbed(q, latent, w_uk, w_uv, scale)
            diff = (a.float() - b.float()).abs().max().item()
            t_non, t_abs = float('inf'), float('inf')
            for _ in range(repeats):    # interleaved: both see the same machine load
                t_non = min(t_non, _best(lambda: non_absorbed(q, latent, w_kvb, scale), 1))
                t_abs = min(t_abs, _best(lambda: absorbed(q, latent, w_uk, w_uv, scale), 1))
        rows.append(dict(context=L, non_absorbed_ms=t_non * 1e3, absorbed_ms=t_abs * 1e3, ratio=t_non / t_abs,
                         max_abs_diff=diff))
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--heads', type=int, default=32, help='query heads per rank (Kimi-Linear-48B: 32 at TP1)')
    p.add_argument('--contexts', default='1024,4096,16384', help='cached tokens per sequence, comma-separated')
    p.add_argument('--batch', type=int, default=1, help='decode sequences per step')
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
    p.add_argument('--json', help='also write the rows and the run settings to this file')
    args = p.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(',')]
    rows = run(args.heads, contexts, args.batch, args.repeats, getattr(torch, args.dtype))
    print(f'MLA decode attention, {args.heads} heads/rank, nope {NOPE} rope {ROPE} v {V} latent {R}, '
          f'batch {args.batch}, {args.dtype}, {torch.get_num_threads()} threads, best of {args.repeats}')
    print(f'{"context":>8} {"non-absorbed ms":>16} {"absorbed ms":>12} {"ratio":>7} {"max |diff|":>11}')
    for r in rows:
        print(f'{r["context"]:>8} {r["non_absorbed_ms"]:>16.3f} {r["absorbed_ms"]:>12.3f} {r["ratio"]:>6.1f}x '
              f'{r["max_abs_diff"]:>11.2e}')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(heads=args.heads, batch=args.batch, dtype=args.dtype, threads=torch.get_num_threads(),
                           repeats=args.repeats, machine=platform.processor() or platform.machine(), rows=rows),
                      f, indent=1)
    return rows


if __name__ == '__main__':
    main()
