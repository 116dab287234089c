"""The throughput harness end to end on a tiny model: JSON report, ratios, greedy check and tables, plus
its roofline measurement, limit fractions, prefill section and the llama.cpp peer's GGUF writer and glue.

CI never runs the real benchmark; this keeps the script itself from rotting.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from benchmark_scripts import load_benchmark

# Roofline measurements small enough for a test (the real ones take a few seconds).
SMALL_ROOFLINE = {"read_bytes": 8 * 2**20, "matmul_n": 256, "repeats": 2}


def _small_roofline(harness: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        harness, "measure_roofline", functools.partial(harness.measure_roofline, **SMALL_ROOFLINE)
    )


def _table_rows(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")] for line in lines]


def test_tiny_run_reports_rows_ratios_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = load_benchmark("throughput")
    _small_roofline(harness, monkeypatch)
    json_out = tmp_path / "report.json"
    argv = ["--models", "tiny", "--engines", "strata,transformers", "--concurrency", "1,2"]
    argv += ["--new-tokens", "4", "--repeats", "1", "--prefill-len", "64"]
    argv += ["--model-dir", str(tmp_path / "models"), "--json-out", str(json_out)]

    assert harness.main(argv) == 0

    stdout = capsys.readouterr().out
    report, end = json.JSONDecoder().raw_decode(stdout)
    assert json.loads(json_out.read_text()) == report
    assert {"cpu_model", "cpu_count", "torch", "transformers", "date"} <= report["machine"].keys()
    roofline = report["machine"]["roofline"]
    for key in ("memory_read_gb_s", "matmul_fp32_gflop_s", "matmul_bf16_gflop_s"):
        assert roofline[key] > 0
    assert roofline["threads"] == torch.get_num_threads()
    # Measured before the first model and after the last; each limit is the better of the two.
    measurements = report["machine"]["roofline_measurements"]
    assert len(measurements) == 2
    for key in ("memory_read_gb_s", "matmul_fp32_gflop_s", "matmul_fp32_best_gflop_s", "matmul_bf16_gflop_s"):
        assert roofline[key] == max(measured[key] for measured in measurements)

    weights = report["models"]["tiny"]
    assert weights["matmul_params"] == _tiny_matmul_params(harness.MODEL_SHAPES["tiny"])
    assert weights["fp32_bandwidth_limit_tok_s"] == pytest.approx(
        roofline["memory_read_gb_s"] * 1e9 / (4 * weights["matmul_params"])
    )

    rows = {(row["concurrency"], row["engine"]): row for row in report["results"]}
    assert set(rows) == {(c, e) for c in (1, 2) for e in ("strata", "transformers")}
    for (concurrency, _), row in rows.items():
        assert row["model"] == "tiny"
        assert len(row["runs_s"]) == 1 and row["median_s"] == row["runs_s"][0] > 0
        assert row["tokens_per_s"] == pytest.approx(row["concurrency"] * 4 / row["median_s"])
        assert row["params"] == weights["matmul_params"]
        assert row["weight_bytes"] == 4 * weights["matmul_params"]
        assert row["flop_fraction"] == pytest.approx(
            row["tokens_per_s"] * 2 * row["params"] / (roofline["matmul_fp32_gflop_s"] * 1e9)
        )
        assert row["flop_fraction_best"] == pytest.approx(
            row["tokens_per_s"] * 2 * row["params"] / (roofline["matmul_fp32_best_gflop_s"] * 1e9)
        )
        # Each sequence: its prompt and 4 generated tokens; all but the last through the layers, 4 through the head.
        head = weights["head_params"]
        flops = concurrency * 2 * ((row["params"] - head) * (harness.PROMPT_LEN + 4 - 1) + head * 4)
        assert row["work_flop_fraction"] == pytest.approx(
            flops / row["median_s"] / (roofline["matmul_fp32_gflop_s"] * 1e9)
        )
        assert row["total_tokens_per_s"] == pytest.approx(
            concurrency * (harness.PROMPT_LEN + 4) / row["median_s"]
        )
        bound = harness.roofline_seconds(row["engine"], weights, roofline, concurrency, harness.PROMPT_LEN, 4)
        assert row["roofline_fraction"] == pytest.approx(bound / row["median_s"])
        if concurrency == 1:
            assert row["bw_fraction"] == pytest.approx(
                row["tokens_per_s"] * row["weight_bytes"] / (roofline["memory_read_gb_s"] * 1e9)
            )
        else:
            assert row["bw_fraction"] is None

    ratios = {row["concurrency"]: row for row in report["ratios"]}
    assert set(ratios) == {1, 2}
    for concurrency, row in ratios.items():
        expected = rows[concurrency, "transformers"]["median_s"] / rows[concurrency, "strata"]["median_s"]
        assert row["ratio"] == pytest.approx(expected)
    assert isinstance(ratios[1]["greedy_match"], bool)
    assert "greedy_match" not in ratios[2]

    prefill = {row["engine"]: row for row in report["prefill"]}
    assert set(prefill) == {"strata", "transformers"}
    for row in prefill.values():
        assert row["prompt_len"] == 64 and len(row["runs_s"]) == 1
        assert row["prompt_tokens_per_s"] == pytest.approx(64 / row["median_s"])
        assert row["flop_fraction"] > 0
        # The prompt's 64 positions through the layers, the last one's through the head too.
        flops = 2 * ((row["params"] - weights["head_params"]) * 64 + weights["head_params"])
        assert row["work_flop_fraction"] == pytest.approx(
            flops / row["median_s"] / (roofline["matmul_fp32_gflop_s"] * 1e9)
        )
    (prefill_ratio,) = report["prefill_ratios"]
    assert prefill_ratio["engine"] == "strata" and prefill_ratio["baseline"] == "transformers"
    assert prefill_ratio["ratio"] == pytest.approx(
        prefill["transformers"]["median_s"] / prefill["strata"]["median_s"]
    )
    assert isinstance(prefill_ratio["greedy_match"], bool)

    text = stdout[end:].strip()
    assert text.startswith("roofline (")
    table = text.splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("model | concurrency"))
    decode = _table_rows(table[start : start + 6])
    assert decode[0] == [
        "model",
        "concurrency",
        "engine",
        "tok/s",
        "vs transformers",
        "bw%",
        "flop%",
        "flop%best",
        "flop%work",
        "roof%",
    ]
    assert [row[1:3] for row in decode[2:]] == [
        ["1", "strata"],
        ["1", "transformers"],
        ["2", "strata"],
        ["2", "transformers"],
    ]
    assert all(row[0] == "tiny" for row in decode[2:])
    assert decode[2][4] == f"{ratios[1]['ratio']:.2f}" and decode[3][4] == "-"
    assert decode[2][5] != "-" and decode[4][5] == "-"  # bw% only at batch 1
    prefill_start = next(i for i, line in enumerate(table) if line.startswith("model | prompt"))
    prefill_table = _table_rows(table[prefill_start : prefill_start + 4])
    assert prefill_table[0] == [
        "model",
        "prompt",
        "engine",
        "prompt tok/s",
        "vs transformers",
        "flop%",
        "flop%best",
        "flop%work",
    ]
    assert [row[:3] for row in prefill_table[2:]] == [
        ["tiny", "64", "strata"],
        ["tiny", "64", "transformers"],
    ]


def test_prefill_off_and_llama_cpp_skipped_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = load_benchmark("throughput")
    _small_roofline(harness, monkeypatch)
    monkeypatch.setattr(harness, "llama_cpp_unavailable", lambda: "not installed")
    assert harness.LLAMA_CPP in harness.DEFAULT_ENGINES
    argv = ["--models", "tiny", "--concurrency", "1", "--new-tokens", "2", "--repeats", "1"]
    argv += ["--prefill-len", "0", "--model-dir", str(tmp_path / "models")]

    assert harness.main(argv) == 0

    captured = capsys.readouterr()
    report, end = json.JSONDecoder().raw_decode(captured.out)
    assert "note: skipping llama.cpp: not installed" in captured.err
    assert report["settings"]["skipped_engines"] == {"llama.cpp": "not installed"}
    assert report["settings"]["engines"] == ["strata", "transformers"]
    assert {row["engine"] for row in report["results"]} == {"strata", "transformers"}
    assert report["prefill"] == [] and report["prefill_ratios"] == []
    assert "model | prompt" not in captured.out[end:]


def test_prefill_len_must_fit_the_models(capsys: pytest.CaptureFixture[str]) -> None:
    harness = load_benchmark("throughput")
    too_long = harness.MODEL_SHAPES["tiny"]["max_position_embeddings"]
    with pytest.raises(SystemExit):
        harness.parse_args(["--models", "tiny", "--prefill-len", str(too_long)])
    assert "max_position_embeddings" in capsys.readouterr().err
    assert harness.parse_args(["--models", "tiny"]).prefill_len == harness.DEFAULT_PREFILL_LEN
    assert (
        min(s["max_position_embeddings"] for s in harness.MODEL_SHAPES.values())
        >= harness.DEFAULT_PREFILL_LEN + 1
    )


def test_best_roofline_takes_each_rate_at_its_best_and_keeps_the_rest() -> None:
    harness = load_benchmark("throughput")
    first = {
        "threads": 2,
        "memory_read_gb_s": 30.0,
        "matmul_fp32_gflop_s": 138.0,
        "matmul_fp32_onednn_gflop_s": None,
    }
    second = {
        "threads": 2,
        "memory_read_gb_s": 25.0,
        "matmul_fp32_gflop_s": 190.0,
        "matmul_fp32_onednn_gflop_s": 207.0,
    }
    assert harness.best_roofline([first, second]) == {
        "threads": 2,
        "memory_read_gb_s": 30.0,
        "matmul_fp32_gflop_s": 190.0,
        "matmul_fp32_onednn_gflop_s": 207.0,
    }
    assert harness.best_roofline([second, first])["matmul_fp32_onednn_gflop_s"] == 207.0
    assert first["matmul_fp32_gflop_s"] == 138.0  # the measurements themselves are left as measured


def test_roofline_measures_bandwidth_and_matmul_rates() -> None:
    harness = load_benchmark("throughput")
    roofline = harness.measure_roofline(**SMALL_ROOFLINE)
    assert roofline["threads"] == torch.get_num_threads()
    assert roofline["read_bytes"] == SMALL_ROOFLINE["read_bytes"] and roofline["matmul_n"] == 256
    for key in ("memory_read_gb_s", "matmul_fp32_gflop_s", "matmul_bf16_gflop_s"):
        assert 0 < roofline[key] < 1e6
    onednn = roofline["matmul_fp32_onednn_gflop_s"]
    assert onednn is None or 0 < onednn < 1e6
    assert roofline["matmul_fp32_best_gflop_s"] == max(roofline["matmul_fp32_gflop_s"], onednn or 0)
    line = harness.format_roofline(roofline)
    assert "GB/s" in line and "fp32 matmul" in line and "bf16 matmul" in line


def _tiny_matmul_params(shape: dict[str, Any]) -> int:
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    return shape["num_hidden_layers"] * layer + hidden + vocab * hidden


def test_model_weights_counts_params_and_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harness = load_benchmark("throughput")
    shape = harness.MODEL_SHAPES["tiny"]
    monkeypatch.setitem(harness.MODEL_SHAPES, "tiny-tied", {**shape, "tie_word_embeddings": True})
    embedding = shape["vocab_size"] * shape["hidden_size"]
    matmul = _tiny_matmul_params(shape)

    # A key and a value per layer and KV head, head_dim wide.
    kv_values = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"]
    kv_values *= shape["hidden_size"] // shape["num_attention_heads"]

    untied = harness.model_weights(harness.ensure_model_folder("tiny", tmp_path))
    assert untied == {
        "params": matmul + embedding,
        "bytes": 4 * (matmul + embedding),
        "matmul_params": matmul,
        "matmul_bytes": 4 * matmul,
        "head_params": embedding,
        "kv_values_per_token": kv_values,
    }
    # A tied table is stored once and read per token as the head.
    tied = harness.model_weights(harness.ensure_model_folder("tiny-tied", tmp_path))
    assert tied == {
        "params": matmul,
        "bytes": 4 * matmul,
        "matmul_params": matmul,
        "matmul_bytes": 4 * matmul,
        "head_params": embedding,
        "kv_values_per_token": kv_values,
    }


@pytest.mark.parametrize(
    ("engine", "weight_bytes", "kv_bytes"), [("strata", 4, 4), ("strata-compiled-kv16", 4, 2)]
)
def test_roofline_seconds_meets_each_limit_alone_and_the_longer_of_both(
    tmp_path: Path, engine: str, weight_bytes: int, kv_bytes: int
) -> None:
    """With memory far faster than the matmuls, the bound is the run's FLOPs (`work_flops`) at the matmul
    rate; with matmuls far faster, every step's reads at the memory's rate: the weights once a step, and
    each decode step every sequence's cache so far (an arithmetic series, summed here in closed form). With
    both finite it is at least either and at most their sum."""
    harness = load_benchmark("throughput")
    weights = harness.model_weights(harness.ensure_model_folder("tiny", tmp_path))
    sequences, prompt, new = 3, 7, 5
    fast, slow = 1e12, 1.0  # GB/s or GFLOP/s

    def bound(memory: float, matmul: float) -> float:
        roofline = {"memory_read_gb_s": memory, "matmul_fp32_gflop_s": matmul, "matmul_bf16_gflop_s": fast}
        return harness.roofline_seconds(engine, weights, roofline, sequences, prompt, new)

    compute = harness.work_flops(weights, sequences, prompt, new) / 1e9
    assert bound(fast, slow) == pytest.approx(compute)
    contexts = sum(range(prompt + 1, prompt + new))  # tokens cached after each decode step
    reads = (
        new * weight_bytes * weights["matmul_params"]
        + sequences * contexts * kv_bytes * weights["kv_values_per_token"]
    )
    assert bound(slow, fast) == pytest.approx(reads / 1e9)
    both = bound(slow, slow)
    assert max(compute, reads / 1e9) * (1 - 1e-9) <= both <= (compute + reads / 1e9) * (1 + 1e-9)


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_writer_round_trips_through_stratas_converter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool
) -> None:
    """Strata's GGUF converter (which undoes llama.cpp's names and Q/K rotary row order) must give back the
    very tensors the harness wrote: that proves the writer's names and permutation are llama.cpp's."""
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    from strata.converters.gguf import convert_gguf

    harness = load_benchmark("throughput")
    name = "tiny-tied" if tied else "tiny"
    shape = {**harness.MODEL_SHAPES["tiny"], "tie_word_embeddings": tied}
    monkeypatch.setitem(harness.MODEL_SHAPES, name, shape)
    folder = harness.ensure_model_folder(name, tmp_path / "models")

    gguf_path = harness.ensure_gguf(folder)
    assert gguf_path == folder / harness.GGUF_NAME
    stamp = gguf_path.stat().st_mtime_ns
    assert harness.ensure_gguf(folder) == gguf_path and gguf_path.stat().st_mtime_ns == stamp

    reader = GGUFReader(gguf_path)
    gguf_tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in gguf_tensors) is not tied
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"} <= set(
        gguf_tensors
    )
    assert all(t.tensor_type.name == "F32" for t in reader.tensors)
    original = load_file(folder / "model.safetensors")
    # The Q rows are in llama.cpp's rotary order, not HF's.
    q = np.asarray(gguf_tensors["blk.0.attn_q.weight"].data).reshape(
        original["model.layers.0.self_attn.q_proj.weight"].shape
    )
    assert not np.array_equal(q, original["model.layers.0.self_attn.q_proj.weight"])

    back = convert_gguf(gguf_path, tmp_path / "back")
    converted = load_file(back / "model.safetensors")
    assert sorted(converted) == sorted(original)
    for key, tensor in original.items():
        np.testing.assert_array_equal(converted[key], tensor, err_msg=key)
    config = json.loads((back / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert config[key] == shape[key]
    assert config["num_key_value_heads"] == shape["num_key_value_heads"]
    assert config["vocab_size"] == shape["vocab_size"]
    assert config["max_position_embeddings"] == shape["max_position_embeddings"]
    assert config["rms_norm_eps"] == shape["rms_norm_eps"]
    assert config["tie_word_embeddings"] is tied


class _FakeLlama:
    """Stands in for llama_cpp.Llama: records its arguments and yields prompt-derived tokens forever."""

    instances: ClassVar[list[_FakeLlama]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.resets = 0
        self.prompts: list[list[int]] = []
        _FakeLlama.instances.append(self)

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens: list[int], **kwargs: Any) -> Iterator[int]:
        assert kwargs["temp"] == 0.0 and kwargs["top_k"] == 1 and kwargs["repeat_penalty"] == 1.0
        self.prompts.append(list(tokens))
        token = tokens[-1]
        while True:
            token = (token * 7 + 1) % 256
            yield token


def test_llama_cpp_engine_runs_prompts_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = load_benchmark("throughput")
    monkeypatch.setitem(sys.modules, "llama_cpp", SimpleNamespace(Llama=_FakeLlama))
    _FakeLlama.instances.clear()
    assert harness.llama_cpp_unavailable() is None
    folder = harness.ensure_model_folder("tiny", tmp_path)

    generate = harness.ENGINES["llama.cpp"](folder, harness.Limits(max_batch=2, max_len=40))

    (llm,) = _FakeLlama.instances
    assert llm.kwargs["model_path"] == str(folder / harness.GGUF_NAME)
    assert llm.kwargs["n_ctx"] == 40 and llm.kwargs["logits_all"] is False
    assert llm.kwargs["n_threads"] == torch.get_num_threads()
    seconds, outputs = generate([[5, 6], [7, 8, 9]], 3)
    assert seconds >= 0
    assert llm.prompts == [[5, 6], [7, 8, 9]] and llm.resets == 2
    assert outputs == [[43, 46, 67], [64, 193, 72]]


def test_model_folders_are_cached_and_deterministic(tmp_path: Path) -> None:
    harness = load_benchmark("throughput")
    folder = harness.ensure_model_folder("tiny", tmp_path / "a")
    weights = folder / "model.safetensors"
    assert (folder / "config.json").is_file() and weights.is_file()
    stamp = weights.stat().st_mtime_ns
    assert harness.ensure_model_folder("tiny", tmp_path / "a") == folder
    assert weights.stat().st_mtime_ns == stamp
    rebuilt = harness.ensure_model_folder("tiny", tmp_path / "b") / "model.safetensors"
    assert rebuilt.read_bytes() == weights.read_bytes()


def test_model_folder_with_an_older_shape_is_rebuilt(tmp_path: Path) -> None:
    harness = load_benchmark("throughput")
    folder = harness.ensure_model_folder("tiny", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    assert harness.ensure_model_folder("tiny", tmp_path) == folder
    rebuilt = json.loads((folder / "config.json").read_text())
    assert rebuilt["max_position_embeddings"] == harness.MODEL_SHAPES["tiny"]["max_position_embeddings"]
