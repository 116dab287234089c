"""The on-disk cache of compiled pieces, and the compilation switches' environment defaults."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from strata import LLM, SamplingParams
from strata.atomic_file import write_atomically
from strata.compilation.compiler import cache_key
from strata.compilation.layer_name import HAS_OPAQUE_TYPE, LayerName
from strata.config import CompilationConfig, ConfigError, EngineConfig, ModelConfig
from strata.entrypoints.llm import default_model
from strata.platforms.cpu import kernels as cpu_kernels

PROMPT = {"prompt_token_ids": [1, 43, 47, 90, 61]}
PARAMS = SamplingParams(temperature=0, max_tokens=8)


def _compiled_llm(cache_dir: Path, mode: str) -> LLM:
    return LLM(
        skip_tokenizer_init=True, compile=True, compilation_config={"cache_dir": str(cache_dir), "mode": mode}
    )


@pytest.mark.skipif(not HAS_OPAQUE_TYPE, reason="needs PyTorch opaque types (>= 2.11)")
@pytest.mark.parametrize(
    ("mode", "trace_file"), [("model", "strata_forward-0.dynamo"), ("layer", "strata_layer_forward-0.dynamo")]
)
def test_second_start_loads_every_piece_with_zero_inductor_compilations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, trace_file: str
) -> None:
    first = _compiled_llm(tmp_path, mode)
    expected = first.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    # Guards are skipped after the first trace (the default): batch sizes 3, 2, 1 still match eager.
    prompts = [{"prompt_token_ids": [1, *range(40, 40 + n)]} for n in (3, 9, 5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6, 3)]
    eager = LLM(skip_tokenizer_init=True).generate(prompts, params, use_tqdm=False)
    compiled = first.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    assert first.engine.runner.compiled.stats.dynamo_graphs == 1  # type: ignore[union-attr]
    stats = first.engine.runner.compiled.stats  # type: ignore[union-attr]
    assert stats.compiled == stats.distinct_pieces and stats.loaded == 0
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert len([name for name in files if name.endswith(".bin")]) == stats.distinct_pieces
    assert [name for name in files if not name.endswith(".bin")] == [trace_file]

    misses = counters["inductor"]["fxgraph_cache_miss"]
    caplog.set_level("INFO", logger="strata.compilation")
    caplog.clear()  # the first engine's summary too, where an earlier test left the logger at INFO
    second = _compiled_llm(tmp_path, mode)
    assert second.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == expected
    stats = second.engine.runner.compiled.stats  # type: ignore[union-attr]
    # Neither Dynamo nor Inductor runs: the saved trace and its pieces are loaded.
    assert stats.dynamo_graphs == 0 and stats.compiled == 0 and stats.loaded == stats.distinct_pieces
    assert counters["inductor"]["fxgraph_cache_miss"] == misses
    summary = [r.getMessage() for r in caplog.records if "pieces" in r.getMessage()]
    assert len(summary) == 1 and f"0 compiled, {stats.distinct_pieces} loaded from cache" in summary[0]
    # What Inductor made of each piece comes with it from disk, logged once per piece.
    reports = second.engine.runner.compiled.backend.piece_reports  # type: ignore[union-attr]
    assert reports == first.engine.runner.compiled.backend.piece_reports  # type: ignore[union-attr]
    assert all(report is not None for report in reports.values())
    logged = [r.getMessage() for r in caplog.records if "extern calls" in r.getMessage()]
    assert sorted(logged) == sorted(report.describe() for report in reports.values() if report is not None)


def test_disable_compile_cache_env_and_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STRATA_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("STRATA_DISABLE_COMPILE_CACHE", "1")
    config = CompilationConfig()
    assert config.use_cache is False and config.cache_dir == str(tmp_path / "compile")
    monkeypatch.delenv("STRATA_DISABLE_COMPILE_CACHE")
    assert CompilationConfig().use_cache is True


def test_use_layer_name_is_read_per_engine_not_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The env var only sets the default, read whenever a config is made, so it can change late."""
    monkeypatch.setenv("STRATA_USE_LAYERNAME", "0")
    assert CompilationConfig().use_layer_name is False
    off = LLM(skip_tokenizer_init=True)
    monkeypatch.setenv("STRATA_USE_LAYERNAME", "1")
    assert CompilationConfig().use_layer_name is HAS_OPAQUE_TYPE
    on = LLM(skip_tokenizer_init=True)

    def names(llm: LLM) -> list[Any]:
        return llm.apply_model(
            lambda model: [m.strata_layer_name for m in model.modules() if hasattr(m, "strata_layer_name")]
        )

    assert all(isinstance(name, str) for name in names(off))
    assert all(isinstance(name, LayerName) == HAS_OPAQUE_TYPE for name in names(on))
    tokens = [llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for llm in (off, on)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"use_layer_name": "yes"}, "use_layer_name"),
        ({"passes": {"no_such_pass": True}}, "passes"),
        ({"compile_everything": True}, "compilation_config"),
    ],
)
def test_bad_compilation_config_names_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        LLM(skip_tokenizer_init=True, compilation_config=config)


def _fail_to_save(path: str) -> None:
    Path(path).write_bytes(b"partial")
    raise OSError("disk full")


def _save_whole(path: str) -> None:
    Path(path).write_bytes(b"whole")


def test_cache_writes_are_atomic(tmp_path: Path) -> None:
    """Readers see a whole file or none: a failed write leaves nothing, not even its temporary file."""
    target = tmp_path / "piece.bin"
    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, _fail_to_save)
    assert os.listdir(tmp_path) == []
    write_atomically(target, _save_whole)
    write_atomically(target, _save_whole)  # a second engine finishing the same piece later
    assert os.listdir(tmp_path) == ["piece.bin"] and target.read_bytes() == b"whole"


def test_layer_name_wraps_a_string() -> None:
    from strata.compilation.layer_name import encode_layer_name, resolve_layer_name

    assert (
        resolve_layer_name(encode_layer_name("model.layers.0.self_attn", True)) == "model.layers.0.self_attn"
    )
    assert encode_layer_name("a", False) == "a"
    assert LayerName("a") == LayerName("a") and hash(LayerName("a")) == hash(LayerName("a"))
    assert LayerName("a") != LayerName("b") and LayerName("a") != "a"
    with pytest.raises(TypeError, match="LayerName value"):
        LayerName(3)  # type: ignore[arg-type]
    assert torch.ops.strata.attention_str.default._schema.arguments[3].type.str() == "str"


@pytest.mark.skipif(not HAS_OPAQUE_TYPE, reason="needs PyTorch opaque types (>= 2.11)")
def test_unreadable_saved_trace_is_traced_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A damaged trace file costs a new trace (with a warning), never a failed start or wrong output."""
    expected = (
        _compiled_llm(tmp_path, "model").generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    )
    (trace,) = tmp_path.rglob("*.dynamo")
    trace.write_bytes(b"not a trace")
    caplog.set_level("WARNING", logger="strata.compilation")
    again = _compiled_llm(tmp_path, "model")
    assert again.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == expected
    stats = again.engine.runner.compiled.stats  # type: ignore[union-attr]
    assert stats.dynamo_graphs == 1 and stats.compiled == 0
    assert any("could not load the saved trace" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="Inductor probes ISAs only on x86")
def test_instruction_set_check_is_recorded_and_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first process records which SIMD instruction sets passed Inductor's probes; a later one, finding
    every candidate passed, sets Inductor's own switch instead of probing again."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    from strata.platforms.cpu import inductor as warmup

    monkeypatch.setenv("STRATA_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", None)
    warmup.check_instruction_sets()
    (record,) = (tmp_path / "inductor").glob("vec-isa-*.json")
    passed = json.loads(record.read_text())["passed"]
    assert passed == [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    assert inductor_config.cpp.vec_isa_ok is None  # the first process probed
    warmup.check_instruction_sets()
    assert inductor_config.cpp.vec_isa_ok is (True if passed == warmup._candidates() else None)
    warmup.InductorWarmup().wait()  # the engine's way: on a thread, whose setting stays its own


def test_cache_key_changes_with_the_kernel_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved pieces call Strata's kernel ops with the schemas of the sources they were compiled against: a
    changed kernel source must not load them (a changed return type would break the call)."""
    config = EngineConfig(ModelConfig(default_model()))
    key = cache_key(config)
    assert cache_key(config) == key
    monkeypatch.setattr(cpu_kernels, "sources_digest", lambda: "another-source")
    assert cache_key(config) != key
