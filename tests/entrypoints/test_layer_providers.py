"""End to end: default and hw-agnostic layers give the same greedy tokens and top-5 logprobs, two engines
with different providers live in one process, and `layer_providers()` reports what each one runs."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata import LLM, SamplingParams

STEPS = 32
TOP = 5
MODELS = ["bundled", "llama", "qwen3", "gemma", "gemma3"]


def _folder(name: str, tiny_model_dir: Callable[[str], Path], bundled_model_dir: Path) -> Path:
    return bundled_model_dir if name == "bundled" else tiny_model_dir(name)


def _run(llm: LLM, prompt: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


def _expected_providers(layer_impl: str) -> dict[str, str]:
    layers = "hw-agnostic" if layer_impl == "hw-agnostic" else "cpu"
    return {
        "rms_norm": layers,
        "gemma_rms_norm": layers,
        "silu_and_mul": layers,
        "gelu_and_mul": layers,
        "linear": layers,
        "glu_mlp": layers,
        "attention": layers,  # hw-agnostic layers come with the reference attention backend
    }


@pytest.mark.parametrize("name", MODELS)
def test_default_and_hw_agnostic_agree(
    name: str, tiny_model_dir: Callable[[str], Path], bundled_model_dir: Path
) -> None:
    folder = str(_folder(name, tiny_model_dir, bundled_model_dir))
    engines = {
        impl: LLM(folder, skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2, layer_impl=impl)
        for impl in ("default", "hw-agnostic")
    }
    vocab = engines["default"].engine.vocab_size
    prompt = torch.randint(3, vocab, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    results = {impl: _run(llm, prompt) for impl, llm in engines.items()}

    tokens, logprobs = results["default"]
    hw_tokens, hw_logprobs = results["hw-agnostic"]
    assert tokens == hw_tokens and len(tokens) == STEPS
    for step, hw_step in zip(logprobs, hw_logprobs, strict=True):
        assert step.keys() == hw_step.keys()  # the same top-5 tokens
        assert max(abs(step[token] - hw_step[token]) for token in step) <= 1e-4

    for impl, llm in engines.items():
        rows = llm.layer_providers()
        num_layers = llm.engine.config.model_config.text_config.num_hidden_layers
        expected = _expected_providers(impl)
        assert {row["op"]: row["provider"] for row in rows} == {
            op: expected[op] for op in {row["op"] for row in rows}
        }
        ops = Counter(row["op"] for row in rows)
        assert ops["glu_mlp"] == num_layers
        assert ops["rms_norm"] + ops["gemma_rms_norm"] >= 2 * num_layers + 1
        by_path = {row["module"]: row for row in rows}
        mlp = by_path["model.layers.0.mlp"]
        assert mlp["class"] == (
            "strata.platforms.cpu.layers.CpuGluMLP"
            if impl == "default"
            else "strata.hw_agnostic.layers.mlp.GluMLP"
        )
        # The CPU platform runs a SiLU or tanh-GELU MLP as one op where the CPU has the panels for it.
        fused = {f"forward_cpu (strata_cpu::linear_glu, {act})" for act in ("silu", "gelu_tanh")}
        assert mlp["forward"] in ({"forward_cpu"} | fused if impl == "default" else {"forward_native"})
        act = by_path["model.layers.0.mlp.act_fn"]
        assert act["forward"] == ("forward_cpu" if impl == "default" else "forward_native")
        assert act["class"].startswith(
            "strata.hw_agnostic.layers." if impl == "hw-agnostic" else "strata.platforms.cpu.layers."
        )
        assert by_path["model.layers.0.self_attn"]["class"] == (
            "strata.platforms.cpu.attention.CpuAttentionBackend"
            if impl == "default"
            else "strata.attention.backends.torch_native.TorchNativeBackend"
        )


def test_two_engines_keep_their_own_providers(bundled_model_dir: Path) -> None:
    hw = LLM(str(bundled_model_dir), max_model_len=32, max_num_seqs=1, layer_impl="hw-agnostic")
    default = LLM(
        str(bundled_model_dir), max_model_len=32, max_num_seqs=1, layer_impl="default", custom_ops=["none"]
    )
    assert {row["provider"] for row in hw.layer_providers() if row["op"] == "rms_norm"} == {"hw-agnostic"}
    default_rows = default.layer_providers()
    # custom_ops="none" keeps every op on its reference.
    assert {row["provider"] for row in default_rows if row["op"] == "rms_norm"} == {"hw-agnostic"}
    assert {row["forward"] for row in default_rows if row["op"] != "attention"} == {"forward_native"}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert hw.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text == (
        default.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text
    )
    with pytest.raises(ValueError, match="layer_impl"):
        LLM(str(bundled_model_dir), layer_impl="fastest")


def test_env_default_and_start_log(
    bundled_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata")
    monkeypatch.setenv("STRATA_USE_HW_AGNOSTIC", "1")
    llm = LLM(str(bundled_model_dir), max_model_len=32, max_num_seqs=1)
    assert llm.engine.config.layer_config.layer_impl == "hw-agnostic"
    assert {row["provider"] for row in llm.layer_providers()} == {"hw-agnostic"}  # attention included
    assert (
        "layers (layer_impl=hw-agnostic, platform cpu): 52 layers; by provider: hw-agnostic 52; "
        "by op: glu_mlp 5, linear 31, rms_norm 11, silu_and_mul 5" in caplog.messages
    )
    explicit = LLM(str(bundled_model_dir), max_model_len=32, max_num_seqs=1, layer_impl="default")
    assert {row["provider"] for row in explicit.layer_providers()} == {"cpu"}
