"""Strata's `torch.compile` backend: split at attention, compile each distinct piece once, cache on disk.

Dynamo hands the backend one FX graph of the whole forward. The backend

1. runs Strata's fusion passes on it (`passes.PassManager`),
2. splits it at every attention op (`split_module`): attention runs as the eager custom op, everything
   between two attention calls is a piece,
3. keys each piece by a hash of its graph (node names and placeholder names canonicalised, constants
   included) and its input metadata, and compiles each distinct key once with Inductor; pieces with the
   same key share the compiled callable,
4. stores each compiled piece under the cache directory (atomic rename), so a second start loads them
   instead of compiling.

The KV-cache write (`strata::kv_cache_update`) is in the pieces unless the fusion pass moved it into the
attention op. With `LayerName` its name is an input of the piece, so every "between two attentions" piece
hashes the same and a model of any depth compiles at most three distinct pieces. With `str` names the name
is a constant of the piece, so the key differs per layer: each layer compiles its own piece, and a piece
compiled for one layer's name can never serve another layer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from strata.attention.ops import ATTENTION_OPS
from strata.compilation.passes import PassManager

logger = logging.getLogger("strata.compilation")

_ATTENTION_TARGETS = {overload for op in ATTENTION_OPS for overload in op.overloads}


@dataclass
class CompileStats:
    """What one engine's compilation did; `dynamo_graphs` above 1 means Dynamo recompiled."""

    dynamo_graphs: int = 0
    pieces: int = 0
    distinct_pieces: int = 0
    compiled: int = 0
    loaded: int = 0
    seconds: float = 0.0


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ATTENTION_TARGETS


def _describe_value(value: Any) -> str:
    """Input metadata that decides whether a compiled piece can serve these inputs."""
    if isinstance(value, torch.Tensor):
        shape = tuple(d if isinstance(d, int) else "s" for d in value.shape)
        stride = tuple(d if isinstance(d, int) else "s" for d in value.stride())
        return f"T{value.dtype}{shape}{stride}{value.device.type}"
    if isinstance(value, torch.SymInt):
        return "SymInt"
    return type(value).__name__


def _target_name(target: Any) -> str:
    """A name for a node's target that is the same in every process (a function's repr holds its address)."""
    if isinstance(target, str | torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or type(getattr(target, "__self__", None)).__name__
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def piece_key(gm: fx.GraphModule, inputs: Sequence[Any]) -> str:
    """Hash of a piece's structure and input metadata, independent of node and placeholder names."""
    names: dict[fx.Node, str] = {}
    lines = []
    for index, node in enumerate(gm.graph.nodes):
        names[node] = f"n{index}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        target = _target_name(node.target) if node.op != "placeholder" else ""
        lines.append(f"{node.op}|{target}|{args}")
    lines.extend(_describe_value(value) for value in inputs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _split(gm: fx.GraphModule) -> fx.GraphModule:
    """One submodule per attention call and one per stretch between them (`submod_0`, `submod_1`, ...)."""
    partition = 0
    assignment: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention(node):
            assignment[node] = partition + 1
            partition += 2
        else:
            assignment[node] = partition
    return split_module(gm, None, lambda node: assignment[node], keep_original_order=True, tuple_return=True)


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs, compiling each piece with the inputs it receives."""

    def __init__(self, module: fx.GraphModule, backend: StrataBackend, fake_mode: Any) -> None:
        super().__init__(module)
        self.backend = backend
        self.fake_mode = fake_mode

    def run(self, *args: Any) -> Any:
        fake_args = [self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with self.fake_mode:
            return super().run(*fake_args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        assert isinstance(target, str)
        submodule = self.fetch_attr(target)
        output = super().call_module(target, args, kwargs)
        if not any(is_attention(node) for node in submodule.graph.nodes):
            compiled = self.backend.compile_piece(submodule, list(args))
            setattr(self.module, target, _CompiledPiece(compiled))
        return output


class _CompiledPiece(torch.nn.Module):
    """A compiled piece in place of its submodule: Inductor callables take a flat argument list."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        return self.compiled(*args)


class StrataBackend:
    """The `backend=` of `torch.compile` for one engine: owns its piece table and statistics."""

    def __init__(self, pass_manager: PassManager, cache_dir: Path | None) -> None:
        self.pass_manager = pass_manager
        self.cache_dir = cache_dir
        self.stats = CompileStats()
        self._pieces: dict[str, Callable[..., Any]] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._guards import detect_fake_mode

        start = time.perf_counter()
        self.stats.dynamo_graphs += 1
        self.pass_manager(gm)
        split = _split(gm)
        fake_mode = detect_fake_mode(example_inputs)
        _PieceCompiler(split, self, fake_mode).run(*example_inputs)
        self.stats.seconds += time.perf_counter() - start
        logger.info(
            "compiled forward: %d pieces, %d distinct, %d compiled, %d loaded from cache, %.1f s",
            self.stats.pieces,
            self.stats.distinct_pieces,
            self.stats.compiled,
            self.stats.loaded,
            self.stats.seconds,
        )
        return split.forward

    def compile_piece(self, piece: fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        """The compiled callable for `piece`: shared with an identical earlier piece, loaded, or compiled."""
        from torch._inductor import CompiledArtifact, standalone_compile

        self.stats.pieces += 1
        key = piece_key(piece, inputs)
        if key in self._pieces:
            return self._pieces[key]
        self.stats.distinct_pieces += 1
        path = self.cache_dir / f"{key}.bin" if self.cache_dir is not None else None
        if path is not None and path.is_file():
            artifact = CompiledArtifact.load(path=str(path), format="binary")
            self.stats.loaded += 1
        else:
            artifact = standalone_compile(piece, inputs, dynamic_shapes="from_tracing_context")
            self.stats.compiled += 1
            if path is not None:
                _save_atomically(artifact, path)
        self._pieces[key] = artifact
        return artifact


def _save_atomically(artifact: Any, path: Path) -> None:
    """Write to a private temporary file in the same folder, then rename: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        artifact.save(path=tmp, format="binary")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
