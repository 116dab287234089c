"""Strata's CPU decode-attention kernel: the same numbers as the pure-PyTorch reference (`_decode_attention`)
over shuffled paged caches, GQA and MHA, soft-capping and sliding windows; the CPU backend sends only
decode steps to it; and the engine's greedy output does not change when the kernel is switched off."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata import LLM, SamplingParams
from strata.attention.backends import torch_native
from strata.attention.forward_context import AttentionMetadata
from strata.platforms.cpu import attention as cpu
from strata.platforms.cpu import kernels

pytestmark = pytest.mark.skipif(
    not kernels.load("paged_decode_attention"),
    reason="Strata's CPU decode-attention kernel cannot be built here (no C++ compiler)",
)

BLOCK_SIZE = 16
# From one token to several blocks, ending inside a block and on a block boundary.
SEQ_LENS = [1, 16, 17, 50, 100]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of a decode-attention kernel op (alone or with the cache write), each wrapped."""
    calls: list[int] = []

    def spy(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted(*args: object) -> torch.Tensor:
            calls.append(1)
            return kernel(*args)

        return counted

    for name in ("paged_decode_attention", "decode_attention_with_kv_write"):
        monkeypatch.setattr(torch.ops.strata_cpu, name, spy(getattr(torch.ops.strata_cpu, name)))
    return calls


def _paged_inputs(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [B, H, D], k/v caches [num_blocks, BLOCK_SIZE, Hkv, D], shuffled block tables (padded with
    spare blocks past each sequence's end) and lengths."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(SEQ_LENS) // BLOCK_SIZE) + 1
    num_blocks = len(SEQ_LENS) * max_blocks + 3
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(SEQ_LENS) * max_blocks]
    block_tables = block_tables.view(len(SEQ_LENS), max_blocks).to(torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    query = torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=generator).to(dtype)
    return query, k_cache, v_cache, block_tables, seq_lens


def _shuffled_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, spare_blocks: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float32 k and v caches [num_blocks, BLOCK_SIZE, Hkv, D] and int32 block tables [B, max_blocks]
    for contexts of `seq_lens` tokens, each table shuffled blocks, `spare_blocks` blocks in no table."""
    max_blocks = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = len(seq_lens) * max_blocks + spare_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * max_blocks]
    return k_cache, v_cache, tables.view(len(seq_lens), max_blocks).to(torch.int32)


def _check_against_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    softcap: float,
    sliding_window: int,
    reference_dtype: torch.dtype,
    tolerance: float,
) -> None:
    """The kernel on random paged inputs of `dtype` against `_decode_attention` run in `reference_dtype`."""
    query, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = torch.ops.strata_cpu.paged_decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, scale, softcap, sliding_window
    )
    reference = [t.to(reference_dtype) for t in (query, k_cache, v_cache)]
    expected = torch_native._decode_attention(
        *reference, block_tables, seq_lens, scale, softcap, sliding_window
    )
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("sliding_window", [0, 20])
# 64 and 48 take the kernel's tiled path, 40 its general one.
@pytest.mark.parametrize("head_dim", [64, 48, 40])
def test_kernel_matches_the_torch_native_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, softcap: float, sliding_window: int, head_dim: int
) -> None:
    _check_against_reference(
        num_heads, num_kv_heads, head_dim, dtype, softcap, sliding_window, dtype, TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (12, 2)], ids=["group3", "group6"])
@pytest.mark.parametrize("head_dim", [32, 80, 96, 128, 256])
@pytest.mark.parametrize(("softcap", "sliding_window"), [(0.0, 0), (3.0, 21)])
def test_kernel_matches_the_reference_for_other_groups_and_head_dims(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, softcap: float, sliding_window: int
) -> None:
    """Query-head groups of 3 and 6 (one pass of 3, two of 4 then 2) and the other head dims of the tiled
    path (Phi-2's 80, Phi-3's 96, Gemma's 256)."""
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    _check_against_reference(
        num_heads, num_kv_heads, head_dim, dtype, softcap, sliding_window, torch.float32, tolerance
    )


@pytest.mark.parametrize("num_threads", [2, 4])
@pytest.mark.parametrize("seq_lens", [[1000], [513, 7], [300]], ids=["one", "two", "short"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 48)], ids=["gqa", "mqa"]
)
@pytest.mark.parametrize(("softcap", "sliding_window"), [(0.0, 0), (2.0, 700)])
def test_long_contexts_of_few_sequences_are_split_over_threads_and_merged(
    threads: Callable[[int], None],
    num_threads: int,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softcap: float,
    sliding_window: int,
) -> None:
    """With fewer (sequence, KV head) items than twice the threads, each long context is attended in parts
    (cut at block boundaries, the sliding window's start inside one) whose results are merged by their
    softmax sums: the same as the reference and as one thread, which attends each context whole."""
    generator = torch.Generator().manual_seed(len(seq_lens) + num_threads)
    k_cache, v_cache, tables = _shuffled_cache(seq_lens, num_kv_heads, head_dim, 5, generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator) * 3  # peaked softmaxes
    args = (query, k_cache, v_cache, tables, lens, head_dim**-0.5, softcap, sliding_window)
    threads(num_threads)
    out = torch.ops.strata_cpu.paged_decode_attention(*args)
    threads(1)
    whole = torch.ops.strata_cpu.paged_decode_attention(*args)
    expected = torch_native._decode_attention(*args)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize(
    "seq_lens",
    [[900, 700, 500, 300, 100, 40, 20, 5], [3, 1200, 9, 14, 30, 2, 1, 64, 17]],
    ids=["longest first", "one long among short"],
)
def test_threads_split_the_items_by_their_tokens_and_every_item_is_attended_once(
    threads: Callable[[int], None], num_threads: int, seq_lens: list[int]
) -> None:
    """Each thread takes a run of (sequence, KV head) items holding about an equal share of the tokens, so
    the runs have different numbers of items, and a context far longer than the others' is attended in
    parts: every item is still attended exactly once, as the reference and one thread attend it."""
    generator = torch.Generator().manual_seed(num_threads)
    k_cache, v_cache, tables = _shuffled_cache(seq_lens, 2, 32, 2, generator)
    query = torch.randn(len(seq_lens), 6, 32, generator=generator) * 3
    args = (query, k_cache, v_cache, tables, torch.tensor(seq_lens), 32**-0.5, 0.0, 0)
    threads(num_threads)
    out = torch.ops.strata_cpu.paged_decode_attention(*args)
    threads(1)
    torch.testing.assert_close(out, torch.ops.strata_cpu.paged_decode_attention(*args), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch_native._decode_attention(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rising", [True, False], ids=["max rises every block", "max at random"])
def test_scores_beyond_exp_range_rescale_the_blocks_before_a_higher_one(rising: bool) -> None:
    """Scores past a hundred, where exp overflows float32 without the running maximum: each block that
    raises the maximum rescales the sums of those before it, one that does not adds to them unscaled, and
    the result is one softmax over the whole context. With `rising`, block j's keys are scaled by j + 1, so
    nearly every block raises the maximum."""
    generator = torch.Generator().manual_seed(3)
    seq_lens = [1, 40, 300]
    k_cache, v_cache, tables = _shuffled_cache(seq_lens, 2, 64, 2, generator)
    if rising:
        for table in tables:
            for j, block in enumerate(table.tolist()):
                k_cache[block] *= j + 1
    query = torch.randn(len(seq_lens), 6, 64, generator=generator) * 40
    args = (query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 64**-0.5, 0.0, 0)
    out = torch.ops.strata_cpu.paged_decode_attention(*args)
    scores = torch.einsum("hd,td->ht", query[2, :2], k_cache[tables[2]].flatten(0, 1)[:300, 0]) / 8
    assert scores.max() > 100  # past float32's exp range (88)
    torch.testing.assert_close(out, torch_native._decode_attention(*args), rtol=1e-4, atol=1e-4)


def test_kernel_reads_int64_tables_and_odd_head_dims() -> None:
    """The model runner builds int64 block tables; a head_dim that is not a multiple of 16 has a tail."""
    query, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(6, 3, 17, torch.float32, seed=1)
    args = (0.3, 0.0, 0)
    out32 = torch.ops.strata_cpu.paged_decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, *args
    )
    out64 = torch.ops.strata_cpu.paged_decode_attention(
        query, k_cache, v_cache, block_tables.long(), seq_lens.long(), *args
    )
    torch.testing.assert_close(out32, out64, rtol=0, atol=0)
    expected = torch_native._decode_attention(query, k_cache, v_cache, block_tables, seq_lens, *args)
    torch.testing.assert_close(out32, expected, rtol=1e-5, atol=1e-5)


def test_kernel_traces_under_torch_compile() -> None:
    """The fake implementation gives Dynamo the output's shape and dtype without running the kernel."""
    query, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(8, 2, 64, torch.bfloat16)

    def attend(query: torch.Tensor) -> torch.Tensor:
        out = torch.ops.strata_cpu.paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, 0.125, 0.0, 0
        )
        return out * 2

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(query), attend(query), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("seq_lens", "message"),
    [([200, 1, 1, 1, 1], "has length 200 but its block table holds"), ([-1, 1, 1, 1, 1], "has length -1")],
)
def test_kernel_rejects_lengths_its_block_table_cannot_hold(seq_lens: list[int], message: str) -> None:
    query, k_cache, v_cache, block_tables, _ = _paged_inputs(4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.strata_cpu.paged_decode_attention(
            query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), 1.0, 0.0, 0
        )


def _metadata(query_lens: list[int], block_tables: torch.Tensor, seq_lens: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_host=seq_lens.tolist(),
        query_start_loc_host=starts,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_size=BLOCK_SIZE,
    )


def test_cpu_backend_sends_decode_steps_to_the_kernel_and_the_rest_to_torch_native(
    kernel_calls: list[int],
) -> None:
    query, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(8, 2, 64, torch.float32)
    kv_cache = torch.stack([k_cache, v_cache])
    settings = (0.125, 0.0, 0)
    decode = _metadata([1] * len(SEQ_LENS), block_tables, seq_lens)
    out = _attend(query, kv_cache, decode, *settings)
    expected = torch_native.paged_attention(query, kv_cache, decode, *settings)
    assert kernel_calls == [1]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    # A prefill chunk among the decodes: its four query tokens are kernel rows too, in the same call.
    query_lens = [1, 1, 4, 1, 1]
    mixed = _metadata(query_lens, block_tables, seq_lens)
    queries = torch.randn(sum(query_lens), 8, 64)
    out = _attend(queries, kv_cache, mixed, *settings)
    assert kernel_calls == [1, 1]
    torch.testing.assert_close(out, torch_native.paged_attention(queries, kv_cache, mixed, *settings))

    # Every sequence's whole prompt: the 100-token one (100 x 100 query-key pairs) goes to torch_native.
    prefill = _metadata(SEQ_LENS, block_tables, seq_lens)
    assert (rows := cpu.KernelRows.of(prefill)) is not None and rows.other_seqs == [4]
    queries = torch.randn(sum(SEQ_LENS), 8, 64)
    out = _attend(queries, kv_cache, prefill, *settings)
    assert kernel_calls == [1, 1, 1]
    torch.testing.assert_close(out, torch_native.paged_attention(queries, kv_cache, prefill, *settings))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 40)], ids=["gqa", "mha"]
)
@pytest.mark.parametrize(("softcap", "sliding_window"), [(0.0, 0), (2.0, 20)])
# All through the kernel; a long prompt and a long chunk through torch_native beside short ones; none.
@pytest.mark.parametrize("query_lens", [[1, 16, 9, 50, 3], [1, 16, 17, 50, 100], [1, 1, 17, 17, 100]])
def test_prefill_and_mixed_steps_attend_each_query_token_as_a_kernel_row(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softcap: float,
    sliding_window: int,
    query_lens: list[int],
) -> None:
    """Each query token of a prefill or chunk attends to its sequence's cache up to and including its own
    position (and no further back than the window): the same as torch_native's causal SDPA per sequence."""
    _, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(num_heads, num_kv_heads, head_dim, dtype)
    kv_cache = torch.stack([k_cache, v_cache])
    metadata = _metadata(query_lens, block_tables, seq_lens)
    generator = torch.Generator().manual_seed(3)
    queries = (torch.randn(sum(query_lens), num_heads, head_dim, generator=generator) * 2).to(dtype)
    settings = (head_dim**-0.5, softcap, sliding_window)
    out = _attend(queries, kv_cache, metadata, *settings)
    expected = torch_native.paged_attention(queries.float(), kv_cache.float(), metadata, *settings)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "sliding_window"), [(0.0, 0), (2.0, 20)])
@pytest.mark.parametrize("query_lens", [[1, 1, 17, 1, 100], [1, 16, 17, 1, 3], [1, 1, 1, 50, 100]])
def test_reference_mixed_steps_attend_their_decodes_together_as_one_sdpa_call_each_would(
    dtype: torch.dtype, softcap: float, sliding_window: int, query_lens: list[int]
) -> None:
    """torch_native (every device's backend) batches a mixed step's one-token sequences through its decode
    path; the result is what one causal SDPA call per sequence gives."""
    _, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(9, 3, 64, dtype)
    kv_cache = torch.stack([k_cache, v_cache])
    metadata = _metadata(query_lens, block_tables, seq_lens)
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(sum(query_lens), 9, 64, generator=generator).to(dtype)
    settings = (0.125, softcap, sliding_window)
    out = torch_native.paged_attention(queries, kv_cache, metadata, *settings)
    expected = torch.empty_like(out)
    torch_native.attend_sequences(
        queries, k_cache, v_cache, metadata, range(len(query_lens)), expected, *settings
    )
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_kernel_rows_are_each_tokens_position_in_its_sequence() -> None:
    """Row lengths count the cached context before a chunk; a sequence the kernel serves worse is left out."""
    _, _, _, block_tables, seq_lens = _paged_inputs(4, 4, 16, torch.float32)
    metadata = _metadata([1, 3, 2, 50, 90], block_tables, seq_lens)  # 90 queries x 100 keys: torch_native
    rows = cpu.KernelRows.of(metadata)
    assert rows is not None and rows.other_seqs == [4]
    assert rows.seq_lens.tolist() == [1, 14, 15, 16, 16, 17, *range(1, 51)]
    assert rows.tokens is not None and rows.tokens.tolist() == list(range(56))
    assert torch.equal(rows.block_tables, block_tables[[0, 1, 1, 1, 2, 2, *[3] * 50]])
    assert cpu.KernelRows.of(_metadata([1, 1, 1, 1, 100], block_tables, seq_lens)) is not None
    assert cpu.KernelRows.of(_metadata([1, 1, 1, 1, 100], block_tables, seq_lens)).tokens is not None
    assert cpu.KernelRows.of(_metadata([1, 16, 17, 50], block_tables[:4], seq_lens[:4])).tokens is None


def _attend(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, *settings: float
) -> torch.Tensor:
    """The CPU backend's attention alone (the step's keys and values already in the cache)."""
    backend = cpu.CpuAttentionBackend(kv_cache.dtype)
    return backend.attend(query, kv_cache, backend.prepare_step(metadata), *settings)


def _through_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *settings: float,
) -> torch.Tensor:
    """The CPU backend as the engine calls it: the step prepared once, then `forward` per layer."""
    backend = cpu.CpuAttentionBackend(kv_cache.dtype)
    return backend.forward(query, key, value, kv_cache, backend.prepare_step(metadata), *settings)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_write_and_attend_is_one_kernel_call_with_the_reference_result(
    kernel_calls: list[int], cache_dtype: torch.dtype
) -> None:
    """The new keys and values land in the cache and are attended to, as the reference's write-then-attend."""
    query, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(8, 2, 64, cache_dtype)
    kv_cache = torch.stack([k_cache, v_cache])
    generator = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, len(SEQ_LENS), 2, 64, generator=generator).to(cache_dtype)
    # Each sequence's new token is its last one, in the block its table lists for that position.
    last = [length - 1 for length in SEQ_LENS]
    slots = [int(block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for b, p in enumerate(last)]
    decode = dataclasses.replace(
        _metadata([1] * len(SEQ_LENS), block_tables, seq_lens), slot_mapping=torch.tensor(slots)
    )
    settings = (0.125, 0.0, 0)
    expected_cache = kv_cache.clone()
    expected = torch_native.write_and_attend(query, key, value, expected_cache, decode, *settings)
    out = _through_backend(query, key, value, kv_cache, decode, *settings)
    assert kernel_calls == [1]
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[cache_dtype], atol=TOLERANCE[cache_dtype])


@pytest.mark.parametrize(
    ("query_lens", "calls"), [([1, 1, 4, 1, 1], [1]), ([1, 16, 17, 50, 100], [1])], ids=["kernel", "split"]
)
def test_a_step_with_a_prefill_chunk_writes_then_attends_through_the_kernel_rows(
    kernel_calls: list[int], query_lens: list[int], calls: list[int]
) -> None:
    """Bound once per step: the cache holds the new keys and values, then every token attends as the
    reference's write-then-attend does (the long prompt of the "split" step through torch_native)."""
    _, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(8, 2, 64, torch.float32)
    kv_cache = torch.stack([k_cache, v_cache])
    # Each sequence's new tokens are its last ones, in the blocks its table lists for those positions.
    positions = [
        (b, p)
        for b, (q, length) in enumerate(zip(query_lens, SEQ_LENS, strict=True))
        for p in range(length - q, length)
    ]
    slots = [int(block_tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for b, p in positions]
    mixed = dataclasses.replace(
        _metadata(query_lens, block_tables, seq_lens), slot_mapping=torch.tensor(slots)
    )
    generator = torch.Generator().manual_seed(2)
    queries = torch.randn(sum(query_lens), 8, 64, generator=generator)
    key, value = torch.randn(2, sum(query_lens), 2, 64, generator=generator)
    settings = (0.125, 0.0, 0)
    expected_cache = kv_cache.clone()
    expected = torch_native.write_and_attend(queries, key, value, expected_cache, mixed, *settings)
    out = _through_backend(queries, key, value, kv_cache, mixed, *settings)
    assert kernel_calls == calls
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()


def test_a_step_the_kernel_serves_worse_is_bound_to_the_reference_write_and_attend(
    kernel_calls: list[int],
) -> None:
    """One sequence, a long prompt: SDPA's step, with nothing built for the kernel."""
    _, k_cache, v_cache, block_tables, seq_lens = _paged_inputs(8, 2, 64, torch.float32)
    kv_cache = torch.stack([k_cache, v_cache])
    table = block_tables[4:]
    slots = table[0, torch.arange(100) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(100) % BLOCK_SIZE
    prompt = dataclasses.replace(_metadata([100], table, seq_lens[4:]), slot_mapping=slots.long())
    assert cpu.KernelRows.of(prompt) is None
    generator = torch.Generator().manual_seed(4)
    queries = torch.randn(100, 8, 64, generator=generator)
    key, value = torch.randn(2, 100, 2, 64, generator=generator)
    expected_cache = kv_cache.clone()
    expected = torch_native.write_and_attend(queries, key, value, expected_cache, prompt, 0.125, 0.0, 0)
    out = _through_backend(queries, key, value, kv_cache, prompt, 0.125, 0.0, 0)
    assert kernel_calls == []
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("seq_lens", "rows_at"),
    [
        ([1, 16, 17, 50, 100], "newest"),  # each work item stores its own sequence's row
        ([700], "newest"),  # the context is attended in parts: the last part stores the row
        ([1000, 20, 30, 40], "newest"),  # the long context alone in parts
        ([30, 40, 50], "swapped"),  # rows 0 and 1 hold each other's sequence's token: stored first
        ([30, 40, 50], "earlier"),  # row 2's slot is a position before its sequence's last
    ],
)
def test_decode_write_and_attend_stores_every_row_before_it_is_read(
    threads: Callable[[int], None],
    num_threads: int,
    cache_dtype: torch.dtype,
    seq_lens: list[int],
    rows_at: str,
) -> None:
    """Where each row is its sequence's newest token, the work items store their own rows as they start;
    anywhere else every row is stored before any item reads. Either way the cache and the output are the
    reference's write-then-attend, also with float32 rows read from a fused q/k/v row and rounded into a
    float16 cache, GQA heads and a sliding window."""
    generator = torch.Generator().manual_seed(len(seq_lens))
    heads, kv_heads, dim, window = 9, 3, 64, 600
    k_cache, v_cache, tables = _shuffled_cache(seq_lens, kv_heads, dim, 3, generator)
    kv_cache = torch.stack([k_cache, v_cache]).to(cache_dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = [length - 1 for length in seq_lens]
    owners = list(range(len(seq_lens)))
    if rows_at == "swapped":
        owners[0], owners[1] = 1, 0
    elif rows_at == "earlier":
        positions[2] -= 5
    slots = torch.tensor(
        [int(tables[b, positions[b] // BLOCK_SIZE]) * BLOCK_SIZE + positions[b] % BLOCK_SIZE for b in owners]
    )
    fused = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * dim, generator=generator)
    query = fused[:, : heads * dim].view(-1, heads, dim) * 3
    key = fused[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    value = fused[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    settings = (dim**-0.5, 0.0, window)
    expected_cache = kv_cache.clone()
    torch_native.write_to_kv_cache(key, value, expected_cache, slots)
    expected = torch.ops.strata_cpu.paged_decode_attention(
        query, expected_cache[0], expected_cache[1], tables, lens, *settings
    )
    threads(num_threads)
    out = torch.ops.strata_cpu.decode_attention_with_kv_write(
        query, key, value, kv_cache, slots, tables, lens, *settings
    )
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_decode_write_and_attend_rejects_a_cache_without_its_key_value_axis() -> None:
    query, k_cache, _, block_tables, seq_lens = _paged_inputs(4, 4, 16, torch.float32)
    key = torch.zeros(len(SEQ_LENS), 4, 16)
    with pytest.raises(RuntimeError, match=r"kv_cache must be \[2, num_blocks"):
        torch.ops.strata_cpu.decode_attention_with_kv_write(
            query, key, key, k_cache, _metadata([1] * len(SEQ_LENS), block_tables, seq_lens).slot_mapping,
            block_tables, seq_lens, 0.25, 0.0, 0,
        )  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_output_is_the_same_with_the_kernel_off(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int], arch: str
) -> None:
    """gemma2 adds soft-capping and a sliding window shorter than the sequences."""
    llm = LLM(str(tiny_model_dir(arch)), skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (3, 11, 20)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with_kernel = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert kernel_calls, "the decode steps did not reach the kernel"
    # The attention backend as STRATA_DISABLE_CPU_KERNELS=1 builds it; the layers keep their own choice.
    monkeypatch.setattr(kernels, "load", lambda name: False)
    runner = llm.engine.runner
    runner.attn_backend = cpu.CpuAttentionBackend(runner.kv_cache_dtype)
    kernel_calls.clear()
    without = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert not kernel_calls
    assert with_kernel == without
    assert all(len(tokens) == 40 for tokens in with_kernel)


def _rows(layout: str, generator: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [20, 3, 8]: contiguous; views of one fused q/k/v row per token (a decode step's, whose
    tokens are 72 floats apart); or with the heads of each token apart (each head's 8 values 24 apart)."""
    if layout == "contiguous":
        key, value = torch.randn(2, 20, 3, 8, generator=generator).to(dtype)
        return key, value
    if layout == "fused rows":
        fused = torch.randn(20, 72, generator=generator).to(dtype)
        return fused[:, 24:48].view(20, 3, 8), fused[:, 48:].view(20, 3, 8)
    key, value = torch.randn(2, 20, 8, 3, generator=generator).to(dtype).transpose(2, 3)
    return key, value


@pytest.mark.parametrize("layout", ["contiguous", "fused rows", "heads apart"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_kernel_cache_write_stores_what_index_copy_stores(
    cache_dtype: torch.dtype, slot_dtype: torch.dtype, layout: str, rows_dtype: torch.dtype
) -> None:
    """Keys and values into a cache of each dtype, at scattered slots in shuffled blocks, from contiguous
    rows and from strided views (read where they lie when the dtypes match, or rounded on the way from
    float32 into a 16-bit cache), rounded as `to()` rounds."""
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 7, BLOCK_SIZE, 3, 8, generator=generator).to(cache_dtype)
    key, value = _rows(layout, generator, rows_dtype)
    assert key.is_contiguous() == (layout == "contiguous")
    slots = torch.randperm(7 * BLOCK_SIZE, generator=generator)[:20].to(slot_dtype)
    expected = kv_cache.clone()
    torch_native.write_to_kv_cache(key, value, expected, slots.long())
    cpu.write_to_kv_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def test_kernel_cache_write_rejects_a_slot_outside_the_cache() -> None:
    kv_cache = torch.zeros(2, 2, BLOCK_SIZE, 1, 4)
    key = torch.ones(1, 1, 4)
    with pytest.raises(RuntimeError, match="slot 32 of token 0 is outside the cache's 32 slots"):
        cpu.write_to_kv_cache(key, key, kv_cache, torch.tensor([2 * BLOCK_SIZE]))
    assert not kv_cache.any()
