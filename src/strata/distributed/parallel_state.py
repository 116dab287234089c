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


def init_distributed(backend: str, init_method: str, rank: int, world_size: int, timeout: float) -> None:
    """Join the engine's process group as `rank` of `world_size`; collectives time out after `timeout`
    seconds, so a dead or hung rank fails the others instead of blocking them for ever."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}, not {rank} of "
                f"{world_size}"
            )
        return
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
