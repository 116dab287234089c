"""Strata's CPU RMSNorm kernel (`strata_cpu::rms_norm`, `strata_cpu::fused_add_rms_norm`): the numbers of
the layers' `forward_native` for Llama's and Gemma's norm in every dtype, row count and width (also widths
that are no multiple of the 16-lane tile, and q/k norms' 4-D inputs), the residual sum bit for bit, clear
errors, and fake implementations that `torch.compile` traces with."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from strata.hw_agnostic.layers import GemmaRMSNorm, RMSNorm
from strata.platforms.cpu import kernels
from strata.platforms.cpu.layers import CpuGemmaRMSNorm, CpuRMSNorm

from resolved_layers import build_layer

pytestmark = pytest.mark.skipif(
    not kernels.load("rms_norm"),
    reason="Strata's CPU RMSNorm kernel cannot be built here (no C++ compiler)",
)

NORMS = [CpuRMSNorm, CpuGemmaRMSNorm]
# float32: the same float32 math up to the order of the sum of squares; bfloat16 / float16: a rounding
# boundary crossed by that difference moves an output by an ulp or two.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-2, 1e-2)}


def _norm(cls: type, hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    """The norm the CPU platform resolves to: `cls`, running the kernel."""
    norm = build_layer(cls.op_name, hidden, 1e-6, dtype=dtype)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    assert type(norm) is cls and norm.forward_method_name == "forward_cpu"
    return norm


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    return x.to(dtype), torch.randn(shape, generator=generator).to(dtype)


def _assert_matches_native(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> None:
    rtol, atol = TOLERANCE[x.dtype]
    if residual is None:
        got, want = norm.forward_cpu(x), norm.forward_native(x)
    else:
        (got, got_sum), (want, want_sum) = norm.forward_cpu(x, residual), norm.forward_native(x, residual)
        assert got_sum.dtype == x.dtype and torch.equal(got_sum, want_sum)
        assert torch.equal(got_sum, x + residual)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cls", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 200])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_forward_native(
    cls: type, dtype: torch.dtype, rows: int, hidden: int, with_residual: bool
) -> None:
    x, residual = _inputs((rows, hidden), dtype)
    x_before, residual_before = x.clone(), residual.clone()
    _assert_matches_native(_norm(cls, hidden, dtype), x, residual if with_residual else None)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # the op is functional


@pytest.mark.parametrize("cls", NORMS)
@pytest.mark.parametrize(("rows", "hidden"), [(32, 576), (15, 576), (200, 1000)])
def test_rows_split_over_threads_give_one_threads_results(
    cls: type, rows: int, hidden: int, threads: Callable[[int], None]
) -> None:
    """A decode step's 32 rows of 576 are split over two threads; each row is the same as on one."""
    x, residual = _inputs((rows, hidden), torch.float32)
    norm = _norm(cls, hidden, torch.float32)
    threads(2)
    split = norm.forward_cpu(x, residual)
    threads(1)
    whole = norm.forward_cpu(x, residual)
    assert all(torch.equal(a, b) for a, b in zip(split, whole, strict=True))
    _assert_matches_native(norm, x, residual)


@pytest.mark.parametrize("cls", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_weight_and_qk_norm_shaped_inputs(cls: type, dtype: torch.dtype) -> None:
    """A float32 weight on narrower activations: Llama's product is then float32, Gemma's x's dtype; and a
    q/k norm's [1, tokens, heads, head_dim] input normalises each head's 40 values (not a tile multiple)."""
    norm = _norm(cls, 40, torch.float32)
    x, residual = _inputs((1, 5, 3, 40), dtype)
    _assert_matches_native(norm, x, None)
    _assert_matches_native(norm, x, residual)
    _assert_matches_native(norm, x[:, :, 1], None)  # a strided view


@pytest.mark.parametrize(("cls", "reference"), [(CpuRMSNorm, RMSNorm), (CpuGemmaRMSNorm, GemmaRMSNorm)])
def test_without_the_kernel_the_reference_serves(
    cls: type, reference: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, residual = _inputs((3, 40), torch.bfloat16)
    with_kernel = _norm(cls, 40, torch.bfloat16)
    monkeypatch.setattr(kernels, "load", lambda name: False)
    norm = build_layer(cls.op_name, 40, 1e-6, dtype=torch.bfloat16)
    assert type(norm) is reference and norm.forward_method_name == "forward_native"
    norm.load_state_dict(with_kernel.state_dict())
    for args in ((x,), (x, residual)):
        for got, want in zip(_as_tuple(norm(*args)), _as_tuple(with_kernel.forward_cpu(*args)), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def _as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.tensor(1.0), torch.randn(1)), r"x must be \[\.\.\., hidden\]"),
        ((torch.randn(2, 8), torch.randn(6)), r"weight must be \[8\]"),
        ((torch.randn(2, 8).double(), torch.randn(8)), "x dtype must be float32, bfloat16 or float16"),
        ((torch.randn(2, 8), torch.randn(8).double()), "weight dtype must be float32, bfloat16 or float16"),
    ],
)
def test_kernel_rejects_bad_inputs_clearly(args: tuple, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.strata_cpu.rms_norm(*args, 1e-6, False)


def test_fused_add_rejects_a_residual_of_another_shape_or_dtype() -> None:
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        torch.ops.strata_cpu.fused_add_rms_norm(x, torch.randn(1, 8), weight, 1e-6, False)
    with pytest.raises(RuntimeError, match="residual must have x's dtype"):
        torch.ops.strata_cpu.fused_add_rms_norm(x, torch.randn(2, 8).bfloat16(), weight, 1e-6, False)


@pytest.mark.parametrize("weight_offset", [False, True])
def test_fake_implementations_match_the_kernel(weight_offset: bool) -> None:
    x, residual = _inputs((3, 24), torch.bfloat16)
    for weight in (torch.randn(24).bfloat16(), torch.randn(24)):
        torch.library.opcheck(
            torch.ops.strata_cpu.rms_norm.default,
            (x, weight, 1e-6, weight_offset),
            test_utils=("test_schema", "test_faketensor"),
        )
        torch.library.opcheck(
            torch.ops.strata_cpu.fused_add_rms_norm.default,
            (x, residual, weight, 1e-6, weight_offset),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_fused_add_rms_norm_compiles_as_one_graph() -> None:
    weight = torch.randn(16)

    def block(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, new_residual = torch.ops.strata_cpu.fused_add_rms_norm(x, residual, weight, 1e-6, False)
        return out * 2, new_residual

    compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
    for tokens in (1, 5):
        x, residual = _inputs((1, tokens, 16), torch.float32, seed=tokens)
        (out, new_residual), (want, want_residual) = compiled(x, residual), block(x, residual)
        torch.testing.assert_close(out, want)
        assert torch.equal(new_residual, want_residual)
