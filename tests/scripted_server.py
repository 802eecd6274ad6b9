"""Test-only launcher of ``lmdeploy serve api_server`` whose sampler can be scripted.

    python tests/scripted_server.py serve api_server MODEL ... (the CLI's arguments)

Environment ``LMDEPLOY_TEST_SCRIPT``: a JSON list of rules ``{"reply": str, and any of
"contains": str, "endswith": str, "turn": int}``. The first rule whose conditions all hold for
a request's prompt text (``turn`` k: the prompt holds k earlier assistant turns) forces its
reply: at each step the logits of every token but the reply's next one (then ``<|im_end|>``)
are set to -inf before the engine's own sampler runs, so the forced tokens flow through the
real sampling, logprob, detokenizing and parsing code. A request no rule matches is the
model's own. This is how a random tiny model is made to emit tool calls.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmdeploy.pytorch.engine import model_runner  # noqa: E402

SCRIPT = json.loads(os.environ.get('LMDEPLOY_TEST_SCRIPT', '[]'))
MARK = '<|im_start|>assistant'
EOS = 2        # <|im_end|> of the tiny tokenizer
_real_sample = model_runner.sample
_plans: dict[int, list[int] | None] = {}
_tokenizer = None


def _tok():
    global _tokenizer
    if _tokenizer is None:
        from transformers import AutoTokenizer
        model = sys.argv[sys.argv.index('api_server') + 1]
        _tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return _tokenizer


def _forced(seq) -> list[int] | None:
    if seq.seq_id not in _plans:
        prompt = _tok().decode(seq.token_ids[:seq.num_prompt_tokens], skip_special_tokens=False)
        turn = prompt.count(MARK) - 1
        reply = next((r['reply'] for r in SCRIPT if r.get('contains', '') in prompt
                      and prompt.endswith(r.get('endswith', '')) and r.get('turn', turn) == turn), None)
        _plans[seq.seq_id] = None if reply is None else _tok().encode(reply, add_special_tokens=False) + [EOS]
    return _plans[seq.seq_id]


def scripted_sample(logits, seqs):
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        ids = _forced(seq)
        if ids is not None and seq.num_generated < len(ids):
            logits[i] = float('-inf')
            logits[i, ids[seq.num_generated]] = 0.0
    return _real_sample(logits, seqs)


model_runner.sample = scripted_sample

if __name__ == '__main__':
    from lmdeploy.cli.entrypoint import main
    sys.exit(main(sys.argv[1:]))
