"""What an attention backend is: how a platform stores a step's keys and values in the paged KV cache and
attends over each sequence's cached context.

A platform names its backend class (`Platform.attention_backend_class`); the model runner makes one instance
per engine and puts it in the forward context, where the attention op finds it. Per step the runner calls
`prepare_step` once, for work every layer would otherwise repeat (which kernel serves which sequence), and
each layer's attention calls `forward` with what it returned.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.attention.forward_context import AttentionMetadata


class AttentionBackend:
    """Paged attention for one engine's caches: every layer's cache is `[2, num_blocks, block_size,
    num_kv_heads, head_dim]` in `kv_cache_dtype`."""

    # Who provides it, as the layer report says: "hw-agnostic", or the platform whose backend it is.
    provider: str = "hw-agnostic"

    def __init__(self, kv_cache_dtype: torch.dtype) -> None:
        self.kv_cache_dtype = kv_cache_dtype

    def prepare_step(self, metadata: AttentionMetadata) -> Any:
        """This step's state for `forward`, computed once for all layers."""
        return metadata

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        step: Any,
        scale: float,
        softcap: float,
        sliding_window: int,
    ) -> torch.Tensor:
        """Write this step's keys and values ([tokens, Hkv, D]) into `kv_cache`, then attend each sequence's
        queries ([tokens, H, D]) over its context; returns the contiguous output [tokens, H, Dv]."""
        raise NotImplementedError


def describe_attention(layer_names: list[str], backend: AttentionBackend) -> list[dict[str, str]]:
    """Layer-report rows (as `custom_op.describe_layers` makes them) for the attention layers `backend` serves."""
    cls = type(backend)
    return [
        {
            "module": name,
            "op": "attention",
            "provider": backend.provider,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "forward": "forward",
        }
        for name in layer_names
    ]
