"""What Inductor made of a compiled piece: the ops it generated code for, and the ops it left as calls of
kernels that exist already (a matmul library's, a custom op's).

Inductor records this itself when its provenance tracking is on (`trace.provenance_tracking_level`, which
`backend.INDUCTOR_OPTIONS` sets for every piece): for each kernel a piece calls, the nodes of its post-grad
graph that the kernel computes. The record, and the post-grad graph's text that names each node's op, are
fields of the `CompiledFxGraph` that Inductor caches and Strata saves, so a piece loaded from disk reports
what its compilation did. The level is part of Inductor's cache key, so a graph from Inductor's cache has
the record too. A kernel is Inductor's own when its definition is in the piece's generated source; any
other kernel is an existing one that the piece calls.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from strata.compilation.inductor_artifact import compiled_fx_graph

# A node of Inductor's printed post-grad graph: `name: "f32[...]" = torch.ops.<ns>.<op>.<overload>(`.
_NODE = re.compile(r'^\s*(\w+)(?::\s*"[^"]*")?\s*=\s*torch\.ops\.(\w+)\.(\w+)\.(\w+)\(', re.MULTILINE)
# A kernel defined in the generated source: Python wrapper (`name = async_compile.cpp_pybinding(...)`,
# `.triton(...)`, ...) or C++ wrapper (`extern "C" void name(...)`).
_DEFINITION = re.compile(r"^(\w+) = async_compile\.|\bvoid\s+(\w+)\s*\(", re.MULTILINE)


@dataclass(frozen=True)
class PieceReport:
    """One distinct piece: how many kernels Inductor generated, the ops they compute (views, which compute
    nothing, left out), and how many calls of each existing kernel's op the piece makes."""

    piece: str
    generated_kernels: int
    fused_ops: tuple[str, ...]
    extern_calls: dict[str, int]

    def cells(self) -> dict[str, str]:
        """The report as text: kernel count, the ops they compute, the calls of existing kernels ("-": none)."""
        calls = ", ".join(f"{op} x{count}" for op, count in sorted(self.extern_calls.items()))
        return {
            "kernels": str(self.generated_kernels),
            "generated ops": ", ".join(self.fused_ops) or "-",
            "extern calls": calls or "-",
        }

    def describe(self) -> str:
        """One line: the piece, its generated kernels and the ops in them, its calls of existing kernels."""
        cells = self.cells()
        kernels = f"{self.generated_kernels} generated kernel{'' if self.generated_kernels == 1 else 's'}"
        return f"piece {self.piece[:12]}: {kernels} ({cells['generated ops']}); extern calls: {cells['extern calls']}"


def _op_name(namespace: str, op: str) -> str:
    return f"{namespace}::{op}"


def _is_view(namespace: str, op: str, overload: str) -> bool:
    """Whether the op returns a view of an input (its schema says so): it computes nothing of its own."""
    try:
        return bool(getattr(getattr(getattr(torch.ops, namespace), op), overload).is_view)
    except (AttributeError, RuntimeError):
        return False


def piece_report(key: str, artifact: Any) -> PieceReport | None:
    """The report of a compiled piece, or None where its artifact holds no provenance record (tracking
    switched off in the engine's `inductor_compile_config`, say)."""
    graph = compiled_fx_graph(artifact)
    record = getattr(graph, "inductor_provenance_mapping_str", None)
    if not record:
        return None
    kernels: dict[str, list[str]] = json.loads(record).get("cppCodeToPost", {})
    if not kernels:
        return None
    ops = {
        node: (ns, op, overload)
        for node, ns, op, overload in _NODE.findall(graph.inductor_post_grad_graph_str)
    }
    defined = {a or b for a, b in _DEFINITION.findall(graph.source_code)}
    generated: set[str] = set()
    fused_nodes: set[str] = set()
    extern_nodes: set[str] = set()
    extern_calls: Counter[str] = Counter()
    for handle, nodes in kernels.items():
        name = handle.rpartition(":")[0] or handle  # "<kernel>:<debug handle>"
        if name in defined:
            generated.add(name)
            fused_nodes.update(nodes)
            continue
        computed = [ops[node] for node in nodes if node in ops and not _is_view(*ops[node])]
        extern_calls.update({_op_name(ns, op) for ns, op, _ in computed} or {name})
        extern_nodes.update(nodes)
    fused = {
        _op_name(ns, op)
        for node in fused_nodes - extern_nodes
        if node in ops
        for ns, op, overload in [ops[node]]
        if not _is_view(ns, op, overload)
    }
    return PieceReport(key, len(generated), tuple(sorted(fused)), dict(sorted(extern_calls.items())))
