"""What a CUDA stream capture refuses, seen on the CPU: a forward that reads a tensor's data on
the host (``.tolist()``, ``.item()``, ``bool``/``int``/``float`` of a tensor, ``torch.equal``) or
runs an op whose output shape depends on the data (``bincount``, ``unique``, ``nonzero``, indexing
by a boolean mask). On a GPU each synchronises with the device, which a capture forbids.

Not the CPU decode graphs' refusal test (``decode_graph._refused_op``): that one also refuses a
tensor made from Python data (``lift_fresh``), which the CUDA graph cache's own step context does
on the host for its per-step lists (CPU tensors, no device copy: nothing a capture refuses)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default, _aten.item.default}
_METHODS = {'tolist', 'item', '__bool__', '__int__', '__float__', '__index__'}
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}


def _host_read(func, args) -> bool:
    if func in _READS:
        return True
    if func in _INDEXING:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return any(tag in func.tags for tag in (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output))


class _Methods(TorchFunctionMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, '__name__', '') in _METHODS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _host_read(func, args):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context manager collecting, in :attr:`seen`, every host read made inside it (method or op
    names, in order); nothing is refused, the code runs as usual."""

    def __init__(self):
        self.seen: list[str] = []
        self._modes = (_Methods(self.seen), _Ops(self.seen))

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
