"""benchmarks/compile_time.py's own pieces on a tiny model (CI never runs the real benchmark)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from benchmark_scripts import load_benchmark


def test_worker_reports_start_time_and_table_formats(tiny_model_dir: Callable[[str], Path]) -> None:
    harness = load_benchmark("compile_time")
    spawned = time.time()
    result = harness.worker(str(tiny_model_dir("llama")), {"compile": False, "spawned": spawned})
    assert set(result) == {"start_s"} and 0 < result["start_s"] <= time.time() - spawned
    table = harness.format_table([{"layers": 2, "distinct_pieces": 3}, {"layers": 8, "distinct_pieces": 3}])
    assert table.splitlines()[0] == "| layers | distinct_pieces |" and table.splitlines()[-1] == "| 8 | 3 |"
