"""The throughput harness end to end on a tiny model: JSON report, ratios, greedy check and table.

CI never runs the real benchmark; this keeps the script itself from rotting.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"


def _load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("throughput_harness", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_reports_rows_ratios_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    harness = _load_harness()
    json_out = tmp_path / "report.json"
    argv = ["--models", "tiny", "--concurrency", "1,2", "--new-tokens", "4", "--repeats", "1"]
    argv += ["--model-dir", str(tmp_path / "models"), "--json-out", str(json_out)]

    assert harness.main(argv) == 0

    stdout = capsys.readouterr().out
    report, end = json.JSONDecoder().raw_decode(stdout)
    assert json.loads(json_out.read_text()) == report
    assert {"cpu_model", "cpu_count", "torch", "transformers", "date"} <= report["machine"].keys()

    rows = {(row["concurrency"], row["engine"]): row for row in report["results"]}
    assert set(rows) == {(c, e) for c in (1, 2) for e in ("strata", "transformers")}
    for row in rows.values():
        assert row["model"] == "tiny"
        assert len(row["runs_s"]) == 1 and row["median_s"] == row["runs_s"][0] > 0
        assert row["tokens_per_s"] == pytest.approx(row["concurrency"] * 4 / row["median_s"])

    ratios = {row["concurrency"]: row for row in report["ratios"]}
    assert set(ratios) == {1, 2}
    for concurrency, row in ratios.items():
        expected = rows[concurrency, "transformers"]["median_s"] / rows[concurrency, "strata"]["median_s"]
        assert row["ratio"] == pytest.approx(expected)
    assert isinstance(ratios[1]["greedy_match"], bool)
    assert "greedy_match" not in ratios[2]

    table = stdout[end:].strip().splitlines()
    header = [cell.strip() for cell in table[0].split("|")]
    assert header == ["model", "concurrency", "strata tok/s", "transformers tok/s", "ratio"]
    assert [line.split("|")[1].strip() for line in table[2:4]] == ["1", "2"]
    assert all(line.startswith("tiny") for line in table[2:4])


def test_model_folders_are_cached_and_deterministic(tmp_path: Path) -> None:
    harness = _load_harness()
    folder = harness.ensure_model_folder("tiny", tmp_path / "a")
    weights = folder / "model.safetensors"
    assert (folder / "config.json").is_file() and weights.is_file()
    stamp = weights.stat().st_mtime_ns
    assert harness.ensure_model_folder("tiny", tmp_path / "a") == folder
    assert weights.stat().st_mtime_ns == stamp
    rebuilt = harness.ensure_model_folder("tiny", tmp_path / "b") / "model.safetensors"
    assert rebuilt.read_bytes() == weights.read_bytes()
