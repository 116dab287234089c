"""Paged attention on the CPU: decode steps through Strata's C++ kernel, everything else through torch_native.

`strata_cpu::paged_decode_attention` reads each sequence's keys and values where they lie in the paged cache;
the pure-PyTorch decode path first copies them into a padded tensor, per layer per step. Prefill and mixed
steps, and caches of a dtype the kernel does not read, use the reference backend. Every step's cache write
goes through `strata_cpu::write_kv_cache`: one call where `index_copy_` takes two, each with its views. A
decode step that writes and attends (`write_and_attend`) is one call, `strata_cpu::decode_attention_with_kv_write`.
"""

from __future__ import annotations

import torch

from strata.attention.backends import torch_native
from strata.attention.forward_context import AttentionMetadata, WriteAndAttend, bind_step_arguments
from strata.layers import cpu_kernels

# Cache dtypes the kernels read and write (`paged_decode_attention` sums in float32 either way).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_serves(kv_cache: torch.Tensor) -> bool:
    """Whether Strata's kernels handle this cache: a dtype they read, and the kernel library built here."""
    return kv_cache.dtype in _KERNEL_DTYPES and cpu_kernels.load("paged_decode_attention")


def prepare() -> None:
    """Build (once per machine) and load the decode kernel now, at engine start, so the first decode step
    neither waits for the compiler nor logs in the middle of streamed output."""
    cpu_kernels.load("paged_decode_attention")


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`torch_native.write_to_kv_cache`'s contract, through the kernel where it can be built."""
    if _kernel_serves(kv_cache):
        k_cache, v_cache = kv_cache.unbind(0)
        torch.ops.strata_cpu.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_native.write_to_kv_cache(key, value, kv_cache, slot_mapping)


def _decode_kernel_serves(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
    return metadata.is_pure_decode and query.device.type == "cpu" and _kernel_serves(kv_cache)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """`torch_native.paged_attention`'s contract, with pure-decode steps on the kernel where it can be built.

    This runs inside Strata's attention custom ops, whose bodies `torch.compile` never traces (it traces
    their fake implementations), so the one-time build in `cpu_kernels.load` happens at the first real
    decode step, outside any compilation, and is a cached lookup afterwards.
    """
    if _decode_kernel_serves(query, kv_cache, metadata):
        k_cache, v_cache = kv_cache.unbind(0)
        return torch.ops.strata_cpu.paged_decode_attention(
            query,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.seq_lens,
            scale,
            softcap,
            sliding_window,
        )
    return torch_native.paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window)


def write_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """`torch_native.write_and_attend`'s contract; a decode step on the kernels is one call for both."""
    if _decode_kernel_serves(query, kv_cache, metadata):
        return torch.ops.strata_cpu.decode_attention_with_kv_write(
            query,
            key,
            value,
            kv_cache,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            scale,
            softcap,
            sliding_window,
        )
    write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    return paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window).contiguous()


def bind_write_and_attend(metadata: AttentionMetadata, kv_cache: torch.Tensor) -> WriteAndAttend:
    """`write_and_attend` for this step's layers (caches like `kv_cache`), decided once for all of them: on a
    decode step, the kernel call with the metadata bound. Between two layers' weight streams the
    interpreter's caches are cold, and there each Python call of the per-layer choice costs microseconds."""
    if not (metadata.is_pure_decode and _kernel_serves(kv_cache)):
        return bind_step_arguments(write_and_attend, metadata)
    return bind_step_arguments(
        torch.ops.strata_cpu.decode_attention_with_kv_write,
        metadata.slot_mapping,
        metadata.block_tables,
        metadata.seq_lens,
    )
