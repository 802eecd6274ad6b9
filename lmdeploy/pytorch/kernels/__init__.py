"""Kernel registry: the one place where an op's implementation is chosen per device.

Each op has a plain-torch implementation that runs anywhere (CPU tests, CI) and may have
accelerated ones: Triton and ``fla-core`` registered for CUDA, the native C kernels
(:mod:`.cpu_native`, source in ``csrc/``) registered for CPU. Callers ask :func:`get_kernel` by
name and device; no caller branches on the backend, the device or a library's availability (a
CPU implementation falls back to torch by itself where its native kernel does not apply).

Ops (module): ``paged_attention``, ``paged_decode_attention`` (attention, attention_triton),
``paged_window_attention`` (window_attention: a sliding window and attention sinks; Triton on CUDA
in window_attention_triton), ``relative_bias_attention`` (CUDA only, window_attention_triton: Inkling's
attention, whose model falls back to its own torch path elsewhere),
``gated_delta_rule_varlen``, ``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``
(gated_delta_rule), ``kda_varlen``, ``chunk_kda``, ``recurrent_kda``, ``kda_decode_step``
(kimi_delta_attention; the native CPU step in cpu_native), ``causal_conv1d``, ``causal_conv1d_varlen`` (causal_conv1d),
``copy_state_slots`` (state_copy), ``ssd_chunk_scan``, ``ssd_step``, ``mamba2_ssd_varlen``,
``grouped_gated_rms_norm`` (mamba2; native ``ssd_step`` on CPU in mamba2_cpu, Triton
``ssd_step`` / ``ssd_chunk_scan`` on CUDA in mamba2_triton), ``selective_scan_chunk``,
``selective_scan_step``, ``selective_scan_varlen`` (mamba1: Mamba-1; native step on CPU in mamba1_cpu,
Triton step and scan on CUDA in mamba1_triton), ``lightning_attention_chunk``, ``lightning_attention_step``,
``lightning_attention_varlen`` (lightning_attention: MiniMax's decayed linear attention; Triton step and
scan on CUDA in lightning_attention_triton), ``swiglu_experts``, ``moe_experts``, ``relu2_experts``,
``limited_swiglu_experts`` (moe),
``rms_norm``, ``gated_rms_norm`` (norm), ``dsa_select``, ``dsa_attend`` (dsa_decode: GLM-5.3-Flash's DSA
decode step; native on CPU). ``linear`` (linear.py) is a plain function: it picks its product by
row count (MKL or the native few-row product) and is called directly.

The varlen recurrent-state ops (``gated_delta_rule_varlen``, ``kda_varlen``, ``mamba2_ssd_varlen``,
``selective_scan_varlen``, ``lightning_attention_varlen``) are one driver (state_varlen) over each op's step and chunk kernels.

Thread-safe: see the comment at the locks below.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from typing import Callable, TypeVar

import torch

from ..model_inputs import slot_range

__all__ = ['register_kernel', 'get_kernel', 'find_kernel', 'triton_available', 'triton_interpreted', 'static_loop_end', 'slot_range',
           'once']

T = TypeVar('T')

# Thread safety (two engines in one process, or the server's threads, may make their first
# forward at once): the registry and the choices change only under _REGISTRY_LOCK, held for a
# few dict operations and never while importing or calling user code, so a kernel module that
# registers while another thread imports the built-in modules cannot deadlock with it. The
# built-in modules are imported under _IMPORT_LOCK and marked imported only after every import
# returned (marking first let a second thread look up an empty registry: KeyError).
_REGISTRY_LOCK = threading.Lock()
_IMPORT_LOCK = threading.RLock()

# op name -> tuple of (priority, device type, availability check, fn), higher priority first;
# replaced (never mutated) by a registration, so a lookup iterates a consistent snapshot.
_REGISTRY: dict[str, tuple[tuple[int, str, Callable[[], bool], Callable], ...]] = {}
# (op name, device type) -> the implementation chosen; models ask several times per layer and step
_CHOSEN: dict[tuple[str, str], Callable] = {}
_GENERATION = 0          # registrations so far: a choice made against an older registry is not kept


def once(fn: Callable[[], T]) -> Callable[[], T]:
    """Memoise a function of no arguments, run at most once per process even when threads call
    it together (``functools.cache`` would run it in each of them): the lazy builders of the
    Triton kernels and the availability checks. An exception is not memoised (the next call
    tries again)."""
    lock = threading.Lock()
    done: list = []

    @functools.wraps(fn)
    def wrapper() -> T:
        if not done:
            with lock:
                if not done:
                    done.append(fn())
        return done[0]
    return wrapper


def register_kernel(name: str, device_type: str = 'any', priority: int = 0,
                    available: Callable[[], bool] = lambda: True) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as an implementation of op ``name`` (thread-safe).

    Args:
        name: op name, e.g. ``'paged_attention'``.
        device_type: ``'cuda'``, ``'cpu'`` or ``'any'`` (the torch fallback).
        priority: higher wins among implementations usable on a device; equal priorities keep
            the order of registration.
        available: called at the first selection for a device type (the choice is then kept
            until the next registration); False hides the implementation (e.g. an optional
            dependency is not installed).
    """
    def wrap(fn: Callable) -> Callable:
        global _GENERATION
        with _REGISTRY_LOCK:
            impls = _REGISTRY.get(name, ()) + ((priority, device_type, available, fn),)
            _REGISTRY[name] = tuple(sorted(impls, key=lambda item: -item[0]))
            _GENERATION += 1
            _CHOSEN.clear()
        return fn
    return wrap


def get_kernel(name: str, device: torch.device | str = 'cpu') -> Callable:
    """The best registered implementation of ``name`` for ``device``, chosen once per device
    type (models ask several times per layer and step) and chosen afresh after any
    :func:`register_kernel`. Thread-safe: the first call of a process imports the built-in
    kernel modules, and a concurrent first call waits until they are all imported.

    Raises:
        KeyError: no implementation of ``name`` is registered for the device.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    key = (name, device_type)
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        return chosen
    _import_builtin_kernels()
    with _REGISTRY_LOCK:
        impls, generation = _REGISTRY.get(name, ()), _GENERATION
    for _, dev, available, fn in impls:       # availability checks run outside the lock (they may import)
        if dev in (device_type, 'any') and available():
            with _REGISTRY_LOCK:
                if generation == _GENERATION:
                    _CHOSEN[key] = fn
            return fn
    raise KeyError(f'no kernel {name!r} for device {device_type!r}; registered: {sorted(_REGISTRY)}')


def find_kernel(name: str, device: torch.device | str = 'cpu') -> Callable | None:
    """:func:`get_kernel`, or ``None`` when no implementation of ``name`` serves the device (an
    op registered for one device type only, e.g. the fused CPU decode steps)."""
    try:
        return get_kernel(name, device)
    except KeyError:
        return None


@once
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


def triton_interpreted(kernel) -> bool:
    """Whether ``kernel`` (what ``triton.jit`` returned) runs in Triton's interpreter
    (``TRITON_INTERPRET=1``: Python on CPU tensors) rather than compiled for a GPU."""
    return type(kernel).__name__ == 'InterpretedFunction'


def static_loop_end(kernel, end: int) -> int:
    """The ``constexpr`` loop end a Triton kernel with a host-computed loop bound is launched with.

    Triton 3.6's interpreter holds every runtime scalar (a kernel's int argument, a loaded
    value) as a one-element array, and ``range()`` over one fails under NumPy 2 ("only
    0-dimensional arrays can be converted to Python scalars"); a ``constexpr`` is a plain int
    there. Such a kernel takes the bound twice, as a runtime int and as a ``constexpr``, and loops
    to the ``constexpr`` when it is ``>= 0``: interpreted, that is ``end`` (nothing is compiled,
    so a new value costs nothing); compiled, ``-1``, so the loop runs to the runtime bound, one
    compiled kernel serves every bound and the loop stays a ``for`` (software-pipelined).

    Args:
        kernel: what ``triton.jit`` returned.
        end: the loop bound (an int >= 0).

    Returns:
        ``end`` under the interpreter, else ``-1``.
    """
    return int(end) if triton_interpreted(kernel) else -1


_BUILTIN = ('attention', 'gated_delta_rule', 'kimi_delta_attention', 'mamba2', 'causal_conv1d', 'state_copy', 'moe',
            'norm', 'attention_triton', 'fp8', 'mamba2_cpu', 'mamba2_triton', 'window_attention',
            'window_attention_triton', 'mamba1', 'mamba1_cpu', 'mamba1_triton', 'lightning_attention',
            'lightning_attention_triton', 'fused_decode', 'fused_recurrent', 'dsa_decode')
_IMPORTED = False
_IMPORTING: int | None = None     # the thread importing them now


def _import_builtin_kernels() -> None:
    """Import the kernel modules so their ``register_kernel`` decorators run; once per process,
    every other thread waiting until all are imported."""
    global _IMPORTED, _IMPORTING
    if _IMPORTED:
        return
    with _IMPORT_LOCK:
        if _IMPORTED or _IMPORTING == threading.get_ident():   # done, or a lookup made by a module being imported
            return
        _IMPORTING = threading.get_ident()
        try:
            for mod in _BUILTIN:
                try:
                    importlib.import_module(f'{__name__}.{mod}')
                except ModuleNotFoundError as err:  # only a missing kernel module is skipped, not its imports
                    if err.name != f'{__name__}.{mod}':
                        raise
            _IMPORTED = True
        finally:
            _IMPORTING = None
