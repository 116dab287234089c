"""This process's place among an engine's ranks: its tensor-parallel rank and group, its pipeline stage.

One engine's ranks form one torch.distributed process group (gloo on the CPU, nccl on CUDA: the
platform's `distributed_backend`); rank r is tensor-parallel rank r % T of pipeline stage r // T. A
process outside any group is rank 0 of 1, so layers ask the same questions in one process and in many.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from strata.distributed import shared_memory
from strata.distributed.shared_memory import SharedMemoryChannel, SharedMemoryCommunicator

# Each rank's slot of the shared segment: collectives of larger tensors go through the process group.
_SLOT_BYTES = 8 * 2**20
# A pipeline channel's ring: messages of any size stream through it in chunks.
_CHANNEL_SLOT_BYTES = 2**20
_CHANNEL_SLOTS = 4
_local: SharedMemoryCommunicator | None = None
# (sender, receiver) -> the shared-memory channel between two local pipeline stages this rank is one of.
_channels: dict[tuple[int, int], SharedMemoryChannel] = {}
_pipeline_size = 1
_MIN_JOIN_SECONDS = 300.0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def pp_world_size() -> int:
    return _pipeline_size if dist.is_initialized() else 1


def pp_rank() -> int:
    return rank() // tp_world_size()


def tp_world_size() -> int:
    return world_size() // pp_world_size()


def tp_rank() -> int:
    return rank() % tp_world_size()


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


def local_channel(sender: int, receiver: int) -> SharedMemoryChannel | None:
    """The shared-memory channel from pipeline rank `sender` to `receiver` (None: the process group's
    point-to-point messages)."""
    return _channels.get((sender, receiver))


def set_watchdog(watchdog: Callable[[], str | None]) -> None:
    """What every shared-memory wait of this rank asks to learn whether a rank died."""
    for segment in [_local, *_channels.values()]:
        if segment is not None:
            segment.watchdog = watchdog


def init_distributed(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    timeout: float,
    same_machine: bool,
    pipeline_parallel_size: int = 1,
) -> None:
    """Join the engine's process group as `rank` of `world_size`, in `pipeline_parallel_size` stages. Ranks
    that all run on this machine (`same_machine`) also map shared-memory segments for their collectives and
    for the messages between consecutive stages, which time out after `timeout` seconds so a hung rank
    fails the others instead of blocking them for ever (the process group's own collectives, across
    machines, after at least `_MIN_JOIN_SECONDS`)."""
    global _local, _pipeline_size
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
    _pipeline_size = pipeline_parallel_size
    if same_machine and shared_memory.supported() and backend == "gloo":
        if pipeline_parallel_size > 1:
            _map_channels(rank, world_size, timeout)
        else:
            _map_communicator(rank, world_size, timeout)


def _map_communicator(rank: int, world_size: int, timeout: float) -> None:
    global _local
    holder = [None]
    if rank == 0:
        _local = SharedMemoryCommunicator(rank, world_size, None, _SLOT_BYTES, timeout)
        holder = [_local.name]
    dist.broadcast_object_list(holder, src=0)
    if rank != 0:
        _local = SharedMemoryCommunicator(rank, world_size, holder[0], _SLOT_BYTES, timeout)
    dist.barrier()
    if rank == 0:  # every rank has mapped it: the name can go, so no crash can leave it behind
        _local.unlink()


def _map_channels(rank: int, world_size: int, timeout: float) -> None:
    """A channel from each stage to the next, and from the last back to rank 0 (its logits)."""
    edges = [(r, (r + 1) % world_size) for r in range(world_size)]
    created = {}
    if rank == 0:
        created = {
            edge: SharedMemoryChannel(None, _CHANNEL_SLOT_BYTES, _CHANNEL_SLOTS, timeout, "")
            for edge in edges
        }
    holder = [{edge: channel.name for edge, channel in created.items()}]
    dist.broadcast_object_list(holder, src=0)
    for edge, name in holder[0].items():
        if rank not in edge:
            continue
        peer = f"rank {edge[1] if edge[0] == rank else edge[0]}"
        if rank == 0:
            _channels[edge] = created[edge]
            _channels[edge].peer = peer
        else:
            _channels[edge] = SharedMemoryChannel(name, _CHANNEL_SLOT_BYTES, _CHANNEL_SLOTS, timeout, peer)
    dist.barrier()
    for edge, channel in created.items():
        channel.unlink()
        if rank not in edge:
            channel.close()


def shutdown_distributed() -> None:
    """Leave the process group and unmap the shared segment."""
    global _local, _pipeline_size
    for segment in [_local, *_channels.values()]:
        if segment is not None:
            segment.close()
    _local, _pipeline_size = None, 1
    _channels.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
