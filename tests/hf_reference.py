"""The ``transformers`` reference runs its pure torch code, whatever kernel packages are installed.

``transformers`` wraps the recurrences of the hybrid families (Gated DeltaNet, Kimi Delta Attention,
the Mamba-2 SSD scan and state update, the causal conv) with
``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(func_name, package)``: when the
modeling module is imported, the decorator imports ``package`` (``fla``, ``mamba_ssm``,
``causal_conv1d``) and, when it is there, every later call goes to that package's Triton/CUDA kernel.
Some versions (5.17, the GPU machine's) do so even for CPU tensors, which fails ("Pointer argument
cannot be accessed from Triton (cpu tensor?)"); later ones route CPU inputs to torch, but would still
hand CUDA inputs to the package. ``USE_HUB_KERNELS=0`` does not help: it only turns off the
``kernels`` hub, not the package fallback.

:func:`use_torch_reference` makes the reference the torch implementation in every case:

- modeling modules imported *afterwards* get the torch function: the decorator factory is replaced
  by one that resolves a package name that never imports, so the wrapper keeps its shape (and the
  ``kernels`` hub's class decorators still accept it) but always calls the torch function;
- modeling modules imported *before* have their wrapped module globals rebound to the torch
  function (the wrapper is a ``functools.wraps`` function, or, when the ``kernels`` package is
  installed, an ``nn.Module`` instance around that function).

tests/conftest.py calls it once before any test imports a modeling module; ``engine_utils.load_hf``
calls it again (it is idempotent), for scripts that use the helpers outside pytest.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

# a package name that cannot be imported: the wrapper's "original package" is then absent
_NO_PACKAGE = '_lmdeploy_tests_torch_reference_only'
_FACTORY = 'use_kernel_func_from_hub_with_fallback'


def torch_function(obj: Any) -> Callable | None:
    """The torch function behind one ``use_kernel_func_from_hub_with_fallback`` wrapper.

    Args:
        obj: a module global of a ``transformers`` modeling module.

    Returns:
        The undecorated torch function when ``obj`` is such a wrapper (a function defined in
        ``transformers/integrations/hub_kernels.py`` with ``__wrapped__``, or the ``kernels``
        package's ``nn.Module`` around one), else ``None``.
    """
    fn = obj
    if not inspect.isfunction(fn) and hasattr(type(fn), 'kernel_layer_name'):
        # kernels.use_kernel_forward_from_hub turned the wrapper into a module instance whose
        # forward closes over it as ``func``
        forward = getattr(type(fn), 'forward', None)
        fn = inspect.getclosurevars(forward).nonlocals.get('func') if inspect.isfunction(forward) else None
    if not inspect.isfunction(fn) or not hasattr(fn, '__wrapped__'):
        return None
    if not fn.__code__.co_filename.replace('\\', '/').endswith('integrations/hub_kernels.py'):
        return None
    inner = fn.__wrapped__
    return inner if inspect.isfunction(inner) else None


def _torch_only_factory(original: Callable) -> Callable:
    @functools.wraps(original)
    def factory(func_name: str, package: str, internal_path: str | None = None):
        # the real factory, told to fall back to a package that never imports: torch is called
        return original(func_name, _NO_PACKAGE, internal_path)

    factory._lmdeploy_torch_reference = True
    return factory


def use_torch_reference() -> int:
    """Make every ``transformers`` kernel-fallback function run its torch implementation.

    Idempotent; cheap (a scan of the already imported ``transformers.models.*`` modules).
    A no-op when ``transformers`` has no ``integrations.hub_kernels`` or no such decorator.

    Returns:
        How many module globals were rebound to their torch function (0 once they all are).
    """
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return 0
    import transformers.integrations as integrations
    original = getattr(hub_kernels, _FACTORY, None)
    if original is not None and not getattr(original, '_lmdeploy_torch_reference', False):
        patched = _torch_only_factory(original)
        setattr(hub_kernels, _FACTORY, patched)
        setattr(integrations, _FACTORY, patched)   # the lazy package the modeling modules import from
    rebound = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith('transformers.models.') or module is None:
            continue
        for attr, value in list(vars(module).items()):
            fn = torch_function(value)
            if fn is not None:
                setattr(module, attr, fn)
                rebound += 1
    return rebound
