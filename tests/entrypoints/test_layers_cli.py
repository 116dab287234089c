"""`strata layers` prints the provider table with totals and, with --verify, the largest difference per op;
`strata generate --layer-impl` switches the provider."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata.config import LayerConfig, ModelConfig
from strata.engine_args import EngineArgs
from strata.entrypoints.cli import main
from strata.entrypoints.layers_cli import LAYERS_OPTIONS
from strata.entrypoints.llm import default_model
from strata.models.transformers.layers import verify_layers
from strata.models.transformers.loader import build_model
from strata.platforms import get_platform
from strata.platforms.cpu import layers as cpu_layers


def test_layers_table_totals_and_verify(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layers", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "platform: cpu  layer_impl: default" in out
    assert "model.layers.0.input_layernorm" in out and "strata.platforms.cpu.layers.CpuRMSNorm" in out
    assert (
        "total: 57 layers; by provider: cpu 57; by op: attention 5, glu_mlp 5, linear 31, rms_norm 11, "
        "silu_and_mul 5" in out
    )
    verify = out.split("max_abs_diff", 1)[1]
    assert "silu_and_mul  5        0" in verify
    # Strata's CPU linear and RMSNorm kernels sum in another order than the reference: equal up to float32
    # rounding.
    rows = {
        line.split()[0]: line.split()
        for line in verify.splitlines()
        if line.startswith(("linear", "rms_norm"))
    }
    assert rows["linear"][1] == "31" and float(rows["linear"][2]) < 1e-5
    assert rows["rms_norm"][1] == "11" and float(rows["rms_norm"][2]) < 1e-5


def test_layers_compile_reports_each_compiled_piece(capsys: pytest.CaptureFixture[str]) -> None:
    """`--compile` runs a compiled step and lists each distinct piece (before the first attention, between
    two, after the last) with the kernels Inductor generated and the matmuls it calls."""
    assert main(["layers", "--compile", "--layer-impl", "hw-agnostic"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.input_layernorm" in out  # the layer table still comes first
    pieces = out.split("compiled pieces", 1)[1].splitlines()[3:]
    assert len(pieces) == 3
    assert all("aten::rsqrt" in row and "strata_onednn::linear x" in row for row in pieces)


def test_layers_hw_agnostic_and_custom_ops(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Callable[[str], Path]
) -> None:
    folder = str(tiny_model_dir("gemma3"))
    assert main(["layers", "--model", folder, "--layer-impl", "hw-agnostic", "--custom-ops", "none"]) == 0
    out = capsys.readouterr().out
    assert (
        "total: 47 layers; by provider: hw-agnostic 47; "
        "by op: attention 3, gelu_and_mul 3, gemma_rms_norm 19, glu_mlp 3, linear 19" in out
    )
    assert "forward_cpu" not in out
    assert main(["layers", "--custom-ops", "all,none"]) == 2
    assert "custom_ops" in capsys.readouterr().err


def test_verify_catches_a_layer_that_computes_something_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fast path that exists but is wrong resolves and runs without complaint; only --verify shows it, and
    `strata layers --verify` then fails."""

    def wrong_forward_cpu(self: cpu_layers.CpuSiluAndMul, x: torch.Tensor) -> torch.Tensor:
        return self.forward_native(x) * 1.5

    monkeypatch.setattr(cpu_layers.CpuSiluAndMul, "forward_cpu", wrong_forward_cpu)
    model, _ = build_model(
        ModelConfig(default_model()), LayerConfig(layer_impl="default"), get_platform("cpu")
    )
    checks = {row["op"]: row for row in verify_layers(model)}
    assert checks["silu_and_mul"]["max_abs_diff"] > 0.1
    assert checks["silu_and_mul"]["reference"] == "strata.hw_agnostic.layers.activation.SiluAndMul"
    assert checks["rms_norm"]["max_abs_diff"] < 1e-5  # a correct layer passes: float32 rounding only
    assert main(["layers", "--verify"]) == 1
    assert "mismatch: silu_and_mul" in capsys.readouterr().out


def test_verify_checks_the_fused_glu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GLU MLP's fused `linear_glu` path is checked against the reference MLP (its projections and its
    activation each the reference's): a wrong fused activation shows."""
    model, _ = build_model(
        ModelConfig(default_model()), LayerConfig(layer_impl="default"), get_platform("cpu")
    )
    mlps = [m for m in model.modules() if isinstance(m, cpu_layers.CpuGluMLP)]
    if not any(m.fused_activation for m in mlps):
        pytest.skip("the fused GLU kernel serves float32 weights on AVX-512 CPUs only")
    assert {row["op"]: row for row in verify_layers(model)}["glu_mlp"]["max_abs_diff"] < 1e-5
    for mlp in mlps:
        mlp.fused_activation = "gelu_tanh"  # the kernel computes another activation than the layer's SiLU
    assert {row["op"]: row for row in verify_layers(model)}["glu_mlp"]["max_abs_diff"] > 1e-3


def test_generate_with_layer_impl(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--prompt", "Once upon a time", "--max-tokens", "12"]
    assert main([*args, "--layer-impl", "hw-agnostic"]) == 0
    hw = capsys.readouterr().out
    assert main([*args, "--layer-impl", "default"]) == 0
    assert capsys.readouterr().out == hw


def _layer_config(args: argparse.Namespace) -> LayerConfig:
    return EngineArgs.from_cli_args(args, LAYERS_OPTIONS).create_engine_config().layer_config


def test_prepack_weights_option_and_environment_reach_the_layer_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, LAYERS_OPTIONS)
    assert _layer_config(parser.parse_args([])).prepack_weights is True
    assert _layer_config(parser.parse_args(["--no-prepack-weights"])).prepack_weights is False
    monkeypatch.setenv("STRATA_PREPACK_WEIGHTS", "0")
    assert _layer_config(parser.parse_args([])).prepack_weights is False
    assert _layer_config(parser.parse_args(["--prepack-weights"])).prepack_weights is True


def test_verify_checks_the_platforms_attention_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU backend agrees with the reference backend on random decode, prefill and mixed steps (windows
    and soft-capping included); one that attends wrongly, or stores the wrong keys, shows."""
    from strata.models.transformers.attention import AttentionLayerSpec
    from strata.models.transformers.layers import verify_attention
    from strata.platforms.cpu.attention import CpuAttentionBackend

    specs = [AttentionLayerSpec("layer", 8, 2, 16)]
    for cache_dtype in (torch.float32, torch.float16):
        row = verify_attention(CpuAttentionBackend(cache_dtype), specs, torch.float32)
        assert row["op"] == "attention" and row["max_abs_diff"] < 1e-5
    attend = CpuAttentionBackend.attend
    monkeypatch.setattr(CpuAttentionBackend, "attend", lambda self, *args: attend(self, *args) * 1.01)
    assert verify_attention(CpuAttentionBackend(torch.float32), specs, torch.float32)["max_abs_diff"] > 1e-3
    monkeypatch.undo()
    monkeypatch.setattr("strata.platforms.cpu.attention.write_to_kv_cache", lambda key, value, *rest: None)
    assert verify_attention(CpuAttentionBackend(torch.float32), specs, torch.float32)["max_abs_diff"] > 1e-1
