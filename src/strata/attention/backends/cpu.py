"""Paged attention on the CPU through Strata's C++ decode kernel, and torch_native where SDPA does better.

`strata_cpu::paged_decode_attention` reads each sequence's keys and values where they lie in the paged cache;
the pure-PyTorch decode path first copies them into a padded tensor, per layer per step. Prefill and mixed
steps go through the same kernel for sequences with few query tokens (`KernelRows`): each query token is a
row of its own, whose context is its sequence's cache up to and including it. Sequences with many query
tokens over a long context, and caches of a dtype the kernel does not read, use the reference backend.
Every step's cache write goes through `strata_cpu::write_kv_cache`: one call where `index_copy_` takes two,
each with its views. A decode step that writes and attends (`write_and_attend`) is one call,
`strata_cpu::decode_attention_with_kv_write`.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# Which sequences of a prefill or mixed step the kernel attends, one row per query token: those with at most
# _KERNEL_QUERY_TOKENS queries, or at most _KERNEL_QUERY_KEY_PAIRS (queries x context). The kernel reads each
# row's context anew, so its cost grows with queries x keys; torch_native pays a fixed ~80 us a sequence
# (gathering the context, masks, the SDPA call) and computes the pairs about twice as fast. Measured per layer
# (9 heads, 3 KV heads, head dim 64, 2 threads, Zen 4): 32 sequences of 32 new tokens 4.4x faster through the
# kernel, one of 64 1.27x, one of 96 1.12x, one of 128 0.96x, one of 256 0.74x; 16 new tokens after 4000
# cached 1.18x, 8 after 8000 2.1x; 32 after 2000 0.83x, 64 after 200 0.86x.
_KERNEL_QUERY_TOKENS = 16
_KERNEL_QUERY_KEY_PAIRS = 8192


@dataclass(frozen=True)
class KernelRows:
    """A prefill or mixed step as a decode-kernel batch: each query token the kernel attends is a row with its
    sequence's block table and its own context length (its position + 1)."""

    # [rows] the step's token indices the kernel attends; None: every token, in order
    tokens: torch.Tensor | None
    block_tables: torch.Tensor  # [rows, max_blocks]
    seq_lens: torch.Tensor  # [rows] int32
    other_seqs: list[int]  # sequences left to torch_native

    @classmethod
    def of(cls, metadata: AttentionMetadata) -> KernelRows | None:
        """The rows for the step's sequences the kernel serves better; None if it serves none of them."""
        starts = metadata.query_start_loc_host
        row_seqs: list[int] = []
        tokens: list[int] = []
        lens: list[int] = []
        other_seqs: list[int] = []
        for i, seq_len in enumerate(metadata.seq_lens_host):
            q_len = starts[i + 1] - starts[i]
            if q_len <= _KERNEL_QUERY_TOKENS or q_len * seq_len <= _KERNEL_QUERY_KEY_PAIRS:
                row_seqs.extend([i] * q_len)
                tokens.extend(range(starts[i], starts[i + 1]))
                lens.extend(range(seq_len - q_len + 1, seq_len + 1))
            else:
                other_seqs.append(i)
        if not tokens:
            return None
        return cls(
            tokens=torch.tensor(tokens) if other_seqs else None,
            block_tables=metadata.block_tables.index_select(0, torch.tensor(row_seqs)),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            other_seqs=other_seqs,
        )


def _attend_kernel_rows(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    rows: KernelRows,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """A prefill or mixed step's attention: `rows` through the kernel, the other sequences through torch_native."""
    k_cache, v_cache = kv_cache.unbind(0)
    kernel = torch.ops.strata_cpu.paged_decode_attention
    extra = (rows.block_tables, rows.seq_lens, scale, softcap, sliding_window)
    if rows.tokens is None:
        return kernel(query, k_cache, v_cache, *extra)
    out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
    out.index_copy_(0, rows.tokens, kernel(query.index_select(0, rows.tokens), k_cache, v_cache, *extra))
    torch_native.attend_sequences(
        query, k_cache, v_cache, metadata, rows.other_seqs, out, scale, softcap, sliding_window
    )
    return out


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """`torch_native.paged_attention`'s contract, through the kernel where it can be built and serves better.

    This runs inside Strata's attention custom ops, whose bodies `torch.compile` never traces (it traces
    their fake implementations), so the one-time build in `cpu_kernels.load` happens at the first real
    step, outside any compilation, and is a cached lookup afterwards.
    """
    if query.device.type == "cpu" and _kernel_serves(kv_cache):
        if metadata.is_pure_decode:
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
        rows = KernelRows.of(metadata)
        if rows is not None:
            return _attend_kernel_rows(query, kv_cache, metadata, rows, scale, softcap, sliding_window)
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


def _write_and_attend_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    rows: KernelRows,
    scale: float,
    softcap: float,
    sliding_window: int,
) -> torch.Tensor:
    """A prefill or mixed step's `write_and_attend`, with the kernel's rows built once for all layers."""
    write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    return _attend_kernel_rows(query, kv_cache, metadata, rows, scale, softcap, sliding_window).contiguous()


def bind_write_and_attend(metadata: AttentionMetadata, kv_cache: torch.Tensor) -> WriteAndAttend:
    """`write_and_attend` for this step's layers (caches like `kv_cache`), decided once for all of them: on a
    decode step, the kernel call with the metadata bound; on another step, the kernel's rows built once. Between
    two layers' weight streams the interpreter's caches are cold, and there each Python call of the per-layer
    choice costs microseconds."""
    if not _kernel_serves(kv_cache):
        return bind_step_arguments(write_and_attend, metadata)
    if metadata.is_pure_decode:
        return bind_step_arguments(
            torch.ops.strata_cpu.decode_attention_with_kv_write,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
        )
    rows = KernelRows.of(metadata)
    if rows is None:
        return bind_step_arguments(write_and_attend, metadata)
    return bind_step_arguments(_write_and_attend_rows, metadata, rows)
