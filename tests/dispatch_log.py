"""What a call dispatches: the aten ops it runs and the native kernel calls it makes, for the
tests that a layer is one native call and reads no tensor value into Python."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmdeploy.pytorch.kernels import cpu_native


class OpLog(TorchDispatchMode):
    """Records every aten op dispatched while it is active, in order, in :attr:`ops`."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def one_native_call(fn: Callable[[], object], kernel: str) -> tuple[object, set]:
    """``fn()`` under ``torch.no_grad()``, checked to call the native ``kernel`` exactly once
    (``cpu_native.CALLS[kernel]``).

    Returns:
        ``(fn's result, the set of aten ops it dispatched)``.

    Raises:
        AssertionError: ``kernel`` was called another number of times.
    """
    before = cpu_native.CALLS[kernel]
    with torch.no_grad(), OpLog() as log:
        result = fn()
    assert cpu_native.CALLS[kernel] == before + 1, (kernel, cpu_native.CALLS[kernel] - before)
    return result, set(log.ops)
