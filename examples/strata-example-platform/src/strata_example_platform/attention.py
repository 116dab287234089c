"""The example platform's attention backend: paged KV cache writes, then one sequence at a time.

Each layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; a sequence's tokens live in the
blocks its block table lists, in order. This backend gathers each sequence's keys and values, and attends its
query tokens with a causal (and, where the layer has one, sliding-window) mask, softmax in float32.
"""

from __future__ import annotations

import torch

from strata.attention.backend import AttentionBackend
from strata.attention.forward_context import AttentionMetadata


class ExampleAttentionBackend(AttentionBackend):
    """Counts its `forward` calls in `ExampleAttentionBackend.calls`."""

    provider = "example"
    calls = 0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        step: AttentionMetadata,
        scale: float,
        softcap: float,
        sliding_window: int,
    ) -> torch.Tensor:
        type(self).calls += 1
        k_cache, v_cache = (half.flatten(0, 1) for half in kv_cache.unbind(0))  # [slots, Hkv, D]
        k_cache.index_copy_(0, step.slot_mapping, key.to(kv_cache.dtype))
        v_cache.index_copy_(0, step.slot_mapping, value.to(kv_cache.dtype))
        out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
        starts = step.query_start_loc_host
        for i, seq_len in enumerate(step.seq_lens_host):
            blocks = step.block_tables[i, : -(-seq_len // step.block_size)]
            slots = (blocks[:, None] * step.block_size + torch.arange(step.block_size)).flatten()[:seq_len]
            rows = slice(starts[i], starts[i + 1])
            out[rows] = _attend(query[rows], k_cache[slots], v_cache[slots], scale, softcap, sliding_window)
        return out


def _attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, softcap: float, window: int
) -> torch.Tensor:
    """Queries [q, H, D] at the last q positions of keys/values [k, Hkv, D]; returns [q, H, Dv]."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, dim=1)  # [k, H, D]
    v = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(keys.shape[0] - query.shape[0], keys.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window > 0:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(query.dtype)
