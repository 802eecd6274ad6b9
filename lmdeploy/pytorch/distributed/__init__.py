"""Workers and executors (``PytorchEngineConfig.tp``): one engine, N ranks, one worker each.

Package map (docs/en/advance/parallelism.md)::

    rank.py       Worker: a rank's model (tp=1: the whole model), cache engine and commands; StepBatch
    executor.py   LocalExecutor (tp=1, in process), MultiProcessExecutor (rank 0 <-> worker
                  processes), ExecutorCaches (every rank's caches, full-head payloads), WorkerDiedError
    comm.py       the process group; all-reduce / all-gather used by the sharded layers
    sharding.py   TPLayout: the local config, the parallel modules, which slice of each tensor
    loading.py    a rank's shard read from safetensors slices (never the full tensor)

tp=1 is the degenerate case, not a second code path: the engine talks to the same executor
protocol and its rank 0 worker runs the same commands; only the process group and the
payload layout conversion are skipped.
"""
