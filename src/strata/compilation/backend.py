"""Strata's `torch.compile` backend: split at attention, compile each distinct piece once, cache on disk.

Dynamo hands the backend one FX graph of the whole forward. The backend

1. runs the platform's graph passes on it (`passes.PassManager`),
2. splits it at every attention call (the split points of `layer_name.split_points`): attention runs as the
   eager op, everything between two attention calls is a piece,
3. keys each piece by a hash of its graph (node names and placeholder names canonicalised, constants
   included) and its input metadata, and compiles each distinct key once with Inductor; pieces with the
   same key share the compiled callable,
4. stores each compiled piece under the cache directory (atomic rename), so a second start loads them
   instead of compiling.

The attention op writes the layer's KV cache and attends in one call, so no piece holds a layer's name:
every "between two attentions" piece hashes the same and a model of any depth compiles at most three
distinct pieces.

The backend returns a `CompiledGraph`, which `torch.compile(...).aot_compile` can serialise together with
Dynamo's bytecode and guards: the saved form is the graph after the passes plus each piece's key, and loading
it asks the loading engine's backend for the pieces (from its table or the disk cache), so a warm start
neither traces nor compiles.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.aot_compile_types import SerializableCallable
from torch.fx.passes.split_module import split_module

from strata.atomic_file import write_atomically
from strata.compilation.layer_name import OpaqueBase, split_points
from strata.compilation.passes import PassManager, traced_value
from strata.compilation.piece_report import PieceReport, piece_report
from strata.platforms import Platform

logger = logging.getLogger("strata.compilation")

# Split-point op overload -> its Python implementation (filled as the ops are registered).
_SPLIT_POINTS = split_points()

# Inductor settings for every piece (`CompilationConfig.inductor_compile_config` adds to or overrides them).
# Its size, stride and alignment checks on each input and each custom-op output are Python calls that
# evaluate symbolic sizes on every run: at batch 1 they cost about as much as a layer's attention. The
# shapes they check are fixed by the trace and the ops' fake implementations, which the tests compare with
# eager. Provenance tracking at its basic level records which kernel computes which node of a piece, for
# `piece_report`: a list of names per kernel while Inductor generates code.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "size_asserts": False,
    "alignment_asserts": False,
    "trace.provenance_tracking_level": 2,
}


def piece_options(inputs: Sequence[Any], platform: Platform, overrides: dict[str, Any]) -> dict[str, Any]:
    """Inductor settings for one piece: `INDUCTOR_OPTIONS`, the platform's, then the engine's `overrides`.
    Inductor's C++ wrapper calls a piece's ops without a Python line between them, but it cannot pass an
    opaque value such as a `LayerName` to an op: a piece taking one keeps the Python wrapper."""
    options = {"cpp_wrapper": False, **INDUCTOR_OPTIONS, **platform.inductor_options(), **overrides}
    if any(isinstance(value, OpaqueBase) for value in inputs):
        options["cpp_wrapper"] = False
    return options


@dataclass
class CompileStats:
    """What one engine's compilation did; `dynamo_graphs` above 1 means Dynamo recompiled."""

    dynamo_graphs: int = 0
    pieces: int = 0
    distinct_pieces: int = 0
    compiled: int = 0
    compiled_cpp_wrapper: int = 0  # of `compiled`, those with Inductor's C++ wrapper (`piece_options`)
    loaded: int = 0
    seconds: float = 0.0


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SPLIT_POINTS


def is_piece(submodule: fx.GraphModule) -> bool:
    """Whether a submodule of the split graph is a piece to compile (it holds no attention call)."""
    return not any(is_attention(node) for node in submodule.graph.nodes)


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
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True, tuple_return=True)
    for call in split.graph.nodes:
        if call.op == "call_module" and is_piece(submodule := split.get_submodule(call.target)):
            _sizes_from_tensor_inputs(call, submodule)
    split.recompile()
    return split


def _sizes_from_tensor_inputs(call: fx.Node, piece: fx.GraphModule) -> None:
    """Make a piece read each size it takes as an int input (the token count) from a tensor input that has it.

    Inductor's C++ wrapper turns every int input into a new tensor on each call; a size read from a tensor
    costs nothing. `call` is the piece's call in the split graph,
    whose arguments lose the inputs the piece no longer takes.
    """
    placeholders = [node for node in piece.graph.nodes if node.op == "placeholder"]
    dims: dict[Any, tuple[fx.Node, int]] = {}
    for node in placeholders:
        value = traced_value(node)
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (node, dim))
    dropped = set()
    for index, node in enumerate(placeholders):
        value = traced_value(node)
        if not isinstance(value, torch.SymInt) or value.node.expr not in dims:
            continue
        with piece.graph.inserting_after(placeholders[-1]):
            size = piece.graph.call_function(torch.ops.aten.sym_size.int, dims[value.node.expr])
        size.meta["example_value"] = value
        node.replace_all_uses_with(size)
        piece.graph.erase_node(node)
        if not size.users:
            piece.graph.erase_node(size)
        dropped.add(index)
    if dropped:
        call.args = tuple(arg for index, arg in enumerate(call.args) if index not in dropped)
        piece.recompile()


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on fake inputs, compiling each piece with the inputs it receives."""

    def __init__(self, module: fx.GraphModule, backend: StrataBackend, fake_mode: Any) -> None:
        super().__init__(module)
        self.backend = backend
        self.fake_mode = fake_mode
        self.piece_keys: dict[str, str] = {}

    def run(self, *args: Any) -> Any:
        fake_args = [self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with self.fake_mode:
            return super().run(*fake_args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        assert isinstance(target, str)
        submodule = self.fetch_attr(target)
        output = super().call_module(target, args, kwargs)
        if is_piece(submodule):
            key = piece_key(submodule, list(args))
            self.piece_keys[target] = key
            setattr(
                self.module, target, _CompiledPiece(self.backend.compile_piece(submodule, list(args), key))
            )
        return output


class _CompiledPiece(torch.nn.Module):
    """A compiled piece in place of its submodule in the split graph: Inductor callables take a flat argument
    list."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        return self.compiled(*args)


class _PieceCall:
    """How the runtime graph calls a compiled piece: the first call through its artifact (whose runtime wrapper
    checks the custom ops on a first call), later calls straight into its generated code where the platform
    can call that directly (`Platform.fast_piece_call`)."""

    def __init__(self, artifact: Callable[..., Any], platform: Platform) -> None:
        self.artifact = artifact
        self.code = platform.fast_piece_call(artifact)
        self.first = True

    def __call__(self, *args: Any) -> Any:
        if self.code is None or self.first:
            self.first = False
            return self.artifact(*args)
        return self.code(list(args))


class StrataBackend:
    """The `backend=` of `torch.compile` for one engine: owns its piece table and statistics."""

    def __init__(
        self,
        pass_manager: PassManager,
        platform: Platform,
        cache_dir: Path | None,
        inductor_options: dict[str, Any] | None = None,
    ) -> None:
        self.pass_manager = pass_manager
        self.platform = platform
        self.cache_dir = cache_dir
        self.inductor_options = inductor_options or {}
        self.stats = CompileStats()
        # Per distinct piece, what Inductor generated and what it calls (None: no record in its artifact).
        self.piece_reports: dict[str, PieceReport | None] = {}
        self._pieces: dict[str, Callable[..., Any]] = {}
        self._count_loads = True

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledGraph:
        from torch._guards import detect_fake_mode

        start = time.perf_counter()
        self.stats.dynamo_graphs += 1
        self.pass_manager(gm)
        split = _split(gm)
        compiler = _PieceCompiler(split, self, detect_fake_mode(example_inputs))
        compiler.run(*example_inputs)
        self.stats.seconds += time.perf_counter() - start
        self.log_summary()
        return CompiledGraph(split, compiler.piece_keys, self.platform)

    def log_summary(self) -> None:
        logger.info(
            "compiled forward: %d pieces, %d distinct, %d compiled, %d loaded from cache, %.1f s",
            self.stats.pieces,
            self.stats.distinct_pieces,
            self.stats.compiled,
            self.stats.loaded,
            self.stats.seconds,
        )

    @contextlib.contextmanager
    def loading(self, count: bool = True) -> Iterator[None]:
        """Within this block, deserialised `CompiledGraph`s take their pieces from this backend; `count=False`
        for a graph this backend just compiled (its pieces are counted already)."""
        token = _LOADING_BACKEND.set(self)
        counted = self._count_loads
        self._count_loads = count
        try:
            yield
        finally:
            _LOADING_BACKEND.reset(token)
            self._count_loads = counted

    def load_piece(self, key: str) -> Callable[..., Any]:
        """The compiled piece `key` of a saved graph: shared with one already loaded, or read from disk."""
        from torch._inductor import CompiledArtifact

        self.stats.pieces += self._count_loads
        if key not in self._pieces:
            path = self._piece_path(key)
            if path is None or not path.is_file():
                raise FileNotFoundError(f"compiled piece {key} is not in the compile cache")
            self.stats.distinct_pieces += 1
            self._add_piece(key, CompiledArtifact.load(path=str(path), format="binary"))
            self.stats.loaded += 1
        return self._pieces[key]

    def _add_piece(self, key: str, artifact: Any) -> None:
        """Keep a new distinct piece and log, once per engine, what Inductor made of it."""
        self._pieces[key] = artifact
        report = self.piece_reports[key] = piece_report(key, artifact)
        if report is None:
            logger.info("piece %s: Inductor kept no record of its kernels", key[:12])
        else:
            logger.info("%s", report.describe())

    def _piece_path(self, key: str) -> Path | None:
        return self.cache_dir / f"{key}.bin" if self.cache_dir is not None else None

    def compile_piece(self, piece: fx.GraphModule, inputs: list[Any], key: str) -> Callable[..., Any]:
        """The compiled callable for `piece`: shared with an identical earlier piece, loaded, or compiled."""
        from torch._inductor import standalone_compile

        path = self._piece_path(key)
        if key in self._pieces or (path is not None and path.is_file()):
            return self.load_piece(key)
        self.stats.pieces += 1
        self.stats.distinct_pieces += 1
        options = piece_options(inputs, self.platform, self.inductor_options)
        artifact = standalone_compile(
            piece, inputs, dynamic_shapes="from_tracing_context", options={"config_patches": options}
        )
        self.stats.compiled += 1
        self.stats.compiled_cpp_wrapper += options["cpp_wrapper"]
        if path is not None:
            write_atomically(path, lambda tmp: artifact.save(path=str(tmp), format="binary"))
        self._add_piece(key, artifact)
        return artifact


# The backend whose pieces a `CompiledGraph` being deserialised uses (`StrataBackend.loading`).
_LOADING_BACKEND: contextvars.ContextVar[StrataBackend] = contextvars.ContextVar("strata_loading_backend")


class _EagerAttention:
    """An attention submodule of the split graph run as its op's Python implementation.

    The split graph runs outside any trace, so the custom op's dispatcher round trip and the submodule's own
    GraphModule call buy nothing there but time, per layer and step; eager forwards skip them the
    same way (`LayerNameOp.__call__`). The submodule stays in the saved graph.
    """

    def __init__(self, impl: Callable[..., Any], call: fx.Node, placeholders: list[fx.Node]) -> None:
        self.impl = impl
        position = {node: index for index, node in enumerate(placeholders)}
        # Per argument of the call: the index of the input it is, or None and the constant it is.
        self.arguments = [(position[a], None) if isinstance(a, fx.Node) else (None, a) for a in call.args]

    def __call__(self, *inputs: Any) -> tuple[Any]:
        return (self.impl(*[value if index is None else inputs[index] for index, value in self.arguments]),)


def _eager_attention(submodule: torch.nn.Module) -> Callable[..., Any]:
    """`_EagerAttention` for a submodule that is one attention call on its inputs; any other, unchanged."""
    if not isinstance(submodule, fx.GraphModule):
        return submodule
    nodes = list(submodule.graph.nodes)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    calls = [node for node in nodes if node.op not in ("placeholder", "output")]
    if len(calls) != 1 or not is_attention(calls[0]) or calls[0].kwargs or nodes[-1].args != ((calls[0],),):
        return submodule
    if any(isinstance(arg, fx.Node) and arg.op != "placeholder" for arg in calls[0].args):
        return submodule
    return _EagerAttention(_SPLIT_POINTS[calls[0].target], calls[0], placeholders)


class CompiledGraph(SerializableCallable):
    """The split forward with its compiled pieces: what the backend returns to Dynamo.

    Runs the split graph with its pieces called as `_PieceCall`s and its attention submodules as
    `_EagerAttention`s: plain callables, which skip `nn.Module.__call__` (two per layer a step). Serialised as the split graph
    with each compiled piece replaced by its key; deserialising takes the pieces from the backend of
    `StrataBackend.loading`.
    """

    def __init__(self, split: fx.GraphModule, piece_keys: dict[str, str], platform: Platform) -> None:
        self.split = split
        self.piece_keys = piece_keys
        children = {
            name: _PieceCall(module.compiled, platform) if name in piece_keys else _eager_attention(module)
            for name, module in split.named_children()
        }
        self.runtime = fx.GraphModule(children, split.graph)

    def __call__(self, *args: Any) -> Any:
        recorder = _RECORDER.get()
        if recorder is not None:
            return recorder.record(self, args)
        return self.run(args)

    def run(self, args: Sequence[Any]) -> Any:
        """The split graph's generated code on `args`: `nn.Module.__call__` and the GraphModule's traceback
        wrapper cost time every step, and there are no hooks to run."""
        return self.runtime.forward(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: CompiledGraph) -> bytes:
        from torch.fx._graph_pickler import GraphPickler, Options

        modules: dict[str, torch.nn.Module] = {}
        for name, module in fn.split.named_children():
            if name in fn.piece_keys:
                modules[name] = torch.nn.Module()  # the piece is saved by its key
            else:
                modules[name] = module
                _drop_trace_metadata(module.graph)
        _drop_trace_metadata(fn.split.graph)
        saved = fx.GraphModule(modules, fn.split.graph)
        return pickle.dumps(
            {"split": GraphPickler.dumps(saved, Options(ops_filter=None)), "keys": fn.piece_keys}
        )

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> CompiledGraph:
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler

        backend = _LOADING_BACKEND.get(None)
        if backend is None:
            raise RuntimeError("a Strata compiled graph loads only inside StrataBackend.loading()")
        state = pickle.loads(data)
        split = GraphPickler.loads(state["split"], FakeTensorMode())
        for name, key in state["keys"].items():
            setattr(split, name, _CompiledPiece(backend.load_piece(key)))
        split.recompile()
        return cls(split, state["keys"], backend.platform)


@dataclass
class GraphCall:
    """One call of a `CompiledGraph`: its arguments and, where it ran, its outputs."""

    graph: CompiledGraph
    args: tuple[Any, ...]
    outputs: Any = None


class GraphCallSkipped(Exception):
    """Raised from a `CompiledGraph` call that a `GraphCallRecorder(run=False)` recorded and did not run."""


class GraphCallRecorder:
    """Within `with GraphCallRecorder(run):`, every `CompiledGraph` call is recorded (`calls`). With
    `run=False` it is not run but abandoned with `GraphCallSkipped`: the caller learns the arguments Dynamo's
    code built for the graph without running the forward."""

    def __init__(self, run: bool) -> None:
        self.run = run
        self.calls: list[GraphCall] = []
        self._token: contextvars.Token[GraphCallRecorder | None] | None = None

    def __enter__(self) -> GraphCallRecorder:
        self._token = _RECORDER.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._token is not None
        _RECORDER.reset(self._token)

    def record(self, graph: CompiledGraph, args: tuple[Any, ...]) -> Any:
        call = GraphCall(graph, args)
        self.calls.append(call)
        if not self.run:
            raise GraphCallSkipped
        call.outputs = graph.run(args)
        return call.outputs


# The recorder in effect in this thread (a context variable: another engine's step in another thread, as the
# server runs them, must not be recorded, let alone skipped).
_RECORDER: contextvars.ContextVar[GraphCallRecorder | None] = contextvars.ContextVar(
    "strata_graph_call_recorder", default=None
)


def _drop_trace_metadata(graph: fx.Graph) -> None:
    """Fake values and source stacks matter while compiling, not to run the graph (and do not pickle)."""
    for node in graph.nodes:
        node.meta = {}


