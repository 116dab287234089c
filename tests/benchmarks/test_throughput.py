"""benchmarks/throughput.py runs on the tiny shape, writes its JSON report and prints its table."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from benchmark_scripts import run_benchmark

# Strata's C++ kernels are off where the harness, not they, is under test: building them takes minutes.
NO_KERNELS = {"STRATA_DISABLE_CPU_KERNELS": "1"}


def test_throughput_reports_every_engine_and_prints_its_table(tmp_path: Path) -> None:
    engines = ["strata", "transformers", "llama.cpp"]
    args = ["--models", "tiny", "--engines", ",".join(engines), "--concurrency", "1,2", "--new-tokens", "4"]
    args += ["--repeats", "1", "--prefill-len", "8", "--threads", "1", "--model-dir", str(tmp_path)]
    report, table = run_benchmark("throughput", *args, "--json-out", str(tmp_path / "r.json"), env=NO_KERNELS)

    assert json.loads((tmp_path / "r.json").read_text()) == report
    machine = report["machine"]
    assert {"cpu_model", "threads", "torch", "transformers", "date"} <= machine.keys()
    assert machine["memory_read_gb_s"] > 0 and machine["matmul_fp32_gflop_s"] > 0
    ran = [e for e in engines if e not in report["settings"]["skipped_engines"]]  # llama.cpp may be missing
    assert report["settings"]["engines"] == ran
    assert report["models"]["tiny"]["matmul_params"] > 0
    assert set(report["models"]["tiny"]["greedy_match"]) == set(ran) - {"transformers"}
    rows = {(row["concurrency"], row["engine"]): row for row in report["results"]}
    assert set(rows) == {(c, e) for c in (1, 2) for e in ran}
    for (concurrency, engine), row in rows.items():
        assert row["model"] == "tiny" and row["tokens_per_s"] > 0 and len(row["runs_s"]) == 1
        assert ("vs_transformers" in row) == (engine != "transformers")
        assert ("vs_llama_cpp" in row) == ("llama.cpp" in ran and engine != "llama.cpp")
        assert ("bw_fraction" in row) == (concurrency == 1)
    assert {row["engine"] for row in report["prefill"]} == set(ran)
    assert all(row["prompt_len"] == 8 and row["prompt_tokens_per_s"] > 0 for row in report["prefill"])

    lines = table.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model"))
    assert [cell.strip() for cell in lines[header].split("|")][:4] == ["model", "run", "engine", "tok/s"]
    assert len([line for line in lines if line.startswith("tiny ")]) == 3 * len(ran)


def _llama_cpp_missing() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a library built for another CPU
        return f"the q8_0 file is written by llama.cpp's quantizer: import llama_cpp failed ({e})"
    return None


LLAMA_CPP_MISSING = _llama_cpp_missing()


@pytest.mark.parametrize("kind", ["tp", "pp"])
def test_multi_process_engines_run_beside_one_process(tmp_path: Path, kind: str) -> None:
    option = {"tp": "--tensor-parallel-size", "pp": "--pipeline-parallel-size"}[kind]
    args = ["--models", "tiny", "--engines", "strata", option, "2", "--concurrency", "1,2"]
    args += ["--new-tokens", "4", "--repeats", "1", "--prefill-len", "0", "--model-dir", str(tmp_path)]
    report, table = run_benchmark("throughput", *args, env=NO_KERNELS)

    engine = f"strata-{kind}2"
    assert report["settings"]["engines"] == ["strata", engine]
    assert report["models"]["tiny"]["greedy_match"] == {engine: True}
    for row in report["results"]:
        if row["engine"] == engine:
            assert row["vs_one_process"] > 0 and row["collective_ms_per_step"] > 0
            assert 0 < row["collective_share"] < 1
        else:
            assert "vs_one_process" not in row and "collective_ms_per_step" not in row
    assert f"{engine} c=2:" in table and "ms of a step in collectives" in table


@pytest.mark.skipif(LLAMA_CPP_MISSING is not None, reason=str(LLAMA_CPP_MISSING))
@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX") or "c++") is None,
    reason="strata-gguf runs compiled, which on GGUF weights needs Strata's C++ GGUF kernel (no compiler here)",
)
def test_gguf_engines_run_on_a_quantized_file_beside_llama_cpp(tmp_path: Path) -> None:
    # Kernels on: strata-gguf is Strata compiled on the file, computing with the GGUF kernel.
    engines = ["strata-compiled", "strata-gguf-q8_0", "llama.cpp-q8_0"]
    args = ["--models", "tiny", "--engines", ",".join(engines), "--concurrency", "1,2", "--new-tokens", "4"]
    args += ["--repeats", "1", "--prefill-len", "8", "--threads", "1", "--model-dir", str(tmp_path)]
    report, table = run_benchmark("throughput", *args)

    assert report["settings"]["engines"] == engines
    tensors = [t for t in GGUFReader(tmp_path / "tiny" / "model-q8_0.gguf").tensors if len(t.shape) == 2]
    assert {t.tensor_type for t in tensors} == {GGMLQuantizationType.Q8_0}  # all 2-D weights, by llama.cpp
    info = report["models"]["tiny"]
    assert info["bytes_per_weight"]["strata-gguf-q8_0"] == 34 / 32  # untied: the token embedding not read
    assert info["bytes_per_weight"]["strata-compiled"] == 4
    assert info["greedy_reference"] == {"strata-gguf-q8_0": "llama.cpp-q8_0"}
    rows = {(row["concurrency"], row["engine"]): row for row in report["results"]}
    assert set(rows) == {(c, e) for c in (1, 2) for e in engines}
    for c in (1, 2):
        gguf_row, llama_row = rows[c, "strata-gguf-q8_0"], rows[c, "llama.cpp-q8_0"]
        assert gguf_row["vs_llama_cpp"] == gguf_row["tokens_per_s"] / llama_row["tokens_per_s"]
        assert (
            gguf_row["vs_strata_f32"] == gguf_row["tokens_per_s"] / rows[c, "strata-compiled"]["tokens_per_s"]
        )
        assert "vs_llama_cpp" not in llama_row and llama_row["sequential"] == (c > 1)
    assert "vs_llama_cpp" not in rows[1, "strata-compiled"]  # llama.cpp on the F32 file did not run
    prefill = {row["engine"]: row for row in report["prefill"]}
    assert set(prefill) == set(engines) and "vs_llama_cpp" in prefill["strata-gguf-q8_0"]
    assert "strata-gguf-q8_0 match (llama.cpp-q8_0)" in table or "MISMATCH (llama.cpp-q8_0)" in table


def test_hw_agnostic_engines_run_beside_their_defaults_with_a_long_context_row(tmp_path: Path) -> None:
    # Kernels off: the harness is under test, and without them a compiled GGUF engine needs no compiler.
    # strata-gguf, on the F32 file, writes the file the Q8_0 one is checked against.
    engines = (
        "strata,strata-hw-agnostic,strata-gguf,strata-gguf-q8_0,strata-gguf-hw-agnostic-q8_0,transformers"
    )
    args = ["--models", "tiny", "--engines", engines, "--concurrency", "1,2", "--new-tokens", "4"]
    args += ["--repeats", "1", "--prefill-len", "8", "--context", "24", "--threads", "1"]
    report, table = run_benchmark("throughput", *args, "--model-dir", str(tmp_path), env=NO_KERNELS)

    assert report["settings"]["engines"] == engines.split(",") and report["settings"]["context"] == 24
    defaults = {"strata-hw-agnostic": "strata", "strata-gguf-hw-agnostic-q8_0": "strata-gguf-q8_0"}
    info = report["models"]["tiny"]
    for engine, default in defaults.items():
        assert info["greedy_reference"][engine] == default
        assert info["greedy_match"][engine]  # the same greedy ids on the same weights
    assert len(report["context"]) == len(report["settings"]["engines"])
    for kind, key in (
        ("results", "tokens_per_s"),
        ("prefill", "prompt_tokens_per_s"),
        ("context", "tokens_per_s"),
    ):
        runs: dict[Any, dict[str, Any]] = {}
        for row in report[kind]:
            runs.setdefault(row.get("concurrency"), {})[row["engine"]] = row
        for rows in runs.values():
            assert set(rows) == set(report["settings"]["engines"])
            for engine, row in rows.items():
                assert row[key] > 0
                if engine in defaults:
                    assert row["vs_default"] == row[key] / rows[defaults[engine]][key]
                else:
                    assert "vs_default" not in row
    assert all(row["context"] == 24 and len(row["runs_s"]) == 1 for row in report["context"])
    cells = [[cell.strip() for cell in line.split("|")] for line in table.strip().splitlines()]
    assert "vs default" in next(line for line in cells if line[0] == "model")
    assert [line[2] for line in cells if line[:2] == ["tiny", "context 24"]] == engines.split(",")

    # The Q8_0 file: llama.cpp's quantizer writes it, or without it the gguf package, each 2-D weight in
    # Q8_0 blocks within half a step of the F32 file's weight, the step (the block's largest magnitude / 127)
    # stored in float16 (relative error up to 2^-11, times up to 127 steps).
    assert info["gguf_quantized_by"] == {"q8_0": "gguf-py" if LLAMA_CPP_MISSING else "llama.cpp"}
    exact = {t.name: t for t in GGUFReader(tmp_path / "tiny" / "model-f32.gguf").tensors}
    for tensor in GGUFReader(tmp_path / "tiny" / "model-q8_0.gguf").tensors:
        weight = np.asarray(exact[tensor.name].data, dtype=np.float32)
        if len(tensor.shape) == 1:
            assert tensor.tensor_type == GGMLQuantizationType.F32
            continue
        assert tensor.tensor_type == GGMLQuantizationType.Q8_0
        blocks = weight.reshape(-1, 32)
        error = np.abs(dequantize(tensor.data, tensor.tensor_type).reshape(-1, 32) - blocks)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127
        assert (error <= step * (0.5 + 127 / 2**11)).all()
