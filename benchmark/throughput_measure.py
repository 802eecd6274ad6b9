"""Measurement tools of ``benchmark/benchmark_throughput.py`` (which re-exports every name here):
wall and CPU time with the peak resident-set growth of one run (:func:`measure`,
:class:`PeakRSS`), min/median/max over repeats, torch dispatcher call counts, and the llama.cpp
baseline (:class:`LlamaCpp`, ``llama-batched-bench`` on the same weights as GGUF).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import threading
import time


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (Linux), or None."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(field + ':'):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (``VmHWM``) to the current RSS: Linux's
    ``/proc/self/clear_refs`` value 5. False where that is unavailable."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    except OSError:
        return False
    return _status_kb('VmHWM') is not None


class PeakRSS:
    """Peak RSS between ``__enter__`` and ``__exit__``: the kernel's own high-water mark, reset on
    entry, where Linux offers it (exact, and no thread competing with the measured run for the
    cores); otherwise a thread sampling RSS every 2 ms."""

    def __enter__(self):
        self._kernel = _reset_peak_rss()
        if self._kernel:
            self.base = self.peak = _status_kb('VmRSS') * 1024
            return self
        import psutil
        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        if self._kernel:
            self.peak = max(self.base, _status_kb('VmHWM') * 1024)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def measure(fn, tokens: int) -> dict:
    """Run ``fn`` once; wall and CPU seconds, tokens/s, tokens per CPU-s, peak RSS growth."""
    with PeakRSS() as mem:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = fn()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return dict(wall_s=wall, cpu_s=cpu, tok_s=tokens / wall, tok_per_cpu_s=tokens / cpu, peak_mb=mem.growth_mb,
                result=result)


def summarize(runs: list[dict]) -> dict:
    """min / median / max of each measurement over the runs (None where a system does not
    report it: llama.cpp's CPU time and memory)."""
    out = {}
    for key in ('wall_s', 'tok_s', 'tok_per_cpu_s', 'peak_mb'):
        values = [r[key] for r in runs]
        out[key] = None if None in values else dict(min=min(values), median=statistics.median(values),
                                                    max=max(values))
    return out


def count_ops(fn) -> int:
    """Torch dispatcher calls made by ``fn()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


class LlamaCpp:
    """llama.cpp's ``llama-batched-bench`` on the same weights (GGUF), run once per measurement.

    Args:
        binary: path of ``llama-batched-bench``, or None to look it up on ``PATH``.
        gguf: the GGUF file, or None.
        threads: ``-t`` and ``-tb`` (generation and batch threads).

    ``available`` is False (and ``note`` says why) when either is missing; after a failed run it
    turns False too, so one failure does not repeat at every measurement.

    A run that exits 0 without printing its record is made again, up to
    :attr:`EMPTY_RUN_ATTEMPTS` runs in all: the build used for the README's runs (its jsonl line
    goes through llama.cpp's asynchronous logger) printed nothing in about 1 run of 6 on the
    2-core AVX2 host.
    """

    EMPTY_RUN_ATTEMPTS = 3

    def __init__(self, binary: str | None, gguf: str | None, threads: int):
        self.binary = binary or shutil.which('llama-batched-bench')
        self.gguf, self.threads = gguf, threads
        self.note = None
        if not self.binary:
            self.note = 'llama-batched-bench not on PATH and --llama-batched-bench not given'
        elif not os.path.isfile(self.binary):
            self.note = f'--llama-batched-bench {self.binary}: no such file'
        elif not gguf:
            self.note = '--gguf not given'
        elif not os.path.isfile(gguf):
            self.note = f'--gguf {gguf}: no such file'

    @property
    def available(self) -> bool:
        return self.note is None

    def info(self) -> dict:
        return {'skipped': self.note} if self.note else {'binary': self.binary, 'gguf': self.gguf,
                                                          'threads': self.threads}

    def _run(self, batch: int, prompt_len: int, new_tokens: int) -> dict | None:
        """One jsonl record of ``llama-batched-bench`` (seconds ``t_pp``, ``t_tg``, ``t``), or None
        after a failure (recorded in ``note``)."""
        ctx = batch * (prompt_len + new_tokens) + 16
        cmd = [self.binary, '-m', self.gguf, '-t', str(self.threads), '-tb', str(self.threads), '-c', str(ctx),
               '-b', '2048', '-ub', '512', '-npp', str(prompt_len), '-ntg', str(new_tokens), '-npl', str(batch),
               '--output-format', 'jsonl']
        try:
            for _ in range(self.EMPTY_RUN_ATTEMPTS):
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
                records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{')]
                if records:
                    break
            else:
                raise ValueError(f'no jsonl record in {self.EMPTY_RUN_ATTEMPTS} runs that exited 0')
            record = records[-1]
            if not all(math.isfinite(record[k]) and record[k] > 0 for k in ('t_pp', 't')):
                raise ValueError(f'unexpected timings {record}')
        except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as err:
            tail = getattr(err, 'stderr', None) or ''
            self.note = f'llama-batched-bench failed: {err} {tail[-300:]}'.strip()
            return None
        return record

    def decode(self, batch: int, prompt_len: int, new_tokens: int) -> dict | None:
        """``batch`` prompts of ``prompt_len`` tokens and ``new_tokens`` new tokens each, counted as
        :func:`measure` counts the engine's (the first comes from the prefill, so llama.cpp runs
        ``new_tokens - 1`` decode steps), with its two parts: ``prefill_s`` (``t_pp``, the prompts'
        forward) and ``decode_s`` (``t_tg``, the decode steps). None when unavailable or
        ``new_tokens < 2``."""
        record = self._run(batch, prompt_len, new_tokens - 1) if self.available and new_tokens >= 2 else None
        if record is None:
            return None
        return dict(wall_s=record['t'], cpu_s=None, tok_s=batch * new_tokens / record['t'], tok_per_cpu_s=None,
                    peak_mb=None, prefill_s=record['t_pp'], decode_s=record.get('t_tg'))

    def prefill(self, length: int) -> dict | None:
        """Prompt processing of one ``length``-token prompt: tokens/s over its seconds."""
        record = self._run(1, length, 1) if self.available else None
        if record is None:
            return None
        return dict(wall_s=record['t_pp'], cpu_s=None, tok_s=length / record['t_pp'], tok_per_cpu_s=None,
                    peak_mb=None)
