"""Build an HF causal LM from its config with transformers' own modeling code, then load its weights.

Parameters are created on the meta device (no memory, no random init) while buffers such as RoPE
frequencies stay real, then each parameter is replaced by the tensor streamed from the safetensors files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from strata.config import ConfigError, LayerConfig, ModelConfig, set_current_layer_config
from strata.custom_op import describe_layers, summarize_layers
from strata.models.transformers.attention import (
    ATTN_IMPLEMENTATION,
    AttentionLayerSpec,
    name_attention_layers,
    register_attention_interface,
)
from strata.models.transformers.fusers import WeightMapping, WeightTarget, fuse_layers
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
    model_config: ModelConfig, layer_config: LayerConfig | None = None, use_layer_name: bool = False
) -> tuple[nn.Module, list[AttentionLayerSpec]]:
    """Build the HF model for `model_config` with Strata attention and its weights loaded, in eval mode.

    Its RMSNorms and GLU MLPs are replaced by the layers `layer_config` resolves to (see `fusers`);
    `use_layer_name` makes attention layers call the `LayerName` variant of the attention op.
    """
    layer_config = layer_config or LayerConfig()
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
    with set_current_layer_config(layer_config):
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=model_config.torch_dtype
            )
        weight_mapping = fuse_layers(model)
    specs = name_attention_layers(model, use_layer_name)
    if not specs:
        raise ConfigError(
            f"{type(model).__name__} is not a causal language model with decoder attention layers Strata can drive"
        )
    load_weights(model, Path(model_config.model), model_config.torch_dtype, weight_mapping)
    model.eval()
    logger.info(
        "layers (layer_impl=%s): %s", layer_config.layer_impl, summarize_layers(describe_layers(model))
    )
    return model, specs


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


def load_weights(
    model: nn.Module, folder: Path, dtype: torch.dtype, weight_mapping: WeightMapping | None = None
) -> None:
    """Replace each meta parameter by its checkpoint tensor; tie what the config ties; name any mismatch.

    `weight_mapping` sends checkpoint names of replaced modules to their new parameters; a sharded target
    (a merged gate/up projection) is assembled from its shards and set once all of them arrived.
    """
    weight_mapping = weight_mapping or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    assembling: dict[str, tuple[torch.Tensor, set[int]]] = {}
    for name, tensor in _iter_checkpoint(_checkpoint_files(folder)):
        target = weight_mapping.get(name, WeightTarget(name))
        if target.param not in params:
            unexpected.append(name)
            continue
        expected = params[target.param]
        shard_rows = expected.shape[0] // target.num_shards
        expected_shape = (shard_rows, *expected.shape[1:]) if target.num_shards > 1 else tuple(expected.shape)
        if tuple(tensor.shape) != tuple(expected_shape):
            raise WeightLoadError(
                f"tensor {name} in {folder} has shape {tuple(tensor.shape)}, the model expects {tuple(expected_shape)}"
            )
        if target.num_shards > 1:
            if target.param not in assembling:
                assembling[target.param] = (torch.empty(expected.shape, dtype=dtype), set())
            merged, shards = assembling[target.param]
            merged[target.shard * shard_rows : (target.shard + 1) * shard_rows] = tensor
            shards.add(target.shard)
            if len(shards) < target.num_shards:
                continue
            tensor = merged
        _set_parameter(model, target.param, nn.Parameter(tensor.to(dtype), requires_grad=False))
        loaded.add(target.param)
    for target, source in model.get_expanded_tied_weights_keys(all_submodels=True).items():
        if target not in loaded and source in loaded:
            _set_parameter(model, target, model.get_parameter(source))
            loaded.add(target)
        elif source not in loaded and target in loaded:
            _set_parameter(model, source, model.get_parameter(target))
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


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    module._parameters[attr] = param
