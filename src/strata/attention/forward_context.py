"""The per-step state that attention reads: set before a forward pass, cleared after.

The HF modeling code calls attention with only tensors and a layer name, so everything else the paged
attention needs (this step's metadata and each layer's KV cache) travels through this module-level context,
the same way vLLM and nano-vllm do it. Keeping it out of the op's arguments is what lets one traced graph
serve every layer and every batch.
"""

from __future__ import annotations

from collections.abc import Callable
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


# A layer's attention step with this step's metadata already bound: (query, key, value, kv_cache, scale,
# softcap, sliding_window) -> the contiguous output [num_tokens, H, Dv], this step's K/V written to the cache.
WriteAndAttend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float, int], torch.Tensor
]


def bind_step_arguments(
    write_and_attend: Callable[..., torch.Tensor], *step_arguments: Any
) -> WriteAndAttend:
    """`write_and_attend(query, key, value, kv_cache, *step_arguments, scale, softcap, sliding_window)` with
    this step's arguments bound: a backend's function with the step's metadata, or a kernel with its tensors."""

    def bound(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        softcap: float,
        sliding_window: int,
    ) -> torch.Tensor:
        return write_and_attend(query, key, value, kv_cache, *step_arguments, scale, softcap, sliding_window)

    return bound


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: dict[str, torch.Tensor]  # layer name -> [2, num_blocks, block_size, num_kv_heads, head_dim]
    # Every layer's write-then-attend this step, chosen by the backend once per step (`ops.bind_write_and_attend`).
    write_and_attend: WriteAndAttend | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError(
            "Strata attention was called outside a forward context; run the model through the engine's ModelRunner"
        )
    return _forward_context


class set_forward_context:  # named as a function: it is used as one, `with set_forward_context(...):`
    """Makes a step's metadata, caches and `write_and_attend` the current forward context, and restores the
    one before on exit. A class rather than a generator context manager: it is entered once per step right
    after the weights have streamed through the caches, where contextlib's machinery costs microseconds."""

    def __init__(
        self,
        attn_metadata: AttentionMetadata | None,
        kv_caches: dict[str, torch.Tensor],
        write_and_attend: WriteAndAttend | None = None,
    ) -> None:
        self.context = ForwardContext(attn_metadata, kv_caches, write_and_attend)

    def __enter__(self) -> ForwardContext:
        global _forward_context
        self.previous = _forward_context
        _forward_context = self.context
        return self.context

    def __exit__(self, *exc_info: object) -> None:
        global _forward_context
        _forward_context = self.previous
