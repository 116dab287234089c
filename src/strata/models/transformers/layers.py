"""The layer resolver: hw-agnostic first when the layer config asks for it, Strata's default otherwise.

Resolution happens while a model is built, from that build's layer config (see
`strata.config.set_current_layer_config`), so two engines in one process can use different providers.
Each symbol falls back on its own: a hw-agnostic module or symbol that does not exist yields the default.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from strata.config import LayerConfig, get_current_layer_config
from strata.custom_op import CustomOp, construct_in_tree, in_tree_class
from strata.layers.activation import UnknownActivationError

logger = logging.getLogger("strata.layers")

HW_AGNOSTIC_PACKAGE = "strata.hw_agnostic.layers"
DEFAULT_PACKAGE = "strata.layers"


def _hw_agnostic_module(module: str, name: str) -> ModuleType | None:
    """`strata.hw_agnostic.layers.<module>`, or None (logged) when it does not exist."""
    path = f"{HW_AGNOSTIC_PACKAGE}.{module}"
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name != path:
            raise  # the hw-agnostic module exists but is broken: a bug to see, not to hide
        logger.info("layer %s: default (there is no hw-agnostic module %s)", name, path)
        return None


def resolve(module: str, name: str, layer_config: LayerConfig | None = None) -> Any:
    """`name` from `strata.hw_agnostic.layers.<module>` when hw-agnostic layers are on and it exists there,
    else from `strata.layers.<module>`; logs which one and why."""
    layer_config = layer_config or get_current_layer_config()
    if not layer_config.use_hw_agnostic:
        logger.info("layer %s: default (layer_impl=%s)", name, layer_config.layer_impl)
    elif (hw_agnostic := _hw_agnostic_module(module, name)) is not None:
        if hasattr(hw_agnostic, name):
            logger.info("layer %s: hw-agnostic (%s)", name, hw_agnostic.__name__)
            return getattr(hw_agnostic, name)
        logger.info("layer %s: default (%s has no %s)", name, hw_agnostic.__name__, name)
    return getattr(importlib.import_module(f"{DEFAULT_PACKAGE}.{module}"), name)


def resolve_act_and_mul(act_name: str, layer_config: LayerConfig | None = None) -> Callable[[], nn.Module]:
    """A factory of the act-and-mul layer for HF activation `act_name`, falling back per activation name."""
    layer_config = layer_config or get_current_layer_config()
    if not layer_config.use_hw_agnostic:
        logger.info("activation %s: default (layer_impl=%s)", act_name, layer_config.layer_impl)
    elif (hw_agnostic := _hw_agnostic_module("activation", act_name)) is not None:
        factory = getattr(hw_agnostic, "ACT_AND_MUL", {}).get(act_name)
        if factory is not None:
            logger.info("activation %s: hw-agnostic", act_name)
            return factory
        logger.info("activation %s: default (no hw-agnostic act-and-mul layer for it)", act_name)
    table = importlib.import_module(f"{DEFAULT_PACKAGE}.activation").ACT_AND_MUL
    if act_name not in table:
        raise UnknownActivationError(
            f"activation {act_name!r} has no act-and-mul layer; known: {', '.join(sorted(table))}"
        )
    return table[act_name]


def get_act_and_mul_fn(act_name: str, layer_config: LayerConfig | None = None) -> nn.Module:
    """The resolved act-and-mul layer for HF activation `act_name`, constructed."""
    return resolve_act_and_mul(act_name, layer_config)()


def verify_layers(model: nn.Module, num_tokens: int = 7, seed: int = 0) -> list[dict[str, Any]]:
    """Run every CustomOp in `model` and the hw-agnostic `forward_native` of its op on the same random
    inputs and weights; per op: how many modules, the largest absolute difference, the reference class.

    This catches a layer that exists but computes something else, which import-time fallback never could.
    """
    package = importlib.import_module(HW_AGNOSTIC_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):  # importing registers the references
        importlib.import_module(f"{HW_AGNOSTIC_PACKAGE}.{info.name}")
    generator = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    results: dict[str, dict[str, Any]] = {}
    for module in model.modules():
        if not isinstance(module, CustomOp):
            continue
        ref_cls = in_tree_class(module.op_name, "hw-agnostic")
        row = results.setdefault(
            module.op_name,
            {"op": module.op_name, "modules": 0, "max_abs_diff": 0.0, "reference": _class_path(ref_cls)},
        )
        row["modules"] += 1
        if ref_cls is None:
            row["max_abs_diff"] = None
            continue
        args, kwargs = module.init_args
        reference = construct_in_tree(ref_cls, *args, **kwargs)
        reference.load_state_dict(module.state_dict(), strict=False)
        with torch.no_grad():
            for inputs in reference.example_inputs(num_tokens, generator, dtype):
                got = module(*(t.clone() for t in inputs))
                want = reference.forward_native(*(t.clone() for t in inputs))
                for g, w in zip(_as_tuple(got), _as_tuple(want), strict=True):
                    diff = (g.float() - w.float()).abs().max().item()
                    row["max_abs_diff"] = max(row["max_abs_diff"], diff)
    return list(results.values())


def _as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _class_path(cls: type | None) -> str | None:
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
