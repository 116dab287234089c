"""Plugins: selection by STRATA_PLUGINS, clear errors, once per process; and the installed example plugin
loaded, reported as `oot:strata_example` under both providers, executed, with unchanged outputs.

The example plugin runs in a subprocess: a loaded override changes every later model in its process.
"""

from __future__ import annotations

import json
import os
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
from strata.layers.activation import SiluAndMul
from strata.layers.layernorm import GemmaRMSNorm
from strata.layers.mlp import GluMLP


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
    assert op_registry["GemmaRMSNorm"].oot_source == "good"
    assert type(GemmaRMSNorm(4)).provider == "oot:good"


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


EXAMPLE_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "strata-example-plugin"

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
def example_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin pip-installed into a folder of its own, as a user would install it.

    Installing it into the test venv itself would make it override the layers of every later `strata`
    command run there (`make run` included); a separate site folder on PYTHONPATH keeps it to the
    subprocess that asks for it.
    """
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(EXAMPLE_PLUGIN),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return site


def test_example_plugin_is_loaded_reported_and_executed(example_plugin_site: Path) -> None:
    env = {**os.environ, "STRATA_PLUGINS": "strata_example", "PYTHONPATH": str(example_plugin_site)}
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
    assert {row["provider"] for row in reference.layer_providers()} == {"default"}


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
            lambda model: [m.fused_activation for m in model.modules() if isinstance(m, GluMLP)]
        )
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        unregister_oot("SiluAndMul")
    assert fused and not any(fused)
    assert CountingSiluAndMul.calls >= 2 * len(fused)  # every MLP, in each of the two steps
