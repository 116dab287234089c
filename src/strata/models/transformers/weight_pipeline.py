"""The way of each checkpoint tensor into the model, one step at a time, and the checks once all arrived.

A tensor is renamed to the place it fills (`WeightTarget`: the model's own name, a fused layer's parameter,
transformers' checkpoint conversions), transposed where stored [in, out], checked against that place's
shape, assembled with its sibling pieces (a merged projection's shards, a mixture of experts' per-expert
tensors), then stored: into a parameter, an int8 linear (quantized on arrival) or a persistent buffer.
After the stream, tied parameters are filled from their sources and any missing or unexpected tensor is
reported by name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

try:  # transformers' checkpoint conversions (its loading internals; absent from some 5.x releases)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
    )
except ImportError:
    get_model_conversion_mapping = None

from strata.hw_agnostic.layers import Int8Linear
from strata.models.transformers.fusers import WeightMapping, WeightTarget

logger = logging.getLogger("strata.models.loader")

# (name, tensor) pairs as a checkpoint yields them, one tensor in memory at a time.
TensorStream = Iterable[tuple[str, torch.Tensor]]


class WeightLoadError(ValueError):
    """The checkpoint does not match the model built from its config."""


def load_weights(
    model: nn.Module,
    tensors: TensorStream,
    folder: str,
    dtype: torch.dtype,
    weight_mapping: WeightMapping | None = None,
    preloaded: set[str] | None = None,
) -> None:
    """Replace each meta parameter by its checkpoint tensor (`tensors`, read from `folder`; `preloaded`
    names the parameters already in place); tie what the config ties; name any mismatch.

    `weight_mapping` sends checkpoint names of replaced modules to their new parameters; a sharded target
    (a merged gate/up projection) is assembled from its shards and set once all of them arrived. The
    weight of an int8 linear is quantized as it arrives (from float32, not `dtype`), and int8 checkpoint
    pairs arrive dequantized one at a time (`weight_sources`), so no full floating-point copy of the model
    is ever held.
    """
    target_of = target_resolver(model, weight_mapping or {})
    places = ModelPlaces(model, dtype, preloaded or set())
    pieces = PieceAssembly()
    unexpected: list[str] = []
    for name, tensor in tensors:
        target = target_of(name)
        tensor = oriented(target, tensor)
        full_shape = places.full_shape(target.param)
        if full_shape is None:
            if not places.load_buffer(name, target.param, tensor, folder):
                unexpected.append(name)
            continue
        check_shape(name, tensor, target, full_shape, folder)
        whole = pieces.add(target, tensor, full_shape, places.assembly_dtype(target.param))
        if whole is not None:
            places.store(target.param, whole)
    places.tie()
    report_mismatch(model, places, unexpected, folder)
    logger.info("loaded %d tensors from %s", len(places.loaded), folder)


# -- rename ---------------------------------------------------------------------------------------------------
def target_resolver(model: nn.Module, weight_mapping: WeightMapping) -> Callable[[str], WeightTarget]:
    """Where each checkpoint tensor goes: a replaced module's parameter (`weight_mapping`), else where
    transformers' conversions send it, else the parameter of its own name."""
    converted = checkpoint_conversion(model)
    return lambda name: weight_mapping.get(name) or converted(name) or WeightTarget(name)


def _supported_merge(converter: WeightConverter) -> bool:
    """Whether a converter only stacks per-expert tensors (dim 0), then joins its sources side by side
    (dim 1): the one form of transformers' checkpoint conversions that the loader assembles."""
    operations = converter.operations
    if not operations or not isinstance(operations[0], MergeModulelist) or operations[0].dim != 0:
        return False
    rest = operations[1:]
    return not rest or (len(rest) == 1 and isinstance(rest[0], Concatenate) and rest[0].dim == 1)


def checkpoint_conversion(model: nn.Module) -> Callable[[str], WeightTarget | None]:
    """Where transformers' checkpoint conversions for `model` send a checkpoint tensor (None: its own name).

    transformers renames some checkpoint names as it loads them, and fuses a mixture of experts' per-expert
    tensors (`experts.3.gate_proj.weight`, `experts.3.up_proj.weight`) into one parameter for all experts
    (`experts.gate_up_proj`, [experts, gate and up rows, hidden]). Strata streams tensors one at a time, so
    each such tensor gets the place it fills in the fused parameter; the conversions themselves come from
    transformers, so every model it converts this way loads."""
    if get_model_conversion_mapping is None:
        return lambda name: None  # such checkpoints then fail to load with their tensors named
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}

    def target(name: str) -> WeightTarget | None:
        renamed = apply_renamings(name, renamings)
        param, pattern = apply_converters(renamed, converters)
        if pattern is None:
            return None if param == name else WeightTarget(param)
        converter = next(c for c in converters if pattern in c.source_patterns)
        if not _supported_merge(converter):
            raise WeightLoadError(
                f"tensor {name} needs transformers' conversion {converter.operations} into {param}, which "
                "Strata's loader does not do"
            )
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
        if found is None or param not in shapes:
            return WeightTarget(param)  # reported as unexpected or mismatched where it is loaded
        return WeightTarget(
            param,
            shard=converter.source_patterns.index(pattern),
            num_shards=len(converter.source_patterns),
            expert=int(found.group(1)),
            num_experts=shapes[param][0],
        )

    return target


# -- transpose, shape check -----------------------------------------------------------------------------------
def oriented(target: WeightTarget, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as its parameter holds it: transposed where the checkpoint stores it [in, out]."""
    return tensor.t().contiguous() if target.transpose else tensor


def _piece_shape(target: WeightTarget, full_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the piece `target` fills: one expert's part of a stacked parameter is the parameter
    without its first dim, and a shard has 1/num_shards of its rows."""
    piece_shape = full_shape[1:] if target.expert is not None else full_shape
    if target.num_shards == 1:
        return piece_shape
    return (piece_shape[0] // target.num_shards, *piece_shape[1:])


def check_shape(
    name: str, tensor: torch.Tensor, target: WeightTarget, full_shape: tuple[int, ...], folder: str
) -> None:
    """Raise when the tensor is not the shape of the piece it fills, or names an expert the model lacks."""
    expected_shape = _piece_shape(target, full_shape)
    if tuple(tensor.shape) != expected_shape or not 0 <= (target.expert or 0) < target.num_experts:
        raise WeightLoadError(
            f"tensor {name} in {folder} has shape {tuple(tensor.shape)}, the model expects {expected_shape}"
            + (f" for expert {target.expert} of {target.num_experts}" if target.expert is not None else "")
        )


# -- expert and shard assembly --------------------------------------------------------------------------------
class PieceAssembly:
    """Parameters stored as pieces (a merged gate/up projection's shards, a mixture of experts' per-expert
    tensors): each piece is copied into its place, and the whole is handed on once every piece arrived."""

    def __init__(self) -> None:
        self._assembling: dict[str, tuple[torch.Tensor, set[tuple[int | None, int]]]] = {}

    def add(
        self, target: WeightTarget, tensor: torch.Tensor, full_shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The whole parameter when `tensor` completes it (`tensor` itself when it is whole), else None."""
        if target.num_shards == 1 and target.expert is None:
            return tensor
        if target.param not in self._assembling:
            self._assembling[target.param] = (torch.empty(full_shape, dtype=dtype), set())
        merged, pieces = self._assembling[target.param]
        block = merged[target.expert] if target.expert is not None else merged
        shard_rows = tensor.shape[0]
        block[target.shard * shard_rows : (target.shard + 1) * shard_rows] = tensor
        pieces.add((target.expert, target.shard))
        if len(pieces) < target.num_shards * target.num_experts:
            return None
        del self._assembling[target.param]
        return merged


# -- store, tie -----------------------------------------------------------------------------------------------
class ModelPlaces:
    """The places of a model a checkpoint tensor can fill (parameters, int8 linears' float weights,
    persistent buffers), what has been filled, and the ties between parameters."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, preloaded: set[str]) -> None:
        self.model, self.dtype = model, dtype
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = _persistent_buffers(model)
        # `<path>.weight` of each int8 linear: the float weight its `qweight` and `scale` are quantized from.
        self.int8_layers = {f"{path}.weight": m for path, m in model.named_modules() if isinstance(m, Int8Linear)}
        self.ties = model.get_expanded_tied_weights_keys(all_submodels=True)
        self._tie_targets = {source: target for target, source in self.ties.items()}
        # A tied head stored before (or instead of) the embedding: its floats, kept for the embedding.
        self._tied_floats: dict[str, torch.Tensor] = {}
        self.loaded: set[str] = set(preloaded)

    def full_shape(self, param: str) -> tuple[int, ...] | None:
        """The shape of parameter `param` (an int8 linear's: of its float weight); None when none has it."""
        int8_layer = self.int8_layers.get(param)
        if int8_layer is not None:
            return (int8_layer.out_features, int8_layer.in_features)
        if param in self.params:
            return tuple(self.params[param].shape)
        return None

    def assembly_dtype(self, param: str) -> torch.dtype:
        """The dtype pieces of `param` are assembled in: float32 for an int8 linear, quantized from it."""
        return torch.float32 if param in self.int8_layers else self.dtype

    def load_buffer(self, name: str, buffer_name: str, tensor: torch.Tensor, folder: str) -> bool:
        """Copy `tensor` into the persistent buffer `buffer_name`; False when the model has no such buffer."""
        buffer = self.buffers.get(buffer_name)
        if buffer is None:
            return False
        if tensor.shape != buffer.shape:
            raise WeightLoadError(
                f"tensor {name} in {folder} has shape {tuple(tensor.shape)}, the model expects {tuple(buffer.shape)}"
            )
        with torch.no_grad():
            buffer.copy_(tensor)
        return True

    def store(self, param: str, tensor: torch.Tensor) -> None:
        """Put the whole tensor of `param` in place: quantized on arrival into an int8 linear, else as a
        parameter of the model's dtype."""
        int8_layer = self.int8_layers.get(param)
        if int8_layer is not None:
            int8_layer.load_float_weight(tensor)
            prefix = param.removesuffix(".weight")
            self.loaded |= {param, f"{prefix}.qweight", f"{prefix}.scale"}
            if param in self.ties and self.ties[param] not in self.loaded:
                self._tied_floats[param] = tensor
        else:
            _set_parameter(self.model, param, nn.Parameter(tensor.to(self.dtype), requires_grad=False))
            self.loaded.add(param)
            self._tied_floats.pop(self._tie_targets.get(param, ""), None)

    def tie(self) -> None:
        """Fill each tied parameter the checkpoint lacks from its partner: a head from its embedding (an
        int8 head gets its own int8 copy), or an embedding from the head stored instead of it."""
        for target, source in self.ties.items():
            if target not in self.loaded and source in self.loaded:
                if target in self.int8_layers:
                    self.int8_layers[target].load_float_weight(self.model.get_parameter(source))
                    prefix = target.removesuffix(".weight")
                    self.loaded |= {f"{prefix}.qweight", f"{prefix}.scale"}
                else:
                    _set_parameter(self.model, target, self.model.get_parameter(source))
                self.loaded.add(target)
            elif source not in self.loaded and target in self.loaded:
                weight = self._tied_floats.pop(target, None)
                tied = (
                    self.model.get_parameter(target)
                    if weight is None
                    else nn.Parameter(weight.to(self.dtype), requires_grad=False)
                )
                _set_parameter(self.model, source, tied)
                self.loaded.add(source)


# -- report ---------------------------------------------------------------------------------------------------
def report_mismatch(model: nn.Module, places: ModelPlaces, unexpected: list[str], folder: str) -> None:
    """Raise naming (the first ten of) the parameters no tensor filled and the tensors with no place."""
    missing = sorted(set(places.params) - places.loaded)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing tensors: {_first_names(missing)}")
    if unexpected:
        parts.append(f"unexpected tensors: {_first_names(unexpected)}")
    raise WeightLoadError(f"checkpoint in {folder} does not match {type(model).__name__}: " + "; ".join(parts))


def _first_names(names: list[str]) -> str:
    return f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint may hold (a learned activation's constants, say): those in the state dict.
    The model made them when it was built, so one the checkpoint lacks keeps that value."""
    return {
        f"{path}.{name}" if path else name: buffer
        for path, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    module._parameters[attr] = param
