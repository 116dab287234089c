"""Compiling the model forward of one engine: Dynamo traces it once, token dimension unbacked-dynamic."""

from __future__ import annotations

import functools
import hashlib
import json
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strata import __version__
from strata.compilation.backend import CompileStats, StrataBackend
from strata.compilation.layer_name import LayerName
from strata.compilation.passes import PassManager, build_passes
from strata.config import ConfigError, EngineConfig
from strata.models.transformers.attention import LAYER_NAME_ATTR


def cache_key(config: EngineConfig) -> str:
    """What decides whether compiled pieces on disk fit this engine, beyond each piece's own graph hash."""
    compilation = config.compilation_config
    parts = {
        "model": config.model_config.hf_config.to_json_string(use_diff=False),
        "dtype": str(config.model_config.torch_dtype),
        "quantization": config.model_config.quantization,
        "strata": __version__,
        "torch": torch.__version__,
        "layers": [config.layer_config.layer_impl, config.layer_config.custom_ops],
        "mode": compilation.mode,
        "use_layer_name": compilation.use_layer_name,
        "passes": sorted(compilation.passes.items()),
        "device": config.device,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> Any:
    return model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits[0]


def _layer_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).forward(layer, *args, **kwargs)


def _fresh(fn: Any, name: str) -> Any:
    """A copy of `fn` with its own code object, hence its own Dynamo cache."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers: the longest `ModuleList` whose entries each hold one attention layer."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            counts = [sum(hasattr(m, LAYER_NAME_ATTR) for m in layer.modules()) for layer in module]
            if counts and all(count == 1 for count in counts):
                best = list(module)
    return best


def _mark_token_dim(args: Any, num_tokens: int) -> None:
    """Mark dim 1 (the token dim of HF's `[1, tokens, ...]` tensors) of every tensor that has it unbacked."""
    for value in torch.utils._pytree.tree_leaves(args):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == num_tokens:
            torch._dynamo.decorators.mark_unbacked(value, 1)


# transformers registers each model class it builds in this global; another engine building another
# architecture grows it, which must not invalidate this engine's graph (its own class's entry is unchanged).
_UNGUARDED_GLOBALS = ("_CAN_RECORD_REGISTRY",)


def _keep_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's guard filter: drop guards that would recompile for reasons that cannot change the graph.

    A layer's name is fixed when the model is built, and with `LayerName` the name is a graph input that
    the pieces never specialise on, so guarding its value would only cost one comparison per layer per step.
    """
    return [
        not isinstance(entry.value, LayerName) and not any(name in entry.name for name in _UNGUARDED_GLOBALS)
        for entry in entries
    ]


def _call_layer(
    compiled: Any, layer: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    _mark_token_dim((hidden_states, args, kwargs), hidden_states.shape[1])
    return compiled(layer, hidden_states, *args, **kwargs)


class CompiledForward:
    """`model(input_ids, positions, keep) -> logits` through `torch.compile` with Strata's backend.

    The token count and the number of kept rows are marked unbacked, so the first trace holds for every
    batch size, one included (a backed size of 1 would be specialised). Each engine compiles its own copy
    of the forward's code object: Dynamo keeps its cache per code object, so engines in one process neither
    share nor evict each other's entries.
    """

    def __init__(self, model: nn.Module, config: EngineConfig) -> None:
        compilation = config.compilation_config
        cache_dir = Path(compilation.cache_dir) / cache_key(config) if compilation.use_cache else None
        layer_names = [getattr(m, LAYER_NAME_ATTR) for m in model.modules() if hasattr(m, LAYER_NAME_ATTR)]
        self.passes = PassManager(build_passes(layer_names, compilation.pass_enabled))
        self.backend = StrataBackend(self.passes, cache_dir)
        self.model = model
        self.evaluate_guards = compilation.evaluate_guards
        self._compiled: Any = None
        if compilation.mode == "model":
            self._compiled = self._compile(_fresh(_forward, "strata_forward"))
            return
        # "layer": Dynamo traces the decoder layer's forward once and every layer reuses it (with
        # LayerName the layers differ only in parameters and name, both graph inputs). With str names
        # each layer gets its own code object, so its name is guarded and baked into its own graph.
        layers = decoder_layers(model)
        if not layers:
            raise ConfigError(
                f"compilation mode 'layer' needs a list of decoder layers; {type(model).__name__} has none "
                "Strata recognises; use mode 'model'"
            )
        shared = (
            self._compile(_fresh(_layer_forward, "strata_layer_forward"))
            if compilation.use_layer_name
            else None
        )
        for index, layer in enumerate(layers):
            compiled = shared or self._compile(_fresh(_layer_forward, f"strata_layer_{index}_forward"))
            layer.forward = functools.partial(_call_layer, compiled, layer)

    def _compile(self, fn: Any) -> Any:
        return torch.compile(
            fn, backend=self.backend, fullgraph=True, dynamic=False, options={"guard_filter_fn": _keep_guards}
        )

    @property
    def stats(self) -> CompileStats:
        return self.backend.stats

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self.stats.dynamo_graphs and not self.evaluate_guards:
            # Traced: nothing a guard checks can change any more (the token count is unbacked, the weights
            # and names are fixed per engine), so evaluating the guards (about 1 ms a step for a small model)
            # only costs time. `evaluate_guards` keeps them, to prove that in tests.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._call(input_ids, positions, keep)
        return self._call(input_ids, positions, keep)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self._compiled is None:
            return _forward(self.model, input_ids, positions, keep)
        torch._dynamo.decorators.mark_unbacked(input_ids, 1)
        torch._dynamo.decorators.mark_unbacked(positions, 1)
        torch._dynamo.decorators.mark_unbacked(keep, 0)
        return self._compiled(self.model, input_ids, positions, keep)
