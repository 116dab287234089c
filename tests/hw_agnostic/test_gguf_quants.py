"""Strata's torch dequantization of GGUF blocks computes exactly what gguf's numpy reference computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from strata.gguf.quants import COMPUTED_TYPES, block_layout, dequantize, row_bytes

T = GGMLQuantizationType
TYPES = sorted((T(t) for t in COMPUTED_TYPES), key=lambda t: t.name)
UNSUPPORTED = sorted((t for t in T if int(t) not in COMPUTED_TYPES), key=lambda t: t.name)

# Byte offsets of the f16 super-block scales (d, dmin) in each K-quant block: gguf has no K-quantizer, so
# tests fill blocks with random bytes and then make these finite, which makes any byte pattern a valid block.
K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def blocks_per_row(qtype: GGMLQuantizationType) -> int:
    return 3 if qtype in K_SCALE_OFFSETS else 5


def quantized(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes `[*shape[:-1], row_bytes]` for `shape` weights: quantized random data where gguf can
    quantize, random blocks with finite scales for K-quants."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in K_SCALE_OFFSETS:
        n_blocks = int(np.prod(shape)) // block_size
        blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
        for offset in K_SCALE_OFFSETS[qtype]:
            scale = rng.uniform(-1, 1, n_blocks).astype(np.float16)
            blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        return blocks.reshape(*shape[:-1], -1)
    x = rng.standard_normal(shape).astype(np.float32)
    if qtype == T.F32:
        return x.view(np.uint8)
    return gguf_quants.quantize(x, qtype).view(np.uint8)


def reference(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(data, qtype)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_gguf_reference(qtype: GGMLQuantizationType) -> None:
    columns = blocks_per_row(qtype) * block_layout(qtype)[0]
    data = quantized(qtype, (4, columns))
    out = dequantize(torch.from_numpy(data), qtype)
    assert out.dtype == torch.float32
    assert out.shape == (4, columns)
    # Both sides do the same float32 operations in the same order: the results are bit-identical.
    torch.testing.assert_close(out, reference(data, qtype), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_non_contiguous_input(qtype: GGMLQuantizationType) -> None:
    columns = blocks_per_row(qtype) * block_layout(qtype)[0]
    data = quantized(qtype, (5, columns), seed=1)
    expected = reference(data, qtype)
    nbytes = data.shape[-1]

    # Rows of a wider buffer, starting at an odd byte: strided rows and a misaligned storage offset.
    wide = torch.zeros(5, nbytes + 7, dtype=torch.uint8)
    wide[:, 3 : 3 + nbytes] = torch.from_numpy(data)
    sliced = wide[:, 3 : 3 + nbytes]
    assert not sliced.is_contiguous()
    torch.testing.assert_close(dequantize(sliced, qtype, columns), expected, rtol=0, atol=0)

    # A transposed view: every byte of a row is a whole row apart in memory.
    transposed = torch.from_numpy(np.ascontiguousarray(data.T)).T
    assert not transposed.is_contiguous()
    torch.testing.assert_close(dequantize(transposed, qtype), expected, rtol=0, atol=0)

    # A single row taken from the middle of a contiguous tensor (nonzero offset, contiguous).
    torch.testing.assert_close(dequantize(torch.from_numpy(data)[2], qtype), expected[2], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_leading_batch_dims(qtype: GGMLQuantizationType) -> None:
    columns = 2 * block_layout(qtype)[0]
    data = quantized(qtype, (2, 3, columns), seed=2)
    out = dequantize(torch.from_numpy(data), qtype, columns)
    assert out.shape == (2, 3, columns)
    expected = reference(data.reshape(6, -1), qtype).reshape(2, 3, columns)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_no_rows(qtype: GGMLQuantizationType) -> None:
    columns = block_layout(qtype)[0]
    data = torch.empty(0, row_bytes(qtype, columns), dtype=torch.uint8)
    assert dequantize(data, qtype).shape == (0, columns)


def test_q4_0_nibble_order() -> None:
    """By hand, independent of gguf: low nibbles are weights 0..15, high nibbles 16..31, value (q-8)*d."""
    qs = [i | (15 - i) << 4 for i in range(16)]
    block = torch.tensor(list(np.float16(0.5).tobytes()) + qs, dtype=torch.uint8)
    expected = [(i - 8) * 0.5 for i in range(16)] + [(7 - i) * 0.5 for i in range(16)]
    assert dequantize(block, T.Q4_0).tolist() == expected


def test_q5_0_high_bits_are_little_endian() -> None:
    """By hand: bit i of the little-endian u32 qh is bit 4 of weight i."""
    qh = (1 << 0) | (1 << 9) | (1 << 31)
    block = torch.tensor(
        list(np.float16(1.0).tobytes()) + list(qh.to_bytes(4, "little")) + [0] * 16, dtype=torch.uint8
    )
    expected = [0.0 if i in (0, 9, 31) else -16.0 for i in range(32)]
    assert dequantize(block, T.Q5_0).tolist() == expected


def test_qtype_accepts_plain_int() -> None:
    data = torch.from_numpy(quantized(T.Q8_0, (2, 64)))
    torch.testing.assert_close(dequantize(data, int(T.Q8_0)), dequantize(data, T.Q8_0), rtol=0, atol=0)
    assert block_layout(int(T.Q6_K)) == block_layout(T.Q6_K) == (256, 210)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layout_comes_from_gguf(qtype: GGMLQuantizationType) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert block_layout(qtype) == (block_size, type_size)
    assert row_bytes(qtype, 4 * block_size) == 4 * type_size


@pytest.mark.parametrize("qtype", UNSUPPORTED, ids=lambda t: t.name)
def test_unsupported_type_is_named(qtype: GGMLQuantizationType) -> None:
    match = f"GGUF type {qtype.name} is not one Strata computes on"
    with pytest.raises(ValueError, match=match):
        block_layout(qtype)
    with pytest.raises(ValueError, match=match):
        row_bytes(qtype, 256)
    with pytest.raises(ValueError, match=match):
        dequantize(torch.zeros(1, 256, dtype=torch.uint8), int(qtype))


def test_unknown_type_number() -> None:
    with pytest.raises(ValueError, match="9999"):
        dequantize(torch.zeros(1, 34, dtype=torch.uint8), 9999)


def test_columns_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="Q4_0"):
        row_bytes(T.Q4_0, 48)
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(torch.zeros(1, 144, dtype=torch.uint8), T.Q4_K, columns=100)


def test_row_bytes_must_match_data() -> None:
    with pytest.raises(ValueError, match="bytes"):
        dequantize(torch.zeros(1, 34, dtype=torch.uint8), T.Q8_0, columns=64)
    with pytest.raises(ValueError, match="whole number"):
        dequantize(torch.zeros(1, 35, dtype=torch.uint8), T.Q8_0)


def test_data_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(1, 32, dtype=torch.int8), T.Q8_0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: GGMLQuantizationType) -> None:
    columns = blocks_per_row(qtype) * block_layout(qtype)[0]
    data = torch.from_numpy(quantized(qtype, (3, columns), seed=3))
    out = dequantize(data.cuda(), qtype)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), dequantize(data, qtype), rtol=0, atol=0)


def test_f16_fields_decode_every_bit_pattern() -> None:
    """The float16 scales are decoded by bit arithmetic: every one of the 65536 patterns (zeros, subnormals,
    infinities, NaNs) gives numpy's float16 value."""
    patterns = np.arange(1 << 16, dtype=np.uint16)
    blocks = np.zeros((1 << 16, 34), dtype=np.uint8)
    blocks[:, 0:2] = patterns.view(np.uint8).reshape(-1, 2)
    blocks[:, 2] = 1  # the first quant: the weight is d itself
    got = dequantize(torch.from_numpy(blocks), T.Q8_0)[:, 0]
    want = torch.from_numpy(patterns.view(np.float16).astype(np.float32))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


QUANTIZED = [t for t in TYPES if t not in (T.F32, T.F16, T.BF16)]


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_compiled_with_unknown_row_count(qtype: GGMLQuantizationType) -> None:
    """Compiled as Strata compiles a forward (rows traced as unknown, e.g. an embedding lookup's): the same
    bits as eager at any row count."""
    columns = blocks_per_row(qtype) * block_layout(qtype)[0]
    table = torch.from_numpy(quantized(qtype, (40, columns), seed=4))
    torch._dynamo.reset()  # one lambda's code object, compiled once per type: not recompiles
    compiled = torch.compile(lambda rows: dequantize(table[rows], qtype), dynamic=False, fullgraph=True)
    example = torch.arange(2)
    torch._dynamo.decorators.mark_unbacked(example, 0)
    compiled(example)
    for count in (1, 3, 40):
        rows = torch.randperm(40, generator=torch.Generator().manual_seed(count))[:count]
        torch.testing.assert_close(compiled(rows), reference(table.numpy(), qtype)[rows], rtol=0, atol=0)
