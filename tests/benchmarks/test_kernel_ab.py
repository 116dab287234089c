"""benchmarks/kernel_ab.py builds HEAD's and the working tree's linear kernel and times both (tiny shape)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmark_scripts import BENCHMARKS, run_benchmark


def _in_git_checkout() -> bool:
    if shutil.which("git") is None or shutil.which("c++") is None:
        return False
    probe = subprocess.run(["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout and a C++ compiler")
def test_kernel_ab_reports_ratios_per_rows() -> None:
    args = ["--base", "HEAD", "--model", "tiny", "--rows", "1,2", "--passes", "3", "--warmup", "1"]
    # -O0 builds in a quarter of -O3's time; the harness, not the kernel's speed, is under test.
    report, table = run_benchmark("kernel_ab", *args, "--extra-flags=-O0")

    assert (report["base"], report["candidate"], report["passes"]) == ("HEAD", "working tree", 3)
    assert report["model"] == "tiny" and report["layers"] == 2
    assert set(report["op_namespaces"]) == {"A", "B"}
    assert [r["rows"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert set(r["median_ms"]) == {"A", "B"} and len(r["pass_ms"]["A"]) == 3
        assert r["ratio_a_over_b"] == pytest.approx(r["median_ms"]["A"] / r["median_ms"]["B"])
        assert 0 <= r["b_won"] <= 1
    assert table.strip().splitlines()[0].startswith("rows")
