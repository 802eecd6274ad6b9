"""Tensor parallelism (``PytorchEngineConfig.tp``) building blocks: how a model splits.

Package map (docs/en/advance/parallelism.md)::

    comm.py       the process group; all-reduce / all-gather used by the sharded layers
    sharding.py   TPLayout: applies a model's ParallelPlan — the local config, the parallel
                  modules, which slice of each tensor, a cached tensor's rank ranges
    loading.py    a rank's shard read from safetensors slices (never the full tensor)

The workers that run on every rank and the executors that reach them live above, in the engine
(``engine/rank.py``: Worker, tp=1 included; ``engine/executor.py``: LocalExecutor,
MultiProcessExecutor, ExecutorCaches): this package knows models and kernels, never the engine,
the scheduler or the caches.
"""
