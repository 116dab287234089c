"""Continuous batching: which tokens of which sequences run in the next forward pass.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, in arrival order,
each taking what it still needs (one token when decoding, a chunk of its prompt when prefilling); then
waiting sequences are admitted first come first served. When the KV cache runs out of blocks, the newest
running sequences are preempted: their blocks are freed and they go back to the front of the queue, to be
recomputed later. Nothing is ever dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from strata.config import SchedulerConfig
from strata.engine.block_manager import BlockManager
from strata.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a new token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    max_batch_size: int = 0  # most sequences seen in one forward pass


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        assert config.max_num_batched_tokens is not None
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_tokens):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, num_tokens)
                out.scheduled.append(ScheduledSequence(seq, num_tokens))
                scheduled_ids.add(seq.seq_id)
                budget -= num_tokens
                i += 1
        # Admit new work only when nothing had to be preempted: otherwise it would take the freed blocks.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            self.block_manager.allocate_cached_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_tokens = min(remaining, budget)
            if (not self.chunked_prefill and remaining > budget) or not self.block_manager.can_append(
                seq, num_tokens
            ):
                self.block_manager.free(seq)  # give the prefix back until it can really start
                seq.reset_for_recompute()
                break
            self.waiting.popleft()
            self.block_manager.record_admission(seq)
            self.block_manager.append_slots(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
        self.stats.num_steps += 1
        self.stats.num_preemptions += out.num_preempted
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(out.scheduled))
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished and free its blocks at once, wherever it is."""
        assert status.is_finished
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)
