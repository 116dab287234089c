"""Dequantization of GGUF / ggml block-quantized tensors in plain PyTorch.

This is the hardware-agnostic reference behind Strata's quantized matmul and embedding ops: it uses only
torch views, bitwise ops, shifts and float32 arithmetic, so the same code runs on CPU, CUDA or a plugin
device, and it computes the same float32 numbers as ggml's own reference dequantization (one rounding per
multiply or add, in ggml's order), so a kernel can be checked against it bit for bit.

Every format is decoded for all blocks at once, in each type's own block shape (`decode`): unsigned integer
quants that stay one byte per weight until the single float32 conversion, and per-group float32 factors,
which the float math then applies in place, so the peak is about the float32 output plus a byte or two per
weight. The code is also written for torch.compile: packed fields are unpacked by broadcasting shifts (not
stacking), float16 scales are decoded with int32 and float32 arithmetic (no float16 bit cast), and the zero
points are subtracted in float32, all of which Inductor's CPU code fuses into one vectorised loop.

Block layouts (ggml's `block_*` structs; f16 fields little endian, as GGUF stores them):

- Q8_0 (32 weights, 34 bytes): f16 d, 32 int8 q; w = q*d.
- Q4_0 (32, 18): f16 d, 16 bytes of nibbles (low nibbles are weights 0..15, high nibbles 16..31);
  w = (q-8)*d.
- Q4_1 (32, 20): f16 d, f16 m, 16 bytes of nibbles; w = q*d + m.
- Q5_0 (32, 22): f16 d, u32 qh (bit i is weight i's fifth bit), 16 bytes of nibbles; w = (q-16)*d.
- Q5_1 (32, 24): f16 d, f16 m, u32 qh, 16 bytes of nibbles; w = q*d + m.
- K-quants: 256-weight super-blocks split into sub-blocks, each with its own small integer scale (and
  min), which the super-block's f16 d (and dmin) multiply; see the decoders below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType

COMPUTED_TYPES: frozenset[int] = frozenset(
    int(t)
    for t in (
        _T.F32,
        _T.F16,
        _T.BF16,
        _T.Q8_0,
        _T.Q4_0,
        _T.Q4_1,
        _T.Q5_0,
        _T.Q5_1,
        _T.Q2_K,
        _T.Q3_K,
        _T.Q4_K,
        _T.Q5_K,
        _T.Q6_K,
    )
)
"""The `GGMLQuantizationType` values Strata computes on (as plain ints; IntEnum members compare equal)."""

# Unquantized types are stored as little-endian floats: one weight per "block".
_FLOAT_DTYPES: dict[int, torch.dtype] = {
    int(_T.F32): torch.float32,
    int(_T.F16): torch.float16,
    int(_T.BF16): torch.bfloat16,
}


def _type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"#{qtype} (unknown)"


def _checked(qtype: int) -> int:
    """`qtype` as a plain int, or a ValueError naming it: callers learn early which tensor Strata can't use."""
    if isinstance(qtype, bool) or not isinstance(qtype, int):
        raise TypeError(f"GGUF type must be an int (a GGMLQuantizationType), got {qtype!r}")
    if qtype not in COMPUTED_TYPES:
        supported = ", ".join(sorted(_type_name(t) for t in COMPUTED_TYPES))
        raise ValueError(
            f"GGUF type {_type_name(qtype)} is not one Strata computes on (supported: {supported})"
        )
    return int(qtype)


def block_layout(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a type Strata computes on, from gguf's own table, so that
    shapes are checked against the same numbers the file writer used."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(_checked(qtype))]
    return block_size, type_size


def row_bytes(qtype: int, columns: int) -> int:
    """Bytes one row of `columns` weights takes in the file; rows hold whole blocks, so `columns` must be a
    multiple of the block size (a ValueError otherwise)."""
    block_size, type_size = block_layout(qtype)
    if columns < 0 or columns % block_size:
        raise ValueError(
            f"{columns} columns is not a whole number of {_type_name(qtype)} blocks ({block_size} weights each)"
        )
    return columns // block_size * type_size


# --- helpers ---------------------------------------------------------------------------------------------


def _reinterpret(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes `[..., k*itemsize]` (little endian, as GGUF stores them) reinterpreted as `dtype`
    `[..., k]`. The bytes are assembled into integers with shifts rather than viewed in place: a view needs
    an aligned storage offset, which a slice of a block or of a memory-mapped file need not have, and which
    torch.compile cannot check."""
    size = dtype.itemsize
    grouped = x.unflatten(-1, (x.shape[-1] // size, size)).to(torch.int64)
    word = grouped[..., 0]
    for i in range(1, size):
        word = word | (grouped[..., i] << (8 * i))
    top_bit = 1 << (8 * size - 1)
    signed = torch.where(word >= top_bit, word - 2 * top_bit, word)  # two's complement, as the file means it
    return signed.to(_SIGNED_OF_SIZE[size]).view(dtype)


_SIGNED_OF_SIZE = {2: torch.int16, 4: torch.int32}

# float16 -> float32 by bits: a float16's exponent and mantissa, moved into a float32's, read 2**112 too small
# (the exponent biases differ by 112); one exact multiply rebiases it, subnormals included.
_F16_REBIAS = 2.0**112
_F16_EXPONENT_BITS = 0x0F800000  # a float16's exponent field, as moved into the float32's bits
_F32_EXPONENT_BITS = 0x7F800000
_SIGN_AND_LOW_27_BITS = -0x70000000 - 1  # 0x8FFFFFFF as int32


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of every block, as float32 `[..., 1]` (ready to broadcast).

    Decoded with int32 and float32 arithmetic only (no float16 bit cast, which Inductor's CPU code does not
    vectorize, so the scale stays cheap to recompute wherever a compiled product reads it): the high byte,
    sign-extended, puts the sign at bit 31 and the other seven bits at 27..21, the low byte at 20..13; the
    float32 those bits spell, times 2**112, is the float16's value. Infinities and NaNs, whose exponent is all
    ones, keep it all ones."""
    high = blocks[..., offset + 1 : offset + 2].view(torch.int8).to(torch.int32)
    low = blocks[..., offset : offset + 1].to(torch.int32)
    bits = ((high << 21) & _SIGN_AND_LOW_27_BITS) | (low << 13)
    special = (bits & _F16_EXPONENT_BITS) == _F16_EXPONENT_BITS
    return torch.where(
        special, (bits | _F32_EXPONENT_BITS).view(torch.float32), bits.view(torch.float32) * _F16_REBIAS
    )


def _unpack(x: torch.Tensor, count: int, width: int, dim: int = -2) -> torch.Tensor:
    """Fields `i` = `(x >> (width*i)) & (2**width - 1)` for i < `count`, along a new (negative) output
    dimension `dim`.

    Packed formats store several small fields per byte; this decodes them for all blocks at once, staying
    uint8. The shifts broadcast from an `arange` rather than being stacked: Inductor's CPU code builds a
    stack by copying each part into a buffer, where a broadcast is indexing it fuses into its consumer.
    `bitwise_right_shift` rather than `>>`: the meta function of `>>` cannot broadcast a size traced as
    unknown (an embedding lookup's row count)."""
    assert dim < 0
    shifts = torch.arange(count, dtype=torch.uint8, device=x.device).mul_(width)
    shifts = shifts.view(count, *([1] * (-dim - 1)))
    return torch.bitwise_right_shift(x.unsqueeze(dim), shifts).bitwise_and_((1 << width) - 1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bits of little-endian bytes `[..., k]` as `[..., 8*k]` uint8 0/1, bit i of the integer at position i."""
    return _unpack(x, 8, 1, dim=-1).flatten(-2)


class Decoded(NamedTuple):
    """Blocks decoded as unsigned integer quants and their factors: weights = `(q - zero) * scale (+ offset)`,
    in that order (ggml's), so the result is bit-identical to ggml's reference.

    `q` is uint8 (int8 for Q8_0) `[..., blocks, *shape]`, the block's weights in order once its trailing dims
    are flattened, shaped so that each group sharing a scale is a trailing run; `scale` and `offset` are
    float32 and broadcast against it. The zero point is subtracted in float32 (exact for these small
    integers): Inductor's CPU code converts uint8 to float32 vectors directly, but to int8 slowly."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None
    zero: int = 0

    def weights(self) -> torch.Tensor:
        """float32 `[..., blocks, *shape]`, computed in place of the one float32 conversion of `q`."""
        out = self.q.to(torch.float32)
        if self.zero:
            out = out.sub_(self.zero)
        out = out.mul_(self.scale)
        return out if self.offset is None else out.add_(self.offset)


# --- legacy 32-weight blocks: [..., blocks, 2, 16] (low nibbles then high) or [..., blocks, 32] -------------


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> `[..., 2, 16]` nibbles per block: low nibbles are weights 0..15, high nibbles 16..31."""
    return _unpack(qs, 2, 4)


def _pair_scale(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """A legacy block's f16 field at `offset`, shaped to broadcast over `[..., 2, 16]`."""
    return _f16(blocks, offset).unsqueeze(-1)


def _q8_0(blocks: torch.Tensor) -> Decoded:
    return Decoded(blocks[..., 2:34].view(torch.int8), _f16(blocks, 0))


def _q4_0(blocks: torch.Tensor) -> Decoded:
    return Decoded(_nibbles(blocks[..., 2:18]), _pair_scale(blocks, 0), zero=8)


def _q4_1(blocks: torch.Tensor) -> Decoded:
    return Decoded(_nibbles(blocks[..., 4:20]), _pair_scale(blocks, 0), _pair_scale(blocks, 2))


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 quants 0..31: the nibble, with bit i of the little-endian u32 `qh` as weight i's bit 4."""
    return _nibbles(qs) | (_bits(qh).unflatten(-1, (2, 16)) << 4)


def _q5_0(blocks: torch.Tensor) -> Decoded:
    return Decoded(_five_bit(blocks[..., 2:6], blocks[..., 6:22]), _pair_scale(blocks, 0), zero=16)


def _q5_1(blocks: torch.Tensor) -> Decoded:
    q = _five_bit(blocks[..., 4:8], blocks[..., 8:24])
    return Decoded(q, _pair_scale(blocks, 0), _pair_scale(blocks, 2))


# --- K-quants: 256-weight super-blocks --------------------------------------------------------------------
# Q2_K, Q3_K, Q6_K: [..., blocks, 2, 4, 2, 16], weight 128h + 32j + 16g + l, scale 8h + 2j + g (16 each).
# Q4_K, Q5_K: [..., blocks, 4, 2, 32], weight 64c + 32p + l, sub-block 2c + p (32 each).


def _sixteens(q: torch.Tensor) -> torch.Tensor:
    """`[..., 2, 4, 32]` quants as the 16-weight groups `[..., 2, 4, 2, 16]`."""
    return q.unflatten(-1, (2, 16))


def _per_sixteen(scales: torch.Tensor) -> torch.Tensor:
    """16 per-group factors `[..., 16]`, shaped to broadcast over `[..., 2, 4, 2, 16]`."""
    return scales.unflatten(-1, (2, 4, 2)).unsqueeze(-1)


def _scale_and_offset(dl: torch.Tensor, ml: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant's per-group factors `dl` and `-ml`, computed as one tensor.

    Each takes a float16 decode and a 6-bit field; inlined into a compiled product, both would be recomputed
    for every 16 weights, and Inductor would rather store the whole float weight. One concatenation is a
    buffer Inductor's CPU code writes once per call (a few bytes per group), which the product then reads."""
    both = torch.cat([dl, -ml], dim=-1)
    return both[..., : dl.shape[-1]], both[..., dl.shape[-1] :]


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K low bits: 64 bytes -> `[..., 2, 4, 32]` 2-bit quants: each 32-byte half covers 128 weights;
    shift 2j of byte l is weight 32j + l of its half."""
    return _unpack(qs.unflatten(-1, (2, 32)), 4, 2)


def _q2_k(blocks: torch.Tensor) -> Decoded:
    # scales[16] (low nibble: scale, high nibble: min, one pair per 16 weights), qs[64], f16 d, f16 dmin
    scales = blocks[..., 0:16]
    scale, offset = _scale_and_offset(
        _f16(blocks, 80) * (scales & 0xF).to(torch.float32),
        _f16(blocks, 82) * (scales >> 4).to(torch.float32),
    )
    return Decoded(_sixteens(_crumbs(blocks[..., 16:80])), _per_sixteen(scale), _per_sixteen(offset))


def _q3_k(blocks: torch.Tensor) -> Decoded:
    # hmask[32] (bit k of byte l: third bit of weight 32k + l), qs[64], scales[12] (16 6-bit), f16 d
    scales = blocks[..., 96:108]
    # scale i: low 4 bits are nibble i//8 of byte i%8, high 2 bits are bits 2*(i//4) of byte 8 + i%4
    low = _unpack(scales[..., 0:8], 2, 4).flatten(-2)
    high = _unpack(scales[..., 8:12], 4, 2).flatten(-2)
    dl = _f16(blocks, 108) * (low | (high << 4)).to(torch.float32).sub(32)
    # The high bit is inverted: a set bit means +0, a clear one -4, so q = (low2 | high << 2) - 4.
    high_bit = _unpack(blocks[..., 0:32], 8, 1).unflatten(-2, (2, 4))
    q = _crumbs(blocks[..., 32:96]) | (high_bit << 2)
    return Decoded(_sixteens(q), _per_sixteen(dl), zero=4)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (uint8 `[..., 8]` each).

    With the bytes as a[0:4], b[4:8], c[8:12]: sub-blocks 0..3 take scale a & 63 and min b & 63; sub-blocks
    4..7 take the nibbles of c (low: scale, high: min) with the top two bits of a (scale) and b (min)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=-1)
    minimum = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return scale, minimum


def _k4(blocks: torch.Tensor, q: torch.Tensor) -> Decoded:
    """w = d*scale*q - dmin*min over eight 32-weight sub-blocks, `q` uint8 `[..., 4, 2, 32]`."""
    scale, minimum = _k4_scales(blocks[..., 4:16])
    dl, ml = _scale_and_offset(
        _f16(blocks, 0) * scale.to(torch.float32), _f16(blocks, 2) * minimum.to(torch.float32)
    )
    return Decoded(q, dl.unflatten(-1, (4, 2, 1)), ml.unflatten(-1, (4, 2, 1)))


def _k4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 nibbles `[..., 4, 2, 32]`: 32-byte chunk c holds sub-block 2c (low) and 2c+1 (high)."""
    return _unpack(qs.unflatten(-1, (4, 32)), 2, 4)


def _q4_k(blocks: torch.Tensor) -> Decoded:
    # f16 d, f16 dmin, scales[12], qs[128]
    return _k4(blocks, _k4_nibbles(blocks[..., 16:144]))


def _q5_k(blocks: torch.Tensor) -> Decoded:
    # f16 d, f16 dmin, scales[12], qh[32] (bit s of byte l: fifth bit of weight 32s + l), qs[128]
    high_bit = _unpack(blocks[..., 16:48], 8, 1).unflatten(-2, (4, 2))
    return _k4(blocks, _k4_nibbles(blocks[..., 48:176]) | (high_bit << 4))


def _q6_k(blocks: torch.Tensor) -> Decoded:
    # ql[128], qh[64], int8 scales[16] (one per 16 weights), f16 d; each half holds 128 weights.
    # Weight 32j + l of a half: low nibble j//2 of ql byte 32*(j%2) + l, high 2 bits at 2j of qh byte l.
    low = _unpack(blocks[..., 0:128].unflatten(-1, (2, 2, 32)), 2, 4, dim=-3).flatten(-3, -2)
    high = _unpack(blocks[..., 128:192].unflatten(-1, (2, 32)), 4, 2)
    dl = _f16(blocks, 208) * blocks[..., 192:208].view(torch.int8).to(torch.float32)
    return Decoded(_sixteens(low | (high << 4)), _per_sixteen(dl), zero=32)


_DECODERS: dict[int, Callable[[torch.Tensor], Decoded]] = {
    int(_T.Q8_0): _q8_0,
    int(_T.Q4_0): _q4_0,
    int(_T.Q4_1): _q4_1,
    int(_T.Q5_0): _q5_0,
    int(_T.Q5_1): _q5_1,
    int(_T.Q2_K): _q2_k,
    int(_T.Q3_K): _q3_k,
    int(_T.Q4_K): _q4_k,
    int(_T.Q5_K): _q5_k,
    int(_T.Q6_K): _q6_k,
}


def _checked_rows(data: torch.Tensor, qtype: int, columns: int | None) -> tuple[int, int]:
    """`(qtype, columns)` for rows of raw blocks `data`, checked: what `dequantize` documents."""
    qtype = _checked(qtype)
    if data.dtype != torch.uint8:
        raise TypeError(f"GGUF data must be raw uint8 bytes, got a {data.dtype} tensor")
    if data.dim() == 0:
        raise ValueError("GGUF data must have a last dimension of row bytes, got a 0-d tensor")
    block_size, type_size = block_layout(qtype)
    nbytes = data.shape[-1]
    if columns is None:
        if nbytes % type_size:
            raise ValueError(
                f"{nbytes} bytes per row is not a whole number of {_type_name(qtype)} blocks "
                f"({type_size} bytes each)"
            )
        columns = nbytes // type_size * block_size
    elif row_bytes(qtype, columns) != nbytes:
        raise ValueError(
            f"{columns} columns of {_type_name(qtype)} take {row_bytes(qtype, columns)} bytes per row, "
            f"but the data has {nbytes}"
        )
    return qtype, columns


def decode(data: torch.Tensor, qtype: int) -> Decoded:
    """Rows of raw blocks of a quantized type (not F32/F16/BF16), uint8 `[..., row_bytes]`, decoded per
    block: `Decoded.q` is `[..., blocks, *shape]`, with the type's own block shape, so a product can sum
    within the blocks without building the weights."""
    qtype, _ = _checked_rows(data, qtype, None)
    if qtype in _FLOAT_DTYPES:
        raise ValueError(f"{_type_name(qtype)} is not block-quantized")
    return _decode_blocks(data, qtype)


def _decode_blocks(data: torch.Tensor, qtype: int) -> Decoded:
    """`decode` of rows already checked."""
    type_size = block_layout(qtype)[1]
    # Decoders see [..., blocks, block bytes]: only the trailing, fixed dims are ever split or merged, so a
    # token count traced as unknown stays one dim of its own.
    return _DECODERS[qtype](data.unflatten(-1, (data.shape[-1] // type_size, type_size)))


def dequantize(data: torch.Tensor, qtype: int, columns: int | None = None) -> torch.Tensor:
    """Rows of raw GGUF blocks -> float32 weights.

    data: uint8 `[..., row_bytes]`, the bytes exactly as the file stores them (contiguous or not; F32/F16/
    BF16 tensors are given as their bytes too), on any device. qtype: a `GGMLQuantizationType` in
    COMPUTED_TYPES (ValueError naming it otherwise). columns: the row length in weights; when given it is
    checked against the byte count, which guards against a mis-sliced buffer. Returns float32
    `[..., columns]` on data's device (for F32 input, possibly a view of data's memory).
    """
    qtype, columns = _checked_rows(data, qtype, columns)
    if qtype in _FLOAT_DTYPES:
        return _reinterpret(data, _FLOAT_DTYPES[qtype]).to(torch.float32)
    return _decode_blocks(data, qtype).weights().flatten(data.dim() - 1)
