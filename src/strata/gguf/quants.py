"""Dequantization of GGUF / ggml block-quantized tensors in plain PyTorch.

This is the hardware-agnostic reference behind Strata's quantized matmul and embedding ops: it uses only
torch views, bitwise ops, shifts and float32 arithmetic, so the same code runs on CPU, CUDA or a plugin
device, and it computes the same float32 numbers as ggml's own reference dequantization (one rounding per
multiply or add, in ggml's order), so a kernel can be checked against it bit for bit.

Every format is decoded for all blocks at once (the only Python loops are over a format's handful of
fields); integer intermediates stay uint8 (one byte per weight) until the single float32 conversion,
which the float math then updates in place, so the peak is about the float32 output plus a byte or two
per weight.

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


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of every block, as float32 `[..., 1]` (ready to broadcast)."""
    return _reinterpret(blocks[..., offset : offset + 2], torch.float16).to(torch.float32)


def _unpack(x: torch.Tensor, shifts: tuple[int, ...], mask: int, dim: int = -2) -> torch.Tensor:
    """`(x >> s) & mask` for each shift `s`, stacked along a new (negative) output dimension `dim`.

    Packed formats store several small fields per byte; each shift decodes one of them for all blocks at
    once, staying uint8. Shifts by Python ints: a broadcast shift tensor does not trace with symbolic sizes."""
    assert dim < 0
    return torch.stack([x >> shift for shift in shifts], dim=dim).bitwise_and_(mask)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bits of little-endian bytes `[..., k]` as `[..., 8*k]` uint8 0/1, bit i of the integer at position i."""
    return _unpack(x, tuple(range(8)), 1, dim=-1).flatten(-2)


# --- legacy 32-weight blocks ---------------------------------------------------------------------------


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 nibbles per block: low nibbles are weights 0..15, high nibbles 16..31."""
    return _unpack(qs, (0, 4), 0xF).flatten(-2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[..., 2:34].view(torch.int8).to(torch.float32).mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return _nibbles(blocks[..., 2:18]).to(torch.float32).sub_(8).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(blocks[..., 4:20]).to(torch.float32).mul_(d).add_(m)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 quants 0..31: the nibble, with bit i of the little-endian u32 `qh` as weight i's bit 4."""
    return _nibbles(qs).bitwise_or_(_bits(qh).bitwise_left_shift_(4))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return _five_bit(blocks[..., 2:6], blocks[..., 6:22]).to(torch.float32).sub_(16).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _five_bit(blocks[..., 4:8], blocks[..., 8:24]).to(torch.float32).mul_(d).add_(m)


# --- K-quants: 256-weight super-blocks -----------------------------------------------------------------


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K low bits: 64 bytes -> 256 2-bit quants. Each 32-byte half covers 128 weights; shift 2j
    of byte l is weight 32j + l of its half."""
    return _unpack(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), 3).flatten(-3)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # scales[16] (low nibble: scale, high nibble: min, one pair per 16 weights), qs[64], f16 d, f16 dmin
    scales = blocks[..., 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0xF).to(torch.float32)).unsqueeze(-1)
    ml = (dmin * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    out = _crumbs(blocks[..., 16:80]).to(torch.float32).unflatten(-1, (16, 16))
    return out.mul_(dl).sub_(ml).flatten(-2)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # hmask[32] (bit k of byte l: third bit of weight 32k + l), qs[64], scales[12] (16 6-bit), f16 d
    d = _f16(blocks, 108)
    scales = blocks[..., 96:108]
    # scale i: low 4 bits are nibble i//8 of byte i%8, high 2 bits are bits 2*(i//4) of byte 8 + i%4
    low = _unpack(scales[..., 0:8], (0, 4), 0xF).flatten(-2)
    high = _unpack(scales[..., 8:12], (0, 2, 4, 6), 3).flatten(-2)
    dl = (d * low.bitwise_or_(high << 4).to(torch.float32).sub_(32)).unsqueeze(-1)
    # The high bit is inverted: a set bit means +0, a clear one -4, so q = (low2 | high << 2) - 4.
    high_bit = _unpack(blocks[..., 0:32], tuple(range(8)), 1).flatten(-2)
    q = _crumbs(blocks[..., 32:96]).bitwise_or_(high_bit.bitwise_left_shift_(2))
    del high_bit  # free before the float32 output is allocated
    out = q.to(torch.float32).sub_(4).unflatten(-1, (16, 16))
    return out.mul_(dl).flatten(-2)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (uint8 `[..., 8]` each).

    With the bytes as a[0:4], b[4:8], c[8:12]: sub-blocks 0..3 take scale a & 63 and min b & 63; sub-blocks
    4..7 take the nibbles of c (low: scale, high: min) with the top two bits of a (scale) and b (min)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = torch.cat([a & 63, (c & 0xF).bitwise_or_((a >> 6) << 4)], dim=-1)
    minimum = torch.cat([b & 63, (c >> 4).bitwise_or_((b >> 6) << 4)], dim=-1)
    return scale, minimum


def _k4_apply(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """w = d*scale*q - dmin*min over eight 32-weight sub-blocks, `q` uint8 `[..., 8, 32]`."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scale, minimum = _k4_scales(blocks[..., 4:16])
    dl = (d * scale.to(torch.float32)).unsqueeze(-1)
    ml = (dmin * minimum.to(torch.float32)).unsqueeze(-1)
    return q.to(torch.float32).mul_(dl).sub_(ml).flatten(-2)


def _k4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 nibbles `[..., 8, 32]`: 32-byte chunk c holds sub-block 2c (low) and 2c+1 (high)."""
    return _unpack(qs.unflatten(-1, (4, 32)), (0, 4), 0xF).flatten(-3, -2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # f16 d, f16 dmin, scales[12], qs[128]
    return _k4_apply(blocks, _k4_nibbles(blocks[..., 16:144]))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # f16 d, f16 dmin, scales[12], qh[32] (bit s of byte l: fifth bit of weight 32s + l), qs[128]
    high_bit = _unpack(blocks[..., 16:48], tuple(range(8)), 1)  # [..., 8, 32]
    q = _k4_nibbles(blocks[..., 48:176]).bitwise_or_(high_bit.bitwise_left_shift_(4))
    del high_bit  # free before the float32 output is allocated
    return _k4_apply(blocks, q)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ql[128], qh[64], int8 scales[16] (one per 16 weights), f16 d; each half holds 128 weights.
    # Weight 32j + l of a half: low nibble j//2 of ql byte 32*(j%2) + l, high 2 bits at 2j of qh byte l.
    d = _f16(blocks, 208)
    low = _unpack(blocks[..., 0:128].unflatten(-1, (2, 2, 32)), (0, 4), 0xF, dim=-3).flatten(-3, -2)
    high = _unpack(blocks[..., 128:192].unflatten(-1, (2, 32)), (0, 2, 4, 6), 3)
    q = low.bitwise_or_(high.bitwise_left_shift_(4))
    del low, high  # q is low, updated in place; free high before the float32 output is allocated
    dl = (d * blocks[..., 192:208].view(torch.int8).to(torch.float32)).unsqueeze(-1)
    out = q.to(torch.float32).sub_(32).flatten(-3).unflatten(-1, (16, 16))
    return out.mul_(dl).flatten(-2)


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
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


def dequantize(data: torch.Tensor, qtype: int, columns: int | None = None) -> torch.Tensor:
    """Rows of raw GGUF blocks -> float32 weights.

    data: uint8 `[..., row_bytes]`, the bytes exactly as the file stores them (contiguous or not; F32/F16/
    BF16 tensors are given as their bytes too), on any device. qtype: a `GGMLQuantizationType` in
    COMPUTED_TYPES (ValueError naming it otherwise). columns: the row length in weights; when given it is
    checked against the byte count, which guards against a mis-sliced buffer. Returns float32
    `[..., columns]` on data's device (for F32 input, possibly a view of data's memory).
    """
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

    if qtype in _FLOAT_DTYPES:
        return _reinterpret(data, _FLOAT_DTYPES[qtype]).to(torch.float32)
    # Decoders see [..., blocks, block bytes] and give [..., blocks, block weights]: only the trailing,
    # fixed dims are ever split or merged, so a token count traced as unknown stays one dim of its own.
    blocks = data.unflatten(-1, (nbytes // type_size, type_size))
    return _DECODERS[qtype](blocks).flatten(-2)
