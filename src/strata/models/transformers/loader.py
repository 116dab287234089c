"""Build an HF causal LM from its config with transformers' own modeling code, then load its weights.

Parameters are created on the meta device (no memory, no random init) while buffers such as RoPE
frequencies stay real, then each parameter is replaced by the tensor streamed from the safetensors files.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

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

from strata.config import ConfigError, LayerConfig, ModelConfig, set_current_layer_config
from strata.custom_op import RegisteredLayer, describe_layers, summarize_layers
from strata.distributed.parallel_state import pp_rank, pp_world_size, tp_rank, tp_world_size
from strata.gguf.file import load_config as load_gguf_config
from strata.gguf.weights import GGUFCheckpoint
from strata.hw_agnostic.layers import Int8Linear
from strata.models.transformers.attention import (
    ATTN_IMPLEMENTATION,
    AttentionLayerSpec,
    name_attention_layers,
    register_attention_interface,
)
from strata.models.transformers.fusers import (
    WeightMapping,
    WeightTarget,
    fuse_layers,
    replace_conv1d,
    replace_layer_norms,
    replace_linears,
)
from strata.models.transformers.hub_kernels import unwrap_hub_kernels
from strata.models.transformers.layers import LayerResolver
from strata.models.transformers.pipeline_parallel import PipelineSplit
from strata.models.transformers.quantization import (
    QSCALE_SUFFIX,
    QWEIGHT_SUFFIX,
    dequantize_groups,
    quantize_linears,
)
from strata.models.transformers.tensor_parallel import TensorParallelSharding
from strata.platforms import Platform
from strata.plugins import load_plugins

logger = logging.getLogger("strata.models.loader")

# Above this many bytes of weights, show a progress bar while loading.
_PROGRESS_BAR_BYTES = 256 * 1024 * 1024


class WeightLoadError(ValueError):
    """The checkpoint does not match the model built from its config."""


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every parameter on the meta device; buffers (RoPE tables, scales) are computed for real."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_model(
    model_config: ModelConfig, layer_config: LayerConfig, platform: Platform, use_layer_name: bool = False
) -> tuple[nn.Module, list[AttentionLayerSpec]]:
    """Build the HF model for `model_config` with Strata attention and its weights loaded, in eval mode.

    Its norms, GLU MLPs and linears are replaced by the layers the resolver picks for `layer_config` on
    `platform` (see `fusers` and `layers`), its Linear layers by int8 ones with `model_config.quantization`;
    `use_layer_name` makes attention layers pass `LayerName`s to the attention op.
    """
    hf_config = model_config.hf_config
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if model_class is None or getattr(hf_config, "is_encoder_decoder", False):
        raise ConfigError(
            f"model {model_config.model!r} (model_type {hf_config.model_type!r}) is not a causal language model "
            "that transformers knows; Strata runs decoder-only models such as llama, qwen2, mistral, gemma"
        )
    if not model_class.is_backend_compatible():
        raise ConfigError(
            f"{model_class.__name__} does not route attention through transformers' AttentionInterface, "
            "so Strata cannot run it"
        )
    register_attention_interface()
    load_plugins()
    resolver = LayerResolver(layer_config, platform)
    with set_current_layer_config(layer_config):
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=model_config.torch_dtype
            )
        if restored := unwrap_hub_kernels(model):
            logger.debug("restored %d functions and layers wrapped for Hub kernels", restored)
        sharding = stages = None
        if pp_world_size() > 1:  # first, so that only this stage's layers are sharded
            stages = PipelineSplit(model, pp_rank(), pp_world_size())
        if tp_world_size() > 1:
            sharding = TensorParallelSharding(model, tp_rank(), tp_world_size())
        gguf = None
        if model_config.gguf_file is not None:
            gguf = GGUFCheckpoint(model_config.gguf_file, model, model_config.gguf_dequantize)
            gguf.replace_layers(
                model, resolver, model_config.torch_dtype, sharding.shards if sharding is not None else None
            )
        weight_mapping = {**fuse_layers(model, resolver), **replace_conv1d(model)}
        replace_layer_norms(model, resolver)
        if model_config.quantization == "int8":
            quantize_linears(model, resolver)
        replace_linears(model, resolver)
    specs = name_attention_layers(model, use_layer_name)
    if not specs:
        raise ConfigError(
            f"{type(model).__name__} is not a causal language model with decoder attention layers Strata can drive"
        )
    if sharding is not None:
        specs = sharding.local_attention_specs(specs)
    if gguf is not None:
        preloaded = gguf.load_kept(model)
        tensors, source = gguf.dense_tensors(), str(gguf.path)
    else:
        preloaded, folder = set(), Path(model_config.model)
        tensors, source = _dequantize_pairs(_iter_checkpoint(_checkpoint_files(folder))), str(folder)
    if stages is not None:
        tensors = ((name, tensor) for name, tensor in tensors if stages.loads(name))
    if sharding is not None:
        tensors = ((name, sharding.slice_tensor(name, tensor)) for name, tensor in tensors)
    load_weights(model, tensors, source, model_config.torch_dtype, weight_mapping, preloaded)
    if sharding is not None:
        sharding.install_collectives(model)
    for module in model.modules():
        if isinstance(module, RegisteredLayer):
            module.process_weights_after_loading()
    model.eval()
    logger.info(
        "layers (layer_impl=%s, platform %s): %s",
        layer_config.layer_impl,
        platform.name,
        summarize_layers(describe_layers(model)),
    )
    return model, specs


def load_gguf_as_transformers(path: Path) -> nn.Module:
    """The file's model as plain transformers builds it, every weight dequantized to float32 (what `strata
    convert gguf` saves); tensors of types Strata does not compute on are dequantized too, with a warning."""
    hf_config = load_gguf_config(path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gguf = GGUFCheckpoint(path, model, dequantize_unsupported=True)
    load_weights(model, gguf.dense_tensors(), str(path), torch.float32)
    return model.eval()


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors weights in {folder}")
    return files


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs, one tensor in memory at a time."""
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=total < _PROGRESS_BAR_BYTES
    ) as bar:
        for path in files:
            with safe_open(path, framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = reader.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    yield name, tensor


def _dequantize_pairs(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass float tensors through; turn each `<x>.qweight` + `<x>.qscale` pair into one float `<x>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        suffix = next((s for s in (QWEIGHT_SUFFIX, QSCALE_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == 2:
            del pending[base]
            yield f"{base}.weight", dequantize_groups(base, parts[QWEIGHT_SUFFIX], parts[QSCALE_SUFFIX])
    for base, parts in pending.items():
        (have,) = parts
        lacks = QSCALE_SUFFIX if have == QWEIGHT_SUFFIX else QWEIGHT_SUFFIX
        raise WeightLoadError(f"quantized tensor {base}{have} has no {base}{lacks} in the checkpoint")


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


def load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
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
    pairs are dequantized one at a time first, so no full floating-point copy of the model is ever held.
    """
    weight_mapping = weight_mapping or {}
    converted = checkpoint_conversion(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = _persistent_buffers(model)
    # `<path>.weight` of each int8 linear: the float weight its `qweight` and `scale` are quantized from.
    int8_layers = {f"{path}.weight": m for path, m in model.named_modules() if isinstance(m, Int8Linear)}
    ties = model.get_expanded_tied_weights_keys(all_submodels=True)
    tie_targets = {source: target for target, source in ties.items()}
    tied_floats: dict[str, torch.Tensor] = {}
    loaded: set[str] = set(preloaded or ())
    unexpected: list[str] = []
    assembling: dict[str, tuple[torch.Tensor, set[tuple[int | None, int]]]] = {}
    for name, tensor in tensors:
        target = weight_mapping.get(name) or converted(name) or WeightTarget(name)
        if target.transpose:
            tensor = tensor.t().contiguous()
        int8_layer = int8_layers.get(target.param)
        if int8_layer is not None:
            full_shape = (int8_layer.out_features, int8_layer.in_features)
        elif target.param in params:
            full_shape = tuple(params[target.param].shape)
        elif target.param in buffers:
            _load_buffer(buffers[target.param], name, tensor, folder)
            continue
        else:
            unexpected.append(name)
            continue
        # One expert's part of a stacked parameter is the parameter without its first dim.
        piece_shape = full_shape[1:] if target.expert is not None else full_shape
        shard_rows = piece_shape[0] // target.num_shards
        expected_shape = (shard_rows, *piece_shape[1:]) if target.num_shards > 1 else piece_shape
        if tuple(tensor.shape) != tuple(expected_shape) or not 0 <= (target.expert or 0) < target.num_experts:
            raise WeightLoadError(
                f"tensor {name} in {folder} has shape {tuple(tensor.shape)}, the model expects {tuple(expected_shape)}"
                + (
                    f" for expert {target.expert} of {target.num_experts}"
                    if target.expert is not None
                    else ""
                )
            )
        if target.num_shards > 1 or target.expert is not None:
            if target.param not in assembling:
                merged_dtype = torch.float32 if int8_layer is not None else dtype
                assembling[target.param] = (torch.empty(full_shape, dtype=merged_dtype), set())
            merged, pieces = assembling[target.param]
            block = merged[target.expert] if target.expert is not None else merged
            block[target.shard * shard_rows : (target.shard + 1) * shard_rows] = tensor
            pieces.add((target.expert, target.shard))
            if len(pieces) < target.num_shards * target.num_experts:
                continue
            del assembling[target.param]
            tensor = merged
        if int8_layer is not None:
            int8_layer.load_float_weight(tensor)
            prefix = target.param.removesuffix(".weight")
            loaded |= {target.param, f"{prefix}.qweight", f"{prefix}.scale"}
            # A tied head stored before (or instead of) the embedding: keep its floats for the embedding.
            if target.param in ties and ties[target.param] not in loaded:
                tied_floats[target.param] = tensor
        else:
            _set_parameter(model, target.param, nn.Parameter(tensor.to(dtype), requires_grad=False))
            loaded.add(target.param)
            tied_floats.pop(tie_targets.get(target.param, ""), None)
    for target, source in ties.items():
        if target not in loaded and source in loaded:
            if target in int8_layers:  # a tied int8 head: its own int8 copy of the float embedding
                int8_layers[target].load_float_weight(model.get_parameter(source))
                prefix = target.removesuffix(".weight")
                loaded |= {f"{prefix}.qweight", f"{prefix}.scale"}
            else:
                _set_parameter(model, target, model.get_parameter(source))
            loaded.add(target)
        elif source not in loaded and target in loaded:
            weight = tied_floats.pop(target, None)
            tied = (
                model.get_parameter(target)
                if weight is None
                else nn.Parameter(weight.to(dtype), requires_grad=False)
            )
            _set_parameter(model, source, tied)
            loaded.add(source)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(
                f"unexpected tensors: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}"
            )
        raise WeightLoadError(
            f"checkpoint in {folder} does not match {type(model).__name__}: " + "; ".join(parts)
        )
    logger.info("loaded %d tensors from %s", len(loaded), folder)


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint may hold (a learned activation's constants, say): those in the state dict.
    The model made them when it was built, so one the checkpoint lacks keeps that value."""
    return {
        f"{path}.{name}" if path else name: buffer
        for path, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def _load_buffer(buffer: torch.Tensor, name: str, tensor: torch.Tensor, folder: Path) -> None:
    if tensor.shape != buffer.shape:
        raise WeightLoadError(
            f"tensor {name} in {folder} has shape {tuple(tensor.shape)}, the model expects {tuple(buffer.shape)}"
        )
    with torch.no_grad():
        buffer.copy_(tensor)


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    module._parameters[attr] = param
