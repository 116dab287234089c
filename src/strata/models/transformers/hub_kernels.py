"""Undo the `kernels` package's Hub-kernel hooks in the modeling code of a model Strata builds.

With `kernels` installed (transformers >= 5.25 requires it), transformers' modeling modules are decorated
so that `kernels.kernelize` can swap in kernels from the Hub: a function such as `apply_rotary_pos_emb`
becomes an instance of a module class defined inside a function, and an attention class's forward routes
it through per-instance copies kept in `_kernel_funcs`. Strata chooses kernels through its own layer
registry and never calls `kernelize`, and torch.compile cannot save a trace that guards on an object of a
locally defined class. So Strata runs the code transformers runs when `kernels` is absent: the original
functions and forwards.

The undo is process-wide, like the decorators themselves: after it, `kernelize` cannot replace those
functions for other models of the same classes in this process either.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FunctionType
from typing import Any

from torch import nn

# Where the `kernels` package defines its wrappers (kernels >= 0.10); nothing else is touched.
_FUNC_MODULE_QUALNAME = "_create_func_module.<locals>.Func"
_KERNELIZED_FORWARD_QUALNAME = "use_kernelized_func.<locals>.decorator.<locals>.new_forward"


def _wrapped_function(value: Any) -> Callable[..., Any] | None:
    """The plain function behind a `use_kernel_forward_from_hub` function wrapper, or None for anything else."""
    if not (isinstance(value, nn.Module) and type(value).__qualname__.endswith(_FUNC_MODULE_QUALNAME)):
        return None
    forward = type(value).forward
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
    func = cells["func"].cell_contents if "func" in cells else None
    return func if isinstance(func, FunctionType) else None


def _unwrap_forward(cls: type) -> None:
    """Give `cls` (and its bases) back the forward that `use_kernelized_func` wrapped."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        # `functools.wraps` copied the original's names onto the wrapper; its code object keeps its own.
        code = getattr(forward, "__code__", None)
        if code is not None and code.co_qualname.endswith(_KERNELIZED_FORWARD_QUALNAME):
            klass.forward = forward.__wrapped__  # type: ignore[attr-defined]


def unwrap_hub_kernels(model: nn.Module) -> int:
    """Restore the original functions and forwards of `model`'s modeling code; returns how many it restored.

    Function wrappers are replaced in every module that defines one of `model`'s layer classes (a modeling
    module may import another's `apply_rotary_pos_emb`), and each layer's `_kernel_funcs` is dropped.
    """
    restored = 0
    module_names: set[str] = set()
    for layer in model.modules():
        if layer.__dict__.pop("_kernel_funcs", None) is not None:
            restored += 1
        _unwrap_forward(type(layer))
        module_names.update(klass.__module__ for klass in type(layer).__mro__)
    for name in module_names:
        namespace = vars(sys.modules[name]) if name in sys.modules else {}
        for attr, value in list(namespace.items()):
            if (function := _wrapped_function(value)) is not None:
                namespace[attr] = function
                restored += 1
    return restored
