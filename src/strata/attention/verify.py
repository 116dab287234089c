"""Checks an attention backend against the reference backend on random paged steps (`strata layers
--verify`): a decode step, a prefill step and a mixed one, with and without a sliding window and
soft-capping, over shuffled blocks. Both must store the same keys and values and attend alike."""

from __future__ import annotations

import torch

from strata.attention.backend import AttentionBackend
from strata.attention.backends.torch_native import TorchNativeBackend
from strata.attention.forward_context import AttentionMetadata

_BLOCK_SIZE = 4
_SEQ_LENS = [1, 6, 9, 17]
# (query tokens per sequence) of the three steps: decode, every prompt whole, and a mix.
_STEPS = ([1, 1, 1, 1], _SEQ_LENS, [1, 3, 1, 17])
_SETTINGS = ((0, 0.0), (5, 20.0))  # (sliding window, soft-cap)


def _step(query_lens: list[int], generator: torch.Generator) -> AttentionMetadata:
    """The metadata of a step whose sequences end at `_SEQ_LENS`, with `query_lens` new tokens each."""
    blocks_per_seq = -(-max(_SEQ_LENS) // _BLOCK_SIZE)
    order = torch.randperm(len(_SEQ_LENS) * blocks_per_seq, generator=generator)
    block_tables = order.view(len(_SEQ_LENS), blocks_per_seq)
    starts, slots = [0], []
    for table, seq_len, q_len in zip(block_tables.tolist(), _SEQ_LENS, query_lens, strict=True):
        starts.append(starts[-1] + q_len)
        slots.extend(
            table[p // _BLOCK_SIZE] * _BLOCK_SIZE + p % _BLOCK_SIZE for p in range(seq_len - q_len, seq_len)
        )
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=block_tables,
        seq_lens=torch.tensor(_SEQ_LENS, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_host=list(_SEQ_LENS),
        query_start_loc_host=starts,
        max_query_len=max(query_lens),
        max_seq_len=max(_SEQ_LENS),
        block_size=_BLOCK_SIZE,
    )


def verify_backend(
    backend: AttentionBackend,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> float:
    """The largest absolute difference, over outputs and stored caches, between `backend` and the reference
    for layers of this shape, queries in `dtype` (caches in the backend's dtype)."""
    reference = TorchNativeBackend(backend.kv_cache_dtype)
    generator = torch.Generator().manual_seed(seed)
    blocks = len(_SEQ_LENS) * -(-max(_SEQ_LENS) // _BLOCK_SIZE)
    worst = 0.0
    for query_lens in _STEPS:
        metadata = _step(query_lens, generator)
        tokens = sum(query_lens)
        for window, softcap in _SETTINGS:
            query = torch.randn(tokens, num_heads, head_dim, generator=generator).to(dtype)
            key, value = torch.randn(2, tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
            cache = torch.randn(2, blocks, _BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
            cache = cache.to(backend.kv_cache_dtype)
            expected_cache = cache.clone()
            settings = (head_dim**-0.5, softcap, window)
            out = backend.forward(query, key, value, cache, backend.prepare_step(metadata), *settings)
            expected = reference.forward(
                query, key, value, expected_cache, reference.prepare_step(metadata), *settings
            )
            for got, want in ((out, expected), (cache, expected_cache)):
                worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst
