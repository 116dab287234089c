"""Graph passes: how Strata runs FX passes on Dynamo's graph of the whole forward, before it is split at
attention, and the helpers passes share. Which passes run is the platform's (`Platform.graph_passes`):
they rewrite calls of its own kernel ops (`strata.platforms.cpu.passes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

logger = logging.getLogger("strata.compilation")

GraphPass = Callable[[fx.GraphModule], int]


class PassManager:
    """Runs the enabled passes in order; each returns how many replacements it made (summed in `counts`)."""

    def __init__(self, passes: dict[str, GraphPass]) -> None:
        self.passes = passes
        self.counts: dict[str, int] = dict.fromkeys(passes, 0)

    def __call__(self, gm: fx.GraphModule) -> None:
        for name, graph_pass in self.passes.items():
            count = graph_pass(gm)
            self.counts[name] += count
            logger.info("pass %s: %d replacements", name, count)
        gm.graph.lint()
        gm.recompile()


def is_call(node: Any, targets: Sequence[Any]) -> bool:
    """Whether `node` is a graph node calling one of `targets`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def same_tensor_type(*nodes: fx.Node) -> bool:
    """Whether the trace recorded every node as a tensor of one shape and dtype (no broadcast, no promotion)."""
    values = [node.meta.get("example_value") for node in nodes]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return all(v.shape == values[0].shape and v.dtype == values[0].dtype for v in values)


def traced_value(node: fx.Node) -> Any:
    """The fake value Dynamo recorded for a node of its graph."""
    return node.meta.get("example_value", node.meta.get("val"))
