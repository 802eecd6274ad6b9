"""Kernel registry: the one place where an op's implementation is chosen per device.

Each op has a plain-torch implementation that runs anywhere (CPU tests, CI) and may have
accelerated ones (Triton, ``fla-core``) registered for CUDA. Callers ask
:func:`get_kernel` by name and device; no caller branches on the backend.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch

__all__ = ['register_kernel', 'get_kernel', 'triton_available', 'slot_range']

# op name -> list of (priority, device type, availability check, fn); higher priority first.
_REGISTRY: dict[str, list[tuple[int, str, Callable[[], bool], Callable]]] = {}


def register_kernel(name: str, device_type: str = 'any', priority: int = 0,
                    available: Callable[[], bool] = lambda: True) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as an implementation of op ``name``.

    Args:
        name: op name, e.g. ``'paged_attention'``.
        device_type: ``'cuda'``, ``'cpu'`` or ``'any'`` (the torch fallback).
        priority: higher wins among implementations usable on a device.
        available: called at the first selection for a device type (the choice is then kept
            until the next registration); False hides the implementation (e.g. an optional
            dependency is not installed).
    """
    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault(name, []).append((priority, device_type, available, fn))
        _REGISTRY[name].sort(key=lambda item: -item[0])
        _CHOSEN.clear()
        return fn
    return wrap


# (op name, device type) -> the implementation chosen; models ask several times per layer and step
_CHOSEN: dict[tuple[str, str], Callable] = {}


def get_kernel(name: str, device: torch.device | str = 'cpu') -> Callable:
    """The best registered implementation of ``name`` for ``device``, chosen once per device
    type (models ask several times per layer and step) and chosen afresh after any
    :func:`register_kernel`.

    Raises:
        KeyError: no implementation of ``name`` is registered for the device.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    chosen = _CHOSEN.get((name, device_type))
    if chosen is not None:
        return chosen
    _import_builtin_kernels()
    for _, dev, available, fn in _REGISTRY.get(name, []):
        if dev in (device_type, 'any') and available():
            _CHOSEN[(name, device_type)] = fn
            return fn
    raise KeyError(f'no kernel {name!r} for device {device_type!r}; registered: {sorted(_REGISTRY)}')


def slot_range(slots: torch.Tensor, has_history: torch.Tensor) -> tuple[int, torch.Tensor | None] | None:
    """Whether a decode step's state slots can be updated in place as one slice of the cache.

    Args:
        slots: int64 ``[N]`` distinct state slots of the step's sequences.
        has_history: bool ``[N]``.

    Returns:
        ``(lo, order)`` when ``slots`` are exactly ``lo .. lo + N - 1`` in some order and every
        sequence has history (``order`` the permutation sorting them, ``None`` when already
        sorted); otherwise ``None``. Always ``None`` for device tensors (reading them would
        synchronise).
    """
    if slots.device.type != 'cpu' or not bool(has_history.all()):
        return None
    ids = slots.tolist()
    if not ids:
        return None
    lo = min(ids)
    if ids == list(range(lo, lo + len(ids))):
        return lo, None
    if sorted(ids) == list(range(lo, lo + len(ids))):
        return lo, torch.argsort(slots)
    return None


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports here (the availability check of Triton implementations)."""
    if importlib.util.find_spec('triton') is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


_IMPORTED = False


def _import_builtin_kernels() -> None:
    """Import the kernel modules so their ``register_kernel`` decorators run."""
    global _IMPORTED
    if _IMPORTED:
        return
    _IMPORTED = True
    import importlib
    for mod in ('attention', 'gated_delta_rule', 'kimi_delta_attention', 'causal_conv1d', 'state_copy', 'moe',
                'attention_triton', 'fp8'):
        try:
            importlib.import_module(f'{__name__}.{mod}')
        except ModuleNotFoundError as err:  # only a missing kernel module is skipped, not its imports
            if err.name != f'{__name__}.{mod}':
                raise
