"""Float32 linears at PyTorch's "high" matmul precision: on CPUs whose kernels are built for AMX, a weight
packed under `torch.set_float32_matmul_precision("high")` is split into bfloat16 hi and lo parts and
multiplied on the tile units as hi*hi + hi*lo + lo*hi ("bf16x3"), at every row count. These tests hold the
results to float64 within what bf16x3 allows (about 2^-16 of the largest output, where bfloat16 alone or any
of the three products left out is off by 2^-9 to 2^-8), check that the packed copy is what is read, and that
"highest" packs exact float32 panels again."""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from strata import LLM, SamplingParams, envs
from strata.config import ConfigError, LayerConfig
from strata.custom_op import describe_layers
from strata.engine_args import EngineArgs
from strata.entrypoints.layers_cli import LAYERS_OPTIONS
from strata.platforms.cpu import kernels

pytestmark = pytest.mark.skipif(
    not kernels.load("small_batch_linear"),
    reason="Strata's CPU kernel cannot be built here (no C++ compiler)",
)

# bf16x3 keeps about 16 bits of each operand: its error stays under this share of the largest output (with
# a margin of 4-8x over what it measured), while one bfloat16 product is off by about 4e-3.
BF16X3_TOLERANCE = 6e-5


@functools.cache
def _builds_amx() -> bool:
    """Whether the kernels are compiled for AMX-BF16 and AVX512-BF16 (the compiler's own macros for their
    target) on a CPU that has them: where bf16x3 must be what "high" packs."""
    compiler = os.environ.get("CXX") or "c++"
    macros = subprocess.run(
        [compiler, f"-march={envs.cpu_kernel_target()}", "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
    ).stdout.split()
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return (
        all(m in macros for m in ("__AMX_BF16__", "__AMX_TILE__", "__AVX512BF16__")) and "amx_bf16" in flags
    )


@pytest.fixture
def high_precision() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(previous)


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


def _require_amx() -> None:
    if not _builds_amx():
        pytest.skip("bf16x3 needs kernels built for AMX-BF16 (Intel Sapphire Rapids and later)")


@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"),
    [
        (130, 96, 4),  # the fewest rows that read the bf16x3 copy; N padded to 160 (5 items), K whole steps
        (37, 5, 16),  # one row tile; K padded to 32 with zeros
        (33, 31, 17),  # a second row tile of one row; an item of a single column
        (960, 576, 32),  # SmolLM-135M's q/k/v: two row tiles, 30 items over the threads
        (576, 1536, 33),  # a third row tile of one row; the later tiles find the item in L2
        (97, 2500, 130),  # deeper than the float32 panels' one pass
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_high_precision_packs_bf16x3_and_matches_float64(
    out_features: int,
    in_features: int,
    rows: int,
    bias: bool,
    high_precision: None,
    threads: Callable[[int], None],
) -> None:
    _require_amx()
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    packed = torch.ops.strata_cpu.prepack_linear_weight(weight)
    assert packed is not None and packed.dtype == torch.bfloat16
    # Items of 32 columns, per 32 of K (padded) four 1 KB tiles: 4 bytes a weight, as float32.
    assert packed.numel() == -(-out_features // 32) * 32 * -(-in_features // 32) * 32 * 2
    threads(2)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0)
    out = torch.ops.strata_cpu.linear(x, weight, None, b)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert _relative_error(out, expected) < BF16X3_TOLERANCE
    # The items are what every row count reads: a write behind the version counter changes only the dense
    # weight, which no width reads any more; the stand-in that replaces it reads the items too.
    weight.data.mul_(2)
    stand_in = torch.ops.strata_cpu.packed_stand_in(weight)
    for rows_read in (1, 3, rows):
        for w in (weight, stand_in):
            out = torch.ops.strata_cpu.linear(x[:rows_read], w, None, b)
            assert _relative_error(out, expected[:rows_read]) < BF16X3_TOLERANCE
    assert (
        _relative_error(torch.ops.strata_cpu.unpack_weight(stand_in), weight.double() / 2) < BF16X3_TOLERANCE
    )


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("intermediate", "in_features"), [(1536, 576), (24, 64), (7, 3), (20, 2500)])
def test_high_precision_glu_matches_the_activated_gate_times_up(
    activation: str, intermediate: int, in_features: int, high_precision: None
) -> None:
    """Items of 16 gates and their 16 ups: whole items, a partial one, fewer outputs than a tile, and a depth
    the float32 panels do not take in one pass (so "highest" packs none for it)."""
    _require_amx()
    generator = torch.Generator().manual_seed(intermediate)
    weight = torch.randn(2 * intermediate, in_features, generator=generator) / in_features**0.5
    packed = torch.ops.strata_cpu.prepack_glu_weight(weight, activation)
    assert packed is not None and packed.dtype == torch.bfloat16
    for rows in (4, 17, 32, 77):
        x = 3 * torch.randn(rows, in_features, generator=generator)
        gate, up = (x.double() @ weight.double().T).chunk(2, dim=1)
        expected = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        out = torch.ops.strata_cpu.linear_glu(x, weight, activation)
        assert out.shape == (rows, intermediate)
        assert _relative_error(out, expected) < BF16X3_TOLERANCE


def test_a_group_of_bf16x3_weights_is_one_call_and_a_mixed_group_still_adds_up(high_precision: None) -> None:
    """A layer's q, k and v packed alike are one bf16x3 call, each weight's columns what `linear` gives it;
    one of them packed under "highest" instead (float32 panels) sends the group through `linear` per weight,
    with the same results."""
    _require_amx()
    generator = torch.Generator().manual_seed(9)
    weights = [torch.randn(n, 64, generator=generator) for n in (96, 17, 40)]
    packed = [torch.ops.strata_cpu.prepack_linear_weight(w) for w in weights]
    x = torch.randn(20, 64, generator=generator)
    expected = torch.cat([x.double() @ w.double().T for w in weights], dim=1)
    grouped = torch.ops.strata_cpu.linear_group(x, weights)
    assert _relative_error(grouped, expected) < BF16X3_TOLERANCE
    torch.testing.assert_close(
        grouped, torch.cat([torch.ops.strata_cpu.linear(x, w, None, None) for w in weights], 1)
    )
    torch.set_float32_matmul_precision("highest")
    packed[1] = torch.ops.strata_cpu.prepack_linear_weight(weights[1])
    assert packed[1].dtype == torch.float32
    mixed = torch.ops.strata_cpu.linear_group(x, weights)
    assert _relative_error(mixed, expected) < BF16X3_TOLERANCE
    torch.testing.assert_close(mixed[:, 96:113].double(), expected[:, 96:113], rtol=1e-5, atol=1e-5)


def test_highest_precision_repacks_exact_float32_panels(high_precision: None) -> None:
    """A weight packed under "high" and packed again after `set_float32_matmul_precision("highest")` gets
    float32 panels: the float64 answer to float32 accuracy, well under bf16x3's error."""
    _require_amx()
    generator = torch.Generator().manual_seed(11)
    weight, x = torch.randn(200, 96, generator=generator), torch.randn(32, 96, generator=generator)
    expected = x.double() @ weight.double().T
    high = torch.ops.strata_cpu.prepack_linear_weight(weight)
    assert high.dtype == torch.bfloat16
    high_error = _relative_error(torch.ops.strata_cpu.linear(x, weight, None, None), expected)
    torch.set_float32_matmul_precision("highest")
    exact = torch.ops.strata_cpu.prepack_linear_weight(weight)
    assert exact.dtype == torch.float32
    exact_error = _relative_error(torch.ops.strata_cpu.linear(x, weight, None, None), expected)
    assert exact_error < 1e-6 < high_error < BF16X3_TOLERANCE


def test_without_amx_high_precision_keeps_float32_panels(high_precision: None) -> None:
    """Where the kernels have no AMX (another CPU, or a portable target), "high" changes nothing."""
    if _builds_amx():
        pytest.skip("this build has AMX")
    packed = torch.ops.strata_cpu.prepack_linear_weight(torch.randn(64, 96))
    assert packed is None or packed.dtype == torch.float32


def _packed_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes of the packed copies `model`'s linears and fused GLU MLPs hold."""
    copies = [getattr(m, name, None) for m in model.modules() for name in ("_packed_weight", "_glu_panels")]
    return {copy.value.dtype for copy in copies if copy is not None}


def test_an_engine_built_at_high_precision_generates_like_the_float32_one(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """`LLM(fp32_matmul_precision="high")` packs bf16x3 copies (and "highest" float32 ones) without touching
    torch's own setting, its layer report says so, and its greedy tokens and their logprobs over a batch of 4 prompts (prefill and
    4-row decode steps read the copies) follow the float32 engine's."""
    _require_amx()
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 120 for j in range(24 + i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs, dtypes, forwards = {}, {}, {}
    for precision in ("highest", "high"):
        llm = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, fp32_matmul_precision=precision)
        assert torch.get_float32_matmul_precision() == "highest"
        dtypes[precision] = llm.apply_model(_packed_dtypes)
        forwards[precision] = {row["forward"] for row in llm.apply_model(describe_layers)}
        outputs[precision] = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
    assert dtypes == {"highest": {torch.float32}, "high": {torch.bfloat16}}
    # The layer report says which linears read bf16x3 copies.
    assert not any("bf16x3" in forward for forward in forwards["highest"])
    assert {
        "forward_cpu (bf16x3)",
        "forward_cpu (strata_cpu::linear_glu, silu, bf16x3)",
    } <= (forwards["high"])
    for exact, high in zip(outputs["highest"], outputs["high"], strict=True):
        assert exact.token_ids == high.token_ids
        for token, a, b in zip(exact.token_ids, exact.logprobs, high.logprobs, strict=True):
            assert abs(a[token].logprob - b[token].logprob) < 1e-3


def _layer_config(args: argparse.Namespace) -> LayerConfig:
    return EngineArgs.from_cli_args(args, LAYERS_OPTIONS).create_engine_config().layer_config


def test_fp32_matmul_precision_option_reaches_the_layer_config_and_bad_values_are_refused() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, LAYERS_OPTIONS)
    assert _layer_config(parser.parse_args([])).fp32_matmul_precision is None
    args = parser.parse_args(["--fp32-matmul-precision", "high"])
    assert _layer_config(args).fp32_matmul_precision == "high"
    with pytest.raises(SystemExit):
        parser.parse_args(["--fp32-matmul-precision", "tf32"])
    with pytest.raises(ConfigError, match="fp32_matmul_precision must be one of highest, high, medium"):
        LLM(fp32_matmul_precision="fast")
