"""The engine: requests in, tokens out (docs/en/architecture.md).

Package map::

    engine.py          Engine: admission, the step loop (schedule -> execute -> update), stop checks
    engine_loop.py     the background thread that runs the steps for the pipeline and the server
    scheduler.py       Scheduler: which sequences run this step, chunk plans, prefix-cache admission
    model_runner.py    ModelRunner: the one flat-batch builder, the forward on every rank, sampling,
                       draft verification
    executor.py        LocalExecutor (tp=1, in process), MultiProcessExecutor (tp>1: rank 0 <->
                       worker processes), ExecutorCaches (every rank's caches, full-head payloads)
    rank.py            Worker: one rank's model (shard), cache engine and commands (tp=1 included)
    host_allocator.py  process-wide CPU allocator tuning
"""
