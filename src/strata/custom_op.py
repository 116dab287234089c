"""One registry of layer implementations, and the base classes of registered layers.

An op ("rms_norm") is defined once, by the class registered with `@CustomOp.register("rms_norm")`: its
parameters, its constructor and its `forward_native`, the pure-PyTorch reference that runs on every device.
Those classes live in `strata.hw_agnostic.layers`. Everything else that computes the op subclasses it:

- a platform's implementation defines `forward_<platform>` (`forward_cpu`) and registers with
  `register_implementation("cpu")`; a platform may register several per op, in order of preference, each
  saying through `supports(...)` which layers it can serve;
- a plugin's override registers with `register_oot` under the op class's name ("RMSNorm") and replaces
  the op on every platform; its `forward_oot` runs where it defines one.

Which class and which forward method a layer gets is decided once per layer, in one place: the resolver
(`strata.models.transformers.layers.LayerResolver`). Constructing a class directly gives that class,
running its `forward_native`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

logger = logging.getLogger("strata.custom_op")

T = TypeVar("T", bound=type)
M = TypeVar("M", bound="RegisteredLayer")

HW_AGNOSTIC = "hw-agnostic"


class RegistrationError(ValueError):
    """A layer class was registered twice, under a name already taken, or not as the right kind of class."""


@dataclass
class OpEntry:
    """Everything registered for one op: its reference class and each platform's implementations."""

    op_name: str
    reference: type[RegisteredLayer]
    implementations: dict[str, list[type[RegisteredLayer]]] = field(default_factory=dict)

    @property
    def oot(self) -> type[RegisteredLayer] | None:
        """The plugin override registered under the reference class's name, if any."""
        return oot_registry.get(self.reference.__name__)


# op name -> its entry
op_registry: dict[str, OpEntry] = {}
# reference class name ("RMSNorm") -> the plugin override; may be registered before the op itself.
oot_registry: dict[str, type[RegisteredLayer]] = {}

# The plugin whose `register()` is running, so its overrides are reported as `oot:<plugin>`.
_registering_plugin: ContextVar[str | None] = ContextVar("strata_registering_plugin", default=None)


@contextmanager
def registering_plugin(name: str) -> Iterator[None]:
    token = _registering_plugin.set(name)
    try:
        yield
    finally:
        _registering_plugin.reset(token)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _register_op(op_cls: type[RegisteredLayer], op_name: str) -> None:
    entry = op_registry.get(op_name)
    if entry is not None and entry.reference is not op_cls:
        raise RegistrationError(
            f"op {op_name!r} is registered twice: {_path(entry.reference)} and {_path(op_cls)}"
        )
    for other in op_registry.values():
        if other.op_name != op_name and other.reference.__name__ == op_cls.__name__:
            raise RegistrationError(
                f"class name {op_cls.__name__} of op {op_name!r} is already the name of op {other.op_name!r} "
                "(plugins override ops by class name)"
            )
    op_cls.op_name = op_name
    op_cls.provider = HW_AGNOSTIC
    op_registry[op_name] = OpEntry(op_name, op_cls)


def _entry_of(cls: type) -> OpEntry:
    """The entry of the op `cls` implements: the registered class among its bases."""
    for base in cls.__mro__:
        entry = op_registry.get(getattr(base, "op_name", ""))
        if entry is not None and entry.reference is base:
            return entry
    raise RegistrationError(f"{_path(cls)} subclasses no registered op class")


def register_implementation(platform: str) -> Callable[[T], T]:
    """`@register_implementation("cpu")` on a subclass of an op's registered class: the platform's
    implementation of that op, preferred over those registered for it after this one."""

    def decorator(impl_cls: T) -> T:
        if not (isinstance(impl_cls, type) and issubclass(impl_cls, RegisteredLayer)):
            raise RegistrationError(f"register_implementation({platform!r}) needs a CustomOp subclass")
        entry = _entry_of(impl_cls)
        classes = entry.implementations.setdefault(platform, [])
        if impl_cls not in classes:
            classes.append(impl_cls)
        impl_cls.provider = platform
        return impl_cls

    return decorator


def register_oot(op_cls: T, name: str) -> T:
    """Register `op_cls` as the plugin override of the op whose class is named `name` ("RMSNorm")."""
    if not (isinstance(op_cls, type) and issubclass(op_cls, RegisteredLayer)):
        raise RegistrationError(f"register_oot needs a CustomOp or PluggableLayer class, got {op_cls!r}")
    previous = oot_registry.get(name)
    if previous is not None and previous is not op_cls:
        raise RegistrationError(
            f"out-of-tree override for {name!r} is registered twice: {_path(previous)} and {_path(op_cls)}"
        )
    oot_registry[name] = op_cls
    op_cls.provider = f"oot:{_registering_plugin.get() or _path(op_cls)}"
    return op_cls


def unregister_oot(name: str) -> None:
    """Remove the override for `name` (tests use this to keep overrides from leaking into later models)."""
    oot_registry.pop(name, None)


def construct(cls: type[M], *args: Any, **kwargs: Any) -> M:
    """`cls(*args, **kwargs)`, remembering the arguments (`init_args`), so a reference of the same layer can
    be built later (`strata layers --verify`)."""
    module = cls(*args, **kwargs)
    module.init_args = (args, kwargs)
    return module


class RegisteredLayer(nn.Module):
    """What every registered layer has: its op, who provides it, the forward it runs, and the hooks the
    loader, the resolver and `strata layers --verify` call."""

    op_name: ClassVar[str]
    provider: ClassVar[str] = HW_AGNOSTIC
    init_args: tuple[tuple[Any, ...], dict[str, Any]]

    def __init__(self) -> None:
        super().__init__()
        self.use_forward("forward_native")

    def use_forward(self, method: str) -> None:
        """Run `method` as this layer's forward (the resolver's choice)."""
        self.forward_method_name = method
        self._forward_method: Callable[..., Any] = getattr(self, method)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward_native")

    @classmethod
    def supports(cls, *args: Any, **kwargs: Any) -> str | None:
        """Why this implementation cannot serve a layer built with these arguments, or None when it can.
        The resolver asks before it picks a platform's implementation; the reference serves every layer."""
        return None

    def process_weights_after_loading(self) -> None:
        """Called once by the loader after every weight is in place, before the first forward. A layer that
        wants its weights in another form (a kernel's packed layout, a derived scale) builds it here, so the
        forward never does that work. The default has nothing to do."""

    def forward_detail(self) -> str | None:
        """What the forward runs beyond its method's name, where loading decided it (a fused kernel)."""
        return None

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        """Random argument tuples covering this op's call forms (`strata layers --verify` feeds them)."""
        raise NotImplementedError(f"{type(self).__name__} has no example_inputs")

    def extra_repr(self) -> str:
        return f"forward={self.forward_method_name}"

    @classmethod
    def register(cls, name: str) -> Callable[[T], T]:
        """`@CustomOp.register("rms_norm")`: define op `name` by this class (its `forward_native` is the
        reference)."""

        def decorator(op_cls: T) -> T:
            if not (isinstance(op_cls, type) and issubclass(op_cls, cls)):
                raise RegistrationError(f"@{cls.__name__}.register({name!r}) needs a {cls.__name__} subclass")
            _register_op(op_cls, name)
            return op_cls

        return decorator

    @classmethod
    def register_oot(cls, _op_cls: T | None = None, *, name: str | None = None) -> Any:
        """Register a plugin override of op class `name` (default: the class this is called on).

        `@RMSNorm.register_oot`, `@RMSNorm.register_oot()`, `@CustomOp.register_oot(name="RMSNorm")`
        and `CustomOp.register_oot(MyNorm, name="RMSNorm")` all work.
        """

        def decorator(op_cls: T) -> T:
            target = name if name is not None else cls.__name__
            if target in ("CustomOp", "PluggableLayer", "RegisteredLayer"):
                raise RegistrationError(
                    "register_oot on the base class needs name=: the registered class name to override"
                )
            return register_oot(op_cls, target)

        return decorator if _op_cls is None else decorator(_op_cls)


class CustomOp(RegisteredLayer):
    """One operation: a pure-PyTorch `forward_native` and, in subclasses, per-platform fast paths."""


class PluggableLayer(RegisteredLayer):
    """A composite layer (built from CustomOps and Linears), replaced as a whole by a platform or plugin;
    its `forward_native` composes its sublayers, each of which runs its own resolved forward."""


def reference_of(module: RegisteredLayer) -> RegisteredLayer:
    """A new instance of `module`'s op reference class, built with its arguments, its registered sublayers
    turned into their references too, holding its weights: what `module` must compute."""
    args, kwargs = module.init_args
    reference = construct(op_registry[module.op_name].reference, *args, **kwargs)
    for name, child in module.named_children():
        if isinstance(child, RegisteredLayer):
            setattr(reference, name, reference_of(child))
    reference.load_state_dict(module.state_dict(), strict=False)
    return reference


def describe_layers(model: nn.Module) -> list[dict[str, str]]:
    """Every registered layer inside `model`: path, op name, provider, class and the forward in use."""
    rows = []
    for path, module in model.named_modules():
        if isinstance(module, RegisteredLayer):
            detail = module.forward_detail()
            rows.append(
                {
                    "module": path,
                    "op": module.op_name,
                    "provider": module.provider,
                    "class": _path(type(module)),
                    "forward": module.forward_method_name + (f" ({detail})" if detail else ""),
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

    return f"{len(rows)} layers; by provider: {counts('provider')}; by op: {counts('op')}"
