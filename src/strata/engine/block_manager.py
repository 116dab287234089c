"""Paged KV-cache block allocation with reference counts and automatic prefix caching.

Every full block is identified by a hash of its tokens chained with the hash of the block before it, so a
hash names a whole prefix. Freed blocks keep their contents and hash and sit in an LRU free queue: a later
sequence with the same prefix takes them back instead of recomputing, and only when a free block is
reused for new tokens is its old hash forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from strata.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass
class BlockManagerStats:
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the least recently freed block is reused first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.stats = BlockManagerStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """At admission, take the cached blocks of the longest known prefix of `seq`.

        The last token is always left to compute, because its logits are needed to sample.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return  # prompt logprobs need the logits of every prompt position
        num_full = (seq.num_tokens - 1) // self.block_size
        parent: int | None = None
        for i in range(num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            parent = block_hash
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def record_admission(self, seq: Sequence) -> None:
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += seq.num_cached_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens; call `can_append` first."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                # Reusing an evicted block: its old prefix is no longer cached.
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Register the blocks that this step's tokens filled, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        first = num_computed_before // self.block_size
        last = seq.num_computed_tokens // self.block_size
        if first == last:  # most decode steps: no block filled up
            return
        parent = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash, block.token_ids = chain_hash(parent, tokens), tokens
                self.hash_to_block.setdefault(block.hash, block.block_id)
            parent = block.hash

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; its tail blocks become the first candidates for eviction."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_blocks[block_id] = None
                    self.free_blocks.move_to_end(block_id, last=False)  # nothing worth keeping: reuse first
                else:
                    self.free_blocks[block_id] = None
        seq.block_table = []

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1
