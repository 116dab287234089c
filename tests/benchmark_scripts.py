"""Load a script of `benchmarks/` as a module, so tests can call its pieces (CI never runs a benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as a fresh module; its folder is on `sys.path` while it loads, as when it runs
    as a script, so it can import its sibling scripts."""
    spec = importlib.util.spec_from_file_location(f"{name}_harness", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
