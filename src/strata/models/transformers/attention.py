"""Strata's entry in transformers' `AttentionInterface`.

Setting a model config's attention implementation to `"strata"` makes every HF attention module call
`strata_attention_forward`, which reshapes HF's `[1, heads, tokens, head_dim]` tensors to the flat
`[tokens, heads, head_dim]` layout and calls Strata's attention op, in eager and compiled forwards alike. "strata" has no entry in transformers'
mask interface, so HF builds no dense attention mask for this path: the paged backend masks by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from strata.attention.ops import attention
from strata.compilation.layer_name import LAYER_NAME_ATTR, encode_layer_name

ATTN_IMPLEMENTATION = "strata"


def strata_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention signature in, `[1, tokens, heads, head_dim]` out (no attention weights)."""
    assert query.shape[0] == 1, "Strata flattens all sequences of a step into one row"
    layer_name = getattr(module, LAYER_NAME_ATTR)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (_tokens_first(t) for t in (query, key, value))
    out = attention(q, k, v, layer_name, float(scale), float(softcap or 0.0), int(sliding_window or 0))
    return out.unsqueeze(0), None


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """`[1, heads, tokens, head_dim]` as `[tokens, heads, head_dim]`. A single head (multi-query attention,
    or one KV head per tensor-parallel rank) is read with explicit strides: a transposed view would keep a
    size-1 dim whose stride is the run-time token count, which a compiled piece cannot order."""
    if t.shape[1] != 1:
        return t[0].transpose(0, 1)
    tokens, head_dim = t.shape[2], t.shape[3]
    return t.contiguous().as_strided((tokens, 1, head_dim), (head_dim, head_dim, 1))


def register_attention_interface() -> None:
    """Idempotent: transformers keeps one global mapping per process."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, strata_attention_forward)


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What the KV cache needs to know about one attention layer."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


def name_attention_layers(model: nn.Module, use_layer_name: bool = False) -> list[AttentionLayerSpec]:
    """Give each HF attention module its module path as a layer name; returns them in model order.

    The name is stored encoded (`encode_layer_name`): a `LayerName` when `use_layer_name` is on and torch
    supports it, which also selects the `LayerName` variant of the attention op at call time.

    HF attention modules are recognised by the attributes they carry: a `layer_idx`, a `config`, the head
    size (`head_dim`; `head_size` in GPT-NeoX) and `is_causal` (which cross-attention lacks), so no list of
    class names is needed. Their KV heads: the query heads over `num_key_value_groups` where the module has
    it, else the config's `num_key_value_heads`, else one per query head (GPT-2, GPT-NeoX, OPT).
    """
    specs = []
    for path, module in model.named_modules():
        head_dim = getattr(module, "head_dim", getattr(module, "head_size", None))
        if not (hasattr(module, "layer_idx") and hasattr(module, "config") and isinstance(head_dim, int)):
            continue
        if getattr(module, "is_causal", None) is not True:
            continue
        setattr(module, LAYER_NAME_ATTR, encode_layer_name(path, use_layer_name))
        num_heads = module.config.num_attention_heads
        groups = getattr(module, "num_key_value_groups", None)
        num_kv_heads = (
            num_heads // groups if groups else getattr(module.config, "num_key_value_heads", num_heads)
        )
        specs.append(AttentionLayerSpec(path, num_heads, num_kv_heads or num_heads, head_dim))
    return specs
