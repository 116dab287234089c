"""Compiling the model forward of one engine: Dynamo traces it once, token dimension unbacked-dynamic."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch._dynamo.aot_compile import AOTCompiledFunction

from strata import __version__
from strata.atomic_file import write_atomically
from strata.compilation.backend import (
    INDUCTOR_OPTIONS,
    CompiledGraph,
    CompileStats,
    GraphCallRecorder,
    GraphCallSkipped,
    StrataBackend,
)
from strata.compilation.layer_name import LAYER_NAME_ATTR, LayerName
from strata.compilation.passes import PassManager
from strata.config import ConfigError, EngineConfig
from strata.distributed.parallel_state import pp_rank, pp_world_size
from strata.process_local import ProcessLocal

logger = logging.getLogger("strata.compilation")


@functools.cache
def source_digest() -> str:
    """A hash of Strata's Python sources: a saved trace holds the graph of the code it traced (the reference
    layers, the GGUF decoders, the model's adapters), which a released version number does not pin while the
    code is being worked on."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def cache_key(config: EngineConfig) -> str:
    """What decides whether compiled pieces on disk fit this engine, beyond each piece's own graph hash."""
    compilation = config.compilation_config
    platform = config.platform
    parts = {
        "model": config.model_config.hf_config.to_json_string(use_diff=False),
        "dtype": str(config.model_config.torch_dtype),
        "quantization": config.model_config.quantization,
        "strata": [__version__, source_digest()],
        "torch": torch.__version__,
        "transformers": transformers.__version__,  # the modeling code the trace holds
        "layers": [config.layer_config.layer_impl, config.layer_config.custom_ops],
        "mode": compilation.mode,
        "use_layer_name": compilation.use_layer_name,
        "passes": [name for name in platform.graph_passes() if compilation.pass_enabled(name)],
        "device": config.device,
        # Pipeline stages hold different layers, so their graphs differ.
        "pipeline_stage": [pp_rank(), pp_world_size()],
        # The traced graph calls the platform's kernel ops, with the schemas their sources define.
        "platform": platform.compile_cache_key(),
        "inductor": sorted(
            {**INDUCTOR_OPTIONS, **platform.inductor_options(), **compilation.inductor_compile_config}.items()
        ),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


# A step has at least one token. Told so, the compiler can resolve HF's `reshape(*shape, -1)` on tensors
# whose token count is unbacked (the -1 is only defined for a non-empty tensor).


def _forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> Any:
    torch._check(input_ids.shape[1] > 0)
    return model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits[0]


def _hidden_forward(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
) -> Any:
    """A pipeline stage before the last: the base model's hidden states of every token (`keep` unused)."""
    torch._check(input_ids.shape[1] > 0)
    return model.base_model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state[0]


def model_forward(hidden: bool) -> Callable[..., Any]:
    """The forward of a model's last pipeline stage (logits of the kept rows), or of one before it."""
    return _hidden_forward if hidden else _forward


def _layer_forward(
    layer: nn.Module, hidden_states: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    torch._check(hidden_states.shape[1] > 0)
    return type(layer).forward(layer, hidden_states, *args, **kwargs)


def _fresh(fn: Any, name: str) -> Any:
    """A copy of `fn` with its own code object, hence its own Dynamo cache."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers this process runs: the longest `ModuleList` whose entries each hold one
    attention layer, less those another pipeline stage runs."""
    best: list[nn.Module] = []
    for module in model.modules():
        local = (
            [layer for layer in module if not getattr(layer, "is_other_stage", False)]
            if isinstance(module, nn.ModuleList)
            else []
        )
        if len(local) > len(best):
            counts = [sum(hasattr(m, LAYER_NAME_ATTR) for m in layer.modules()) for layer in local]
            if all(count == 1 for count in counts):
                best = local
    return best


def _with_unbacked_dims(args: Any, dims: Callable[[torch.Tensor], Sequence[int]]) -> Any:
    """`args` with each tensor replaced by an alias whose `dims(tensor)` are marked unbacked for tracing.

    Aliases, so the caller's tensors stay unmarked: a saved trace's guards do not know the marks, and the
    trace in use must check its guards as the saved one will.
    """

    def marked(tensor: torch.Tensor) -> torch.Tensor:
        alias = tensor.detach()
        for dim in dims(tensor):
            torch._dynamo.decorators.mark_unbacked(alias, dim)
        return alias

    return torch.utils._pytree.tree_map_only(torch.Tensor, marked, args)


# transformers registers each model class it builds in this global; another engine building another
# architecture grows it, which must not invalidate this engine's graph (its own class's entry is unchanged).
_UNGUARDED_GLOBALS = ("_CAN_RECORD_REGISTRY",)


def _keep_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's guard filter: drop guards that would recompile for reasons that cannot change the graph, and
    those a saved trace cannot hold.

    A layer's name is fixed when the model is built, and with `LayerName` the name is a graph input that
    the pieces never specialise on, so guarding its value would only cost one comparison per layer per step.
    Identity guards (this very module or function object) cannot outlive the process; a trace loaded from
    disk is checked against the next process's objects by their types, attributes and tensor properties.
    """
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not isinstance(entry.value, LayerName)
        and not any(name in entry.name for name in _UNGUARDED_GLOBALS)
        and entry.guard_type not in unsaveable
        and not set(entry.derived_guard_types or ()) & unsaveable
        for entry in entries
    ]


class TracedFunction:
    """One function Dynamo traces ahead of time (`aot_compile`), with each trace saved to and loaded from disk.

    A trace holds for the calls its guards accept. `select` returns the first trace whose guards accept the
    arguments, tracing a new one only when none does, so a decoder layer whose attributes differ from the
    others' (a sliding-window layer, say) gets a trace of its own and never runs another layer's graph. Traces
    are saved as `<name>-<index>.dynamo` beside the compiled pieces and loaded on the next start: a warm start
    runs neither Dynamo nor Inductor.
    """

    def __init__(self, fn: Any, backend: StrataBackend, cache_dir: Path | None, check_guards: bool) -> None:
        self.fn = fn
        self.backend = backend
        self.cache_dir = cache_dir
        self.check_guards = check_guards
        self.traces: list[Any] = self._load() if cache_dir is not None else []

    def _path(self, index: int) -> Path:
        assert self.cache_dir is not None
        return self.cache_dir / f"{self.fn.__name__}-{index}.dynamo"

    def _load(self) -> list[Any]:
        traces = []
        start = time.perf_counter()
        while (path := self._path(len(traces))).is_file():
            try:
                traces.append(self._deserialize(path.read_bytes(), loaded=True))
            except Exception as exc:  # any unreadable trace is traced again, not fatal
                logger.warning("could not load the saved trace %s (%s); tracing again", path, exc)
                break
        self.backend.stats.seconds += time.perf_counter() - start
        return traces

    def _deserialize(self, data: bytes, loaded: bool) -> Any:
        """A trace from its saved bytes. Tensor guards are rebuilt from the saved tensors: built in inference
        mode, as the engine runs, they expect the dispatch keys of the engine's tensors."""
        with self.backend.loading(count=loaded), torch.inference_mode():
            trace = AOTCompiledFunction.deserialize(data, f_globals=self.fn.__globals__)
        if not self.check_guards:
            trace.disable_guard_check()
        return trace

    def select(self, args: tuple[Any, ...], unbacked: Callable[[torch.Tensor], Sequence[int]]) -> Any:
        """The trace for these arguments, traced (and saved) if no earlier one accepts them.

        `unbacked(tensor)` names a tensor's dimensions that vary between calls (traced unbacked). A new trace is
        used in its saved form, as the next start loads it, so both check their guards alike.
        """
        for trace in self.traces:
            if trace.guard_check(*args):
                return trace
        compiled = torch.compile(
            self.fn,
            backend=self.backend,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": _keep_guards},
        )
        data = AOTCompiledFunction.serialize(
            compiled.aot_compile((_with_unbacked_dims(args, unbacked), {}))
        ).serialized_data
        if self.cache_dir is not None:
            write_atomically(self._path(len(self.traces)), lambda tmp: tmp.write_bytes(data))
        self.traces.append(self._deserialize(data, loaded=False))
        return self.traces[-1]


class _LayerCall(ProcessLocal):
    """A decoder layer's forward through its trace: the first call selects the trace, later calls reuse it.
    Process-local: it sits in the layer's `__dict__`, which a saved trace pickles, and reaches the compiled
    pieces, which belong to this process."""

    def __init__(self, traced: TracedFunction, layer: nn.Module) -> None:
        self.traced = traced
        self.layer = layer
        self.trace: Any = None

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.trace is None or self.traced.check_guards:
            tokens = hidden_states.shape[1]  # dim 1 of HF's [1, tokens, ...] tensors

            def unbacked(tensor: torch.Tensor) -> Sequence[int]:
                return (1,) if tensor.dim() >= 2 and tensor.shape[1] == tokens else ()

            self.trace = self.traced.select((self.layer, hidden_states, args, kwargs), unbacked)
        return self.trace(self.layer, hidden_states, args, kwargs)


@dataclass
class DirectForward:
    """The traced forward's split graph called with an argument list built here instead of by Dynamo.

    Each call of a trace first runs Dynamo's prologue: it fetches every parameter and layer name through the
    module tree (about 270 attribute chains for a 30-layer model) and the sizes the graph takes. After the
    first step none of that changes but the three inputs and their sizes, so the list is built once
    (`template`) and only those are put in (`inputs`: argument position, which input, and its dimension, or
    None for the tensor itself). At batch 1 the prologue is a visible share of a small model's step.
    """

    graph: CompiledGraph
    template: list[Any]
    inputs: list[tuple[int, int, int | None]]
    output: int  # which output of the graph the forward returns

    def arguments(self, inputs: Sequence[torch.Tensor]) -> list[Any]:
        args = self.template.copy()
        for position, which, dim in self.inputs:
            args[position] = inputs[which] if dim is None else inputs[which].shape[dim]
        return args

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graph(*self.arguments(inputs))[self.output]


def _probe_inputs(inputs: Sequence[torch.Tensor], sizes: Iterator[int]) -> tuple[torch.Tensor, ...]:
    """Zero tensors like `inputs` (dtype, device, number of dimensions), each dimension sized by `sizes`."""
    return tuple(
        torch.zeros([next(sizes) for _ in tensor.shape], dtype=tensor.dtype, device=tensor.device)
        for tensor in inputs
    )


def _argument_source(
    values: Sequence[Any], probes: Sequence[Sequence[torch.Tensor]]
) -> tuple[int, int | None] | None:
    """Which probe input (and dimension, or None for the tensor) an argument's value in each probe is."""
    for which in range(len(probes[0])):
        if all(value is probe[which] for value, probe in zip(values, probes, strict=True)):
            return which, None
        for dim in range(probes[0][which].dim()):
            if all(
                type(value) is int and value == probe[which].shape[dim]
                for value, probe in zip(values, probes, strict=True)
            ):
                return which, dim
    return None


def _same_value(a: Any, b: Any) -> bool:
    """The same object, or equal ints (a prologue may build an int anew each call)."""
    return a is b or (type(a) is int and a == b)


def derive_direct_forward(
    trace: Callable[..., Any], model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> tuple[Any, DirectForward | None]:
    """Run `trace(model, *inputs)` and learn how to call its graph directly: returns the forward's result and
    the `DirectForward`, or None where that is not sure to hold.

    It asks the trace's prologue for the graph's arguments twice with probe inputs whose every dimension has a
    size of its own (the graph is not run), so each argument shows what it is: one of the inputs, one of
    their sizes, or an object that is the same both times (a parameter, a layer name, a constant). Then the
    real call is recorded, and the list built from that reading must be the very list the prologue built,
    and the forward's result one of the graph's outputs.
    """
    # Every dimension its own size, and the second probe's sizes 2 * s + 1 of the first's: no size of one
    # dimension is another's plus or times a constant in both probes.
    first_sizes = [37 + 4 * index for index in range(sum(tensor.dim() for tensor in inputs))]
    probes = [
        _probe_inputs(inputs, iter(first_sizes)),
        _probe_inputs(inputs, iter(2 * size + 1 for size in first_sizes)),
    ]
    recorded = []
    for probe in probes:
        with GraphCallRecorder(run=False) as recorder:
            try:
                trace(model, *probe)
            except GraphCallSkipped:
                pass
            except Exception:  # the prologue refused a probe: no direct call, the real one still runs
                recorder.calls.clear()
        recorded.append(recorder.calls)
    with GraphCallRecorder(run=True) as recorder:
        result = trace(model, *inputs)
    calls = [*recorded, recorder.calls]
    if any(len(call) != 1 for call in calls) or len({id(call[0].graph) for call in calls}) != 1:
        return result, None
    (first,), (second,), (real,) = calls
    if not len(first.args) == len(second.args) == len(real.args):
        return result, None
    template: list[Any] = []
    sources = []
    for position, values in enumerate(zip(first.args, second.args, strict=True)):
        source = _argument_source(values, probes)
        if source is not None:
            sources.append((position, *source))
        elif not _same_value(*values):
            return result, None  # made anew by each prologue: not known here
        template.append(None if source is not None else values[0])
    outputs = real.outputs if isinstance(real.outputs, tuple | list) else ()
    output = next((index for index, value in enumerate(outputs) if value is result), None)
    if output is None:
        return result, None
    direct = DirectForward(real.graph, template, sources, output)
    same = all(map(_same_value, direct.arguments(inputs), real.args))
    return result, direct if same else None


class CompiledForward:
    """`model(input_ids, positions, keep) -> logits` traced by Dynamo ahead of time with Strata's backend.

    The token count and the number of kept rows are marked unbacked, so the first trace holds for every
    batch size, one included (a backed size of 1 would be specialised). Each engine traces its own copy of
    the forward's code object, named for what it is, which also names its saved traces.

    Guards are checked when a trace is chosen: in mode "model" on the first step, in mode "layer" on each
    layer's first call. After that nothing a guard checks can change (the token count is unbacked, the
    weights and names are fixed per engine), so evaluating them every step would only cost time; `evaluate_guards` keeps them on every call, to prove that in tests.
    For the same reason, in mode "model" the steps after the first call the graph without the trace's Dynamo
    code (`DirectForward`); mode "layer" still runs it for each layer.
    """

    def __init__(self, model: nn.Module, config: EngineConfig, hidden: bool = False) -> None:
        """`hidden`: the model is a pipeline stage before the last, which returns hidden states."""
        compilation = config.compilation_config
        cache_dir = Path(compilation.cache_dir) / cache_key(config) if compilation.use_cache else None
        platform = config.platform
        passes = {name: p for name, p in platform.graph_passes().items() if compilation.pass_enabled(name)}
        self.passes = PassManager(passes)
        self.backend = StrataBackend(self.passes, platform, cache_dir, compilation.inductor_compile_config)
        self.model = model
        self.evaluate_guards = compilation.evaluate_guards
        self._eager = model_forward(hidden)

        def traced(name: str, fn: Any) -> TracedFunction:
            return TracedFunction(_fresh(fn, name), self.backend, cache_dir, compilation.evaluate_guards)

        self._forward: TracedFunction | None = None
        self._trace: Any = None
        self._direct: DirectForward | None = None
        self._direct_tried = False
        if compilation.mode == "model":
            self._forward = traced("strata_stage_forward" if hidden else "strata_forward", self._eager)
        else:
            self._compile_layers(model, compilation.use_layer_name, traced)
        if self.stats.loaded:  # one line for everything the saved traces brought
            self.backend.log_summary()

    def _compile_layers(
        self, model: nn.Module, use_layer_name: bool | None, traced: Callable[[str, Any], TracedFunction]
    ) -> None:
        """Mode "layer": each decoder layer calls a traced layer forward. With `LayerName` all layers share
        one `TracedFunction` (they differ in parameters and name, both graph inputs, and in kind, which its
        guards tell apart); with str names each layer gets its own code object, so its name is guarded and
        baked into its own graph."""
        layers = decoder_layers(model)
        if not layers:
            raise ConfigError(
                f"compilation mode 'layer' needs a list of decoder layers; {type(model).__name__} has none "
                "Strata recognises; use mode 'model'"
            )
        shared = traced("strata_layer_forward", _layer_forward) if use_layer_name else None
        for index, layer in enumerate(layers):
            layer_traced = shared or traced(f"strata_layer_{index}_forward", _layer_forward)
            layer.forward = _LayerCall(layer_traced, layer)

    @property
    def stats(self) -> CompileStats:
        return self.backend.stats

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self._forward is None:
            return self._eager(self.model, input_ids, positions, keep)
        if self._trace is None or self.evaluate_guards:
            # The token dim of input_ids and positions ([1, tokens]) and the kept rows (1-D) vary per step.
            args = (self.model, input_ids, positions, keep)
            self._trace = self._forward.select(args, lambda tensor: (1,) if tensor.dim() == 2 else (0,))
        if self._direct is not None:
            return self._direct(input_ids, positions, keep)
        if not self._direct_tried and not self.evaluate_guards:
            self._direct_tried = True
            result, self._direct = derive_direct_forward(
                self._trace, self.model, (input_ids, positions, keep)
            )
            if self._direct is None:
                logger.info(
                    "the compiled forward keeps Dynamo's calling code: its arguments could not be derived"
                )
            return result
        return self._trace(self.model, input_ids, positions, keep)
