"""Plugins: selection by STRATA_PLUGINS, clear errors, once per process; the installed example plugin
loaded, reported as `oot:strata_example` under both layer settings, executed, with unchanged outputs; and the
example platform plugin installed, named as a device, running its ops and its attention backend.

The examples run in subprocesses: a loaded override changes every later model in its process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from strata import LLM, SamplingParams, plugins
from strata.custom_op import CustomOp, op_registry, unregister_oot
from strata.hw_agnostic.layers import GluMLP, SiluAndMul
from strata.hw_agnostic.layers.layernorm import GemmaRMSNorm
from strata.platforms import Platform, register_platform

from example_plugins import install_example


@dataclass
class FakeEntryPoint:
    name: str
    target: Callable[[], None]

    def load(self) -> Callable[[], None]:
        return self.target


@pytest.fixture
def fake_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Three fake installed plugins: `good` registers an override, `other` only records, `broken` raises."""
    calls: list[str] = []

    class CountingGemma(GemmaRMSNorm):
        pass

    def good() -> None:
        calls.append("good")
        CustomOp.register_oot(CountingGemma, name="GemmaRMSNorm")

    def broken() -> None:
        raise ImportError("No module named 'missing_kernels'")

    installed = [FakeEntryPoint("good", good), FakeEntryPoint("other", lambda: calls.append("other"))]
    installed.append(FakeEntryPoint("broken", broken))
    monkeypatch.setattr(plugins, "entry_points", lambda group: installed if group == "strata.plugins" else [])
    monkeypatch.setattr(plugins, "_loaded", None)
    yield calls
    unregister_oot("GemmaRMSNorm")


def test_selected_plugins_load_once_and_their_overrides_name_them(
    fake_plugins: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PLUGINS", "good")
    assert plugins.load_plugins() == ["good"]
    assert plugins.load_plugins() == ["good"]  # once per process
    assert fake_plugins == ["good"]
    override = op_registry["gemma_rms_norm"].oot
    assert override is not None and override.provider == "oot:good"


def test_a_broken_or_missing_plugin_is_named(
    fake_plugins: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PLUGINS", "other,broken")
    with pytest.raises(
        plugins.PluginError, match=r"plugin 'broken' failed to load: No module named 'missing_kernels'"
    ):
        plugins.load_plugins()
    monkeypatch.setenv("STRATA_PLUGINS", "nope")
    with pytest.raises(
        plugins.PluginError, match=r"'nope', which is not installed; installed: broken, good, other"
    ):
        plugins.load_plugins()


def test_non_strict_mode_skips_a_broken_plugin(
    fake_plugins: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("STRATA_PLUGINS")  # unset: every installed plugin
    monkeypatch.setenv("STRATA_PLUGINS_STRICT", "0")
    assert plugins.load_plugins() == ["good", "other"]
    assert "plugin 'broken' failed to load" in caplog.text and "STRATA_PLUGINS_STRICT=0" in caplog.text


EXAMPLE_RUN = textwrap.dedent(
    """
    import json
    import torch
    torch.set_num_threads(1)
    from strata import LLM, SamplingParams
    from strata.models.transformers.layers import verify_layers
    from strata.plugins import load_plugins
    from strata_example_plugin.layers import CountingRMSNorm

    report = {}
    for impl in ("default", "hw-agnostic"):
        llm = LLM(layer_impl=impl, max_model_len=64, max_num_seqs=1)
        params = SamplingParams(temperature=0.0, max_tokens=16)
        output = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
        report[impl] = {
            "text": output.text,
            "rows": llm.layer_providers(),
            "verify": verify_layers(llm.engine.runner.model),
        }
    report["calls"] = CountingRMSNorm.calls
    report["plugins"] = load_plugins()
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def example_plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return install_example("strata-example-plugin", "strata_example", tmp_path_factory.mktemp("plugin-site"))


def test_example_plugin_is_loaded_reported_and_executed(example_plugin_env: dict[str, str]) -> None:
    env = example_plugin_env
    check = [
        sys.executable,
        "-c",
        "from importlib.metadata import entry_points as e; print([p.name for p in e(group='strata.plugins')])",
    ]
    assert (
        "strata_example" in subprocess.run(check, env=env, capture_output=True, text=True, check=True).stdout
    )
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLE_RUN], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plugins"] == ["strata_example"]
    assert report["calls"] > 0
    reference = LLM(max_model_len=64, max_num_seqs=1)  # this process has no plugin loaded
    expected = reference.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
    )
    for impl in ("default", "hw-agnostic"):
        assert report[impl]["text"] == expected[0].outputs[0].text
        norms = [row for row in report[impl]["rows"] if row["op"] == "rms_norm"]
        assert len(norms) == 11
        for row in norms:  # one registry: the override applies whichever provider was resolved
            assert row["provider"] == "oot:strata_example"
            assert row["class"] == "strata_example_plugin.layers.CountingRMSNorm"
            assert row["forward"] == "forward_oot"
        verify = {check["op"]: check["max_abs_diff"] for check in report[impl]["verify"]}
        assert verify["rms_norm"] <= 1e-6
    assert {row["provider"] for row in reference.layer_providers()} == {"cpu"}


def test_a_plugin_activation_keeps_its_glu_mlp_unfused(tiny_model_dir: Callable[[str], Path]) -> None:
    """Strata runs a GLU MLP's projection and activation as one kernel only when both are its own: with a
    plugin's act-and-mul layer, that layer is what runs."""

    class CountingSiluAndMul(SiluAndMul):
        calls = 0

        def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
            type(self).calls += 1
            return self.forward_native(x)

    CustomOp.register_oot(CountingSiluAndMul, name="SiluAndMul")
    try:
        llm = LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True)
        fused = llm.apply_model(
            lambda model: [
                getattr(m, "fused_activation", None) for m in model.modules() if isinstance(m, GluMLP)
            ]
        )
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        unregister_oot("SiluAndMul")
    assert fused and not any(fused)
    assert CountingSiluAndMul.calls >= 2 * len(fused)  # every MLP, in each of the two steps


class BarePlatform(Platform):
    """A plugin's platform with nothing of its own: the base class's hooks (reference layers and attention
    backend, no graph passes, default Inductor options), computing on the CPU device."""

    name = "bare"
    device_type = "cpu"
    forward_method = "forward_bare"

    def available_memory(self, device: torch.device) -> int:
        return 1 << 30


def test_a_platform_without_kernels_compiles_the_reference_path(
    restore_registry: None, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Compiling needs nothing from a platform: one with no kernels runs the hw-agnostic layers through
    Inductor, which generates their math and calls a matmul library for the linears, and gives eager's
    greedy tokens."""
    register_platform(BarePlatform())
    folder = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": [1, 43, 47, 90, 61]}, {"prompt_token_ids": [1, 100]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for compiled_forward in (False, True):
        llm = LLM(folder, device="bare", skip_tokenizer_init=True, compile=compiled_forward)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]
    assert {row["provider"] for row in llm.layer_providers() if row["op"] != "attention"} == {"hw-agnostic"}
    compiled = llm.engine.runner.compiled
    assert compiled is not None and compiled.stats.compiled_cpp_wrapper == 0  # Inductor's default wrapper
    reports = [report for report in compiled.backend.piece_reports.values() if report is not None]
    assert len(reports) == compiled.stats.distinct_pieces > 0
    assert all(report.generated_kernels > 0 for report in reports)
    assert {op for report in reports for op in report.extern_calls} == {"aten::mm"}
    assert "aten::rsqrt" in {op for report in reports for op in report.fused_ops}


EXAMPLE_PLATFORM_RUN = textwrap.dedent(
    """
    import json
    import torch
    torch.set_num_threads(1)
    from strata import LLM, SamplingParams
    from strata.models.transformers.layers import verify_attention, verify_layers
    from strata_example_platform.attention import ExampleAttentionBackend
    from strata_example_platform.layers import ExampleRMSNorm

    llm = LLM(device="example", max_model_len=64, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outputs = llm.generate(["Once upon a time", "Lily had a dog"], params, use_tqdm=False)
    print(json.dumps({
        "texts": [output.outputs[0].text for output in outputs],
        "rows": llm.layer_providers(),
        "verify": verify_layers(llm.engine.runner.model),
        "attention": verify_attention(llm.engine.runner.attn_backend, llm.engine.runner.layers, torch.float32),
        "norm_calls": ExampleRMSNorm.calls,
        "attention_calls": ExampleAttentionBackend.calls,
    }))
    """
)


@pytest.fixture(scope="module")
def example_platform_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("platform-site")
    return install_example("strata-example-platform", "strata_example_platform", site)


def test_example_platform_plugin_runs_its_ops_and_attention_backend(
    example_platform_env: dict[str, str],
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLE_PLATFORM_RUN],
        env=example_platform_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    reference = LLM(max_model_len=64, max_num_seqs=2)  # the CPU platform, in this process
    expected = reference.generate(
        ["Once upon a time", "Lily had a dog"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
    )
    assert report["texts"] == [output.outputs[0].text for output in expected]
    assert report["norm_calls"] > 0 and report["attention_calls"] > 0
    providers = {row["op"]: (row["provider"], row["class"]) for row in report["rows"]}
    assert providers["rms_norm"] == ("example", "strata_example_platform.layers.ExampleRMSNorm")
    assert providers["attention"] == ("example", "strata_example_platform.attention.ExampleAttentionBackend")
    assert providers["linear"] == ("hw-agnostic", "strata.hw_agnostic.layers.linear.Linear")
    assert {row["forward"] for row in report["rows"] if row["op"] == "rms_norm"} == {"forward_example"}
    assert all(check["max_abs_diff"] <= 1e-6 for check in report["verify"])
    # Its attention against the reference backend: float32 math in another order.
    assert report["attention"]["modules"] == 5 and report["attention"]["max_abs_diff"] <= 1e-5


def test_example_platform_is_a_device_on_the_command_line(example_platform_env: dict[str, str]) -> None:
    def strata(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "strata.entrypoints.cli", *args]
        return subprocess.run(command, env=example_platform_env, capture_output=True, text=True, timeout=300)

    story = ["generate", "--prompt", "Once upon a time", "--max-tokens", "12"]
    on_example, on_cpu = strata(*story, "--device", "example"), strata(*story)
    assert on_example.returncode == 0, on_example.stderr
    assert on_example.stdout == on_cpu.stdout and on_example.stdout.startswith("Once upon a time")
    layers = strata("layers", "--device", "example")
    assert "platform: example" in layers.stdout and "ExampleAttentionBackend" in layers.stdout
    unknown = strata(*story, "--device", "tpu")
    assert (
        unknown.returncode == 2
        and "device 'tpu' names no platform; known: cpu, cuda, example" in unknown.stderr
    )
