"""The kernel A/B harness: two renamed builds of the linear kernels in one process, their passes
alternated; the report's ratios from its own pass times; both builds computing the real linear; refusals.

CI never runs the real benchmark; this keeps the script itself from rotting. Its two builds take about a
minute and a half on 2 cores, so one run serves the checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmark_scripts import load_benchmark

REPO_ROOT = Path(__file__).resolve().parents[2]


def _in_git_checkout() -> bool:
    if shutil.which("git") is None or shutil.which("c++") is None:
        return False
    probe = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True)
    return probe.returncode == 0


needs_checkout = pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout and a C++ compiler")


def _run_harness(argv: list[str]) -> tuple[dict[str, Any], str]:
    """The harness run with `argv`, which must succeed: its JSON report and the table printed after it."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert load_benchmark("kernel_ab").main(argv) == 0
    report, end = json.JSONDecoder().raw_decode(stdout.getvalue())
    return report, stdout.getvalue()[end:]


@pytest.fixture(scope="module")
def control_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """HEAD against the working tree on the tiny model: its JSON report and the table printed after it."""
    json_out = tmp_path_factory.mktemp("kernel_ab") / "report.json"
    argv = ["--base", "HEAD", "--model", "tiny", "--rows", "1,9", "--passes", "4", "--warmup", "1"]
    report, table = _run_harness([*argv, "--json-out", str(json_out)])
    assert json.loads(json_out.read_text()) == report
    return report, table


@needs_checkout
def test_report_ratios_come_from_the_alternated_passes(control_run: tuple[dict[str, Any], str]) -> None:
    report, table = control_run
    assert report["candidate"] == "working tree" and report["base"] == "HEAD"
    assert [r["rows"] for r in report["results"]] == [1, 9]
    shape = load_benchmark("throughput").MODEL_SHAPES["tiny"]
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    # q, k, v (kv heads of the same head dim), o, gate-up, down per layer, and the head.
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 2 * inter * hidden + hidden * inter
    params = shape["num_hidden_layers"] * per_layer + vocab * hidden
    for result in report["results"]:
        a, b = result["pass_ms"]["A"], result["pass_ms"]["B"]
        assert len(a) == len(b) == 4 and all(t > 0 for t in a + b)
        assert result["median_ms"] == pytest.approx({"A": statistics.median(a), "B": statistics.median(b)})
        assert result["ratio_a_over_b"] == pytest.approx(statistics.median(a) / statistics.median(b))
        assert result["b_won"] == sum(tb < ta for ta, tb in zip(a, b, strict=True)) / 4
        rows = result["rows"]
        assert result["gflops"]["B"] == pytest.approx(2 * params * rows / statistics.median(b) / 1e6)
        assert result["weight_gbps"]["B"] == pytest.approx(4 * params / statistics.median(b) / 1e6)
    lines = table.strip().splitlines()
    assert lines[0].split("|")[0].strip() == "rows"
    assert [line.split("|")[0].strip() for line in lines[2:]] == ["1", "9"]


@needs_checkout
@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_each_build_computes_the_linear_layers(
    control_run: tuple[dict[str, Any], str], variant: str, rows: int
) -> None:
    """Each renamed build loaded side by side is the real kernel: its linear, group and GLU against torch."""
    report, _ = control_run
    ops = getattr(torch.ops, report["op_namespaces"][variant])
    assert ops.name != "strata_cpu"
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator)
    weights = [torch.randn(n, 64, generator=generator) / 8 for n in (48, 16, 16)]
    gate_up = torch.randn(256, 64, generator=generator) / 8
    packed = [ops.prepack_linear_weight(w) for w in weights], ops.prepack_glu_weight(gate_up, "silu")
    bias = torch.randn(48, generator=generator)
    expected_group = torch.cat([x @ w.T for w in weights], dim=1)
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(ops.linear(x, weights[0], None, bias), x @ weights[0].T + bias, **close)
    torch.testing.assert_close(ops.linear_group(x, weights), expected_group, **close)
    gate, up = (x @ gate_up.T).chunk(2, dim=1)
    glu = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ops.linear_glu(x, gate_up, "silu"), glu, **close)
    del packed


@needs_checkout
def test_aten_stands_in_for_a_build_and_agrees_with_strata() -> None:
    """`--base aten` times ATen's linear against the working tree's build: the harness checks that both
    compute the same layers before timing (a disagreement fails the run), and A is no build."""
    argv = ["--base", "aten", "--model", "tiny", "--rows", "1,9", "--passes", "2", "--warmup", "0"]
    report, _ = _run_harness(argv)
    assert report["base"] == "aten" and report["op_namespaces"]["A"] == "aten"
    assert report["op_namespaces"]["B"].startswith("strata_ab_b_")
    for result in report["results"]:
        a, b = result["pass_ms"]["A"], result["pass_ms"]["B"]
        assert result["ratio_a_over_b"] == pytest.approx(statistics.median(a) / statistics.median(b))


def test_aten_linear_is_torch_linear_with_the_glu_halves_in_order() -> None:
    aten = load_benchmark("kernel_ab").AtenLinear()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=generator)
    weights = [torch.randn(n, 16, generator=generator) for n in (8, 4)]
    torch.testing.assert_close(aten.linear_group(x, weights), torch.cat([x @ w.T for w in weights], dim=1))
    gate_up = torch.randn(12, 16, generator=generator)
    gate, up = x @ gate_up[:6].T, x @ gate_up[6:].T
    torch.testing.assert_close(aten.linear_glu(x, gate_up, "silu"), torch.nn.functional.silu(gate) * up)
    assert aten.prepack_linear_weight(gate_up) is None


def test_unknown_revision_is_refused_before_any_build(capsys: pytest.CaptureFixture[str]) -> None:
    harness = load_benchmark("kernel_ab")
    if shutil.which("git") is None:
        pytest.skip("needs git")
    assert harness.main(["--base", "no-such-revision", "--model", "tiny", "--passes", "1"]) == 1
    err = capsys.readouterr().err
    assert "no kernel sources at revision 'no-such-revision'" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--rows", "1,x"],
        ["--rows", "0"],
        ["--passes", "0"],
        ["--layers", "0"],
        ["--threads", "0"],
        ["--model", "nope"],
        ["--kernel", "nope"],
        ["--kernel", "attention", "--context", "0"],
        ["--kernel", "attention", "--kv-dtype", "int8"],
        ["--kernel", "attention", "--base", "aten"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    harness = load_benchmark("kernel_ab")
    with pytest.raises(SystemExit) as exit_info:
        harness.main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """HEAD against the working tree for the decode-attention kernel on the tiny model's layers, float16
    caches: its JSON report and the table printed after it."""
    argv = ["--kernel", "attention", "--base", "HEAD", "--model", "tiny", "--rows", "1,5", "--context", "40"]
    return _run_harness([*argv, "--kv-dtype", "float16", "--passes", "4", "--warmup", "1"])


@needs_checkout
def test_attention_report_rates_come_from_the_kv_bytes_and_the_alternated_passes(
    attention_run: tuple[dict[str, Any], str],
) -> None:
    report, table = attention_run
    assert (report["kernel"], report["context"], report["kv_dtype"]) == ("attention", 40, "float16")
    shape = load_benchmark("throughput").MODEL_SHAPES["tiny"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    for result, rows in zip(report["results"], [1, 5], strict=True):
        a, b = result["pass_ms"]["A"], result["pass_ms"]["B"]
        assert (result["rows"], result["context"]) == (rows, 40) and len(a) == len(b) == 4
        assert result["ratio_a_over_b"] == pytest.approx(statistics.median(a) / statistics.median(b))
        # Keys and values of every sequence's 40 tokens in every layer, 2 bytes each.
        kv_bytes = 2 * rows * 40 * shape["num_key_value_heads"] * head_dim * 2 * shape["num_hidden_layers"]
        assert result["kv_gbps"]["B"] == pytest.approx(kv_bytes / statistics.median(b) / 1e6)
    lines = table.strip().splitlines()
    assert "B KV GB/s" in lines[0]
    assert [line.split("|")[0].strip() for line in lines[2:]] == ["1", "5"]


@needs_checkout
@pytest.mark.parametrize("variant", ["A", "B"])
def test_each_attention_build_attends_the_harness_caches_as_the_reference_does(
    attention_run: tuple[dict[str, Any], str], variant: str
) -> None:
    """The harness's caches are paged caches as the engine lays them out (each sequence's blocks `rows`
    apart), and each renamed build attends them as Strata's pure-PyTorch decode attention does."""
    from strata.attention.backends import torch_native

    report, _ = attention_run
    harness = load_benchmark("kernel_ab")
    ops = getattr(torch.ops, report["op_namespaces"][variant])
    shape = load_benchmark("throughput").MODEL_SHAPES["tiny"]
    step = harness.attention_step(shape, 3, 40, torch.float32)
    assert step.tables.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    for layer, cache in enumerate(step.caches):
        expected = torch_native._decode_attention(
            step.query, cache[0], cache[1], step.tables, step.lens, step.scale, 0.0, 0
        )
        torch.testing.assert_close(harness.attend(ops, step, layer), expected, rtol=1e-5, atol=1e-5)
