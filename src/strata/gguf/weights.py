"""A GGUF file's weights in a transformers model, the quantized ones kept in their GGUF types.

Names and conversions come from transformers' GGUF integration: `get_gguf_hf_weights_map` pairs each GGUF
tensor with the model's parameter, and the architecture's `TensorProcessor` undoes what llama.cpp's
converter did to it (Llama's rotary row order, Gemma's norm offset, GPT-2's transposes, stacked experts).

A 2-D tensor of a quantized (or 16-bit) type that feeds a linear layer or the embedding table is not
dequantized: that module becomes a `gguf_linear` / `gguf_embedding` layer holding the file's own blocks (a
view of the memory-mapped file, so the weights cost no memory of their own). A mixture of experts' stacked
gate, up and down tensors (`ffn_*_exps`) likewise make transformers' experts module a `gguf_experts`
layer. Transformations that only reorder rows are found by running the processor on a column of row
numbers and applied to the rows of blocks; a tensor whose conversion changes values stays on the dense
path. Every other tensor (norms, biases) is dequantized, processed exactly as transformers does, and
loaded like a safetensors tensor.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import moe
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)
from transformers.pytorch_utils import Conv1D

from strata.gguf.file import GGUFError, architecture, open_gguf
from strata.gguf.quants import COMPUTED_TYPES
from strata.hw_agnostic.layers.gguf import EXPERT_PROJECTIONS
from strata.models.transformers.layers import LayerResolver
from strata.models.transformers.tensor_parallel import LinearShard

logger = logging.getLogger("strata.models.gguf")

# The gguf library's names of a layer's stacked expert tensors ("blk.{bid}.ffn_gate_exps"), as patterns.
_EXPERT_TENSOR_NAMES = {
    name: re.compile(re.escape(TENSOR_NAMES[tensor]).replace(r"\{bid\}", r"\d+") + r"\.weight")
    for name, tensor in zip(
        EXPERT_PROJECTIONS,
        (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP),
        strict=True,
    )
}


@dataclass
class KeptWeight:
    """A module whose weight stays in its GGUF type: the file's tensor, the row order it is read in, and
    this tensor-parallel rank's part of it."""

    module_path: str
    tensor: ReaderTensor
    row_order: np.ndarray | None  # None: the file's own order
    shard: LinearShard | None = None  # None: all of it


class GGUFCheckpoint:
    """One GGUF file's tensors, paired with the parameters of `model` (built from the file's config, its
    parameters on meta, before any of its modules are replaced)."""

    def __init__(self, path: Path, model: nn.Module, dequantize_unsupported: bool = False) -> None:
        self.path = path
        self.reader = open_gguf(path)
        self.dequantize_unsupported = dequantize_unsupported
        arch = architecture(self.reader)
        self.processor: TensorProcessor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
            config=model.config.to_dict()
        )
        try:
            # Named after the file's architecture, which can differ from the model's (Mistral files are
            # "llama" ones).
            with _tensor_name_maps_cached():
                self.name_map: dict[str, str] = get_gguf_hf_weights_map(
                    model, self.processor, model_type=arch
                )
        except NotImplementedError as exc:
            raise GGUFError(
                f"{path.name}: the gguf library cannot name the tensors of {arch!r} ({exc})"
            ) from exc
        self.ties: dict[str, str] = model.get_expanded_tied_weights_keys(all_submodels=True)
        self.kept: dict[str, KeptWeight] = {}  # by the HF parameter name the tensor would have filled
        self.kept_experts: dict[str, dict[str, ReaderTensor]] = {}  # module path -> gate/up/down tensors
        for tensor in self.reader.tensors:
            self._check_type(tensor)

    def _check_type(self, tensor: ReaderTensor) -> None:
        if tensor.tensor_type in COMPUTED_TYPES:
            return
        what = f"{self.path.name}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}"
        if not self.dequantize_unsupported:
            raise GGUFError(
                f"{what}, which Strata does not compute on (it does: "
                f"{', '.join(GGMLQuantizationType(t).name for t in sorted(COMPUTED_TYPES))}); "
                "pass gguf_dequantize=True (--gguf-dequantize) to dequantize such tensors at load"
            )
        logger.warning("%s: dequantized to the model's dtype at load", what)

    # -- which modules keep their GGUF weights ------------------------------------------------------------
    def replace_layers(
        self,
        model: nn.Module,
        resolver: LayerResolver,
        dtype: torch.dtype,
        shards: Mapping[str, LinearShard] | None = None,
    ) -> int:
        """Make each linear and embedding module whose weight the file holds in a quantized (or 16-bit)
        type a `gguf_linear` / `gguf_embedding` layer of that type; returns how many. A linear that
        `shards` (module path -> this tensor-parallel rank's part) splits keeps its part of the blocks:
        rows, or whole blocks of columns (one whose columns do not split at block edges loads dense)."""
        for tensor in self.reader.tensors:
            hf_name = self.name_map.get(tensor.name)
            if hf_name is None or not hf_name.endswith(".weight") or not self._keeps_type(tensor):
                continue
            module_path = hf_name.removesuffix(".weight")
            module = _submodule(model, module_path)
            row_order = self._row_order(tensor, module)
            shard = (shards or {}).get(module_path)
            shape = _local_shape(tensor, shard)
            if row_order is False or shape is None:
                continue
            if (new := self._gguf_layer(module, tensor, resolver, dtype, shape)) is None:
                continue
            model.set_submodule(module_path, new)
            self.kept[hf_name] = KeptWeight(module_path, tensor, row_order, shard)
        # A head tied to a kept embedding (no `output.weight` in the file) reads the same blocks.
        for target, source in self.ties.items():
            kept = self.kept.get(source)
            if kept is None or target in self.kept:
                continue
            module_path = target.removesuffix(".weight")
            shape = _local_shape(kept.tensor, None)
            new = self._gguf_layer(_submodule(model, module_path), kept.tensor, resolver, dtype, shape)
            if new is not None:
                model.set_submodule(module_path, new)
                self.kept[target] = KeptWeight(module_path, kept.tensor, kept.row_order)
        self._replace_experts(model, resolver, dtype)
        return len(self.kept) + len(self.kept_experts)

    def _replace_experts(self, model: nn.Module, resolver: LayerResolver, dtype: torch.dtype) -> None:
        """Make each experts module whose three stacks the file holds in computed types `gguf_experts`."""
        stacks: dict[str, dict[str, ReaderTensor]] = {}
        for tensor in self.reader.tensors:
            projection = next(
                (p for p, rx in _EXPERT_TENSOR_NAMES.items() if rx.fullmatch(tensor.name)), None
            )
            hf_name = self.name_map.get(tensor.name.removesuffix(".weight"))
            if projection is None or hf_name is None or len(tensor.shape) != 3:
                continue
            if tensor.tensor_type == GGMLQuantizationType.F32 or tensor.tensor_type not in COMPUTED_TYPES:
                continue
            stacks.setdefault(hf_name.rpartition(".")[0], {})[projection] = tensor
        for module_path, tensors in stacks.items():
            module = _submodule(model, module_path)
            if len(tensors) < len(EXPERT_PROJECTIONS) or not _plain_gated_experts(module):
                continue
            experts, intermediate, hidden = (int(d) for d in reversed(tensors["gate"].shape))
            shapes = {
                "gate_up_proj": (experts, 2 * intermediate, hidden),
                "down_proj": (experts, hidden, intermediate),
            }
            if any(tuple(getattr(module, name).shape) != shape for name, shape in shapes.items()):
                continue
            if any(self._row_order(tensor, module) is not None for tensor in tensors.values()):
                continue  # an architecture that reorders expert rows: dense
            qtypes = tuple(int(tensors[p].tensor_type) for p in EXPERT_PROJECTIONS)
            with torch.device("meta"):
                new = resolver.build(
                    "gguf_experts", experts, hidden, intermediate, qtypes, module.config.hidden_act, dtype
                )
            model.set_submodule(module_path, new)
            self.kept_experts[module_path] = tensors

    def _keeps_type(self, tensor: ReaderTensor) -> bool:
        return (
            len(tensor.shape) == 2
            and tensor.tensor_type != GGMLQuantizationType.F32
            and tensor.tensor_type in COMPUTED_TYPES
        )

    def _gguf_layer(
        self,
        module: nn.Module | None,
        tensor: ReaderTensor,
        resolver: LayerResolver,
        dtype: torch.dtype,
        shape: tuple[int, int],
    ) -> nn.Module | None:
        """The GGUF layer of `shape` (rows, columns: the tensor's, or this rank's part of it) that replaces
        `module`, or None where it is not a plain linear or embedding of that shape."""
        rows, columns = shape
        qtype = int(tensor.tensor_type)
        with torch.device("meta"):
            if type(module) is nn.Linear and (module.out_features, module.in_features) == (rows, columns):
                return resolver.build("gguf_linear", columns, rows, qtype, module.bias is not None, dtype)
            if type(module) is Conv1D and (module.nf, module.nx) == (rows, columns):
                return resolver.build("gguf_linear", columns, rows, qtype, module.bias is not None, dtype)
            if isinstance(module, nn.Embedding) and tuple(module.weight.shape) == (rows, columns):
                scale = getattr(module, "embed_scale", None)
                if type(module) is not nn.Embedding and scale is None:
                    return None  # a subclass whose forward does something this layer does not
                scale = None if scale is None else float(scale)
                return resolver.build("gguf_embedding", rows, columns, qtype, scale, dtype)
        return None

    def _row_order(self, tensor: ReaderTensor, module: nn.Module) -> np.ndarray | bool | None:
        """How the architecture's processor reorders the tensor's rows: None (it does not), the new order,
        or False where it does more than reorder rows (the tensor then loads dense)."""
        rows = int(tensor.shape[1])
        probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        result = self.processor.process(
            weights=probe, name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
        )
        order = np.asarray(result.weights)
        if order.shape == (1, rows) and type(module) is Conv1D:
            order = (
                order.T
            )  # GGUF holds GPT-2's projections as [out, in] already, the layout this layer reads
        if order.shape != (rows, 1):
            return False
        order = order[:, 0]
        if np.array_equal(order, probe[:, 0]):
            return None
        if not np.array_equal(np.sort(order), probe[:, 0]):
            return False
        return order.astype(np.int64)

    # -- loading --------------------------------------------------------------------------------------------
    def load_kept(self, model: nn.Module) -> set[str]:
        """Put each kept tensor's blocks into its layer (a view of the mapped file where the rows keep their
        order); returns the parameter names filled."""
        loaded: set[str] = set()
        shared: dict[str, nn.Parameter] = {}
        for kept in self.kept.values():
            param = shared.get(kept.tensor.name)
            if param is None:
                param = nn.Parameter(_blocks(kept.tensor, kept.row_order, kept.shard), requires_grad=False)
                shared[kept.tensor.name] = param
            model.get_submodule(kept.module_path).qweight = param
            loaded.add(f"{kept.module_path}.qweight")
        for module_path, tensors in self.kept_experts.items():
            layer = model.get_submodule(module_path)
            for projection, tensor in tensors.items():
                setattr(layer, f"{projection}_qweight", nn.Parameter(_blocks(tensor), requires_grad=False))
                loaded.add(f"{module_path}.{projection}_qweight")
        return loaded

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, float tensor) for every tensor not kept in its GGUF type, converted as
        transformers' GGUF loader converts it; tensors the model has no place for are skipped, as there."""
        kept = {kept.tensor.name for kept in self.kept.values()}
        kept.update(tensor.name for tensors in self.kept_experts.values() for tensor in tensors.values())
        parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}
        for tensor in self.reader.tensors:
            if tensor.name in kept:
                continue
            try:
                weights = dequantize(tensor.data, tensor.tensor_type)
            except (ValueError, NotImplementedError) as exc:
                raise GGUFError(f"{self.path.name}: tensor {tensor.name!r} cannot be read ({exc})") from exc
            result = self.processor.process(
                weights=weights, name=tensor.name, tensor_key_mapping=self.name_map, parsed_parameters=parsed
            )
            if result.name is None:
                continue  # the processor stored it (merged experts) in parsed["tensors"]
            hf_name = self.name_map.get(result.name)
            if hf_name is None:
                logger.debug("%s: tensor %s has no place in the model; skipped", self.path.name, tensor.name)
                continue
            yield hf_name, torch.from_numpy(np.array(result.weights))
        yield from parsed["tensors"].items()


@contextmanager
def _tensor_name_maps_cached() -> Iterator[None]:
    """`get_gguf_hf_weights_map` rebuilds the gguf library's name table for every submodule it recurses
    into (seconds for a deep model); the table depends only on the architecture and depth, so build it once."""
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _plain_gated_experts(module: nn.Module | None) -> bool:
    """Whether `module` is a transformers experts module computing what `gguf_experts` does: `[gate; up]`
    stacked, not transposed, no biases or norms, the default gating of its config's activation."""
    return (
        getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "is_transposed", True)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "has_post_expert_norm", True)
        and getattr(type(module), "_apply_gate", None) is getattr(moe, "_default_apply_gate", False)
        and getattr(module.config, "hidden_act", None) in ACT2FN
        and type(module.act_fn) is type(ACT2FN[module.config.hidden_act])
    )


def _local_shape(tensor: ReaderTensor, shard: LinearShard | None) -> tuple[int, int] | None:
    """(rows, columns) of a 2-D tensor, or of `shard`'s part of it; None when that part's columns do not
    start and end at the edges of the type's blocks, or it is an embedding's share of the tokens."""
    columns, rows = (int(d) for d in tensor.shape)
    if shard is None:
        return rows, columns
    if shard.vocabulary:
        return None  # an embedding split by tokens loads dense
    if shard.colwise:
        return shard.size, columns
    block = gguf.GGML_QUANT_SIZES[GGMLQuantizationType(tensor.tensor_type)][0]
    return (rows, shard.size) if shard.start % block == 0 and shard.size % block == 0 else None


def _blocks(
    tensor: ReaderTensor, row_order: np.ndarray | None = None, shard: LinearShard | None = None
) -> torch.Tensor:
    """The tensor's bytes as uint8 [..., rows, row bytes] (experts first in a stack): the mapped file
    itself, or its rows reordered, or `shard`'s rows (a view) or blocks of columns (a copy)."""
    leading = [int(d) for d in reversed(tensor.shape[1:])]
    data = np.asarray(tensor.data).view(np.uint8).reshape(*leading, -1)
    if row_order is not None:
        data = data[row_order]
    if shard is not None and shard.colwise:
        data = data[shard.start : shard.start + shard.size]
    elif shard is not None:
        elements, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType(tensor.tensor_type)]
        data = np.ascontiguousarray(
            data[:, shard.start // elements * size : (shard.start + shard.size) // elements * size]
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only map: the weights are never written
        return torch.from_numpy(data)
