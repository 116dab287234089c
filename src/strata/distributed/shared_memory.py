"""Collectives between the ranks of one machine through a shared-memory segment.

gloo moves even a few hundred bytes between two local processes through TCP and its own threads: about
1.5 ms a collective on a small machine, more than a whole decode step of a small model. Here each rank
copies its tensor into its slot of a segment all ranks map, publishes the collective's sequence number
in its flag, and waits (spinning) until every rank has published it; then each reads all slots. Slots are
double-buffered by sequence parity: a rank can only write slot set k + 2 after every rank arrived at
k + 1, so after every rank finished reading set k. Every rank sums the slots in rank order, so all get the
same bits. A rank that does not arrive within the timeout is named in the error.

The flags are plain stores and loads, which x86's total store order keeps in order (data before flag);
other architectures use gloo.
"""

from __future__ import annotations

import multiprocessing
import pickle
import platform
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch

# A flag per rank, each on its own cache line.
_FLAG_STRIDE = 8  # int64s
_SUPPORTED_MACHINES = {"x86_64", "AMD64"}
# What `broadcast_object` returns when the object does not fit a slot.
TOO_LARGE = object()
_TOO_LARGE_LENGTH = 2**63 - 1
# A channel message's header size, and the alignment of the tensor bytes after its pickled object.
_ALIGN = 16
# How often a waiting collective asks the watchdog whether a rank died.
_WATCH_SECONDS = 0.1
# A collective spins this long (the other ranks are a few microseconds behind within a step), then
# sleeps between looks.
_SPIN_SECONDS = 2e-3
_IDLE_SLEEP_SECONDS = 2e-4


def supported() -> bool:
    return platform.machine() in _SUPPORTED_MACHINES


class _SharedSegment:
    """A shared-memory segment that rank 0 creates (`name` None) and the others attach to by the name rank
    0 sent them, and the bounded wait its users spin in."""

    def __init__(self, name: str | None, size: int, timeout: float) -> None:
        self.timeout = timeout
        self.segment = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        self.name = self.segment.name
        if name is not None and multiprocessing.parent_process() is None:
            # Attaching registers the segment for removal at this process's exit too: rank 0 owns it. (A
            # rank rank 0 spawned shares its resource tracker, where the name is rank 0's to remove.)
            resource_tracker.unregister(self.segment._name, "shared_memory")  # type: ignore[attr-defined]
        # Says which rank died (None: all alive); asked while a wait goes on, so a dead rank fails the
        # others at once instead of after the timeout.
        self.watchdog: Callable[[], str | None] | None = None

    def unlink(self) -> None:
        """Remove the segment's name (the mappings stay until closed)."""
        self.segment.unlink()

    def close(self) -> None:
        self.segment.close()

    def _wait(self, ready: Callable[[], bool], waiting_for: Callable[[], str]) -> None:
        """Spin until `ready()`, then sleep between looks; past the timeout, fail saying what it was
        `waiting_for`; a rank the watchdog finds dead fails it at once."""
        if ready():
            return
        now = time.monotonic()
        spin_until, deadline, next_check = now + _SPIN_SECONDS, now + self.timeout, now + _WATCH_SECONDS
        while not ready():
            now = time.monotonic()
            if now > spin_until:
                time.sleep(_IDLE_SLEEP_SECONDS)  # a long wait (an idle engine): stop burning the core
            if now > deadline:
                raise TimeoutError(f"{waiting_for()} within {self.timeout} s")
            if now > next_check and self.watchdog is not None:
                next_check = now + _WATCH_SECONDS
                if (dead := self.watchdog()) is not None:
                    raise RuntimeError(f"{waiting_for()}: {dead}")


class SharedMemoryCommunicator(_SharedSegment):
    """All-reduce, all-gather and broadcast of up to `slot_bytes` between `world` local ranks."""

    def __init__(self, rank: int, world: int, name: str | None, slot_bytes: int, timeout: float) -> None:
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        flag_bytes = world * _FLAG_STRIDE * 8
        super().__init__(name, flag_bytes + 2 * world * slot_bytes, timeout)
        self.flags = np.ndarray((world, _FLAG_STRIDE), dtype=np.int64, buffer=self.segment.buf)
        if name is None:
            self.flags[:] = 0
        self.data = torch.frombuffer(self.segment.buf, dtype=torch.uint8, offset=flag_bytes)
        self.sequence = 0

    def close(self) -> None:
        del self.data, self.flags
        super().close()

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # -- the exchange ---------------------------------------------------------------------------------
    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        start = (parity * self.world + rank) * self.slot_bytes
        return self.data[start : start + nbytes]

    def _exchange(self, payload: torch.Tensor) -> int:
        """Publish `payload` (bytes) in this rank's slot and wait for every rank's; returns the parity of
        the slot set that now holds them all."""
        self.sequence += 1
        parity = self.sequence % 2
        self._slot(parity, self.rank, payload.numel()).copy_(payload)
        self.flags[self.rank, 0] = self.sequence
        self._wait(
            lambda: bool((self.flags[:, 0] >= self.sequence).all()),
            lambda: (
                f"tensor-parallel ranks {np.flatnonzero(self.flags[:, 0] < self.sequence).tolist()} "
                "did not reach a collective"
            ),
        )
        return parity

    def _gathered(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape and dtype on all), as views of the segment."""
        x = x.contiguous()
        raw = x.view(-1).view(torch.uint8)
        parity = self._exchange(raw)
        return [
            self._slot(parity, rank, raw.numel()).view(x.dtype).view(x.shape) for rank in range(self.world)
        ]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._gathered(x)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._gathered(x), dim=dim)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """`obj` from rank `src`, or `TOO_LARGE` on every rank when its pickle does not fit a slot (the
        caller then sends it another way)."""
        if self.rank == src:
            raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            fits = len(raw) + 8 <= self.slot_bytes
            header = (len(raw) if fits else _TOO_LARGE_LENGTH).to_bytes(8, "little")
            payload = torch.frombuffer(bytearray(header + raw if fits else header), dtype=torch.uint8)
        else:
            payload = torch.zeros(8, dtype=torch.uint8)  # nothing to say; the slot set is what matters
        parity = self._exchange(payload)
        length = int.from_bytes(bytes(self._slot(parity, src, 8).numpy()), "little")
        if length == _TOO_LARGE_LENGTH:
            return TOO_LARGE
        if self.rank == src:
            return obj
        return pickle.loads(bytes(self._slot(parity, src, 8 + length).numpy()[8:]))


class SharedMemoryChannel(_SharedSegment):
    """Messages from one local rank to another (a pipeline stage to the next): a ring of `num_slots`
    chunks of `slot_bytes`, so a message of any size streams through while the receiver copies it out.

    The sender's count of chunks written and the receiver's count of chunks read sit on their own cache
    lines; the sender waits while the ring is full, the receiver while it is empty. A message is an
    object (pickled) and a tensor's raw bytes: [object length, tensor length][object][tensor bytes]."""

    def __init__(self, name: str | None, slot_bytes: int, num_slots: int, timeout: float, peer: str) -> None:
        self.slot_bytes, self.num_slots, self.peer = slot_bytes, num_slots, peer
        flag_bytes = 2 * _FLAG_STRIDE * 8
        super().__init__(name, flag_bytes + num_slots * slot_bytes, timeout)
        self.flags = np.ndarray((2, _FLAG_STRIDE), dtype=np.int64, buffer=self.segment.buf)
        if name is None:
            self.flags[:] = 0
        self.data = torch.frombuffer(self.segment.buf, dtype=torch.uint8, offset=flag_bytes)

    def close(self) -> None:
        del self.data, self.flags
        super().close()

    def _slot(self, chunk: int) -> torch.Tensor:
        start = (chunk % self.num_slots) * self.slot_bytes
        return self.data[start : start + self.slot_bytes]

    def send(self, obj: Any, tensor: torch.Tensor | None = None) -> None:
        """Send `obj` and (a copy of) `tensor` to the receiving rank."""
        data = torch.empty(0, dtype=torch.uint8)
        meta = None
        if tensor is not None:
            tensor = tensor.detach().contiguous()
            data, meta = tensor.view(-1).view(torch.uint8), (tensor.dtype, tuple(tensor.shape))
        raw = pickle.dumps((obj, meta), protocol=pickle.HIGHEST_PROTOCOL)
        padded = -(-len(raw) // _ALIGN) * _ALIGN  # the tensor's bytes start aligned for any dtype
        header = torch.tensor([padded, data.numel()], dtype=torch.int64).view(torch.uint8)
        pickled = torch.zeros(padded, dtype=torch.uint8)
        pickled[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        # The header and the tensor's bytes back to back, copied chunk by chunk straight into the ring (a
        # step's activations are not copied into one message first).
        parts = [torch.cat([header, pickled]), data]
        written = int(self.flags[0, 0])
        part, part_offset = 0, 0
        for _ in range(0, sum(p.numel() for p in parts), self.slot_bytes):  # a chunk each
            self._wait(
                lambda written=written: written - int(self.flags[1, 0]) < self.num_slots,
                lambda: f"{self.peer} did not take a message",
            )
            slot, filled = self._slot(written), 0
            while filled < self.slot_bytes and part < len(parts):
                count = min(self.slot_bytes - filled, parts[part].numel() - part_offset)
                slot[filled : filled + count].copy_(parts[part][part_offset : part_offset + count])
                filled, part_offset = filled + count, part_offset + count
                if part_offset == parts[part].numel():
                    part, part_offset = part + 1, 0
            written += 1
            self.flags[0, 0] = written

    def receive(self) -> tuple[Any, torch.Tensor | None]:
        """The next message: its object and its tensor (None when it was sent without one)."""
        read = int(self.flags[1, 0])
        self._wait(lambda: int(self.flags[0, 0]) > read, lambda: f"{self.peer} sent nothing")
        object_bytes, tensor_bytes = self._slot(read)[:_ALIGN].clone().view(torch.int64).tolist()
        message = torch.empty(_ALIGN + object_bytes + tensor_bytes, dtype=torch.uint8)
        for offset in range(0, message.numel(), self.slot_bytes):
            if offset:
                self._wait(
                    lambda read=read: int(self.flags[0, 0]) > read, lambda: f"{self.peer} sent half a message"
                )
            chunk = message[offset : offset + self.slot_bytes]
            chunk.copy_(self._slot(read)[: chunk.numel()])
            read += 1
            self.flags[1, 0] = read
        obj, meta = pickle.loads(message[_ALIGN : _ALIGN + object_bytes].numpy().tobytes())
        if meta is None:
            return obj, None
        dtype, shape = meta
        return obj, message[_ALIGN + object_bytes :].view(dtype).view(shape)
