"""The quantization-agreement harness end to end on the tiny benchmark model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark


def test_tiny_agreement_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    harness = load_benchmark("quantization")
    assert harness.main(["--models", "tiny", "--tokens", "12", "--model-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)["tiny"]
    assert report["tokens"] == 12
    assert set(report["variants"]) == {
        f"{v}/{p}" for v in ("fp32", "bf16", "int8", "fp32-high") for p in ("decode", "prefill")
    }
    for variant in report["variants"].values():
        assert 0.5 <= variant["top1_agreement"] <= 1.0
        assert 0 <= variant["mean_logprob_diff"] <= variant["max_logprob_diff"] < 0.5
