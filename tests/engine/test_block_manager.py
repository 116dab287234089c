"""Block allocation, reference counts, prefix-cache hits and LRU eviction, on real Sequences."""

from __future__ import annotations

import time

from strata.engine.block_manager import BlockManager
from strata.engine.sequence import Request, Sequence
from strata.sampling_params import SamplingParams


def _seq(tokens: list[int]) -> Sequence:
    request = Request("r", None, tokens, SamplingParams(), time.monotonic())
    return Sequence(request, 0, None, None)


def _run_prefill(manager: BlockManager, seq: Sequence) -> None:
    manager.allocate_cached_prefix(seq)
    todo = seq.num_tokens - seq.num_computed_tokens
    assert manager.can_append(seq, todo)
    manager.append_slots(seq, todo)
    before = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq, before)


def test_allocation_and_free_return_every_block() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(list(range(10)))
    _run_prefill(manager, seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert not manager.can_append(seq, 4 * 5 + 3)  # would need 6 more blocks
    manager.free(seq)
    assert manager.num_free_blocks == 8 and seq.block_table == []


def test_shared_prefix_is_reused_with_reference_counts() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(10)))
    _run_prefill(manager, first)
    second = _seq([*range(8), 99, 98, 97])
    manager.allocate_cached_prefix(second)
    assert second.block_table == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert all(manager.blocks[b].ref_count == 2 for b in second.block_table)
    # A different token in the first block breaks the chain: nothing is shared.
    third = _seq([5, *range(1, 10)])
    manager.allocate_cached_prefix(third)
    assert third.block_table == []


def test_last_token_is_always_computed() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(8)))
    _run_prefill(manager, first)
    again = _seq(list(range(8)))
    manager.allocate_cached_prefix(again)
    assert again.num_computed_tokens == 4  # the second block holds the last token, so it is recomputed


def test_freed_blocks_stay_cached_until_reused() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    first = _seq(list(range(9)))
    _run_prefill(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = _seq(list(range(9)))
    manager.allocate_cached_prefix(again)
    assert again.num_cached_tokens == 8
    manager.free(again)
    # Filling the whole cache with other tokens evicts the old prefix.
    other = _seq(list(range(100, 116)))
    _run_prefill(manager, other)
    manager.free(other)
    evicted = _seq(list(range(9)))
    manager.allocate_cached_prefix(evicted)
    assert evicted.num_cached_tokens == 0
