"""The compile A/B harness: one engine, two compiled forwards alternated step by step, on the tiny model;
each forward really has its own settings, the report's ratio comes from its own step times, and bad
variants are refused.

CI never runs the real benchmark; this keeps the script itself from rotting.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from strata.compilation import backend

from benchmark_scripts import load_benchmark


def _piece_sources(forward: Any) -> list[str]:
    codes = [backend.inductor_code(piece) for piece in forward.backend._pieces.values()]
    assert codes and all(code is not None for code in codes)
    return [Path(code.__globals__["__file__"]).read_text() for code in codes]


def test_tiny_run_alternates_two_forwards_of_one_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = load_benchmark("compile_ab")
    built: list[Any] = []

    class Recorded(harness.TwoForwards):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            built.append(self)

    monkeypatch.setattr(harness, "TwoForwards", Recorded)
    json_out = tmp_path / "report.json"
    a = {"inductor_compile_config": {"cpp.threads": 1}}
    argv = ["--model", "tiny", "--a", json.dumps(a), "--concurrency", "2", "--new-tokens", "4"]
    argv += ["--repeats", "2", "--threads", "2", "--model-dir", str(tmp_path / "models")]
    argv += ["--json-out", str(json_out)]

    assert harness.main(argv) == 0

    stdout = capsys.readouterr().out
    report, end = json.JSONDecoder().raw_decode(stdout)
    assert json.loads(json_out.read_text()) == report
    assert report["settings"]["a"] == a and report["settings"]["b"] == {}
    rows = {row["variant"]: row for row in report["results"]}
    # Two repeats of 4 tokens: the prefill step of each is untimed, the other 3 alternate A and B.
    assert rows["A"]["steps"] + rows["B"]["steps"] == 2 * 3
    assert rows["A"]["steps"] == len(rows["A"]["steps_ms"]) >= 2
    for row in rows.values():
        assert row["median_step_ms"] == pytest.approx(statistics.median(row["steps_ms"]))
    assert report["a_over_b"] == pytest.approx(rows["A"]["median_step_ms"] / rows["B"]["median_step_ms"])
    pairs = list(zip(rows["A"]["steps_ms"], rows["B"]["steps_ms"], strict=False))
    assert report["b_faster_share"] == pytest.approx(sum(b < a for a, b in pairs) / len(pairs))
    assert report["greedy_match"] is True  # serial loops compute what parallel ones do

    # Both forwards serve the one engine's model; A's pieces were compiled with its own Inductor options.
    (forwards,) = built
    forward_a, forward_b = forwards.forwards["A"], forwards.forwards["B"]
    assert forward_a.model is forward_b.model is forwards.engine.runner.model
    assert not any("#pragma omp parallel" in source for source in _piece_sources(forward_a))
    assert all("#pragma omp parallel" in source for source in _piece_sources(forward_b))

    table = stdout[end:].strip().splitlines()
    assert table[0].split("|")[0].strip() == "variant"
    cells = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in table[2:]}
    assert cells["B"][3] == f"{report['a_over_b']:.3f}" and cells["B"][5] == "yes"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--a", "{"], "not JSON"),
        (["--a", "[1]"], "must be a JSON object"),
        (["--a", '{"bogus": 1}'], r"unknown compilation_config fields \['bogus'\]"),
        (["--a", '{"mode": "layer"}'], "only mode 'model'"),
        (["--a", "{}", "--b", '{"mode": "layer"}'], "only mode 'model'"),
        (["--a", "{}", "--new-tokens", "2"], "--new-tokens must be at least 3"),
        (["--a", "{}", "--concurrency", "0"], "--concurrency must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_before_any_engine_is_built(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    harness = load_benchmark("compile_ab")
    with pytest.raises(SystemExit) as exit_info:
        harness.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_bad_value_for_a_known_field_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    harness = load_benchmark("compile_ab")
    for variant in ("--a", "--b"):
        argv = ["--model", "tiny", "--a", "{}", variant, '{"passes": {"no_such_pass": true}}']
        assert harness.main([*argv, "--model-dir", str(tmp_path)]) == 2
        assert f"error: {variant}: passes: 'no_such_pass'" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()  # refused before the model was even built
