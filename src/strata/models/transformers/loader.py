"""Build an HF causal LM from its config with transformers' own modeling code, then load its weights.

Parameters are created on the meta device (no memory, no random init) while buffers such as RoPE
frequencies stay real; the steps of `build_steps` then shape the model for its configuration and ranks, and
each parameter is replaced by the tensor streamed from the checkpoint through `weight_pipeline`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from strata.config import ConfigError, LayerConfig, ModelConfig, set_current_layer_config
from strata.custom_op import RegisteredLayer, describe_layers, summarize_layers
from strata.gguf.file import load_config as load_gguf_config
from strata.gguf.weights import GGUFCheckpoint
from strata.models.transformers.attention import (
    ATTN_IMPLEMENTATION,
    AttentionLayerSpec,
    name_attention_layers,
    register_attention_interface,
)
from strata.models.transformers.build_steps import ModelPlan, ModelStep, prepare_model
from strata.models.transformers.hub_kernels import unwrap_hub_kernels
from strata.models.transformers.layers import LayerResolver
from strata.models.transformers.weight_pipeline import WeightLoadError, load_weights
from strata.platforms import Platform
from strata.plugins import load_plugins

__all__ = ["WeightLoadError", "build_model", "load_gguf_as_transformers", "load_weights"]

logger = logging.getLogger("strata.models.loader")


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
    _check_causal_lm(model_config)
    register_attention_interface()
    load_plugins()
    resolver = LayerResolver(layer_config, platform)
    with set_current_layer_config(layer_config):
        plan = ModelPlan(_instantiate(model_config), model_config, resolver)
        steps = prepare_model(plan)
    specs = _attention_specs(plan.model, use_layer_name, steps)
    _load_checkpoint(plan, steps)
    _finish(plan.model, steps)
    logger.info(
        "layers (layer_impl=%s, platform %s): %s",
        layer_config.layer_impl,
        platform.name,
        summarize_layers(describe_layers(plan.model)),
    )
    return plan.model, specs


def _check_causal_lm(model_config: ModelConfig) -> None:
    """Refuse a model that is not a decoder-only LM whose attention Strata can replace."""
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


def _instantiate(model_config: ModelConfig) -> nn.Module:
    """transformers' model with Strata attention, its parameters on the meta device, Hub kernels undone."""
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            model_config.hf_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=model_config.torch_dtype
        )
    if restored := unwrap_hub_kernels(model):
        logger.debug("restored %d functions and layers wrapped for Hub kernels", restored)
    return model


def _attention_specs(model: nn.Module, use_layer_name: bool, steps: list[ModelStep]) -> list[AttentionLayerSpec]:
    """The attention layers this rank runs; a model without any is refused."""
    specs = name_attention_layers(model, use_layer_name)
    if not specs:
        raise ConfigError(
            f"{type(model).__name__} is not a causal language model with decoder attention layers Strata can drive"
        )
    for step in steps:
        specs = step.attention_specs(specs)
    return specs


def _load_checkpoint(plan: ModelPlan, steps: list[ModelStep]) -> None:
    """Stream the checkpoint's tensors through each step's per-tensor transforms into the model."""
    source = plan.weight_source()
    tensors, preloaded = source.open(plan.model)
    for step in steps:
        tensors = step.tensors(tensors)
    load_weights(plan.model, tensors, source.name, plan.config.torch_dtype, plan.weight_mapping, preloaded)


def _finish(model: nn.Module, steps: list[ModelStep]) -> None:
    """Each step's completion (collectives), then each layer's own processing of its loaded weights."""
    for step in steps:
        step.finish(model)
    for module in model.modules():
        if isinstance(module, RegisteredLayer):
            module.process_weights_after_loading()
    model.eval()


def load_gguf_as_transformers(path: Path) -> nn.Module:
    """The file's model as plain transformers builds it, every weight dequantized to float32 (what `strata
    convert gguf` saves); tensors of types Strata does not compute on are dequantized too, with a warning."""
    hf_config = load_gguf_config(path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gguf = GGUFCheckpoint(path, model, dequantize_unsupported=True)
    load_weights(model, gguf.dense_tensors(), str(path), torch.float32)
    return model.eval()
