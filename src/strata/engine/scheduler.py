"""Continuous batching: which tokens of which sequences run in the next forward pass.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, in arrival order,
each taking what it still needs (one token when decoding, a chunk of its prompt when prefilling); then
waiting sequences are admitted. When the KV cache runs out of blocks, the newest running sequences are
preempted: their blocks are freed and they go back to the front of their request's queue, to be
recomputed later. Nothing is ever dropped.

The scheduler owns the KV block manager: it allocates a sequence's blocks when it schedules it, registers
the blocks a step filled when the step's output comes back (`update_from_output`), and frees them when a
sequence is preempted or finishes. A scheduled sequence is in flight until its step's output comes back
(at once with one process, a few steps later in a pipeline) and is not scheduled or preempted meanwhile.

Admission is fair between requests, not first come first served by sequence: the next sequence admitted
is one of the waiting request that has the fewest sequences running, and when the batch is full
(`max_num_seqs`) while a request has none running, the request with the most running gives up its newest
one. So a request of thousands of sequences (many prompts, large `n`) cannot hold back another's first
token until all of its own have run; it keeps the rest of the batch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from strata.config import CacheConfig, SchedulerConfig
from strata.engine.block_manager import BlockManager
from strata.engine.sequence import Request, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """A sequence's share of one step, as it stood when scheduled: `num_tokens` tokens from `start`, and
    whether they reach its last token (so a new token is sampled after them)."""

    seq: Sequence
    num_tokens: int

    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        start = self.seq.num_computed_tokens
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "samples", start + self.num_tokens == self.seq.num_tokens)


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


class WaitingQueue:
    """Waiting sequences, a first-in-first-out queue per request, requests in arrival order."""

    def __init__(self) -> None:
        self._queues: dict[Request, deque[Sequence]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues.values():
            yield from queue

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and seq in self._queues.get(seq.request, ())

    def append(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.request, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: first of its request's to be admitted again."""
        self._queues.setdefault(seq.request, deque()).appendleft(seq)
        self._len += 1

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def requests(self) -> list[Request]:
        return list(self._queues)

    def next(self, running: Counter[Request] | None) -> Sequence:
        """The sequence to admit next: the first of the request with the fewest `running` sequences (the
        earliest such request), or of the earliest request when `running` is None."""
        if running is None or len(self._queues) == 1:
            request = next(iter(self._queues))
        else:
            request = min(self._queues, key=lambda r: running[r])
        return self._queues[request][0]

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[seq.request]
        if queue[0] is seq:
            queue.popleft()
        else:
            queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[seq.request]


class Scheduler:
    """Which sequences run next, and the KV-cache blocks they hold (`num_blocks` of them in all)."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int) -> None:
        assert config.max_num_batched_tokens is not None
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        # Sequences in a step whose output has not come back: their blocks are being written.
        self._in_flight: set[Sequence] = set()
        self.stats = SchedulerStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def is_in_flight(self, seq: Sequence) -> bool:
        return seq in self._in_flight

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """The next step's work: at most `max_seqs` sequences (all that fit by default), none of those in
        a step still in flight."""
        out = SchedulerOutput()
        max_seqs = max_seqs if max_seqs is not None else self.max_num_seqs
        fairness_preemptions = self._make_room_for_starved_requests()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            seq = self.running[i]
            if seq in self._in_flight:
                i += 1
                continue
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_tokens):
                # Newest first; never one in flight, whose step writes its blocks (`seq` itself is not).
                victim = next(s for s in reversed(self.running) if s not in self._in_flight)
                self.running.remove(victim)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, num_tokens)
                out.scheduled.append(ScheduledSequence(seq, num_tokens))
                budget -= num_tokens
                i += 1
        # Admit new work only when nothing had to be preempted: otherwise it would take the freed blocks.
        # Running counts per request order the admissions; one waiting request needs none.
        running = Counter(s.request for s in self.running) if self.waiting.num_requests > 1 else None
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(out.scheduled) < max_seqs
            and not out.num_preempted
        ):
            seq = self.waiting.next(running)
            self.block_manager.allocate_cached_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_tokens = min(remaining, budget)
            if (not self.chunked_prefill and remaining > budget) or not self.block_manager.can_append(
                seq, num_tokens
            ):
                self.block_manager.free(seq)  # give the prefix back until it can really start
                seq.reset_for_recompute()
                break
            self.waiting.remove(seq)
            if running is not None:
                running[seq.request] += 1
            self.block_manager.record_admission(seq)
            self.block_manager.append_slots(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
        self._in_flight.update(item.seq for item in out.scheduled)
        self.stats.num_steps += 1
        self.stats.num_preemptions += out.num_preempted + fairness_preemptions
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(out.scheduled))
        return out

    def _make_room_for_starved_requests(self) -> int:
        """With the batch full, give each waiting request that has no sequence running a slot, taken from
        the request running the most (never its last one); returns how many sequences were preempted."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return 0
        running = Counter(seq.request for seq in self.running)
        preempted = 0
        for request in self.waiting.requests():
            if running[request]:
                continue
            richest, count = running.most_common(1)[0]
            if count < 2:
                break
            victim = next(
                (s for s in reversed(self.running) if s.request is richest and s not in self._in_flight), None
            )
            if victim is None:
                break
            self.running.remove(victim)
            self._preempt(victim)
            running[richest] -= 1
            preempted += 1
        return preempted

    def update_from_output(self, schedule: SchedulerOutput) -> None:
        """A step's output came back: its sequences' tokens are in the cache now (those that finished
        meanwhile, aborted while in flight, have no blocks left), and the blocks they filled are cached."""
        for item in schedule.scheduled:
            seq = item.seq
            self._in_flight.discard(seq)
            if not seq.is_finished:
                seq.num_computed_tokens = item.start + item.num_tokens
                self.block_manager.cache_full_blocks(seq, item.start)

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
