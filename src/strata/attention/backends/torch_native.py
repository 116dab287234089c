"""Paged attention in plain PyTorch: runs on every device torch supports, and is the reference backend.

The KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; a sequence's tokens live
in the blocks its block table lists, in order. Each step first scatters the new keys and values into their
slots, then every sequence attends over its own cached context with a causal (and, where the layer has one,
sliding-window) mask.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from strata.attention.backend import AttentionBackend
from strata.attention.forward_context import AttentionMetadata


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values ([num_tokens, num_kv_heads, head_dim]) at their cache slots."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_offset: int,
    key_offset: int,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Attention of one sequence: query [q, H, D] at positions query_offset.., keys [k, Hkv, D] at key_offset..."""
    q_len, k_len = query.shape[0], key.shape[0]
    q = query.transpose(0, 1)
    k = key.transpose(0, 1)
    v = value.transpose(0, 1)
    q_pos = torch.arange(query_offset, query_offset + q_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(key_offset, key_offset + k_len, device=query.device).unsqueeze(0)
    needs_mask = q_len > 1 or sliding_window > 0
    mask = None
    if needs_mask:
        mask = k_pos <= q_pos
        if sliding_window > 0:
            mask &= k_pos > q_pos - sliding_window
    if softcap <= 0:
        # Queries and keys that start together without a window (a whole prompt) are SDPA's own causal case
        # (top-left aligned), whose flash kernels skip the blocks above the diagonal a mask would compute.
        causal = mask is not None and query_offset == key_offset and sliding_window <= 0
        # With a batch axis: for 3-D inputs some dispatches take SDPA's math path, which materialises the scores.
        out = F.scaled_dot_product_attention(
            q[None],
            k[None],
            v[None],
            attn_mask=None if causal else mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    # Logit soft-capping (Gemma 2) has no SDPA equivalent: spell it out, softmax in float32.
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, dim=0)
    v = v.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """One query token per sequence, all sequences at once: query [B, H, D] -> [B, H, Dv].

    Each sequence's blocks are gathered into a padded [B, max_len] key/value view and the padding (and
    anything outside the sliding window) is masked, so a decode step costs a few batched ops per layer
    instead of one attention call per sequence.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[-2]
    # In the query's dtype: a 16-bit cache under a float32 model is widened here.
    keys = k_cache[block_tables].flatten(1, 2).to(query.dtype)  # [B, L, Hkv, D]
    values = v_cache[block_tables].flatten(1, 2).to(query.dtype)
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", q, keys).float() * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(keys.shape[1], device=query.device)
    last = (seq_lens - 1).unsqueeze(1)
    invalid = key_pos > last
    if sliding_window > 0:
        invalid |= key_pos <= last - sliding_window
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(batch, num_heads, values.shape[-1])


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """Attend each sequence's queries ([num_tokens, H, D]) over its cached context; returns [num_tokens, H, Dv]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if metadata.is_pure_decode:
        return _decode_attention(
            query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, softcap, sliding_window
        )
    out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
    starts = metadata.query_start_loc_host
    decoding = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    if len(decoding) < 2:
        decoding = []  # nothing to batch
    else:
        # A mixed step's decoding sequences attend together, as a decode step's do, not one SDPA call each.
        seqs = torch.tensor(decoding, device=query.device)
        rows = torch.tensor([starts[i] for i in decoding], device=query.device)
        attended = _decode_attention(
            query.index_select(0, rows),
            k_cache,
            v_cache,
            metadata.block_tables.index_select(0, seqs),
            metadata.seq_lens.index_select(0, seqs),
            scale,
            softcap,
            sliding_window,
        )
        out.index_copy_(0, rows, attended)
    batched = set(decoding)
    others = [i for i in range(metadata.num_seqs) if i not in batched]
    attend_sequences(query, k_cache, v_cache, metadata, others, out, scale, softcap, sliding_window)
    return out


def attend_sequences(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    seqs: Iterable[int],
    out: torch.Tensor,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> None:
    """Attend the queries of sequences `seqs` (their rows of query [num_tokens, H, D]) over their cached
    contexts, one SDPA call each, into the same rows of `out` [num_tokens, H, Dv]."""
    block_size = metadata.block_size
    starts = metadata.query_start_loc_host
    for i in seqs:
        seq_len = metadata.seq_lens_host[i]
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        query_offset = seq_len - q_len
        # Keys older than the window can never be attended to: skip whole blocks of them.
        first_key = max(0, query_offset - sliding_window + 1) if sliding_window > 0 else 0
        first_block = first_key // block_size
        last_block = (seq_len + block_size - 1) // block_size
        blocks = metadata.block_tables[i, first_block:last_block]
        key_offset = first_block * block_size
        num_keys = seq_len - key_offset
        key = k_cache[blocks].flatten(0, 1)[:num_keys].to(query.dtype)
        value = v_cache[blocks].flatten(0, 1)[:num_keys].to(query.dtype)
        out[q_start:q_end] = _attend(
            query[q_start:q_end], key, value, query_offset, key_offset, scale, softcap, sliding_window
        )


def write_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """A layer's attention step: store this step's keys and values, then attend (`paged_attention`); the
    output is contiguous."""
    write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    return paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window).contiguous()


class TorchNativeBackend(AttentionBackend):
    """The reference backend: `write_and_attend` with the step's metadata, on any device."""

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
        return write_and_attend(query, key, value, kv_cache, step, scale, softcap, sliding_window)
