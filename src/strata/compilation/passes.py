"""Strata's FX passes, run on Dynamo's graph of the whole forward before it is split at attention.

`fuse_residual_add_into_rms_norm` turns `rms_norm(a + b)`, where HF writes the residual add and the next
norm separately, into `fused_add_rms_norm(a, b) -> (normed, a + b)`: one pass over the hidden state instead
of two. It applies where the norm is Strata's own CPU kernel (an opaque op, which Inductor cannot fuse
with the add on its own); with the hw-agnostic norm Inductor sees plain tensor math and fuses the add
itself, so the pass finds nothing there.

`fuse_kv_write_into_attention` turns `unified_attention(q, kv_cache_update(k, v, name), name, ...)` into
`attention_with_kv_write(q, k, v, name, ...)`: one custom-op call per layer instead of two, and no
dependency tensor. It also leaves the compiled pieces without any op that takes a `LayerName`, so they can
use Inductor's C++ wrapper (`backend.piece_options`).

`group_sibling_linears` turns the CPU linears that read one input (a layer's q, k and v projections) into
one `strata_cpu::linear_group` call: one dispatch and one parallel region for all three at decode sizes.

The attention pattern contains layer-name ops, so it is written the way `LayerName` needs: with `LayerName` the name
is a pattern input (`KeywordArg`), registered once, and matches every layer; with `str` names each name is
a constant of the graph, so one pattern per layer is registered with that layer's name as a literal. A
`str` pattern against a `LayerName` graph (or the reverse) silently matches nothing, which is why the tests
count replacements in both settings.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

from strata.attention.ops import attention_with_kv_write, kv_cache_update, unified_attention
from strata.compilation.layer_name import LayerName

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


def fuse_kv_write_into_attention(layer_names: Sequence[str | LayerName]) -> GraphPass:
    """The pass for a model whose attention layers are called with `layer_names` (encoded)."""
    patterns = PatternMatcherPass(pass_name="fuse_kv_write_into_attention")
    use_layer_name = any(isinstance(name, LayerName) for name in layer_names)
    # One pattern with the name as an input, or one per layer with the name as a literal.
    pattern_names: list[Any] = [KeywordArg("layer_name")] if use_layer_name else list(layer_names)
    variant = layer_names[0] if layer_names else ""
    for name in pattern_names:
        kv_write = CallFunction(
            kv_cache_update.variant(variant), KeywordArg("key"), KeywordArg("value"), name, _users=1
        )
        attention = CallFunction(
            unified_attention.variant(variant),
            KeywordArg("query"),
            kv_write,
            name,
            KeywordArg("scale"),
            KeywordArg("softcap"),
            KeywordArg("sliding_window"),
        )
        register_graph_pattern(attention, pass_dict=patterns)(_replace_with_fused(name, variant))

    def run(gm: fx.GraphModule) -> int:
        return patterns.apply(gm.graph)

    return run


def _replace_with_fused(pattern_name: Any, variant: str | LayerName) -> Callable[..., None]:
    fused = attention_with_kv_write.variant(variant)

    def replace(match: Match, query: fx.Node, key: fx.Node, value: fx.Node, **kwargs: Any) -> None:
        name = kwargs.get("layer_name", pattern_name)
        attention = match.output_node()
        graph = attention.graph
        with graph.inserting_before(attention):
            node = graph.call_function(
                fused,
                (query, key, value, name, kwargs["scale"], kwargs["softcap"], kwargs["sliding_window"]),
            )
        node.meta.update(attention.meta)
        attention.replace_all_uses_with(node)
        match.erase_nodes()

    return replace


def _is_call(node: Any, targets: Sequence[Any]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _same_tensor_type(*nodes: fx.Node) -> bool:
    """Whether the trace recorded every node as a tensor of one shape and dtype (no broadcast, no promotion)."""
    values = [node.meta.get("example_value") for node in nodes]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return all(v.shape == values[0].shape and v.dtype == values[0].dtype for v in values)


def fuse_residual_add_into_rms_norm(gm: fx.GraphModule) -> int:
    """Replace `rms_norm(a + b, w, eps, offset)` by `fused_add_rms_norm(a, b, w, eps, offset)`; the add's other
    users (the next residual) take the fused op's sum. Returns the number of replacements."""
    ops = torch.ops.strata_cpu
    if not (hasattr(ops, "rms_norm") and hasattr(ops, "fused_add_rms_norm")):
        return 0  # the kernel is not loaded: norms are not opaque ops in this graph
    norms = (ops.rms_norm, ops.rms_norm.default)
    adds = (operator.add, torch.add, torch.ops.aten.add.Tensor)
    count = 0
    for norm in list(gm.graph.nodes):
        if not _is_call(norm, norms) or norm.kwargs:
            continue
        total, *rest = norm.args
        if not _is_call(total, adds) or total.kwargs or len(total.args) != 2:
            continue
        a, b = total.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and _same_tensor_type(a, b, total)):
            continue
        graph = gm.graph
        with graph.inserting_before(norm):
            fused = graph.call_function(ops.fused_add_rms_norm.default, (a, b, *rest))
            normed = graph.call_function(operator.getitem, (fused, 0))
            new_total = graph.call_function(operator.getitem, (fused, 1))
        normed.meta.update(norm.meta)
        new_total.meta.update(total.meta)
        norm.replace_all_uses_with(normed)
        total.replace_all_uses_with(new_total)
        graph.erase_node(norm)
        graph.erase_node(total)
        count += 1
    return count


def traced_value(node: fx.Node) -> Any:
    """The fake value Dynamo recorded for a node of its graph."""
    return node.meta.get("example_value", node.meta.get("val"))


def group_sibling_linears(gm: fx.GraphModule) -> int:
    """Replace the `strata_cpu::linear` calls that read one input (a layer's q, k and v projections) by one
    `strata_cpu::linear_group` call: at decode sizes one dispatch and one parallel region for all of them.
    Each member's output becomes its columns of the group's output (a strided view, as HF's reshapes allow).
    HF reshapes the input once per projection, so inputs count as one when they are the same operation on the
    same arguments. Only plain weights group (no int8 scale, no bias). Returns the number of groups made."""
    ops = torch.ops.strata_cpu
    if not hasattr(ops, "linear_group"):
        return 0  # the kernel is not loaded: linears are not Strata's op in this graph
    linears = (ops.linear, ops.linear.default)
    groups: dict[Any, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if not _is_call(node, linears) or node.kwargs or len(node.args) != 4 or node.args[2:] != (None, None):
            continue
        x = node.args[0]
        if not isinstance(x, fx.Node):
            continue
        same_as = (x.op, x.target, x.args, tuple(x.kwargs.items())) if x.op != "placeholder" else x
        groups.setdefault(same_as, []).append(node)
    count = 0
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    for members in groups.values():
        # The group call goes where the first member was, so each weight must be defined before that.
        first = order[members[0]]
        members = [m for m in members if not isinstance(m.args[1], fx.Node) or order[m.args[1]] < first]
        if len(members) < 2:
            continue
        x = members[0].args[0]
        with graph.inserting_before(members[0]):
            group = graph.call_function(ops.linear_group.default, (x, [m.args[1] for m in members]))
        start = 0
        for member in members:
            width = traced_value(member).shape[-1]
            with graph.inserting_after(group):
                output = graph.call_function(torch.ops.aten.slice.Tensor, (group, 1, start, start + width))
            start += width
            output.meta.update(member.meta)
            member.replace_all_uses_with(output)
            old_input = member.args[0]
            graph.erase_node(member)
            if isinstance(old_input, fx.Node) and old_input is not x and not old_input.users:
                graph.erase_node(old_input)
        count += 1
    return count


def build_passes(
    layer_names: Sequence[str | LayerName], enabled: Callable[[str], bool]
) -> dict[str, GraphPass]:
    """The enabled passes for a model with these (encoded) attention layer names, in the order they run."""
    passes: dict[str, GraphPass] = {}
    if enabled("fuse_residual_add_into_rms_norm"):
        passes["fuse_residual_add_into_rms_norm"] = fuse_residual_add_into_rms_norm
    if enabled("fuse_kv_write_into_attention"):
        passes["fuse_kv_write_into_attention"] = fuse_kv_write_into_attention(layer_names)
    if enabled("group_sibling_linears"):
        passes["group_sibling_linears"] = group_sibling_linears
    return passes
