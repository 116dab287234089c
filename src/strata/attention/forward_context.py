"""The per-step state that attention reads: set before a forward pass, cleared after.

The HF modeling code calls attention with only tensors and a layer name, so everything else the paged
attention needs (this step's metadata, each layer's KV cache and the backend that runs it) travels through
this module-level context, the same way vLLM and nano-vllm do it. Keeping it out of the op's arguments is
what lets one traced graph serve every layer and every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache, for all scheduled sequences at once.

    Tokens of all sequences are flattened into one row; sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]` and, after this step, has `seq_lens[i]` tokens in the cache.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: physical block ids per sequence, padded
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sum of query lengths
    # Host copies, so CPU backends can slice without a device sync per sequence.
    seq_lens_host: list[int]
    query_start_loc_host: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: dict[str, torch.Tensor]  # layer name -> [2, num_blocks, block_size, num_kv_heads, head_dim]
    attn_backend: Any = None  # the engine's `AttentionBackend`
    attn_step: Any = None  # what `attn_backend.prepare_step(attn_metadata)` returned for this step


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "Strata attention was called outside a forward context; run the model through the engine's ModelRunner"
        )
    return _forward_context


class set_forward_context:  # named as a function: it is used as one, `with set_forward_context(...):`
    """Makes a step's metadata, caches and attention backend the current forward context (the backend
    prepares its step state here, once for all layers), and restores the one before on exit. A class rather
    than a generator context manager: it is entered once per step, where contextlib's machinery costs
    microseconds."""

    def __init__(
        self,
        attn_metadata: AttentionMetadata | None,
        kv_caches: dict[str, torch.Tensor],
        attn_backend: Any = None,
    ) -> None:
        step = (
            attn_backend.prepare_step(attn_metadata)
            if attn_backend is not None and attn_metadata is not None
            else None
        )
        self.context = ForwardContext(attn_metadata, kv_caches, attn_backend, step)

    def __enter__(self) -> ForwardContext:
        global _forward_context
        self.previous = _forward_context
        _forward_context = self.context
        return self.context

    def __exit__(self, *exc_info: object) -> None:
        global _forward_context
        _forward_context = self.previous
