"""Tensor parallelism on CPU (gloo), TP2 against TP1 on the tiny models (issue 19).

What is checked: each rank reads only its slices from safetensors; TP2 logits of every prompt
position are within 1e-5 of TP1 and greedy tokens are equal (continuous batching, chunked
prefill); outputs with the prefix cache off / on / last-only are identical; n-gram speculative
decoding accepts exactly the right drafts and rolls back every rank's state; Qwen3-Next MTP
drafting at TP2 loads only slices of the split ``mtp.*`` tensors, drafts exactly TP1's tokens and
decodes plain TP1's, and its Store objects restore across TP sizes; Qwen3.5 (flat Gated DeltaNet
projections read as q | k | v slices, the vision tower on rank 0 only) equals TP1 text-only and
with images (chunked, prefix cache off / on) and its Store objects restore across TP sizes; the
ledger is idle after aborts; a killed worker ends the engine with an error naming its rank and
leaves no process behind. The MTP and Qwen3.5-with-images checks are in
tests/test_tensor_parallel_mtp_vision.py.

Geometry: B = 16, A = 64, P = 48 (every prompt is chunked).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine_utils import assert_idle, engine_prompt_logits, random_prompt, run_staggered
from tp_utils import B, PROMPTS, TP_TOL, check_store_across_tp_sizes, engine, record_safetensors_reads
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.executor import WorkerDiedError
from lmdeploy.pytorch.distributed.sharding import TPLayout
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.engine_loop import EngineLoop
from lmdeploy.pytorch.models.loader import iter_safetensors, iter_weights, load_config


GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f'/proc/{pid}/stat') as f:      # a zombie is gone for our purposes
        return f.read().split()[2] != 'Z'


# loading ---------------------------------------------------------------------------------
@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_next', 'qwen3_5', 'qwen3_5_text', 'qwen3_5_moe', 'qwen3_5_moe_text'])
def test_each_rank_reads_its_slices_and_the_slices_tile_every_split_tensor(arch, request, monkeypatch):
    path = request.getfixturevalue(f'tiny_{arch}')
    config = load_config(path)
    text = getattr(config, 'text_config', None) or config
    full = dict(iter_safetensors(path, progress=False))
    reads = record_safetensors_reads(monkeypatch)
    layouts = [TPLayout(config, r, 2) for r in range(2)]
    parts = [dict(iter_weights(path, layout)) for layout in layouts]
    split = [n for n in full if layouts[0].shard(n) is not None]
    assert 'lm_head.weight' in split or config.tie_word_embeddings
    assert any('k_proj' in n for n in split)
    if arch == 'qwen3_next':
        assert any('conv1d' in n for n in split) and any('in_proj_qkvz' in n for n in split)
        assert any(n.startswith('mtp.') and 'k_proj' in n for n in split)      # the MTP head's attention
    if arch.startswith('qwen3_5'):      # flat Gated DeltaNet projections, under model.language_model.*
        for part in ('in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a', 'conv1d', 'dt_bias', 'A_log',
                     'out_proj', 'q_proj', 'o_proj') + (() if 'moe' in arch else ('down_proj', 'gate_proj')):
            assert any(f'.{part}.' in n or n.endswith(f'.{part}') for n in split), part
        # the text-only MoE checkpoint is written by transformers' Qwen3_5MoeForCausalLM: model.* names
        assert ('model.embed_tokens.weight' if arch == 'qwen3_5_moe_text'
                else 'model.language_model.embed_tokens.weight') in split
    if 'moe' in arch:      # MoE (experts, router, shared expert) replicated; the MTP head's attention split
        assert not any('.mlp.' in n for n in split)
        assert any(n.startswith('mtp.') and 'k_proj' in n for n in split)
    if arch in ('qwen3_5', 'qwen3_5_moe'):
        visual = {n for n in full if n.startswith('model.visual.')}
        assert visual and visual <= set(parts[0]) and not visual & set(parts[1])   # the tower: rank 0 only
        assert not visual & set(split)
    assert not {n for n, how in reads if how == 'whole'} & set(split), 'a split tensor was read whole'
    for name in split:
        shard = layouts[0].shard(name)
        if len(shard.ranges) == 1:
            joined = torch.cat([p[name] for p in parts], dim=shard.dim)
        else:   # conv1d, in_proj_qkv: q | k | v channel groups, each split between the ranks
            pieces = [p[name].split([b - a for a, b in layouts[i].shard(name).ranges]) for i, p in enumerate(parts)]
            joined = torch.cat([pieces[r][g] for g in range(3) for r in range(2)])
        if name.endswith(('k_proj.weight', 'v_proj.weight')) and text.num_key_value_heads < 2:
            continue
        assert torch.equal(joined, full[name]), name


def test_a_tp_size_the_heads_do_not_allow_is_refused_naming_the_field(tiny_qwen3_next):
    with pytest.raises(ValueError, match='linear_num_key_heads'):
        Engine(tiny_qwen3_next, PytorchEngineConfig(tp=4, device_type='cpu', dtype='float32', num_gpu_blocks=16))
    with pytest.raises(ValueError, match='tp'):
        PytorchEngineConfig(tp=0)


def test_a_model_type_without_a_split_is_refused_naming_tp(tiny_qwen3):
    """Every registered model type splits; a config of any other type (here the tiny Qwen3's
    relabelled) is a ValueError naming tp and the model type."""
    config = load_config(tiny_qwen3)
    config.model_type = 'llama'
    with pytest.raises(ValueError, match=r"tp \(2\).*'llama'"):
        TPLayout(config, 0, 2)


def test_qwen3_5_local_config_splits_the_text_config(tiny_qwen3_5):
    """The vision-language config's ``text_config`` gets this rank's counts (the vision config
    and the full config are untouched), and a TP size the Gated DeltaNet key heads do not allow
    names ``linear_num_key_heads``."""
    config = load_config(tiny_qwen3_5)
    local = TPLayout(config, 1, 2).local_config()
    t, full = local.text_config, config.text_config
    assert (t.num_attention_heads, t.num_key_value_heads) == (full.num_attention_heads // 2, 1)
    assert (t.linear_num_key_heads, t.linear_num_value_heads) == (1, 2)
    assert t.intermediate_size == full.intermediate_size // 2
    assert local.vision_config.to_dict() == config.vision_config.to_dict()
    assert full.linear_num_key_heads == 2
    layout = TPLayout(config, 1, 2)
    assert (layout.part('k_heads'), layout.part('v_heads')) == ((1, 2), (2, 4))
    with pytest.raises(ValueError, match='linear_num_key_heads'):
        TPLayout(config, 0, 4)


def test_kv_heads_fewer_than_ranks_are_replicated(tiny_qwen3):
    config = load_config(tiny_qwen3)        # 2 KV heads, 4 query heads
    assert [TPLayout(config, r, 4).part('kv_heads') for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TPLayout(config, r, 4).part('q_heads') for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.fixture(scope='module')
def tiny_qwen3_5_text(tiny_qwen3_5, tmp_path_factory) -> str:
    """The tiny Qwen3.5's text stack as a ``qwen3_5_text`` checkpoint (``Qwen3_5ForCausalLM``):
    its ``text_config`` as the config, its tensors less ``model.visual.*`` (names kept under
    ``model.language_model.*``)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    dst = str(tmp_path_factory.mktemp('tiny_qwen3_5_text'))
    for name in os.listdir(tiny_qwen3_5):
        if name not in ('config.json', 'model.safetensors', 'preprocessor_config.json'):
            shutil.copy(os.path.join(tiny_qwen3_5, name), dst)
    text = load_config(tiny_qwen3_5).text_config.to_dict()
    with open(os.path.join(dst, 'config.json'), 'w') as f:
        json.dump(dict(text, architectures=['Qwen3_5ForCausalLM']), f)
    tensors = load_file(os.path.join(tiny_qwen3_5, 'model.safetensors'))
    save_file({n: t for n, t in tensors.items() if not n.startswith('model.visual.')},
              os.path.join(dst, 'model.safetensors'), metadata={'format': 'pt'})
    assert load_config(dst).model_type == 'qwen3_5_text'
    return dst


# TP2 == TP1 ------------------------------------------------------------------------------
def _run(eng: Engine) -> list[list[int]]:
    seqs = run_staggered(eng, PROMPTS, GEN, every=2)
    assert_idle_or_cached(eng)
    return [s.output_ids for s in seqs]


def assert_idle_or_cached(eng: Engine) -> None:
    assert eng.is_idle()
    if not eng.prefix_cache.caches_prefixes:
        assert_idle(eng)


def check_tp_slices_tile_every_split_tensor(path: str, shared: bool = False):
    """Over 2 ranks' ``TPLayout``, each split tensor of the checkpoint at ``path`` has ranges that
    tile its axis exactly once, and a tensor one rank reads whole every rank reads whole. With
    ``shared``, a range several ranks read identically (rows replicated on the ranks that share
    them, e.g. a Mamba-2 group's ``B`` / ``C``) counts once; partial overlaps still fail.

    Returns:
        ``(config, [layout of rank 0, of rank 1], number of split tensors)``; with ``shared``,
        also the number of ranges read by more than one rank.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    from lmdeploy.pytorch.distributed.sharding import TPLayout
    config = AutoConfig.from_pretrained(path)
    layouts = [TPLayout(config, r, 2) for r in range(2)]
    split = repeated = 0
    with safe_open(os.path.join(path, 'model.safetensors'), framework='pt') as f:
        for name in f.keys():
            shards = [lay.shard(name) for lay in layouts]
            shape = f.get_slice(name).get_shape()
            if shards[0] is None:
                assert all(s is None for s in shards), name
                continue
            split += 1
            covered = sorted(r for s in shards for r in s.ranges)
            if shared:
                repeated += len(covered) - len(set(covered))
                covered = sorted(set(covered))
            assert covered[0][0] == 0 and covered[-1][1] == shape[shards[0].dim], name
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), name
    return (config, layouts, split, repeated) if shared else (config, layouts, split)


def check_tp2_equals_tp1(path: str, then=None) -> None:
    """A TP2 engine's prompt logits of ``PROMPTS[1]`` are within ``TP_TOL`` of a TP1 engine's and
    its staggered greedy outputs of ``PROMPTS`` equal TP1's; ``then(tp2_engine)``, when given,
    runs the caller's further checks before the TP2 engine closes."""
    ref = engine(path)
    ref_logits, _ = engine_prompt_logits(ref, PROMPTS[1])
    ref_out = [s.output_ids for s in run_staggered(ref, PROMPTS, GEN, every=2)]
    ref.close()
    eng = engine(path, tp=2)
    try:
        logits, _ = engine_prompt_logits(eng, PROMPTS[1])
        assert (logits - ref_logits).abs().max().item() <= TP_TOL
        assert [s.output_ids for s in run_staggered(eng, PROMPTS, GEN, every=2)] == ref_out
        if then is not None:
            then(eng)
    finally:
        eng.close()


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_next', 'qwen3_5', 'qwen3_5_text', 'qwen3_5_moe', 'qwen3_5_moe_text'])
def test_tp2_logits_and_greedy_tokens_equal_tp1(arch, request):
    path = request.getfixturevalue(f'tiny_{arch}')
    ref = engine(path)
    ref_logits, ref_forwards = engine_prompt_logits(ref, PROMPTS[1])
    ref_out = _run(ref)
    ref.close()
    eng = engine(path, tp=2)
    try:
        assert len(eng.executor.pids) == 1
        logits, forwards = engine_prompt_logits(eng, PROMPTS[1])
        # 90 tokens in chunks of 48: the state crosses a chunk; a hybrid model's chunk grid also ends
        # a forward at the last reusable aligned boundary (48, 64, 90), caching on or off
        assert forwards == ref_forwards == (2 if arch == 'qwen3' else 3)
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= TP_TOL, diff
        assert _run(eng) == ref_out
        assert_idle(eng)
    finally:
        pids = eng.executor.pids
        eng.close()
    assert not any(_pid_alive(p) for p in pids)


def test_tp2_prefix_cache_on_last_only_and_off_are_identical_and_aborts_leave_it_idle(tiny_qwen3_next):
    off = engine(tiny_qwen3_next)
    expected = _run(off)
    off.close()
    for last_only in (False, True):
        # last-only runs with one memory budget: checkpoints in KV block rows, on every rank
        budget = dict(num_gpu_blocks=0, cache_bytes=8 << 20) if last_only else {}
        eng = engine(tiny_qwen3_next, tp=2, enable_prefix_caching=True, prefill_save_last_only=last_only, **budget)
        try:
            assert eng.state_cache.uses_block_rows == last_only
            assert _run(eng) == expected
            assert _run(eng) == expected        # second pass restores from the checkpoints
            stats = eng.stats()
            assert stats['prefix_cache_hit_tokens'] >= 64 and stats['checkpoints_saved'] > 0
            # aborts: one mid-prefill, one mid-decode
            a = eng.add_request(random_prompt(100, 7), GEN)
            b = eng.add_request(PROMPTS[0], GEN)
            while b.num_generated < 2:
                eng.step()
            eng.abort(b)
            eng.step()
            eng.abort(a)
            assert eng.is_idle()
            led = eng.ledger()
            assert led['blocks_in_use'] == 0 and led['checkpoints_pinned'] == 0
            assert led['runtime_slots_free'] == led['runtime_slots_total']
        finally:
            eng.close()


# speculative decoding -----------------------------------------------------------------------
@pytest.mark.parametrize('wrong_at', [None, 1])
def test_tp2_ngram_speculative_decoding_accepts_exactly_and_rolls_back_every_rank(tiny_qwen3_next, wrong_at):
    """Drafts scripted from the plain TP1 output (all right, or wrong at index 1): TP2 verifies
    them in one forward per step on both ranks, emits exactly the accepted prefix plus one token,
    and — when a draft is rejected — restores every rank's slice of the recurrent state, so the
    output equals plain TP1 decoding with the prefix cache on."""
    K = 3
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    ref = engine(tiny_qwen3_next)
    expected = [ref.generate(p, gen).output_ids for p in PROMPTS]
    ref.close()
    eng = engine(tiny_qwen3_next, tp=2, enable_prefix_caching=True,
                 speculative_config=dict(method='ngram', num_speculative_tokens=K))
    try:
        spec = eng.spec
        truth: dict[int, list[int]] = {}

        def propose(sched, new_tokens):     # the true continuation, one draft corrupted
            for chunk in sched.chunks:
                seq = chunk.seq
                room = spec._draft_room(seq) if seq.seq_id in new_tokens else 0
                drafts = list(truth[seq.seq_id][seq.num_generated:seq.num_generated + room])
                if wrong_at is not None and wrong_at < len(drafts):
                    drafts[wrong_at] = 3 + (drafts[wrong_at] - 2) % 1000
                seq.draft_ids = drafts
        spec.propose = propose

        def run() -> tuple[list[list[int]], list[int]]:
            seqs = [eng.add_request(p, gen) for p in PROMPTS]
            truth.update({s.seq_id: e for s, e in zip(seqs, expected)})
            emitted = []
            while not all(s.is_finished for s in seqs):
                emitted.extend(len(o.new_token_ids) for o in eng.step())
            return [s.output_ids for s in seqs], emitted

        outputs, emitted = run()
        assert outputs == expected
        stats = eng.stats()
        assert max(emitted) == (K + 1 if wrong_at is None else 2)   # accepted drafts + the target's token
        assert stats['spec_decode_verify_steps'] > 0
        assert (stats['spec_decode_rollbacks'] == 0) == (wrong_at is None)
        assert eng.is_idle()
        # a second pass restores the prefixes saved while drafting and decodes the same tokens
        assert run()[0] == expected
        assert eng.stats()['prefix_cache_hit_tokens'] > 0
    finally:
        eng.close()


# failure ---------------------------------------------------------------------------------
def test_killing_a_worker_mid_request_ends_the_engine_with_an_error_naming_the_rank(tiny_qwen3_next):
    eng = engine(tiny_qwen3_next, tp=2)
    pid = eng.executor.pids[0]
    loop = EngineLoop(eng)
    try:
        gen = GenerationConfig(max_new_tokens=200, ignore_eos=True)
        handle = loop.submit(eng.requests.check(random_prompt(40, 9), gen))
        assert handle.get(timeout=60).token_ids        # running: the first token arrived
        os.kill(pid, signal.SIGKILL)
        reason = None
        deadline = time.monotonic() + 60
        while reason is None and time.monotonic() < deadline:
            reason = handle.get(timeout=60).finish_reason
        assert reason == 'error'
        loop._thread.join(timeout=30)
        assert not loop._thread.is_alive()              # the loop ended instead of retrying
        assert isinstance(loop.fatal_error, WorkerDiedError)
        assert loop.fatal_error.rank == 1 and 'rank 1' in str(loop.fatal_error)
        assert 'signal 9' in str(loop.fatal_error)
        with pytest.raises(RuntimeError, match='rank 1'):
            loop.submit(eng.requests.check([5, 6, 7], GEN))
    finally:
        loop.close()
    assert not _pid_alive(pid)


# Store: full-head objects, restorable across TP sizes --------------------------------------
def test_a_script_without_a_main_guard_gets_a_worker_error_that_says_so(tiny_qwen3, tmp_path):
    """Workers are spawned and import the main module: a script that builds a tp > 1 pipeline at
    top level makes each worker start it again; the error names the fix, not just the exit."""
    import subprocess
    import sys
    script = tmp_path / 'unguarded.py'
    script.write_text('from lmdeploy import pipeline, PytorchEngineConfig\n'
                      f'pipe = pipeline({tiny_qwen3!r}, backend_config=PytorchEngineConfig(tp=2, device_type="cpu"))\n'
                      'print(pipe("hi").text)\n')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1'))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert 'WorkerDiedError' in last and 'if __name__ == "__main__":' in last, proc.stderr[-2000:]


def test_a_tp2_engine_process_exits_without_a_leaked_semaphore_warning(tiny_qwen3, tmp_path):
    """A worker leaves by os._exit, so a named semaphore it made (tqdm's default multiprocessing
    lock, built by the weight loader's disabled progress bar on rank 1) stayed registered with the
    resource tracker, and every tp > 1 server's exit printed its 'leaked semaphore' warning."""
    import subprocess
    import sys
    script = tmp_path / 'start_stop.py'
    script.write_text('import torch\n'
                      'from lmdeploy.pytorch.engine.executor import MultiProcessExecutor\n'
                      'if __name__ == "__main__":\n'
                      f'    MultiProcessExecutor({tiny_qwen3!r}, "auto", torch.device("cpu"), 2).close()\n')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MC_TCP_BIND_ADDRESS='127.0.0.1'))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'leaked semaphore' not in proc.stderr, proc.stderr[-2000:]


def test_store_layout_round_trips_rank_slices(tiny_qwen3_next):
    from lmdeploy.pytorch.store.layout import StoreLayout
    from lmdeploy.pytorch.models.qwen3_next import Qwen3NextForCausalLM
    config = load_config(tiny_qwen3_next)
    full = Qwen3NextForCausalLM.cache_specs(config, torch.float32)
    local = Qwen3NextForCausalLM.cache_specs(TPLayout(config, 0, 2).local_config(), torch.float32)
    layout = StoreLayout(config, 2, local, full, B)
    for kv, size in ((True, layout.kv_block_bytes), (False, layout.state_bytes)):
        payload = torch.randint(0, 256, (3, size), dtype=torch.uint8)
        ranks = layout.to_ranks(payload, kv)
        assert sum(r.shape[1] for r in ranks) == size          # no head replicated at TP2: bytes = sum over ranks
        assert torch.equal(layout.to_full(ranks, kv), payload)
        assert not torch.equal(ranks[0], payload[:, :ranks[0].shape[1]])    # interleaved per layer, not a prefix


@pytest.mark.parametrize('writer_tp, reader_tp', [(2, 1), (1, 2), (2, 2)])
def test_a_reader_with_another_tp_size_restores_the_writers_prefix_and_bytes_match_the_simulator(
        writer_tp, reader_tp, tiny_qwen3_next, mooncake_services):
    check_store_across_tp_sizes(tiny_qwen3_next, mooncake_services, writer_tp, reader_tp,
                                4000 + 10 * writer_tp + reader_tp, kv_replicated=False)


def test_the_rendezvous_listens_on_loopback_only():
    """Rank 0's TCPStore listens on 127.0.0.1, not on every interface (a ``tcp://127.0.0.1``
    init method leaves torch's store server on the wildcard address)."""
    import subprocess
    import sys
    psutil = pytest.importorskip('psutil')
    code = ("import os, json, psutil, torch\n"
            "from lmdeploy.pytorch.distributed.comm import init_group, destroy_group, free_port\n"
            "port = free_port()\n"
            "init_group(0, 1, port, torch.device('cpu'), 20.0)\n"
            "print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections(kind='inet')\n"
            "                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port]))\n"
            "destroy_group()\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == '["127.0.0.1"]', out.stdout


def test_every_listener_of_a_tp2_engine_and_its_workers_is_on_loopback(tiny_qwen3_next):
    """Rendezvous, gloo pairs and anything else the ranks open listen on 127.0.0.1 only (gloo
    binds to the hostname's address unless pinned to an interface; where the hostname resolves
    to 127.0.0.1 this passes without the pinning too, elsewhere it needs it)."""
    psutil = pytest.importorskip('psutil')

    def listening(procs) -> set:
        return {(p.pid, c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind='inet')
                if c.status == psutil.CONN_LISTEN}

    before = listening([psutil.Process()])      # earlier tests in this process may have left their own
    eng = engine(tiny_qwen3_next, tp=2)
    try:
        eng.generate(PROMPTS[0], GenerationConfig(max_new_tokens=2, ignore_eos=True))
        new = listening([psutil.Process()] + [psutil.Process(pid) for pid in eng.executor.pids]) - before
        assert new and all(ip == '127.0.0.1' for _, ip, _ in new), new
    finally:
        eng.close()
