"""Per-token cost of a grammar token mask on CPU: xgrammar vs llguidance.

For each library the script compiles one JSON schema, then walks a valid instance of it token
by token (the tokens a model would emit) and times, at every position, what a decode step does
for a guided sequence: compute the next-token bitmask, apply it to a ``[vocab]`` float32 logits
row, and advance the matcher by the emitted token. ``--batch 16`` runs 16 matchers side by side
(one step = 16 masks, the sampler's per-row loop). Numbers are microseconds per token and per
step; compile time is reported once (it is cached per schema in the engine).

``--throughput`` also measures the engine's decode throughput (generated tokens per second,
CPU, float32, greedy) at each batch size for requests guided by a JSON schema (xgrammar, as the
engine uses it) and for the same requests unguided with the same number of tokens each.

Usage::

    python benchmark/benchmark_grammar_mask.py [--model DIR] [--batch 1 16] [--repeat 20] [--throughput]

Without ``--model`` it makes the tiny Qwen3 checkpoint (``lmdeploy.tools.make_tiny_model``) and
uses its tokenizer. Results: benchmark/README.md ("Grammar mask").
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string'},
        'age': {'type': 'integer'},
        'tags': {'type': 'array', 'items': {'type': 'string', 'enum': ['a', 'bb', 'ccc']}},
        'address': {'type': 'object', 'properties': {'city': {'type': 'string'}, 'zip': {'type': 'string'}},
                    'required': ['city', 'zip']},
        'score': {'type': 'number'},
    },
    'required': ['name', 'age', 'tags', 'address', 'score'],
    'additionalProperties': False,
}
INSTANCE = {'name': 'the quick brown fox jumps over the lazy dog', 'age': 42, 'tags': ['a', 'ccc', 'bb', 'a'],
            'address': {'city': 'Paris', 'zip': '75001'}, 'score': 3.25}


class _XGrammar:
    name = 'xgrammar'

    def __init__(self, tokenizer, vocab_size):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(',', ':'))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def step(self, m, bitmask, i, row, token):
        m.fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(row, bitmask[i])
        assert torch.isfinite(row[token]), 'the instance left the grammar'
        assert m.accept_token(token)


class _LLGuidance:
    name = 'llguidance'

    def __init__(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema):
        return self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={'whitespace_flexible': False})

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def bitmask(self, n):
        return self.lt.allocate_token_bitmask(n, self.vocab_size)

    def step(self, m, bitmask, i, row, token):
        self.lt.fill_next_token_bitmask(m, bitmask, i)
        self.lt.apply_token_bitmask_inplace(row, bitmask[i])
        assert torch.isfinite(row[token]), 'the instance left the grammar'
        assert m.consume_token(token), m.get_error()


def measure(lib, tokens: list[int], batch: int, repeat: int) -> dict:
    """Median microseconds per step (``batch`` masks) and per token; compile time in ms."""
    t0 = time.perf_counter()
    compiled = lib.compile(SCHEMA)
    compile_ms = (time.perf_counter() - t0) * 1e3
    steps = []
    logits = torch.zeros(batch, lib.vocab_size)
    for _ in range(repeat):
        matchers = [lib.matcher(compiled) for _ in range(batch)]
        bitmask = lib.bitmask(batch)
        for token in tokens:
            logits.zero_()
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                lib.step(m, bitmask, i, logits[i], token)
            steps.append(time.perf_counter() - t0)
    step_us = statistics.median(steps) * 1e6
    return {'library': lib.name, 'batch': batch, 'compile_ms': round(compile_ms, 2),
            'us_per_step': round(step_us, 1), 'us_per_token': round(step_us / batch, 1),
            'tokens': len(tokens), 'vocab': lib.vocab_size}


# a schema whose instances are long (64 bounded integers), so decode dominates
LONG_SCHEMA = {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 999},
               'minItems': 64, 'maxItems': 64}


def measure_throughput(model: str, batch: int, prompt_len: int = 64, repeat: int = 3) -> dict:
    """Decode tokens/s of ``batch`` requests guided by :data:`LONG_SCHEMA`, and unguided with the
    same token counts (the engine's step loop, prefill excluded by timing after the first token)."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.messages import StructuredOutput
    from lmdeploy.pytorch.engine.engine import Engine
    eng = Engine(model, PytorchEngineConfig(device_type='cpu', dtype='float32', num_gpu_blocks=512,
                                            max_batch_size=max(batch, 1)))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    guided = GenerationConfig(max_new_tokens=1000, structured_output=StructuredOutput(type='json_schema',
                                                                                      json_schema=LONG_SCHEMA))

    def run(cfgs):
        seqs = [eng.add_request(p, c) for p, c in zip(prompts, cfgs)]
        while any(s.num_generated == 0 for s in seqs):     # prefill and the first token: not timed
            eng.step()
        start, first = time.perf_counter(), sum(s.num_generated for s in seqs)
        while eng.has_work:
            eng.step()
        return sum(s.num_generated for s in seqs) - first, time.perf_counter() - start, seqs
    try:
        _, _, seqs = run([guided] * batch)                      # warm-up (compiles the grammar once)
        plain = [GenerationConfig(max_new_tokens=s.num_generated, ignore_eos=True) for s in seqs]
        best = {'guided': 0.0, 'unguided': 0.0}
        for _ in range(repeat):     # alternating, best of each: a shared machine's noise hits both alike
            for name, cfgs in (('guided', [guided] * batch), ('unguided', plain)):
                tokens, secs, _ = run(cfgs)
                best[name] = max(best[name], tokens / secs)
    finally:
        eng.close()
    return {'batch': batch, 'guided_tok_s': round(best['guided'], 1), 'unguided_tok_s': round(best['unguided'], 1),
            'tokens_per_request': seqs[0].num_generated, 'slowdown': round(best['unguided'] / best['guided'], 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--model', help='model directory (its tokenizer and vocab_size); default: the tiny Qwen3')
    ap.add_argument('--batch', type=int, nargs='+', default=[1, 16])
    ap.add_argument('--repeat', type=int, default=20)
    ap.add_argument('--throughput', action='store_true', help='also measure engine decode throughput')
    ap.add_argument('--json', help='write the results here')
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from lmdeploy.tools.make_tiny_model import make_tiny_model
        model = make_tiny_model(tempfile.mkdtemp(prefix='tiny_qwen3_'), arch='qwen3', seed=0)
    from transformers import AutoConfig, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = AutoConfig.from_pretrained(model).get_text_config().vocab_size
    text = json.dumps(INSTANCE, separators=(',', ':'))
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    torch.set_num_threads(1)
    results = []
    for cls in (_XGrammar, _LLGuidance):
        lib = cls(tokenizer, vocab_size)
        for b in args.batch:
            r = measure(lib, tokens, b, args.repeat)
            results.append(r)
            print(json.dumps(r))
    if args.throughput:
        for b in args.batch:
            r = measure_throughput(model, b)
            results.append(r)
            print(json.dumps(r))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == '__main__':
    main()
