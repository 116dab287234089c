"""The resolver: the one place that decides which class and which forward method each layer gets.

For one model build (a layer config and a platform), `LayerResolver.build(op_name, *args)` chooses, in order:

1. a plugin's override of the op (`register_oot`): its `forward_oot` where it defines one and the op is
   enabled, else its `forward_native`;
2. the op's reference (`strata.hw_agnostic.layers`, `forward_native`) when the layer config asks for
   hw-agnostic layers, or its `custom_ops` setting disables the op;
3. the platform's first registered implementation whose `supports(*args)` accepts the layer, running the
   platform's `forward_<name>`;
4. else the reference: an op without a platform implementation falls back on its own, per op.

The choice is logged once per op and class, and recorded on the module (`provider`, `forward_method_name`),
which is what the layer report shows. `verify_layers` checks each built module against its reference, and
`verify_attention` the attention backend against the reference backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import strata.hw_agnostic.layers  # noqa: F401 (registers every op's reference)
from strata.attention.backends.torch_native import TorchNativeBackend
from strata.attention.verify import verify_backend
from strata.config import LayerConfig
from strata.custom_op import RegisteredLayer, construct, op_registry, reference_of
from strata.models.transformers.attention import AttentionLayerSpec
from strata.platforms import Platform

logger = logging.getLogger("strata.layers")


@dataclass(frozen=True)
class LayerChoice:
    """What the resolver picked for a layer, and why."""

    cls: type[RegisteredLayer]
    forward_method: str
    reason: str


def _defines(cls: type, method: str) -> bool:
    return callable(getattr(cls, method, None))


class LayerResolver:
    """Resolves the layers of one model build; construct it where the build starts."""

    def __init__(self, layer_config: LayerConfig, platform: Platform) -> None:
        self.layer_config = layer_config
        self.platform = platform
        platform.load_layers()
        self._logged: set[tuple[str, type, str]] = set()

    def choose(self, op_name: str, *args: Any, **kwargs: Any) -> LayerChoice:
        """The class and forward method for a layer of op `op_name` built with these arguments."""
        entry = op_registry[op_name]
        enabled = self.layer_config.op_enabled(op_name)
        oot = entry.oot
        if oot is not None:
            method = "forward_oot" if enabled and _defines(oot, "forward_oot") else "forward_native"
            return LayerChoice(oot, method, "a plugin overrides it")
        native = "forward_native"
        if self.layer_config.use_hw_agnostic:
            return LayerChoice(entry.reference, native, f"layer_impl={self.layer_config.layer_impl}")
        if not enabled:
            return LayerChoice(entry.reference, native, "custom_ops disables it")
        platform = self.platform
        declined = []
        for cls in entry.implementations.get(platform.name, ()):
            why_not = cls.supports(*args, **kwargs)
            if why_not is None and _defines(cls, platform.forward_method):
                return LayerChoice(cls, platform.forward_method, f"the {platform.name} platform's")
            declined.append(f"{cls.__name__}: {why_not or f'has no {platform.forward_method}'}")
        reason = "; ".join(declined) if declined else f"the {platform.name} platform has no implementation"
        return LayerChoice(entry.reference, native, reason)

    def build(self, op_name: str, *args: Any, **kwargs: Any) -> nn.Module:
        """A new layer of op `op_name`, of the chosen class, running the chosen forward."""
        choice = self.choose(op_name, *args, **kwargs)
        key = (op_name, choice.cls, choice.forward_method)
        if key not in self._logged:
            self._logged.add(key)
            logger.info(
                "layer %s: %s.%s (%s)", op_name, choice.cls.__qualname__, choice.forward_method, choice.reason
            )
        module = construct(choice.cls, *args, **kwargs)
        module.use_forward(choice.forward_method)
        return module


def verify_layers(model: nn.Module, num_tokens: int = 7, seed: int = 0) -> list[dict[str, Any]]:
    """Run every registered layer in `model` and its op's reference (`custom_op.reference_of`: the hw-agnostic
    class with the same arguments and weights, composite layers' sublayers turned into theirs too) on the same
    random inputs; per op: how many modules, the largest absolute difference, the reference class.

    This catches a layer that exists but computes something else, which resolving alone never could.
    """
    generator = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    results: dict[str, dict[str, Any]] = {}
    for module in model.modules():
        if not isinstance(module, RegisteredLayer):
            continue
        reference_cls = op_registry[module.op_name].reference
        row = results.setdefault(
            module.op_name,
            {
                "op": module.op_name,
                "modules": 0,
                "max_abs_diff": 0.0,
                "reference": f"{reference_cls.__module__}.{reference_cls.__qualname__}",
            },
        )
        row["modules"] += 1
        if type(module) is reference_cls:
            continue  # the reference itself
        reference = reference_of(module)
        with torch.no_grad():
            for inputs in reference.example_inputs(num_tokens, generator, dtype):
                got = module(*(t.clone() for t in inputs))
                want = reference(*(t.clone() for t in inputs))
                for g, w in zip(_as_tuple(got), _as_tuple(want), strict=True):
                    diff = (g.float() - w.float()).abs().max().item()
                    row["max_abs_diff"] = max(row["max_abs_diff"], diff)
    return list(results.values())


def verify_attention(backend: Any, specs: Sequence[AttentionLayerSpec], dtype: torch.dtype) -> dict[str, Any]:
    """`verify_layers`' row for the attention layers: `backend` against the reference backend, once per
    distinct layer shape, on random paged steps (`strata.attention.verify`)."""
    shapes = {(spec.num_heads, spec.num_kv_heads, spec.head_dim) for spec in specs}
    worst = max((verify_backend(backend, *shape, dtype) for shape in shapes), default=0.0)
    return {
        "op": "attention",
        "modules": len(specs),
        "max_abs_diff": worst,
        "reference": f"{TorchNativeBackend.__module__}.{TorchNativeBackend.__qualname__}",
    }


def _as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)
