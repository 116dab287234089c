"""The Linear layer and Strata's CPU kernel behind it: same numbers as `nn.Linear` at every batch size and
dtype, int8 weights with scales, clear errors, an ATen fallback where the kernel cannot be built, and
every HF Linear of a built model replaced."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strata import LLM, SamplingParams, envs
from strata.config import ConfigError
from strata.hw_agnostic.layers import GluMLP
from strata.hw_agnostic.layers import linear as hw_linear
from strata.platforms.cpu import kernels
from strata.platforms.cpu import layers as cpu_layers

from resolved_layers import build_layer

pytestmark = pytest.mark.skipif(
    not kernels.load("small_batch_linear"),
    reason="Strata's CPU kernel cannot be built here (no C++ compiler)",
)

# The kernel takes up to 8 rows and in blocks of 4; 9 and 40 rows go to ATen inside the same op.
ROWS = [1, 3, 4, 5, 8, 9, 40]
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 5e-2), torch.float16: (2e-3, 2e-3)}


@functools.cache
def _has_avx512() -> bool:
    """Whether the kernels are compiled with AVX-512 (what their panel GEMM needs): the compiler's own macros
    for their target (`STRATA_CPU_KERNEL_TARGET`, this CPU by default), not the CPU's flags."""
    compiler = os.environ.get("CXX") or "c++"
    cpu = envs.cpu_kernel_target()
    macros = subprocess.run(
        [compiler, f"-march={cpu}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True
    ).stdout
    return "__AVX512F__" in macros.split()


def _reference_pair(dtype: torch.dtype, bias: bool, in_features: int = 96, out_features: int = 130) -> tuple:
    generator = torch.Generator().manual_seed(0)
    reference = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(out_features, in_features, generator=generator))
        if bias:
            reference.bias.copy_(torch.randn(out_features, generator=generator))
    reference = reference.to(dtype)
    ours = build_layer("linear", in_features, out_features, bias=bias, dtype=dtype)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_cpu_linear_matches_nn_linear(dtype: torch.dtype, bias: bool, rows: int) -> None:
    ours, reference = _reference_pair(dtype, bias)
    # The kernel reads float32 and bfloat16 weights; float16 ones take the reference (ATen's F.linear).
    assert (type(ours) is cpu_layers.CpuLinear) == (dtype != torch.float16)
    assert ours.forward_method_name == ("forward_cpu" if dtype != torch.float16 else "forward_native")
    _check_against_reference(ours, reference, dtype, bias, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 32, 512])
def test_prepacked_linear_matches_nn_linear(dtype: torch.dtype, bias: bool, rows: int) -> None:
    """After loading, a float32 weight on an AVX-512 build is replaced by its panels: the layer's `weight`
    is a stand-in that holds no memory, every row count reads the panels, and `state_dict` still gives the
    weight. Other weights keep their dense form and no copy."""
    ours, reference = _reference_pair(dtype, bias)
    ours.process_weights_after_loading()
    packed = dtype == torch.float32 and _has_avx512()
    assert (ours._packed_weight is not None) == packed
    assert cpu_layers.is_stand_in(ours.weight) == packed
    assert ours.weight.shape == reference.weight.shape and ours.weight.dtype == dtype
    assert torch.equal(ours.state_dict()["weight"], reference.weight)
    _check_against_reference(ours, reference, dtype, bias, rows)


def _onednn_has_bfloat16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _check_against_reference(
    ours: nn.Module, reference: nn.Linear, dtype: torch.dtype, bias: bool, rows: int
) -> None:
    x = torch.randn(2, rows, 96).to(dtype)
    out = ours(x)
    assert out.dtype == dtype and out.shape == (2, rows, 130)
    # Against float32 math, so the kernel's float32 accumulation is held to the float32 answer.
    expected = nn.functional.linear(
        x.float(), reference.weight.float(), None if not bias else reference.bias.float()
    )
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


def test_registered_panels_are_read_at_every_row_count_while_they_match_the_weight() -> None:
    """A weight registered with its panels is read through them at every row count, alone or in a group,
    while it keeps its shape and version; its stand-in reads them too, and fails clearly once they are gone."""
    if not _has_avx512():
        pytest.skip("float32 weights are packed into panels only on AVX-512 CPUs")
    generator = torch.Generator().manual_seed(7)
    weight, small = torch.randn(64, 96, generator=generator), torch.randn(16, 96, generator=generator)
    x = torch.randn(16, 96, generator=generator)
    expected = x @ weight.T
    packed = torch.ops.strata_cpu.prepack_linear_weight(weight)
    assert packed is not None
    # A write through `.data` bypasses the version counter, so only the dense weight changes: every width
    # still sees the old values, which shows it reads the panels.
    weight.data.mul_(2)
    stand_in = torch.ops.strata_cpu.packed_stand_in(weight)
    assert stand_in.shape == weight.shape and stand_in.stride() == (0, 0)
    assert stand_in.untyped_storage().nbytes() == 4
    for rows in (1, 2, 3, 4, 8, 9, 16):
        for w in (weight, stand_in):
            torch.testing.assert_close(
                torch.ops.strata_cpu.linear(x[:rows], w, None, None), expected[:rows], rtol=1e-5, atol=1e-4
            )
        grouped = torch.ops.strata_cpu.linear_group(x[:rows], [stand_in, small])  # the small one dense
        torch.testing.assert_close(grouped[:, :64], expected[:rows], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grouped[:, 64:], x[:rows] @ small.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.ops.strata_cpu.unpack_weight(stand_in), weight / 2, rtol=0, atol=0)
    weight.mul_(1)  # a tracked in-place write: the panels no longer match the weight and are not read
    torch.testing.assert_close(torch.ops.strata_cpu.linear(x, weight, None, None), 2 * expected)
    del packed  # freed with its owner: the weight reads itself, the stand-in has nothing left to read
    torch.testing.assert_close(torch.ops.strata_cpu.linear(x, weight, None, None), 2 * expected)
    with pytest.raises(RuntimeError, match="packed form that replaced this"):
        torch.ops.strata_cpu.linear(x, stand_in, None, None)


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry (range and fields) of the mapping holding `address`, or None."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if entry is not None and entry["found"] == "yes":
                return entry
            start, end = (int(part, 16) for part in head.split("-"))
            entry = {"start": str(start), "end": str(end), "found": "yes" if start <= address < end else "no"}
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return entry if entry is not None and entry["found"] == "yes" else None


def test_panels_of_two_megabytes_and_more_get_their_own_huge_page_mapping() -> None:
    """A 4 MB weight's panels start on a 2 MB boundary of a mapping advised for huge pages (eligible for
    them whenever the kernel's THP setting is not "never"), compute what the weight does, and the mapping is
    gone once the panels are freed."""
    if not _has_avx512():
        pytest.skip("float32 weights are packed into panels only on AVX-512 CPUs")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this machine")
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(1024, 1024, generator=generator), torch.randn(8, 1024, generator=generator)
    packed = torch.ops.strata_cpu.prepack_linear_weight(weight)
    address = packed.data_ptr()
    mapping = _mapping_of(address)
    assert mapping is not None and address == int(mapping["start"]) and address % (2 << 20) == 0
    assert int(mapping["end"]) - address == packed.numel() * 4  # 4 MB: a whole number of pages
    if "THPeligible" not in mapping:
        pytest.skip("this kernel's smaps does not say which mappings may get huge pages")
    assert mapping["THPeligible"] == "1"
    torch.testing.assert_close(
        torch.ops.strata_cpu.linear(x, weight, None, None), x @ weight.T, rtol=1e-5, atol=1e-4
    )
    del packed
    assert _mapping_of(address) is None


def test_a_weight_shared_by_two_layers_keeps_its_dense_form_and_no_copy() -> None:
    """A weight another module holds too (an embedding tied to its output head reads its rows) cannot be
    freed, so packing it would hold it twice: both layers keep it dense and read it as it is."""
    first = cpu_layers.CpuLinear(96, 130)
    second = cpu_layers.CpuLinear(96, 130)
    nn.init.normal_(first.weight)
    second.weight = first.weight
    first.process_weights_after_loading()
    second.process_weights_after_loading()
    assert first._packed_weight is None and second._packed_weight is None
    assert first.weight is second.weight and not cpu_layers.is_stand_in(first.weight)
    x = torch.randn(20, 96)
    torch.testing.assert_close(first(x), x @ first.weight.T, rtol=1e-5, atol=1e-4)
    other = cpu_layers.CpuLinear(96, 130)
    other.process_weights_after_loading()
    assert (other._packed_weight is not None) == _has_avx512()


def test_only_contiguous_float32_weights_are_packed() -> None:
    """Panels for float32 only (on AVX-512 builds): bfloat16 and int8 weights keep their dense form, which
    the small-batch kernel reads for few rows and oneDNN for wide inputs."""
    assert torch.ops.strata_cpu.prepack_linear_weight(torch.randn(96, 64).t()) is None
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.ops.strata_cpu.prepack_linear_weight(torch.randn(64, 96, dtype=dtype)) is None
    for dtype in (torch.int8, torch.int32):
        weight = torch.randint(-5, 5, (64, 96), dtype=dtype)
        assert torch.ops.strata_cpu.prepack_linear_weight(weight) is None
    assert (torch.ops.strata_cpu.prepack_linear_weight(torch.randn(64, 96)) is not None) == _has_avx512()
    with pytest.raises(RuntimeError, match="no registered float32 panels"):
        torch.ops.strata_cpu.packed_stand_in(torch.randn(64, 96))


def _packed_copies(model: nn.Module, layer_class: type) -> list[bool]:
    """Whether each linear of `model` has its packed copy: a GLU MLP whose gate and up projections run fused
    holds theirs (`_glu_panels`) in the projection's place."""
    fused = {
        id(m.gate_up_proj): m
        for m in model.modules()
        if isinstance(m, cpu_layers.CpuGluMLP) and m.fused_activation
    }
    return [
        (fused[id(m)]._glu_panels if id(m) in fused else m._packed_weight) is not None
        for m in model.modules()
        if isinstance(m, layer_class)
    ]


def _weight_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes the CPU linears' weights would take dense, and bytes their weight storages and packed forms
    hold (a fused GLU MLP's panels counted for its projection)."""
    glu_panels = {
        id(m.gate_up_proj): m._glu_panels for m in model.modules() if isinstance(m, cpu_layers.CpuGluMLP)
    }
    nominal = held = 0
    for m in model.modules():
        if isinstance(m, cpu_layers.CpuLinear):
            nominal += m.weight.numel() * m.weight.element_size()
            held += m.weight.untyped_storage().nbytes()
            for packed in (m._packed_weight, glu_panels.get(id(m))):
                held += 0 if packed is None else packed.value.untyped_storage().nbytes()
    return nominal, held


def test_engine_holds_each_linear_weight_once(tiny_model_dir: Callable[[str], Path]) -> None:
    """A float32 model loaded with `prepack_weights` holds its linears' weights once: on AVX-512 builds as
    panels only (padding aside, the weights' own bytes, not twice them), elsewhere dense only; greedy tokens
    are those of the engine that packs nothing."""
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 120 for j in range(24)]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, packed = {}, {}
    for prepack in (True, False):
        llm = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, prepack_weights=prepack)
        nominal, held = llm.apply_model(_weight_bytes)
        assert nominal <= held <= 1.1 * nominal
        packed[prepack] = llm.apply_model(lambda model: _packed_copies(model, cpu_layers.CpuLinear))
        tokens[prepack] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert packed[True] and all(packed[True]) == _has_avx512() and not any(packed[False])
    assert tokens[True] == tokens[False]
    with pytest.raises(ConfigError, match="prepack_weights"):
        LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, prepack_weights="yes")


def test_hw_agnostic_linear_is_plain_f_linear() -> None:
    ours, reference = _reference_pair(torch.float32, True)
    agnostic = hw_linear.Linear(96, 130, bias=True)
    agnostic.load_state_dict(reference.state_dict())
    x = torch.randn(5, 96)
    torch.testing.assert_close(agnostic(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(ours(x), agnostic(x))


@pytest.mark.parametrize("rows", [1, 6, 12, 300])
def test_kernel_int8_weights_with_per_row_scales(rows: int) -> None:
    generator = torch.Generator().manual_seed(1)
    qweight = torch.randint(-127, 128, (70, 64), dtype=torch.int8, generator=generator)
    scale = torch.rand(70, generator=generator) / 100
    bias = torch.randn(70, generator=generator)
    x = torch.randn(rows, 64, generator=generator)
    out = torch.ops.strata_cpu.linear(x, qweight, scale, bias)
    expected = x @ (qweight.float() * scale[:, None]).T + bias
    if rows <= 8 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    else:
        # Wide inputs meet the int8 weights in bfloat16 (exact for int8), the scales multiply the product.
        bf16_product = F.linear(x.to(torch.bfloat16), qweight.to(torch.bfloat16)).float() * scale + bias
        torch.testing.assert_close(out, bf16_product, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.randn(2, 5), torch.randn(3, 4), None, None), "x has 5 features but weight expects 4"),
        (
            (torch.randn(2, 4), torch.randn(3, 4).double(), None, None),
            "weight dtype must be float32, bfloat16 or int8",
        ),
        ((torch.randn(2, 4), torch.zeros(3, 4, dtype=torch.int8), None, None), "int8 weights need a scale"),
        ((torch.randn(2, 2, 4), torch.randn(3, 4), None, None), "must be 2-D"),
        ((torch.randn(9, 4), torch.randn(3, 4), None, torch.randn(2)), "bias must have one value per output"),
        (
            (torch.randn(2, 4), torch.zeros(3, 4, dtype=torch.int8), torch.ones(3, 1), None),
            "scale must have one value per output",
        ),
    ],
)
def test_kernel_rejects_bad_inputs_clearly(args: tuple, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        torch.ops.strata_cpu.linear(*args)


@pytest.mark.parametrize("prepacked", [False, True])
def test_no_input_features_give_the_bias_at_every_row_count(prepacked: bool) -> None:
    """A weight with no input columns: every sum is empty, so each row is the bias (or zeros), on every path
    (small batches, panels or oneDNN), alone or in a group."""
    weight, bias = torch.randn(3, 0), torch.randn(3)
    packed = torch.ops.strata_cpu.prepack_linear_weight(weight) if prepacked else None
    for rows in (1, 4, 9):
        x = torch.randn(rows, 0)
        torch.testing.assert_close(torch.ops.strata_cpu.linear(x, weight, None, bias), bias.expand(rows, 3))
        torch.testing.assert_close(
            torch.ops.strata_cpu.linear_group(x, [weight, weight]), torch.zeros(rows, 6)
        )
    del packed


def _kernel_in_subprocess(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
        "from strata.config import LayerConfig\n"
        "from strata.models.transformers.layers import LayerResolver\n"
        "from strata.platforms import get_platform\n"
        "layer = LayerResolver(LayerConfig(), get_platform('cpu')).build('linear', 8, 4)\n"
        "torch.nn.init.normal_(layer.weight)\n"
        "x = torch.randn(1, 8)\n"
        "torch.testing.assert_close(layer(x), x @ layer.weight.T)\n"
        "print('use_kernel', type(layer).__name__ == 'CpuLinear')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "STRATA_CACHE_ROOT": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_compiler_the_layer_falls_back_to_aten_with_one_warning(tmp_path: Path) -> None:
    result = _kernel_in_subprocess(tmp_path, CXX="no-such-compiler")
    assert result.returncode == 0, result.stderr
    assert "use_kernel False" in result.stdout
    assert result.stderr.count("no C++ compiler (no-such-compiler) found") == 1


def test_a_failing_build_falls_back_and_disable_env_skips_the_build(tmp_path: Path) -> None:
    failing = _kernel_in_subprocess(tmp_path, CXX="false")
    assert failing.returncode == 0, failing.stderr
    assert "use_kernel False" in failing.stdout and "building Strata's CPU kernel" in failing.stderr
    disabled = _kernel_in_subprocess(tmp_path, STRATA_DISABLE_CPU_KERNELS="1")
    assert "use_kernel False" in disabled.stdout and disabled.stderr == ""
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("layer_impl", ["default", "hw-agnostic"])
def test_every_hf_linear_of_a_built_model_is_replaced(
    tiny_model_dir: Callable[[str], Path], layer_impl: str
) -> None:
    llm = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, layer_impl=layer_impl)
    types = llm.apply_model(lambda model: {type(m) for m in model.modules()})
    assert nn.Linear not in types
    rows = [row for row in llm.layer_providers() if row["op"] == "linear"]
    # 4 attention projections and 2 MLP projections per layer, and the head.
    num_layers = llm.apply_model(lambda model: model.config.num_hidden_layers)
    assert len(rows) == 6 * num_layers + 1
    assert {row["provider"] for row in rows} == {"cpu" if layer_impl == "default" else "hw-agnostic"}


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 5), (19, 33), (130, 96), (300, 200)])
def test_kernel_every_small_row_count_odd_shapes_and_dtypes(
    wdtype: torch.dtype, xdtype: torch.dtype, shape: tuple
) -> None:
    """All M the kernel's own path takes (1-8) over rows and features that are not multiples of its tiles
    (16 lanes) nor of its row blocks, float32 / bfloat16 x and bias, float32 / bfloat16 / int8 weights."""
    n, k = shape
    generator = torch.Generator().manual_seed(2)
    if wdtype == torch.int8:
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        scale = torch.rand(n, generator=generator) / 100
        dense = weight.float() * scale[:, None]
    else:
        weight, scale = torch.randn(n, k, generator=generator).to(wdtype), None
        dense = weight.float()
    bias = torch.randn(n, generator=generator).to(xdtype)
    for rows in range(1, 9):
        x = torch.randn(rows, k, generator=generator).to(xdtype)
        out = torch.ops.strata_cpu.linear(x, weight, scale, bias)
        assert out.dtype == xdtype and out.shape == (rows, n)
        expected = x.float() @ dense.T + bias.float()
        if xdtype == torch.bfloat16:
            # The kernel rounds its float32 result to bfloat16 once, as `.to()` does.
            torch.testing.assert_close(out, expected.to(xdtype), rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8, 9])
def test_linear_group_equals_one_linear_per_weight(
    xdtype: torch.dtype, wdtype: torch.dtype, rows: int
) -> None:
    """Row counts up to 8 take the grouped kernel (one parallel region over every weight's rows, including
    weights whose rows do not fill a 16-row tile), 9 the per-weight path; each weight's columns of the one
    output are what `linear` gives."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 200, generator=generator).to(xdtype)
    weights = [torch.randn(n, 200, generator=generator).to(wdtype) for n in (300, 37, 37, 5000)]
    grouped = torch.ops.strata_cpu.linear_group(x, weights)
    assert grouped.shape == (rows, 300 + 37 + 37 + 5000)
    outputs = grouped.split([w.shape[0] for w in weights], dim=1)
    for output, weight in zip(outputs, weights, strict=True):
        expected = torch.ops.strata_cpu.linear(x, weight, None, None)
        assert output.dtype == expected.dtype and output.shape == expected.shape
        torch.testing.assert_close(output, expected, rtol=0, atol=0)


def test_linear_group_of_mixed_or_strided_weights_falls_back_to_linear_per_weight() -> None:
    x = torch.randn(2, 64)
    weights = [torch.randn(32, 64), torch.randn(64, 16).t(), torch.randn(8, 64).bfloat16()]
    grouped = torch.ops.strata_cpu.linear_group(x, weights)
    for output, weight in zip(grouped.split([32, 16, 8], dim=1), weights, strict=True):
        torch.testing.assert_close(output, x @ weight.float().t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="needs at least one weight"):
        torch.ops.strata_cpu.linear_group(x, [])


@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"),
    [
        (130, 96, 4),  # the fewest rows that read the panels: one partial row block
        (130, 96, 9),  # one row block of 8 and one of 1; a last panel of 2 tiles, the last tile partial
        (1, 5, 16),  # a single output column, two full row blocks
        (48, 33, 23),  # exactly one panel; row blocks of 8, 8 and 7
        (200, 96, 40),  # 5 row blocks over two depth slices (64 and 32), the last panel narrow
        (160, 129, 24),  # three depth slices, the last one k deep, their sums carried between them
        (97, 2500, 130),  # deeper than one pass (parts of the depth) and more rows than one chunk of x
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_weights_for_wide_inputs_match_float64(
    out_features: int, in_features: int, rows: int, bias: bool, threads: Callable[[int], None]
) -> None:
    """Float32 inputs of 4 rows or more: on AVX-512 builds Strata's panel GEMM on the packed weight (its
    column panels, padded to whole tiles), elsewhere the dense weight (nothing is packed) through oneDNN or
    the small-batch kernel; either way the float64 answer to float32 accuracy, with every panel split over
    two threads landing in its own columns."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    packed = torch.ops.strata_cpu.prepack_linear_weight(weight)
    if _has_avx512():
        assert packed is not None
        assert packed.dim() == 1 and packed.numel() == -(-out_features // 16) * 16 * in_features
    else:
        assert packed is None
    threads(2)
    out = torch.ops.strata_cpu.linear(x, weight, None, b)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert (out.double() - expected).abs().max() <= 1e-6 * in_features**0.5 * expected.abs().max()


def test_linear_group_of_packed_weights_for_wide_inputs_equals_one_linear_per_weight() -> None:
    """From 4 rows on, a group whose weights are all prepacked is one call over all their panels, each
    weight's columns exactly what `linear` gives it; a group with one weight not prepacked takes another
    path (the small-batch kernel up to 8 rows, `linear` per weight above), with the same results to float32
    accuracy. Each panel's last slice prefetches the next panel, which may be the next weight's."""
    generator = torch.Generator().manual_seed(6)
    weights = [torch.randn(n, 64, generator=generator) for n in (96, 17, 17, 300)]
    packed = [torch.ops.strata_cpu.prepack_linear_weight(w) for w in weights[:3]]
    for rows in (5, 20, 40):
        x = torch.randn(rows, 64, generator=generator)
        for group, exact in ((weights[:3], True), (weights, rows > 8)):
            grouped = torch.ops.strata_cpu.linear_group(x, group)
            outputs = grouped.split([w.shape[0] for w in group], dim=1)
            for output, weight in zip(outputs, group, strict=True):
                expected = torch.ops.strata_cpu.linear(x, weight, None, None)
                tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-4}
                torch.testing.assert_close(output, expected, **tolerance)
    del packed


def test_kernel_strided_inputs_empty_x_and_threads_split_large_layers(threads: Callable[[int], None]) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 2000, generator=generator)
    x = torch.randn(3, 200, generator=generator)[:, ::2]  # non-contiguous x
    w = weight[:, ::20]  # non-contiguous weight, 96 x 100
    torch.testing.assert_close(torch.ops.strata_cpu.linear(x, w, None, None), x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.ops.strata_cpu.linear(torch.randn(0, 100), w, None, None).shape == (0, 96)
    # Large enough to be split over the intra-op threads; each thread's rows must land in place.
    big = torch.randn(4099, 512, generator=generator)
    xs = torch.randn(5, 512, generator=generator)
    threads(2)
    out = torch.ops.strata_cpu.linear(xs, big, None, None)
    torch.testing.assert_close(out, xs @ big.T, rtol=1e-5, atol=1e-3)


def _glu_reference(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x @ gate.T) * (x @ up.T) in float64, as HF's MLP computes it."""
    gate, up = (x.double() @ weight.double().T).chunk(2, dim=1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("intermediate", "in_features"), [(384, 96), (24, 64), (10, 16), (7, 3), (40, 200)])
@pytest.mark.parametrize("packed", [True, False])
def test_linear_glu_matches_the_activated_gate_times_up(
    activation: str, intermediate: int, in_features: int, packed: bool
) -> None:
    """Whole panels (384 = 16 panels of 24 pairs), one exact panel, and panels with fewer pairs than a tile;
    depths of one slice (64 and less) and of several (96, 200), the gate applied after the last; row counts
    below, at and past the panels' 4-row threshold and the 8-row blocks."""
    assert kernels.load("small_batch_linear")
    weight = torch.randn(2 * intermediate, in_features, generator=torch.Generator().manual_seed(intermediate))
    weight /= in_features**0.5
    copy = torch.ops.strata_cpu.prepack_glu_weight(weight, activation) if packed else None
    assert (copy is not None) == (packed and _has_avx512())
    for rows in (1, 3, 4, 9, 32, 77):
        x = 3 * torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        out = torch.ops.strata_cpu.linear_glu(x, weight, activation)
        assert out.shape == (rows, intermediate) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), _glu_reference(x, weight, activation), rtol=2e-5, atol=2e-5)
    # The same weight through the plain op does not read the pairs.
    x = torch.randn(32, in_features)
    torch.testing.assert_close(torch.ops.strata_cpu.linear(x, weight, None, None), x @ weight.T)


def test_glu_weights_are_packed_only_where_the_panels_serve_them() -> None:
    assert kernels.load("small_batch_linear")
    prepack = torch.ops.strata_cpu.prepack_glu_weight
    assert prepack(torch.randn(6, 2049), "silu") is None  # deeper than one pass over the panels
    assert prepack(torch.randn(6, 8, dtype=torch.bfloat16), "silu") is None
    assert prepack(torch.randn(5, 8), "silu") is None  # no even split into gate and up
    assert prepack(torch.randn(12, 8)[:, ::2], "silu") is None  # not contiguous
    assert prepack(torch.randn(0, 8), "silu") is None
    with pytest.raises(RuntimeError, match="unknown GLU activation 'relu'"):
        prepack(torch.randn(6, 8), "relu")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.randn(2, 8), torch.randn(6, 8), "gelu"), "unknown GLU activation 'gelu'"),
        ((torch.randn(2, 8), torch.randn(5, 8), "silu"), r"weight \[2I, K\]"),
        ((torch.randn(2, 7), torch.randn(6, 8), "silu"), "x has 7 features but weight expects 8"),
        ((torch.randn(2, 3, 8), torch.randn(6, 8), "silu"), r"x must be \[M, K\]"),
    ],
)
def test_linear_glu_rejects_bad_inputs_clearly(args: tuple, message: str) -> None:
    assert kernels.load("small_batch_linear")
    with pytest.raises(RuntimeError, match=message):
        torch.ops.strata_cpu.linear_glu(*args)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_glu_mlps_run_fused_where_their_layers_are_strata_own(
    tiny_model_dir: Callable[[str], Path], arch: str
) -> None:
    """SwiGLU (Llama) and tanh-GELU (Gemma) MLPs run as `linear_glu` on AVX-512 CPUs, holding the packed
    copy in their projection's place; without prepacked weights, or with the hw-agnostic layers, they run
    unfused. Greedy tokens agree either way (logits against transformers: tests/models)."""
    prompts = [{"prompt_token_ids": [3 + (5 * i + j) % 120 for j in range(20)]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fused, tokens = {}, {}
    for name, options in {
        "fused": {},
        "no_prepack": {"prepack_weights": False},
        "hw": {"layer_impl": "hw-agnostic"},
    }.items():
        llm = LLM(str(tiny_model_dir(arch)), skip_tokenizer_init=True, **options)
        fused[name] = llm.apply_model(
            lambda model: [
                (
                    getattr(m, "fused_activation", None),
                    m.gate_up_proj._packed_weight is None if getattr(m, "fused_activation", None) else None,
                )
                for m in model.modules()
                if isinstance(m, GluMLP)
            ]
        )
        tokens[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    activation = "silu" if arch == "llama" else "gelu_tanh"
    assert fused["fused"] and all(
        f == ((activation, True) if _has_avx512() else (None, None)) for f in fused["fused"]
    )
    assert not any(f[0] for f in fused["no_prepack"] + fused["hw"])
    assert tokens["fused"] == tokens["no_prepack"] == tokens["hw"]
