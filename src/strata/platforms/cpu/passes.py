"""The CPU platform's graph passes, over calls of its own kernel ops in Dynamo's graph of the forward.

`fuse_residual_add_into_rms_norm` turns `rms_norm(a + b)`, where HF writes the residual add and the next
norm separately, into `fused_add_rms_norm(a, b) -> (normed, a + b)`: one pass over the hidden state instead
of two. The norm is an opaque kernel op, which Inductor cannot fuse with the add on its own; with the
hw-agnostic norm Inductor sees plain tensor math and fuses the add itself, so the pass finds nothing there.

`group_sibling_linears` turns the linears that read one input (a layer's q, k and v projections) into one
`strata_cpu::linear_group` call: one dispatch and one parallel region for all three at decode sizes.

`linears_to_onednn` turns the plain `F.linear` calls that are left (the hw-agnostic layers', or any a
platform kernel does not serve) into oneDNN's matmul on the same weights (`strata.platforms.cpu.onednn`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from strata.compilation.passes import is_call, same_tensor_type, traced_value
from strata.platforms.cpu import onednn


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
        if not is_call(norm, norms) or norm.kwargs:
            continue
        total, *rest = norm.args
        if not is_call(total, adds) or total.kwargs or len(total.args) != 2:
            continue
        a, b = total.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and same_tensor_type(a, b, total)):
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
        if not is_call(node, linears) or node.kwargs or len(node.args) != 4 or node.args[2:] != (None, None):
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


def linears_to_onednn(gm: fx.GraphModule) -> int:
    """Replace each `F.linear(x, weight, bias)` on CPU tensors of a dtype oneDNN takes (`onednn.DTYPES`, the
    weight 2-D and of x's dtype) by `strata_onednn::linear`, which Inductor lowers to oneDNN's matmul.
    Returns the number of replacements."""
    linears = (torch._C._nn.linear, torch.nn.functional.linear, torch.ops.aten.linear.default)
    count = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, linears) or node.kwargs or len(node.args) not in (2, 3):
            continue
        x, weight, bias = (*node.args, None)[:3]
        values = [traced_value(n) if isinstance(n, fx.Node) else n for n in (x, weight, bias)]
        if not all(isinstance(v, torch.Tensor) for v in values[:2]) or not (
            values[2] is None or isinstance(values[2], torch.Tensor)
        ):
            continue
        dtypes = {v.dtype for v in values if v is not None}
        devices = {v.device.type for v in values if v is not None}
        if dtypes - set(onednn.DTYPES) or len(dtypes) != 1 or devices != {"cpu"} or values[1].dim() != 2:
            continue
        if not onednn.register():
            return 0
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.strata_onednn.linear.default, (x, weight, bias))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        count += 1
    return count
