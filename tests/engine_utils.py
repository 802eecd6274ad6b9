"""Shared drivers for the engine-level suites (Qwen3, Qwen3-Next, pipeline).

What they provide:
- ``engine_prompt_logits``: run one prompt through ``Engine.step`` (chunked as the engine's
  plan says) and collect the logits of EVERY prompt position, ``[n, vocab]`` float32;
- ``hf_prompt_logits`` / ``hf_greedy``: the ``transformers`` reference for the same ids;
- ``StepRecorder``: what each forward held (which sequences, prefill or decode), so a test can
  prove that continuous batching really mixed prefill and decode in one forward;
- ``run_staggered`` / ``run_alone``: request drivers that add a new request every few steps
  while others run, or one request at a time;
- ``assert_idle``: the exact idle ledger (docs/en/advance/prefix_caching.md "Invariants") of an engine.

Every driver runs on the engine's own thread-free API (``add_request`` / ``step`` / ``abort``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.paging.sequence import Sequence

TOL = 1e-4              # fp32 max abs logit difference allowed against transformers
FIRST_PLAIN_TOKEN = 3   # ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|> (eos)
VOCAB = 1024            # tokenizer size of the tiny models


def random_prompt(num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` plain token ids (no special tokens), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (num_tokens,), generator=gen).tolist()


def make_engine(model_path: str, **fields) -> Engine:
    """A CPU float32 engine with 256 KV blocks; ``fields`` override these and the other
    :class:`PytorchEngineConfig` defaults.

    Why 256 blocks: the derived CPU default sizes the cache for ``max_batch_size`` sequences of
    the model's full 32768-token context (hundreds of MB), which costs seconds per engine here.
    """
    fields.setdefault('num_gpu_blocks', 256)
    fields.setdefault('device_type', 'cpu')
    fields.setdefault('dtype', 'float32')
    return Engine(model_path, PytorchEngineConfig(**fields))


# recording forwards -----------------------------------------------------------------------
@dataclass
class StepRecord:
    """One forward: ``(seq_id, start, end, is_prefill)`` per scheduled chunk."""
    chunks: list[tuple[int, int, int, bool]] = field(default_factory=list)

    @property
    def mixed(self) -> bool:
        """The forward held at least one prefill chunk and one decode token."""
        kinds = {c[3] for c in self.chunks}
        return kinds == {True, False}


class StepRecorder:
    """Wraps ``engine.model_runner.forward`` to record every forward's chunks and, when
    ``keep_logits``, the logits of every position, per sequence: ``logits[seq_id]`` is a list of
    ``(start, [end - start, vocab] float32)``.
    """

    def __init__(self, engine: Engine, keep_logits: bool = False):
        self.steps: list[StepRecord] = []
        self.logits: dict[int, list[tuple[int, torch.Tensor]]] = {}
        runner = engine.model_runner
        inner = runner.forward

        def forward(out, return_all_logits: bool = False):
            result = inner(out, return_all_logits=keep_logits or return_all_logits)
            rec = StepRecord()
            offset = 0
            for chunk in out.chunks:
                n = chunk.end - chunk.start
                rec.chunks.append((chunk.seq.seq_id, chunk.start, chunk.end, chunk.is_prefill))
                if keep_logits:
                    self.logits.setdefault(chunk.seq.seq_id, []).append(
                        (chunk.start, runner.all_logits[offset:offset + n].float()))
                offset += n
            self.steps.append(rec)
            return result

        runner.forward = forward

    @property
    def num_mixed_steps(self) -> int:
        """Forwards that held prefill and decode together."""
        return sum(s.mixed for s in self.steps)

    def max_concurrent(self) -> int:
        """Most sequences in one forward."""
        return max((len(s.chunks) for s in self.steps), default=0)

    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """``[num_prompt_tokens, vocab]`` logits of every prompt position of ``seq``, stitched
        from its forwards; raises AssertionError if a position is missing or repeated."""
        parts = sorted(self.logits[seq.seq_id], key=lambda p: p[0])
        pos = 0
        rows = []
        for start, block in parts:
            if start >= seq.num_prompt_tokens:
                break
            assert start == pos, f'prompt positions {pos}..{start} were never computed'
            rows.append(block)
            pos += block.shape[0]
        out = torch.cat(rows)
        assert out.shape[0] == seq.num_prompt_tokens, (out.shape, seq.num_prompt_tokens)
        return out


def engine_prompt_logits(engine: Engine, token_ids: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of every prompt position from the engine, and the number of forwards it took.

    Returns:
        ``([n, vocab] float32, forwards)``; the engine is idle again afterwards.
    """
    rec = StepRecorder(engine, keep_logits=True)
    seq = engine.generate(token_ids, GenerationConfig(max_new_tokens=1, ignore_eos=True))
    return rec.prompt_logits(seq), len(rec.steps)


# transformers reference -------------------------------------------------------------------
def load_hf(model_path: str):
    """The ``transformers`` reference model in float32, eval mode, running ``transformers``' torch
    code even where fla-core / mamba_ssm / causal_conv1d are installed (tests/hf_reference.py)."""
    from hf_reference import use_torch_reference
    from transformers import AutoModelForCausalLM
    use_torch_reference()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_prompt_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """``[n, vocab]`` float32 logits of ``transformers`` at every position."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(hf_model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """``transformers`` ``generate`` greedy continuation (ends at the model's eos, included)."""
    out = hf_model.generate(torch.tensor([token_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(token_ids):].tolist()


def hf_prompt_refs(hf_model, lengths: list[int]) -> dict[int, tuple[list[int], torch.Tensor]]:
    """``{n: (ids, transformers logits [n, vocab])}`` with an independent prompt per length
    (``random_prompt(n, seed=n)``)."""
    refs = {}
    for n in lengths:
        ids = random_prompt(n, seed=n)
        refs[n] = (ids, hf_prompt_logits(hf_model, ids))
    return refs


def seeded_prompts(lengths: list[int], first_seed: int) -> list[list[int]]:
    """One random prompt per length, the ``i``-th with seed ``first_seed + i``."""
    return [random_prompt(n, seed=first_seed + i) for i, n in enumerate(lengths)]


def reference_fixtures(model_fixture: str, lengths: list[int], stagger_lengths: list[int], first_seed: int,
                       new_tokens: int) -> tuple:
    """Module-scoped fixtures an engine suite compares with ``transformers``, to be assigned to
    module names (pytest finds a fixture by the name it is assigned to)::

        hf, prompt_refs, prompts, hf_continuations = reference_fixtures('tiny_qwen3', ...)

    - ``hf``: :func:`load_hf` of the checkpoint the fixture ``model_fixture`` gives;
    - ``prompt_refs``: :func:`hf_prompt_refs` of ``lengths``;
    - ``prompts``: :func:`seeded_prompts` of ``stagger_lengths`` from ``first_seed``;
    - ``hf_continuations``: the ``transformers`` greedy continuation (``new_tokens`` at most) of
      each of those prompts.
    """
    @pytest.fixture(scope='module')
    def hf(request):
        return load_hf(request.getfixturevalue(model_fixture))

    @pytest.fixture(scope='module')
    def prompt_refs(hf):
        return hf_prompt_refs(hf, lengths)

    @pytest.fixture(scope='module')
    def prompts():
        return seeded_prompts(stagger_lengths, first_seed)

    @pytest.fixture(scope='module')
    def hf_continuations(hf):
        return [hf_greedy(hf, p, new_tokens) for p in seeded_prompts(stagger_lengths, first_seed)]

    return hf, prompt_refs, prompts, hf_continuations


# request drivers --------------------------------------------------------------------------
def run_staggered(engine: Engine, prompts: list[list[int]], gen_config: GenerationConfig,
                  every: int = 2, max_steps: int = 10_000) -> list[Sequence]:
    """Add request ``i`` before step ``i * every``, stepping until every request finished.

    Returns:
        The finished sequences, in prompt order.
    """
    seqs: list[Sequence] = []
    step = 0
    while len(seqs) < len(prompts) or not all(s.is_finished for s in seqs):
        while len(seqs) < len(prompts) and step >= len(seqs) * every:
            seqs.append(engine.add_request(prompts[len(seqs)], gen_config))
        engine.step()
        step += 1
        assert step < max_steps, 'requests did not finish'
    return seqs


def run_alone(engine: Engine, prompts: list[list[int]], gen_config: GenerationConfig) -> list[list[int]]:
    """Each prompt run to completion with nothing else in the engine; the output ids."""
    return [engine.generate(p, gen_config).output_ids for p in prompts]


def step_until(engine: Engine, cond, max_steps: int = 10_000) -> None:
    """Step ``engine`` until ``cond()`` holds."""
    for _ in range(max_steps):
        if cond():
            return
        engine.step()
    raise AssertionError('condition never held')


def idle_ledger(engine: Engine) -> dict[str, int]:
    """The ledger an engine without a prefix cache must show when no request is in flight."""
    led = engine.ledger()
    total_slots = led['runtime_slots_total']
    return {'blocks_total': led['blocks_total'], 'blocks_free': led['blocks_total'], 'blocks_cached': 0,
            'blocks_in_use': 0, 'checkpoint_rows': 0, 'device_cache_bytes': 0, 'host_cache_bytes': 0,
            'window_blocks_total': led['window_blocks_total'], 'window_blocks_free': led['window_blocks_total'],
            'window_blocks_cached': 0,
            'runtime_slots_free': total_slots, 'runtime_slots_total': total_slots,
            'checkpoints_pinned': 0, 'checkpoints_published': 0, 'store_inflight': 0, 'store_queue_depth': 0,
            'requests_running': 0, 'requests_waiting': 0, 'grammar_matchers': 0}


def sampled_logits(engine: Engine, ids: list[int], steps: int) -> torch.Tensor:
    """``[steps, vocab]``: the engine's logits of each sampled token of one greedy request (the
    prompt's last, then each decode step's), eos ignored; the engine is idle again afterwards."""
    seq = engine.add_request(ids, GenerationConfig(max_new_tokens=steps, ignore_eos=True))
    rows = []
    while not seq.is_finished:
        before = seq.num_generated
        engine.step()
        if seq.num_generated > before:
            rows.append(engine.model_runner.last_logits[0].clone())
    return torch.stack(rows)


def run_schedule(engine: Engine, schedule, max_steps: int = 200) -> tuple[list, list[list[int]]]:
    """Step ``engine`` through ``schedule``, one ``(arrival step, prompt tokens, new tokens)`` per
    request: request ``i`` (prompt ``random_prompt(prompt tokens, i)``, ``new tokens`` generated,
    eos ignored) is added before step ``arrival``; stops once every request finished, or after
    ``max_steps`` steps.

    Returns:
        ``(logits, tokens)``: per step the runner's sampled logits (``model_runner.last_logits``,
        None for a step that sampled nothing) and each request's token ids, in schedule order.
    """
    runner, seqs, logits = engine.model_runner, [], []
    for step in range(max_steps):
        for i, (at, prompt, new) in enumerate(schedule):
            if at == step:
                seqs.append(engine.add_request(random_prompt(prompt, i),
                                               GenerationConfig(max_new_tokens=new, ignore_eos=True)))
        runner.last_logits = None
        engine.step()
        logits.append(runner.last_logits)
        if len(seqs) == len(schedule) and all(s.is_finished for s in seqs):
            break
    return logits, [list(s.token_ids) for s in seqs]


def assert_idle(engine: Engine) -> None:
    """Every block and runtime state slot is free and nothing is queued."""
    assert engine.ledger() == idle_ledger(engine)
    assert engine.is_idle()


# the prefix-cache policies every hybrid family must serve identically
CACHE_POLICIES = {
    'off': dict(enable_prefix_caching=False),
    'on': dict(enable_prefix_caching=True),
    'last_only': dict(enable_prefix_caching=True, prefill_save_last_only=True),
    'turn_end': dict(enable_prefix_caching=True, decode_save_last=True),
}


def check_four_turn_chat_under_every_cache_policy(model_path: str) -> None:
    """A 4-turn chat (90/50/70/40-token user turns, 8 new tokens each, B=16, 32-token chunks,
    A=16) gives identical replies with the prefix cache off, on, last-only and turn-end, no hit
    on turn 1 and a hit on every later turn whenever the cache is on."""
    users = [random_prompt(n, seed=40 + i) for i, n in enumerate((90, 50, 70, 40))]
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    replies, hits = {}, {}
    for name, fields in CACHE_POLICIES.items():
        eng = make_engine(model_path, block_size=16, max_prefill_token_num=32, prefill_save_alignment=16,
                          num_checkpoint_slots=16, **fields)
        ids, replies[name], hits[name] = [], [], []
        for user in users:
            ids = ids + user
            seq = eng.generate(ids, gen)
            replies[name].append(seq.output_ids)
            hits[name].append(seq.num_cached_tokens)
            ids = list(seq.token_ids)
    assert all(r == replies['off'] for r in replies.values()), replies
    assert hits['off'] == [0, 0, 0, 0]
    for name in ('on', 'last_only', 'turn_end'):
        assert hits[name][0] == 0 and all(h > 0 for h in hits[name][1:]), (name, hits[name])


# checks every hybrid family runs against its transformers reference ------------------------
def tiny_checkpoint_and_reference(tmp_path_factory, arch: str, load=load_hf):
    """``make_tiny_model(arch, seed=0)`` in a fresh temporary folder; ``(path, load(path))``, the
    checkpoint in the published layout and the float32 ``transformers`` reference."""
    from lmdeploy.tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(str(tmp_path_factory.mktemp(f'tiny_{arch}')), arch=arch, seed=0)
    return path, load(path)


def check_prompt_logits_match_transformers(model_path: str, hf_model, n: int, chunk: int) -> None:
    """A random ``n``-token prompt prefilled in ``chunk``-token forwards (B=16): one forward per
    chunk, fp32 logits within ``TOL`` of ``transformers`` at every position, argmax equal."""
    ids = random_prompt(n, seed=n)
    got, forwards = engine_prompt_logits(make_engine(model_path, max_prefill_token_num=chunk, block_size=16), ids)
    ref = hf_prompt_logits(hf_model, ids)
    assert forwards == -(-n // chunk)
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def check_greedy_equals_transformers_cold_chunked_and_after_restore(model_path: str, hf_model) -> None:
    """12 greedy tokens of a 200-token prompt equal ``transformers`` cold, in 32-token chunks, and
    with the prefix cache (A=64) on both the first run (save points 64/128/192) and a rerun
    that restores 192 tokens."""
    ids = random_prompt(200, seed=11)
    expected = hf_greedy(hf_model, ids, 12)
    gen = GenerationConfig(max_new_tokens=12)
    cold = make_engine(model_path, block_size=16).generate(ids, gen).output_ids
    chunked = make_engine(model_path, block_size=16, max_prefill_token_num=32).generate(ids, gen).output_ids
    cached = make_engine(model_path, block_size=16, max_prefill_token_num=32, prefill_save_alignment=64,
                         enable_prefix_caching=True, num_checkpoint_slots=8)
    first = cached.generate(ids, gen)
    again = cached.generate(ids, gen)
    assert cold == chunked == first.output_ids == again.output_ids == expected
    assert first.stats.save_points == [64, 128, 192] and again.num_cached_tokens == 192


def check_store_bytes_then_a_new_engine_restores(model_path: str, tmp_path, seed: int) -> None:
    """Against a ``file:`` Store: the '16k' / 'mt4k' seed scenarios scaled by 1/16 put exactly the
    bytes ``simulate()`` predicts (default and last-only policies); then a new engine (empty local
    cache, same Store) restores a 300-token prompt another engine saved (256 tokens, all from the
    Store) and decodes what an engine with caching off decodes. The Store path is the one a fresh
    process takes (each cache kind runs it once in a fresh process,
    tests/test_store_fresh_process.py), so a family whose cache kinds are not new runs it here, in
    this one. A model with nothing paged (K_blk = 0) puts state objects only."""
    from test_benchmark_store_bytes import check_store_put_bytes_equal_the_simulator
    store = dict(store_backend=f'file:{tmp_path / "store"}')
    for last_only in (False, True):
        check_store_put_bytes_equal_the_simulator(model_path, last_only, store, max_turns=2, seed=seed)
    ids = random_prompt(300, seed=seed + 301)
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    fields = dict(block_size=16, prefill_save_alignment=64, max_prefill_token_num=64, enable_prefix_caching=True,
                  **store)
    writer = make_engine(model_path, **fields)
    first = writer.generate(ids, gen)
    assert writer.store.flush(timeout=30)
    # the 16 blocks below 256 tokens; none when nothing is paged (a prefix is its state objects alone)
    kv_objects = 16 if writer.cache_engine.kv_block_bytes else 0
    want = {'state': 4, 'kv': kv_objects}
    if writer.store.window_rows:     # a window pool of its own: the blocks of each save point's window
        from lmdeploy.pytorch.cache_specs import window_first_block
        want['window'] = len({k for b in (64, 128, 192, 256)
                              for k in range(window_first_block(b, writer.store.window_rows, 16), b // 16)})
    assert writer.stats()['store_put_objects'] == want
    writer.close()
    reader = make_engine(model_path, **fields)
    try:
        again = reader.generate(ids, gen)
        assert first.stats.save_points == [64, 128, 192, 256] and first.num_cached_tokens == 0
        assert again.num_cached_tokens == again.stats.store_hit_tokens == 256
    finally:
        reader.close()
    cold = make_engine(model_path, max_prefill_token_num=64).generate(ids, gen).output_ids
    assert first.output_ids == again.output_ids == cold


def check_checkpoint_matches_transformers(model_path: str, hf_model) -> None:
    """A 120-token prompt in 40-token chunks (B=16): fp32 logits within ``TOL`` of ``hf_model``'s
    at every position; 8 greedy tokens (eos ignored) equal ``transformers`` ``generate``."""
    ids = random_prompt(120, seed=7)
    got, _ = engine_prompt_logits(make_engine(model_path, max_prefill_token_num=40, block_size=16), ids)
    assert (got - hf_prompt_logits(hf_model, ids)).abs().max().item() <= TOL
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    assert make_engine(model_path, block_size=16).generate(ids, gen).output_ids == hf_greedy(hf_model, ids, 8)


def check_host_window_entries(host, ce, prompts: list[list[int]], block_size: int, window: int) -> None:
    """A mixed model's host tier holds window entries for exactly the windows of its state
    entries (the blocks ``[window_first_block(b), b / B)`` of each boundary b with a state
    entry, among the prompts' 12 first blocks), at least one state entry, and ``bytes_held``
    equal to its entries' payload bytes (state, global rows, window rows)."""
    from lmdeploy.pytorch.cache_specs import window_first_block
    from lmdeploy.pytorch.prefix_cache.block_trie import chain_block_hashes
    entries = {kind: {h for k, h in host._entries if k == kind} for kind in ('state', 'kv', 'window')}
    want = set()
    for p in prompts:
        hashes = chain_block_hashes(p, block_size, 12)
        for i, h in enumerate(hashes):
            if h in entries['state']:
                want.update(hashes[k] for k in range(window_first_block((i + 1) * block_size, window, block_size), i + 1))
    assert entries['state'] and entries['window'] == want
    assert host.bytes_held == (len(entries['state']) * ce.state_bytes + len(entries['kv']) * ce.kv_block_bytes
                               + len(want) * ce.window_block_bytes)
