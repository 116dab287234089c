"""Layers built as an engine builds them: through the resolver, for a platform and a layer config."""

from __future__ import annotations

from typing import Any

from torch import nn

from strata.config import LayerConfig, set_current_layer_config
from strata.models.transformers.layers import LayerResolver
from strata.platforms import get_platform


def build_layer(
    op_name: str, *args: Any, platform: str = "cpu", layer_config: LayerConfig | None = None, **kwargs: Any
) -> nn.Module:
    """The layer of op `op_name` the resolver builds on `platform` (default layer config: "default")."""
    layer_config = layer_config or LayerConfig(layer_impl="default")
    with set_current_layer_config(layer_config):
        return LayerResolver(layer_config, get_platform(platform)).build(op_name, *args, **kwargs)
