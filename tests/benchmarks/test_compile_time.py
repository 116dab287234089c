"""benchmarks/compile_time.py runs on the tiny shape at one depth and reports its fields."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import run_benchmark


def test_compile_time_reports_a_row_per_setting(tmp_path: Path) -> None:
    args = ["--shape", "tiny", "--depths", "2", "--modes", "model", "--layer-name", "on", "--repeats", "1"]
    report, table = run_benchmark(
        "compile_time", *args, "--model-dir", str(tmp_path), env={"STRATA_DISABLE_CPU_KERNELS": "1"}
    )

    assert report["shape"] == "tiny" and report["threads"] == 1
    (row,) = report["rows"]
    assert (row["layers"], row["mode"], row["layer_name"]) == (2, "model", True)
    cold = {"cold_compile_s", "dynamo_graphs", "pieces", "distinct_pieces", "inductor_compilations"}
    assert (
        cold | {"warm_start_s", "eager_start_s", "warm_vs_eager", "warm_inductor_compilations"} <= row.keys()
    )
    assert row["inductor_compilations"] > 0 and row["warm_start_s"] > 0
    assert table.strip().splitlines()[0].startswith("| layers | mode | layer_name |")
