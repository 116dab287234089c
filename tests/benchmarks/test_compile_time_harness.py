"""benchmarks/compile_time.py's own pieces on a tiny model (CI never runs the real benchmark)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compile_time.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compile_time_harness", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worker_reports_start_time_and_table_formats(tiny_model_dir: Callable[[str], Path]) -> None:
    harness = _load()
    result = harness.worker(str(tiny_model_dir("llama")), {"compile": False})
    assert set(result) == {"start_s"} and result["start_s"] > 0
    table = harness.format_table([{"layers": 2, "distinct_pieces": 3}, {"layers": 8, "distinct_pieces": 3}])
    assert table.splitlines()[0] == "| layers | distinct_pieces |" and table.splitlines()[-1] == "| 8 | 3 |"
