"""`torch.ops.strata.unified_attention`: the one attention op every model calls.

The op takes only tensors, the layer's name and the layer's scalar attention settings. The name is the
handle to that layer's KV cache in the forward context, so the op never holds an `nn.Module`: to the
compiler each call looks the same apart from the name.
"""

from __future__ import annotations

import torch

from strata.attention.backends.torch_native import paged_attention, write_to_kv_cache
from strata.attention.forward_context import get_forward_context


@torch.library.custom_op("strata::unified_attention", mutates_args=())
def unified_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: str,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Write this step's K/V ([T, Hkv, D]) into `layer_name`'s paged cache, then attend; query/out [T, H, D]."""
    context = get_forward_context()
    kv_cache = context.kv_caches[layer_name]
    metadata = context.attn_metadata
    assert metadata is not None, "attention needs metadata; the model runner sets it for every step"
    write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    return paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window)


@unified_attention.register_fake
def _unified_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: str,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
