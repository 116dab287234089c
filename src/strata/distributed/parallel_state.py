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
from typing import Any

import torch
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
# This stage's tensor-parallel ranks, where there are several stages (else the whole group).
_tp_group: dist.ProcessGroup | None = None
# Where this rank's model, and so the tensors of its process group (nccl's on its GPU), live.
_device = torch.device("cpu")
_MIN_JOIN_SECONDS = 300.0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    """This rank's place among the engine's ranks on this machine (torchrun's LOCAL_RANK; the ranks an
    engine spawns all run on its machine)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def pp_world_size() -> int:
    return _pipeline_size if dist.is_initialized() else 1


def pp_rank() -> int:
    return rank() // tp_world_size()


def tp_world_size() -> int:
    return world_size() // pp_world_size()


def tp_rank() -> int:
    return rank() % tp_world_size()


def tp_group() -> dist.ProcessGroup:
    """The process group of this rank's tensor-parallel peers (its pipeline stage's ranks)."""
    return _tp_group if _tp_group is not None else dist.group.WORLD  # type: ignore[return-value]


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


def group_device() -> torch.device:
    return _device


def set_group_device(device: torch.device) -> None:
    global _device
    _device = device


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
    global _pipeline_size, _tp_group
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
    tensor_parallel_size = world_size // pipeline_parallel_size
    if pipeline_parallel_size > 1 and tensor_parallel_size > 1:
        for stage in range(pipeline_parallel_size):  # every rank makes every group, in the same order
            group = dist.new_group(_stage_ranks(stage, tensor_parallel_size))
            if stage == rank // tensor_parallel_size:
                _tp_group = group
    if same_machine and shared_memory.supported() and backend == "gloo":
        _map_segments(rank, world_size, pipeline_parallel_size, timeout)


def _stage_ranks(stage: int, tensor_parallel_size: int) -> list[int]:
    return [stage * tensor_parallel_size + t for t in range(tensor_parallel_size)]


def _map_segments(rank: int, world_size: int, stages: int, timeout: float) -> None:
    """Rank 0 creates every segment and sends the others their names: the collectives of each stage's
    tensor-parallel ranks (where it has several), a channel from each rank to its peer of the next stage,
    and one from the last stage's first rank back to rank 0 (the logits)."""
    global _local
    width = world_size // stages
    groups = {("stage", s): _stage_ranks(s, width) for s in range(stages)} if width > 1 else {}
    edges = [(r, r + width) for r in range(world_size - width)]
    if stages > 1:
        edges.append(((stages - 1) * width, 0))
    created: dict[Any, Any] = {}
    if rank == 0:
        created = {key: SharedMemoryCommunicator(0, width, None, _SLOT_BYTES, timeout) for key in groups}
        created |= {
            edge: SharedMemoryChannel(None, _CHANNEL_SLOT_BYTES, _CHANNEL_SLOTS, timeout, "")
            for edge in edges
        }
    holder = [{key: segment.name for key, segment in created.items()}]
    dist.broadcast_object_list(holder, src=0)
    for key, name in holder[0].items():
        members = groups.get(key, key)
        if rank not in members:
            continue
        if key in groups:
            _local = (
                created[key]
                if rank == 0
                else SharedMemoryCommunicator(members.index(rank), width, name, _SLOT_BYTES, timeout)
            )
            continue
        peer = f"rank {key[1] if key[0] == rank else key[0]}"
        if rank == 0:
            _channels[key] = created[key]
            _channels[key].peer = peer
        else:
            _channels[key] = SharedMemoryChannel(name, _CHANNEL_SLOT_BYTES, _CHANNEL_SLOTS, timeout, peer)
    dist.barrier()
    for key, segment in created.items():  # every rank has mapped them: no crash can leave them behind
        segment.unlink()
        if rank not in groups.get(key, key):
            segment.close()


def shutdown_distributed() -> None:
    """Leave the process group and unmap the shared segment."""
    global _local, _pipeline_size, _tp_group, _device
    for segment in [_local, *_channels.values()]:
        if segment is not None:
            segment.close()
    _local, _pipeline_size, _tp_group, _device = None, 1, None, torch.device("cpu")
    _channels.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
