"""The `strata` command line, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stories260k import GREEDY_55_TEXT, PROMPT


def _strata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata.entrypoints.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("compile_flag", [[], ["--compile"]], ids=["eager", "compiled"])
def test_generate_streams_the_llama2c_story(compile_flag: list[str]) -> None:
    result = _strata(
        "--log-level", "INFO", "generate", "--prompt", PROMPT, "--max-tokens", "55", *compile_flag
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == GREEDY_55_TEXT + "\n"
    assert ("loaded from cache" in result.stderr) == bool(compile_flag)


def test_help_lists_commands() -> None:
    result = _strata("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout and "convert" in result.stdout


def test_user_errors_are_one_line_not_tracebacks(tmp_path: Path) -> None:
    result = _strata("generate", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "not a directory" in result.stderr and "Traceback" not in result.stderr
    result = _strata("generate", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr and "Traceback" not in result.stderr
    result = _strata("generate", "--dtype", "int4")
    assert result.returncode == 2 and "dtype" in result.stderr and "Traceback" not in result.stderr
    result = _strata("generate", "--kv-cache-dtype", "fp8")
    assert result.returncode == 2 and "--kv-cache-dtype" in result.stderr and "Traceback" not in result.stderr
