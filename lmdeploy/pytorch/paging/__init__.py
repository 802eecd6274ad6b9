"""Sequences and their pages: per-request state, KV block allocation, prefill chunk plans.

Package map::

    sequence.py        Sequence: tokens, status, computed-token count, blocks and state slot
    block_manager.py   BlockManager: KV block ids, reference counts, free list
    prefill_plan.py    plan_prefill / ReuseRules: chunk ends and save points (pure integers)

Nothing here imports the prefix cache, the engine or torch models; the prefix cache builds on
the block manager and the reuse rules, the scheduler (``engine/scheduler.py``) on all of them.
"""
