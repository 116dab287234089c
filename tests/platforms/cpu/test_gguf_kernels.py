"""Strata's CPU kernels on GGUF blocks (`strata_cpu::gguf_linear`, `strata_cpu::gguf_embedding`): every type
against gguf's own numpy dequantization, at decode sizes (int8 dot products per row of x), batch sizes
(repacked weight tiles; float panels for F16/BF16/F32), with and without bias, on one thread and on shapes
that split over two; and clear errors for misuse."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from strata.platforms.cpu import kernels

pytestmark = pytest.mark.skipif(
    not kernels.load("gguf_linear"), reason="Strata's CPU GGUF kernel cannot be built here (no C++ compiler)"
)

T = gguf.GGMLQuantizationType

# Types built from random floats by gguf's own quantizer.
QUANTIZED = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
# K-quants (gguf has no quantizer for them): random bytes, with the float16 super-block scales at these byte
# offsets overwritten by small finite values.
K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
TYPES = QUANTIZED + list(K_SCALE_OFFSETS)
# Decode takes x in int8 per block, as llama.cpp does, but keeps it finer for the 8- and 6-bit types: int16 for
# Q8_0, int8 and what it leaves over (to 1/128 of a step) for Q6_K. The batch path takes x in int16.
RESIDUAL = {T.Q8_0, T.Q6_K}
FLOAT = {T.F32, T.F16, T.BF16}
MAX_DECODE_ROWS = 8

# Up to 8 rows decode; more take the batch path (the quantized types; up to 32 rows on CPUs without VNNI) or
# float panels and ATen's GEMM (F32, F16, BF16). Odd counts add a bias.
ROWS = [1, 3, 8, 9, 16, 31, 33, 64]
OUTPUTS = [37, 701]  # not a multiple of 16 (nor of 2); enough rows to split over two threads


def _in_features(qtype: T) -> int:
    """Several blocks a row: 2 super-blocks of the K-quants; 15 blocks of the legacy types (which decode
    blocks in groups of 8, 4, 2 and 1)."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return 512 if block == 256 else 480


@functools.cache
def _weights(qtype: T, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes [rows, row_bytes] of type `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype in K_SCALE_OFFSETS:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(rows * columns // block, type_size), dtype=np.uint8)
        for offset in K_SCALE_OFFSETS[qtype]:
            scale = rng.uniform(0.002, 0.02, size=len(blocks)).astype(np.float16)
            blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    data = rng.standard_normal((rows, columns)).astype(np.float32)
    # F32 and F16 come back as floats; as bytes they are the rows a GGUF file stores.
    return np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8).reshape(rows, -1)


def _dequantized(data: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))


@functools.cache
def _reference_weight(qtype: T, rows: int, columns: int) -> torch.Tensor:
    return _dequantized(_weights(qtype, rows, columns), qtype).double()


def _exact_int8_rows(rows: int, columns: int, generator: torch.Generator, residual: bool) -> torch.Tensor:
    """x that the kernels' quantization (per 32 inputs, or per 256 for the K-quants in decode; scale max |x| /
    127, or / 32512 in int16) represents exactly: integers in [-127, 127] (with a `residual`, plus 128ths below
    half a step, still within [-127, 127]), each 32 with a +-127 in it, times a power of two per 256 (per 32
    where rows are not whole 256s: legacy types)."""
    steps = torch.randint(-127, 128, (rows, columns // 32, 32), generator=generator).double()
    if residual:
        steps = (steps + torch.randint(-63, 64, steps.shape, generator=generator) / 128).clamp(-127, 127)
    steps[:, :, 0] = 127 * (torch.randint(0, 2, (rows, columns // 32), generator=generator) * 2 - 1)
    steps = steps.gather(2, torch.rand(steps.shape, generator=generator).argsort(dim=2))
    group = 256 if columns % 256 == 0 else 32
    scale = 2.0 ** -torch.randint(4, 9, (rows, columns // group, 1), generator=generator)
    return (steps.reshape(rows, -1, group) * scale).reshape(rows, columns).float()


def _tolerance(
    x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor, qtype: T, exact: bool
) -> float:
    """Float rounding where the kernel represents x exactly or works in float; otherwise decode's int8 x (as
    llama.cpp's) errs by up to half a step (1/254 of a block's max |x|) per input: a few thousandths of the
    outputs' RMS on average, up to about 5% of it at the tails of these random weights. x kept finer (the
    residual, int16) errs by about 1/65000 of its block's max |x|. CPUs without AVX2 compute every type in
    float."""
    if exact or qtype in FLOAT:
        return 1e-5 * (x.double().abs() @ weight.abs().T).max().item()
    fine = qtype in RESIDUAL or x.shape[0] > MAX_DECODE_ROWS
    return (2e-3 if fine else 6e-2) * reference.pow(2).mean().sqrt().item()


@pytest.fixture(params=[1, 2], ids=["1_thread", "2_threads"])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("exact", [True, False], ids=["int8_exact_x", "gaussian_x"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_linear_matches_dequantized_matmul(qtype: T, exact: bool, rows: int, threads: int) -> None:
    columns = _in_features(qtype)
    generator = torch.Generator().manual_seed(rows)
    bias = rows % 2 == 1
    for outputs in OUTPUTS:
        data = _weights(qtype, outputs, columns)
        weight = _reference_weight(qtype, outputs, columns)
        x = (
            _exact_int8_rows(rows, columns, generator, qtype in RESIDUAL)
            if exact
            else torch.randn(rows, columns, generator=generator)
        )
        b = torch.randn(outputs, generator=generator) if bias else None
        reference = x.double() @ weight.T + (b.double() if bias else 0)
        out = torch.ops.strata_cpu.gguf_linear(x, torch.from_numpy(data), int(qtype), b)
        assert out.dtype == torch.float32 and out.shape == (rows, outputs)
        atol = _tolerance(x, weight, reference, qtype, exact)
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=atol, msg=qtype.name)


@pytest.mark.parametrize("qtype", sorted(RESIDUAL), ids=lambda t: t.name)
def test_residual_keeps_x_to_a_128th_of_a_step(qtype: T) -> None:
    """With one input 40x the others (LLM hidden states have such), int8 alone leaves the rest of its block
    a few levels; the residual keeps decode within a few thousandths of the outputs' RMS."""
    columns = _in_features(qtype)
    data = _weights(qtype, 300, columns)
    weight = _dequantized(data, qtype).double()
    x = torch.randn(4, columns, generator=torch.Generator().manual_seed(6))
    x[:, 5] = 40.0
    reference = x.double() @ weight.T
    out = torch.ops.strata_cpu.gguf_linear(x, torch.from_numpy(data), int(qtype), None)
    atol = 5e-3 * reference.pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=atol)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_do_not_depend_on_each_other(qtype: T) -> None:
    """Each row of x is quantized with its own scales: a row's result does not depend on the batch it is in,
    in decode beyond the order of float sums, in the batch path not at all (each output is one lane's sums)."""
    columns = _in_features(qtype)
    data = torch.from_numpy(_weights(qtype, 300, columns))
    x = torch.randn(32, columns, generator=torch.Generator().manual_seed(3))  # AVX2 builds: up to 32 rows
    x[3] *= 1000  # a row far larger than the others
    decode = torch.ops.strata_cpu.gguf_linear(x[:MAX_DECODE_ROWS], data, int(qtype), None)
    for m in (0, 3, 5):
        single = torch.ops.strata_cpu.gguf_linear(x[m : m + 1], data, int(qtype), None)
        torch.testing.assert_close(
            decode[m : m + 1], single, rtol=1e-5, atol=1e-5 * single.abs().max().item()
        )
    batch = torch.ops.strata_cpu.gguf_linear(x, data, int(qtype), None)
    for begin, end in ((0, 9), (3, 12), (5, 30)):
        assert torch.equal(
            torch.ops.strata_cpu.gguf_linear(x[begin:end], data, int(qtype), None), batch[begin:end]
        )


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_results_do_not_depend_on_the_thread_count(qtype: T) -> None:
    """The engine may change its thread count between steps: every output is computed the same way however
    the rows are split (a greedy decode must not change with it)."""
    columns = _in_features(qtype)
    data = torch.from_numpy(_weights(qtype, 701, columns))
    x = torch.randn(64, columns, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        results = {}
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results[count] = [
                torch.ops.strata_cpu.gguf_linear(x[:rows], data, int(qtype), None)
                for rows in (1, 2, 5, 9, 12, 40, 64)
            ]
    finally:
        torch.set_num_threads(threads)
    for count in (2, 3):
        for one, other in zip(results[1], results[count], strict=True):
            assert torch.equal(one, other)


def test_gguf_linear_reads_strided_x_and_rows_of_a_larger_buffer() -> None:
    """A transposed x is made contiguous; qweight rows may be a view with a wider row pitch."""
    data = torch.from_numpy(_weights(T.Q8_0, 37, 160))
    padded = torch.zeros(37, data.shape[1] + 10, dtype=torch.uint8)
    padded[:, 3 : 3 + data.shape[1]] = data
    view = padded[:, 3 : 3 + data.shape[1]]
    x = torch.randn(160, 2, generator=torch.Generator().manual_seed(4)).T
    for rows in (x, torch.randn(12, 160)):
        assert torch.equal(
            torch.ops.strata_cpu.gguf_linear(rows, view, int(T.Q8_0), None),
            torch.ops.strata_cpu.gguf_linear(rows.contiguous(), data, int(T.Q8_0), None),
        )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_embedding_returns_the_dequantized_rows(qtype: T) -> None:
    columns = _in_features(qtype)
    data = _weights(qtype, 300, columns)
    table = _dequantized(data, qtype)
    ids = torch.tensor([[0, 299, 17], [17, 5, 123]])
    out = torch.ops.strata_cpu.gguf_embedding(torch.from_numpy(data), ids, int(qtype))
    assert out.dtype == torch.float32 and out.shape == (2, 3, columns)
    torch.testing.assert_close(out, table[ids], rtol=1e-6, atol=1e-6 * table.abs().max().item())
    many = torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(5))  # split over threads
    torch.testing.assert_close(
        torch.ops.strata_cpu.gguf_embedding(torch.from_numpy(data), many, int(qtype)),
        table[many],
        rtol=1e-6,
        atol=1e-6 * table.abs().max().item(),
    )


def test_empty_and_scalar_inputs() -> None:
    data = torch.from_numpy(_weights(T.Q4_0, 37, 160))
    assert torch.ops.strata_cpu.gguf_linear(torch.zeros(0, 160), data, int(T.Q4_0), None).shape == (0, 37)
    bias = torch.randn(37)
    no_features = torch.ops.strata_cpu.gguf_linear(torch.zeros(2, 0), data[:, :0], int(T.Q4_0), bias)
    assert torch.equal(no_features, bias.expand(2, 37))
    empty_ids = torch.zeros(0, 4, dtype=torch.int64)
    assert torch.ops.strata_cpu.gguf_embedding(data, empty_ids, int(T.Q4_0)).shape == (0, 4, 160)
    one = torch.ops.strata_cpu.gguf_embedding(data, torch.tensor(5), int(T.Q4_0))
    assert torch.equal(one, _dequantized(data.numpy(), T.Q4_0)[5])


def test_weights_in_a_read_only_memory_map(tmp_path: Path) -> None:
    """GGUF rows are read where the file's map puts them, and never written (a write would fault)."""
    data = _weights(T.Q4_K, 300, 512)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        qweight = torch.from_numpy(mapped)
    x = torch.randn(33, 512)
    for rows in (x[:1], x[:8], x):
        expected = torch.ops.strata_cpu.gguf_linear(rows, torch.from_numpy(data), int(T.Q4_K), None)
        assert torch.equal(torch.ops.strata_cpu.gguf_linear(rows, qweight, int(T.Q4_K), None), expected)
    ids = torch.tensor([3, 299])
    assert torch.equal(
        torch.ops.strata_cpu.gguf_embedding(qweight, ids, int(T.Q4_K)),
        torch.ops.strata_cpu.gguf_embedding(torch.from_numpy(data), ids, int(T.Q4_K)),
    )


def test_misuse_is_an_error_not_a_crash() -> None:
    data = torch.from_numpy(_weights(T.Q4_0, 37, 160))
    x = torch.randn(2, 160)
    linear, embedding = torch.ops.strata_cpu.gguf_linear, torch.ops.strata_cpu.gguf_embedding
    with pytest.raises(RuntimeError, match="qweight must be uint8"):
        linear(x, data.view(torch.int8), int(T.Q4_0), None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        linear(x.double(), data, int(T.Q4_0), None)
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(2, 192), data, int(T.Q4_0), None)  # row_bytes holds 160 weights, not 192
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(2, 150), data, int(T.Q4_0), None)  # not whole blocks
    with pytest.raises(RuntimeError, match="features"):
        linear(x, data, int(T.Q8_0), None)  # the bytes of Q4_0 rows are not Q8_0 rows
    with pytest.raises(RuntimeError, match="unsupported GGUF type"):
        linear(x, data, int(T.IQ2_XXS), None)
    with pytest.raises(RuntimeError, match="bias"):
        linear(x, data, int(T.Q4_0), torch.zeros(36))
    with pytest.raises(RuntimeError, match="qweight must be"):
        linear(x, data.flatten(), int(T.Q4_0), None)
    with pytest.raises(RuntimeError, match="out of range"):
        embedding(data, torch.tensor([0, 37]), int(T.Q4_0))
    with pytest.raises(RuntimeError, match="out of range"):
        embedding(data, torch.tensor([-1]), int(T.Q4_0))
    with pytest.raises(RuntimeError, match="ids must be int64"):
        embedding(data, torch.tensor([0.0]), int(T.Q4_0))
    with pytest.raises(RuntimeError, match="not whole blocks"):
        embedding(data[:, :17], torch.tensor([0]), int(T.Q4_0))
    with pytest.raises(RuntimeError, match="unsupported GGUF type"):
        embedding(data, torch.tensor([0]), int(T.Q8_1))


@pytest.mark.parametrize("rows", [3, 12])
def test_ops_check_out_for_torch_compile(rows: int) -> None:
    """Schemas, fake registrations (what torch.compile traces with) and dispatch agree with the real ops."""
    data = torch.from_numpy(_weights(T.Q4_K, 37, 512))
    x, bias = torch.randn(rows, 512), torch.randn(37)
    torch.library.opcheck(torch.ops.strata_cpu.gguf_linear.default, (x, data, int(T.Q4_K), bias))
    torch.library.opcheck(torch.ops.strata_cpu.gguf_linear.default, (x, data, int(T.Q4_K), None))
    ids = torch.tensor([[1, 2, 3], [36, 0, 5]])
    torch.library.opcheck(torch.ops.strata_cpu.gguf_embedding.default, (data, ids, int(T.Q4_K)))
