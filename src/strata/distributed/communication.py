"""How an engine's ranks talk: the collectives of tensor-parallel layers, as Strata custom ops (eager
forwards call them as they are, and torch.compile keeps each as one opaque node of the graph: Inductor
cannot lower collectives over a token count it only knows at run time, so a sharded layer still compiles
once); messages between pipeline stages; and the engine's own exchanges of plans and settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from strata.distributed.parallel_state import (
    group_device,
    local_channel,
    local_communicator,
    rank,
    tp_group,
    tp_world_size,
    world_size,
)
from strata.distributed.shared_memory import TOO_LARGE

T = TypeVar("T")

# Seconds this process spent in collectives (waiting for the other ranks included): the cost of
# parallelism that `LLMEngine.stats()` reports.
_collective_seconds = 0.0


def collective_seconds() -> float:
    return _collective_seconds


def _timed(collective: Callable[[], T]) -> T:
    global _collective_seconds
    start = time.perf_counter()
    result = collective()
    _collective_seconds += time.perf_counter() - start
    return result


@torch.library.custom_op("strata::tp_all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    local = local_communicator()
    if local is not None and local.fits(x.nbytes):
        return _timed(lambda: local.all_reduce(x))
    out = x.clone()
    _timed(lambda: dist.all_reduce(out, group=tp_group()))
    return out


@_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("strata::tp_all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    local = local_communicator()
    if local is not None and local.fits(x.nbytes):
        return _timed(lambda: local.all_gather(x, dim))
    parts = [torch.empty_like(x) for _ in range(tp_world_size())]
    _timed(lambda: dist.all_gather(parts, x.contiguous(), group=tp_group()))
    return torch.cat(parts, dim=dim)


@_all_gather.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= tp_world_size()
    return x.new_empty(shape)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel ranks (x itself on one rank)."""
    return x if tp_world_size() == 1 else _all_reduce(x)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` side by side along `dim`, in rank order."""
    return x if tp_world_size() == 1 else _all_gather(x, dim % x.dim())


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (pickled: for a step's small inputs and control messages)."""
    local = local_communicator()
    if local is not None and (sent := local.broadcast_object(obj, src)) is not TOO_LARGE:
        return sent
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=tp_group())
    return holder[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank of the engine."""
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def min_over_ranks(value: int) -> int:
    """The smallest of the engine's ranks' `value`s (what every rank can afford)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=group_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def send_to(receiver: int, obj: Any, tensor: torch.Tensor | None = None) -> None:
    """Send `obj` (pickled) and `tensor` to rank `receiver`, which takes them with `receive_from`."""
    channel = local_channel(rank(), receiver)
    if channel is not None:
        return _timed(lambda: channel.send(obj, tensor))
    meta = None if tensor is None else (tensor.dtype, tuple(tensor.shape))

    def send() -> None:
        dist.send_object_list([obj, meta], dst=receiver)
        if tensor is not None:
            dist.send(tensor.contiguous(), dst=receiver)

    _timed(send)


def receive_from(sender: int) -> tuple[Any, torch.Tensor | None]:
    """The next object and tensor (None if it sent none) rank `sender` sent this rank."""
    channel = local_channel(sender, rank())
    if channel is not None:
        return _timed(channel.receive)

    def receive() -> tuple[Any, torch.Tensor | None]:
        holder: list[Any] = [None, None]
        dist.recv_object_list(holder, src=sender)
        obj, meta = holder
        if meta is None:
            return obj, None
        tensor = torch.empty(meta[1], dtype=meta[0], device=group_device())
        dist.recv(tensor, src=sender)
        return obj, tensor

    return _timed(receive)
