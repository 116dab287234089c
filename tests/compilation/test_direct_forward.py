"""`derive_direct_forward` on hand-written stand-ins for a trace's Dynamo code: it learns the argument list of
the graph call where each argument is an input, an input's size or a fixed object, and refuses otherwise."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import fx, nn

from strata.compilation.backend import CompiledGraph, GraphCallRecorder
from strata.compilation.compiler import derive_direct_forward
from strata.platforms import get_platform


def _graph_body(weight: torch.Tensor, ids: torch.Tensor, tokens: int, keep: torch.Tensor) -> Any:
    return (ids.float() * weight + tokens, keep * 2)


@pytest.fixture
def graph() -> CompiledGraph:
    return CompiledGraph(fx.symbolic_trace(_graph_body), {}, get_platform("cpu"))


@pytest.fixture
def model() -> nn.Module:
    return nn.Linear(1, 1)


def _inputs(tokens: int, kept: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.arange(tokens).unsqueeze(0)
    return ids, ids + 100, torch.arange(kept)


def test_inputs_their_sizes_and_fixed_objects_are_learned(graph: CompiledGraph, model: nn.Module) -> None:
    def prologue(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> Any:
        return graph(model.weight, ids, ids.shape[1], keep)[0]

    inputs = _inputs(4, 1)
    result, direct = derive_direct_forward(prologue, model, inputs)
    assert direct is not None
    torch.testing.assert_close(result, prologue(model, *inputs))
    # Other sizes than the call it learned from: the same as the prologue computes.
    for tokens, kept in ((1, 1), (9, 3)):
        other = _inputs(tokens, kept)
        torch.testing.assert_close(direct(*other), prologue(model, *other), rtol=0, atol=0)


@pytest.mark.parametrize(
    "prologue",
    [
        # a tensor made anew on every call
        lambda graph, model, ids, positions, keep: graph(torch.ones(1), ids, ids.shape[1], keep)[0],
        # a size that is no input's size
        lambda graph, model, ids, positions, keep: graph(model.weight, ids, ids.shape[1] + 1, keep)[0],
        # a result that is not one of the graph's outputs
        lambda graph, model, ids, positions, keep: graph(model.weight, ids, ids.shape[1], keep)[0] + 1,
        # no graph call at all
        lambda graph, model, ids, positions, keep: ids.float(),
    ],
    ids=["fresh-tensor", "derived-size", "changed-result", "no-graph"],
)
def test_anything_else_keeps_the_trace(
    graph: CompiledGraph, model: nn.Module, prologue: Callable[..., Any]
) -> None:
    def trace(*args: Any) -> Any:
        return prologue(graph, *args)

    inputs = _inputs(4, 1)
    result, direct = derive_direct_forward(trace, model, inputs)
    assert direct is None
    torch.testing.assert_close(result, trace(model, *inputs))


def test_a_recorder_sees_only_calls_in_its_own_thread(graph: CompiledGraph, model: nn.Module) -> None:
    """The server steps engines in threads of their own: one engine learning its call must neither record nor
    stop another's forward."""
    ids, _, keep = _inputs(4, 1)
    outputs: list[Any] = []
    with GraphCallRecorder(run=False) as recorder:
        other = threading.Thread(target=lambda: outputs.append(graph(model.weight, ids, 4, keep)))
        other.start()
        other.join()
    assert recorder.calls == []
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0][1], keep * 2)
