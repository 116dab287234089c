"""The step-pairs harness: engines' decode steps alternated one by one, on the tiny model with Strata and
transformers; the rotation of the step order; the report's ratios from its own step times; refusals.

CI never runs the real benchmark; this keeps the script itself from rotting.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark


def test_tiny_run_alternates_steps_and_reports_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    harness = load_benchmark("step_pairs")
    json_out = tmp_path / "report.json"
    argv = ["--model", "tiny", "--engines", "strata,transformers", "--new-tokens", "4", "--repeats", "2"]
    argv += ["--model-dir", str(tmp_path / "models"), "--json-out", str(json_out)]

    assert harness.main(argv) == 0

    stdout = capsys.readouterr().out
    report, end = json.JSONDecoder().raw_decode(stdout)
    assert json.loads(json_out.read_text()) == report
    assert report["settings"]["engines"] == ["strata", "transformers"]
    rows = {row["engine"]: row for row in report["results"]}
    for row in rows.values():
        assert row["steps"] == len(row["steps_ms"]) == 2 * 3  # two runs of 4 tokens, the first untimed
        assert row["median_step_ms"] == pytest.approx(statistics.median(row["steps_ms"]))
        assert row["tokens_per_s"] == pytest.approx(1e3 / row["median_step_ms"])
        assert len(row["first_run_tokens"]) == 4
    (ratio,) = report["ratios"]
    strata, hf = rows["strata"]["steps_ms"], rows["transformers"]["steps_ms"]
    assert ratio["baseline"] == "strata" and ratio["engine"] == "transformers"
    assert ratio["speed_ratio"] == pytest.approx(statistics.median(strata) / statistics.median(hf))
    assert ratio["faster_share"] == pytest.approx(
        sum(h < s for h, s in zip(hf, strata, strict=True)) / len(hf)
    )
    # Over every run; the report keeps the first run's tokens.
    assert isinstance(ratio["greedy_match"], bool)
    if rows["strata"]["first_run_tokens"] != rows["transformers"]["first_run_tokens"]:
        assert not ratio["greedy_match"]

    table = stdout[end:].strip().splitlines()
    assert table[0].split("|")[0].strip() == "engine"
    cells = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in table[2:]}
    assert cells["strata"][3] == "-"
    assert cells["transformers"][3] == f"{ratio['speed_ratio']:.3f}"


class _Recording:
    """A stepper that counts its tokens and logs each call in a shared list."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def start(self, prompt: list[int], new_tokens: int) -> int:
        self.log.append(f"start {self.name}")
        self.next_token = len(prompt)
        return self.next_token

    def step(self) -> int:
        self.log.append(self.name)
        self.next_token += 1
        return self.next_token


def test_every_round_steps_each_engine_once_in_a_rotating_order() -> None:
    harness = load_benchmark("step_pairs")
    log: list[str] = []
    steppers = {name: _Recording(name, log) for name in ("a", "b", "c")}

    seconds, tokens = harness.run_pairs(steppers, [1, 2], new_tokens=4, repeats=2)

    run = ["start a", "start b", "start c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert log == run + run
    assert {name: len(times) for name, times in seconds.items()} == {"a": 6, "b": 6, "c": 6}
    assert tokens["a"] == [[2, 3, 4, 5], [2, 3, 4, 5]]


def test_bad_arguments_and_a_missing_peer_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    harness = load_benchmark("step_pairs")
    for argv, message in [
        (["--new-tokens", "1"], "--new-tokens must be at least 2"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--engines", "strata,strata"], "at least two different engines"),
        (["--engines", "strata"], "at least two different engines"),
        (["--engines", "strata,nope"], "nope"),
    ]:
        with pytest.raises(SystemExit):
            harness.main(argv)
        assert message in capsys.readouterr().err

    monkeypatch.setattr(harness.throughput, "llama_cpp_unavailable", lambda: "not installed here")
    argv = ["--model", "tiny", "--engines", "llama.cpp,strata", "--model-dir", str(tmp_path)]
    assert harness.main(argv) == 2
    err = capsys.readouterr().err
    assert "skipping llama.cpp: not installed here" in err and "fewer than two engines" in err
