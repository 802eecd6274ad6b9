"""The engine: requests in, tokens out (docs/en/architecture.md).

Package map::

    engine.py          Engine: admission, the step loop (schedule -> execute -> update), stop checks
    engine_loop.py     the background thread that runs the steps for the pipeline and the server
    scheduler.py       Scheduler: which sequences run this step, chunk plans, prefix-cache admission
    model_runner.py    ModelRunner (tp == 1): flat batch, forward, sampling, draft verification
    executor.py        TPExecutor (tp > 1: rank 0 <-> worker processes), TPCacheEngine, TPModelRunner
    rank.py            RankRuntime: one rank's model shard, cache engine and commands; StepBatch
    host_allocator.py  process-wide CPU allocator tuning
"""
