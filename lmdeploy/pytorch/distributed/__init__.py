"""Tensor parallelism (``PytorchEngineConfig.tp``): one engine, N processes, one shard each.

Package map (docs/en/advance/parallelism.md)::

    comm.py       the process group; all-reduce / all-gather used by the sharded layers
    sharding.py   TPLayout: the local config, the parallel modules, which slice of each tensor
    loading.py    a rank's shard read from safetensors slices (never the full tensor)
    rank.py       RankRuntime: a rank's model shard, cache engine and commands; StepBatch
    executor.py   TPExecutor (rank 0 ↔ workers), TPCacheEngine, TPModelRunner, WorkerDiedError

With ``tp == 1`` nothing here is imported: the engine runs in one process as before.
"""
