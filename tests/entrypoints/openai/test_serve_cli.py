"""`strata serve` options: clear one-line errors for what is not available, and layer implementations."""

from __future__ import annotations

import subprocess
import sys

import pytest
from remote_server import RemoteServer

from strata import LLM, SamplingParams

from stories260k import PROMPT


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata.entrypoints.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unavailable_options_are_one_line_errors() -> None:
    result = _serve("--chat-template", "no-such-file.jinja")
    assert result.returncode == 2 and "--chat-template" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("compile_flag", [[], ["--compile"]], ids=["eager", "compiled"])
def test_layer_impl_reaches_the_engine(compile_flag: list[str]) -> None:
    remote = RemoteServer("--layer-impl", "hw-agnostic", *compile_flag)
    try:
        result = remote.client().completions.create(
            model="stories260K", prompt=PROMPT, max_tokens=16, temperature=0
        )
        params = SamplingParams(temperature=0, max_tokens=16)
        expected = LLM(layer_impl="hw-agnostic").generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
        assert result.choices[0].text == expected
    finally:
        assert remote.stop() == 0
