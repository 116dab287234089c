"""The CPU platform's attention backend: Strata's C++ decode kernel, and the reference where SDPA does better.

`strata_cpu::paged_decode_attention` reads each sequence's keys and values where they lie in the paged cache;
the pure-PyTorch decode path first copies them into a padded tensor, per layer per step. Prefill and mixed
steps go through the same kernel for sequences with few query tokens (`KernelRows`): each query token is a
row of its own, whose context is its sequence's cache up to and including it. Sequences with many query
tokens over a long context, and caches of a dtype the kernel does not read, use the reference backend.
Every step's cache write goes through `strata_cpu::write_kv_cache`: one call where `index_copy_` takes two,
each with its views. A decode step writes and attends in one call, `strata_cpu::decode_attention_with_kv_write`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.attention.backends import torch_native
from strata.attention.forward_context import AttentionMetadata
from strata.platforms.cpu import kernels

# Cache dtypes the kernels read and write (`paged_decode_attention` sums in float32 either way).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_serves(cache_dtype: torch.dtype) -> bool:
    """Whether Strata's kernels handle caches of this dtype: one they read, and the kernel library built here."""
    return cache_dtype in _KERNEL_DTYPES and kernels.load("paged_decode_attention")


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`torch_native.write_to_kv_cache`'s contract, through the kernel where it can be built."""
    if _kernel_serves(kv_cache.dtype):
        k_cache, v_cache = kv_cache.unbind(0)
        torch.ops.strata_cpu.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_native.write_to_kv_cache(key, value, kv_cache, slot_mapping)


# Which sequences of a prefill or mixed step the kernel attends, one row per query token: those with at most
# _KERNEL_QUERY_TOKENS queries, or at most _KERNEL_QUERY_KEY_PAIRS (queries x context). The kernel reads each
# row's context anew, so its cost grows with queries x keys; torch_native pays a fixed cost a sequence
# (gathering the context, masks, the SDPA call) and then computes the pairs faster. The bounds sit where the
# two cost the same (docs/cpu-kernels.md).
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


@dataclass(frozen=True)
class CpuStep:
    """A step as the backend runs it, worked out once for all layers: whether the kernels serve its caches,
    and for a prefill or mixed step the kernel's rows."""

    metadata: AttentionMetadata
    kernel: bool
    rows: KernelRows | None


class CpuAttentionBackend(torch_native.TorchNativeBackend):
    """Writes and attends through the kernels where they serve the step, through the reference elsewhere."""

    provider = "cpu"

    def __init__(self, kv_cache_dtype: torch.dtype) -> None:
        super().__init__(kv_cache_dtype)
        self.kernel = _kernel_serves(kv_cache_dtype)

    def prepare_step(self, metadata: AttentionMetadata) -> CpuStep:
        rows = KernelRows.of(metadata) if self.kernel and not metadata.is_pure_decode else None
        return CpuStep(metadata, self.kernel, rows)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        step: CpuStep,
        scale: float,
        softcap: float,
        sliding_window: int,
    ) -> torch.Tensor:
        """Attention alone, this step's keys and values already in the cache: `torch_native.paged_attention`'s
        contract, through the kernel where it serves."""
        metadata = step.metadata
        if step.kernel and metadata.is_pure_decode:
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
        if step.rows is not None:
            return _attend_kernel_rows(query, kv_cache, metadata, step.rows, scale, softcap, sliding_window)
        return torch_native.paged_attention(query, kv_cache, metadata, scale, softcap, sliding_window)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        step: CpuStep,
        scale: float,
        softcap: float,
        sliding_window: int,
    ) -> torch.Tensor:
        metadata = step.metadata
        if step.kernel and metadata.is_pure_decode:  # the write and the attention in one call
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
        return self.attend(query, kv_cache, step, scale, softcap, sliding_window).contiguous()
