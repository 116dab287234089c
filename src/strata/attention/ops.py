"""The attention ops every model calls; each takes tensors, the layer's name and scalar settings only.

The name is the handle to that layer's KV cache in the forward context, so no op holds an `nn.Module`:
to the compiler each call looks the same apart from the name, and with `LayerName` not even that.

- `strata::attention_with_kv_write(query, key, value, layer_name, scale, softcap, sliding_window)`: write
  this step's K/V into the layer's paged cache, then attend. Eager forwards call this one.
- `strata::kv_cache_update(key, value, layer_name)` and `strata::unified_attention(query, kv_written,
  layer_name, scale, softcap, sliding_window)`: the same work as two ops. Traced forwards emit these, so
  the KV write sits in the compiled pieces (only attention is a split point) and fusion passes can see it;
  the `fuse_kv_write_into_attention` pass turns the pair back into the one op. `kv_written` is a dummy
  output of the write that orders it before the attention reading the cache.

Each is registered twice (`LayerNameOp`): taking `LayerNameType` and, as `<name>_str`, taking `str`.
The cache write and attention go to the backend for the cache's device (`write_to_kv_cache`, `paged_attention`,
and both at once, `write_and_attend`). The last is chosen once per step for all layers (`bind_write_and_attend`,
which the model runner puts in the forward context), not once per layer.
"""

from __future__ import annotations

from types import ModuleType

import torch

from strata.attention.backends import cpu, torch_native
from strata.attention.forward_context import AttentionMetadata, WriteAndAttend, get_forward_context
from strata.compilation.layer_name import LayerNameOp, LayerNameType, resolve_layer_name


def prepare_backend(device: torch.device) -> None:
    """Get the attention backend for `device` ready before the first forward (CPU: build its kernel)."""
    if device.type == "cpu":
        cpu.prepare()


def _backend(kv_cache: torch.Tensor) -> ModuleType:
    """The backend for the device the cache lives on: Strata's kernels for a CPU cache, plain PyTorch
    elsewhere. It is chosen inside the ops below, so the choice is never traced into a graph."""
    return cpu if kv_cache.device.type == "cpu" else torch_native


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values with the backend for the cache's device."""
    _backend(kv_cache).write_to_kv_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Attend with the backend for the cache's device."""
    return _backend(kv_cache).paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window)


def bind_write_and_attend(
    metadata: AttentionMetadata, kv_caches: dict[str, torch.Tensor]
) -> WriteAndAttend | None:
    """This step's write-then-attend for every layer (None without layers), from the backend for the caches'
    device: the runner allocates all layers' caches on one device in one dtype."""
    kv_cache = next(iter(kv_caches.values()), None)
    return None if kv_cache is None else _backend(kv_cache).bind_write_and_attend(metadata, kv_cache)


def _cache_and_metadata(layer_name: LayerNameType) -> tuple[torch.Tensor, AttentionMetadata]:
    context = get_forward_context()
    metadata = context.attn_metadata
    assert metadata is not None, "attention needs metadata; the model runner sets it for every step"
    return context.kv_caches[resolve_layer_name(layer_name)], metadata


def _kv_cache_update(key: torch.Tensor, value: torch.Tensor, layer_name: LayerNameType) -> torch.Tensor:
    """Write this step's K/V ([T, Hkv, D]) into `layer_name`'s paged cache; returns an empty dependency."""
    kv_cache, metadata = _cache_and_metadata(layer_name)
    write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    return key.new_empty(0)


def _kv_cache_update_fake(key: torch.Tensor, value: torch.Tensor, layer_name: LayerNameType) -> torch.Tensor:
    return key.new_empty(0)


def _unified_attention(
    query: torch.Tensor,
    kv_written: torch.Tensor,
    layer_name: LayerNameType,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Attend over `layer_name`'s cache (this step's K/V already written); query/out [T, H, D]."""
    kv_cache, metadata = _cache_and_metadata(layer_name)
    return paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window).contiguous()


def _unified_attention_fake(
    query: torch.Tensor,
    kv_written: torch.Tensor,
    layer_name: LayerNameType,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    return query.new_empty(query.shape)  # contiguous, as the real op returns it, whatever query's layout


def _attention_with_kv_write(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: LayerNameType,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Write this step's K/V ([T, Hkv, D]) into `layer_name`'s paged cache, then attend; query/out [T, H, D].
    The step's `write_and_attend` was chosen when its context was set, not here, once per layer."""
    context = get_forward_context()
    assert context.write_and_attend is not None, (
        "attention needs metadata; the model runner sets it for every step"
    )
    kv_cache = context.kv_caches[resolve_layer_name(layer_name)]
    return context.write_and_attend(query, key, value, kv_cache, scale, softcap, sliding_window)


def _attention_with_kv_write_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: LayerNameType,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    return query.new_empty(query.shape)  # contiguous, as the real op returns it, whatever query's layout


kv_cache_update = LayerNameOp("kv_cache_update", _kv_cache_update, _kv_cache_update_fake)
unified_attention = LayerNameOp("unified_attention", _unified_attention, _unified_attention_fake)
attention_with_kv_write = LayerNameOp(
    "attention_with_kv_write", _attention_with_kv_write, _attention_with_kv_write_fake
)
# Where the compiled graph is split: everything between two of these is one compiled piece.
ATTENTION_OPS = (unified_attention, attention_with_kv_write)
