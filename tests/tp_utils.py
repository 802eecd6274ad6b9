"""The TP test geometry (B = 16, A = 64, P = 48), TP2-vs-TP1 logit tolerance, shared prompts, the
engine factory, the safetensors read recorder and the cross-TP Store restore check used by
tests/test_tensor_parallel.py and tests/test_tensor_parallel_mtp_vision.py.
"""
from __future__ import annotations

from engine_utils import make_engine, random_prompt
from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


B, A, P = 16, 64, 48
# fp32: TP only reorders sums (row-parallel layers, all-reduces, and inside the native CPU kernels,
# which see other widths per rank). Observed max |logit diff| TP2 vs TP1 on the tiny models (logits
# up to ~10): torch kernels 2.5e-6 / 7.0e-6 / 8.8e-6 (qwen3 / qwen3_next / qwen3_5), native kernels
# 2.4e-6 / 9.3e-6 / 1.35e-5 (the native RMS norm's sum of squares rounds differently).
TP_TOL = 2e-5
SHARED = random_prompt(70, 100)
PROMPTS = [SHARED + random_prompt(30, 1), random_prompt(90, 2), SHARED + random_prompt(12, 3)]


def engine(path: str, **fields) -> Engine:
    fields = dict(dict(block_size=B, prefill_save_alignment=A, max_prefill_token_num=P, num_gpu_blocks=64,
                       max_batch_size=4, session_len=1024), **fields)
    return make_engine(path, **fields)


def record_safetensors_reads(monkeypatch) -> list[tuple[str, str]]:
    """Make shard loading record every tensor it reads: ``(name, 'slice' | 'whole')`` in order."""
    import safetensors
    reads: list[tuple[str, str]] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            reads.append((name, 'slice'))
            return self.f.get_slice(name)

        def get_tensor(self, name):
            reads.append((name, 'whole'))
            return self.f.get_tensor(name)
    monkeypatch.setattr('lmdeploy.pytorch.models.checkpoint_files.safe_open', Recording)
    return reads


def assert_reader_restores(path: str, cfg: dict, tp: int, ids: list[int], gen, expected: list[int]) -> None:
    """A fresh engine of size ``tp`` on the Store of ``cfg`` restores the 128-token prefix of
    ``ids`` and decodes ``expected``; it ends idle."""
    reader = Engine(path, PytorchEngineConfig(**cfg, tp=tp))
    try:
        again = reader.generate(ids, gen)
        assert again.num_cached_tokens == 128 and again.stats.store_hit_tokens == 128
        assert again.output_ids == expected
        assert reader.store.flush(timeout=30) and reader.is_idle()
    finally:
        reader.close()


def check_store_across_tp_sizes(path: str, services, writer_tp: int, reader_tp: int, seed: int,
                                kv_replicated: bool) -> None:
    """A last-only writer of size ``writer_tp`` saves a 150-token prompt (save point 128) to the
    Store; its put bytes equal ``simulate()`` fed the S and K_blk that ``sizes_from_config``
    computes for TP2 from config.json: S is the sum of the ranks' state, K_blk one rank's blocks
    when ``kv_replicated`` (an MLA latent / indexer keys held whole by every rank, stored and
    charged once), else the sum of the ranks'. A reader of size ``reader_tp`` then restores the
    prefix and decodes what a TP1 engine with caching off decodes."""
    import json
    import os

    from lmdeploy import GenerationConfig
    from test_store_engine import sim, store_config
    gen = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    ids = random_prompt(150, seed)               # a prompt new to the shared Store
    cold = engine(path)
    expected = cold.generate(ids, gen).output_ids
    cold.close()
    cfg = store_config(services, prefill_save_last_only=True, num_gpu_blocks=64)
    writer = Engine(path, PytorchEngineConfig(**cfg, tp=writer_tp))
    try:
        seq = writer.generate(ids, gen)
        assert seq.output_ids == expected and seq.stats.save_points == [128]
        assert writer.store.flush(timeout=30)
        with open(os.path.join(path, 'config.json')) as f:
            sizes = sim.sizes_from_config(json.load(f), tp=2, block_size=B)
        S, K = sizes.charged
        assert (S, K) == (writer.cache_engine.state_bytes, writer.cache_engine.kv_block_bytes)
        assert (S, K) == (2 * sizes.state_bytes, (1 if kv_replicated else 2) * sizes.kv_block_bytes)
        plan = sim.simulate([150], S, K, chunk_size=P, block_size=B, alignment=A)
        assert writer.stats()['store_put_bytes'] == {'state': S, 'kv': 8 * K}
        assert sum(writer.stats()['store_put_bytes'].values()) == plan.last_only.total_bytes
    finally:
        writer.close()
    assert_reader_restores(path, cfg, reader_tp, ids, gen, expected)
