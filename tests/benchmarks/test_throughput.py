"""benchmarks/throughput.py runs on the tiny shape, writes its JSON report and prints its table."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import run_benchmark

# Strata's C++ kernels are off: building them would take minutes, and the harness, not they, is under test.
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
