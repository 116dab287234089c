"""One registry for layer implementations: in-tree ones (default and hw-agnostic) and out-of-tree overrides.

Entries are keyed by the registered class name ("RMSNorm"). The default and the hw-agnostic `RMSNorm`
share that entry, so an override registered for "RMSNorm" (by a plugin, before or after Strata's layers
are imported) replaces whichever of the two the resolver picked: constructing a registered class returns
an instance of its override, with the same arguments.

`CustomOp` is one operation and picks its forward method once, at construction, from the current platform
and the `custom_ops` setting of the layer config being built. `PluggableLayer` is a composite module that is
only swapped, never dispatched.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from strata import platforms
from strata.config import get_current_layer_config

logger = logging.getLogger("strata.custom_op")

T = TypeVar("T", bound=type)

_HW_AGNOSTIC_PREFIX = "strata.hw_agnostic."


class RegistrationError(ValueError):
    """A layer class was registered twice under one name, or not as a class."""


@dataclass
class RegistryEntry:
    """Everything registered under one class name: the op name, in-tree classes per provider, the override."""

    op_name: str | None = None
    in_tree: dict[str, type] = field(default_factory=dict)
    oot: type | None = None
    oot_source: str = ""


op_registry: dict[str, RegistryEntry] = {}

# The plugin whose `register()` is running, so its overrides are reported as `oot:<plugin>`.
_registering_plugin: ContextVar[str | None] = ContextVar("strata_registering_plugin", default=None)


@contextmanager
def registering_plugin(name: str) -> Iterator[None]:
    token = _registering_plugin.set(name)
    try:
        yield
    finally:
        _registering_plugin.reset(token)


def _provider_of_module(module_name: str) -> str:
    return "hw-agnostic" if module_name.startswith(_HW_AGNOSTIC_PREFIX) else "default"


def _register_in_tree(op_cls: type, op_name: str) -> None:
    entry = op_registry.setdefault(op_cls.__name__, RegistryEntry())
    for other_name, other in op_registry.items():
        if other is not entry and other.op_name == op_name:
            raise RegistrationError(
                f"op name {op_name!r} of {op_cls.__module__}.{op_cls.__qualname__} is already used by {other_name}"
            )
    if entry.op_name is not None and entry.op_name != op_name:
        raise RegistrationError(
            f"{op_cls.__qualname__} is registered as op {op_name!r}, but the other {op_cls.__name__} classes "
            f"use {entry.op_name!r}"
        )
    provider = _provider_of_module(op_cls.__module__)
    previous = entry.in_tree.get(provider)
    if previous is not None and previous is not op_cls:
        raise RegistrationError(
            f"{op_name!r} ({provider}) is registered twice: {previous.__module__}.{previous.__qualname__} "
            f"and {op_cls.__module__}.{op_cls.__qualname__}"
        )
    entry.op_name = op_name
    entry.in_tree[provider] = op_cls
    if entry.oot is not None and getattr(entry.oot, "op_name", None) is None:
        entry.oot.op_name = op_name  # type: ignore[attr-defined]
    op_cls.op_name = op_name  # type: ignore[attr-defined]
    op_cls.provider = provider  # type: ignore[attr-defined]


def _register_oot(op_cls: type, name: str) -> None:
    entry = op_registry.setdefault(name, RegistryEntry())
    if entry.oot is not None and entry.oot is not op_cls:
        raise RegistrationError(
            f"out-of-tree override for {name!r} is registered twice: "
            f"{entry.oot.__module__}.{entry.oot.__qualname__} and {op_cls.__module__}.{op_cls.__qualname__}"
        )
    entry.oot = op_cls
    entry.oot_source = _registering_plugin.get() or f"{op_cls.__module__}.{op_cls.__qualname__}"
    op_cls.provider = f"oot:{entry.oot_source}"  # type: ignore[attr-defined]
    if entry.op_name is not None and getattr(op_cls, "op_name", None) is None:
        op_cls.op_name = entry.op_name  # type: ignore[attr-defined]
    op_cls.is_oot = True  # type: ignore[attr-defined]


def unregister_oot(name: str) -> None:
    """Remove the override for `name` (tests use this to keep overrides from leaking into later models)."""
    entry = op_registry.get(name)
    if entry is not None:
        entry.oot = None
        entry.oot_source = ""


def maybe_get_oot_by_class(cls: type) -> type:
    """The out-of-tree override registered under `cls`'s name, or `cls` itself."""
    entry = op_registry.get(cls.__name__)
    return entry.oot if entry is not None and entry.oot is not None else cls


def in_tree_class(op_name: str, provider: str) -> type | None:
    """The in-tree class of `provider` ("default" or "hw-agnostic") registered as `op_name`, if any."""
    for entry in op_registry.values():
        if entry.op_name == op_name:
            return entry.in_tree.get(provider)
    return None


def construct_in_tree(cls: type[nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Build `cls` itself, skipping any override (the reference of `strata layers --verify`)."""
    module = nn.Module.__new__(cls)
    module.__init__(*args, **kwargs)  # type: ignore[misc]
    return module


class _Swappable(nn.Module):
    """Shared by CustomOp and PluggableLayer: construction returns the registered override, if any."""

    op_name: str
    provider: str = "default"
    is_oot: bool = False
    init_args: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        target = maybe_get_oot_by_class(cls)
        if target is not cls:
            logger.debug("constructing %s as its override %s", cls.__name__, target.__qualname__)
        module = super().__new__(target)
        object.__setattr__(module, "init_args", (args, kwargs))
        if not isinstance(module, cls):
            # Python only runs __init__ itself when __new__ returns an instance of cls.
            module.__init__(*args, **kwargs)
        return module

    def process_weights_after_loading(self) -> None:
        """Called once by the loader after every weight is in place, before the first forward. A layer that
        wants its weights in another form (a kernel's packed layout, a derived scale) builds it here, so the
        forward never does that work. The default has nothing to do."""

    @classmethod
    def register(cls, name: str) -> Callable[[T], T]:
        """`@CustomOp.register("rms_norm")`: register an in-tree implementation as op `name`."""

        def decorator(op_cls: T) -> T:
            if not (isinstance(op_cls, type) and issubclass(op_cls, cls)):
                raise RegistrationError(f"@{cls.__name__}.register({name!r}) needs a {cls.__name__} subclass")
            _register_in_tree(op_cls, name)
            return op_cls

        return decorator

    @classmethod
    def register_oot(cls, _op_cls: T | None = None, *, name: str | None = None) -> Any:
        """Register an out-of-tree override of `name` (default: the class this is called on).

        `@RMSNorm.register_oot`, `@RMSNorm.register_oot()`, `@CustomOp.register_oot(name="RMSNorm")`
        and `CustomOp.register_oot(MyNorm, name="RMSNorm")` all work.
        """

        def decorator(op_cls: T) -> T:
            if not isinstance(op_cls, type):
                raise RegistrationError(f"register_oot needs a class, got {type(op_cls).__name__}")
            target_name = name if name is not None else cls.__name__
            if target_name in ("CustomOp", "PluggableLayer"):
                raise RegistrationError(
                    "register_oot on the base class needs name=: the in-tree class name to override"
                )
            _register_oot(op_cls, target_name)
            return op_cls

        if _op_cls is None:
            return decorator
        return decorator(_op_cls)


class CustomOp(_Swappable):
    """One operation with a pure-PyTorch `forward_native` and optional per-platform fast paths."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_method_name = self._choose_forward_method()
        self._forward_method: Callable[..., Any] = getattr(self, self.forward_method_name)

    def _choose_forward_method(self) -> str:
        layer_config = get_current_layer_config()
        op_name = getattr(self, "op_name", None)
        if op_name is None or not layer_config.op_enabled(op_name):
            return "forward_native"
        method = "forward_oot" if self.is_oot else platforms.current_platform.forward_method
        # A class without its own fast path runs forward_native; report that, not the delegating stub.
        overridden = getattr(type(self), method, None) is not getattr(CustomOp, method, None)
        return method if overridden else "forward_native"

    def extra_repr(self) -> str:
        return f"forward={self.forward_method_name}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward_native")

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        """Random argument tuples covering this op's call forms (`strata layers --verify` feeds them)."""
        raise NotImplementedError(f"{type(self).__name__} has no example_inputs")


class PluggableLayer(_Swappable):
    """A composite layer (built from CustomOps and Linears) that can be swapped as a whole."""

    forward_method_name = "forward"


def describe_layers(model: nn.Module) -> list[dict[str, str]]:
    """Every registered layer inside `model`: path, op name, provider, class and the forward in use."""
    rows = []
    for path, module in model.named_modules():
        if isinstance(module, _Swappable):
            cls = type(module)
            rows.append(
                {
                    "module": path,
                    "op": getattr(module, "op_name", cls.__name__),
                    "provider": module.provider,
                    "class": f"{cls.__module__}.{cls.__qualname__}",
                    "forward": module.forward_method_name,
                }
            )
    return rows


def summarize_layers(rows: list[dict[str, str]]) -> str:
    """One line of totals for `describe_layers` rows: how many, by provider and by op."""

    def counts(key: str) -> str:
        return (
            ", ".join(f"{name} {n}" for name, n in sorted(Counter(row[key] for row in rows).items()))
            or "none"
        )

    return f"{len(rows)} replaced; by provider: {counts('provider')}; by op: {counts('op')}"
