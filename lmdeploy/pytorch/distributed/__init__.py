"""Tensor parallelism (``PytorchEngineConfig.tp``) building blocks: how a model splits.

Package map (docs/en/advance/parallelism.md)::

    comm.py       the process group; all-reduce / all-gather used by the sharded layers
    sharding.py   TPLayout: the local config, the parallel modules, which slice of each tensor
    loading.py    a rank's shard read from safetensors slices (never the full tensor)

The processes that run the shards live above, in the engine (``engine/executor.py``,
``engine/rank.py``): this package knows models and kernels, never the engine, the scheduler or
the caches. With ``tp == 1`` nothing here is imported.
"""
