"""The attention op every model calls: `strata::attention(query, key, value, layer_name, scale, softcap,
sliding_window)` writes this step's keys and values into the layer's paged cache, then attends.

It takes tensors, the layer's name and scalar settings only. The name is the handle to that layer's KV cache
in the forward context, so the op holds no `nn.Module`: to the compiler each call looks the same apart from
the name, and with `LayerName` not even that. The work goes to the engine's attention backend, which the
forward context holds; eager and compiled forwards call the same op, and the compiled graph is split at it.
It is registered in both name forms (`LayerNameOp`): taking `LayerName` and, as `attention_str`, `str`.
"""

from __future__ import annotations

import torch

from strata.attention.forward_context import get_forward_context
from strata.compilation.layer_name import LayerNameOp, LayerNameType, resolve_layer_name


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: LayerNameType,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Write this step's K/V ([T, Hkv, D]) into `layer_name`'s paged cache, then attend; query/out [T, H, D]."""
    context = get_forward_context()
    assert context.attn_backend is not None, (
        "attention needs a backend; the model runner sets it for every step"
    )
    kv_cache = context.kv_caches[resolve_layer_name(layer_name)]
    return context.attn_backend.forward(
        query, key, value, kv_cache, context.attn_step, scale, softcap, sliding_window
    )


def _attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: LayerNameType,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    return query.new_empty(query.shape)  # contiguous, as the real op returns it, whatever query's layout


# The compiled forward is split at every call of it: attention runs eagerly, everything between is a piece.
attention = LayerNameOp("attention", _attention, _attention_fake, splits_graph=True)
