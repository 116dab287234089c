"""Host memory in transparent huge pages for what every CPU decode step streams: the weights and the KV cache.

A batch-1 decode step reads every weight once. In 4 KiB pages that is a TLB miss per 4 KiB read (130,000
pages a step for SmolLM-135M in float32); in 2 MiB pages, 512 times fewer. Linux backs a range with huge
pages on its first write when THP is `always`, or when it is `madvise` (a common default) and the range was
advised `MADV_HUGEPAGE` before that write. So the weights are copied, once at load, into one advised arena,
and the KV cache is allocated in one. Measured on this machine (Zen 5, 2 threads), SmolLM-135M's chain of
decode matmuls: 10.45 -> 9.36 ms and 9.57 -> 8.77 ms a step, in alternated runs.

Where the advice is not available (not Linux, or `madvise` fails) the same layout is used without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch
from torch import nn

logger = logging.getLogger("strata.worker.huge_pages")

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_ALIGNMENT = 64  # each tensor in an arena starts on a cache line


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def empty_in_huge_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of uninitialised host memory (uint8), 2 MiB aligned and advised for huge pages before anything
    writes it. The over-allocation around it is never written, so it takes address space, not memory."""
    length = _round_up(max(nbytes, 1), HUGE_PAGE_BYTES)
    buffer = torch.empty(length + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE_BYTES
    madvise = _madvise()
    if madvise is not None and madvise(buffer.data_ptr() + offset, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): normal pages", ctypes.get_errno())
    return buffer[offset : offset + nbytes]


def _slots(arena: torch.Tensor, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Consecutive views of `arena`, one per (shape, dtype), each on a 64-byte boundary."""
    views, offset = [], 0
    for shape, dtype in shapes:
        nbytes = shape.numel() * dtype.itemsize
        views.append(arena[offset : offset + nbytes].view(dtype).view(shape))
        offset = _round_up(offset + nbytes, _ALIGNMENT)
    return views


def _arena_bytes(shapes: list[tuple[torch.Size, torch.dtype]]) -> int:
    return sum(_round_up(shape.numel() * dtype.itemsize, _ALIGNMENT) for shape, dtype in shapes)


def move_parameters_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter of `model` into one huge-page arena, tensor by tensor, so each old copy is
    freed as soon as it is replaced. A parameter shared by several modules (tied embeddings) is moved once
    and stays shared. Returns the bytes moved."""
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    shapes = [(p.shape, p.dtype) for p in params]
    total = _arena_bytes(shapes)
    if total == 0:
        return 0
    for param, slot in zip(params, _slots(empty_in_huge_pages(total), shapes), strict=True):
        slot.copy_(param.data)
        param.data = slot
    return total


def zeros_in_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed tensors of these shapes, side by side in one huge-page arena (the KV caches of all layers)."""
    sizes = [(torch.Size(shape), dtype) for shape in shapes]
    tensors = _slots(empty_in_huge_pages(_arena_bytes(sizes)), sizes)
    for tensor in tensors:
        tensor.zero_()
    return tensors
