"""Run a script of `benchmarks/` as a user does and read back its report (CI never runs a real benchmark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(name: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """`python benchmarks/<name>.py ARGS`, which must succeed: its JSON report (the start of its stdout) and
    the rest of its stdout (the table)."""
    command = [sys.executable, str(BENCHMARKS / f"{name}.py"), *args]
    proc = subprocess.run(
        command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
    report, end = json.JSONDecoder().raw_decode(proc.stdout)
    return report, proc.stdout[end:]
