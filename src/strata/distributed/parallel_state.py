"""This process's place among an engine's ranks: its tensor-parallel rank and group.

One engine's ranks form one torch.distributed process group (gloo on the CPU, nccl on CUDA: the
platform's `distributed_backend`). A process outside any group is rank 0 of 1, so layers ask the same
questions in one process and in many.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from strata.distributed import shared_memory
from strata.distributed.shared_memory import SharedMemoryCommunicator

# Each rank's slot of the shared segment: collectives of larger tensors go through the process group.
_SLOT_BYTES = 8 * 2**20
_local: SharedMemoryCommunicator | None = None
_MIN_JOIN_SECONDS = 300.0


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_group() -> dist.ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def free_local_init_method() -> str:
    """A TCP store address on 127.0.0.1 with a port free now, for ranks spawned on this machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or a launcher setting its variables) started this process as one
    rank of a group; None otherwise."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def same_machine() -> bool:
    """Whether the ranks torchrun started all run on this machine (one node)."""
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def local_communicator() -> SharedMemoryCommunicator | None:
    """The shared-memory collectives of ranks that all run on this machine (None: the process group's)."""
    return _local


def init_distributed(
    backend: str, init_method: str, rank: int, world_size: int, timeout: float, same_machine: bool
) -> None:
    """Join the engine's process group as `rank` of `world_size`. Ranks that all run on this machine
    (`same_machine`) also map one shared-memory segment for their collectives, which time out after
    `timeout` seconds so a hung rank fails the others instead of blocking them for ever (the process
    group's own collectives, across machines, after at least `_MIN_JOIN_SECONDS`)."""
    global _local
    if dist.is_initialized():
        raise RuntimeError(f"this process is already rank {dist.get_rank()} of an engine's process group")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        # Joining waits for every rank to start (importing torch, on a busy machine) as well.
        timeout=datetime.timedelta(seconds=max(timeout, _MIN_JOIN_SECONDS)),
    )
    if same_machine and shared_memory.supported() and backend == "gloo":
        holder = [None]
        if rank == 0:
            _local = shared_memory.SharedMemoryCommunicator(rank, world_size, None, _SLOT_BYTES, timeout)
            holder = [_local.name]
        dist.broadcast_object_list(holder, src=0)
        if rank != 0:
            _local = shared_memory.SharedMemoryCommunicator(rank, world_size, holder[0], _SLOT_BYTES, timeout)
        dist.barrier()
        if rank == 0:  # every rank has mapped it: the name can go, so no crash can leave it behind
            _local.unlink()


def shutdown_distributed() -> None:
    """Leave the process group and unmap the shared segment."""
    global _local
    if _local is not None:
        _local.close()
        _local = None
    if dist.is_initialized():
        dist.destroy_process_group()
