"""`LayerName`: a layer's name as an opaque value that `torch.compile` lifts to a graph input.

A `str` argument of a custom op is baked into the traced graph as a constant, so N identical decoder layers
become N different graphs and N compilations. Wrapped in `LayerName` (registered as a hoisted opaque value
type, PyTorch >= 2.11) the name becomes an input of the graph, every layer traces to the same graph, and one
compiled artifact serves them all.

Whether an engine uses it is part of its `CompilationConfig` (`use_layer_name`), not a process-wide flag:
an op schema is fixed when it is registered, so a layer-name op is registered twice at import, once taking
`LayerNameType` and once taking `str` (`LayerNameOp`), and the name a call site passes picks the variant.
The model build encodes names as its config asks, so engines with different settings share a process.
A layer-name op may be a split point of compiled graphs (`splits_graph`): the piecewise backend runs it
eagerly between the compiled pieces (`split_points`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

try:
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase

    HAS_OPAQUE_TYPE = True
except ImportError:  # PyTorch < 2.11: plain strings everywhere
    OpaqueBase = object  # type: ignore[assignment,misc]
    HAS_OPAQUE_TYPE = False


class LayerName(OpaqueBase):  # type: ignore[misc,valid-type]
    """A layer name that compiles as a graph input instead of a constant."""

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"LayerName value must be a str, got {type(value).__name__}")
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerName) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"LayerName({self.value!r})"

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        return f"LayerName({self.value!r})", {"LayerName": LayerName}


if HAS_OPAQUE_TYPE:
    register_opaque_type(LayerName, typ="value", hoist=True)

if TYPE_CHECKING:
    LayerNameType: TypeAlias = str | LayerName
else:
    # The annotation op schemas use; the op registrations pick `str` or `LayerName` per variant.
    LayerNameType = LayerName if HAS_OPAQUE_TYPE else str


def encode_layer_name(name: str, use_layer_name: bool) -> str | LayerName:
    """The value a call site passes for `name`: a `LayerName` when the engine uses it and torch supports it."""
    return LayerName(name) if use_layer_name and HAS_OPAQUE_TYPE else name


def resolve_layer_name(name: str | LayerName) -> str:
    """The plain string behind either form."""
    return name.value if isinstance(name, LayerName) else name


# The attribute of an attention module that holds its encoded layer name (`encode_layer_name`).
LAYER_NAME_ATTR = "strata_layer_name"

# Overloads of the layer-name ops that split compiled graphs -> their Python implementations.
_split_points: dict[Any, Callable[..., Any]] = {}


def split_points() -> dict[Any, Callable[..., Any]]:
    """The op overloads compiled graphs are split at, with the implementation each runs eagerly."""
    return _split_points


class LayerNameOp:
    """A custom op that takes a layer name, registered in both forms: `strata::<name>` takes `LayerNameType`
    and `strata::<name>_str` takes `str`. Calling it picks the form from the name's type, so call sites
    only encode names and never choose ops. With `splits_graph`, compiled graphs are split at its calls.
    """

    def __init__(
        self, name: str, impl: Callable[..., Any], fake: Callable[..., Any], splits_graph: bool = False
    ) -> None:
        self.name = name
        self.impl = impl
        self.with_layer_name = _register(name, impl, fake, LayerName if HAS_OPAQUE_TYPE else str)
        self.with_str = _register(f"{name}_str", impl, fake, str)
        self._name_index = list(inspect.signature(impl).parameters).index("layer_name")
        if splits_graph:
            _split_points.update(dict.fromkeys(self.overloads, impl))

    @property
    def overloads(self) -> tuple[Any, Any]:
        """Both variants' default overloads: the targets FX graphs hold."""
        return self.with_layer_name._opoverload, self.with_str._opoverload

    def __call__(self, *args: Any) -> Any:
        if not torch.compiler.is_compiling():
            # Eager forwards run the implementation directly: the dispatcher round trip of a Python custom
            # op costs tens of microseconds per layer per step and only matters to the compiler.
            return self.impl(*args)
        return self.overloads[0 if isinstance(args[self._name_index], LayerName) else 1](*args)


def _register(name: str, impl: Callable[..., Any], fake: Callable[..., Any], name_type: type) -> Any:
    """`torch.library.custom_op` for `impl` with its `layer_name` parameter annotated `name_type`.

    The schema is inferred from the signature, so each variant gets a copy of `impl` whose signature
    differs only in that one annotation.
    """
    hints = typing.get_type_hints(impl, globalns={**vars(sys.modules[impl.__module__]), "LayerNameType": str})
    params = [
        p.replace(annotation=name_type if p.name == "layer_name" else hints[p.name])
        for p in inspect.signature(impl).parameters.values()
    ]
    signature = inspect.Signature(params, return_annotation=hints["return"])

    def with_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        del wrapper.__wrapped__  # inspect.signature must not look through to `fn`
        return wrapper

    op = torch.library.custom_op(f"strata::{name}", with_signature(impl), mutates_args=())
    op.register_fake(with_signature(fake))
    return op
